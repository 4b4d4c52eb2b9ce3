"""Internet scale, simulated: 64 / 256 / 1,024 peers in one process, driven by the node's grouping rule.

``python -m bench.simscale [--quick]``. No network, no model: each round calls
:func:`diloco_swarm.averaging.grouping.plan_round` (the code the node uses, not a copy) on the online peers'
ETAs (lognormal speeds, churn with as many joiners as leavers, late peers folding their Δ into their next
round), and a ``DIM``-dimensional stand-in for θ_global shows how the groups mix: a group replaces its members'
θ by their mean θ plus the token-weighted mean Δ. Then ``SETTLE_ROUNDS`` rounds with no new Δ and no churn.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import human_bytes, md_table, mean
from diloco_swarm.averaging.grouping import plan_round

PARAMS = 100_000_000  # model size for the byte counts
INNER_S = 600.0  # one inner phase of a median-speed peer (H steps), seconds
SPEED_SIGMA = 0.5  # lognormal σ of peer speeds
QUORUM = 0.5
GRACE_S = 120.0
LINK_BYTES_PER_S = 100e6 / 8  # 100 Mbit/s
BLOCKSIZE = 1024
DIM = 64
SETTLE_ROUNDS = 4  # rounds without new Δ after the run: the spread the groups' mixing leaves
SIZES = {
    "quick": {"configs": [(64, 64), (256, 64), (1024, 64)], "rounds": 12},
    "full": {"configs": [(64, 64), (256, 64), (1024, 64), (1024, 16)], "rounds": 40},
}


def int8_allreduce_bytes(group_size: int, params: int = PARAMS) -> float:
    """Bytes one member sends (and receives) in a butterfly all-reduce of int8 parts."""
    if group_size < 2:
        return 0.0
    return 2 * params * (group_size - 1) / group_size * (1 + 4 / BLOCKSIZE)


def simulate(n_peers: int, cap: int, rounds: int, churn_per_hour: float = 0.1, seed: int = 0,
             settle_rounds: int = 0) -> dict[str, Any]:
    """``rounds`` rounds of training with churn, then ``settle_rounds`` rounds with no new Δ and no churn,
    every peer on time (the ``settle`` records): how fast the groups' mixing removes the θ spread."""
    rng = np.random.default_rng(seed)
    next_id = 0
    theta: dict[str, np.ndarray] = {}
    speed: dict[str, float] = {}
    remaining: dict[str, float] = {}  # seconds left in the current inner phase
    tokens: dict[str, float] = {}  # work since the peer's last contribution (median-speed seconds)
    delta: dict[str, np.ndarray] = {}

    def join(template: np.ndarray) -> str:
        nonlocal next_id
        pid = f"Qm{next_id:08d}"
        next_id += 1
        theta[pid] = template.copy()
        speed[pid] = float(rng.lognormal(0.0, SPEED_SIGMA))
        remaining[pid] = INNER_S / speed[pid]
        tokens[pid] = 0.0
        delta[pid] = np.zeros(DIM)
        return pid

    for _ in range(n_peers):
        join(np.zeros(DIM))
    clock = 0.0
    per_round = []
    joins = leaves = 0
    for t in range(rounds + settle_rounds):
        settle = t >= rounds
        online = sorted(theta)
        if settle:  # nobody trains: everyone is due at once, and Δ stays 0
            for p in online:
                remaining[p], tokens[p], delta[p] = 0.0, 0.0, np.zeros(DIM)
        plan = plan_round(t, {p: remaining[p] for p in online}, max_group_size=cap, quorum=QUORUM, grace_s=GRACE_S)
        largest = max((len(m) for m in plan.groups.values()), default=1)
        duration = plan.deadline_s + int8_allreduce_bytes(largest) / LINK_BYTES_PER_S
        # everyone trains for the round's duration (the expected peers exactly to the end of their phase)
        g = rng.standard_normal(DIM)
        for p in online if not settle else ():
            work = min(remaining[p], duration) if p in plan.expected else duration
            done = work * speed[p]  # tokens, in seconds of a median-speed peer
            tokens[p] += done
            delta[p] += done / INNER_S * (g + rng.standard_normal(DIM))
        bytes_avg = 0.0
        for members in plan.groups.values():
            w = np.array([max(tokens[p], 1e-9) for p in members])
            mean_theta = np.mean([theta[p] for p in members], axis=0)
            mean_delta = np.average([delta[p] for p in members], axis=0, weights=w)
            # members that hold different θ mix them: θ differences and momentum, 2 more int8 tensor sets
            tensor_sets = 3 if len({id(theta[p]) for p in members}) > 1 else 1
            new = mean_theta + mean_delta
            for p in members:
                theta[p] = new  # one array: members of a group hold the same θ
                bytes_avg += tensor_sets * int8_allreduce_bytes(len(members))
        for p in plan.expected:
            tokens[p], delta[p] = 0.0, np.zeros(DIM)
            remaining[p] = INNER_S / speed[p]
        for p in plan.late:
            remaining[p] = max(0.0, remaining[p] - duration)
        participants = [p for p in plan.expected]
        lineages = len({id(theta[p]) for p in participants})
        # churn over this round's wall time
        p_leave = 0.0 if settle else 1.0 - math.exp(-churn_per_hour * duration / 3600.0)
        leaving = [p for p in online if rng.random() < p_leave]
        for p in leaving:
            for d in (theta, speed, remaining, tokens, delta):
                d.pop(p)
        leaves += len(leaving)
        n_join = 0 if settle else int(rng.poisson(churn_per_hour * n_peers * duration / 3600.0))
        sync_bytes = 0.0
        for _ in range(n_join):
            if not theta:
                break
            donor = list(theta)[int(rng.integers(len(theta)))]
            join(theta[donor])
            sync_bytes += 8 * PARAMS
        joins += n_join
        clock += duration
        spread = _spread([theta[p] for p in theta])
        spread_participants = _spread([theta[p] for p in participants if p in theta])
        per_round.append({
            "round": t, "settle": settle, "time_s": round(clock, 1), "online": len(online), "expected": len(plan.expected),
            "late": len(plan.late), "groups": len(plan.groups), "grid_dims": plan.dims, "lineages": lineages,
            "theta_spread": spread, "theta_spread_participants": spread_participants,
            "avg_bytes_per_peer": bytes_avg / len(online),
            "sync_bytes_per_peer": sync_bytes / len(online), "joins": n_join, "leaves": len(leaving),
        })
    return {"n_peers": n_peers, "cap": cap, "rounds": rounds, "churn_per_hour": churn_per_hour,
            "joins": joins, "leaves": leaves, "per_round": per_round}


def _spread(thetas: list[np.ndarray]) -> float:
    """RMS distance from the mean θ, per coordinate (Δ coordinates are N(0, 1) per outer step)."""
    if len(thetas) < 2:
        return 0.0
    a = np.array(thetas)
    return float(np.sqrt(np.mean(np.sum((a - a.mean(axis=0)) ** 2, axis=1)) / DIM))


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    runs = [simulate(n, cap, cfg["rounds"], settle_rounds=SETTLE_ROUNDS) for n, cap in cfg["configs"]]
    return {"params": PARAMS, "inner_s": INNER_S, "speed_sigma": SPEED_SIGMA, "quorum": QUORUM, "grace_s": GRACE_S,
            "link_bytes_per_s": LINK_BYTES_PER_S, "dim": DIM, "runs": runs}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    rows, series = [], []
    for r in result["runs"]:
        pr = [x for x in r["per_round"] if not x.get("settle")]
        settled = [pr[-1]["theta_spread"]] + [x["theta_spread"] for x in r["per_round"] if x.get("settle")]
        half = pr[len(pr) // 2:]
        spreads = [x["theta_spread_participants"] for x in pr]
        rows.append([r["n_peers"], r["cap"], pr[0]["grid_dims"],
                     f"{100 * mean(x['expected'] / x['online'] for x in pr):.0f}%",
                     f"{mean(x['groups'] for x in pr):.1f}", f"{max(x['lineages'] for x in half)}",
                     f"{mean(x['theta_spread_participants'] for x in half):.3f}",
                     f"{mean(x['theta_spread'] for x in half):.3f}", human_bytes(mean(x["avg_bytes_per_peer"] for x in pr)),
                     human_bytes(mean(x["sync_bytes_per_peer"] for x in pr)), f"{r['leaves']}/{r['joins']}",
                     f"{pr[-1]['time_s'] / 3600:.1f} h"])
        series.append(f"- {r['n_peers']} peers, cap {r['cap']}: θ spread of the round's peers, by round: "
                      + ", ".join(f"{s:.2f}" for s in spreads[:12]) + (" …" if len(spreads) > 12 else "")
                      + "; of all online peers when training stops, then after each round without new Δ: "
                      + " → ".join(f"{s:.3f}" for s in settled))
    return (f"Quorum {result['quorum']:.0%} + {result['grace_s']:.0f} s grace; inner phase {result['inner_s']:.0f} s at "
            f"median speed, speeds lognormal (σ {result['speed_sigma']}); {result['params'] / 1e6:.0f}M parameters for "
            "the byte counts.\n\n"
            + md_table(["peers", "cap", "grid dims", "peers per round", "groups per round", "lineages (max)",
                        "θ spread (round's peers)", "θ spread (all online)", "all-reduce bytes/peer/step",
                        "state-sync bytes/peer/step", "left/joined", "simulated time"], rows)
            + "\n" + "\n".join(series) + "\n")


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="simscale"))
