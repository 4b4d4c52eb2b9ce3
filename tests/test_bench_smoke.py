"""Smoke test of the benchmarks: each one runs at toy size and renders its report section.

Benchmarks are not tests: nothing here checks a time or a ratio, only that every benchmark runs
end to end and writes its JSON, its markdown section and its plot. Everything goes to tmp_path;
docs/benchmarks.md and bench/out/ are never touched.
"""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from bench import NAMES  # bench/ is importable through pytest's pythonpath (pyproject.toml)
from bench.cli import main


@pytest.mark.swarm
@pytest.mark.timeout(1200)  # every benchmark at toy size, several start real nodes (~6-10 min on 2 busy cores)
def test_every_benchmark_runs_at_toy_size(tmp_path):
    out, doc = tmp_path / "out", tmp_path / "docs" / "benchmarks.md"
    rc = main(["all", "--size", "smoke", "--out-dir", str(out), "--doc", str(doc)])
    assert rc == 0
    text = doc.read_text()
    for name in NAMES:
        result = json.loads((out / f"{name}.smoke.json").read_text())
        assert result["name"] == name and result["size"] == "smoke"
        assert result["provenance"]["command"].startswith("python -m bench all")
        assert f"<!-- bench:{name} size=smoke -->" in text
    wire = json.loads((out / "wire.smoke.json").read_text())
    # one failed round is allowed: the rare partial round (docs/architecture.md, Known limits)
    assert sum(r["rounds"] - r["rounds_ok"] for r in wire["rows"]) <= 1, wire["rows"]
    assert (doc.parent / "bench-quality.png").stat().st_size > 0
    assert "### With churn" in text and "TODO" not in text
    churn = json.loads((out / "netns.smoke.json").read_text())["churn"]["runs"]["churn"]
    done = [(a["action"], a["peer"]) for a in churn["actions"]]
    assert ("kill", "p1") in done or ("kill", "p0") in done, f"the churn schedule killed nobody: {done}"
    assert any(a == "restart" for a, _ in done), f"the killed node was not restarted: {done}"
    overlap = json.loads((out / "overlap.smoke.json").read_text())
    for mode, run in overlap["modes"].items():
        assert [p["exit_code"] for p in run["peers"]] == [0, 0], (mode, [p["log_tail"] for p in run["peers"]])
    # the pair averaged (both modes); each node of the alone run never met anybody
    for mode in ("overlap", "blocking"):
        assert all(2 in p["group_sizes"] for p in overlap["modes"][mode]["peers"]), overlap["modes"][mode]
    assert all(set(p["group_sizes"]) == {1} for p in overlap["modes"]["alone"]["peers"])
    assert "overlap ÷ alone" in text and "lone-peer ratio" in text
    speeds = json.loads((out / "speeds.smoke.json").read_text())
    for run in speeds["variants"].values():
        assert [p["exit_code"] for p in run["peers"]] == [0, 0, 0], [p["log_tail"] for p in run["peers"]]
        assert all(3 in p["group_sizes"] for p in run["peers"]), run  # the three peers met at least once
    assert [p["slow"] for p in speeds["variants"]["mixed"]["peers"]] == [False, False, True]
    assert "The slow peer joined" in text
    _check_scale(json.loads((out / "scale.smoke.json").read_text()), text)


@pytest.mark.timeout(180)
def test_the_sparse_benchmark_runs_at_toy_size_and_every_sparse_mode_uploads_less_than_int8(tmp_path):
    out = tmp_path / "out"
    assert main(["--size", "smoke", "--out-dir", str(out), "--no-doc"], name="sparse") == 0
    result = json.loads((out / "sparse.smoke.json").read_text())
    upload = {r["variant"]: r["upload_B_per_param"] for r in result["runs"]
              if (r["lr"], r["momentum"]) == (0.7, 0.9) and not r["hostile"]}
    assert set(upload) == {"int8", "sparse1-int8", "sparse1-int8-cut", "sparse2-int8", "sparse2-int8-cut"}
    assert all(upload[v] < upload["int8"] / 5 for v in upload if v != "int8"), upload
    assert {c["mode"] for c in result["codec"]} == {"sparse1-int8", "sparse2-int8"}
    # the hostile runs: one per rule, each against the same mode's honest peers alone at its outer step
    from bench.sparse import summarize_hostile
    attacked = summarize_hostile(result)
    assert {(r["variant"], r["rule"]) for r in attacked} == {("sparse1-int8", "mean"), ("sparse1-int8", "skipped-mean")}
    assert all(r["alone"] is not None and math.isfinite(r["final_loss"]) for r in attacked), attacked


@pytest.mark.timeout(60)
def test_report_keeps_full_sections_and_untouched_ones(tmp_path):
    from bench.common import provenance, save_result
    from bench.report import update_doc

    out, doc = tmp_path / "out", tmp_path / "benchmarks.md"
    doc.write_text("stale intro\n<!-- bench:codec size=full -->\n## codec\nFULL FIGURES\n<!-- /bench:codec -->\n"
                   "<!-- bench:wire size=full -->\n## wire\nWIRE FIGURES\n<!-- /bench:wire -->\n"
                   "<!-- bench:other size=full -->\n## other\nOTHER FIGURES\n<!-- /bench:other -->\n")
    row = {"codec": "fp16", "values": 10, "note": "", "repeats": 1, "encode_wall_s": [1.0], "decode_wall_s": [1.0],
           "encode_cpu_s": [1.0], "decode_cpu_s": [1.0], "encode_gbps_cpu": 1.0, "decode_gbps_cpu": 1.0,
           "roundtrip_gbps_cpu": 0.5, "roundtrip_gbps_wall": 0.5, "bytes_per_value": 2.0,
           "rel_err_gaussian": 1e-4, "rel_err_mixed_scale": 1e-4}
    save_result(out, "codec", "quick", {"name": "codec", "size": "quick", "elapsed_s": 1.0, "loadavg_end": None,
                                        "provenance": provenance("python -m bench codec --quick"),
                                        "torch_threads": 1, "rows": [row]})
    assert update_doc(doc, out)[1] == []
    text = doc.read_text()
    assert "FULL FIGURES" in text and "WIRE FIGURES" in text  # a quick result never replaces a full section
    assert "python -m bench all" in text and "stale intro" not in text  # the intro is regenerated
    save_result(out, "codec", "full", {"name": "codec", "size": "full", "elapsed_s": 1.0, "loadavg_end": None,
                                       "provenance": provenance("python -m bench codec"), "torch_threads": 1,
                                       "rows": [row]})
    assert update_doc(doc, out)[1] == []
    text = doc.read_text()
    assert "FULL FIGURES" not in text and "| fp16 |" in text and "WIRE FIGURES" in text
    assert "OTHER FIGURES" in text  # another benchmark's marked section survives


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_idle_benchmark_runs_at_toy_size(tmp_path):
    from bench.common import provenance
    from bench.idle import VARIANTS, run
    from bench.report import section

    result = {"name": "idle", "size": "smoke", **run("smoke")}
    assert [t["variant"] for t in result["trials"]] == list(VARIANTS)
    for t in result["trials"]:  # the whole process tree was measured: node, DHT, averager, p2pd
        assert len(t["per_process"]) >= 4 and any(name.startswith("p2pd") for name in t["per_process"]), t
    result.update(elapsed_s=1.0, loadavg_end=None, provenance=provenance("python -m bench.idle"))
    text = section("idle", result, tmp_path / "idle.smoke.json", tmp_path)
    assert "<!-- bench:idle size=smoke -->" in text and "| stock |" in text and "| paced |" in text


@pytest.mark.timeout(60)
def test_a_standalone_benchmark_writes_its_json_and_its_doc_section(tmp_path, monkeypatch, capsys):
    """``python -m bench.NAME`` is ``bench.cli.main(name=NAME)``: the JSON, the figures printed, the doc section."""
    toy = types.ModuleType("bench.toy")
    toy.run = lambda size: {"answer": 42 if size == "quick" else 0}
    toy.render = lambda result, docs_dir: f"{result['answer']} is the answer"
    monkeypatch.setitem(sys.modules, "bench.toy", toy)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Toy\n\nWhat the toy measures.\n")
    assert main(["--quick", "--out-dir", str(tmp_path), "--doc", str(doc)], name="toy") == 0
    data = json.loads((tmp_path / "toy.quick.json").read_text())
    assert data["answer"] == 42 and data["size"] == "quick" and data["elapsed_s"] >= 0
    assert data["provenance"]["command"].startswith("python -m bench.toy --quick")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n") and "What the toy measures." in text  # the hand-written text is kept
    assert "<!-- bench:toy size=quick -->" in text and "42 is the answer" in text
    assert "42 is the answer" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_simscale_runs_on_the_nodes_grouping_rule(tmp_path):
    from bench.common import provenance
    from bench.report import section
    from bench.simscale import simulate

    one = simulate(32, 64, rounds=6, seed=1)  # fits under the cap: one group, one lineage every round
    assert all(r["groups"] == 1 and r["lineages"] == 1 and r["theta_spread_participants"] < 1e-12
               for r in one["per_round"])
    grid = simulate(256, 16, rounds=6, seed=1, settle_rounds=3)
    training, settle = grid["per_round"][:6], grid["per_round"][6:]
    spreads = [training[-1]["theta_spread"]] + [r["theta_spread"] for r in settle]
    # without new Δ the grid's mixing shrinks the spread every round; a full 16 × 16 grid averages exactly in 2
    assert all(b < a for a, b in zip(spreads, spreads[1:3])) and spreads[-1] < 0.01 * spreads[0], spreads
    for r in training:
        # the grid places every online peer (late ones too): 16² = 256 peers fit on 2 dimensions
        assert r["grid_dims"] == (2 if r["online"] <= 256 else 3)
        assert r["groups"] >= r["expected"] / 17 and 0 < r["expected"] <= r["online"]
        assert r["avg_bytes_per_peer"] > 0
    result = {"size": "smoke", "runs": [one, grid], "quorum": 0.5, "grace_s": 120.0, "inner_s": 600.0,
              "speed_sigma": 0.5, "params": 1e8, "provenance": provenance("python -m bench.simscale")}
    assert "<!-- /bench:simscale -->" in section("simscale", result, tmp_path / "x.json", tmp_path)


@pytest.mark.timeout(300)
def test_eager_benchmark_runs_at_toy_size(tmp_path):
    from bench.common import provenance
    from bench.eager import run
    from bench.quality import ESTIMATES
    from bench.report import section

    result = {"name": "eager", "size": "smoke", **run("smoke")}
    assert list(result["final_loss"]) == ["blocking", *ESTIMATES]
    assert all(loss == loss and loss > 0 for loss in result["final_loss"].values())  # finite losses, no NaN
    result.update(elapsed_s=1.0, loadavg_end=None, provenance=provenance("python -m bench.eager"))
    text = section("eager", result, tmp_path / "eager.smoke.json", tmp_path)
    assert "<!-- bench:eager size=smoke -->" in text and "| fit |" in text and "| own |" in text and "| none |" in text


@pytest.mark.timeout(300)
def test_staleness_benchmark_runs_at_toy_size(tmp_path):
    from bench.common import provenance
    from bench.eager import SEEDS
    from bench.report import section
    from bench.staleness import LATE, OUTER_STEPS, VARIANTS, run

    result = {"name": "staleness", "size": "smoke", **run("smoke")}
    assert list(result["curves_by_seed"]) == [str(s) for s in SEEDS]
    for curves in result["curves_by_seed"].values():
        assert list(curves) == list(VARIANTS)
        # a held-out loss at the start and after every outer step; the first round is the same in both modes
        assert all(len(c) == OUTER_STEPS["smoke"] + 1 and all(x == x and x > 0 for x in c) for c in curves.values())
        assert all(curves["blocking"][1] == curves[v][1] for v in LATE)
    result.update(elapsed_s=1.0, loadavg_end=None, provenance=provenance("python -m bench.staleness"))
    text = section("staleness", result, tmp_path / "staleness.smoke.json", tmp_path)
    assert "<!-- bench:staleness size=smoke -->" in text and "after outer step 3" in text and "Mean over 3 seeds" in text
    assert all(f"| {v} |" in text for v in LATE)


def _check_scale(result: dict, text: str) -> None:
    """What `bench scale` at toy size must show: each configuration ran every peer to the end, with
    rounds, a lineage count at every outer step and a final loss per peer."""
    from bench.scale import CONFIGS, SIZES

    steps, peers = SIZES["smoke"]["outer_steps"], SIZES["smoke"]["peers"]
    assert list(result["configs"]) == list(CONFIGS)
    for label, c in result["configs"].items():
        assert "error" not in c, (label, c["error"])
        assert [p["exit_code"] for p in c["peers"]] == [0] * peers, (label, [p["log_tail"] for p in c["peers"]])
        assert c["rounds"] >= 1 and sum(c["group_size_hist"].values()) == c["rounds"], (label, c)
        # a lineage count at every outer step, among the peers that held a θ there
        assert [s for s, _, _ in c["lineages"]] == list(range(1, steps + 1)), (label, c["lineages"])
        assert all(1 <= n <= held <= peers for _, held, n in c["lineages"]), (label, c["lineages"])
        assert all(loss is not None and loss > 0 for loss in c["final_eval_loss"]), (label, c["final_eval_loss"])
        assert c["averaging_bytes_received"] > 0 and c["resync_share"] is not None
    assert result["configs"]["default"]["loss_vs_default"] == 1.0
    assert result["configs"]["default"]["loss_vs_default_equal_tokens"] == pytest.approx(1.0)
    assert "<!-- bench:scale size=smoke -->" in text and "lineages per outer step" in text


def test_scale_compares_at_equal_tokens_along_the_default_curve():
    from bench.scale import loss_at_tokens

    curve = [[1, 100, 3.0], [2, 200, 2.5], [3, 400, 2.2]]
    assert loss_at_tokens(curve, 200) == 2.5 and loss_at_tokens(curve, 400) == 2.2
    assert loss_at_tokens(curve, 100 * 2 ** 0.5) == pytest.approx(2.75)  # halfway in log(tokens)
    assert loss_at_tokens(curve, 401) is None and loss_at_tokens(curve, 99) is None  # no extrapolation
    assert loss_at_tokens([], 100) is None and loss_at_tokens([[3, 50, 4.0]], 50) == 4.0


def test_scale_counts_lineages_syncs_and_rounds_from_records():
    from bench.scale import analyse, split_windows

    def step(s, digest, group, ok=True, loss=None):  # a round's hand-off, then its record
        return [{"event": "averaging_start", "outer_step": s - 1},
                {"event": "outer_step", "outer_step": s, "group": group, "group_size": len(group), "round_ok": ok,
                 "theta_digest": digest, "synced_to": None, "bytes_received": 100, "bytes_sent": 100,
                 "eval_loss": loss, "eval_outer_step": s if loss else 0}]

    pair, trio = ["a", "b"], ["a", "b", "c"]
    a = [{"event": "start", "peer_id": "a"}, *step(1, "aa" * 8, pair), *step(2, "ab" * 8, pair), *step(3, "ac" * 8, trio, loss=2.0)]
    b = [{"event": "start", "peer_id": "b"}, *step(1, "aa" * 8, pair), *step(2, "ab" * 8, pair), *step(3, "ac" * 8, trio, loss=2.2)]
    sync = {"event": "state_sync", "reason": "diverged", "outer_step": 2, "from_outer_step": 2, "bytes": 30,
            "theta_digest": "ab" * 8}
    # c: a solo round at step 1, then its failed round of step 2 re-synced it to the pair's θ
    c = [{"event": "start", "peer_id": "c"}, *step(1, "bb" * 8, ["c"], ok=False), *step(2, "cc" * 8, ["c", "d"], ok=False),
         *step(3, "ac" * 8, trio, loss=2.0)]
    c.insert(c.index(step(2, "cc" * 8, ["c", "d"], ok=False)[1]), sync)
    got = analyse([a, b, c])
    assert got["lineages"] == [[1, 3, 2], [2, 3, 1], [3, 3, 1]] and got["longest_split"] == 1
    assert got["split_windows"] == []  # steps 1-3: the verified rounds connect a, b and c (at step 3)
    pair_only = [(1, ("a", "b")), (2, ("a", "b")), (3, ("a", "b")), (4, ("a", "b", "c"))]
    assert split_windows(pair_only, ["a", "b", "c"]) == [[1, 2]]  # c alone for steps 1-3; 2-4 connect
    assert got["rounds"] == 4 and got["rounds_ok"] == 3 and got["group_size_hist"] == {"2": 3, "3": 1}
    assert got["solo_rounds"] == 1 and got["sync_bytes"]["diverged"] == 30 and got["sync_count"]["join"] == 0
    assert got["resync_share"] == 30 / 900 and got["final_eval_loss"] == [2.0, 2.2, 2.0]
    assert abs(got["loss_spread"] - 0.1) < 1e-12
    assert got["loss_curve"] == [[3, 0, pytest.approx(6.2 / 3)]]  # only the last step was evaluated by all


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_memory_benchmark_runs_at_toy_size(tmp_path):
    """``python -m bench.memory``: two tiny nodes, the joiner's download, PSS sampled per process."""
    from bench.common import provenance
    from bench.memory import run
    from bench.report import section

    result = {"name": "memory", "size": "smoke", **run("smoke", base=None), "provenance": provenance("test")}
    nodes = result["models"]["tiny"]["now"]
    assert [n["exit_code"] for n in nodes] == [0, 0], [n.get("log_tail") for n in nodes]
    assert all(n["peak_pss"] > 0 and n["params"] and n["samples"] for n in nodes)
    assert {"main", "p2pd"} <= set(nodes[0]["peak_pss_by_role"])
    assert "| tiny | now n0 |" in section("memory", result, tmp_path / "memory.smoke.json", tmp_path)
