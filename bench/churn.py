"""Goodput under churn: a calm swarm against one whose peers are killed and restarted.

Run: ``python -m bench.churn [--quick]``. Starts 4 real ``diloco_swarm join`` processes on
127.0.0.1 (tiny model), lets them train for a fixed wall time, twice in one invocation:

- ``calm``: nobody fails;
- ``churn``: a seeded schedule SIGKILLs the whole process tree of a random peer (the node, its
  forked hivemind processes and its p2pd daemon: a machine or container failure) about every
  20 s, and restarts it about 10 s later with the same ``--state-dir`` (``--wait-for-peers 0``).

Then every live node gets SIGINT (graceful leave) and the bench waits for it. Every process is
cleaned up in ``finally``. Writes ``bench/out/churn[.quick].json`` and ``docs/benchmarks-churn.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
DOC = ROOT / "docs" / "benchmarks-churn.md"

N_NODES = 4
SEED = 20240603
KILL_EVERY_S = 20.0
KILL_JITTER_S = 5.0
RESTART_AFTER_S = 10.0
START_TIMEOUT_S = 300.0  # torch + hivemind imports and the dataset on a busy 2-core machine
LEAVE_TIMEOUT_S = 60.0

NODE_ARGS = [
    "--host", "127.0.0.1",
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
INITIAL_START = ["--wait-for-peers", str(N_NODES)]
RESTART = ["--wait-for-peers", "0"]


# ------------------------------------------------------------------------------ processes
def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants, parents first (psutil if installed, else /proc)."""
    try:
        import psutil  # type: ignore

        try:
            p = psutil.Process(pid)
            return [pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(children.get(tree[i], []))
        i += 1
    return tree


def pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (our run directory: only ours)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(int(entry.name))
    return out


@dataclass
class Life:
    """One process lifetime of a node (a restart starts a new one)."""

    launched: float
    ended: float | None = None
    how: str = ""  # killed | sigint | exited | cleanup


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
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or e.get("event") == kind:
                out.append(e)
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Swarm:
    def __init__(self, root: Path, run_id: str):
        self.root, self.run_id = root, run_id
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, extra: list[str], initial: str | None = None) -> Node:
        node = self.nodes.get(name)
        if node is None:
            d = self.root / name
            node = Node(name, d, d / "metrics.jsonl", self.root / f"{name}.log")
            self.nodes[name] = node
        cmd = [sys.executable, "-m", "diloco_swarm", "join", "--run-id", self.run_id, *NODE_ARGS,
               "--state-dir", str(node.state_dir), "--metrics-file", str(node.metrics), "--port", "0", *extra]
        if initial:
            cmd += ["--initial-peers", initial]
        log = open(node.log, "a")
        node.handles.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        node.lives.append(Life(time.time()))
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return node

    def end_life(self, node: Node, how: str) -> None:
        if node.lives and node.lives[-1].ended is None:
            node.lives[-1].ended, node.lives[-1].how = time.time(), how

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

    def live_maddr(self, exclude: str | None = None) -> str | None:
        for node in self.nodes.values():
            if node.name != exclude and node.alive():
                # Only this life's start event: an earlier life's address is dead.
                starts = [e for e in node.events("start") if e["time"] >= node.lives[-1].launched]
                if starts:
                    return starts[-1]["maddrs"][0]
        return None

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
def churn_schedule(seed: int, duration: float, names: list[str]) -> list[dict]:
    """[{kill_at, restart_at, peer}], seconds after the measured window starts. One peer down at a
    time; every killed peer is back at least 5 s before the window ends."""
    rng = random.Random(seed)
    plan, t, back = [], 0.0, 0.0
    while True:
        t = max(t + KILL_EVERY_S + rng.uniform(-KILL_JITTER_S, KILL_JITTER_S), back + 3.0)
        restart = t + RESTART_AFTER_S + rng.uniform(-2.0, 2.0)
        if restart > duration - 5.0:
            break
        plan.append({"kill_at": round(t, 1), "restart_at": round(restart, 1), "peer": rng.choice(names)})
        back = restart  # the next kill comes after this restart
    return plan


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


def run_once(label: str, root: Path, duration: float, schedule: list[dict] | None) -> dict:
    names = [f"p{i}" for i in range(N_NODES)]
    root.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(root, f"churn-bench-{label}-{int(time.time())}")
    actions: list[dict] = []
    try:
        p0 = swarm.start(names[0], INITIAL_START)
        wait_for(lambda: p0.events("start"), START_TIMEOUT_S, "p0 start", swarm)
        maddr = p0.events("start")[-1]["maddrs"][0]
        for name in names[1:]:
            swarm.start(name, INITIAL_START, initial=maddr)
        nodes = [swarm.nodes[n] for n in names]
        wait_for(lambda: all(n.events("eval") for n in nodes), START_TIMEOUT_S, "all peers start training", swarm)
        t0 = time.time()
        print(f"[{label}] all {N_NODES} peers training; measuring {duration:.0f} s", flush=True)

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
                    initial = swarm.live_maddr(exclude=name)
                    if initial is None:  # no peer is up yet to join through: try again shortly
                        pending.append((now + 1.0, "restart", name))
                        pending.sort()
                        continue
                    swarm.start(name, RESTART, initial=initial)
                    actions.append({"t": round(time.time() - t0, 1), "action": "restart", "peer": name})
                print(f"[{label}] t={actions[-1]['t']:6.1f}s {action} {name}", flush=True)
            for node in nodes:  # an unplanned exit is recorded, not hidden
                if node.proc is not None and node.proc.poll() is not None and node.lives[-1].ended is None:
                    swarm.end_life(node, "exited")
                    actions.append({"t": round(time.time() - t0, 1), "action": "exited", "peer": node.name,
                                    "code": node.proc.returncode})
                    print(f"[{label}] {node.name} exited on its own ({node.proc.returncode})", flush=True)
            time.sleep(0.2)
        t_end = time.time()
        codes = swarm.leave_all()
        print(f"[{label}] SIGINT exit codes: {codes}", flush=True)
        result = summarize(label, swarm, names, t0, t_end)
        result.update(duration_s=duration, actions=actions, leave_codes=codes)
        return result
    finally:
        swarm.close()


def summarize(label: str, swarm: Swarm, names: list[str], t0: float, t_end: float) -> dict:
    per_node, useful_sum, wall_sum = {}, 0.0, 0.0
    all_records, syncs, initial, finals = [], 0, [], []
    for name in names:
        node = swarm.nodes[name]
        events = node.events()
        # Each process life's records: written between its launch and its end (a life killed
        # during its imports wrote nothing).
        for life in node.lives:
            ended = life.ended or time.time()
            recs = [e for e in events if e.get("event") == "outer_step" and life.launched <= e["time"] <= ended + 1.0]
            last = recs[-1] if recs else None
            useful = (last["inner_s"] - last["wasted_inner_s"]) if last else 0.0
            wall = (life.ended or time.time()) - life.launched
            useful_sum += useful
            wall_sum += wall
        recs = [e for e in events if e.get("event") == "outer_step"]
        all_records += recs
        syncs += sum(1 for e in events if e.get("event") == "state_sync")
        evals = [e for e in events if e.get("event") == "eval"]
        if evals:
            initial.append(evals[0]["eval_loss"])
        last_loss = next((e["eval_loss"] for e in reversed(events) if e.get("event") in ("outer_step", "eval")), None)
        if last_loss is not None:
            finals.append(last_loss)
        per_node[name] = {
            "lives": len(node.lives),
            "outer_steps_recorded": len(recs),
            "last_outer_step": recs[-1]["outer_step"] if recs else None,
            "last_goodput": recs[-1]["goodput"] if recs else None,
            "final_eval_loss": last_loss,
        }
    ok = sum(1 for r in all_records if r.get("round_ok"))
    steps = [e["outer_step"] for n in names for e in swarm.nodes[n].events()
             if e.get("event") in ("outer_step", "state_sync")]
    return {
        "label": label,
        "measured_s": round(t_end - t0, 1),
        "goodput_overall": useful_sum / wall_sum if wall_sum else None,
        "useful_inner_s": round(useful_sum, 1),
        "node_wall_s": round(wall_sum, 1),
        "swarm_outer_steps": max(steps, default=0),
        "rounds": len(all_records),
        "verified_rounds": ok,
        "state_syncs": syncs,
        "initial_eval_loss": max(initial) if initial else None,
        "final_eval_loss_min": min(finals) if finals else None,
        "final_eval_loss_mean": sum(finals) / len(finals) if finals else None,
        "nodes": per_node,
    }


# ------------------------------------------------------------------------------ report
def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def write_doc(data: dict) -> None:
    calm, churn = data["runs"]["calm"], data["runs"]["churn"]
    rows = []
    for r in (calm, churn):
        goodputs = ", ".join(f"{n} {fmt(v['last_goodput'], 2)}" for n, v in r["nodes"].items())
        rows.append(
            f"| {r['label']} | {fmt(r['goodput_overall'])} | {goodputs} | {r['swarm_outer_steps']} | "
            f"{r['verified_rounds']} / {r['rounds']} | {r['state_syncs']} | {fmt(r['initial_eval_loss'])} | "
            f"{fmt(r['final_eval_loss_min'])} / {fmt(r['final_eval_loss_mean'])} |")
    sched = "\n".join(f"| {s['kill_at']} | {s['peer']} | {s['restart_at']} |" for s in data["schedule"]) or "| – | – | – |"
    done = "\n".join(
        f"- t = {a['t']} s: {a['action']} {a['peer']}"
        + (f" ({a['pids']} processes)" if "pids" in a else "")
        + (f" (exit code {a['code']})" if "code" in a else "")
        for a in churn["actions"]) or "- (none)"
    m = data["machine"]
    size = "quick (`--quick`)" if data["quick"] else "full"
    text = f"""# Benchmark: goodput under churn

Generated by `{data['command']}` on {data['date']} ({size} size). Do not edit by hand: rerun the command.

Four real `diloco_swarm join` processes on 127.0.0.1 (tiny model, CPU) train for a fixed
{data['duration_s']:.0f} s of wall time (counted from the moment all four have started training), twice
in one invocation: **calm** (nobody fails) and **churn** (a seeded schedule SIGKILLs the whole process
tree of one peer, i.e. the node, its forked hivemind processes and its p2pd daemon, and restarts it
with the same `--state-dir` and `--wait-for-peers 0` about {RESTART_AFTER_S:.0f} s later). At the end every
live node gets SIGINT and leaves gracefully.

Node arguments: `{' '.join(NODE_ARGS)}`; the initial start adds `--wait-for-peers {N_NODES}`, a restart
`--wait-for-peers 0` and `--initial-peers` of a live peer.

Machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}. **The CPUs are shared with other
work (and the four nodes share them with each other), so read the ratios between the two runs, not the
absolute figures.**

## Results

| run | goodput, overall | goodput, each node's last `outer_step` record | outer steps (swarm) | verified rounds / rounds | state syncs | initial eval loss | final eval loss min / mean |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

**goodput(churn) / goodput(calm) = {fmt(data['goodput_ratio'])}** (overall figures).

- *goodput, overall*: Σ(`inner_s` − `wasted_inner_s`) over every process life (its last `outer_step`
  record; 0 for a life killed before its first record) divided by Σ of the lives' wall time (launch to
  exit, imports included). Time a peer is down is in no life's wall time.
- *outer steps (swarm)*: the highest `outer_step` any node reached (round record or state sync).
- *verified rounds / rounds*: `outer_step` records with `round_ok` true, over all records of all nodes.
- *state syncs*: `state_sync` events over all nodes (joins after a restart, lagging or diverged peers).
- *eval loss*: held-out loss in nats per byte; initial = the `eval` event at start (max over nodes),
  final = each node's last `eval_loss`.

Measured windows: calm {calm['measured_s']} s, churn {churn['measured_s']} s. Graceful-leave exit codes:
calm {calm['leave_codes']}, churn {churn['leave_codes']}.

## Churn schedule (seed {data['seed']})

Seconds after the measured window starts: a kill about every {KILL_EVERY_S:.0f} ± {KILL_JITTER_S:.0f} s, one peer down at a time.

| kill at (s) | peer | restart at (s) |
|---|---|---|
{sched}

Carried out:

{done}

Raw data: `bench/out/{data['out_name']}` (not committed).
"""
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 s runs instead of 150 s")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (overrides the size)")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)

    def _terminate(signum, frame):  # SIGTERM (and SIGINT, even where it was ignored): clean up in `finally`
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    duration = args.duration or (60.0 if args.quick else 150.0)
    names = [f"p{i}" for i in range(N_NODES)]
    schedule = churn_schedule(args.seed, duration, names)
    print(f"churn schedule (seed {args.seed}), seconds after the window starts:")
    for item in schedule:
        print(f"  kill {item['peer']} at {item['kill_at']} s, restart at {item['restart_at']} s")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    work = OUT_DIR / ("churn-runs.quick" if args.quick else "churn-runs")
    runs = {}
    for label, sched in (("calm", None), ("churn", schedule)):
        d = work / label
        if d.exists():
            subprocess.run(["rm", "-rf", str(d)], check=False)
        runs[label] = run_once(label, d, duration, sched)
        print(json.dumps({k: v for k, v in runs[label].items() if k not in ("nodes", "actions")}), flush=True)

    gc, gk = runs["calm"]["goodput_overall"], runs["churn"]["goodput_overall"]
    out_name = "churn.quick.json" if args.quick else "churn.json"
    cmd = "python -m bench.churn" + (" --quick" if args.quick else "")
    if args.duration:
        cmd += f" --duration {args.duration:g}"
    if args.seed != SEED:
        cmd += f" --seed {args.seed}"
    data = {
        "command": cmd,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "duration_s": duration,
        "seed": args.seed,
        "schedule": schedule,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "runs": runs,
        "goodput_ratio": (gk / gc) if gc and gk is not None else None,
        "out_name": out_name,
    }
    (OUT_DIR / out_name).write_text(json.dumps(data, indent=2))
    write_doc(data)
    print(f"goodput calm {fmt(gc)} churn {fmt(gk)} ratio {fmt(data['goodput_ratio'])}")
    print(f"wrote {OUT_DIR / out_name} and {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
