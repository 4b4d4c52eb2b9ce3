"""``uplink``: real nodes behind home links (20 Mbit/s up, 100 Mbit/s down), int8 against the sparse modes, one run.

Each node runs in its own network namespace of a star (tests/natlib.py ``star_topology``): ``tc tbf`` caps every
peer's upload at ``up`` and its download at ``down``. The same nodes and flags train once per ``--compression``,
one after the other in the same run of this benchmark: the seconds of a round's all-reduce (``allreduce_s`` of the
``outer_step`` records: once its group formed; and ``averaging_s``, matchmaking and verification included), past
each node's first round, the bytes each node sent per round, tokens per wall second and the share of wall
time spent in inner steps over the steady window (``bench.nodes``). Overlapped rounds hide a round up to a phase;
past that the next hand-off waits, which the tokens per second show. Without ``ip netns`` the nodes run on
127.0.0.1 with no limit, and the report says so.

Then the same links carry pseudo-gradients shaped like a larger model's (``shapes``: ``base``, ~100M parameters, where
a node would not fit this machine four times): one averager per namespace (:mod:`bench.swarm`, no training, a
random Δ per peer that the sparse codecs select from), ``shape_rounds`` rounds per codec, one codec after the other,
once per group size of ``shape_peers`` (``full``: 4 peers, then 2: on a 2-core machine, the second is a core per
peer by count, as peers on their own machines would have; nothing is pinned).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

from bench.common import f, human_bytes, md_table, mean, median, ratio
from bench.nodes import NodeSpec, run_nodes, scratch, steady_window, window_figures

SIZES = {
    "smoke": {"peers": 2, "model": "tiny", "H": 2, "seq_len": 32, "batch": 2, "outer_steps": 3, "up": "20mbit",
              "down": "100mbit", "modes": ["int8", "sparse1-int8"], "max_bytes": 200_000, "timeout": 300,
              "shapes": "tiny", "shape_rounds": 1, "shape_peers": [2]},
    "quick": {"peers": 3, "model": "tiny", "H": 5, "seq_len": 64, "batch": 4, "outer_steps": 4, "up": "20mbit",
              "down": "100mbit", "modes": ["int8", "sparse1-int8"], "max_bytes": 1_000_000, "timeout": 600,
              "shapes": "small", "shape_rounds": 2, "shape_peers": [3]},
    "full": {"peers": 4, "model": "small", "H": 5, "seq_len": 64, "batch": 4, "outer_steps": 6, "up": "20mbit",
             "down": "100mbit", "modes": ["int8", "sparse1-int8", "sparse2-int8"], "max_bytes": 4_000_000,
             "timeout": 1500, "shapes": "base", "shape_rounds": 2, "shape_peers": [4, 2]},
}
MATCHMAKING_S = 2.0
AVERAGING_WINDOW_S = 120.0  # an int8 round of `small` at 20 Mbit/s takes seconds: room for it
SHAPED_ROUND_S = 600.0  # an int8 round of `base`'s 100M values at 20 Mbit/s up takes about a minute


@contextlib.contextmanager
def _placements(cfg, ok: bool, n_peers: int | None = None):
    from tests.natlib import star_topology

    n_peers = n_peers or cfg["peers"]
    if not ok:
        yield [([], "127.0.0.1")] * n_peers
        return
    with star_topology(n_peers, cfg["down"], subnet="10.124.0", up_rate=cfg["up"]) as peers:
        yield [(["ip", "netns", "exec", ns], addr) for ns, addr in peers]


def run(size: str) -> dict[str, Any]:
    from diloco_swarm.models import build_model, num_parameters
    from tests.natlib import netns_check, tc_qdisc_kinds

    cfg = SIZES[size]
    ok, why = netns_check()
    if ok and not tc_qdisc_kinds()["tbf"]:
        ok, why = False, "tc tbf is not available in this kernel"
    runs = []
    for mode in cfg["modes"]:
        tag = f"{mode}-{int(time.time())}"
        args = ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
                "--batch-size", str(cfg["batch"]), "--compression", mode, "--matchmaking-time", str(MATCHMAKING_S),
                "--averaging-window", str(AVERAGING_WINDOW_S), "--max-dataset-bytes", str(cfg["max_bytes"]),
                "--device", "cpu", "--threads", "1", "--max-outer-steps", str(cfg["outer_steps"]),
                "--wait-for-peers", str(cfg["peers"])]
        with scratch("uplink", tag) as workdir, _placements(cfg, ok) as placements:
            nodes = run_nodes([NodeSpec(f"peer-{i}", f"bench-uplink-{tag}", args, wrap, host)
                               for i, (wrap, host) in enumerate(placements)], workdir, cfg["timeout"])
            peers = []
            for r in nodes:
                steps = r.records("outer_step")
                peers.append({**window_figures(r, steady_window(r.records(), cfg["peers"], last=-1)),
                              "bytes_sent": [e.get("bytes_sent") for e in steps],
                              "allreduce_s": [e.get("allreduce_s") for e in steps],
                              "bytes_received": [e.get("bytes_received") for e in steps]})
        runs.append({"compression": mode, "peers": peers})
    return {"config": cfg, "netns": ok, "netns_reason": why, "matchmaking_time": MATCHMAKING_S,
            "params": num_parameters(build_model(cfg["model"], seed=0)), "runs": runs, "shaped": _shaped(cfg, ok)}


def _shaped(cfg: dict[str, Any], ok: bool) -> dict[str, Any]:
    """Averagers alone behind the same links, Δs shaped like ``cfg["shapes"]``: :mod:`bench.swarm`'s records, once
    per group size of ``cfg["shape_peers"]``."""
    import torch

    from bench.swarm import run_swarm
    from diloco_swarm.models import build_model

    with torch.device("meta"):  # the shapes only: no 400 MB of weights for `base`
        shapes = [list(t.shape) for t in build_model(cfg["shapes"], seed=0).parameters()]
    jobs = [{"compression": mode, "shapes": shapes, "rounds": cfg["shape_rounds"]} for mode in cfg["modes"]]
    groups = []
    for n in cfg["shape_peers"]:
        spec = {"n_peers": n, "jobs": jobs, "prefix": f"uplink-shaped-{n}-{int(time.time())}",
                "matchmaking_time": MATCHMAKING_S, "round_timeout": SHAPED_ROUND_S, "allreduce_timeout": SHAPED_ROUND_S,
                "next_chunk_timeout": SHAPED_ROUND_S / 2}
        with _placements(cfg, ok, n) as placements:
            if ok:
                spec["placements"] = [[wrap[-1], host] for wrap, host in placements]
            records = run_swarm(spec, timeout=len(jobs) * cfg["shape_rounds"] * 2 * SHAPED_ROUND_S)
        groups.append({"peers": n, "records": records})
    return {"preset": cfg["shapes"], "params": sum(math.prod(s) for s in shapes), "groups": groups}


def _round_s(run: dict[str, Any], key: str = "allreduce_s") -> float | None:
    """Median seconds (``key`` of the records) of a round with a group, past each node's first (start-up and the
    first matchmaking aside)."""
    return median(s for p in run["peers"] for s, g in zip(p[key][1:], p["group_sizes"][1:]) if s and g and g > 1)


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, rows = result["config"], []
    base = next((r for r in result["runs"] if r["compression"] == "int8"), None)
    for r in result["runs"]:
        peers = r["peers"]
        sent = mean(b for p in peers for b in p["bytes_sent"][1:] if b)
        rows.append([r["compression"], f"{sum(p['rounds_ok'] for p in peers)}/{sum(p['outer_steps'] for p in peers)}",
                     human_bytes(sent or 0), f((sent or 0) / result["params"], ".4f"), f(_round_s(r), ".2f"),
                     f(ratio(_round_s(base), _round_s(r)) if base else None, ".1f", "×"),
                     f(_round_s(r, "averaging_s"), ".1f"),
                     f(mean(p.get("tokens_per_s") for p in peers), ",.0f"),
                     f(ratio(mean(p.get("tokens_per_s") for p in peers), mean(p.get("tokens_per_s") for p in base["peers"]))
                       if base else None, ".2f", "×"),
                     f(mean(p.get("utilization") for p in peers), ".1%"),
                     ", ".join(str(p["exit_code"]) for p in peers)])
    link = (f"each node's link capped by `tc tbf` at {cfg['up']} up and {cfg['down']} down" if result["netns"] else
            f"**127.0.0.1, no link limit: network namespaces were refused here ({result['netns_reason']})**")
    return "\n".join([
        f"Model `{cfg['model']}` ({result['params']:,} parameters), {cfg['peers']} nodes, {link}; H = {cfg['H']}, "
        f"seq_len {cfg['seq_len']}, batch {cfg['batch']}, {cfg['outer_steps']} outer steps, overlapped rounds; one "
        "run after the other with the same flags but `--compression`.\n",
        md_table(["codec", "verified rounds", "sent per node per round", "up B/param", "all-reduce s (median)",
                  "int8 all-reduce ÷ this", "round s with matchmaking (median)", "tokens/s per node (steady)", "÷ int8", "utilization (steady)", "exit codes"],
                 rows),
        *_render_shaped(result)])


def _render_shaped(result: dict[str, Any]) -> list[str]:
    shaped = result.get("shaped")
    if not shaped:
        return []
    cfg, params, rows = result["config"], shaped["params"], []
    # (a result from before `shape_peers` holds one group's records)
    for group in shaped.get("groups") or [{"peers": cfg["peers"], "records": shaped["records"]}]:
        by_mode = {mode: [r for r in group["records"] if r["job"] == j] for j, mode in enumerate(cfg["modes"])}

        def allreduce_s(mode):
            return median(r["allreduce_s"] for r in by_mode[mode] if r["ok"] and r["allreduce_s"])

        for mode, recs in by_mode.items():
            ok = [r for r in recs if r["ok"]]
            sent = mean(r["bytes_sent"] for r in ok)
            rows.append([str(group["peers"]), mode,
                         f"{len({r['round'] for r in ok if all(x['ok'] for x in recs if x['round'] == r['round'])})}"
                         f"/{len({r['round'] for r in recs})}",
                         human_bytes(sent or 0), f((sent or 0) / params, ".4f"), f(allreduce_s(mode), ".1f"),
                         f(ratio(allreduce_s("int8"), allreduce_s(mode)), ".1f", "×"),
                         f(median(r["total_s"] for r in ok), ".1f")])
    where = "behind the same links" if result["netns"] else "on 127.0.0.1 with no link limit"
    cores = result.get("provenance", {}).get("cpus_usable", "the")
    return ["", f"Averagers alone {where}, a random Δ shaped like `{shaped['preset']}` ({params:,} values) per peer, "
            f"{cfg['shape_rounds']} round{'s' if cfg['shape_rounds'] != 1 else ''} per codec; the peers (each with its "
            f"own p2pd) share the {cores} CPU cores of the machine that ran it:\n",
            md_table(["peers", "codec", "verified rounds", "sent per peer per round", "up B/param",
                      "all-reduce s (median)", "int8 all-reduce ÷ this", "round s with matchmaking (median)"], rows)]


if __name__ == "__main__":
    from bench.cli import main

    raise SystemExit(main(name="uplink"))
