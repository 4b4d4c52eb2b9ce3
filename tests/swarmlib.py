"""The process harness of the tests and the benchmarks (bench/ imports it as ``tests.swarmlib``): real
``diloco-node join`` processes, their metrics records and their process trees.

A node is several processes: the main one, forked hivemind DHT and averager processes, and a p2pd
daemon. A crash of the whole peer (machine down, container killed) kills all of them (:func:`kill_tree`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco_swarm.node.report import read_metrics

FAULTY_NODE = [str(Path(__file__).resolve().parent / "faults.py")]  # what a node with --fault runs (tests/faults.py)
TICK = os.sysconf("SC_CLK_TCK")

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
    lives: list[dict] = field(default_factory=list)  # one per start: launched, and ended, how, code once it ended

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

    def end_life(self, how: str) -> None:
        """Note how the current process life ended (killed, sigint, exited, cleanup), once."""
        if self.lives and "ended" not in self.lives[-1]:
            self.lives[-1].update(ended=time.time(), how=how, code=self.proc.returncode)


class Swarm:
    """Starts nodes, waits on their metrics, and always cleans up (use as a context manager).

    :param base: the flags every node gets first (the tests' :data:`FAST_ARGS`; a benchmark gives its own).
    :param env: added to every node's environment; ``cwd``: where the nodes run (the checkout they import).
    """

    def __init__(self, root: Path, run_id: str, extra: list[str] | None = None, *, base: list[str] = FAST_ARGS,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.root, self.run_id, self.extra, self.base = root, run_id, list(extra or []), list(base)
        self.env, self.cwd = dict(env or {}), cwd
        root.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, NodeProc] = {}

    def start(self, name: str, *args: str, initial: "NodeProc | list[str] | None" = None, wait_start: bool = True,
              timeout: float = 180, wrap: list[str] | None = None, initial_host: str | None = None,
              session: bool = False, entry: list[str] | None = None, run_id: str | None = None) -> NodeProc:
        """Start node ``name`` (again, with the same state dir if it ran before).

        :param initial: a node to dial (its address on ``initial_host``, default its first), or multiaddrs.
        :param wrap: command prefix, e.g. ``ip netns exec NS`` to run it inside a network namespace.
        :param session: start it in its own session and process group (pid = group id), as a shell
            or a service manager does, so a test can signal its whole group (``os.killpg``).
        :param entry: what python runs instead of ``-m diloco_swarm`` (a test's node subclass, e.g.
            ``[path of tests/census_node.py]``); the same arguments follow. A node given ``--fault``
            (here or in the swarm's ``extra``) runs tests/faults.py, the faulty node, unless told otherwise.
        :param run_id: this node's run id instead of the swarm's.
        """
        node = self.nodes.get(name)
        if node is None:
            d = self.root / name
            node = NodeProc(name, d, d / "metrics.jsonl", self.root / f"{name}.log", [])
            self.nodes[name] = node
        if entry is None and "--fault" in (*self.extra, *args):
            entry = FAULTY_NODE
        cmd = [*(wrap or []), sys.executable, *(entry or ["-m", "diloco_swarm"]), "join", "--run-id",
               run_id or self.run_id, *self.base, *self.extra, "--state-dir", str(node.state_dir),
               "--metrics-file", str(node.metrics), "--port", "0", *args]
        for addr in [initial.maddr(initial_host)] if isinstance(initial, NodeProc) else initial or []:
            cmd += ["--initial-peers", addr]
        node.args = cmd
        log = open(node.log, "a")
        node.log_handles.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        node.lives.append({"launched": time.time()})
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                     start_new_session=session)
        if wait_start:
            n_starts = len(node.events("start"))
            self.wait(lambda: len(node.events("start")) > n_starts, timeout, f"{name} did not start", node)
        return node

    def wait(self, predicate, timeout: float, what: str, node: NodeProc | list[NodeProc] | None = None,
             poll: float = 0.3):
        """``predicate()``'s first true value; fails when ``node`` (or one of a list) exits first, or on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            for n in [node] if isinstance(node, NodeProc) else node or []:
                if n.proc is not None and n.proc.poll() is not None and not predicate():
                    raise AssertionError(f"{what}: {n.name} exited with {n.proc.returncode}\n{n.output()[-3000:]}")
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

    def leave(self, timeout: float = 60) -> dict[str, int | None]:
        """SIGINT every live node (a graceful leave) and wait for them: {name: exit code, None if still running}."""
        running = [n for n in self.nodes.values() if n.alive()]
        for node in running:
            node.proc.send_signal(signal.SIGINT)
        deadline, codes = time.monotonic() + timeout, {}
        for node in running:
            try:
                codes[node.name] = node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node.name] = None
            node.end_life("sigint")
        return codes

    def close(self) -> None:
        for node in self.nodes.values():
            if node.alive():
                kill_tree(node, "cleanup")
            elif node.proc is not None:
                node.end_life("exited")
            for h in node.log_handles:
                h.close()
        # orphans (p2pd daemons of SIGKILLed nodes, forked helpers): ours name a path below our root
        for pid in pids_mentioning(f"{self.root}/"):
            _signal(pid, signal.SIGKILL)

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


# --- what the records say ----------------------------------------------------------------------------

def theta_by_step(node: NodeProc | list[dict[str, Any]]) -> dict[int, str]:
    """outer step -> digest of the θ_global a node held at the end of that step, from its metrics records.

    A round record gives it, unless the node re-synced during that round (a ``state_sync`` event
    between the round's ``averaging_start`` and its record: the record's ``theta_digest`` is then
    the θ before the re-sync, and ``synced_to`` stays null when the re-sync landed on the same
    outer step); a ``state_sync`` event gives the adopted state's digest.
    """
    out: dict[int, str] = {}
    synced_this_round = False
    for e in node.events() if isinstance(node, NodeProc) else node:
        kind = e.get("event")
        if kind in ("averaging_start", "start"):
            synced_this_round = False
        elif kind == "state_sync":
            out[e["outer_step"]] = e["theta_digest"]
            synced_this_round = True
        elif kind == "outer_step" and e.get("synced_to") is None and not synced_this_round:
            out[e["outer_step"]] = e["theta_digest"]
    return out


def verified_digests(nodes: list[NodeProc]) -> dict[int, dict[str, str]]:
    """outer step -> {node name: digest of the θ_global it held there} (:func:`theta_by_step`), for the steps
    whose round each node verified."""
    digests: dict[int, dict[str, str]] = {}
    for node in nodes:
        held = theta_by_step(node)
        for r in node.outer_steps():
            if r["round_ok"] and r["outer_step"] in held:
                digests.setdefault(r["outer_step"], {})[node.name] = held[r["outer_step"]]
    return digests


def round_key(record: dict[str, Any]) -> Any:
    """What identifies the round of an ``outer_step`` record: hivemind's group id, or for records
    without one (older runs) the outer step and the group's members. A late round keeps its outer
    step, and members of mixed steps meet in one round, so the step alone does not tell rounds apart."""
    return record.get("group_id") or (record["outer_step"], tuple(sorted(record.get("group") or [])))


# --- process trees (from /proc; Linux only) ----------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants, parents first. ``[pid]`` alone if it has no children or has exited."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:  # the command name in (...) may hold spaces
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(children.get(tree[i], []))
        i += 1
    return tree


def pids_mentioning(text: str) -> list[int]:
    """Live processes (other than this one) whose command line contains ``text``."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != os.getpid() and text in (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _per_process(pids: list[int], read) -> dict[int, tuple[str, Any]]:
    out = {}
    for pid in pids:
        try:
            out[pid] = (Path(f"/proc/{pid}/comm").read_text().strip(), read(pid))
        except (OSError, StopIteration):
            continue
    return out


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """{pid: (comm, user + system CPU seconds so far)} for the live ones of ``pids`` (/proc/PID/stat)."""
    def read(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    return _per_process(pids, read)


def pss_bytes(pids: list[int]) -> dict[int, tuple[str, int]]:
    """{pid: (comm, proportional set size in bytes)} for the live ones of ``pids`` (/proc/PID/smaps_rollup:
    pages shared by N processes count 1/N in each, so a tree's sum is what it holds of the machine's memory)."""
    return _per_process(pids, lambda pid: 1024 * next(int(line.split()[1]) for line in Path(
        f"/proc/{pid}/smaps_rollup").read_text().splitlines() if line.startswith("Pss:")))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(node: NodeProc, how: str = "killed") -> list[int]:
    """SIGKILL a node and every process it started; returns the pids signalled."""
    if not node.alive():
        return []
    pids = process_tree(node.proc.pid)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    node.proc.wait(timeout=30)
    node.end_life(how)
    return pids
