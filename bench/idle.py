"""CPU use of a lone peer waiting for an averaging group: hivemind's stock matchmaking vs ours.

Run: ``python -m bench.idle [--quick]``. Starts one real ``diloco_swarm join`` process on
127.0.0.1 (tiny model, 5 inner steps, a 60 s averaging window) per trial. Once it is in
matchmaking (its ``averaging_start`` event, plus 3 s), the CPU time of its whole process tree
(node, DHT and averager processes, p2pd) is read from /proc over a fixed window. Trials alternate:

- ``stock``: ``DILOCO_GROUP_POLL_S=0``, hivemind's matchmaking as shipped (it re-reads the group key
  from the DHT as soon as the last read returns);
- ``paced``: the default, at most one read per 0.25 s (diloco_swarm/utils/hivemind_fixes.py).

Writes ``bench/out/idle[.quick].json`` and the ``idle`` section of ``docs/benchmarks.md``.
A lone peer in matchmaking is common: the first to finish its inner steps, a swarm of one, a
client with no public peer. Its CPU is taken from the trainers on the same machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import md_table, median, provenance_md, standalone_main
from bench.procs import cpu_seconds, process_tree
from diloco_swarm.node.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"stock": "0", "paced": None}
NODE_ARGS = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "5",
             "--max-dataset-bytes", "300000", "--threads", "1", "--device", "cpu", "--matchmaking-time", "3",
             "--averaging-window", "60", "--sync-mode", "blocking", "--host", "127.0.0.1", "--port", "0"]
START_TIMEOUT_S = 240.0


def trial(variant: str, window_s: float, workdir: Path) -> dict:
    """One lone node; its CPU over ``window_s`` seconds of matchmaking, in % of one core."""
    d = workdir / f"{variant}-{time.monotonic_ns()}"
    d.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DILOCO_GROUP_POLL_S", None)
    if VARIANTS[variant] is not None:
        env["DILOCO_GROUP_POLL_S"] = VARIANTS[variant]
    metrics = d / "metrics.jsonl"
    cmd = [sys.executable, "-m", "diloco_swarm", "join", "--run-id", f"idle-{d.name}", *NODE_ARGS,
           "--state-dir", str(d / "state"), "--metrics-file", str(metrics)]
    with open(d / "node.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not read_metrics(metrics, "averaging_start"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: the node did not reach matchmaking; see {d / 'node.log'}")
            time.sleep(0.2)
        time.sleep(3.0)
        before = cpu_seconds(process_tree(proc.pid))
        time.sleep(window_s)
        after = cpu_seconds(process_tree(proc.pid))
        if read_metrics(metrics, "outer_step"):
            raise RuntimeError(f"{variant}: the averaging window ended inside the measurement")
        per_process = {f"{after[p][0]}[{p}]": round(100 * (after[p][1] - before[p][1]) / window_s, 1)
                       for p in after if p in before}
        return {"variant": variant, "cpu_percent_of_core": round(sum(per_process.values()), 1),
                "per_process": per_process, "window_s": window_s}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def run(size: str) -> dict:
    window, repeats = {"smoke": (3.0, 1), "quick": (8.0, 1), "full": (20.0, 3)}[size]
    trials = []
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        for _ in range(repeats):
            for variant in VARIANTS:
                trials.append(trial(variant, window, Path(tmp)))
                print(f"[idle] {trials[-1]['variant']}: {trials[-1]['cpu_percent_of_core']}% of a core "
                      f"{trials[-1]['per_process']}", file=sys.stderr, flush=True)
    summary = {v: median([t["cpu_percent_of_core"] for t in trials if t["variant"] == v]) for v in VARIANTS}
    return {"window_s": window, "repeats": repeats, "trials": trials, "median_cpu_percent_of_core": summary}


def section(result: dict, source: Path) -> str:
    size = result["size"]
    med = result["median_cpu_percent_of_core"]
    rows = [[v, f"{med[v]:.1f}%", ", ".join(f"{t['cpu_percent_of_core']:.0f}%" for t in result["trials"]
                                            if t["variant"] == v)] for v in VARIANTS]
    ratio = med["stock"] / max(med["paced"], 0.1)
    return (f"<!-- bench:idle size={size} -->\n## 7. A lone peer waiting for a group (`python -m bench.idle`)\n\n"
            + ("" if size == "full" else "> **Toy size**: run `python -m bench.idle` for the full-size figures.\n\n")
            + "One tiny-model node alone on 127.0.0.1, in matchmaking (a 60 s averaging window, nobody to average "
            f"with). CPU time of its whole process tree over {result['window_s']:.0f} s, in % of one core, median of "
            f"{result['repeats']} alternating trial(s). *stock*: hivemind's matchmaking as shipped "
            "(`DILOCO_GROUP_POLL_S=0`: it re-reads the group key from the DHT as soon as the last read returns); "
            "*paced*: ours (at most one read per 0.25 s, `diloco_swarm/utils/hivemind_fixes.py`).\n\n"
            + md_table(["variant", "CPU (median)", "trials"], rows)
            + f"\nPacing cuts a waiting peer's CPU by **{ratio:.0f}×**; a leader that appears is seen at most "
            "0.25 s later.\n\n" + provenance_md(result, source) + "<!-- /bench:idle -->\n")


def main(argv: list[str] | None = None) -> int:
    return standalone_main("idle", __doc__, run, section, lambda r: f"median CPU of a lone peer in matchmaking: {r['median_cpu_percent_of_core']} (% of a core)",
                           quick_help="one 8 s trial per variant instead of three of 20 s", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
