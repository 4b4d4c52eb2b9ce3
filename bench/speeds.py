"""``speeds``: 3 peers, one of them 3× slower (``--fault slowdown=3``, tests/faults.py), against 3 equal peers.

Two runs of 3 real nodes on 127.0.0.1, overlapped rounds: ``mixed`` and ``equal``. Per peer: inner steps per
outer step (DyLU-sized). The slow peer's share of the swarm's rounds (distinct ``round_key``, ≥ 2 members), and
the swarm's goodput and tokens per second over a common window (from every peer's 2nd applied round to the
first peer's second-to-last; each peer's cumulative figures interpolated between its records).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from bench.common import exits_md, f, loadavg, md_table, notes_md, ratio
from bench.nodes import NodeSpec, run_nodes, scratch
from tests.swarmlib import round_key

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
AVERAGING_WINDOW_S = 30.0


def node_args(cfg: dict[str, Any]) -> list[str]:
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8", "--matchmaking-time", str(MATCHMAKING_S),
            "--averaging-window", str(AVERAGING_WINDOW_S), "--target-group-size", str(PEERS),
            "--max-dataset-bytes", str(cfg["max_bytes"]), "--max-outer-steps", str(cfg["outer_steps"]),
            "--wait-for-peers", str(PEERS), "--device", "cpu", "--threads", "1"]


def _at(records: list[dict], t: float, value) -> float:
    """A cumulative figure of one node at time ``t``, linearly interpolated between its records."""
    for a, b in zip(records, records[1:]):
        if a["time"] <= t <= b["time"]:
            w = (t - a["time"]) / (b["time"] - a["time"]) if b["time"] > a["time"] else 0.0
            return value(a) + w * (value(b) - value(a))
    raise ValueError("t outside the records")


def _useful(e: dict) -> float:
    return e["inner_s"] - e["wasted_inner_s"]


def analyse(runs, slow: int | None) -> dict[str, Any]:
    """Per-peer figures, the slow peer's share of rounds and the swarm goodput over the common window."""
    recs = [r.records("outer_step") for r in runs]
    ids = [next((e.get("peer_id") for e in r.records("start")), None) for r in runs]
    t_a = t_b = None
    if all(len(x) >= 4 for x in recs) and min(x[-2]["time"] for x in recs) > max(x[1]["time"] for x in recs):
        t_a, t_b = max(x[1]["time"] for x in recs), min(x[-2]["time"] for x in recs)
    out: dict[str, Any] = {"peers": [], "window": [t_a, t_b], "window_s": t_a and t_b - t_a}
    useful = tokens = 0.0
    for i, (r, x) in enumerate(zip(runs, recs)):
        peer = {"peer": i, "slow": i == slow, "exit_code": r.exit_code, "outer_steps": len(x),
                "inner_steps": [e.get("inner_steps") for e in x], "group_sizes": [e.get("group_size") for e in x],
                "rounds_ok": sum(1 for e in x if e.get("round_ok")), "state_syncs": len(r.records("state_sync")),
                "log_tail": r.log_tail()}
        if t_a is not None:
            du = _at(x, t_b, _useful) - _at(x, t_a, _useful)
            dt = _at(x, t_b, lambda e: e["tokens_total"]) - _at(x, t_a, lambda e: e["tokens_total"])
            useful, tokens = useful + du, tokens + dt / (t_b - t_a)
            steps = [e.get("inner_steps") or 0 for e in x if t_a <= e["time"] <= t_b]
            peer.update(window_goodput=du / (t_b - t_a), window_tokens_per_s=dt / (t_b - t_a),
                        mean_inner_steps=sum(steps) / len(steps) if steps else None)
        out["peers"].append(peer)
    out["swarm_goodput"] = useful / (len(runs) * (t_b - t_a)) if t_a is not None else None
    out["swarm_tokens_per_s"] = tokens or None
    rounds = {round_key(e): e.get("group") or [] for x in recs for e in x
              if (e.get("group_size") or 0) >= 2 and (t_a is None or t_a <= e["time"] <= t_b)}
    out["rounds"] = len(rounds)
    if slow is not None and ids[slow]:
        out["slow_joined"] = sum(1 for g in rounds.values() if ids[slow] in g)
        out["slow_share"] = ratio(out["slow_joined"], len(rounds))
    return out


def run(size: str) -> dict[str, Any]:
    cfg, tag, variants = SIZES[size], str(int(time.time())), {}
    for label in ("mixed", "equal"):
        slow = PEERS - 1 if label == "mixed" else None
        load, t0 = loadavg(), time.time()
        with scratch("speeds", label, cfg.get("keep_logs")) as workdir:
            specs = [NodeSpec(f"peer-{i}", f"bench-speeds-{tag}-{label}", node_args(cfg)
                              + (["--fault", f"slowdown={SLOWDOWN:g}"] if i == slow else [])) for i in range(PEERS)]
            out = analyse(run_nodes(specs, workdir, cfg["timeout"]), slow)
        variants[label] = {"label": label, "slow_peer": slow, "loadavg_start": load,
                           "elapsed_s": round(time.time() - t0, 1), **out}
        print(f"[speeds] {label}: goodput {f(out['swarm_goodput'], '.1%')}", file=sys.stderr, flush=True)
    return {"config": cfg, "slowdown": SLOWDOWN, "matchmaking_time": MATCHMAKING_S,
            "averaging_window": AVERAGING_WINDOW_S, "variants": variants}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, m, e = result["config"], result["variants"]["mixed"], result["variants"]["equal"]
    rows = [[v["label"], f"{p['peer']}{' (slow)' if p['slow'] else ''}", " ".join(str(s) for s in p["inner_steps"]),
             f(p.get("mean_inner_steps"), ".1f"), " ".join(str(g) for g in p["group_sizes"]),
             f(p.get("window_goodput"), ".1%"), f(p.get("window_tokens_per_s"), ".0f"), p["state_syncs"], p["exit_code"],
             v["loadavg_start"]] for v in (m, e) for p in v["peers"]]
    return "\n".join([
        f"Model `{cfg['model']}`, nominal H = {cfg['H']}, seq_len {cfg['seq_len']}, batch {cfg['batch']}, int8, "
        f"{cfg['outer_steps']} outer steps; peer {PEERS - 1} of the mixed run slowed {result['slowdown']:g}×.\n",
        md_table(["run", "peer", "inner steps per outer step", "mean in window", "group sizes", "goodput (window)",
                  "tokens/s (window)", "state syncs", "exit", "load avg at start"], rows),
        f"\nThe slow peer joined **{m.get('slow_joined', '–')} of {m['rounds']}** rounds "
        f"(**{f(m.get('slow_share'), '.0%')}**). Swarm goodput: mixed {f(m['swarm_goodput'], '.1%')}, equal "
        f"{f(e['swarm_goodput'], '.1%')}: **{f(ratio(m['swarm_goodput'], e['swarm_goodput']))}×**. Swarm tokens per "
        f"second: {f(ratio(m['swarm_tokens_per_s'], e['swarm_tokens_per_s']))}× the equal run's (no time lost: "
        f"{(PEERS - 1 + 1 / result['slowdown']) / PEERS:.2f}×).\n",
        notes_md(result), exits_md((f"{v['label']}, peer {p['peer']}", p) for v in (m, e) for p in v["peers"])])
