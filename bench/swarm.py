"""A group of averaging peers, each a separate process on one host, for the wire and round benchmarks.

Each peer is a forked process with its own ``hivemind.DHT`` (peer 0's is the first one, the others
bootstrap from it) and a :class:`diloco_swarm.averaging.averager.PseudoGradientAverager`. For every
round all peers wait on a ``multiprocessing.Barrier`` and then call ``average()`` together, so the
round's wall time starts at the same instant on every peer.

Timing per round and peer (``time.time()``, one clock for all processes on the host):

- ``total_s``: barrier release → ``average()`` returned (matchmaking + all-reduce + verification);
- ``matchmaking_s``: barrier release → the averager process entered ``_aggregate_with_group``
  (the group was formed);
- ``allreduce_s``: inside ``_aggregate_with_group`` (load balancing + the butterfly all-reduce);
- ``verify_s``: the rest (copying out, checks, the members' digest cross-check through the DHT).

The two inner timestamps come from a subclass of the averager (below) that only records them.

A job with compression ``raw-fp32`` runs hivemind's own ``DecentralizedAverager`` instead (fp32,
no part checks, no digest cross-check; ``step()`` with the same matchmaking settings): the
baseline that ``bench round`` compares our verified rounds with. Its bytes are computed from the
butterfly all-reduce's pattern, not counted.

Run as ``python -m bench.swarm < spec.json`` to do the same in another process (for example
inside a network namespace, ``ip netns exec NS python -m bench.swarm``); it prints one JSON line.
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
from typing import Any

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")

STARTUP_TIMEOUT_S = 180.0


def loopback_bytes() -> tuple[int, int] | None:
    """(rx, tx) bytes of ``lo`` in this process's network namespace, from /proc/self/net/dev."""
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        pass
    return None


def _make_timed_averager_class():
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class TimedAverager(PseudoGradientAverager):
        """Records when the all-reduce of a round started and ended (in the averager process)."""

        def __init__(self, *args, bench_times, **kwargs):
            self._bench_times = bench_times  # mp.Array('d', 2), shared with the peer process by fork
            super().__init__(*args, **kwargs)

        async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
            self._bench_times[0] = time.time()
            try:
                return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            finally:
                self._bench_times[1] = time.time()

    return TimedAverager


RAW_FP32 = "raw-fp32"  # a job's compression: plain hivemind, the baseline of our verified rounds


def _make_raw_averager_class():
    """hivemind's own ``DecentralizedAverager`` (fp32, no checks, no digest cross-check), timed the same way."""
    from hivemind.averaging import DecentralizedAverager

    class RawAverager(DecentralizedAverager):
        def __init__(self, *args, bench_times, **kwargs):
            self._bench_times = bench_times
            super().__init__(*args, **kwargs)

        async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
            self._bench_times[0] = time.time()
            try:
                return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            finally:
                self._bench_times[1] = time.time()

    return RawAverager


class _RawRound:
    """What ``PseudoGradientAverager.average`` returns, for a raw hivemind round."""

    def __init__(self, ok: bool, group_size: int, bytes_sent: int, reason: str = ""):
        self.ok, self.group_size, self.reason = ok, group_size, reason
        self.bytes_sent = self.bytes_received = bytes_sent
        self.rejected_peers: dict[str, str] = {}  # raw hivemind refuses nobody


def _start_raw_averager(shapes, dht, spec: dict[str, Any], prefix: str, n: int, times):
    import torch

    matchmaking_time = spec.get("matchmaking_time", 2.0)
    return _make_raw_averager_class()(
        [torch.zeros(s) for s in shapes], dht, start=True, prefix=prefix, target_group_size=n, min_group_size=2,
        min_matchmaking_time=matchmaking_time, request_timeout=max(0.5, min(3.0, matchmaking_time / 3)),
        allreduce_timeout=spec.get("allreduce_timeout", 300.0), next_chunk_timeout=spec.get("next_chunk_timeout", 60.0),
        bench_times=times)


def _raw_average(averager, delta, timeout: float, n: int):
    """One raw round: copy Δ in, ``step()``, copy the average out. Bytes are computed, not counted:
    each peer sends (n−1)/n of its fp32 vector and gets as much back (hivemind's butterfly all-reduce)."""
    with averager.get_tensors() as tensors:
        for t, d in zip(tensors, delta):
            t.copy_(d)
    try:
        gathered = averager.step(weight=1.0, timeout=timeout, allow_retries=False)
        ok, reason = gathered is not None, "" if gathered is not None else "no group"
    except Exception as e:
        gathered, ok, reason = None, False, f"{type(e).__name__}: {e}"[:200]
    size = len(gathered) if gathered else 1
    with averager.get_tensors() as tensors:
        out = [t.clone() for t in tensors]
    sent = int(2 * 4 * sum(t.numel() for t in out) * (size - 1) / size)
    return _RawRound(ok, size, sent, reason), out


def _deltas(shapes, seed: int, job: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(hash((seed, job, rank)) & 0x7FFFFFFF)
    return [torch.randn(tuple(s), generator=g).mul_(1e-3) for s in shapes]


def _peer(rank: int, spec: dict[str, Any], addr_q, barrier, res_q) -> None:
    import torch

    torch.set_num_threads(1)
    dht = None
    try:
        from hivemind import DHT

        n = spec["n_peers"]
        host = spec.get("host", "127.0.0.1")
        initial = [] if rank == 0 else addr_q.get(timeout=STARTUP_TIMEOUT_S)
        dht = DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial)
        if rank == 0:
            addrs = [str(a) for a in dht.get_visible_maddrs()]
            for _ in range(n - 1):
                addr_q.put(addrs)
        Averager = _make_timed_averager_class()
        bt = spec.get("barrier_timeout", 600.0)
        records = []
        for j, job in enumerate(spec["jobs"]):
            shapes = [tuple(s) for s in job["shapes"]]
            delta = _deltas(shapes, spec.get("seed", 0), j, rank)
            true_mean = None
            if spec.get("check_mean", True):
                true_mean = [torch.zeros(s) for s in shapes]
                for r in range(n):
                    for acc, d in zip(true_mean, _deltas(shapes, spec.get("seed", 0), j, r)):
                        acc.add_(d, alpha=1.0 / n)
            times = mp.Array("d", 2)
            raw = job["compression"] == RAW_FP32
            if raw:
                averager = _start_raw_averager(shapes, dht, spec, f"{spec.get('prefix', 'bench')}-{j}", n, times)
            else:
                averager = Averager(
                    [torch.zeros(s) for s in shapes],
                    dht,
                    prefix=f"{spec.get('prefix', 'bench')}-{j}",
                    compression=job["compression"],
                    target_group_size=n,
                    matchmaking_time=spec.get("matchmaking_time", 2.0),
                    allreduce_timeout=spec.get("allreduce_timeout", 300.0),
                    next_chunk_timeout=spec.get("next_chunk_timeout", 60.0),
                    bench_times=times,
                )
            try:
                barrier.wait(timeout=bt)  # every averager is up
                for r in range(job["rounds"]):
                    barrier.wait(timeout=bt)
                    lo0 = loopback_bytes() if rank == 0 else None
                    times[0] = times[1] = float("nan")
                    t0 = time.time()
                    if raw:
                        result, out = _raw_average(averager, delta, spec.get("round_timeout", 60.0), n)
                    else:
                        result, out = averager.average(delta, weight=1.0, metadata={"rank": rank},
                                                       timeout=spec.get("round_timeout", 60.0))
                    t1 = time.time()
                    rel_err = None
                    if true_mean is not None and result.ok:
                        # fp32 norms (no fp64 copies: 50M values would cost 400 MB per temporary)
                        num = sum(float(torch.linalg.vector_norm(a.reshape(-1) - m.reshape(-1))) ** 2
                                  for a, m in zip(out, true_mean))
                        den = sum(float(torch.linalg.vector_norm(m.reshape(-1))) ** 2 for m in true_mean)
                        rel_err = math.sqrt(num / max(den, 1e-300))
                    del out
                    barrier.wait(timeout=bt)  # everyone finished: the loopback counters cover the whole round
                    lo1 = loopback_bytes() if rank == 0 else None
                    ar0, ar1 = times[0], times[1]
                    rec = {
                        "job": j,
                        "round": r,
                        "rank": rank,
                        "ok": bool(result.ok),
                        "reason": result.reason,
                        "rejected_peers": dict(result.rejected_peers),  # refused senders, failed reducers: why
                        "group_size": result.group_size,
                        "bytes_sent": int(result.bytes_sent),
                        "bytes_received": int(result.bytes_received),
                        "t_start": t0,
                        "t_end": t1,
                        "total_s": t1 - t0,
                        "matchmaking_s": (ar0 - t0) if ar0 == ar0 else None,
                        "allreduce_s": (ar1 - ar0) if (ar0 == ar0 and ar1 == ar1) else None,
                        "verify_s": (t1 - ar1) if ar1 == ar1 else None,
                        "t_allreduce_start": ar0 if ar0 == ar0 else None,
                        "t_allreduce_end": ar1 if ar1 == ar1 else None,
                        "rel_err_vs_true_mean": rel_err,
                    }
                    if lo0 is not None and lo1 is not None:
                        rec["lo_tx_bytes_all_peers"] = lo1[1] - lo0[1]
                    records.append(rec)
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
            try:
                dht.shutdown()
            except Exception:
                pass


def run_swarm(spec: dict[str, Any], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run ``spec`` (``n_peers``, ``jobs``: [{shapes, compression, rounds}], timings) in forked peers.

    :returns: one record per (job, round, peer); see the module docstring for the fields.
    :raises RuntimeError: a peer failed or the swarm did not finish in ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    n = spec["n_peers"]
    addr_q, res_q = ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_peer, args=(rank, spec, addr_q, barrier, res_q), daemon=False) for rank in range(n)]
    for p in procs:
        p.start()
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"swarm of {n} peers did not finish in {timeout:.0f} s")
            try:
                status, rank, payload = res_q.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and res_q.empty():
                    raise RuntimeError("all peers exited without reporting (killed for memory?)")
                continue
            got += 1
            if status == "ok":
                records.extend(payload)
            else:
                errors.append(f"peer {rank}:\n{payload}")
        if errors:
            raise RuntimeError("a benchmark peer failed:\n" + "\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return sorted(records, key=lambda r: (r["job"], r["round"], r["rank"]))


def run_swarm_subprocess(spec: dict[str, Any], prefix_cmd: list[str], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """:func:`run_swarm` in a child ``python -m bench.swarm``, started as ``prefix_cmd + [python, ...]``."""
    import subprocess

    from bench.common import REPO

    cmd = [*prefix_cmd, sys.executable, "-m", "bench.swarm"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run(cmd, input=json.dumps({"spec": spec, "timeout": timeout}), capture_output=True, text=True,
                          timeout=timeout + 120, cwd=REPO, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])["records"]


def _main() -> int:
    args = json.loads(sys.stdin.read())
    records = run_swarm(args["spec"], timeout=args.get("timeout", 1800.0))
    print(json.dumps({"records": records}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
