"""`diloco-node status` through the py-libp2p light client vs through hivemind: wall time and peak memory.

Run: ``python -m bench.light [--quick]``. Starts 3 real ``diloco_swarm join`` processes on 127.0.0.1
(tiny model), waits until all three records are readable, then runs ``status --json`` alternately
through hivemind (a client-mode DHT: a forked DHT process and the go-libp2p daemon ``p2pd``) and
through the light client (``--light``: one Python process), against the same swarm in the same run.

Per call: wall time from spawn to exit, and the peak resident memory of the call's whole process tree
(the sum of VmRSS over the tree, sampled every 20 ms from /proc). Each call must list the 3 peers.
Writes ``bench/out/light[.quick].json`` and the ``light`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import md_table, median, provenance_md, standalone_main
from bench.procs import process_tree
from diloco_swarm.node.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent
NODE_ARGS = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "20",
             "--max-dataset-bytes", "300000", "--threads", "1", "--device", "cpu", "--matchmaking-time", "3",
             "--averaging-window", "30", "--host", "127.0.0.1", "--port", "0"]
PATHS = {"hivemind": [], "light": ["--light"]}
START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 120.0


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def call(path: str, maddr: str, run_id: str) -> dict:
    """One ``status --json``; its wall time, peak tree RSS, process names and the peers it listed."""
    cmd = [sys.executable, "-m", "diloco_swarm", "status", "--initial-peers", maddr, "--run-id", run_id, "--json",
           *PATHS[path]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    peak, names = 0, set()
    while proc.poll() is None:
        tree = process_tree(proc.pid)
        peak = max(peak, _rss_bytes(tree))
        for pid in tree:
            try:
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
        if time.perf_counter() - start > CALL_TIMEOUT_S:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.02)
    wall = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{path} status failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}")
    peers = sorted(p["peer_id"] for p in json.loads(out)["peers"])
    return {"path": path, "wall_s": round(wall, 3), "peak_rss_bytes": peak, "processes": sorted(names),
            "peers": peers}


def start_swarm(workdir: Path, run_id: str) -> tuple[list[subprocess.Popen], str]:
    procs, first = [], None
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("a", "b", "c"):
        d = workdir / name
        d.mkdir(parents=True)
        cmd = [sys.executable, "-m", "diloco_swarm", "join", "--run-id", run_id, *NODE_ARGS, "--name", name,
               "--state-dir", str(d / "state"), "--metrics-file", str(d / "metrics.jsonl")]
        if first is not None:
            cmd += ["--initial-peers", first]
        with open(d / "node.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                          start_new_session=True))
        if first is None:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not read_metrics(d / "metrics.jsonl", "start"):
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node a did not start; see {d / 'node.log'}")
                time.sleep(0.3)
            first = read_metrics(d / "metrics.jsonl", "start")[0]["maddrs"][0]
    return procs, first


def run(size: str) -> dict:
    repeats = {"smoke": 1, "quick": 2, "full": 5}[size]
    run_id = f"bench-light-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="bench-light-") as tmp:
        procs, maddr = start_swarm(Path(tmp), run_id)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(call("light", maddr, run_id)["peers"]) < 3:  # all three records readable
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the 3 records never showed up; see {tmp}/*/node.log")
                time.sleep(2.0)
            calls = []
            for _ in range(repeats):
                for path in PATHS:
                    calls.append(call(path, maddr, run_id))
                    c = calls[-1]
                    print(f"[light] {path}: {c['wall_s']:.2f} s, peak {c['peak_rss_bytes'] / 2**20:.0f} MiB, "
                          f"{len(c['peers'])} peers, processes {c['processes']}", file=sys.stderr, flush=True)
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=30)
    if any(len(c["peers"]) != 3 for c in calls):
        raise RuntimeError(f"a status call did not list the 3 peers: {[c['peers'] for c in calls]}")
    med = {path: {"wall_s": median([c["wall_s"] for c in calls if c["path"] == path]),
                  "peak_rss_bytes": median([c["peak_rss_bytes"] for c in calls if c["path"] == path])}
           for path in PATHS}
    ratios = {"wall": round(med["hivemind"]["wall_s"] / med["light"]["wall_s"], 2),
              "peak_rss": round(med["hivemind"]["peak_rss_bytes"] / med["light"]["peak_rss_bytes"], 2)}
    return {"repeats": repeats, "calls": calls, "median": med, "ratio_hivemind_over_light": ratios}


def section(result: dict, source: Path) -> str:
    med, ratio = result["median"], result["ratio_hivemind_over_light"]
    procs = {p: sorted({n for c in result["calls"] if c["path"] == p for n in c["processes"]}) for p in PATHS}
    rows = [[p, f"{med[p]['wall_s']:.2f} s", f"{med[p]['peak_rss_bytes'] / 2**20:.0f} MiB", ", ".join(procs[p])]
            for p in PATHS]
    size = result["size"]
    return (f"<!-- bench:light size={size} -->\n## 9. `status` through the light client vs hivemind "
            "(`python -m bench.light`)\n\n"
            + ("" if size == "full" else "> **Toy size**: run `python -m bench.light` for the full-size figures.\n\n")
            + "One 3-node swarm (tiny model, training) on 127.0.0.1; `diloco-node status --json` alternately through "
            "hivemind (a client-mode DHT: a forked DHT process and the go-libp2p daemon) and through the py-libp2p "
            f"light client (`--light`), {result['repeats']} call(s) each, medians. Wall time from spawn to exit; "
            "peak memory = the largest sum of VmRSS over the call's process tree (sampled every 20 ms). Every call "
            "listed the 3 peers.\n\n"
            + md_table(["path", "wall time", "peak RSS (tree)", "processes"], rows)
            + f"\nThe light client is **{ratio['wall']:.1f}×** faster and uses **{ratio['peak_rss']:.1f}×** less "
            "memory (hivemind / light). Most of a light call is Python start-up and importing py-libp2p; the DHT "
            "reads themselves take tens of milliseconds (docs/light-client.md).\n\n"
            + provenance_md(result, source) + "<!-- /bench:light -->\n")


def _summary(result: dict) -> str:
    r = result["ratio_hivemind_over_light"]
    return f"status, hivemind / light: wall time {r['wall']}×, peak RSS {r['peak_rss']}×"


def main(argv: list[str] | None = None) -> int:
    return standalone_main("light", __doc__, run, section, _summary,
                           quick_help="2 calls per path instead of 5", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
