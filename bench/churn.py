"""Goodput under churn: a calm swarm against one whose peers are killed and restarted.

Run: ``python -m bench.churn [--quick]``. Starts 4 real ``diloco_swarm join`` processes on
127.0.0.1 (tiny model), lets them train for a fixed wall time, twice in one invocation:

- ``calm``: nobody fails;
- ``churn``: a seeded schedule SIGKILLs the whole process tree of a random peer (the node, its
  forked hivemind processes and its p2pd daemon: a machine or container failure) about every
  20 s, and restarts it about 10 s later with the same ``--state-dir`` (``--wait-for-peers 0``,
  ``--initial-peers`` = every live peer's current address).

Then every live node gets SIGINT (graceful leave) and the bench waits for it. Every process is
cleaned up in ``finally``. Writes ``bench/out/churn[.quick].json``, ``docs/benchmarks-churn.md``,
``docs/bench-churn.png`` and the ``churn`` section of ``docs/benchmarks.md`` (a quick run never
replaces the docs of a full one; ``--report`` only regenerates them from the JSON).

:func:`run_once` and :func:`churn_schedule` are reused by ``bench/netns.py`` (the same schedule,
with the nodes in network namespaces behind a 100 Mbit/s link).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.procs import pids_mentioning, process_tree
from diloco_swarm.node.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
DOCS = ROOT / "docs"
DOC = DOCS / "benchmarks-churn.md"
PLOT = DOCS / "bench-churn.png"
MAIN_DOC = DOCS / "benchmarks.md"

N_NODES = 4
SEED = 20240603
KILL_EVERY_S = 20.0
KILL_JITTER_S = 5.0
RESTART_AFTER_S = 10.0
RESTART_JITTER_S = 2.0
TAIL_S = 20.0  # the last restart comes at least this long before the window ends (time to rejoin)
START_TIMEOUT_S = 300.0  # torch + hivemind imports and the dataset on a busy 2-core machine
LEAVE_TIMEOUT_S = 60.0
RESTART_FAILED_AFTER_S = 2.0  # a node that exits on its own in the window is restarted (like a supervisor would)

NODE_ARGS = [
    "--model", "tiny",
    "--seq-len", "64",
    "--batch-size", "4",
    "--inner-steps", "10",
    "--max-dataset-bytes", "300000",
    "--threads", "1",
    "--device", "cpu",
    "--matchmaking-time", "3",
    "--averaging-window", "30",
    "--allreduce-timeout", "20",
]
RESTART = ["--wait-for-peers", "0"]

# (command prefix, listen host) of a node: ([], "127.0.0.1") here, (["ip", "netns", "exec", NS], ADDR) in bench/netns.py
Placement = tuple[list[str], str]
LOCAL: Placement = ([], "127.0.0.1")
# log lines worth showing in the report (the node's own one-line errors and warnings, tracebacks)
_NOTE = re.compile(r"error|warning|traceback|failed|refused|could not|exception", re.I)
_STATUS = re.compile(r"^outer \d+ \|")  # the node's status line (its round outcome is in the metrics already)
_LOGGER = re.compile(r"^\w{3} +\d+ [\d:.]+ \[(\w+)\]")  # a hivemind logger line: "Nov 30 05:28:24.209 [DEBUG] ..."
_TRACE = re.compile(r"^(\s|\* |Traceback|During handling|The above exception|[\w.]+(Error|Exception|Failure)\b)")


def noteworthy(line: str) -> bool:
    """A log line worth quoting in the report: the node's own errors and warnings, hivemind's WARN/ERROR
    lines; not its DEBUG lines, the tracebacks they carry, or the node's status line."""
    m = _LOGGER.match(line)
    if m:
        return m[1] in ("WARN", "WARNING", "ERROR", "CRITICAL")
    return bool(_NOTE.search(line)) and not _STATUS.match(line) and not _TRACE.match(line)


@dataclass
class Life:
    """One process lifetime of a node (a restart starts a new one)."""

    launched: float
    ended: float | None = None
    how: str = ""  # killed | sigint | exited | cleanup
    code: int | None = None


@dataclass
class Node:
    name: str
    state_dir: Path
    metrics: Path
    log: Path
    proc: subprocess.Popen | None = None
    lives: list[Life] = field(default_factory=list)
    handles: list = field(default_factory=list)

    def events(self, kind: str | None = None) -> list[dict]:
        return read_metrics(self.metrics, kind)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Swarm:
    def __init__(self, root: Path, run_id: str, node_args: list[str] | None = None,
                 placements: dict[str, Placement] | None = None, env: dict[str, str] | None = None):
        self.root, self.run_id = root, run_id
        self.node_args = list(NODE_ARGS if node_args is None else node_args)
        self.placements = placements or {}
        self.env = env or {}
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, extra: list[str], initial: list[str] = ()) -> Node:
        node = self.nodes.get(name)
        if node is None:
            d = self.root / name
            node = Node(name, d, d / "metrics.jsonl", self.root / f"{name}.log")
            self.nodes[name] = node
        prefix, host = self.placements.get(name, LOCAL)
        cmd = [*prefix, sys.executable, "-m", "diloco_swarm", "join", "--run-id", self.run_id, "--host", host,
               *self.node_args, "--state-dir", str(node.state_dir), "--metrics-file", str(node.metrics),
               "--port", "0", *extra]
        for addr in initial:
            cmd += ["--initial-peers", addr]
        log = open(node.log, "a")
        log.write(f"---- [bench] life {len(node.lives) + 1} launched at {time.time():.1f}\n")
        log.flush()
        node.handles.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env}
        node.lives.append(Life(time.time()))
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return node

    def end_life(self, node: Node, how: str) -> None:
        if node.lives and node.lives[-1].ended is None:
            life = node.lives[-1]
            life.ended, life.how = time.time(), how
            life.code = node.proc.returncode if node.proc is not None else None

    def kill_tree(self, node: Node, how: str = "killed") -> list[int]:
        if node.proc is None:
            return []
        pids = process_tree(node.proc.pid) if node.alive() else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            node.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.end_life(node, how)
        return pids

    def live_maddrs(self, exclude: str | None = None) -> list[str]:
        """The current address of every live node but ``exclude``: a restart dials them all, so it
        still gets in when one of them dies while it is starting."""
        out = []
        for node in self.nodes.values():
            if node.name != exclude and node.alive():
                # Only this life's start event: an earlier life's address is dead.
                starts = [e for e in node.events("start") if e["time"] >= node.lives[-1].launched]
                if starts and starts[-1].get("maddrs"):
                    out.append(starts[-1]["maddrs"][0])
        return out

    def leave_all(self) -> dict[str, int | None]:
        running = [n for n in self.nodes.values() if n.alive()]
        for node in running:
            node.proc.send_signal(signal.SIGINT)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        for node in running:
            try:
                codes[node.name] = node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node.name] = None
            self.end_life(node, "sigint")
        return codes

    def close(self) -> None:
        # A second Ctrl+C / SIGTERM must not cut the cleanup short.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _close(self) -> None:
        for node in self.nodes.values():
            if node.alive():
                self.kill_tree(node, "cleanup")
            else:
                self.end_life(node, "exited")
            for h in node.handles:
                h.close()
        # Orphans (p2pd daemons of SIGKILLed nodes, forked helpers): ours mention our run directory.
        for pid in pids_mentioning(str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ------------------------------------------------------------------------------ schedule
def churn_schedule(seed: int, duration: float, names: list[str], every: float = KILL_EVERY_S,
                   jitter: float = KILL_JITTER_S, down: float = RESTART_AFTER_S,
                   down_jitter: float = RESTART_JITTER_S, tail: float = TAIL_S) -> list[dict]:
    """[{kill_at, restart_at, peer}], seconds after the measured window starts: a kill every
    ``every`` ± ``jitter`` s, the peer back ``down`` ± ``down_jitter`` s later. One peer down at a
    time; every killed peer is back at least ``tail`` s before the window ends."""
    rng = random.Random(seed)
    plan, t, back = [], 0.0, 0.0
    while True:
        t = max(t + every + rng.uniform(-jitter, jitter), back + 3.0)
        restart = t + down + rng.uniform(-down_jitter, down_jitter)
        if restart > duration - tail:
            break
        plan.append({"kill_at": round(t, 1), "restart_at": round(restart, 1), "peer": rng.choice(names)})
        back = restart  # the next kill comes after this restart
    return plan


def schedule_params(every: float = KILL_EVERY_S, jitter: float = KILL_JITTER_S, down: float = RESTART_AFTER_S,
                    down_jitter: float = RESTART_JITTER_S, tail: float = TAIL_S) -> dict[str, float]:
    return {"every": every, "jitter": jitter, "down": down, "down_jitter": down_jitter, "tail": tail}


# ------------------------------------------------------------------------------ one run
def wait_for(predicate, timeout: float, what: str, swarm: Swarm) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for node in swarm.nodes.values():
            if node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError(f"{what}: {node.name} exited with {node.proc.returncode}\n{node.tail()}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout}s: {what}\n" +
                       "\n".join(f"--- {n.name}\n{n.tail()}" for n in swarm.nodes.values()))


def run_once(label: str, root: Path, duration: float, schedule: list[dict] | None, *,
             node_args: list[str] | None = None, placements: dict[str, Placement] | None = None,
             names: list[str] | None = None, run_id: str | None = None,
             counters: Callable[[], list[tuple[int, int]]] | None = None,
             start_timeout: float = START_TIMEOUT_S, log_prefix: str = "", env: dict[str, str] | None = None,
             restart_failed: bool = True) -> dict:
    """Start ``names`` (node 0 first, the others through it), wait until all train, then measure
    ``duration`` s while carrying out ``schedule`` (None: calm), then SIGINT everyone.

    ``counters``, when given, returns (rx, tx) bytes per node; it is read when the window starts and ends.
    ``env`` is added to every node's environment. With ``restart_failed``, a node that exits on its own
    during the window (its exit is recorded) is restarted ``RESTART_FAILED_AFTER_S`` s later, as a
    supervisor (systemd ``Restart=on-failure``) would.
    """
    names = names or [f"p{i}" for i in range(N_NODES)]
    tag = f"{log_prefix}{label}"
    root.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(root, run_id or f"churn-bench-{label}-{int(time.time())}", node_args, placements, env)
    initial_start = ["--wait-for-peers", str(len(names))]
    actions: list[dict] = []
    try:
        p0 = swarm.start(names[0], initial_start)
        wait_for(lambda: p0.events("start"), start_timeout, "p0 start", swarm)
        maddr = p0.events("start")[-1]["maddrs"][0]
        for name in names[1:]:
            swarm.start(name, initial_start, initial=[maddr])
        nodes = [swarm.nodes[n] for n in names]
        wait_for(lambda: all(n.events("eval") for n in nodes), start_timeout, "all peers start training", swarm)
        t0 = time.time()
        before = counters() if counters else None
        print(f"[{tag}] all {len(names)} peers training; measuring {duration:.0f} s", flush=True)

        pending = []
        for item in schedule or []:
            pending.append((t0 + item["kill_at"], "kill", item["peer"]))
            pending.append((t0 + item["restart_at"], "restart", item["peer"]))
        pending.sort()
        end = t0 + duration
        while time.time() < end:
            now = time.time()
            while pending and pending[0][0] <= now:
                _, action, name = pending.pop(0)
                node = swarm.nodes[name]
                if action == "kill":
                    pids = swarm.kill_tree(node, "killed")
                    actions.append({"t": round(time.time() - t0, 1), "action": "kill", "peer": name, "pids": len(pids)})
                else:
                    if node.alive():  # already back (restarted after a failure in the meantime)
                        continue
                    initial = swarm.live_maddrs(exclude=name)
                    if not initial:  # no peer is up yet to join through: try again shortly
                        pending.append((now + 1.0, action, name))
                        pending.sort()
                        continue
                    swarm.start(name, RESTART, initial=initial)
                    actions.append({"t": round(time.time() - t0, 1), "action": "restart", "peer": name,
                                    "initial_peers": len(initial)}
                                   | ({"after_failure": True} if action == "restart-failed" else {}))
                print(f"[{tag}] t={actions[-1]['t']:6.1f}s {action} {name}", flush=True)
            for node in nodes:  # an unplanned exit is recorded, not hidden
                if node.proc is not None and node.proc.poll() is not None and node.lives[-1].ended is None:
                    swarm.end_life(node, "exited")
                    actions.append({"t": round(time.time() - t0, 1), "action": "exited", "peer": node.name,
                                    "code": node.proc.returncode})
                    print(f"[{tag}] {node.name} exited on its own ({node.proc.returncode})", flush=True)
                    if restart_failed:
                        pending.append((time.time() + RESTART_FAILED_AFTER_S, "restart-failed", node.name))
                        pending.sort()
            time.sleep(0.2)
        t_end = time.time()
        after = counters() if counters else None
        codes = swarm.leave_all()
        print(f"[{tag}] SIGINT exit codes: {codes}", flush=True)
        result = summarize(label, swarm, names, t0, t_end)
        result.update(duration_s=duration, actions=actions, leave_codes=codes)
        for name, node in swarm.nodes.items():  # the end of the log of a node that exited badly
            if codes.get(name, 0) != 0 or any(life.how == "exited" and life.code for life in node.lives):
                result["nodes"][name]["log_tail"] = node.tail(1500)
        if before is not None and after is not None:
            result["link_bytes_window"] = [{"rx": a[0] - b[0], "tx": a[1] - b[1]} for a, b in zip(after, before)]
        return result
    finally:
        swarm.close()


def _cumulative_at(records: list[dict], t: float, key: str) -> float:
    """A cumulative metric of one process life at time ``t``: its last record's value at or before ``t``."""
    value = 0.0
    for e in records:
        if e["time"] <= t:
            value = e.get(key) or 0.0
    return value


def summarize(label: str, swarm: Swarm, names: list[str], t0: float, t_end: float) -> dict:
    per_node, useful_sum, inner_sum, wall_sum, startup_sum = {}, 0.0, 0.0, 0.0, 0.0
    win_inner, win_useful = 0.0, 0.0
    all_records, syncs, initial, finals, series = [], 0, [], [], {}
    for name in names:
        node = swarm.nodes[name]
        events = node.events()
        lives = []
        # Each process life's records: written between its launch and its end (a life killed
        # during its imports wrote nothing).
        for life in node.lives:
            ended = life.ended or time.time()
            recs = sorted((e for e in events if e.get("event") == "outer_step"
                           and life.launched <= e["time"] <= ended + 1.0), key=lambda e: e["time"])
            last = recs[-1] if recs else None
            inner = last["inner_s"] if last else 0.0
            useful = (last["inner_s"] - last["wasted_inner_s"]) if last else 0.0
            wall = ended - life.launched
            # launch to the node's start record (the whole life, when it was killed before one)
            start = next((e for e in events if e.get("event") == "start" and life.launched <= e["time"] <= ended), None)
            startup = (start["time"] - life.launched) if start else wall
            startup_sum += startup
            useful_sum += useful
            inner_sum += inner
            wall_sum += wall
            d_inner = _cumulative_at(recs, t_end, "inner_s") - _cumulative_at(recs, t0, "inner_s")
            d_wasted = _cumulative_at(recs, t_end, "wasted_inner_s") - _cumulative_at(recs, t0, "wasted_inner_s")
            win_inner += d_inner
            win_useful += d_inner - d_wasted
            lives.append({"launched": round(life.launched - t0, 1), "ended": round(ended - t0, 1), "how": life.how,
                          "code": life.code, "outer_steps": len(recs), "inner_s": round(inner, 1),
                          "useful_inner_s": round(useful, 1), "wall_s": round(wall, 1),
                          "startup_s": round(startup, 1), "startup_phases": (start or {}).get("startup_s")})
        recs = [e for e in events if e.get("event") == "outer_step"]
        all_records += [e for e in recs if e["time"] <= t_end]  # not the rounds cut short by the final SIGINT
        syncs += sum(1 for e in events if e.get("event") == "state_sync")
        evals = [e for e in events if e.get("event") == "eval"]
        if evals:
            initial.append(evals[0]["eval_loss"])
        last_loss = next((e["eval_loss"] for e in reversed(events) if e.get("event") in ("outer_step", "eval")), None)
        if last_loss is not None:
            finals.append(last_loss)
        # [seconds since t0, loss]; [t, None] at each process start (a gap in the plotted line)
        series[name] = [[round(e["time"] - t0, 2), e.get("eval_loss")] for e in events
                        if e.get("event") == "start"
                        or (e.get("event") in ("outer_step", "eval") and e.get("eval_loss") is not None)]
        notes = [ln.strip()[:300] for ln in (node.log.read_text(errors="replace").splitlines() if node.log.exists()
                                             else []) if noteworthy(ln)]
        per_node[name] = {
            "lives": lives,
            "outer_steps_recorded": len(recs),
            "last_outer_step": recs[-1]["outer_step"] if recs else None,
            "last_goodput": recs[-1]["goodput"] if recs else None,
            "final_eval_loss": last_loss,
            "state_syncs": [{k: e.get(k) for k in ("reason", "from_outer_step", "outer_step", "bytes", "seconds")}
                            | {"t": round(e["time"] - t0, 1)} for e in events if e.get("event") == "state_sync"],
            "log_notes": notes[-12:],
        }
    ok = sum(1 for r in all_records if r.get("round_ok"))

    def swarm_step(t: float) -> int:
        return max((e["outer_step"] for n in names for e in swarm.nodes[n].events()
                    if e.get("event") in ("outer_step", "state_sync") and e["time"] <= t), default=0)

    window = t_end - t0
    return {
        "label": label,
        "t0": t0,
        "measured_s": round(window, 1),
        "goodput_overall": useful_sum / wall_sum if wall_sum else None,
        "utilization_overall": inner_sum / wall_sum if wall_sum else None,
        "startup_s": round(startup_sum, 1),
        "goodput_once_started": useful_sum / (wall_sum - startup_sum) if wall_sum > startup_sum else None,
        "useful_inner_s": round(useful_sum, 1),
        "inner_s": round(inner_sum, 1),
        "node_wall_s": round(wall_sum, 1),
        "window_utilization": win_inner / (len(names) * window) if window > 0 else None,
        "window_goodput": win_useful / (len(names) * window) if window > 0 else None,
        "swarm_outer_steps": swarm_step(float("inf")),
        "outer_steps_in_window": swarm_step(t_end) - swarm_step(t0),
        "rounds": len(all_records),
        "verified_rounds": ok,
        "failed_rounds": len(all_records) - ok,
        "failure_reasons": dict(Counter((r.get("reason") or "?")[:160] for r in all_records if not r.get("round_ok"))),
        "group_sizes": dict(Counter(str(r.get("group_size")) for r in all_records)),
        "state_syncs": syncs,
        "initial_eval_loss": max(initial) if initial else None,
        "final_eval_loss_min": min(finals) if finals else None,
        "final_eval_loss_mean": sum(finals) / len(finals) if finals else None,
        "series": series,
        "nodes": per_node,
    }


# ------------------------------------------------------------------------------ report
def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def schedule_md(schedule: list[dict], actions: list[dict]) -> str:
    """The seeded schedule as a table, and what was carried out (with unplanned exits)."""
    sched = "\n".join(f"| {s['kill_at']} | {s['peer']} | {s['restart_at']} |" for s in schedule) or "| – | – | – |"
    done = "\n".join(
        f"- t = {a['t']} s: {a['action']} {a['peer']}"
        + (f" ({a['pids']} processes)" if "pids" in a else "")
        + (" **after its failure**" if a.get("after_failure") else "")
        + (f" (dialing {a['initial_peers']} live peer(s))" if "initial_peers" in a else "")
        + (f" (**exit code {a['code']}**)" if "code" in a else "")
        for a in actions) or "- (none)"
    return f"| kill at (s) | peer | restart at (s) |\n|---|---|---|\n{sched}\n\nCarried out:\n\n{done}\n"


def syncs_md(runs: list[dict]) -> str:
    """State syncs by reason (count, mean seconds, size) and averaging group sizes, per run."""
    parts = []
    for r in runs:
        by: dict[str, list[dict]] = {}
        for node in r["nodes"].values():
            for x in node.get("state_syncs", []):
                by.setdefault(x["reason"], []).append(x)
        syncs = ", ".join(f"{why} {len(xs)} (mean {sum(x['seconds'] or 0 for x in xs) / len(xs):.1f} s, "
                          f"{(xs[0]['bytes'] or 0) / 1e6:.1f} MB each)" for why, xs in sorted(by.items())) or "none"
        groups = r.get("group_sizes")
        sizes = (f"; averaging groups of {', '.join(f'{k}: {v}' for k, v in sorted(groups.items(), reverse=True))} "
                 "round records" if groups else "")
        parts.append(f"{r['label']}: {syncs}{sizes}")
    return "State syncs by reason: " + "; ".join(parts) + "."


def problems_md(run: dict) -> list[str]:
    """Unplanned exits, non-zero leave codes, failed-round reasons and the nodes' error lines of one run."""
    out = []
    for reason, count in sorted(run.get("failure_reasons", {}).items(), key=lambda kv: -kv[1]):
        out.append(f"- {run['label']}: {count} round(s) not verified: `{reason}`")
    for a in run.get("actions", []):
        if a["action"] == "exited":
            out.append(f"- {run['label']}: {a['peer']} exited on its own at t = {a['t']} s (exit code {a['code']})")
    for name, code in (run.get("leave_codes") or {}).items():
        if code != 0:
            last = (run.get("nodes", {}).get(name, {}).get("lives") or [{}])[-1]
            why = (f" (its last life, launched at t = {last['launched']} s, had made no outer step by the window's "
                   f"end, {run['measured_s']} s)" if last.get("outer_steps") == 0 else "")
            out.append(f"- {run['label']}: {name} answered the final SIGINT with exit code {code}{why}")
    for name, node in run.get("nodes", {}).items():
        for line in [x for x in node.get("log_notes", []) if noteworthy(x)][-3:]:
            out.append(f"- {run['label']}, {name} log: `{line[:200]}`")
    return out


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """Held-out loss vs seconds since the window started, calm and churn, with the kills and restarts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = {"calm": "tab:blue", "churn": "tab:orange"}
    for label, run in runs.items():
        for i, (name, pts) in enumerate(sorted(run["series"].items())):
            pts = [p for p in pts if p[0] >= -5]
            if pts:
                ax.plot([p[0] for p in pts], [float("nan") if p[1] is None else p[1] for p in pts], ".-", lw=0.8,
                        ms=3, alpha=0.8,
                        color=colors.get(label, "gray"), label=label if i == 0 else None)
    churn = runs.get("churn", {})
    for j, a in enumerate(churn.get("actions", [])):
        style = {"kill": ("tab:red", "--"), "restart": ("tab:green", ":"), "exited": ("black", "-.")}[a["action"]]
        ax.axvline(a["t"], color=style[0], ls=style[1], lw=1,
                   label=a["action"] if a["action"] not in [b["action"] for b in churn["actions"][:j]] else None)
    ax.set_xlabel("seconds since all peers started training (measured window)")
    ax.set_ylabel("held-out loss (nats/byte), each node")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=-5, right=max(r["measured_s"] for r in runs.values()) + 10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_table(runs: list[dict]) -> str:
    head = (f"| run | goodput (process lives) | compute utilization (process lives) | goodput, window × {N_NODES} slots | "
            "start-up s (all lives) | goodput once started | "
            "outer steps in window (swarm) | highest outer step | verified / all rounds | failed rounds | "
            "state syncs | final held-out loss min / mean | graceful-leave exit codes |\n|" + "---|" * 13)
    rows = [head]
    for r in runs:
        rows.append(
            f"| {r['label']} | {fmt(r['goodput_overall'])} | {fmt(r['utilization_overall'])} | "
            f"{fmt(r['window_goodput'])} | {fmt(r.get('startup_s'), 1)} | {fmt(r.get('goodput_once_started'))} | "
            f"{r['outer_steps_in_window']} | {r['swarm_outer_steps']} | "
            f"{r['verified_rounds']} / {r['rounds']} | {r['failed_rounds']} | {r['state_syncs']} | "
            f"{fmt(r['final_eval_loss_min'])} / {fmt(r['final_eval_loss_mean'])} | "
            f"{', '.join(f'{k} {v}' for k, v in r['leave_codes'].items()) or '–'} |")
    return "\n".join(rows) + "\n"


def headline(calm: dict, churn: dict) -> str:
    def ratio(key):
        a, b = calm.get(key), churn.get(key)
        return f"{b / a:.2f}×" if a and b is not None else "–"

    dl = (churn["final_eval_loss_mean"] - calm["final_eval_loss_mean"]
          if churn["final_eval_loss_mean"] is not None and calm["final_eval_loss_mean"] is not None else None)
    return (f"**Churn vs calm (same invocation): goodput {fmt(churn['goodput_overall'])} vs "
            f"{fmt(calm['goodput_overall'])} ({ratio('goodput_overall')}); once started (every life's start-up "
            f"excluded) {fmt(churn.get('goodput_once_started'))} vs {fmt(calm.get('goodput_once_started'))} "
            f"({ratio('goodput_once_started')}); outer steps in the window "
            f"{churn['outer_steps_in_window']} vs {calm['outer_steps_in_window']} ({ratio('outer_steps_in_window')}); "
            f"final held-out loss (mean over nodes) {fmt(churn['final_eval_loss_mean'])} vs "
            f"{fmt(calm['final_eval_loss_mean'])} ({'+' if dl is not None and dl >= 0 else ''}{fmt(dl)}).**")


def write_docs(data: dict, path: Path) -> None:
    """docs/benchmarks-churn.md, docs/bench-churn.png and the `churn` section of docs/benchmarks.md."""
    from bench.common import provenance_md

    calm, churn = data["runs"]["calm"], data["runs"]["churn"]
    prov = provenance_md(data, path)
    sp = data["schedule_params"]
    plot(data["runs"], PLOT, f"4 tiny-model peers on 127.0.0.1, calm vs churn (seed {data['seed']}); "
                             f"{data['provenance']['date_utc'][:10]}")
    problems = problems_md(calm) + problems_md(churn)
    size = "quick (`--quick`)" if data["quick"] else "full"
    DOC.write_text(f"""# Benchmark: goodput under churn

Generated by `{data['provenance']['command']}` ({size} size) from `bench/out/{path.name}`; do not edit by hand:
rerun the command (or `python -m bench.churn --report` to regenerate this page and the plot from the JSON).

Four real `diloco_swarm join` processes on 127.0.0.1 (tiny model, `--device cpu`, one torch thread each)
train for a fixed {data['duration_s']:.0f} s of wall time (the *window*, counted from the moment all four
have started training), twice in one invocation: **calm** (nobody fails) and **churn** (a seeded schedule
SIGKILLs the whole process tree of one peer, i.e. the node, its forked hivemind processes and its p2pd
daemon, and restarts it about {sp['down']:.0f} s later with the same `--state-dir`, `--wait-for-peers 0`
and `--initial-peers` = every live peer's current address). At the end every live node gets SIGINT and
leaves gracefully.

Node arguments: `{' '.join(data['node_args'])}`; the initial start adds `--wait-for-peers {N_NODES}`.

**Hardware: the 2-core shared CPU machine described below; the four nodes share its 2 cores with each
other and with other jobs, so read the ratios between the two runs, not the absolute figures.**

## Results

{results_table([calm, churn])}
{headline(calm, churn)}

{syncs_md([calm, churn])}

- *goodput (process lives)*: Σ(`inner_s` − `wasted_inner_s`) over every process life (its last
  `outer_step` record; 0 for a life killed before its first record), divided by Σ of the lives' wall
  time (launch to exit, imports and start-up included). Inner seconds of an outer step cut short by a
  kill are lost (never in a record). Time a peer is down is in no life's wall time.
- *compute utilization*: the same with all inner seconds (`inner_s`, applied or not).
- *start-up s*: Σ over every process life of launch → its `start` record (imports, the DHT, the reachability
  check, the averager; the record's `startup_s` splits it), or the whole life when it was killed before one.
  *goodput once started*: goodput with each life's start-up taken out of its wall time: what the kills cost
  besides restarting processes. On this machine a restart shares the 2 cores with three training peers;
  a volunteer's restart runs on its own machine.
- *goodput, window × {N_NODES} slots*: inner seconds whose Δ was applied that the records place inside the
  window, over {N_NODES} × the window: a peer that is down or restarting counts as an idle slot.
- *outer steps in window (swarm)*: the highest `outer_step` any node had reached (round record or state
  sync) at the window's end minus at its start; *highest outer step*: the same at the very end.
- *verified / all rounds*: `outer_step` records with `round_ok`, over all records of all nodes from
  start-up to the window's end (not the rounds cut short by the final SIGINT); *failed rounds* = the
  others (solo, failed or partial rounds).
- *state syncs*: `state_sync` events of all nodes (a restarted peer that is behind downloads the
  swarm's state; lagging or diverged peers too).
- *held-out loss*: nats per byte on the held-out split every peer shares; initial
  {fmt(calm['initial_eval_loss'])}; final = each node's last `eval_loss`.

![held-out loss vs wall time, calm vs churn](bench-churn.png)

## Churn schedule (seed {data['seed']})

Seconds after the window starts: a kill every {sp['every']:.0f} ± {sp['jitter']:.0f} s, the peer back
{sp['down']:.0f} ± {sp['down_jitter']:.0f} s later, one peer down at a time, the last restart at least
{sp['tail']:.0f} s before the window ends.

{schedule_md(data['schedule'], churn['actions'])}
Per node (churn run): process lives (`launched`–`ended` in s since the window started, how it ended),
outer-step records per life and state syncs:

{chr(10).join(f"- {n}: " + "; ".join(f"{l['launched']}–{l['ended']} s {l['how']}"
                                     + (f" (code {l['code']})" if l['code'] not in (None, 0) and l['how'] != 'killed' else "")
                                     + f", {l['outer_steps']} steps"
                                     + (f", start-up {l['startup_s']} s" if l.get('startup_s') is not None else "")
                                     + (" (" + ", ".join(f"{k} {x:.1f}" for k, x in l['startup_phases'].items()
                                                         if isinstance(x, (int, float)) and x >= 0.5) + ")"
                                        if l.get('startup_phases') else "") for l in v['lives'])
                + (f"; syncs: " + ", ".join(f"{x['reason']} {x['from_outer_step']}→{x['outer_step']} at {x['t']} s"
                                           for x in v['state_syncs']) if v['state_syncs'] else "")
                for n, v in churn['nodes'].items())}

## What went wrong

{chr(10).join(problems) or "Nothing: no failed rounds, no unplanned exits, every node left with exit code 0."}

{prov}""")
    upsert_main_section(data, path, prov)


def upsert_main_section(data: dict, path: Path, prov: str) -> None:
    """The `churn` section of docs/benchmarks.md (kept by `python -m bench report`): the headline table
    and a link to the full page. A quick result never replaces a full-size section."""
    size = "quick" if data["quick"] else "full"
    calm, churn = data["runs"]["calm"], data["runs"]["churn"]
    section = (f"<!-- bench:churn size={size} -->\n## 6. Goodput and loss under churn (`python -m bench.churn`)\n\n"
               + ("" if size == "full" else "> **Toy size (quick)**: run `python -m bench.churn` for the full-size "
                                            "figures.\n\n")
               + f"4 tiny-model peers on 127.0.0.1 train for {data['duration_s']:.0f} s twice: calm, and with a "
               f"seeded kill/restart schedule ({len(data['schedule'])} SIGKILLs of a whole node, each restarted "
               f"~{data['schedule_params']['down']:.0f} s later). Definitions, the schedule, per-node lives and "
               f"the plot: [benchmarks-churn.md](benchmarks-churn.md).\n\n"
               f"{results_table([calm, churn])}\n{headline(calm, churn)}\n\n"
               + "".join(f"*Note:* {note}\n\n" for note in data.get("notes", []))  # a reading, added to the JSON afterwards
               + f"{prov}<!-- /bench:churn -->\n")
    text = MAIN_DOC.read_text() if MAIN_DOC.exists() else ""
    m = re.search(r"<!-- bench:churn size=(\w+) -->\n.*?<!-- /bench:churn -->\n", text, re.S)
    if m and m[1] == "full" and size != "full":
        print(f"kept the full-size churn section of {MAIN_DOC}")
        return
    text = text[:m.start()] + section + text[m.end():] if m else text.rstrip("\n") + "\n\n" + section
    MAIN_DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    from bench.common import loadavg, provenance

    ap = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="75 s runs instead of 150 s")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (overrides the size)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--report", action="store_true", help="only regenerate the docs from bench/out/churn[.quick].json")
    args = ap.parse_args(argv)
    out_name = "churn.quick.json" if args.quick else "churn.json"
    if args.report:
        data = json.loads((OUT_DIR / out_name).read_text())
        write_docs(data, OUT_DIR / out_name)
        print(f"wrote {DOC}, {PLOT} and the churn section of {MAIN_DOC} from {OUT_DIR / out_name}")
        return 0

    def _terminate(signum, frame):  # SIGTERM (and SIGINT, even where it was ignored): clean up in `finally`
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    duration = args.duration or (75.0 if args.quick else 150.0)
    names = [f"p{i}" for i in range(N_NODES)]
    schedule = churn_schedule(args.seed, duration, names)
    print(f"churn schedule (seed {args.seed}), seconds after the window starts:")
    for item in schedule:
        print(f"  kill {item['peer']} at {item['kill_at']} s, restart at {item['restart_at']} s")

    cmd = "python -m bench.churn" + (" --quick" if args.quick else "")
    if args.duration:
        cmd += f" --duration {args.duration:g}"
    if args.seed != SEED:
        cmd += f" --seed {args.seed}"
    prov = provenance(cmd)
    t_start = time.perf_counter()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    work = OUT_DIR / ("churn-runs.quick" if args.quick else "churn-runs")
    runs = {}
    for label, sched in (("calm", None), ("churn", schedule)):
        d = work / label
        if d.exists():
            subprocess.run(["rm", "-rf", str(d)], check=False)
        runs[label] = run_once(label, d, duration, sched)
        print(json.dumps({k: v for k, v in runs[label].items() if k not in ("nodes", "actions", "series")}), flush=True)

    gc, gk = runs["calm"]["goodput_overall"], runs["churn"]["goodput_overall"]
    data = {
        "name": "churn",
        "size": "quick" if args.quick else "full",
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "loadavg_end": loadavg(),
        "provenance": prov,
        "quick": args.quick,
        "duration_s": duration,
        "seed": args.seed,
        "schedule_params": schedule_params(),
        "schedule": schedule,
        "node_args": NODE_ARGS,
        "runs": runs,
        "goodput_ratio": (gk / gc) if gc and gk is not None else None,
    }
    path = OUT_DIR / out_name
    path.write_text(json.dumps(data, indent=1))
    full = OUT_DIR / "churn.json"
    if args.quick and full.exists() and json.loads(full.read_text()).get("size") == "full":
        print(f"kept the docs of the full-size run ({full}); `python -m bench.churn --quick --report` rewrites them")
    else:
        write_docs(data, path)
        print(f"wrote {DOC}, {PLOT} and the churn section of {MAIN_DOC}")
    print(f"goodput calm {fmt(gc)} churn {fmt(gk)} ratio {fmt(data['goodput_ratio'])}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
