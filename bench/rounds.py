"""``round``: averaging round time and bytes per peer, against raw loopback TCP as the ceiling.

2 and 4 peers, separate processes on 127.0.0.1 (see :mod:`bench.swarm`), average one flat fp32
tensor of 1M / 10M / 50M values with int8, fp16 and fp32 through the same
``PseudoGradientAverager``. Per round (all peers released by one barrier at t0):

- ``total``: t0 → the last peer's ``average()`` returned;
- ``matchmaking``: t0 → the last peer's averager entered the all-reduce (group formed);
- ``all-reduce``: first peer entered → last peer left the all-reduce (load balancing + butterfly);
- ``verify``: the last all-reduce end → the last ``average()`` return (checks, the members' digest confirmation).

The baseline is hivemind's own ``DecentralizedAverager`` in fp32 (codec ``raw-fp32``: no part
checks, no digest cross-check, ``step()`` with the same matchmaking settings), in the same run:
the report gives our verified int8 round time ÷ that raw round time (issue 13's target: ≤ 1.3× at
10M and 50M values, and ≤ 1 s end to end for 1M values on 2 peers).

The ceiling is one TCP stream between two processes on 127.0.0.1 (``socket.sendall`` of a large
buffer, ``recv_into`` on the other side). A round's effective throughput is the payload all peers
sent (Σ ``bytes_sent``) divided by its all-reduce time, as a fraction of that ceiling. The all-reduce
runs n·(n−1)·2 streams at once through the go-libp2p daemons (TLS) on the same 2 cores, so a
fraction well below 1 is expected; it says how much of the machine's raw loopback the stack uses.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

from bench.common import human_bytes, human_count, md_table, median
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
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    got = drain(conn, total, chunk=4 << 20)
    done_q.put((time.time(), got))
    conn.sendall(b"k")
    conn.close()
    srv.close()


def tcp_ceiling(total: int, repeats: int) -> dict[str, Any]:
    """One TCP stream, two processes, 127.0.0.1: bytes/s of ``sendall`` of a ``total``-byte buffer."""
    ctx = mp.get_context("fork")
    payload = bytes(total)
    rates = []
    for _ in range(repeats):
        port_q, done_q = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_tcp_receiver, args=(port_q, done_q, total))
        p.start()
        try:
            port = port_q.get(timeout=30)
            with socket.create_connection(("127.0.0.1", port)) as s:
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


def run(size: str) -> dict[str, Any]:
    from bench.swarm import run_swarm

    cfg = SIZES[size]
    ceiling = tcp_ceiling(cfg["tcp_bytes"], cfg["tcp_repeats"])
    jobs = [{"values": v, "compression": c, "rounds": cfg["rounds"][v]} for v in cfg["values"] for c in cfg["compressions"]]
    rows = []
    for n in cfg["peers"]:
        spec = {"n_peers": n, "prefix": f"round{n}", "matchmaking_time": 2.0, "check_mean": True,
                "allreduce_timeout": 600.0, "next_chunk_timeout": 120.0, "round_timeout": 120.0,
                "jobs": [{"shapes": [[j["values"]]], "compression": j["compression"], "rounds": j["rounds"]}
                         for j in jobs]}
        records = run_swarm(spec, timeout=3600.0)
        for ji, job in enumerate(jobs):
            recs = [r for r in records if r["job"] == ji]
            per_round = []
            for rnd in sorted({r["round"] for r in recs}):
                rr = [r for r in recs if r["round"] == rnd]
                ok = all(r["ok"] for r in rr)
                t0 = min(r["t_start"] for r in rr)
                ar_starts = [r["t_allreduce_start"] for r in rr if r["t_allreduce_start"] is not None]
                ar_ends = [r["t_allreduce_end"] for r in rr if r["t_allreduce_end"] is not None]
                have_ar = len(ar_starts) == len(rr) and len(ar_ends) == len(rr)
                ar = (max(ar_ends) - min(ar_starts)) if have_ar else None
                sent_all = sum(r["bytes_sent"] for r in rr)
                per_round.append({
                    "round": rnd,
                    "ok": ok,
                    "reasons": sorted({r["reason"] for r in rr if r["reason"]}
                                      | {f"{p}: {why}" for r in rr for p, why in r.get("rejected_peers", {}).items()}),
                    "total_s": max(r["t_end"] for r in rr) - t0,
                    "matchmaking_s": (max(ar_starts) - t0) if have_ar else None,
                    "allreduce_s": ar,
                    "verify_s": (max(r["t_end"] for r in rr) - max(ar_ends)) if have_ar else None,
                    "bytes_sent_per_peer": median(r["bytes_sent"] for r in rr),
                    "bytes_received_per_peer": median(r["bytes_received"] for r in rr),
                    "payload_all_peers": sent_all,
                    "throughput_bytes_per_s": (sent_all / ar) if ar else None,
                    "rel_err": median(r["rel_err_vs_true_mean"] for r in rr),
                })
            good = [p for p in per_round if p["ok"]]
            thr = median(p["throughput_bytes_per_s"] for p in good)
            rows.append({
                "n_peers": n,
                "values": job["values"],
                "compression": job["compression"],
                "rounds": len(per_round),
                "rounds_ok": len(good),
                "total_s": median(p["total_s"] for p in good),
                "matchmaking_s": median(p["matchmaking_s"] for p in good),
                "allreduce_s": median(p["allreduce_s"] for p in good),
                "verify_s": median(p["verify_s"] for p in good),
                "bytes_sent_per_peer": median(p["bytes_sent_per_peer"] for p in good),
                "throughput_bytes_per_s": thr,
                "fraction_of_ceiling": thr / ceiling["median_bytes_per_s"] if ceiling["median_bytes_per_s"] else None,
                "rel_err": median(p["rel_err"] for p in good),
                "per_round": per_round,
            })
    return {"tcp_ceiling": ceiling, "rows": rows, "matchmaking_time": 2.0}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and v == v and v > 0


def _s(v) -> str:
    return "–" if v is None or v != v else f"{v:.2f}"


def render(result: dict[str, Any], docs_dir: Path) -> str:
    ceil = result["tcp_ceiling"]
    rows = result["rows"]
    table = []
    for r in rows:
        table.append([
            r["n_peers"], human_count(r["values"]), r["compression"], f"{r['rounds_ok']}/{r['rounds']}",
            _s(r["total_s"]), _s(r["matchmaking_s"]), _s(r["allreduce_s"]), _s(r["verify_s"]),
            human_bytes(r["bytes_sent_per_peer"]) if r["bytes_sent_per_peer"] == r["bytes_sent_per_peer"] else "–",
            f"{r['throughput_bytes_per_s'] / 1e6:.0f} MB/s" if r["throughput_bytes_per_s"] == r["throughput_bytes_per_s"] else "–",
            f"{100 * r['fraction_of_ceiling']:.1f}%" if r["fraction_of_ceiling"] == r["fraction_of_ceiling"] and r["fraction_of_ceiling"] is not None else "–",
            f"{r['rel_err']:.1e}" if r["rel_err"] == r["rel_err"] else "–",
        ])
    md = [
        f"One flat fp32 tensor averaged by n peers (separate processes, 127.0.0.1), all released together by a "
        f"barrier; `matchmaking_time` {result['matchmaking_time']} s, target group size = n. Seconds are medians over "
        "the verified rounds; *matchmaking* = barrier → last peer entered the all-reduce; *all-reduce* = first peer in "
        "→ last peer out; *verify* = the checks and the members' digest confirmation after it (in `average()`: in-band, the DHT as fallback; for "
        "`raw-fp32`, hivemind's own `step()` returning). "
        "*Throughput* = payload sent by all peers / all-reduce time.\n",
        f"**Ceiling**: one TCP stream between two processes on 127.0.0.1, `sendall` of {human_bytes(ceil['bytes'])}: "
        f"**{ceil['median_bytes_per_s'] / 1e6:,.0f} MB/s** (median of {len(ceil['bytes_per_s'])}).\n",
        md_table(["peers", "values", "codec", "ok rounds", "total s", "matchmaking s", "all-reduce s", "verify s",
                  "payload sent/peer", "throughput", "of ceiling", "error vs exact mean"], table),
    ]
    by = {(r["n_peers"], r["values"], r["compression"]): r for r in rows}
    lines = []
    for (n, v, c), r in sorted(by.items()):
        if c != "int8":
            continue
        f32 = by.get((n, v, "fp32"))
        f16 = by.get((n, v, "fp16"))
        bits = []
        if f32 and f32["allreduce_s"] == f32["allreduce_s"] and r["allreduce_s"]:
            bits.append(f"all-reduce time fp32 ÷ int8 = {f32['allreduce_s'] / r['allreduce_s']:.2f}")
        if f16 and f16["allreduce_s"] == f16["allreduce_s"] and r["allreduce_s"]:
            bits.append(f"fp16 ÷ int8 = {f16['allreduce_s'] / r['allreduce_s']:.2f}")
        if f32 and f32["total_s"] == f32["total_s"] and r["total_s"]:
            bits.append(f"whole round fp32 ÷ int8 = {f32['total_s'] / r['total_s']:.2f}")
        if bits:
            lines.append(f"- {n} peers, {human_count(v)} values, int8: " + "; ".join(bits) + ".")
    if lines:
        md.append("\nSide by side (same run; above 1 = int8 faster):\n\n" + "\n".join(lines) + "\n")
    overhead = []
    for (n, v, c), r in sorted(by.items()):
        base = by.get((n, v, RAW_FP32))
        if c != "int8" or not base or not _num(base["total_s"]) or not _num(r["total_s"]):
            continue
        ar = (f"; all-reduce {r['allreduce_s'] / base['allreduce_s']:.2f}×, verify {_s(r['verify_s'])} s vs "
              f"{_s(base['verify_s'])} s" if _num(r["allreduce_s"]) and _num(base["allreduce_s"]) else "")
        overhead.append(f"- {n} peers, {human_count(v)} values: verified int8 round {r['total_s']:.2f} s ÷ raw hivemind "
                        f"fp32 round {base['total_s']:.2f} s = **{r['total_s'] / base['total_s']:.2f}×**{ar}.")
    if overhead:
        md.append("\nOverhead against raw hivemind (`raw-fp32`: `DecentralizedAverager`, fp32, no verification), "
                  "same run; issue 13 targets ≤ 1.3× at 10M and 50M values, and ≤ 1 s for 1M values on 2 peers:\n\n"
                  + "\n".join(overhead) + "\n")
    png = _plot(rows, docs_dir)
    if png:
        md.append(f"\n![all-reduce time vs size]({png})\n")
    return "\n".join(md)


def _plot(rows, docs_dir: Path) -> str | None:
    sizes = sorted({r["values"] for r in rows})
    if len(sizes) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    peers = sorted({r["n_peers"] for r in rows})
    for ax, n in zip(axes, peers[:2]):
        for c, style in (("int8", "o-"), ("fp16", "s--"), ("fp32", "^:"), (RAW_FP32, "x-.")):
            pts = [(r["values"], r["allreduce_s"]) for r in rows
                   if r["n_peers"] == n and r["compression"] == c and r["allreduce_s"] == r["allreduce_s"]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=c)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{n} peers, 127.0.0.1")
        ax.set_xlabel("values averaged")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("all-reduce seconds (median)")
    axes[0].legend()
    fig.tight_layout()
    name = "bench-round.png"
    fig.savefig(docs_dir / name, dpi=80)
    plt.close(fig)
    return name
