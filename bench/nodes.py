"""Real ``diloco-node join`` processes run to ``--max-outer-steps`` (tests/swarmlib.py's harness), with the CPU
seconds (and PSS) of every process of their trees sampled about once a second, and the figures of a window
defined by their own records. Nodes of one run id average together: the first starts alone, the others dial it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from bench.common import DEFAULT_OUT, REPO
from tests.swarmlib import NodeProc, Swarm, cpu_seconds, process_tree, pss_bytes

START_TIMEOUT_S = 300.0  # torch + hivemind imports and the dataset on a busy 2-core machine


@dataclass
class NodeSpec:
    name: str
    run_id: str
    args: list[str]  # a node given `--fault` runs tests/faults.py
    wrap: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]
    host: str = "127.0.0.1"
    join_after_step: int = 0  # a joiner starts once the first node applied this outer step (a state download)


@dataclass
class NodeRun:
    spec: NodeSpec
    node: NodeProc | None = None
    cpu: list = field(default_factory=list)  # [(time.time(), {pid: (comm, CPU seconds)})], one per poll
    pss: list = field(default_factory=list)  # [(time.time(), {pid: (comm, PSS bytes)})], with sample_memory
    exit_code: int | None = None

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return self.node.events(kind)

    def log_tail(self, n: int = 2000) -> str:
        return "" if self.exit_code == 0 else self.node.output()[-n:]


def run_nodes(specs: list[NodeSpec], workdir: Path, timeout: float, *, env: dict[str, str] | None = None,
              cwd: Path = REPO, sample_memory: bool = False) -> list[NodeRun]:
    """Start ``specs``, wait until every node exits by itself, sampling its tree; whatever is left is killed.
    ``cwd``: the checkout whose ``diloco_swarm`` the nodes run. :raises AssertionError: a node did not
    start, or the nodes did not finish in ``timeout`` s (its message holds the logs' tails)."""
    runs = [NodeRun(s) for s in specs]
    firsts: dict[str, NodeRun] = {}
    with Swarm(workdir, "", base=[], env={"OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd) as swarm:
        def start(r: NodeRun, initial: NodeProc | None = None) -> None:
            r.node = swarm.start(r.spec.name, "--host", r.spec.host, *r.spec.args, run_id=r.spec.run_id,
                                 wrap=r.spec.wrap, initial=initial, wait_start=False)

        def poll() -> None:
            now = time.time()
            for r in runs:
                if r.node is not None and r.node.alive():
                    tree = process_tree(r.node.proc.pid)
                    r.cpu.append((now, cpu_seconds(tree)))
                    if sample_memory:
                        r.pss.append((now, pss_bytes(tree)))

        for r in runs:  # the first node of every run id: they start side by side
            if r.spec.run_id not in firsts:
                firsts[r.spec.run_id] = r
                start(r)
        for r in runs:
            if r.node is None:
                first = firsts[r.spec.run_id]
                swarm.wait(lambda: first.records("start"), START_TIMEOUT_S, "start", first.node)
                swarm.wait(lambda: poll() or not r.spec.join_after_step or not first.node.alive() or any(
                    e["outer_step"] >= r.spec.join_after_step for e in first.records("outer_step")),
                    START_TIMEOUT_S, f"outer step {r.spec.join_after_step}", poll=1.0)
                start(r, first.node)
        swarm.wait(lambda: poll() or not any(r.node.alive() for r in runs), timeout, "the nodes' end", poll=1.0)
        for r in runs:
            r.exit_code = r.node.proc.returncode
    return runs


def cpu_by_role(run: NodeRun, t0: float, t1: float) -> dict[str, float]:
    """CPU seconds each process of the tree used between ``t0`` and ``t1`` (time.time(), the nearest samples), by
    role: ``training`` (the node's own process), ``p2pd``, ``forked-1``, ``forked-2``... (hivemind's DHT and
    averager processes, in the order they started)."""
    if not run.cpu:
        return {}
    a = min(run.cpu, key=lambda s: abs(s[0] - t0))[1]
    b = min(run.cpu, key=lambda s: abs(s[0] - t1))[1]
    root = run.node.proc.pid
    forked = sorted(p for p, (comm, _) in b.items() if p != root and not comm.startswith("p2pd"))
    out: dict[str, float] = {}
    for pid, (comm, cpu) in b.items():
        role = "training" if pid == root else "p2pd" if comm.startswith("p2pd") else f"forked-{forked.index(pid) + 1}"
        out[role] = out.get(role, 0.0) + cpu - a.get(pid, (comm, 0.0))[1]
    return out


def steady_window(records: list[dict[str, Any]], first_ok: int | None = None, last: int = -2) -> tuple[dict, dict] | None:
    """(first, last) ``outer_step`` record of the steady window, or None when it holds under 2 rounds.

    It starts at the first record whose round averaged with ``first_ok`` members (None: the second record;
    start-up, data loading and the first matchmaking excluded) and ends at record ``last``: by default the
    second-to-last, as with ``--max-outer-steps`` the last round has no next phase to hide behind.
    """
    steps = [e for e in records if e.get("event") == "outer_step"]
    start = 1 if first_ok is None else next(
        (i for i, e in enumerate(steps) if e.get("group_size") == first_ok and e.get("round_ok")), None)
    end = len(steps) + last
    return None if start is None or end - start < 2 else (steps[start], steps[end])


def window_figures(run: NodeRun, window: tuple[dict, dict] | None) -> dict[str, Any]:
    """Tokens per wall second, utilization, waits and CPU of one node over its steady window."""
    steps = run.records("outer_step")
    out: dict[str, Any] = {"exit_code": run.exit_code, "outer_steps": len(steps),
                           "rounds_ok": sum(1 for e in steps if e.get("round_ok")), "log_tail": run.log_tail()}
    out.update({k: [e.get(k) for e in steps] for k in ("inner_steps", "round_wall_s", "previewed_tensors",
                                                       "preview_lead_s", "averaging_s")})
    out["group_sizes"] = [e.get("group_size") for e in steps]
    out["reasons"] = sorted({e.get("reason") for e in steps if e.get("reason")})
    if window is None:
        return out
    a, b = window
    dwall, dinner, rounds = b["wall_s"] - a["wall_s"], b["inner_s"] - a["inner_s"], b["outer_step"] - a["outer_step"]
    dtok = b["tokens_total"] - a["tokens_total"]
    inner_steps = sum(e.get("inner_steps") or 0 for e in steps if a["outer_step"] < e["outer_step"] <= b["outer_step"])
    cpu = cpu_by_role(run, a["time"], b["time"])
    out.update({
        "window_outer_steps": [a["outer_step"], b["outer_step"]], "window_wall_s": dwall, "window_rounds": rounds,
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
    })
    return out


@contextlib.contextmanager
def scratch(bench: str, label: str, keep: bool = False) -> Iterator[Path]:
    """A temporary folder for one run's nodes; with ``keep``, their logs and metrics (not checkpoints, keys or locks)
    are copied to ``bench/out/BENCH-runs/LABEL`` first, the last run's, to look into."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{bench}-{label}-"))
    try:
        yield workdir
    finally:
        dest = DEFAULT_OUT / f"{bench}-runs" / label
        if keep:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for f in workdir.glob("*.log"):
                shutil.copy2(f, dest / f.name)
            for f in workdir.glob("*/metrics.jsonl"):
                shutil.copy2(f, dest / f"{f.parent.name}.jsonl")
        shutil.rmtree(workdir, ignore_errors=True)
