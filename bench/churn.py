"""Goodput under churn: a calm swarm against one whose peers are killed and restarted.

``python -m bench.churn [--quick]``: 4 real nodes on 127.0.0.1 (tiny model) train for a fixed window twice:
``calm``, and ``churn``, where a seeded schedule SIGKILLs the whole process tree of a peer (node, forked hivemind
processes, p2pd: a machine failure) about every 20 s and restarts it about 10 s later with the same state dir,
``--wait-for-peers 0`` and every live peer's address. Then every live node gets SIGINT. :func:`run_once` and
:func:`churn_schedule` serve ``bench/netns.py`` too (the same schedule behind 100 Mbit/s links).
"""

from __future__ import annotations

import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from bench.common import REPO, figure, f, mean, md_table, ratio
from tests.swarmlib import NodeProc, Swarm, kill_tree

N_NODES = 4
SEED = 20240603
DURATION_S = {"smoke": 40.0, "quick": 75.0, "full": 150.0}
# a kill every `every` ± `jitter` s, the peer back `down` ± `down_jitter` s later, none in the window's last `tail` s
SCHEDULE = {"every": 20.0, "jitter": 5.0, "down": 10.0, "down_jitter": 2.0, "tail": 20.0}
START_TIMEOUT_S = 300.0  # torch + hivemind imports and the dataset on a busy 2-core machine
RESTART_FAILED_AFTER_S = 2.0  # a node that exits on its own in the window is restarted (like a supervisor would)
NODE_ARGS = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--inner-steps", "10",
             "--max-dataset-bytes", "300000", "--threads", "1", "--device", "cpu", "--matchmaking-time", "3",
             "--averaging-window", "30", "--allreduce-timeout", "20"]
# log lines worth quoting: the node's own errors and warnings, hivemind's WARN/ERROR lines; not its DEBUG lines,
# the tracebacks they carry, or the node's status line
_NOTE = re.compile(r"error|warning|traceback|failed|refused|could not|exception", re.I)
_LOGGER = re.compile(r"^\w{3} +\d+ [\d:.]+ \[(\w+)\]")  # "Nov 30 05:28:24.209 [DEBUG] ..."
_QUIET = re.compile(r"^(outer \d+ \||\s|\* |Traceback|During handling|The above exception|"
                    r"[\w.]+(Error|Exception|Failure)\b)")


def noteworthy(line: str) -> bool:
    m = _LOGGER.match(line)
    return m[1] in ("WARN", "WARNING", "ERROR", "CRITICAL") if m else bool(_NOTE.search(line)) and not _QUIET.match(line)


def churn_schedule(seed: int, duration: float, names: list[str], every: float, jitter: float, down: float,
                   down_jitter: float, tail: float) -> list[dict]:
    """[{kill_at, restart_at, peer}], seconds after the window starts, one peer down at a time (:data:`SCHEDULE`)."""
    rng = random.Random(seed)
    plan, t, back = [], 0.0, 0.0
    while True:
        t = max(t + every + rng.uniform(-jitter, jitter), back + 3.0)
        back = t + down + rng.uniform(-down_jitter, down_jitter)  # the next kill comes after this restart
        if back > duration - tail:
            return plan
        plan.append({"kill_at": round(t, 1), "restart_at": round(back, 1), "peer": rng.choice(names)})


def _live_maddrs(swarm: Swarm, exclude: str) -> list[str]:
    """The current address of every live node but ``exclude`` (a restart dials them all)."""
    out = []
    for node in swarm.nodes.values():
        starts = [e for e in node.events("start") if node.alive() and e["time"] >= node.lives[-1]["launched"]]
        if node.name != exclude and starts and starts[-1].get("maddrs"):
            out.append(starts[-1]["maddrs"][0])
    return out


def run_once(label: str, root: Path, duration: float, schedule: list[dict] | None, *,
             node_args: list[str] = NODE_ARGS, placements: dict[str, tuple[list[str], str]] | None = None,
             names: list[str] | None = None, counters: Callable[[], list[tuple[int, int]]] | None = None,
             start_timeout: float = START_TIMEOUT_S, env: dict[str, str] | None = None) -> dict:
    """Start ``names`` (the first alone, the others through it; ``placements``: name → (command prefix, host)),
    wait until all train, then measure ``duration`` s while carrying out ``schedule`` (None: calm) and restarting
    a node that exits on its own, then SIGINT everyone. ``counters()``: (rx, tx) bytes per node, read at the
    window's start and end."""
    names, placements = names or [f"p{i}" for i in range(N_NODES)], placements or {}
    with Swarm(root, f"bench-{label}-{int(time.time())}", base=node_args, env={"OMP_NUM_THREADS": "1", **(env or {})},
               cwd=REPO) as swarm:
        def start(name: str, *args: str, initial: list[str] | None = None) -> NodeProc:
            wrap, host = placements.get(name, ([], "127.0.0.1"))
            return swarm.start(name, "--host", host, *args, initial=initial, wrap=wrap, wait_start=False)

        first = start(names[0], "--wait-for-peers", str(len(names)))
        swarm.wait(lambda: first.events("start"), start_timeout, "start", first)
        nodes = [first] + [start(n, "--wait-for-peers", str(len(names)), initial=[first.maddr()]) for n in names[1:]]
        swarm.wait(lambda: all(n.events("eval") for n in nodes), start_timeout, "all peers train", nodes)
        t0, before, actions = time.time(), counters() if counters else None, []
        print(f"[{label}] all {len(names)} peers training; measuring {duration:.0f} s", file=sys.stderr, flush=True)
        pending = sorted([(t0 + x["kill_at"], "kill", x["peer"]) for x in schedule or []]
                         + [(t0 + x["restart_at"], "restart", x["peer"]) for x in schedule or []])
        while time.time() < t0 + duration:
            while pending and pending[0][0] <= time.time():
                _, action, name = pending.pop(0)
                node, now = swarm.nodes[name], round(time.time() - t0, 1)
                if action == "kill":
                    actions.append({"t": now, "action": "kill", "peer": name, "pids": len(kill_tree(node))})
                elif not node.alive():  # (not when it is back already: restarted after a failure)
                    initial = _live_maddrs(swarm, name)
                    if not initial:  # nobody is up to join through: try again shortly
                        pending = sorted([*pending, (time.time() + 1.0, action, name)])
                        continue
                    start(name, "--wait-for-peers", "0", initial=initial)
                    actions.append({"t": now, "action": "restart", "peer": name, "initial_peers": len(initial),
                                    **({"after_failure": True} if action == "restart-failed" else {})})
            for node in nodes:  # an unplanned exit is recorded, not hidden, and restarted as a supervisor would
                if node.proc.poll() is not None and "ended" not in node.lives[-1]:
                    node.end_life("exited")
                    actions.append({"t": round(time.time() - t0, 1), "action": "exited", "peer": node.name,
                                    "code": node.proc.returncode})
                    pending = sorted([*pending, (time.time() + RESTART_FAILED_AFTER_S, "restart-failed", node.name)])
            time.sleep(0.2)
        t_end, after = time.time(), counters() if counters else None
        codes = swarm.leave()
        result = summarize(label, nodes, t0, t_end)
        result.update(duration_s=duration, actions=actions, leave_codes=codes)
        for node in nodes:  # the end of the log of a node that exited badly
            if codes.get(node.name, 0) != 0 or any(life.get("how") == "exited" and life["code"] for life in node.lives):
                result["nodes"][node.name]["log_tail"] = node.output()[-1500:]
        if before and after:
            result["link_bytes_window"] = [{"rx": a[0] - b[0], "tx": a[1] - b[1]} for a, b in zip(after, before)]
        return result


def _at(records: list[dict], t: float, key: str) -> float:
    """A cumulative metric of one process life at time ``t``: its last record's value at or before ``t``."""
    return next(((e.get(key) or 0.0) for e in reversed(records) if e["time"] <= t), 0.0)


def summarize(label: str, nodes: list[NodeProc], t0: float, t_end: float) -> dict:
    """Goodput and utilization over the process lives and over the window, rounds, syncs, losses, per-node lives."""
    useful = inner = wall = startup = win_inner = win_useful = 0.0
    per_node, all_records, initial, finals, series = {}, [], [], [], {}
    for node in nodes:
        events, lives = node.events(), []
        for life in node.lives:  # each life's records: written between its launch and its end
            ended = life.get("ended") or time.time()
            recs = [e for e in events if e.get("event") == "outer_step" and life["launched"] <= e["time"] <= ended + 1.0]
            last = recs[-1] if recs else {"inner_s": 0.0, "wasted_inner_s": 0.0}
            start = next((e for e in events if e.get("event") == "start" and life["launched"] <= e["time"] <= ended), None)
            up = (start["time"] if start else ended) - life["launched"]  # launch to its start record
            useful, inner = useful + last["inner_s"] - last["wasted_inner_s"], inner + last["inner_s"]
            wall, startup = wall + ended - life["launched"], startup + up
            d_inner = _at(recs, t_end, "inner_s") - _at(recs, t0, "inner_s")
            win_inner += d_inner
            win_useful += d_inner - _at(recs, t_end, "wasted_inner_s") + _at(recs, t0, "wasted_inner_s")
            lives.append({"launched": round(life["launched"] - t0, 1), "ended": round(ended - t0, 1),
                          "how": life.get("how", ""), "code": life.get("code"), "outer_steps": len(recs),
                          "startup_s": round(up, 1), "startup_phases": (start or {}).get("startup_s")})
        recs = [e for e in events if e.get("event") == "outer_step"]
        all_records += [e for e in recs if e["time"] <= t_end]  # not the rounds cut short by the final SIGINT
        initial += [e["eval_loss"] for e in events if e.get("event") == "eval"][:1]
        final = next((e["eval_loss"] for e in reversed(events) if e.get("event") in ("outer_step", "eval")), None)
        finals += [final] if final is not None else []
        # [seconds since t0, loss]; [t, None] at each process start (a gap in the plotted line)
        series[node.name] = [[round(e["time"] - t0, 2), e.get("eval_loss")] for e in events if e.get("event") == "start"
                             or (e.get("event") in ("outer_step", "eval") and e.get("eval_loss") is not None)]
        per_node[node.name] = {
            "lives": lives, "final_eval_loss": final,
            "state_syncs": [{k: e.get(k) for k in ("reason", "from_outer_step", "outer_step", "bytes", "seconds")}
                            | {"t": round(e["time"] - t0, 1)} for e in events if e.get("event") == "state_sync"],
            "log_notes": [ln.strip()[:300] for ln in node.output().splitlines() if noteworthy(ln)][-12:],
        }

    def swarm_step(t: float) -> int:
        return max((e["outer_step"] for n in nodes for e in n.events()
                    if e.get("event") in ("outer_step", "state_sync") and e["time"] <= t), default=0)

    ok, slots = sum(1 for r in all_records if r.get("round_ok")), len(nodes) * (t_end - t0)
    return {
        "label": label, "measured_s": round(t_end - t0, 1),
        "goodput_overall": ratio(useful, wall), "utilization_overall": ratio(inner, wall),
        "startup_s": round(startup, 1), "goodput_once_started": ratio(useful, wall - startup),
        "window_utilization": ratio(win_inner, slots), "window_goodput": ratio(win_useful, slots),
        "swarm_outer_steps": swarm_step(float("inf")), "outer_steps_in_window": swarm_step(t_end) - swarm_step(t0),
        "rounds": len(all_records), "verified_rounds": ok, "failed_rounds": len(all_records) - ok,
        "failure_reasons": dict(Counter((r.get("reason") or "?")[:160] for r in all_records if not r.get("round_ok"))),
        "group_sizes": dict(Counter(str(r.get("group_size")) for r in all_records)),
        "state_syncs": sum(len(n["state_syncs"]) for n in per_node.values()),
        "initial_eval_loss": max(initial, default=None), "final_eval_loss_min": min(finals, default=None),
        "final_eval_loss_mean": mean(finals), "series": series, "nodes": per_node,
    }


def run(size: str) -> dict:
    names, duration = [f"p{i}" for i in range(N_NODES)], DURATION_S[size]
    schedule = churn_schedule(SEED, duration, names, **SCHEDULE)
    print(f"[churn] schedule (seed {SEED}): {schedule}", file=sys.stderr, flush=True)
    runs = {}
    for label, sched in (("calm", None), ("churn", schedule)):
        work = REPO / "bench" / "out" / (f"churn-runs.{size}" if size != "full" else "churn-runs") / label
        shutil.rmtree(work, ignore_errors=True)  # the last run's nodes stay there, to look into
        runs[label] = run_once(label, work, duration, sched)
    return {"duration_s": duration, "seed": SEED, "schedule_params": SCHEDULE, "schedule": schedule,
            "node_args": NODE_ARGS, "runs": runs,
            "goodput_ratio": ratio(runs["churn"]["goodput_overall"], runs["calm"]["goodput_overall"])}


# --- report ----------------------------------------------------------------------------------------

def results_table(runs: list[dict]) -> str:
    n = len(next(iter(runs))["nodes"]) if runs else N_NODES
    return md_table(["run", "goodput (process lives)", "compute utilization (process lives)",
                     f"goodput, window × {n} slots", "start-up s (all lives)", "goodput once started",
                     "outer steps in window (swarm)", "highest outer step", "verified / all rounds", "failed rounds",
                     "state syncs", "final held-out loss min / mean", "graceful-leave exit codes"],
                    [[r["label"], f(r["goodput_overall"], ".3f"), f(r["utilization_overall"], ".3f"),
                      f(r["window_goodput"], ".3f"), f(r.get("startup_s"), ".1f"), f(r.get("goodput_once_started"), ".3f"),
                      r["outer_steps_in_window"], r["swarm_outer_steps"], f"{r['verified_rounds']} / {r['rounds']}",
                      r["failed_rounds"], r["state_syncs"],
                      f"{f(r['final_eval_loss_min'], '.3f')} / {f(r['final_eval_loss_mean'], '.3f')}",
                      ", ".join(f"{k} {v}" for k, v in r["leave_codes"].items()) or "–"] for r in runs])


def syncs_md(runs: list[dict]) -> str:
    """State syncs by reason (count, mean seconds, size) and averaging group sizes, per run."""
    parts = []
    for r in runs:
        by: dict[str, list[dict]] = {}
        for x in (x for node in r["nodes"].values() for x in node.get("state_syncs", [])):
            by.setdefault(x["reason"], []).append(x)
        syncs = ", ".join(f"{why} {len(xs)} (mean {sum(x['seconds'] or 0 for x in xs) / len(xs):.1f} s, "
                          f"{(xs[0]['bytes'] or 0) / 1e6:.1f} MB each)" for why, xs in sorted(by.items())) or "none"
        groups = ", ".join(f"{k}: {v}" for k, v in sorted(r.get("group_sizes", {}).items(), reverse=True))
        parts.append(f"{r['label']}: {syncs}" + (f"; averaging groups of {groups} round records" if groups else ""))
    return "State syncs by reason: " + "; ".join(parts) + "."


def schedule_md(schedule: list[dict], actions: list[dict]) -> str:
    """The seeded schedule as a table, and what was carried out (with unplanned exits)."""
    done = "\n".join(f"- t = {a['t']} s: {a['action']} {a['peer']}" + (f" ({a['pids']} processes)" if "pids" in a else "")
                     + (" **after its failure**" if a.get("after_failure") else "")
                     + (f" (dialing {a['initial_peers']} live peer(s))" if "initial_peers" in a else "")
                     + (f" (**exit code {a['code']}**)" if "code" in a else "") for a in actions) or "- (none)"
    return (md_table(["kill at (s)", "peer", "restart at (s)"],
                     [[s["kill_at"], s["peer"], s["restart_at"]] for s in schedule])
            + f"\nCarried out:\n\n{done}\n")


def problems_md(run: dict) -> list[str]:
    """Unplanned exits, non-zero leave codes, failed-round reasons and the nodes' error lines of one run."""
    out = [f"- {run['label']}: {count} round(s) not verified: `{reason}`"
           for reason, count in sorted(run.get("failure_reasons", {}).items(), key=lambda kv: -kv[1])]
    out += [f"- {run['label']}: {a['peer']} exited on its own at t = {a['t']} s (exit code {a['code']})"
            for a in run.get("actions", []) if a["action"] == "exited"]
    out += [f"- {run['label']}: {name} answered the final SIGINT with exit code {code}"
            for name, code in (run.get("leave_codes") or {}).items() if code != 0]
    return out + [f"- {run['label']}, {name} log: `{line[:200]}`" for name, node in run.get("nodes", {}).items()
                  for line in [x for x in node.get("log_notes", []) if noteworthy(x)][-3:]]


def render(data: dict, docs_dir: Path) -> str:
    calm, churn = data["runs"]["calm"], data["runs"]["churn"]
    with figure(docs_dir / "bench-churn.png", (8, 4.2)) as ax:
        for label, run in data["runs"].items():
            for i, (name, pts) in enumerate(sorted(run["series"].items())):
                pts = [p for p in pts if p[0] >= -5]
                ax.plot([p[0] for p in pts], [float("nan") if p[1] is None else p[1] for p in pts], ".-", lw=0.8, ms=3,
                        color={"calm": "tab:blue", "churn": "tab:orange"}[label], label=label if i == 0 else None)
        for j, a in enumerate(churn["actions"]):
            color, ls = {"kill": ("tab:red", "--"), "restart": ("tab:green", ":"), "exited": ("black", "-.")}[a["action"]]
            ax.axvline(a["t"], color=color, ls=ls, lw=1,
                       label=a["action"] if a["action"] not in [b["action"] for b in churn["actions"][:j]] else None)
        ax.set(xlabel="seconds since all peers started training (measured window)",
               ylabel="held-out loss (nats/byte), each node", xlim=(-5, data["duration_s"] + 10))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lives = "\n".join(f"- {n}: " + "; ".join(
        f"{x['launched']}–{x['ended']} s {x['how']}" + (f" (code {x['code']})" if x["code"] not in (None, 0) and
                                                       x["how"] != "killed" else "")
        + f", {x['outer_steps']} steps, start-up {x['startup_s']} s" for x in v["lives"])
        + ("; syncs: " + ", ".join(f"{x['reason']} {x['from_outer_step']}→{x['outer_step']} at {x['t']} s"
                                   for x in v["state_syncs"]) if v["state_syncs"] else "")
        for n, v in churn["nodes"].items())
    problems = problems_md(calm) + problems_md(churn)
    return "\n".join([
        f"Window {data['duration_s']:.0f} s, seed {data['seed']}. Node arguments: `{' '.join(data['node_args'])}`.\n",
        results_table([calm, churn]),
        f"**Churn vs calm (same invocation): goodput {f(churn['goodput_overall'], '.3f')} vs "
        f"{f(calm['goodput_overall'], '.3f')} ({f(ratio(churn['goodput_overall'], calm['goodput_overall']))}×); once "
        f"started {f(ratio(churn.get('goodput_once_started'), calm.get('goodput_once_started')))}×; outer steps in the "
        f"window {f(ratio(churn['outer_steps_in_window'], calm['outer_steps_in_window']))}×; final held-out loss (mean "
        f"over nodes) {f(churn['final_eval_loss_mean'], '.3f')} vs {f(calm['final_eval_loss_mean'], '.3f')}.**\n",
        syncs_md([calm, churn]) + "\n", "![held-out loss vs wall time, calm vs churn](bench-churn.png)\n",
        "Schedule (seconds after the window starts):\n\n" + schedule_md(data["schedule"], churn["actions"]),
        f"Per node (churn run): process lives (seconds since the window started), state syncs:\n\n{lives}\n",
        "What went wrong:\n\n" + ("\n".join(problems) or "Nothing: no failed rounds, no unplanned exits, every node "
                                 "left with exit code 0.") + "\n",
        "".join(f"*Note:* {note}\n\n" for note in data.get("notes", []))])


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="churn"))
