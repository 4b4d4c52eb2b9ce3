"""``diloco-node demo``: a local swarm of real ``diloco-node join`` processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from diloco_swarm.node.report import read_metrics

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0  # a node's graceful stop: leave the swarm, keep the checkpoint of its last outer step
KILL_GRACE_S = 5.0


def node_command(*args: str) -> list[str]:
    """The command line of a ``diloco-node`` child process (same interpreter as ours)."""
    return [sys.executable, "-m", "diloco_swarm", *args]


def _pump(stream, prefix: str, own_command: str = "diloco-node") -> None:
    for line in iter(stream.readline, ""):
        line = line.rstrip()
        if "to join from " in line:  # a node's join hint names diloco-node, which may not be on PATH here
            line = line.replace(": diloco-node join ", f": {own_command} join ", 1)
        print(f"{prefix} {line}", file=sys.stderr, flush=True)


def say(console: Console, line: str) -> None:
    """One line, never wrapped (the commands in it stay copy-pastable), never read as markup."""
    console.print(Text(line), soft_wrap=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_nodes(procs: list[subprocess.Popen], console: Console) -> None:
    """Ask each running node to stop (one SIGINT: it leaves the swarm and keeps its checkpoint) and wait
    up to ``STOP_TIMEOUT_S``. A Ctrl+C meanwhile, or the timeout, kills them instead."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    say(console, "demo: stopping the nodes; each keeps its last checkpoint, if it has one (Ctrl+C again to kill them at once)")
    for p in running:
        p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    try:
        for p in running:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return
    except KeyboardInterrupt:
        say(console, "demo: Ctrl+C again: killing the nodes (each keeps the checkpoint of its last outer step)")
    except subprocess.TimeoutExpired:
        say(console, f"demo: the nodes did not all stop within {STOP_TIMEOUT_S:.0f} s; killing them")
    kill_nodes(running)


def kill_nodes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (a node's second stop signal: it kills its own child processes and exits at once), then
    SIGKILL to each node's whole process group. Not interruptible: it takes at most ``KILL_GRACE_S``."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + KILL_GRACE_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:  # the node leads its process group: this also ends its DHT, averager and p2pd
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_demo(*, peers: int, outer_steps: int, inner_steps: int, port: int, workdir: Path, dataset: str | None,
             console: Console) -> int:
    """Start ``peers`` nodes, wait for them to finish ``outer_steps``, print a summary.

    Each node runs in its own process group, so a Ctrl+C in the terminal reaches only the demo,
    which then stops every node exactly once (:func:`stop_nodes`); SIGTERM and SIGHUP do the same.

    :returns: 0 when every node exited 0, else 1 (2 if the first node could not start; 130 when stopped).
    """
    run_dir = workdir / time.strftime("run-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"demo-{run_dir.name[4:]}"
    common = [
        "--run-id", run_id,
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
    own = _own_command()
    metrics = [run_dir / f"peer-{i}" / "metrics.jsonl" for i in range(peers)]

    def start(i: int, extra: list[str]) -> None:
        cmd = node_command("join", *common, "--state-dir", str(run_dir / f"peer-{i}"),
                           "--metrics-file", str(metrics[i]), *extra)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, process_group=0)
        threading.Thread(target=_pump, args=(proc.stdout, f"[peer {i}]", own), daemon=True).start()
        procs.append(proc)

    say(console, f"demo: run {run_id}, {peers} nodes, {outer_steps} outer steps of H={inner_steps}; files in {run_dir}")
    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then leaves it so
    handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        start(0, ["--port", str(port)])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        maddrs: list[str] = []
        while not maddrs:
            if procs[0].poll() is not None:
                say(console, "demo: the first node exited before it started; see its messages above")
                return 2
            if time.monotonic() > deadline:
                say(console, "demo: the first node did not start in time")
                stop_nodes(procs, console)
                return 2
            maddrs = next((e["maddrs"] for e in read_metrics(metrics[0]) if e.get("event") == "start"), [])
            time.sleep(0.3)
        say(console, f"demo: watch it with: {own} status --run-id {run_id} --initial-peers {maddrs[0]}")
        for i in range(1, peers):
            start(i, ["--port", "0", "--initial-peers", maddrs[0]])
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop_nodes(procs, console)
        say(console, f"demo: stopped; checkpoints and metrics are in {run_dir}")
        return 130
    except BaseException:
        kill_nodes(procs)  # never leave nodes behind
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    table, verdict = summarize(metrics, codes)
    console.print(table)
    if verdict:
        say(console, verdict)
    return 0 if all(c == 0 for c in codes) else 1


def summarize(metrics: list[Path], codes: list[int]) -> tuple[Table, str]:
    """The demo's summary table from each peer's ``metrics.jsonl`` and exit code, and a line saying
    whether the peers ended on one θ_global ("" when no digest was recorded)."""
    table = Table(title="demo summary")
    for col in ("peer", "exit", "outer step reached", "averaged rounds", "first eval loss", "last eval loss",
                "θ digest"):
        table.add_column(col)
    digests = []
    for i, code in enumerate(codes):
        events = read_metrics(metrics[i])
        steps = [e for e in events if e.get("event") == "outer_step"]
        evals = [e["eval_loss"] for e in events if e.get("eval_loss") is not None]
        # the last θ_global this peer held: after its last outer step, or a state it adopted since
        held = [e for e in events if e.get("theta_digest") and e.get("event") in ("outer_step", "state_sync")]
        digests.append(held[-1]["theta_digest"] if held else "")
        reached = max((e.get("outer_step") or 0 for e in held), default=0)
        table.add_row(
            str(i), str(code), str(reached), str(sum(1 for e in steps if e["round_ok"])),
            f"{evals[0]:.3f}" if evals else "-", f"{evals[-1]:.3f}" if evals else "-", digests[-1][:8] or "-",
        )
    lineages = len({d for d in digests if d})
    if lineages == 1 and all(digests):
        return table, f"demo: all {len(digests)} peers hold the same θ_global"
    if lineages > 1:
        return table, (f"demo: warning: the peers ended on {lineages} different θ_global: a peer that did not answer "
                       "when the others reached the last outer step finished alone (docs/architecture.md, Known limits)")
    return table, ""


def _own_command() -> str:
    """How to run ``diloco-node`` again from this shell: its name when it is on PATH (an activated
    venv, a pip install), else the path it was started from (``./diloco demo`` runs .venv/bin/diloco-node)."""
    if shutil.which("diloco-node"):
        return "diloco-node"
    launched = Path(sys.argv[0])
    return str(launched) if launched.name == "diloco-node" and launched.exists() else f"{sys.executable} -m diloco_swarm"
