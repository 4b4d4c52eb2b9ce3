"""``speeds``: 3 peers, one of them 3× slower, against 3 equal peers (adaptive inner steps, DyLU).

Two runs of 3 real ``diloco-node join`` processes on 127.0.0.1 in one invocation, overlapped
rounds (the default sync mode):

- ``mixed``: peer 2 is the tests' faulty node with ``--fault slowdown=3`` (each inner step takes 3× as
  long: a slower machine; tests/faults.py), so it trains about ⅓ of the others' tokens per second;
- ``equal``: the same 3 peers, none slowed.

Reported per peer: inner steps per outer step (the ``inner_steps`` field of its records: DyLU-sized,
extended while a round runs). For the slow peer: the share of the swarm's rounds it joined, from the
``group`` field of every peer's records (a round = a distinct ``nodes.round_key``, hivemind's group id, with ≥ 2 members).
Swarm goodput over a common window (from the moment every peer has applied 2 rounds to the
moment the first peer applied its second-to-last one; each peer's cumulative figures interpolated
between its records): Σ inner seconds whose Δ was applied (``inner_s − wasted_inner_s``) ÷ Σ wall
seconds, over the peers; the slow peer's slowed steps count as
inner seconds (its machine is busy). Tokens per wall second are reported beside it, with the
ratio an ideal swarm would reach (1 + 1 + ⅓) / 3.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_OUT, loadavg, md_table
from bench.nodes import FAULTY_NODE, NodeSpec, keep_logs, round_key, run_nodes

SLOWDOWN = 3.0
PEERS = 3
SIZES = {
    "smoke": {"model": "tiny", "H": 6, "seq_len": 32, "batch": 2, "outer_steps": 5, "max_bytes": 200_000,
              "timeout": 240},
    "quick": {"model": "tiny", "H": 40, "seq_len": 64, "batch": 4, "outer_steps": 6, "max_bytes": 1_000_000,
              "timeout": 400, "keep_logs": True},
    "full": {"model": "tiny", "H": 100, "seq_len": 64, "batch": 4, "outer_steps": 15, "max_bytes": 2_000_000,
             "timeout": 900, "keep_logs": True},
}
MATCHMAKING_S = 2.0
RUNS_DIR = DEFAULT_OUT / "speeds-runs"  # the nodes' metrics and logs of the last run, to look into
AVERAGING_WINDOW_S = 30.0


def node_args(cfg: dict[str, Any]) -> list[str]:
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8", "--matchmaking-time", str(MATCHMAKING_S),
            "--averaging-window", str(AVERAGING_WINDOW_S), "--target-group-size", str(PEERS),
            "--max-dataset-bytes", str(cfg["max_bytes"]), "--max-outer-steps", str(cfg["outer_steps"]),
            "--wait-for-peers", str(PEERS), "--device", "cpu", "--threads", "1"]


def _interp(records: list[dict], t: float, key) -> float:
    """A cumulative figure of one node at time ``t``, linearly interpolated between its records."""
    value = key if callable(key) else (lambda e: e[key])
    for a, b in zip(records, records[1:]):
        if a["time"] <= t <= b["time"]:
            f = (t - a["time"]) / (b["time"] - a["time"]) if b["time"] > a["time"] else 0.0
            return value(a) + f * (value(b) - value(a))
    raise ValueError("t outside the records")


def _useful(e: dict) -> float:
    return e["inner_s"] - e["wasted_inner_s"]


def analyse(runs, slow: int | None) -> dict[str, Any]:
    """Per-peer figures, the slow peer's share of rounds and the swarm goodput over a common window
    [t_a, t_b]: t_a = when the last peer applied its 2nd round, t_b = when the first peer applied its
    second-to-last; every peer's cumulative figures are interpolated between its records at both ends."""
    recs = [[e for e in r.records() if e.get("event") == "outer_step"] for r in runs]
    ids = [next((e.get("peer_id") for e in r.records("start")), None) for r in runs]
    out: dict[str, Any] = {"peers": []}
    t_a = t_b = None
    if all(len(x) >= 4 for x in recs):
        t_a = max(x[1]["time"] for x in recs)
        t_b = min(x[-2]["time"] for x in recs)
        if t_b <= t_a:
            t_a = t_b = None
    useful = tokens = 0.0
    for i, (r, x) in enumerate(zip(runs, recs)):
        peer: dict[str, Any] = {"peer": i, "slow": i == slow, "exit_code": r.exit_code, "outer_steps": len(x),
                                "inner_steps": [e.get("inner_steps") for e in x],
                                "group_sizes": [e.get("group_size") for e in x],
                                "rounds_ok": sum(1 for e in x if e.get("round_ok")),
                                "state_syncs": len(r.records("state_sync")),
                                "log_tail": "" if r.exit_code == 0 else r.log.read_text(errors="replace")[-2000:]}
        if t_a is not None:
            dw = t_b - t_a
            du = _interp(x, t_b, _useful) - _interp(x, t_a, _useful)
            dt = _interp(x, t_b, "tokens_total") - _interp(x, t_a, "tokens_total")
            useful, tokens = useful + du, tokens + dt / dw
            steps = [e.get("inner_steps") or 0 for e in x if t_a <= e["time"] <= t_b]
            peer.update(window_goodput=du / dw, window_tokens_per_s=dt / dw,
                        mean_inner_steps=sum(steps) / len(steps) if steps else None)
        out["peers"].append(peer)
    out["window"] = [t_a, t_b]
    out["window_s"] = (t_b - t_a) if t_a is not None else None
    out["swarm_goodput"] = useful / (len(runs) * (t_b - t_a)) if t_a is not None else None
    out["swarm_tokens_per_s"] = tokens or None
    # rounds: distinct rounds (nodes.round_key) with ≥ 2 members in any peer's records inside the window
    rounds = {round_key(e): e.get("group") or [] for x in recs for e in x
              if (e.get("group_size") or 0) >= 2 and (t_a is None or t_a <= e["time"] <= t_b)}
    out["rounds"] = len(rounds)
    if slow is not None and ids[slow]:
        joined = sum(1 for g in rounds.values() if ids[slow] in g)
        out["slow_joined"] = joined
        out["slow_share"] = joined / len(rounds) if rounds else None
    return out


def run_variant(cfg: dict[str, Any], label: str, tag: str) -> dict[str, Any]:
    slow = PEERS - 1 if label == "mixed" else None
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-speeds-{label}-"))
    load = loadavg()
    print(f"[speeds] {label}: load average at start {load}", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        specs = [NodeSpec(f"peer-{i}", f"bench-speeds-{tag}-{label}", node_args(cfg)) for i in range(PEERS)]
        if slow is not None:
            specs[slow].args += ["--fault", f"slowdown={SLOWDOWN:g}"]
            specs[slow].entry = FAULTY_NODE
        runs = run_nodes(specs, workdir, cfg["timeout"], log_tag=f"[speeds {label}] ")
        out = analyse(runs, slow)
    finally:
        if cfg.get("keep_logs"):
            keep_logs(workdir, RUNS_DIR / label)
        shutil.rmtree(workdir, ignore_errors=True)
    return {"label": label, "slow_peer": slow, "loadavg_start": load, "elapsed_s": round(time.time() - t0, 1), **out}


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    tag = str(int(time.time()))
    variants = {label: run_variant(cfg, label, tag) for label in ("mixed", "equal")}
    result = {"config": cfg, "slowdown": SLOWDOWN, "matchmaking_time": MATCHMAKING_S,
              "averaging_window": AVERAGING_WINDOW_S, "variants": variants}
    for line in summary_lines(result):
        print(f"[speeds] {line}", file=sys.stderr, flush=True)
    return result


def _f(x, spec=".2f"):
    return f"{x:{spec}}" if x is not None else "–"


def _ratio(a, b):
    return a / b if a is not None and b else None


def summary_lines(result: dict[str, Any]) -> list[str]:
    m, e = result["variants"]["mixed"], result["variants"]["equal"]
    lines = [f"{v['label']}: peer {p['peer']}{' (slow)' if p['slow'] else ''}: inner steps per outer step "
             f"{p['inner_steps']}, goodput {_f(p.get('window_goodput'), '.1%')}"
             for v in (m, e) for p in v["peers"]]
    lines.append(f"slow peer joined {m.get('slow_joined', '–')}/{m['rounds']} rounds ({_f(m.get('slow_share'), '.0%')}, "
                 f"target ≥ 80%); swarm goodput mixed {_f(m['swarm_goodput'], '.1%')} vs equal "
                 f"{_f(e['swarm_goodput'], '.1%')}: {_f(_ratio(m['swarm_goodput'], e['swarm_goodput']))}× "
                 f"(target ≥ 0.9×); tokens/s {_f(_ratio(m['swarm_tokens_per_s'], e['swarm_tokens_per_s']))}× "
                 f"(ideal {(PEERS - 1 + 1 / result['slowdown']) / PEERS:.2f}×)")
    return lines


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg = result["config"]
    m, e = result["variants"]["mixed"], result["variants"]["equal"]
    md = [
        f"{PEERS} `diloco-node join` processes on 127.0.0.1, overlapped rounds, two runs in one invocation: **mixed** "
        f"(peer {PEERS - 1} runs with `--fault slowdown={result['slowdown']:g}`, tests/faults.py: each inner step takes "
        f"{result['slowdown']:g}× as long) and **equal** (nobody slowed). Model `{cfg['model']}`, nominal H = "
        f"{cfg['H']} (DyLU range H/4 .. 2H), seq_len {cfg['seq_len']}, batch {cfg['batch']}, int8, "
        f"{cfg['outer_steps']} outer steps, matchmaking {result['matchmaking_time']} s, `--threads 1` each.\n",
        "*Goodput* = Σ inner seconds whose Δ was applied (`inner_s − wasted_inner_s`) ÷ Σ wall seconds over the "
        "peers, in a common window (from the moment every peer applied 2 rounds to the moment the first one applied "
        "its second-to-last; each peer's cumulative `inner_s`, `wasted_inner_s`, `tokens_total` interpolated "
        "between its records at both ends); a slowed step counts as inner time (the slow machine is busy). *Rounds joined*: of "
        "the distinct rounds (by hivemind's group id) with ≥ 2 members in any peer's records in the window, those whose "
        "`group` holds the slow peer.\n",
    ]
    rows = []
    for v in (m, e):
        for p in v["peers"]:
            rows.append([v["label"], f"{p['peer']}{' (slow)' if p['slow'] else ''}",
                         " ".join(str(s) for s in p["inner_steps"]), _f(p.get("mean_inner_steps"), ".1f"),
                         " ".join(str(g) for g in p["group_sizes"]), _f(p.get("window_goodput"), ".1%"),
                         _f(p.get("window_tokens_per_s"), ".0f"), p["state_syncs"], p["exit_code"],
                         v["loadavg_start"]])
    md.append(md_table(["run", "peer", "inner steps per outer step", "mean in window", "group sizes",
                        "goodput (window)", "tokens/s (window)", "state syncs", "exit", "load avg at start"], rows))
    gr = _ratio(m["swarm_goodput"], e["swarm_goodput"])
    tr = _ratio(m["swarm_tokens_per_s"], e["swarm_tokens_per_s"])
    md.append(
        f"\nThe slow peer joined **{m.get('slow_joined', '–')} of {m['rounds']}** rounds "
        f"(**{_f(m.get('slow_share'), '.0%')}**, target ≥ 80%). Swarm goodput: mixed {_f(m['swarm_goodput'], '.1%')}, "
        f"equal {_f(e['swarm_goodput'], '.1%')}: **{_f(gr)}×** (target ≥ 0.9×). Swarm tokens per second: "
        f"{_f(tr)}× the equal run's (a swarm that lost no time would reach "
        f"{(PEERS - 1 + 1 / result['slowdown']) / PEERS:.2f}×: the slow peer trains ⅓ of the tokens).\n")
    for note in result.get("notes", []):  # a reading of the run, added to its JSON afterwards
        md.append(f"\n*Note:* {note}\n")
    problems = [f"- {v['label']}, peer {p['peer']} exited {p['exit_code']}: "
                f"`{((p.get('log_tail') or '').strip().splitlines()[-1:] or ['(no output)'])[0][:160]}`"
                for v in (m, e) for p in v["peers"] if p["exit_code"] != 0]
    if problems:
        md.append("\nWhat went wrong in this run:\n\n" + "\n".join(problems) + "\n")
    return "\n".join(md)
