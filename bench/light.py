"""``diloco-node status`` through the py-libp2p light client vs through hivemind: wall time and peak memory.

``python -m bench.light [--quick]``: 3 real nodes on 127.0.0.1; once all three records are readable,
``status --json`` alternately through hivemind (a client-mode DHT: a forked DHT process and ``p2pd``) and through
the light client (``--light``). Per call: spawn to exit, and the peak of the sum of VmRSS over its process tree
(sampled every 20 ms). Each call must list the 3 peers.
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

from bench.common import REPO, md_table, median
from tests.swarmlib import Swarm, process_tree

NODE_ARGS = ["--host", "127.0.0.1", "--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "20",
             "--max-dataset-bytes", "300000", "--threads", "1", "--device", "cpu", "--matchmaking-time", "3",
             "--averaging-window", "30"]
PATHS = {"hivemind": [], "light": ["--light"]}
START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 120.0


def _rss_bytes(pid: int) -> int:
    try:
        return 1024 * next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def call(path: str, maddr: str, run_id: str) -> dict:
    """One ``status --json``; its wall time, peak tree RSS, process names and the peers it listed."""
    cmd = [sys.executable, "-m", "diloco_swarm", "status", "--initial-peers", maddr, "--run-id", run_id, "--json",
           *PATHS[path]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, start_new_session=True)
    peak, names = 0, set()
    while proc.poll() is None:
        tree = process_tree(proc.pid)
        peak = max(peak, sum(_rss_bytes(p) for p in tree))
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
    return {"path": path, "wall_s": round(wall, 3), "peak_rss_bytes": peak, "processes": sorted(names),
            "peers": sorted(p["peer_id"] for p in json.loads(out)["peers"])}


def run(size: str) -> dict:
    repeats, run_id = {"smoke": 1, "quick": 2, "full": 5}[size], f"bench-light-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="bench-light-") as tmp, Swarm(Path(tmp), run_id, base=NODE_ARGS,
                                                                          env={"OMP_NUM_THREADS": "1"}) as swarm:
        a = swarm.start("a", "--name", "a", timeout=START_TIMEOUT_S)
        for name in ("b", "c"):
            swarm.start(name, "--name", name, initial=a, wait_start=False)
        maddr = a.maddr()
        swarm.wait(lambda: len(call("light", maddr, run_id)["peers"]) >= 3, START_TIMEOUT_S, "3 records", poll=2.0)
        calls = [call(path, maddr, run_id) for _ in range(repeats) for path in PATHS]
    if any(len(c["peers"]) != 3 for c in calls):
        raise RuntimeError(f"a status call did not list the 3 peers: {[c['peers'] for c in calls]}")
    med = {path: {k: median([c[k] for c in calls if c["path"] == path]) for k in ("wall_s", "peak_rss_bytes")}
           for path in PATHS}
    ratios = {"wall": round(med["hivemind"]["wall_s"] / med["light"]["wall_s"], 2),
              "peak_rss": round(med["hivemind"]["peak_rss_bytes"] / med["light"]["peak_rss_bytes"], 2)}
    return {"repeats": repeats, "calls": calls, "median": med, "ratio_hivemind_over_light": ratios}


def render(result: dict, docs_dir: Path) -> str:
    med, ratio = result["median"], result["ratio_hivemind_over_light"]
    rows = [[p, f"{med[p]['wall_s']:.2f} s", f"{med[p]['peak_rss_bytes'] / 2**20:.0f} MiB",
             ", ".join(sorted({n for c in result["calls"] if c["path"] == p for n in c["processes"]}))] for p in PATHS]
    return (f"{result['repeats']} call(s) each, medians:\n\n"
            + md_table(["path", "wall time", "peak RSS (tree)", "processes"], rows)
            + f"\nThe light client is **{ratio['wall']:.1f}×** faster and uses **{ratio['peak_rss']:.1f}×** less "
            "memory (hivemind / light).\n")


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="light"))
