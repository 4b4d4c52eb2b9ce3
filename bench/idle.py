"""CPU use of a lone peer waiting for an averaging group: hivemind's stock matchmaking vs ours (paced).

``python -m bench.idle [--quick]``: one real node on 127.0.0.1 per trial, alone in matchmaking (a 60 s
averaging window); from its ``averaging_start`` record plus 3 s, the CPU time of its whole process tree over a
fixed window. *stock*: ``DILOCO_GROUP_POLL_S=0``, hivemind's matchmaking as shipped; *paced*: the default.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.common import md_table, median
from tests.swarmlib import Swarm, cpu_seconds, process_tree

VARIANTS = {"stock": {"DILOCO_GROUP_POLL_S": "0"}, "paced": {}}
NODE_ARGS = ["--host", "127.0.0.1", "--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "5",
             "--max-dataset-bytes", "300000", "--threads", "1", "--device", "cpu", "--matchmaking-time", "3",
             "--averaging-window", "60", "--sync-mode", "blocking"]
START_TIMEOUT_S = 240.0


def trial(variant: str, window_s: float, root: Path) -> dict:
    """One lone node; its CPU over ``window_s`` seconds of matchmaking, in % of one core."""
    with Swarm(root / f"{variant}-{time.monotonic_ns()}", f"idle-{time.monotonic_ns()}", base=NODE_ARGS,
               env={"OMP_NUM_THREADS": "1", **VARIANTS[variant]}) as swarm:
        node = swarm.start("node", timeout=START_TIMEOUT_S)
        swarm.wait(lambda: node.events("averaging_start"), START_TIMEOUT_S, "matchmaking", node)
        time.sleep(3.0)
        before = cpu_seconds(process_tree(node.proc.pid))
        time.sleep(window_s)
        after = cpu_seconds(process_tree(node.proc.pid))
        if node.events("outer_step"):
            raise RuntimeError(f"{variant}: the averaging window ended inside the measurement")
    per_process = {f"{after[p][0]}[{p}]": round(100 * (after[p][1] - before[p][1]) / window_s, 1)
                   for p in after if p in before}
    return {"variant": variant, "cpu_percent_of_core": round(sum(per_process.values()), 1),
            "per_process": per_process, "window_s": window_s}


def run(size: str) -> dict:
    window, repeats = {"smoke": (3.0, 1), "quick": (8.0, 1), "full": (20.0, 3)}[size]
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        trials = [trial(variant, window, Path(tmp)) for _ in range(repeats) for variant in VARIANTS]
    summary = {v: median([t["cpu_percent_of_core"] for t in trials if t["variant"] == v]) for v in VARIANTS}
    return {"window_s": window, "repeats": repeats, "trials": trials, "median_cpu_percent_of_core": summary}


def render(result: dict, docs_dir: Path) -> str:
    med = result["median_cpu_percent_of_core"]
    rows = [[v, f"{med[v]:.1f}%", ", ".join(f"{t['cpu_percent_of_core']:.0f}%" for t in result["trials"]
                                            if t["variant"] == v)] for v in VARIANTS]
    return (f"CPU time of the whole process tree over {result['window_s']:.0f} s, in % of one core, median of "
            f"{result['repeats']} alternating trial(s):\n\n" + md_table(["variant", "CPU (median)", "trials"], rows)
            + f"\nPacing cuts a waiting peer's CPU by **{med['stock'] / max(med['paced'], 0.1):.0f}×**.\n")


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="idle"))
