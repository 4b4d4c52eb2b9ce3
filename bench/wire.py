"""``wire``: bytes on the wire per peer per outer step: int8 vs fp16 vs fp32 DiLoCo vs data-parallel.

The DiLoCo bytes are measured: 2 and 4 peers, separate processes on 127.0.0.1, average a
pseudo-gradient shaped like the ``tiny`` / ``small`` model's parameters through
``PseudoGradientAverager.average``; ``RoundResult.bytes_sent`` / ``bytes_received`` count the
codec payload (``runtime_pb2.Tensor.buffer``) of every part. When network namespaces work, each
group runs in a private namespace, and the ``lo`` counters there give every byte the round
moved (payload + protobuf + libp2p/TLS + TCP/IP headers + matchmaking + the DHT digest check).

The data-parallel figure is analytic: a ring all-reduce of fp32 gradients sends
2·(n−1)/n·4·P bytes per peer per step, H steps per outer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import human_bytes, human_count, md_table, median

H = 500
COMPRESSIONS = ("int8", "fp16", "fp32")

SIZES = {
    "smoke": {"presets": ["tiny"], "peers": [2], "compressions": ["int8", "fp32"], "rounds": 1, "netns": False},
    "quick": {"presets": ["tiny"], "peers": [2, 4], "compressions": list(COMPRESSIONS), "rounds": 1, "netns": True},
    "full": {"presets": ["tiny", "small"], "peers": [2, 4], "compressions": list(COMPRESSIONS), "rounds": 2,
             "netns": True},
}


def _shapes(preset: str) -> list[list[int]]:
    from diloco_swarm.models import build_model

    model = build_model(preset, seed=0)
    return [list(p.shape) for p in model.parameters()]


def run(size: str) -> dict[str, Any]:
    from bench.netutil import netns_check, private_netns
    from bench.swarm import run_swarm, run_swarm_subprocess

    cfg = SIZES[size]
    shapes = {p: _shapes(p) for p in cfg["presets"]}
    params = {p: sum(_prod(s) for s in shapes[p]) for p in shapes}
    use_netns, why_not = (netns_check() if cfg["netns"] else (False, "disabled at this size"))
    jobs = [{"preset": p, "compression": c, "shapes": shapes[p], "rounds": cfg["rounds"]}
            for p in cfg["presets"] for c in cfg["compressions"]]
    rows = []
    for n in cfg["peers"]:
        spec = {"n_peers": n, "jobs": [{k: j[k] for k in ("shapes", "compression", "rounds")} for j in jobs],
                "prefix": f"wire{n}", "matchmaking_time": 2.0, "check_mean": True}
        if use_netns:
            with private_netns(f"w{n}") as ns:
                records = run_swarm_subprocess(spec, ["ip", "netns", "exec", ns])
        else:
            records = run_swarm(spec)
        for j, job in enumerate(jobs):
            recs = [r for r in records if r["job"] == j]
            ok = [r for r in recs if r["ok"]]
            lo = [r["lo_tx_bytes_all_peers"] / n for r in recs if "lo_tx_bytes_all_peers" in r]
            P = params[job["preset"]]
            sent = median(r["bytes_sent"] for r in ok)
            rows.append({
                "preset": job["preset"],
                "params": P,
                "n_peers": n,
                "compression": job["compression"],
                "rounds": len({r["round"] for r in recs}),
                "rounds_ok": sum(1 for rnd in {r["round"] for r in recs}
                                 if all(r["ok"] for r in recs if r["round"] == rnd)),
                "all_ok": len(ok) == len(recs),
                "bytes_sent_per_peer": sent,
                "bytes_received_per_peer": median(r["bytes_received"] for r in ok),
                "sent_bytes_per_value": sent / (2 * (n - 1) / n * P),
                "onwire_tx_per_peer": median(lo) if (lo and use_netns) else None,
                "rel_err_vs_true_mean": median(r["rel_err_vs_true_mean"] for r in ok),
                "dp_ring_bytes_per_step": 2 * (n - 1) / n * 4 * P,
                "dp_ring_bytes_per_outer_step": 2 * (n - 1) / n * 4 * P * H,
                "records": recs,
            })
    by = {(r["preset"], r["n_peers"], r["compression"]): r for r in rows}
    for r in rows:
        fp32 = by.get((r["preset"], r["n_peers"], "fp32"))
        r["fp32_over_this"] = fp32["bytes_sent_per_peer"] / r["bytes_sent_per_peer"] if fp32 else None
        r["dp_over_this"] = r["dp_ring_bytes_per_outer_step"] / r["bytes_sent_per_peer"]
        r["dp_over_this_onwire"] = (r["dp_ring_bytes_per_outer_step"] / r["onwire_tx_per_peer"]
                                    if r["onwire_tx_per_peer"] else None)
    return {"H": H, "netns": use_netns, "netns_reason": why_not, "params": params, "rows": rows}


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _x(v) -> str:
    return "–" if v is None else f"{v:,.0f}×" if v >= 100 else f"{v:.2f}×"


def _summarize(rows: list[dict[str, Any]], H: int) -> None:
    """Per-peer payload from the raw records: mean over peers and rounds (= total / n, independent of how
    the load balancer split the vector) and the busiest peer; then the ratios."""
    for r in rows:
        ok = [x for x in r["records"] if x["ok"]]
        n, P = r["n_peers"], r["params"]
        r["mean_sent"] = sum(x["bytes_sent"] for x in ok) / len(ok) if ok else float("nan")
        r["max_sent"] = max((x["bytes_sent"] for x in ok), default=float("nan"))
        r["mean_bytes_per_value"] = r["mean_sent"] / (2 * (n - 1) / n * P)
    by = {(r["preset"], r["n_peers"], r["compression"]): r for r in rows}
    for r in rows:
        fp32 = by.get((r["preset"], r["n_peers"], "fp32"))
        r["fp32_over_this_mean"] = fp32["mean_sent"] / r["mean_sent"] if fp32 else None
        r["dp_over_this_mean"] = r["dp_ring_bytes_per_outer_step"] / r["mean_sent"]


def render(result: dict[str, Any], docs_dir: Path) -> str:
    rows = result["rows"]
    _summarize(rows, result["H"])
    table = []
    for r in rows:
        table.append([
            f"{r['preset']} ({human_count(r['params'])})", r["n_peers"], r["compression"],
            human_bytes(r["mean_sent"]), human_bytes(r["max_sent"]), f"{r['mean_bytes_per_value']:.4f}",
            human_bytes(r["onwire_tx_per_peer"]) if r["onwire_tx_per_peer"] else "–",
            _x(r["fp32_over_this_mean"]), human_bytes(r["dp_ring_bytes_per_outer_step"]), _x(r["dp_over_this_mean"]),
            _x(r["dp_over_this_onwire"]),
            f"{r['rel_err_vs_true_mean']:.2e}" if r["rel_err_vs_true_mean"] == r["rel_err_vs_true_mean"] else "–",
            "yes" if r["all_ok"] else f"NO ({r['rounds_ok']}/{r['rounds']} rounds)",
        ])
    md = [
        "Bytes one peer sends per outer step. *Measured*: real `PseudoGradientAverager.average()` rounds between "
        "separate processes on 127.0.0.1, tensors shaped like the model preset's parameters (random Δ). "
        "*Payload* = `RoundResult.bytes_sent` (codec buffers only), mean over peers and rounds (= the group's total "
        "÷ n; the busiest peer is shown too, since hivemind's load balancer splits the vector unevenly). "
        + ("*On the wire* = bytes the loopback interface of a private network namespace carried during the "
           "round, divided by the peers (adds protobuf, libp2p/TLS and TCP/IP framing, matchmaking and the "
           "DHT digest cross-check). " if result["netns"] else
           f"No on-the-wire count: network namespaces unavailable ({result['netns_reason']}). ")
        + f"*Data-parallel* is the **analytic ring all-reduce figure** 2·(n−1)/n·4·P bytes per step per peer, "
        f"×H={result['H']} steps per outer step (nothing was run for it).\n",
        md_table(["model (P)", "peers", "codec", "payload sent/peer", "busiest peer", "B per value moved¹",
                  "on the wire/peer", "fp32 ÷ this", f"data-parallel fp32, H={result['H']}",
                  "data-parallel ÷ payload", "data-parallel ÷ on the wire", "error vs exact mean", "all rounds ok"],
                 table),
        "\n¹ mean payload sent ÷ (2·(n−1)/n·P): bytes per value for each of the 2·(n−1)/n·P values a peer sends "
        "in a butterfly (or ring) all-reduce.\n",
    ]
    int8 = [r for r in rows if r["compression"] == "int8"]
    fp = [r["fp32_over_this_mean"] for r in int8 if r["fp32_over_this_mean"]]
    dp = [r["dp_over_this_mean"] for r in int8]
    wire = [r["dp_over_this_onwire"] for r in int8 if r["dp_over_this_onwire"]]
    if fp:
        md.append(
            f"\n**int8 vs fp32 averaging: {_span(fp, '.2f')}× fewer payload bytes** per peer "
            f"(ideal 4×, less the 4-byte absmax scale per {_blocksize()}-value block and the part headers). "
            f"**int8 vs data-parallel at H={result['H']}: {_span(dp, ',.0f')}× fewer payload bytes**"
            + (f" ({_span(wire, ',.0f')}× counting everything on the wire)" if wire else "")
            + f". An ideal 1-byte code would give 4·H = {4 * result['H']:,}×: the butterfly all-reduce moves the "
            "same 2·(n−1)/n·P values per peer as a ring, so only H and the bytes per value differ, and the "
            "scales cost the rest.\n")
    return "\n".join(md)


def _span(values, fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}×–{format(hi, fmt)}"


def _blocksize() -> int:
    try:
        from diloco_swarm.averaging.codec import BLOCKSIZE

        return BLOCKSIZE
    except Exception:
        return 1024
