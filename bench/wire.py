"""``wire``: bytes one peer sends per outer step: int8 vs fp16 vs fp32 DiLoCo and the sparse int8 modes, measured, vs
data-parallel, analytic.

2 and 4 peers (:mod:`bench.swarm`) average a pseudo-gradient shaped like a preset's parameters; the payload is
``RoundResult.bytes_sent``; in a private network namespace the ``lo`` counters give every byte a round moved.
Data-parallel: a ring all-reduce of fp32 gradients, 2·(n−1)/n·4·P bytes per peer per step, H steps per outer step.
Upload and download per parameter are listed apart (a home link's upload is the scarce one). The sparse modes get
each peer's dense random Δ, so their codec selects the top entries itself, as it does of a node's Δ + residual, and
the members' supports are independent: the densest average an as-is reducer can return (correlated Δs overlap).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.common import f, human_bytes, human_count, md_table, median, ratio

H = 500
SPARSE = ("sparse1-int8", "sparse2-int8", "sparse1-int8-cut", "sparse2-int8-cut")  # averaging/sparse.py SPARSE_MODES
SIZES = {
    "smoke": {"presets": ["tiny"], "peers": [2], "compressions": ["int8", "fp32", "sparse1-int8"], "rounds": 1, "netns": False},
    "quick": {"presets": ["tiny"], "peers": [2, 4], "compressions": ["int8", "fp16", "fp32"], "rounds": 1, "netns": True},
    "full": {"presets": ["tiny", "small"], "peers": [2, 4, 8], "compressions": ["int8", "fp16", "fp32", *SPARSE],
             "rounds": 2, "netns": True},
}


def run(size: str) -> dict[str, Any]:
    from bench.swarm import run_swarm, run_swarm_subprocess
    from diloco_swarm.models import build_model
    from tests.natlib import netns_check, private_netns

    cfg = SIZES[size]
    shapes = {p: [list(t.shape) for t in build_model(p, seed=0).parameters()] for p in cfg["presets"]}
    use_netns, why_not = netns_check() if cfg["netns"] else (False, "disabled at this size")
    jobs = [{"preset": p, "compression": c, "shapes": shapes[p], "rounds": cfg["rounds"]}
            for p in cfg["presets"] for c in cfg["compressions"]]
    rows = []
    for n in cfg["peers"]:
        spec = {"n_peers": n, "jobs": jobs, "prefix": f"wire{n}", "matchmaking_time": 2.0}
        if use_netns:
            with private_netns(f"w{n}") as ns:
                records = run_swarm_subprocess(spec, ["ip", "netns", "exec", ns])
        else:
            records = run_swarm(spec)
        for j, job in enumerate(jobs):
            recs = [r for r in records if r["job"] == j]
            ok = [r for r in recs if r["ok"]]
            lo = [r["lo_tx_bytes_all_peers"] / n for r in recs if "lo_tx_bytes_all_peers" in r]
            P = sum(math.prod(s) for s in job["shapes"])
            mean_sent = sum(r["bytes_sent"] for r in ok) / len(ok) if ok else None  # = the group's total / n
            rounds = {r["round"] for r in recs}
            rows.append({
                "preset": job["preset"], "params": P, "n_peers": n, "compression": job["compression"],
                "rounds": len(rounds), "rounds_ok": sum(all(r["ok"] for r in recs if r["round"] == x) for x in rounds),
                "mean_sent": mean_sent, "max_sent": max((r["bytes_sent"] for r in ok), default=None),
                "mean_received": sum(r["bytes_received"] for r in ok) / len(ok) if ok else None,
                "up_per_param": mean_sent and mean_sent / P,
                "down_per_param": ok and sum(r["bytes_received"] for r in ok) / len(ok) / P or None,
                "bytes_per_value": mean_sent and mean_sent / (2 * (n - 1) / n * P),
                "onwire_tx_per_peer": median(lo) if lo and use_netns else None,
                "rel_err_vs_true_mean": median(r["rel_err_vs_true_mean"] for r in ok),
                "dp_ring_bytes_per_outer_step": 2 * (n - 1) / n * 4 * P * H,
                "records": recs,
            })
    by = {(r["preset"], r["n_peers"], r["compression"]): r for r in rows}
    for r in rows:
        r["fp32_over_this"] = ratio((by.get((r["preset"], r["n_peers"], "fp32")) or {}).get("mean_sent"), r["mean_sent"])
        r["dp_over_this"] = ratio(r["dp_ring_bytes_per_outer_step"], r["mean_sent"])
        r["dp_over_this_onwire"] = ratio(r["dp_ring_bytes_per_outer_step"], r["onwire_tx_per_peer"])
    return {"H": H, "netns": use_netns, "netns_reason": why_not, "rows": rows}


def _x(v) -> str:
    return "–" if v is None else f"{v:,.0f}×" if v >= 100 else f"{v:.2f}×"


def _span(values, spec: str) -> str:
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}×–{hi}"


def render(result: dict[str, Any], docs_dir: Path) -> str:
    rows, H = result["rows"], result["H"]
    table = [[f"{r['preset']} ({human_count(r['params'])})", r["n_peers"], r["compression"],
              human_bytes(r["mean_sent"] or 0), human_bytes(r["max_sent"] or 0), f(r.get("up_per_param"), ".4f"),
              f(r.get("down_per_param"), ".4f"), f(r["bytes_per_value"], ".4f"),
              human_bytes(r["onwire_tx_per_peer"]) if r["onwire_tx_per_peer"] else "–", _x(r["fp32_over_this"]),
              human_bytes(r["dp_ring_bytes_per_outer_step"]), _x(r["dp_over_this"]), _x(r["dp_over_this_onwire"]),
              f(r["rel_err_vs_true_mean"], ".2e"),
              "yes" if r["rounds_ok"] == r["rounds"] else f"NO ({r['rounds_ok']}/{r['rounds']} rounds)"] for r in rows]
    md = ["" if result["netns"] else f"No on-the-wire count: network namespaces unavailable ({result['netns_reason']}).\n",
          md_table(["model (P)", "peers", "codec", "payload sent/peer", "busiest peer", "up B/param", "down B/param",
                    "B per value moved",
                    "on the wire/peer", "fp32 ÷ this", f"data-parallel fp32, H={H}", "data-parallel ÷ payload",
                    "data-parallel ÷ on the wire", "error vs exact mean", "all rounds ok"], table)]
    int8 = [r for r in rows if r["compression"] == "int8"]
    fp = [r["fp32_over_this"] for r in int8 if r["fp32_over_this"]]
    dp = [r["dp_over_this"] for r in int8 if r["dp_over_this"]]
    wire = [r["dp_over_this_onwire"] for r in int8 if r["dp_over_this_onwire"]]
    if fp and dp:
        md.append(f"\n**int8 vs fp32 averaging: {_span(fp, '.2f')}× fewer payload bytes** per peer. **int8 vs "
                  f"data-parallel at H={H}: {_span(dp, ',.0f')}× fewer payload bytes**"
                  + (f" ({_span(wire, ',.0f')}× counting everything on the wire)" if wire else "")
                  + f"; an ideal 1-byte code would give 4·H = {4 * H:,}×.\n")
    return "\n".join(md)
