"""``netns``: compute utilization of real nodes behind a 100 Mbit/s link, and the same nodes under churn.

Each node runs in its own network namespace of a star (tests/natlib.py); with the limit on, ``tc tbf`` caps both
directions of every peer's link. Utilization = inner-step seconds / wall seconds from the nodes' own records:
*steady* from the first round verified with the whole group to the last, *overall* since the start. Then the same
nodes train for a fixed window, calm and under ``bench/churn.py``'s seeded kill/restart schedule. Without
``ip netns`` the nodes run on 127.0.0.1 with no limit, and the report says so.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import churn
from bench.common import REPO, exits_md, f, human_bytes, md_table, mean, ratio
from bench.nodes import NodeSpec, run_nodes, scratch, steady_window, window_figures

# churn: a window of `duration` s for each of `labels`, at the cadence `schedule` (over churn.SCHEDULE): the full
# size's kills are spaced to its outer step (~40-60 s on the shared 2-core machine)
SIZES = {
    "smoke": {"peers": 2, "model": "tiny", "H": 2, "seq_len": 32, "batch": 2, "outer_steps": 2,
              "runs": [("100mbit", "100mbit", "fp16")], "max_bytes": 200_000, "timeout": 240, "probe_bytes": 1 << 20,
              "churn": {"rate": "100mbit", "compression": "fp16", "duration": 22.0, "labels": ("churn",),
                        "schedule": {"every": 7.0, "jitter": 0.0, "down": 3.0, "down_jitter": 0.0, "tail": 8.0},
                        "start_timeout": 180.0}},
    "quick": {"peers": 4, "model": "tiny", "H": 10, "seq_len": 64, "batch": 4, "outer_steps": 3,
              "runs": [("no limit", None, "int8"), ("100mbit", "100mbit", "int8")], "max_bytes": 1_000_000,
              "timeout": 400, "probe_bytes": 8 << 20,
              "churn": {"rate": "100mbit", "compression": "int8", "duration": 75.0, "labels": ("calm", "churn"),
                        "schedule": {}, "start_timeout": 300.0, "keep_logs": True}},
    "full": {"peers": 4, "model": "small", "H": 5, "seq_len": 64, "batch": 4, "outer_steps": 4,
             "runs": [("no limit", None, "int8"), ("100mbit", "100mbit", "int8"), ("100mbit", "100mbit", "fp32")],
             "max_bytes": 4_000_000, "timeout": 900, "probe_bytes": 8 << 20,
             "churn": {"rate": "100mbit", "compression": "int8", "duration": 360.0, "labels": ("calm", "churn"),
                       "schedule": {"every": 70.0, "jitter": 15.0, "down": 20.0, "down_jitter": 4.0, "tail": 40.0},
                       "start_timeout": 600.0, "keep_logs": True}},
}
MATCHMAKING_S = 2.0
AVERAGING_WINDOW_S = 60.0
# hivemind's Python-side DEBUG lines (failed pings, matchmaking) in the churn runs' node logs; p2pd stays quiet
CHURN_NODE_ENV = {"HIVEMIND_LOGLEVEL": "DEBUG", "GOLOG_LOG_LEVEL": "error"}


def _node_args(cfg, compression: str) -> list[str]:
    """The training and averaging flags every node of a size gets (host, ports, state and run id apart)."""
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", compression,
            "--matchmaking-time", str(MATCHMAKING_S), "--averaging-window", str(AVERAGING_WINDOW_S),
            "--target-group-size", str(cfg["peers"]), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--device", "cpu", "--threads", "1"]


@contextlib.contextmanager
def _placements(cfg, ok: bool, rate: str | None, probe: bool = False):
    """(placements [(command prefix, host)] of the peers, their link counters or None, the link probe or None)."""
    from tests.natlib import star_link_bytes, star_topology

    if not ok:
        yield [([], "127.0.0.1")] * cfg["peers"], None, None
        return
    with star_topology(cfg["peers"], rate) as peers:
        yield ([(["ip", "netns", "exec", ns], addr) for ns, addr in peers], lambda: star_link_bytes(peers),
               _probe_link(peers, cfg["probe_bytes"]) if probe else None)


def _probe_link(peers: list[tuple[str, str]], total: int) -> dict[str, Any] | None:
    """RTT and one TCP stream's throughput from peer 1 to peer 0 through the hub (bench.netprobe)."""
    (ns0, addr0), (ns1, _) = peers[0], peers[1]
    netprobe = [sys.executable, "-m", "bench.netprobe"]
    server = subprocess.Popen(["ip", "netns", "exec", ns0, *netprobe, "serve", addr0, "5201"], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        server.stdout.readline()  # "ready"
        r = subprocess.run(["ip", "netns", "exec", ns1, *netprobe, "probe", addr0, "5201", str(total)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None
    finally:
        server.kill()
        server.wait(timeout=10)


def run(size: str) -> dict[str, Any]:
    from diloco_swarm.models import build_model, num_parameters
    from tests.natlib import netns_check, tc_qdisc_kinds

    cfg = SIZES[size]
    ok, why = netns_check()
    qdiscs = tc_qdisc_kinds() if ok else {"tbf": False, "netem": False}
    if ok and not qdiscs["tbf"]:
        raise RuntimeError("tc tbf is not available in this kernel")
    runs = []
    for label, rate, compression in cfg["runs"] if ok else [("no limit", None, cfg["runs"][0][2])]:
        tag = f"{label.replace(' ', '')}-{compression}-{int(time.time())}"
        with scratch("netns", tag) as workdir, _placements(cfg, ok, rate, probe=True) as (placements, counters, probe):
            args = [*_node_args(cfg, compression), "--max-outer-steps", str(cfg["outer_steps"]),
                    "--wait-for-peers", str(cfg["peers"])]
            before = counters() if counters else None
            nodes = run_nodes([NodeSpec(f"peer-{i}", f"bench-netns-{tag}", args, wrap, host)
                               for i, (wrap, host) in enumerate(placements)], workdir, cfg["timeout"])
            after = counters() if counters else None
            peers = []
            for r in nodes:  # (their records are read before the folder goes)
                steps = r.records("outer_step")
                peers.append({**window_figures(r, steady_window(r.records(), cfg["peers"], last=-1)),
                              "bytes_sent": [e.get("bytes_sent") for e in steps],
                              "overall_utilization": ratio(steps[-1]["inner_s"], steps[-1]["wall_s"]) if steps else None})
        link = [{"rx": a[0] - b[0], "tx": a[1] - b[1]} for a, b in zip(after, before)] if after else None
        runs.append({"label": label, "rate": rate, "compression": compression, "link_probe": probe, "peers": peers,
                     "link_bytes": link})
    return {"config": {k: v for k, v in cfg.items() if k not in ("runs", "churn")}, "netns": ok, "netns_reason": why,
            "qdiscs": qdiscs, "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
            "params": num_parameters(build_model(cfg["model"], seed=0)), "runs": runs, "churn": _run_churn(cfg, ok)}


def _run_churn(cfg, ok: bool) -> dict[str, Any]:
    """Calm vs churn for a fixed window behind the link limit, with bench.churn's schedule and runner."""
    cc = cfg["churn"]
    names, params = [f"p{i}" for i in range(cfg["peers"])], {**churn.SCHEDULE, **cc["schedule"]}
    schedule = churn.churn_schedule(churn.SEED, cc["duration"], names, **params)
    runs = {}
    for label in cc["labels"]:
        with scratch("netns-churn", label, cc.get("keep_logs")) as workdir, \
                _placements(cfg, ok, cc["rate"]) as (placements, counters, _):
            runs[label] = churn.run_once(
                label, workdir, cc["duration"], schedule if label == "churn" else None,
                node_args=_node_args(cfg, cc["compression"]), placements=dict(zip(names, placements)), names=names,
                counters=counters, start_timeout=cc["start_timeout"], env=CHURN_NODE_ENV)
    return {"rate": cc["rate"] if ok else None, "compression": cc["compression"], "duration_s": cc["duration"],
            "seed": churn.SEED, "schedule_params": params, "schedule": schedule, "runs": runs}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, rows = result["config"], []
    for r in result["runs"]:
        peers, probe = r["peers"], r.get("link_probe")
        steps = sum(p["outer_steps"] for p in peers)
        link_tx = ratio(mean(x["tx"] for x in r["link_bytes"] or []), max(1, mean(p["outer_steps"] for p in peers) or 1))
        rows.append([r["label"] if result["netns"] else "127.0.0.1 (no namespaces)", r["compression"], steps,
                     f"{sum(p['rounds_ok'] for p in peers)}/{steps}", f(mean(p.get("utilization") for p in peers), ".1%"),
                     f(mean(p["overall_utilization"] for p in peers), ".1%"),
                     f(mean(s for p in peers for s in p["averaging_s"][1:])),
                     human_bytes(mean(b for p in peers for b in p["bytes_sent"] if b) or 0),
                     human_bytes(link_tx) if link_tx else "–",
                     f"{probe['mbit_per_s']:.0f} Mbit/s, RTT {probe['rtt_ms_median']:.3f} ms" if probe else "–",
                     ", ".join(str(p["exit_code"]) for p in peers)])
    md = [f"Model `{cfg['model']}` ({result['params']:,} parameters), {cfg['peers']} nodes, H = {cfg['H']}, seq_len "
          f"{cfg['seq_len']}, batch {cfg['batch']}, {cfg['outer_steps']} outer steps; "
          + ("`tc netem` is available (no latency was added)." if result["qdiscs"].get("netem") else
             "`tc netem` is not available in this kernel: no latency or loss was added.")
          + ("" if result["netns"] else f" **Network namespaces were refused here ({result['netns_reason']}).**") + "\n",
          md_table(["link", "codec", "outer steps (all nodes)", "verified rounds", "utilization, steady",
                    "utilization, overall", "averaging s per step", "payload sent per step", "link tx per step",
                    "link probe", "exit codes"], rows)]
    reasons = [f"- {r['label']}, {r['compression']}: " + "; ".join(x[:120] for x in why[:4])
               for r in result["runs"] if (why := sorted({x for p in r["peers"] for x in p["reasons"]}))]
    md.append(("\nRounds not verified:\n\n" + "\n".join(reasons) + "\n" if reasons else "")
              + exits_md((f"{r['label']}, {r['compression']}, node {i}", p) for r in result["runs"]
                         for i, p in enumerate(r["peers"])))
    base = next((r for r in result["runs"] if r["rate"] is None), None)
    for r in result["runs"]:
        if base and r is not base and r["compression"] == base["compression"]:
            x = ratio(mean(p.get("utilization") for p in r["peers"]), mean(p.get("utilization") for p in base["peers"]))
            md.append(f"\nSteady utilization with the {r['label']} limit is **{f(x)}×** the unlimited one "
                      f"({r['compression']}, same run).\n")
    ch = result["churn"]
    runs = [ch["runs"][k] for k in ("calm", "churn") if k in ch["runs"]]
    sp = ch["schedule_params"]
    md += ["\n### With churn\n",
           f"{'`tc tbf` ' + ch['rate'] if ch['rate'] else '127.0.0.1, no link limit'}, {ch['compression']}, a window "
           f"of {ch['duration_s']:.0f} s; a kill every {sp['every']:.0f} ± {sp['jitter']:.0f} s, the node back "
           f"{sp['down']:.0f} ± {sp['down_jitter']:.0f} s later (seed {ch['seed']}).\n", churn.results_table(runs),
           "".join(f"Link tx per node in the {r['label']} window: {human_bytes(tx)} "
                   f"({8 * tx / r['measured_s'] / 1e6:.1f} Mbit/s).\n" for r in runs
                   if (tx := mean(x["tx"] for x in r.get("link_bytes_window") or []))),
           churn.syncs_md(runs) + "\n",
           "Schedule (seconds after the window starts):\n\n" + churn.schedule_md(ch["schedule"], ch["runs"].get(
               "churn", {}).get("actions", []))]
    problems = [x for r in runs for x in churn.problems_md(r)]
    if problems:
        md.append("\nWhat went wrong in these runs:\n\n" + "\n".join(problems) + "\n")
    return "\n".join(md)
