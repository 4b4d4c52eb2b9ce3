"""``scale``: 8 tiny-model peers on 127.0.0.1, whole-swarm rounds vs groups of 4 vs groups of 2 (issue 13).

Three runs of real ``diloco-node join`` processes (:mod:`bench.nodes`), one after another in one
invocation, the same flags but ``--target-group-size``:

- ``default``: no ``--target-group-size`` (0: the whole swarm in one group, a group must hold a
  majority of the online peers);
- ``group-4``: ``--target-group-size 4``;
- ``group-2``: ``--target-group-size 2``.

Reported per configuration, from the nodes' metrics records (docs/metrics.md):

- *rounds*: the distinct rounds (``nodes.round_key``: hivemind's group id) with ≥ 2 members in any peer's ``outer_step``
  records, how many of them were verified (``round_ok``), and a histogram of their group sizes;
  *solo rounds*: peer records with ``group_size`` 1;
- *lineages at each outer step*: the distinct θ_global digests held at the end of that step by the
  peers that reached it (:func:`bench.nodes.theta_by_step`: a round's ``theta_digest``, or the digest
  of a state adopted in that round), counted by ``dht.lineages.lineage_summary``; and the longest
  run of consecutive outer steps with more than one lineage (groups smaller than the swarm leave one
  lineage per group at every step by design: this run says nothing about their mixing);
- *split windows*: the windows of 3 consecutive outer steps whose verified rounds' groups do not
  connect every peer (union of the groups, connected components over the peers' ids). This is how
  "no lineage persists for more than 3 outer steps" is judged: a set of peers that averages only
  among itself for 3 rounds is a split;
- *state-sync bytes*: Σ ``bytes`` of the ``state_sync`` records by ``reason``; those of ``diverged``
  and ``lagging`` downloads (joins excluded) against the *averaging bytes*, Σ ``bytes_received`` of
  every peer's ``outer_step`` records (both are bytes a peer downloaded);
- *final held-out loss* of each peer (``eval_loss`` of its last record, taken at its last outer
  step, the one it downloaded when its last round ended in a state sync: the node always evaluates there), their spread max/min − 1, and the mean over the peers
  ÷ the default configuration's mean. The last round of a planned run is one group in every
  configuration (node/runner.py), so the spread one outer step earlier is reported beside it: what
  the groups' mixing alone left;
- *mean ÷ default at equal tokens*: runs of equal outer steps need not train equal tokens (DyLU and
  overlapped phases size each phase by how long rounds take), so a grid run's mean final loss is also
  divided by the default run's mean loss at the grid run's tokens (:func:`loss_at_tokens` on the
  default's curve of per-step means; not measured when the grid run trained more tokens). It leans
  toward the grid runs: their last, whole-swarm round merges the groups' θ_global and lowers the
  loss more in one step than a step of the default run does.

Targets (issue 13): default: one lineage at every outer step and no ``diverged`` download (a calm
run); group sizes 4 and 2: no split window (above), state-sync bytes
(joins excluded) ≤ 10% of averaging bytes, final held-out losses within 1% of each other and their
mean within 2% of the default's.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_OUT, human_bytes, human_count, loadavg, md_table
from bench.nodes import NodeSpec, keep_logs, round_key, run_nodes, theta_by_step
from diloco_swarm.dht.lineages import lineage_summary

# label -> --target-group-size (0: the node's default, the whole swarm)
CONFIGS = {"default": 0, "group-4": 4, "group-2": 2}
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
RUNS_DIR = DEFAULT_OUT / "scale-runs"  # the nodes' metrics and logs of the last run, to look into
SPLIT_STEPS_MAX = 3  # target: the groups of every this many consecutive outer steps connect all peers
SYNC_SHARE_MAX = 0.10  # target: diverged + lagging state-sync bytes ≤ 10% of averaging bytes
SPREAD_MAX = 0.01  # target: final held-out losses within 1% of each other
VS_DEFAULT_MAX = 0.02  # target: mean final held-out loss within 2% of the default configuration's


def node_args(cfg: dict[str, Any], group_size: int) -> list[str]:
    """The flags of one node (run id, host, port, state and metrics apart)."""
    return ["--model", cfg["model"], "--inner-steps", str(cfg["H"]), "--seq-len", str(cfg["seq_len"]),
            "--batch-size", str(cfg["batch"]), "--compression", "int8", "--matchmaking-time", str(MATCHMAKING_S),
            "--averaging-window", str(AVERAGING_WINDOW_S), "--max-dataset-bytes", str(cfg["max_bytes"]),
            "--max-outer-steps", str(cfg["outer_steps"]), "--wait-for-peers", str(cfg["peers"]),
            "--eval-budget", "1",  # every outer step: the spread a round before the end is reported too
            "--device", "cpu", "--threads", "1",
            *(["--target-group-size", str(group_size)] if group_size else [])]


def longest_split(lineages: list[list[int]]) -> int:
    """The longest run of consecutive outer steps with 2+ lineages, from ``[[step, peers, lineages], ...]``."""
    longest = run = 0
    prev = None
    for step, _, count in lineages:
        if (count or 0) < 2:  # None: unknown
            run = 0
        else:
            run = run + 1 if prev is not None and step == prev + 1 else 1
        longest, prev = max(longest, run), step
    return longest


def split_windows(rounds: list[tuple[int, tuple[str, ...]]], peers: list[str],
                  width: int = SPLIT_STEPS_MAX) -> list[list[int]]:
    """``[[first step, components], ...]`` for each window of ``width`` consecutive outer steps that holds a
    round, where the union of the groups of its verified ``rounds`` ``[(outer step, members)]`` leaves
    ``components`` > 1 sets of ``peers`` that never averaged together."""
    steps = sorted({s for s, _ in rounds})
    out = []
    for first in range(steps[0], steps[-1] - width + 2) if steps else ():
        parent = {p: p for p in peers}

        def root(p: str) -> str:
            while parent[p] != p:
                p = parent[p]
            return p

        for s, members in rounds:
            if first <= s < first + width:
                known = [m for m in members if m in parent]
                for m in known[1:]:
                    parent[root(m)] = root(known[0])
        components = len({root(p) for p in peers})
        if components > 1:
            out.append([first, components])
    return out


def analyse(records_by_peer: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of one configuration (module docstring) from each peer's metrics records."""
    steps = [[e for e in recs if e.get("event") == "outer_step"] for recs in records_by_peer]
    syncs = [e for recs in records_by_peer for e in recs if e.get("event") == "state_sync"]
    rounds: dict[tuple[int, tuple[str, ...]], dict[str, Any]] = {}
    for x in steps:
        for e in x:
            if (e.get("group_size") or 0) >= 2:
                r = rounds.setdefault(round_key(e), {"size": e["group_size"], "ok": True, "step": 0,
                                                     "group": tuple(sorted(e.get("group") or []))})
                r["ok"] = r["ok"] and bool(e.get("round_ok"))
                r["step"] = max(r["step"], e["outer_step"])
    peer_ids = [next((e["peer_id"] for e in recs if e.get("event") == "start" and e.get("peer_id")), f"#{i}")
                for i, recs in enumerate(records_by_peer)]
    held = [theta_by_step(recs) for recs in records_by_peer]
    last = max((s for h in held for s in h), default=0)
    lineages = []
    for s in range(1, last + 1):
        at_s = {i: [(s, h[s])] for i, h in enumerate(held) if s in h}
        if at_s:
            lineages.append([s, len(at_s), lineage_summary(at_s)["lineages"]])
    sync_bytes = {reason: sum(e.get("bytes") or 0 for e in syncs if e.get("reason") == reason)
                  for reason in ("join", "diverged", "lagging")}
    sync_count = {reason: sum(1 for e in syncs if e.get("reason") == reason) for reason in sync_bytes}
    resync = sync_bytes["diverged"] + sync_bytes["lagging"]
    received = sum(e.get("bytes_received") or 0 for x in steps for e in x)
    finals = []
    for x, recs in zip(steps, records_by_peer):
        end = x[-1] if x else {}
        held = end.get("synced_to") or end.get("outer_step")  # a round that ended in a download: the state's step
        ok = end.get("eval_outer_step") == held and end.get("eval_loss") is not None
        loss = end.get("eval_loss") if ok else None
        after = recs[recs.index(end) + 1:] if end else []  # a state adopted at the end is evaluated after it
        loss = next((e.get("eval_loss") for e in reversed(after) if e.get("event") == "eval"), loss)
        finals.append(loss)
    losses = [v for v in finals if v is not None]
    # the same a round earlier: a grid run's last round is one group (node/runner.py), so this is the
    # spread its groups' mixing left
    end_step = max((e["outer_step"] for x in steps for e in x), default=0)
    before = [next((e["eval_loss"] for e in x if e["outer_step"] == end_step - 1 and e.get("eval_loss") is not None
                    and e.get("eval_outer_step") == end_step - 1), None) for x in steps]
    before = [v for v in before if v is not None]
    # mean held-out loss against the swarm's tokens at each outer step that every peer evaluated
    # (runs of equal outer steps need not train equal tokens), for the comparison at equal tokens
    curve = []
    for s in range(1, end_step):
        at = [next((e for e in x if e["outer_step"] == s), None) for x in steps]
        if all(e is not None and e.get("eval_outer_step") == s and e.get("eval_loss") is not None for e in at):
            curve.append([s, sum(e.get("tokens_total") or 0 for e in at), sum(e["eval_loss"] for e in at) / len(at)])
    tokens_total = sum((x[-1].get("tokens_total") or 0) if x else 0 for x in steps)
    if len(losses) == len(finals) and losses:
        curve.append([end_step, tokens_total, sum(losses) / len(losses)])
    return {
        "rounds": len(rounds),
        "rounds_ok": sum(1 for r in rounds.values() if r["ok"]),
        "group_size_hist": {str(k): v for k, v in sorted(Counter(r["size"] for r in rounds.values()).items())},
        "solo_rounds": sum(1 for x in steps for e in x if (e.get("group_size") or 0) < 2),
        "lineages": lineages,
        "longest_split": longest_split(lineages),
        "split_windows": split_windows([(r["step"], r["group"]) for r in rounds.values() if r["ok"]], peer_ids),
        "sync_bytes": sync_bytes,
        "sync_count": sync_count,
        "resync_bytes": resync,
        "averaging_bytes_received": received,
        "averaging_bytes_sent": sum(e.get("bytes_sent") or 0 for x in steps for e in x),
        "resync_share": resync / received if received else None,
        "final_eval_loss": finals,
        "loss_spread": max(losses) / min(losses) - 1 if losses else None,
        "loss_spread_before_last": max(before) / min(before) - 1 if len(before) >= 2 else None,
        "mean_final_loss": sum(losses) / len(losses) if losses else None,
        "tokens_total": tokens_total,
        "loss_curve": curve,
        "peers": [{"outer_steps": len(x), "group_sizes": [e.get("group_size") for e in x],
                   "inner_steps": [e.get("inner_steps") for e in x],
                   "rounds_ok": sum(1 for e in x if e.get("round_ok")),
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
    """One configuration: ``cfg['peers']`` nodes of one run id to ``cfg['outer_steps']``; a run that does
    not finish is reported with its error (the other configurations still run)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{label}-"))
    load = loadavg()
    print(f"[scale] {label}: load average at start {load}", file=sys.stderr, flush=True)
    t0 = time.time()
    out: dict[str, Any] = {"label": label, "target_group_size": CONFIGS[label], "loadavg_start": load}
    try:
        specs = [NodeSpec(f"peer-{i}", f"bench-scale-{tag}-{label}", node_args(cfg, CONFIGS[label]))
                 for i in range(cfg["peers"])]
        runs = run_nodes(specs, workdir, cfg["timeout"], log_tag=f"[scale {label}] ")
        out.update(analyse([r.records() for r in runs]))
        for peer, r in zip(out["peers"], runs):
            peer.update(exit_code=r.exit_code,
                        log_tail="" if r.exit_code == 0 else r.log.read_text(errors="replace")[-2000:])
    except RuntimeError as e:
        out["error"] = str(e)[-2000:]
        print(f"[scale] {label} failed: {out['error']}", file=sys.stderr, flush=True)
    finally:
        if cfg.get("keep_logs"):
            keep_logs(workdir, RUNS_DIR / label)
        shutil.rmtree(workdir, ignore_errors=True)
    out["elapsed_s"] = round(time.time() - t0, 1)
    return out


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    tag = str(int(time.time()))
    configs = {label: run_config(cfg, label, tag) for label in CONFIGS}
    base = configs["default"].get("mean_final_loss")
    for c in configs.values():
        mean = c.get("mean_final_loss")
        c["loss_vs_default"] = mean / base if mean is not None and base else None
        # the default run (one model at every step) read at this run's tokens: a grid run's own steps before
        # its last, whole-swarm round are its groups' separate θ_global, not one model
        at = loss_at_tokens(configs["default"].get("loss_curve") or [], c.get("tokens_total") or 0)
        c["loss_vs_default_equal_tokens"] = mean / at if mean is not None and at else None
    from diloco_swarm.models import build_model, num_parameters

    result = {"config": cfg, "matchmaking_time": MATCHMAKING_S, "averaging_window": AVERAGING_WINDOW_S,
              "params": num_parameters(build_model(cfg["model"], seed=0)), "configs": configs}
    result["verdicts"] = verdicts(result)
    for line in summary_lines(result):
        print(f"[scale] {line}", file=sys.stderr, flush=True)
    return result


def _f(x, spec=".2f"):
    return f"{x:{spec}}" if x is not None else "–"


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target of the issue: configuration, target, the measured figure, met (bool; None when
    this run could not measure it)."""
    out = []

    def add(label: str, target: str, figure: str, met: bool | None) -> None:  # None: not measured
        out.append({"config": label, "target": target, "figure": figure, "met": met})

    for label, c in result["configs"].items():
        if "error" in c:
            add(label, "the run finished", c["error"].splitlines()[-1][:160] if c["error"] else "error", False)
            continue
        counts = [n for _, _, n in c["lineages"]]
        if label == "default":
            add(label, "one lineage at every outer step", f"lineages per step {counts}",
                bool(counts) and all(n == 1 for n in counts))
            add(label, 'no "diverged" download', f"{c['sync_count']['diverged']} diverged download(s)",
                c["sync_count"]["diverged"] == 0)
            continue
        windows = c.get("split_windows", [])
        add(label, f"no lineage persists for more than {SPLIT_STEPS_MAX} outer steps (the groups of any "
            f"{SPLIT_STEPS_MAX} consecutive rounds connect all peers)",
            f"{len(windows)} split window(s)" + (f", first at outer step {windows[0][0]}: {windows[0][1]} sets of "
                                                  "peers that never averaged together" if windows else ""),
            bool(counts) and c["rounds_ok"] > 0 and not windows)
        share = c["resync_share"]
        add(label, f"state-sync bytes (joins excluded) ≤ {SYNC_SHARE_MAX:.0%} of averaging bytes",
            f"{human_bytes(c['resync_bytes'])} / {human_bytes(c['averaging_bytes_received'])} = {_f(share, '.1%')}",
            share is not None and share <= SYNC_SHARE_MAX)
        add(label, f"final held-out losses within {SPREAD_MAX:.0%} of each other",
            f"spread {_f(c['loss_spread'], '.2%')}; {_f(c.get('loss_spread_before_last'), '.2%')} a round before the "
            "end (the last round is one group)", c["loss_spread"] is not None and c["loss_spread"] <= SPREAD_MAX)
        vs = c.get("loss_vs_default")
        add(label, f"mean final held-out loss within {VS_DEFAULT_MAX:.0%} of the default's (at the same outer step)",
            f"{_f(vs, '.4f')}× the default's, with {human_count(c['tokens_total'])} tokens against "
            f"{human_count(result['configs']['default'].get('tokens_total') or 0)}",
            vs is not None and abs(vs - 1) <= VS_DEFAULT_MAX)
        eq = c.get("loss_vs_default_equal_tokens")
        beyond = (c.get("tokens_total") or 0) > (result["configs"]["default"].get("tokens_total") or 0)
        add(label, f"mean final held-out loss within {VS_DEFAULT_MAX:.0%} of the default's at equal tokens (the "
            "default's curve at this run's tokens)", f"{_f(eq, '.4f')}× the default's" if eq is not None else
            "not measured: this run trained more tokens than the default's whole run (the same-step ratio favours "
            "it)" if beyond else "not measured", None if eq is None else abs(eq - 1) <= VS_DEFAULT_MAX)
    return out


def _rows(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for label, c in result["configs"].items():
        if "error" in c:
            rows.append([label, c["target_group_size"] or "whole swarm", "did not finish", *["–"] * 12])
            continue
        hist = " ".join(f"{k}×{v}" for k, v in c["group_size_hist"].items()) or "–"
        sync = " + ".join(f"{human_bytes(c['sync_bytes'][k])} ({c['sync_count'][k]})" for k in ("diverged", "lagging"))
        rows.append([label, c["target_group_size"] or "whole swarm", f"{c['rounds_ok']}/{c['rounds']}",
                     hist, c["solo_rounds"], " ".join(str(n) for _, _, n in c["lineages"]), c["longest_split"],
                     len(c.get("split_windows", [])),
                     f"{sync} vs {human_bytes(c['averaging_bytes_received'])}: {_f(c['resync_share'], '.1%')}",
                     human_count(c["tokens_total"]),
                     " ".join(_f(v, ".4f") for v in c["final_eval_loss"]), _f(c["loss_spread"], ".2%"),
                     _f(c.get("loss_spread_before_last"), ".2%"),
                     *(f"{_f(c.get(k), '.4f')}×" if c.get(k) is not None else "–"
                       for k in ("loss_vs_default", "loss_vs_default_equal_tokens"))])
    return rows


HEADERS = ["config", "group size", "rounds verified/all", "group sizes (size×rounds)", "solo rounds",
           "lineages per outer step", "longest run of 2+ lineages (steps)", "split windows",
           "state-sync bytes diverged + lagging (downloads) vs averaging bytes", "tokens trained (all peers)",
           "final held-out loss per peer",
           "spread", "spread a round before the end", "mean ÷ default", "mean ÷ default at equal tokens"]


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "**missed**"


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = md_table(HEADERS, _rows(result)).splitlines()
    lines += [f"{v['config']}: {v['target']}: {_verdict(v['met']).strip('*').upper()} ({v['figure']})"
              for v in verdicts(result)]
    return lines


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg = result["config"]
    md = [
        f"{cfg['peers']} `diloco-node join` processes on 127.0.0.1, three runs one after another in one invocation, "
        f"the same flags but the group size: **default** (no `--target-group-size`: whole-swarm rounds, a group must "
        f"hold a majority of the online peers), **group-4** (`--target-group-size 4`), **group-2** "
        f"(`--target-group-size 2`). Model `{cfg['model']}` ({result['params']:,} parameters), H = {cfg['H']}, "
        f"seq_len {cfg['seq_len']}, batch {cfg['batch']}, int8, overlapped rounds, {cfg['outer_steps']} outer steps, "
        f"matchmaking {result['matchmaking_time']} s, `--wait-for-peers {cfg['peers']} --threads 1 --eval-budget 1` "
        f"(the held-out loss is taken at every outer step).\n",
        "*Rounds*: distinct rounds (by hivemind's group id) with ≥ 2 members in any peer's records; verified = every "
        "member's record says `round_ok`. *Lineages per outer step*: distinct θ_global digests held at the end of "
        "each outer step by the peers that reached it (a round's `theta_digest`, or the digest of a state adopted "
        "in that round), counted by `dht/lineages.py`. *Longest run*: of consecutive outer steps with 2+ "
        "lineages (groups smaller than the swarm hold one lineage each at every step, so it measures a split only "
        "for whole-swarm rounds). *Split windows*: windows of 3 consecutive outer steps whose verified rounds' "
        "groups leave 2+ sets of peers that never averaged together; none means no lineage persisted for more "
        "than 3 outer steps. *State-sync bytes*: Σ `bytes` of the `diverged` and `lagging` `state_sync` records "
        "(joins excluded; the number of downloads in parentheses) against Σ `bytes_received` of every peer's "
        "rounds. *Tokens trained*: Σ `tokens_total` of the peers at their last step (DyLU sizes each inner phase "
        "between H/4 and 2H by the peers' speeds, and an overlapped phase runs on while its round is in flight, so runs of equal outer steps need not train equal tokens: read "
        "*mean ÷ default* with it). *Spread*: max/min − 1 of the peers' final held-out losses; *mean ÷ default*: "
        "their mean over the default run's; *at equal tokens*: over the default run's mean held-out loss at this "
        "run's tokens trained (the default's means at each outer step against its swarm tokens, linear in "
        "log(tokens) between the two outer steps around it; not measured when this run trained more tokens).\n",
        md_table(HEADERS, _rows(result)),
        "\nTargets (issue 13):\n",
        md_table(["config", "target", "measured", "verdict"],
                 [[v["config"], v["target"], v["figure"], _verdict(v["met"])]
                  for v in verdicts(result)]),
    ]
    for note in result.get("notes", []):  # a reading of the run, added to its JSON afterwards
        md.append(f"\n*Note:* {note}\n")
    problems = [f"- {label}, peer {i} exited {p['exit_code']}: "
                f"`{((p.get('log_tail') or '').strip().splitlines()[-1:] or ['(no output)'])[0][:160]}`"
                for label, c in result["configs"].items() for i, p in enumerate(c.get("peers", []))
                if p.get("exit_code") != 0]
    if problems:
        md.append("\nWhat went wrong in this run:\n\n" + "\n".join(problems) + "\n")
    return "\n".join(md)
