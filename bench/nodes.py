"""Real ``diloco-node join`` processes run to ``--max-outer-steps``, with their process trees' CPU time.

Shared by ``bench/overlap.py`` (peers in network namespaces), ``bench/speeds.py`` and ``bench/scale.py``
(127.0.0.1).
A *group* is one run id: its first node starts alone, the others bootstrap from its address.
While the nodes run, the CPU seconds (utime + stime, /proc/PID/stat) of every process of every
node's tree are sampled about once a second, so a window defined by the nodes' own metrics
records can be charged the CPU each process used in it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.procs import cpu_seconds, process_tree, pss_bytes
from diloco_swarm.node.report import read_metrics

START_TIMEOUT_S = 300.0  # torch + hivemind imports and the dataset on a busy 2-core machine
NODE = ["-m", "diloco_swarm"]
FAULTY_NODE = ["-m", "tests.faults"]  # diloco-node with `--fault NAME[=VALUE]` (tests/faults.py; run from REPO)


@dataclass
class NodeSpec:
    """One node: its run id (nodes of one run id average together), placement and flags."""

    name: str
    run_id: str
    args: list[str]
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]
    host: str = "127.0.0.1"
    join_after_step: int = 0  # a joiner starts once the first node applied this outer step (a state download)
    entry: list[str] = field(default_factory=lambda: list(NODE))  # what python runs: NODE or FAULTY_NODE


@dataclass
class NodeRun:
    spec: NodeSpec
    metrics: Path
    log: Path
    proc: subprocess.Popen | None = None
    # [(time.time(), {pid: (comm, cpu seconds)})], one per poll
    cpu_samples: list[tuple[float, dict[int, tuple[str, float]]]] = field(default_factory=list)
    # [(time.time(), {pid: (comm, PSS bytes)})], one per poll, when run_nodes(sample_memory=True)
    pss_samples: list[tuple[float, dict[int, tuple[str, int]]]] = field(default_factory=list)
    exit_code: int | None = None

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_metrics(self.metrics, kind)

    def cpu_by_role(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each process of the tree used between ``t0`` and ``t1`` (time.time()), by role:
        ``training`` (the node's own process: inner steps, its averaging and housekeeping threads),
        ``p2pd`` (libp2p daemons), ``forked-1``, ``forked-2``... (hivemind's forked DHT and averager
        processes, in the order they started). From the samples nearest to ``t0`` and ``t1``."""
        if not self.cpu_samples:
            return {}
        a = min(self.cpu_samples, key=lambda s: abs(s[0] - t0))[1]
        b = min(self.cpu_samples, key=lambda s: abs(s[0] - t1))[1]
        root = self.proc.pid if self.proc else None
        forked = sorted(p for p, (comm, _) in b.items() if p != root and not comm.startswith("p2pd"))
        out: dict[str, float] = {}
        for pid, (comm, cpu) in b.items():
            if pid == root:
                role = "training"
            elif comm.startswith("p2pd"):
                role = "p2pd"
            else:
                role = f"forked-{forked.index(pid) + 1}"
            out[role] = out.get(role, 0.0) + cpu - a.get(pid, (comm, 0.0))[1]
        return out


def run_nodes(specs: list[NodeSpec], workdir: Path, timeout: float, env: dict[str, str] | None = None,
              log_tag: str = "", cwd: Path = REPO, sample_memory: bool = False) -> list[NodeRun]:
    """Start ``specs`` (each run id's first node first, the others through its address), wait until
    every node exits by itself (``--max-outer-steps`` in their args), sampling CPU (and with
    ``sample_memory`` the PSS of every process of every tree, :func:`bench.procs.pss_bytes`);
    SIGINT then SIGKILL whatever is left on timeout or error. ``cwd``: the checkout whose
    ``diloco_swarm`` the nodes run (``python -m`` imports it from there).
    :raises RuntimeError: a node failed to start or the nodes did not finish in ``timeout`` s."""
    workdir.mkdir(parents=True, exist_ok=True)
    runs = [NodeRun(s, workdir / f"{s.name}.jsonl", workdir / f"{s.name}.log") for s in specs]
    handles = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}

    def start(r: NodeRun, initial: str | None) -> None:
        s = r.spec
        cmd = [*s.prefix, sys.executable, *s.entry, "join", "--run-id", s.run_id, "--host", s.host,
               "--port", "0", *s.args, "--state-dir", str(workdir / f"state-{s.name}"),
               "--metrics-file", str(r.metrics), *(["--initial-peers", initial] if initial else [])]
        log = open(r.log, "w")
        handles.append(log)
        r.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    def first_maddr(r: NodeRun, deadline: float) -> str:
        while True:
            starts = r.records("start")
            if starts and starts[-1].get("maddrs"):
                return starts[-1]["maddrs"][0]
            if r.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log_tag}{r.spec.name} did not start:\n{r.log.read_text()[-3000:]}")
            time.sleep(0.3)

    try:
        firsts: dict[str, NodeRun] = {}
        for r in runs:  # the first node of every run id: they start side by side
            if r.spec.run_id not in firsts:
                firsts[r.spec.run_id] = r
                start(r, None)
        deadline = time.monotonic() + START_TIMEOUT_S

        def poll() -> None:
            now = time.time()
            for r in runs:
                if r.proc is not None and r.proc.poll() is None:
                    tree = process_tree(r.proc.pid)
                    r.cpu_samples.append((now, cpu_seconds(tree)))
                    if sample_memory:
                        r.pss_samples.append((now, pss_bytes(tree)))

        for r in runs:
            if r.proc is None:
                first = firsts[r.spec.run_id]
                maddr = first_maddr(first, deadline)
                while r.spec.join_after_step and first.proc.poll() is None and not any(
                        e["outer_step"] >= r.spec.join_after_step for e in first.records("outer_step")):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{log_tag}{first.spec.name} did not reach outer step {r.spec.join_after_step}")
                    poll()
                    time.sleep(1.0)
                start(r, maddr)
        deadline = time.monotonic() + timeout
        while any(r.proc.poll() is None for r in runs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{log_tag}nodes did not finish in {timeout:.0f} s")
            poll()
            time.sleep(1.0)
        for r in runs:
            r.exit_code = r.proc.returncode
    finally:
        for r in runs:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGINT)
        for r in runs:
            if r.proc is None:
                continue
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for pid in process_tree(r.proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                r.proc.wait(timeout=10)
            if r.exit_code is None:
                r.exit_code = r.proc.returncode
        for h in handles:
            h.close()
    return runs


def steady_window(records: list[dict[str, Any]], first_ok: int | None = None) -> tuple[dict, dict] | None:
    """(first, last) ``outer_step`` record of the steady window, or None when it has under 2 rounds.

    It starts at the first record whose round averaged with ``first_ok`` members (None: the second
    record; start-up, data loading and the first matchmaking excluded) and ends at the second-to-last
    record: with ``--max-outer-steps`` the last round has no next phase to hide behind, so an
    overlapped node waits for it (a blocking one waits for every round anyway).
    """
    steps = [e for e in records if e.get("event") == "outer_step"]
    if first_ok is None:
        start = 1
    else:
        start = next((i for i, e in enumerate(steps) if e.get("group_size") == first_ok and e.get("round_ok")), None)
        if start is None:
            return None
    end = len(steps) - 2
    if end - start < 2:
        return None
    return steps[start], steps[end]


def window_figures(run: NodeRun, window: tuple[dict, dict] | None) -> dict[str, Any]:
    """Tokens per wall second, utilization, waits and CPU of one node over its steady window."""
    steps = [e for e in run.records() if e.get("event") == "outer_step"]
    out: dict[str, Any] = {
        "exit_code": run.exit_code,
        "outer_steps": len(steps),
        "rounds_ok": sum(1 for e in steps if e.get("round_ok")),
        "group_sizes": [e.get("group_size") for e in steps],
        "inner_steps": [e.get("inner_steps") for e in steps],
        "applied_at_inner_step": [e.get("applied_at_inner_step") for e in steps],
        "round_wall_s": [e.get("round_wall_s") for e in steps],
        "previewed_tensors": [e.get("previewed_tensors") for e in steps],
        "preview_lead_s": [e.get("preview_lead_s") for e in steps],
        "averaging_s": [e.get("averaging_s") for e in steps],
        "reasons": sorted({e.get("reason") for e in steps if e.get("reason")}),
        "log_tail": "" if run.exit_code == 0 else run.log.read_text(errors="replace")[-2000:],
    }
    if window is None:
        return out
    a, b = window
    dwall = b["wall_s"] - a["wall_s"]
    dtok = b["tokens_total"] - a["tokens_total"]
    dinner = b["inner_s"] - a["inner_s"]
    rounds = b["outer_step"] - a["outer_step"]
    inner_steps = sum(e.get("inner_steps") or 0 for e in steps if a["outer_step"] < e["outer_step"] <= b["outer_step"])
    cpu = run.cpu_by_role(a["time"], b["time"])
    out.update({
        "window_outer_steps": [a["outer_step"], b["outer_step"]],
        "window_wall_s": dwall,
        "window_rounds": rounds,
        "window_inner_steps": inner_steps,
        "tokens_per_s": dtok / dwall if dwall > 0 else None,
        "inner_tokens_per_s": dtok / dinner if dinner > 0 else None,
        "utilization": dinner / dwall if dwall > 0 else None,
        "inner_s_per_round": dinner / rounds if rounds else None,
        "waited_s": b["averaging_total_s"] - a["averaging_total_s"],
        "eval_s": (b.get("eval_s") or 0.0) - (a.get("eval_s") or 0.0),
        "cpu_s": cpu,
        "cpu_s_per_round": {k: v / rounds for k, v in cpu.items()} if rounds else None,
        "training_cpu_s_per_inner_step": cpu.get("training", 0.0) / inner_steps if inner_steps else None,
        "group_members": [sorted(e.get("group") or []) for e in steps
                          if a["outer_step"] < e["outer_step"] <= b["outer_step"]],
    })
    return out


def round_key(record: dict[str, Any]) -> Any:
    """What identifies the round of an ``outer_step`` record: hivemind's group id, or for records
    without one (older runs) the outer step and the group's members. A late round keeps its outer
    step, and members of mixed steps meet in one round, so the step alone does not tell rounds apart."""
    return record.get("group_id") or (record["outer_step"], tuple(sorted(record.get("group") or [])))


def theta_by_step(records: list[dict[str, Any]]) -> dict[int, str]:
    """outer step -> digest of the θ_global a node held at the end of that step, from its metrics records.

    A round record gives it, unless the node re-synced during that round (a ``state_sync`` event
    between the round's ``averaging_start`` and its record: the record's ``theta_digest`` is then
    the θ before the re-sync, and ``synced_to`` stays null when the re-sync landed on the same
    outer step); a ``state_sync`` event gives the adopted state's digest.
    """
    out: dict[int, str] = {}
    synced_this_round = False
    for e in records:
        kind = e.get("event")
        if kind in ("averaging_start", "start"):
            synced_this_round = False
        elif kind == "state_sync":
            out[e["outer_step"]] = e["theta_digest"]
            synced_this_round = True
        elif kind == "outer_step" and e.get("synced_to") is None and not synced_this_round:
            out[e["outer_step"]] = e["theta_digest"]
    return out


def keep_logs(workdir: Path, dest: Path) -> None:
    """Copy the nodes' metrics and logs (not checkpoints, keys or locks) from ``workdir`` to ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    for f in list(workdir.glob("*.jsonl")) + list(workdir.glob("*.log")):
        shutil.copy2(f, dest / f.name)
