"""A group of averaging peers, each a forked process on one host, for the wire and round benchmarks.

Each peer runs its own ``hivemind.DHT`` (peer 0's first, the others bootstrap from it) and a
``PseudoGradientAverager`` (or, for compression ``raw-fp32``, hivemind's own ``DecentralizedAverager``: fp32,
no checks, no digest cross-check, the baseline of ``bench round``; its bytes are computed, not counted). For
every round all peers pass a ``multiprocessing.Barrier`` and call ``average()`` together. Per round and peer
(``time.time()``, one clock on the host): ``total_s`` barrier → ``average()`` returned; ``matchmaking_s``
barrier → the all-reduce began (the group formed); ``allreduce_s`` inside ``_aggregate_with_group``;
``verify_s`` the rest. ``python -m bench.swarm < spec.json`` does the same in another process (inside a
network namespace, say) and prints one JSON line. With ``placements`` (``[[namespace, address], ...]``, one per
peer: tests/natlib.py's ``star_topology``) each forked peer enters its own namespace first, behind its own link.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")

STARTUP_TIMEOUT_S = 180.0
RAW_FP32 = "raw-fp32"  # a job's compression: plain hivemind, the baseline of our verified rounds


def loopback_bytes() -> tuple[int, int] | None:
    """(rx, tx) bytes of ``lo`` in this process's network namespace, from /proc/self/net/dev."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0]), int(rest.split()[8])
    return None


def _timed(base: type) -> type:
    """``base`` (an averager class) recording when the all-reduce of a round began and ended (in the averager
    process) into ``bench_times``, an ``mp.Array('d', 2)`` shared with the peer process by fork."""

    class Timed(base):
        def __init__(self, *args, bench_times, **kwargs):
            self._bench_times = bench_times
            super().__init__(*args, **kwargs)

        async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
            self._bench_times[0] = time.time()
            try:
                return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            finally:
                self._bench_times[1] = time.time()

    return Timed


def _averager(shapes, dht, spec: dict[str, Any], prefix: str, n: int, times, compression: str):
    import torch

    common = {"prefix": prefix, "target_group_size": n, "allreduce_timeout": spec.get("allreduce_timeout", 300.0),
              "next_chunk_timeout": spec.get("next_chunk_timeout", 60.0), "bench_times": times}
    mm = spec.get("matchmaking_time", 2.0)
    if compression == RAW_FP32:
        from hivemind.averaging import DecentralizedAverager

        return _timed(DecentralizedAverager)([torch.zeros(s) for s in shapes], dht, start=True, min_group_size=2,
                                             min_matchmaking_time=mm, request_timeout=max(0.5, min(3.0, mm / 3)),
                                             **common)
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    return _timed(PseudoGradientAverager)([torch.zeros(s) for s in shapes], dht, compression=compression,
                                          matchmaking_time=mm, **common)


def _raw_average(averager, delta, timeout: float):
    """One raw round: copy Δ in, ``step()``, copy the average out. Bytes are computed: each peer sends (n−1)/n
    of its fp32 vector and gets as much back (hivemind's butterfly all-reduce)."""
    with averager.get_tensors() as tensors:
        for t, d in zip(tensors, delta):
            t.copy_(d)
    try:
        gathered, reason = averager.step(weight=1.0, timeout=timeout, allow_retries=False), "no group"
    except Exception as e:
        gathered, reason = None, f"{type(e).__name__}: {e}"[:200]
    size = len(gathered) if gathered else 1
    with averager.get_tensors() as tensors:
        out = [t.clone() for t in tensors]
    sent = int(2 * 4 * sum(t.numel() for t in out) * (size - 1) / size)
    return SimpleNamespace(ok=gathered is not None, group_size=size, bytes_sent=sent, bytes_received=sent,
                           reason="" if gathered is not None else reason, rejected_peers={}), out


def _deltas(shapes, seed: int, job: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(hash((seed, job, rank)) & 0x7FFFFFFF)
    return [torch.randn(tuple(s), generator=g).mul_(1e-3) for s in shapes]


def _enter_netns(name: str) -> None:
    """Move this (single-threaded, just forked) process into network namespace ``name`` (``ip netns``'s
    /var/run/netns/NAME): the threads and processes it starts later (the DHT, the averager, the p2p daemon) are
    born there. Python 3.11 has no ``os.setns``. :raises OSError: the kernel refused (not root)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)


def _peer(rank: int, spec: dict[str, Any], addr_q, barrier, res_q) -> None:
    dht = None
    try:
        host = spec.get("host", "127.0.0.1")
        if spec.get("placements"):
            namespace, host = spec["placements"][rank]
            _enter_netns(namespace)
        import torch
        from hivemind import DHT

        from diloco_swarm.averaging.request import RoundRequest

        torch.set_num_threads(1)
        n, seed, bt = spec["n_peers"], spec.get("seed", 0), spec.get("barrier_timeout", 600.0)
        initial = [] if rank == 0 else addr_q.get(timeout=STARTUP_TIMEOUT_S)
        dht = DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial)
        if rank == 0:
            for _ in range(n - 1):
                addr_q.put([str(a) for a in dht.get_visible_maddrs()])
        records = []
        for j, job in enumerate(spec["jobs"]):
            shapes = [tuple(s) for s in job["shapes"]]
            delta = _deltas(shapes, seed, j, rank)
            true_mean = [torch.zeros(s) for s in shapes]
            for r in range(n):
                for acc, d in zip(true_mean, _deltas(shapes, seed, j, r)):
                    acc.add_(d, alpha=1.0 / n)
            times = mp.Array("d", 2)
            raw = job["compression"] == RAW_FP32
            averager = _averager(shapes, dht, spec, f"{spec.get('prefix', 'bench')}-{j}", n, times, job["compression"])
            try:
                barrier.wait(timeout=bt)  # every averager is up
                for r in range(job["rounds"]):
                    barrier.wait(timeout=bt)
                    lo0 = loopback_bytes() if rank == 0 else None
                    times[0] = times[1] = float("nan")
                    t0 = time.time()
                    timeout = spec.get("round_timeout", 60.0)
                    result, out = (_raw_average(averager, delta, timeout) if raw else
                                   averager.average(RoundRequest(
                                       delta=delta, weight=1.0, metadata={"rank": rank}, timeout=timeout)))
                    t1 = time.time()
                    rel_err = None
                    if result.ok:  # fp32 norms (no fp64 copies: 50M values would cost 400 MB per temporary)
                        num = sum(float(torch.linalg.vector_norm(a.reshape(-1) - m.reshape(-1))) ** 2
                                  for a, m in zip(out, true_mean))
                        den = sum(float(torch.linalg.vector_norm(m.reshape(-1))) ** 2 for m in true_mean)
                        rel_err = math.sqrt(num / max(den, 1e-300))
                    del out
                    barrier.wait(timeout=bt)  # everyone finished: the loopback counters cover the whole round
                    lo1 = loopback_bytes() if rank == 0 else None
                    ar0, ar1 = (x if x == x else None for x in times)
                    records.append({
                        "job": j, "round": r, "rank": rank, "ok": bool(result.ok), "reason": result.reason,
                        "rejected_peers": dict(result.rejected_peers),  # refused senders, failed reducers: why
                        "group_size": result.group_size, "bytes_sent": int(result.bytes_sent),
                        "bytes_received": int(result.bytes_received), "t_start": t0, "t_end": t1, "total_s": t1 - t0,
                        "matchmaking_s": ar0 and ar0 - t0, "allreduce_s": ar0 and ar1 and ar1 - ar0,
                        "verify_s": ar1 and t1 - ar1, "t_allreduce_start": ar0, "t_allreduce_end": ar1,
                        "rel_err_vs_true_mean": rel_err,
                        **({"lo_tx_bytes_all_peers": lo1[1] - lo0[1]} if lo0 and lo1 else {}),
                    })
            finally:
                averager.shutdown()
        res_q.put(("ok", rank, records))
    except BaseException:
        res_q.put(("error", rank, traceback.format_exc()))
        try:
            barrier.abort()
        except Exception:
            pass
    finally:
        if dht is not None:
            dht.shutdown()


def run_swarm(spec: dict[str, Any], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run ``spec`` (``n_peers``, ``jobs``: [{shapes, compression, rounds}], timings) in forked peers.

    :returns: one record per (job, round, peer); see the module docstring for the fields.
    :raises RuntimeError: a peer failed or the swarm did not finish in ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    n = spec["n_peers"]
    addr_q, res_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=_peer, args=(rank, spec, addr_q, barrier, res_q)) for rank in range(n)]
    for p in procs:
        p.start()
    records, errors, got = [], [], 0
    deadline = time.monotonic() + timeout
    try:
        while got < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"swarm of {n} peers did not finish in {timeout:.0f} s")
            try:
                status, rank, payload = res_q.get(timeout=5.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and res_q.empty():
                    raise RuntimeError("all peers exited without reporting (killed for memory?)")
                continue
            got += 1
            records.extend(payload) if status == "ok" else errors.append(f"peer {rank}:\n{payload}")
        if errors:
            raise RuntimeError("a benchmark peer failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return sorted(records, key=lambda r: (r["job"], r["round"], r["rank"]))


def run_swarm_subprocess(spec: dict[str, Any], prefix_cmd: list[str], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """:func:`run_swarm` in a child ``python -m bench.swarm``, started as ``prefix_cmd + [python, ...]``."""
    import subprocess

    from bench.common import REPO

    cmd = [*prefix_cmd, sys.executable, "-m", "bench.swarm"]
    proc = subprocess.run(cmd, input=json.dumps({"spec": spec, "timeout": timeout}), capture_output=True, text=True,
                          timeout=timeout + 120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])["records"]


if __name__ == "__main__":
    args = json.loads(sys.stdin.read())
    print(json.dumps({"records": run_swarm(args["spec"], timeout=args.get("timeout", 1800.0))}), flush=True)
