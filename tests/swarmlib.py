"""Helpers for multi-process swarm tests: real ``diloco-node join`` processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.nodes import theta_by_step as records_theta_by_step
from bench.procs import process_tree
from diloco_swarm.node.report import read_metrics

FAULTY_NODE = [str(Path(__file__).resolve().parent / "faults.py")]  # what a node with --fault runs (tests/faults.py)

# Small and fast: tiny model, short sequences, a 300 KB slice of the standard library.
FAST_ARGS = [
    "--host", "127.0.0.1",
    "--model", "tiny",
    "--seq-len", "64",
    "--batch-size", "4",
    "--inner-steps", "10",
    "--max-dataset-bytes", "300000",
    "--threads", "1",
    "--device", "cpu",
    "--matchmaking-time", "3",
    "--averaging-window", "40",
    "--allreduce-timeout", "20",
    "--eval-budget", "1",  # evaluate after every round: the tests compare held-out losses step by step
]


@dataclass
class NodeProc:
    name: str
    state_dir: Path
    metrics: Path
    log: Path
    args: list[str]
    proc: subprocess.Popen | None = None
    log_handles: list = field(default_factory=list)

    def events(self, kind: str | None = None) -> list[dict]:
        return read_metrics(self.metrics, kind)

    def outer_steps(self) -> list[dict]:
        return self.events("outer_step")

    def maddr(self, host: str | None = None) -> str:
        """The node's first multiaddr, or its first on ``host`` (an IPv4 address)."""
        addrs = next(e["maddrs"] for e in self.events("start"))
        return next(a for a in addrs if host is None or a.startswith(f"/ip4/{host}/"))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Swarm:
    """Starts nodes, waits on their metrics, and always cleans up (use as a context manager)."""

    def __init__(self, root: Path, run_id: str, extra: list[str] | None = None):
        self.root, self.run_id, self.extra = root, run_id, list(extra or [])
        self.nodes: dict[str, NodeProc] = {}

    def start(self, name: str, *args: str, initial: "NodeProc | None" = None, wait_start: bool = True,
              timeout: float = 180, wrap: list[str] | None = None, initial_host: str | None = None,
              session: bool = False, entry: list[str] | None = None) -> NodeProc:
        """Start node ``name`` (again, with the same state dir if it ran before).

        :param wrap: command prefix, e.g. ``ip netns exec NS`` to run it inside a network namespace.
        :param initial_host: dial ``initial`` on its address on this host (default: its first address).
        :param session: start it in its own session and process group (pid = group id), as a shell
            or a service manager does, so a test can signal its whole group (``os.killpg``).
        :param entry: what python runs instead of ``-m diloco_swarm`` (a test's node subclass, e.g.
            ``[path of tests/census_node.py]``); the same arguments follow. A node given ``--fault``
            (here or in the swarm's ``extra``) runs tests/faults.py, the faulty node, unless told otherwise.
        """
        node = self.nodes.get(name)
        if node is None:
            d = self.root / name
            node = NodeProc(name, d, d / "metrics.jsonl", self.root / f"{name}.log", [])
            self.nodes[name] = node
        if entry is None and "--fault" in (*self.extra, *args):
            entry = FAULTY_NODE
        cmd = [*(wrap or []), sys.executable, *(entry or ["-m", "diloco_swarm"]), "join", "--run-id", self.run_id, *FAST_ARGS, *self.extra,
               "--state-dir", str(node.state_dir), "--metrics-file", str(node.metrics), "--port", "0", *args]
        if initial is not None:
            cmd += ["--initial-peers", initial.maddr(initial_host)]
        node.args = cmd
        log = open(node.log, "a")
        node.log_handles.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=session)
        if wait_start:
            n_starts = len(node.events("start"))
            self.wait(lambda: len(node.events("start")) > n_starts, timeout, f"{name} did not start", node)
        return node

    def wait(self, predicate, timeout: float, what: str, node: NodeProc | None = None, poll: float = 0.3):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if node is not None and node.proc is not None and node.proc.poll() is not None and not predicate():
                raise AssertionError(f"{what}: {node.name} exited with {node.proc.returncode}\n{node.output()[-3000:]}")
            time.sleep(poll)
        logs = "\n".join(f"--- {n.name}\n{n.output()[-2000:]}" for n in self.nodes.values())
        raise AssertionError(f"timed out after {timeout}s: {what}\n{logs}")

    def wait_exit(self, node: NodeProc, timeout: float) -> int:
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{node.name} did not exit within {timeout}s\n{node.output()[-3000:]}")

    def kill(self, node: NodeProc, sig: int = signal.SIGKILL) -> None:
        if node.alive():
            node.proc.send_signal(sig)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.alive():
                node.proc.kill()
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for h in node.log_handles:
                h.close()
        # p2pd daemons of SIGKILLed nodes are orphans: end them too (only ours: matched by state dir).
        subprocess.run(["pkill", "-f", f"{self.root}/.*identity.key"], check=False)

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def theta_by_step(node: NodeProc) -> dict[int, str]:
    """outer step -> digest of the θ_global this node held at the end of that step
    (:func:`bench.nodes.theta_by_step` of its records)."""
    return records_theta_by_step(node.events())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_checkpoint(node: NodeProc) -> dict:
    return torch.load(node.state_dir / "checkpoint.pt", map_location="cpu", weights_only=True)


def load_theta(node: NodeProc) -> list[torch.Tensor]:
    return load_checkpoint(node)["outer"]["theta"]


def checkpoint_step(node: NodeProc, missing: int = -1) -> int:
    """The outer step of the node's checkpoint on disk (its θ_global checked finite); ``missing`` while
    there is none. Checkpoints replace each other by rename, so a read never sees half a file."""
    if not (node.state_dir / "checkpoint.pt").exists():
        return missing
    state = load_checkpoint(node)
    assert all(torch.isfinite(t).all() for t in state["outer"]["theta"]), f"{node.name}: non-finite θ_global"
    return int(state["outer_step"])


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(x.pow(2).sum()) for x in a)
    return (num / max(den, 1e-30)) ** 0.5


# --- process trees (churn tests) -------------------------------------------------------------
# A node is several processes: the main one, forked hivemind DHT and averager processes, and a
# p2pd daemon. A crash of the whole peer (machine down, container killed) kills all of them.


def kill_tree(node: NodeProc) -> list[int]:
    """SIGKILL a node and every process it started; returns the pids signalled."""
    if not node.alive():
        return []
    pids = process_tree(node.proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.proc.wait(timeout=30)
    return pids
