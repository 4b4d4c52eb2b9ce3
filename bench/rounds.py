"""``round``: averaging round time and bytes per peer, against raw loopback TCP as the ceiling.

2 and 4 peers (:mod:`bench.swarm`) average one flat fp32 tensor of 1M / 10M / 50M values with int8, fp16 and
fp32, and hivemind's own fp32 averager (``raw-fp32``) as the baseline. Per round (all peers released at t0):
*total* t0 → the last ``average()`` returned; *matchmaking* t0 → the last peer entered the all-reduce;
*all-reduce* first in → last out; *verify* the rest. The ceiling: one TCP stream between two processes.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

from bench.common import f, figure, human_bytes, human_count, md_table, median, ratio
from bench.netprobe import drain
from bench.swarm import RAW_FP32

SIZES = {
    "smoke": {"peers": [2], "values": [100_000], "compressions": ["int8", RAW_FP32], "rounds": {100_000: 1},
              "tcp_bytes": 8 << 20, "tcp_repeats": 1},
    "quick": {"peers": [2, 4], "values": [1_000_000], "compressions": ["int8", "fp16", "fp32", RAW_FP32],
              "rounds": {1_000_000: 2}, "tcp_bytes": 64 << 20, "tcp_repeats": 3},
    "full": {"peers": [2, 4], "values": [1_000_000, 10_000_000, 50_000_000],
             "compressions": ["int8", "fp16", "fp32", RAW_FP32],
             "rounds": {1_000_000: 3, 10_000_000: 3, 50_000_000: 2}, "tcp_bytes": 256 << 20, "tcp_repeats": 3},
}


def _tcp_receiver(port_q, done_q, total: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        got = drain(conn, total, chunk=4 << 20)
        done_q.put((time.time(), got))
        conn.sendall(b"k")
        conn.close()


def tcp_ceiling(total: int, repeats: int) -> dict[str, Any]:
    """One TCP stream, two processes, 127.0.0.1: bytes/s of ``sendall`` of a ``total``-byte buffer."""
    ctx = mp.get_context("fork")
    payload, rates = bytes(total), []
    for _ in range(repeats):
        port_q, done_q = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_tcp_receiver, args=(port_q, done_q, total))
        p.start()
        try:
            with socket.create_connection(("127.0.0.1", port_q.get(timeout=30))) as s:
                t0 = time.time()
                s.sendall(payload)
                s.recv(1)  # the receiver got everything
                t1, got = done_q.get(timeout=60)
            if got == total:
                rates.append(total / (t1 - t0))
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {"bytes": total, "repeats": repeats, "bytes_per_s": rates, "median_bytes_per_s": median(rates)}


def _round(rr: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one round from its peers' records."""
    t0, t_end = min(r["t_start"] for r in rr), max(r["t_end"] for r in rr)
    starts = [r["t_allreduce_start"] for r in rr if r["t_allreduce_start"] is not None]
    ends = [r["t_allreduce_end"] for r in rr if r["t_allreduce_end"] is not None]
    timed = len(starts) == len(ends) == len(rr)
    ar = max(ends) - min(starts) if timed else None
    sent = sum(r["bytes_sent"] for r in rr)
    return {"round": rr[0]["round"], "ok": all(r["ok"] for r in rr),
            "reasons": sorted({r["reason"] for r in rr if r["reason"]}
                              | {f"{p}: {why}" for r in rr for p, why in r.get("rejected_peers", {}).items()}),
            "total_s": t_end - t0, "matchmaking_s": max(starts) - t0 if timed else None, "allreduce_s": ar,
            "verify_s": t_end - max(ends) if timed else None,
            "bytes_sent_per_peer": median(r["bytes_sent"] for r in rr), "payload_all_peers": sent,
            "throughput_bytes_per_s": sent / ar if ar else None, "rel_err": median(r["rel_err_vs_true_mean"] for r in rr)}


def run(size: str) -> dict[str, Any]:
    from bench.swarm import run_swarm

    cfg = SIZES[size]
    ceiling = tcp_ceiling(cfg["tcp_bytes"], cfg["tcp_repeats"])
    jobs = [{"values": v, "compression": c, "rounds": cfg["rounds"][v]} for v in cfg["values"] for c in cfg["compressions"]]
    rows = []
    for n in cfg["peers"]:
        spec = {"n_peers": n, "prefix": f"round{n}", "matchmaking_time": 2.0, "allreduce_timeout": 600.0,
                "next_chunk_timeout": 120.0, "round_timeout": 120.0,
                "jobs": [{"shapes": [[j["values"]]], "compression": j["compression"], "rounds": j["rounds"]} for j in jobs]}
        records = run_swarm(spec, timeout=3600.0)
        for ji, job in enumerate(jobs):
            recs = [r for r in records if r["job"] == ji]
            per_round = [_round([r for r in recs if r["round"] == x]) for x in sorted({r["round"] for r in recs})]
            good = [p for p in per_round if p["ok"]]
            row = {"n_peers": n, **job, "rounds": len(per_round), "rounds_ok": len(good), "per_round": per_round}
            for key in ("total_s", "matchmaking_s", "allreduce_s", "verify_s", "bytes_sent_per_peer",
                        "throughput_bytes_per_s", "rel_err"):
                row[key] = median(p[key] for p in good)
            row["fraction_of_ceiling"] = ratio(row["throughput_bytes_per_s"], ceiling["median_bytes_per_s"])
            rows.append(row)
    return {"tcp_ceiling": ceiling, "rows": rows, "matchmaking_time": 2.0}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    ceil, rows = result["tcp_ceiling"], result["rows"]
    table = [[r["n_peers"], human_count(r["values"]), r["compression"], f"{r['rounds_ok']}/{r['rounds']}",
              f(r["total_s"]), f(r["matchmaking_s"]), f(r["allreduce_s"]), f(r["verify_s"]),
              human_bytes(r["bytes_sent_per_peer"]) if r["bytes_sent_per_peer"] == r["bytes_sent_per_peer"] else "–",
              f(r["throughput_bytes_per_s"] and r["throughput_bytes_per_s"] / 1e6, ".0f", " MB/s"),
              f(r["fraction_of_ceiling"] and 100 * r["fraction_of_ceiling"], ".1f", "%"),
              f(r["rel_err"], ".1e")] for r in rows]
    md = [f"**Ceiling**: one TCP stream between two processes on 127.0.0.1, `sendall` of {human_bytes(ceil['bytes'])}: "
          f"**{ceil['median_bytes_per_s'] / 1e6:,.0f} MB/s** (median of {len(ceil['bytes_per_s'])}).\n",
          md_table(["peers", "values", "codec", "ok rounds", "total s", "matchmaking s", "all-reduce s", "verify s",
                    "payload sent/peer", "throughput", "of ceiling", "error vs exact mean"], table)]
    by = {(r["n_peers"], r["values"], r["compression"]): r for r in rows}
    lines = []
    for (n, v, c), r in sorted(by.items()):
        base = by.get((n, v, RAW_FP32))
        if c == "int8" and base and ratio(r["total_s"], base["total_s"]):
            lines.append(f"- {n} peers, {human_count(v)} values: verified int8 round {r['total_s']:.2f} s ÷ raw "
                         f"hivemind fp32 round {base['total_s']:.2f} s = **{r['total_s'] / base['total_s']:.2f}×**; "
                         f"all-reduce {f(ratio(r['allreduce_s'], base['allreduce_s']))}×, verify {f(r['verify_s'])} s "
                         f"vs {f(base['verify_s'])} s; fp32 ÷ int8 all-reduce time "
                         f"{f(ratio((by.get((n, v, 'fp32')) or {}).get('allreduce_s'), r['allreduce_s']))}.")
    if lines:
        md.append("\nAgainst raw hivemind (`raw-fp32`), same run:\n\n" + "\n".join(lines) + "\n")
    if len({r["values"] for r in rows}) > 1:
        with figure(docs_dir / "bench-round.png", (8, 3.2), ncols=2, sharey=True) as axes:
            for ax, n in zip(axes, sorted({r["n_peers"] for r in rows})):
                for c, style in (("int8", "o-"), ("fp16", "s--"), ("fp32", "^:"), (RAW_FP32, "x-.")):
                    pts = [(r["values"], r["allreduce_s"]) for r in rows if r["n_peers"] == n and r["compression"] == c
                           and r["allreduce_s"] == r["allreduce_s"]]
                    if pts:
                        ax.loglog([p[0] for p in pts], [p[1] for p in pts], style, label=c)
                ax.set(title=f"{n} peers, 127.0.0.1", xlabel="values averaged")
                ax.grid(True, which="both", alpha=0.3)
            axes[0].set_ylabel("all-reduce seconds (median)")
            axes[0].legend()
        md.append("\n![all-reduce time vs size](bench-round.png)\n")
    return "\n".join(md)
