"""``diloco-node demo``: a local swarm of real ``diloco-node join`` processes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

STARTUP_TIMEOUT_S = 120.0


def node_command(*args: str) -> list[str]:
    """The command line of a ``diloco-node`` child process (same interpreter as ours)."""
    return [sys.executable, "-m", "diloco_swarm", *args]


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        print(f"{prefix} {line.rstrip()}", file=sys.stderr, flush=True)


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def run_demo(*, peers: int, outer_steps: int, inner_steps: int, port: int, workdir: Path, dataset: str | None,
             console: Console) -> int:
    """Start ``peers`` nodes, wait for them to finish ``outer_steps``, print a summary.

    :returns: 0 when every node exited 0, else 1 (2 if the first node could not start).
    """
    run_dir = workdir / time.strftime("run-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    common = [
        "--run-id", f"demo-{run_dir.name[4:]}",
        "--host", "127.0.0.1",
        "--model", "tiny",
        "--inner-steps", str(inner_steps),
        "--seq-len", "128",
        "--batch-size", "8",
        "--max-outer-steps", str(outer_steps),
        "--matchmaking-time", "3",
        "--averaging-window", "30",
        "--max-dataset-bytes", str(8_000_000),
        "--device", "cpu",
        "--threads", "1",
        "--wait-for-peers", str(peers),
    ]
    if dataset:
        common += ["--dataset", dataset]
    procs: list[subprocess.Popen] = []
    metrics = [run_dir / f"peer-{i}" / "metrics.jsonl" for i in range(peers)]

    def start(i: int, extra: list[str]) -> None:
        cmd = node_command("join", *common, "--state-dir", str(run_dir / f"peer-{i}"),
                           "--metrics-file", str(metrics[i]), *extra)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=_pump, args=(proc.stdout, f"[peer {i}]"), daemon=True).start()
        procs.append(proc)

    console.print(f"demo: {peers} nodes, {outer_steps} outer steps of H={inner_steps}; files in {run_dir}")
    try:
        start(0, ["--port", str(port)])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        maddrs: list[str] = []
        while not maddrs:
            if procs[0].poll() is not None:
                console.print("demo: the first node exited before it started; see its messages above")
                return 2
            if time.monotonic() > deadline:
                console.print("demo: the first node did not start in time")
                return 2
            maddrs = next((e["maddrs"] for e in _read_events(metrics[0]) if e.get("event") == "start"), [])
            time.sleep(0.3)
        for i in range(1, peers):
            start(i, ["--port", "0", "--initial-peers", maddrs[0]])
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        console.print("demo: stopping the nodes (they write their checkpoints)...")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        return 130

    table = Table(title="demo summary")
    for col in ("peer", "exit", "outer steps", "averaged rounds", "first eval loss", "last eval loss"):
        table.add_column(col)
    for i, code in enumerate(codes):
        events = _read_events(metrics[i])
        steps = [e for e in events if e.get("event") == "outer_step"]
        evals = [e["eval_loss"] for e in events if e.get("eval_loss") is not None]
        table.add_row(
            str(i), str(code), str(len(steps)), str(sum(1 for e in steps if e["round_ok"])),
            f"{evals[0]:.3f}" if evals else "-", f"{evals[-1]:.3f}" if evals else "-",
        )
    console.print(table)
    return 0 if all(c == 0 for c in codes) else 1
