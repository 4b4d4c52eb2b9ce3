"""``scale``: 8 tiny-model peers on 127.0.0.1, whole-swarm rounds vs groups of 4 vs groups of 2 (issue 13).

Three runs of real nodes (:mod:`bench.nodes`), the same flags but ``--target-group-size`` (:data:`CONFIGS`).
From the nodes' records (:func:`analyse`): the distinct rounds and their group sizes; the θ_global lineages at
each outer step (``dht.lineages.lineage_summary`` of ``theta_by_step``); the *split windows* (3 consecutive outer
steps whose verified rounds leave 2+ sets of peers that never averaged together); state-sync bytes against
averaging bytes; the final held-out losses, their spread, and their mean over the default run's, also at equal
tokens (:func:`loss_at_tokens` on the default's curve).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import exits_md, f, human_bytes, human_count, loadavg, md_table, mean, notes_md, ratio
from bench.nodes import NodeSpec, run_nodes, scratch
from diloco_swarm.dht.lineages import lineage_summary
from tests.swarmlib import round_key, theta_by_step

CONFIGS = {"default": 0, "group-4": 4, "group-2": 2}  # label -> --target-group-size (0: the whole swarm)
SIZES = {
    "smoke": {"model": "tiny", "peers": 4, "H": 4, "seq_len": 32, "batch": 2, "outer_steps": 3,
              "max_bytes": 200_000, "timeout": 300},
    "quick": {"model": "tiny", "peers": 6, "H": 10, "seq_len": 64, "batch": 4, "outer_steps": 5,
              "max_bytes": 300_000, "timeout": 420, "keep_logs": True},
    "full": {"model": "tiny", "peers": 8, "H": 20, "seq_len": 64, "batch": 4, "outer_steps": 10,
             "max_bytes": 1_000_000, "timeout": 900, "keep_logs": True},
}
MATCHMAKING_S = 2.0
AVERAGING_WINDOW_S = 30.0
SPLIT_STEPS = 3  # a split window: this many consecutive outer steps whose groups do not connect all peers


def node_args(cfg: dict[str, Any], group_size: int) -> list[str]:
    """The flags of one node (run id, host, port, state and metrics apart)."""
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8", "--matchmaking-time", str(MATCHMAKING_S),
            "--averaging-window", str(AVERAGING_WINDOW_S), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--max-outer-steps", str(cfg["outer_steps"]), "--wait-for-peers", str(cfg["peers"]),
            "--eval-budget", "1",  # every outer step: the spread a round before the end is reported too
            "--device", "cpu", "--threads", "1", *(["--target-group-size", str(group_size)] if group_size else [])]


def longest_split(lineages: list[list[int]]) -> int:
    """The longest run of consecutive outer steps with 2+ lineages, from ``[[step, peers, lineages], ...]``."""
    longest = run = 0
    prev = None
    for step, _, count in lineages:
        run = 0 if (count or 0) < 2 else run + 1 if prev is not None and step == prev + 1 else 1
        longest, prev = max(longest, run), step
    return longest


def split_windows(rounds: list[tuple[int, tuple[str, ...]]], peers: list[str], width: int = SPLIT_STEPS) -> list[list[int]]:
    """``[[first step, components], ...]`` for each window of ``width`` consecutive outer steps where the union of
    the groups of the verified ``rounds`` ``[(outer step, members)]`` leaves ``components`` > 1 sets of ``peers``."""
    steps = sorted({s for s, _ in rounds})
    out = []
    for first in range(steps[0], steps[-1] - width + 2) if steps else ():
        parent = {p: p for p in peers}

        def root(p: str) -> str:
            while parent[p] != p:
                p = parent[p]
            return p

        for s, members in rounds:
            known = [m for m in members if m in parent]
            for m in known[1:] if first <= s < first + width else ():
                parent[root(m)] = root(known[0])
        components = len({root(p) for p in peers})
        if components > 1:
            out.append([first, components])
    return out


def analyse(records_by_peer: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of one configuration (module docstring) from each peer's metrics records."""
    steps = [[e for e in recs if e.get("event") == "outer_step"] for recs in records_by_peer]
    syncs = [e for recs in records_by_peer for e in recs if e.get("event") == "state_sync"]
    rounds: dict[Any, dict[str, Any]] = {}
    for e in (e for x in steps for e in x if (e.get("group_size") or 0) >= 2):
        r = rounds.setdefault(round_key(e), {"size": e["group_size"], "ok": True, "step": 0,
                                             "group": tuple(sorted(e.get("group") or []))})
        r["ok"], r["step"] = r["ok"] and bool(e.get("round_ok")), max(r["step"], e["outer_step"])
    peer_ids = [next((e["peer_id"] for e in recs if e.get("event") == "start" and e.get("peer_id")), f"#{i}")
                for i, recs in enumerate(records_by_peer)]
    held = [theta_by_step(recs) for recs in records_by_peer]
    lineages = [[s, len(at), lineage_summary(at)["lineages"]]
                for s in range(1, max((s for h in held for s in h), default=0) + 1)
                if (at := {i: [(s, h[s])] for i, h in enumerate(held) if s in h})]
    sync_bytes = {why: sum(e.get("bytes") or 0 for e in syncs if e.get("reason") == why)
                  for why in ("join", "diverged", "lagging")}
    resync = sync_bytes["diverged"] + sync_bytes["lagging"]
    received = sum(e.get("bytes_received") or 0 for x in steps for e in x)
    finals = []
    for x, recs in zip(steps, records_by_peer):
        end = x[-1] if x else {}
        at = end.get("synced_to") or end.get("outer_step")  # a round that ended in a download: the state's step
        loss = end.get("eval_loss") if end.get("eval_outer_step") == at else None
        after = recs[recs.index(end) + 1:] if end else []  # a state adopted at the end is evaluated after it
        finals.append(next((e.get("eval_loss") for e in reversed(after) if e.get("event") == "eval"), loss))
    losses = [v for v in finals if v is not None]
    # the spread a round earlier: a grid run's last round is one group (node/runner.py), so this is what its
    # groups' mixing left
    end_step = max((e["outer_step"] for x in steps for e in x), default=0)
    before = [v for x in steps if (v := next((e["eval_loss"] for e in x if e["outer_step"] == e.get("eval_outer_step")
                                              == end_step - 1 and e.get("eval_loss") is not None), None))]
    # mean held-out loss against the swarm's tokens at each outer step every peer evaluated, for equal tokens
    curve = []
    for s in range(1, end_step):
        at_s = [next((e for e in x if e["outer_step"] == s), None) for x in steps]
        if all(e is not None and e.get("eval_outer_step") == s and e.get("eval_loss") is not None for e in at_s):
            curve.append([s, sum(e.get("tokens_total") or 0 for e in at_s), mean(e["eval_loss"] for e in at_s)])
    tokens_total = sum((x[-1].get("tokens_total") or 0) if x else 0 for x in steps)
    if losses and len(losses) == len(finals):
        curve.append([end_step, tokens_total, mean(losses)])
    return {
        "rounds": len(rounds), "rounds_ok": sum(1 for r in rounds.values() if r["ok"]),
        "group_size_hist": {str(k): v for k, v in sorted(Counter(r["size"] for r in rounds.values()).items())},
        "solo_rounds": sum(1 for x in steps for e in x if (e.get("group_size") or 0) < 2),
        "lineages": lineages, "longest_split": longest_split(lineages),
        "split_windows": split_windows([(r["step"], r["group"]) for r in rounds.values() if r["ok"]], peer_ids),
        "sync_bytes": sync_bytes,
        "sync_count": {why: sum(1 for e in syncs if e.get("reason") == why) for why in sync_bytes},
        "resync_bytes": resync, "averaging_bytes_received": received, "resync_share": ratio(resync, received),
        "averaging_bytes_sent": sum(e.get("bytes_sent") or 0 for x in steps for e in x),
        "final_eval_loss": finals, "loss_spread": max(losses) / min(losses) - 1 if losses else None,
        "loss_spread_before_last": max(before) / min(before) - 1 if len(before) >= 2 else None,
        "mean_final_loss": mean(losses), "tokens_total": tokens_total, "loss_curve": curve,
        "peers": [{"outer_steps": len(x), "group_sizes": [e.get("group_size") for e in x],
                   "inner_steps": [e.get("inner_steps") for e in x], "rounds_ok": sum(1 for e in x if e.get("round_ok")),
                   "state_syncs": [[e.get("reason"), e.get("from_outer_step"), e.get("outer_step"), e.get("bytes")]
                                   for e in recs if e.get("event") == "state_sync"]}
                  for x, recs in zip(steps, records_by_peer)],
    }


def loss_at_tokens(curve: list[list[float]], tokens: float) -> float | None:
    """The mean held-out loss of a ``curve`` ``[[outer step, swarm tokens, mean loss], ...]`` at ``tokens``,
    linear in log(tokens) between its two outer steps around it; None outside the curve."""
    exact = [loss for _, t, loss in curve if t == tokens]
    if exact:
        return exact[-1]
    for (_, t0, l0), (_, t1, l1) in zip(curve, curve[1:]):
        if 0 < t0 < tokens < t1:
            return l0 + (l1 - l0) * (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return None


def run_config(cfg: dict[str, Any], label: str, tag: str) -> dict[str, Any]:
    """One configuration; a run that does not finish is reported with its error (the others still run)."""
    t0 = time.time()
    out: dict[str, Any] = {"label": label, "target_group_size": CONFIGS[label], "loadavg_start": loadavg()}
    try:
        with scratch("scale", label, cfg.get("keep_logs")) as workdir:
            runs = run_nodes([NodeSpec(f"peer-{i}", f"bench-scale-{tag}-{label}", node_args(cfg, CONFIGS[label]))
                              for i in range(cfg["peers"])], workdir, cfg["timeout"])
            out.update(analyse([r.records() for r in runs]))
            for peer, r in zip(out["peers"], runs):
                peer.update(exit_code=r.exit_code, log_tail=r.log_tail())
    except AssertionError as e:
        out["error"] = str(e)[-2000:]
        print(f"[scale] {label} failed: {out['error']}", file=sys.stderr, flush=True)
    out["elapsed_s"] = round(time.time() - t0, 1)
    return out


def run(size: str) -> dict[str, Any]:
    from diloco_swarm.models import build_model, num_parameters

    cfg, tag = SIZES[size], str(int(time.time()))
    configs = {label: run_config(cfg, label, tag) for label in CONFIGS}
    base = configs["default"]
    for c in configs.values():
        c["loss_vs_default"] = ratio(c.get("mean_final_loss"), base.get("mean_final_loss"))
        # the default run read at this run's tokens: a grid run's own steps before its last, whole-swarm round are
        # its groups' separate θ_global, not one model
        c["loss_vs_default_equal_tokens"] = ratio(c.get("mean_final_loss"), loss_at_tokens(
            base.get("loss_curve") or [], c.get("tokens_total") or 0))
    return {"config": cfg, "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
            "params": num_parameters(build_model(cfg["model"], seed=0)), "configs": configs}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, rows = result["config"], []
    for label, c in result["configs"].items():
        if "error" in c:
            rows.append([label, c["target_group_size"] or "whole swarm", "did not finish", *["–"] * 12])
            continue
        sync = " + ".join(f"{human_bytes(c['sync_bytes'][k])} ({c['sync_count'][k]})" for k in ("diverged", "lagging"))
        rows.append([label, c["target_group_size"] or "whole swarm", f"{c['rounds_ok']}/{c['rounds']}",
                     " ".join(f"{k}×{v}" for k, v in c["group_size_hist"].items()) or "–", c["solo_rounds"],
                     " ".join(str(n) for _, _, n in c["lineages"]), c["longest_split"], len(c["split_windows"]),
                     f"{sync} vs {human_bytes(c['averaging_bytes_received'])}: {f(c['resync_share'], '.1%')}",
                     human_count(c["tokens_total"]), " ".join(f(v, ".4f") for v in c["final_eval_loss"]),
                     f(c["loss_spread"], ".2%"), f(c.get("loss_spread_before_last"), ".2%"),
                     *(f(c.get(k), ".4f", "×") for k in ("loss_vs_default", "loss_vs_default_equal_tokens"))])
    return "\n".join([
        f"{cfg['peers']} nodes, model `{cfg['model']}` ({result['params']:,} parameters), H = {cfg['H']}, seq_len "
        f"{cfg['seq_len']}, batch {cfg['batch']}, int8, {cfg['outer_steps']} outer steps.\n",
        md_table(["config", "group size", "rounds verified/all", "group sizes (size×rounds)", "solo rounds",
                  "lineages per outer step", "longest run of 2+ lineages (steps)", "split windows",
                  "state-sync bytes diverged + lagging (downloads) vs averaging bytes", "tokens trained (all peers)",
                  "final held-out loss per peer", "spread", "spread a round before the end", "mean ÷ default",
                  "mean ÷ default at equal tokens"], rows),
        notes_md(result), exits_md((f"{label}, peer {i}", p) for label, c in result["configs"].items()
                                   for i, p in enumerate(c.get("peers", [])))])
