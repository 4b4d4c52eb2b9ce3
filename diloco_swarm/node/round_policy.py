"""Whom a round averages with, and what the outer step does with its outcome, as pure functions of
the peers' records, the hand-off, the clock and the config; node/round.py (the averaging thread)
and node/runner.py (the training thread) carry the decisions out. No I/O, no threads. (Which state
to catch up with or adopt is node/canonical.py's; whether a group mixes, averaging/mixing.py's.)

Before matchmaking (:func:`before_plan`, :func:`plan`, :func:`after_plan`; a client that sees no
public peer is solo before these, ``Round._public_peer_online``):

    overlap mode, nobody else online (or all others gone)   -> Solo    (our own Δ is the outer step)
    the others finished the run without us                  -> Skip    (the round then catches up)
    planned: the other members of our grid group are gone   -> Skip    (late: Δ goes into the next round)
    otherwise                                               -> Join    (average with the plan's group)

After the round (:func:`settle`), on the training thread:

    the members mixed different θ_global                    -> AdoptMixed
    a canonical state was downloaded                        -> AdoptState   (carry Δ if the state lacks it)
    a verified average, our own Δ alone, or late too long   -> Apply
    late: others online, no verified group for us           -> Hold         (Δ carried into the next round)

Progress alignment follows Decoupled DiLoCo's quorum plus grace window (arXiv 2604.21428), the grid
Moshpit SGD (arXiv 2103.03239, ``averaging/grouping.py``), the late round's carried Δ Decoupled
DiLoCo's late fragments, bounded at :data:`MAX_CARRIED_ROUNDS` (Async Local-SGD's bounded
staleness, arXiv 2401.09135).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from diloco_swarm.averaging.grouping import RoundPlan, plan_round, round_number
from diloco_swarm.averaging.mixing import standing
from diloco_swarm.node.feedback import Feedback

ALIGN_SLACK_S = 1.0  # a round waits this long past the last expected member's hand-off
MAX_CARRIED_ROUNDS = 2  # a peer late this many rounds in a row applies its carried Δ alone (bounded staleness)
SILENT_RECORDS = 2  # a peer whose record missed this many re-signing periods (as we read it) crashed


# ---------------------------------------------------------------- before the round: whom to average with
@dataclass(frozen=True)
class Solo:
    """Nobody to average with: the outer step takes our own Δ."""

    reason: str


@dataclass(frozen=True)
class Skip:
    """Others are online, but this round has no group for us: late (our Δ is carried), or the
    others finished the run (the round then catches up with their state)."""

    reason: str
    group_key: str = ""


@dataclass(frozen=True)
class Join:
    """Average with ``members`` (ourselves excluded) under ``plan``; all of them should have handed
    off by ``due`` (unix s)."""

    plan: RoundPlan
    due: float
    members: tuple[str, ...]
    group_key: str  # "" when the swarm averages as one group
    online: int  # peers online as the round sees them, ourselves included


@dataclass(frozen=True)
class Planned:
    """A round's plan and the time by which every expected member should have handed off (unix s)."""

    plan: RoundPlan
    due: float


def seconds_to_handoff(phase_eta: float, now: float, *, silent_s: float, max_silent_s: float,
                       first_round: bool = False) -> float:
    """A peer's ETA for ``grouping.plan_round`` from its record: seconds until it hands off its phase
    (``phase_eta``, unix s; ≤ 0: it has), or ``inf``, not coming this round:

    - it is starting up (``phase_eta`` 0: no inner phase yet), unless ``first_round`` (our own first
      round since we started): peers that start together (``--wait-for-peers``) then meet in one
      group, while a running swarm does not wait for a restarted peer's imports and state download;
    - its record has not changed for ``silent_s`` > ``max_silent_s`` seconds, as we saw it (our clock,
      not the peer's): a live peer re-signs it every few seconds (dht/records.py), so it crashed, and
      its record outlives it by the DHT's TTL."""
    if (phase_eta <= 0.0 and not first_round) or silent_s > max_silent_s:
        return math.inf
    return phase_eta - now if phase_eta > 0.0 else 0.0


def training(records: Mapping[str, Any]) -> dict[str, Any]:
    """The records of the peers that train now: a paused peer (its record's ``paused``, node/pause.py)
    stays known, but is in no round's plan, online count, quorum or median."""
    return {p: r for p, r in records.items() if getattr(r, "paused", None) is None}


def nobody_online(records: Mapping[str, Any], *, me: str, donors: bool) -> bool:
    """No other peer online: no record but ours, and no state donor announced. A round then ends
    alone (``RoundOutcome.alone``), and its own Δ is applied (:func:`settle`)."""
    return not donors and not set(records) - {me}


def before_plan(records: Mapping[str, Any], *, me: str, donors: bool, overlap: bool,
                max_outer_steps: int, paused: int = 0) -> Solo | Skip | None:
    """The round's first decision, from one read of the records (peer id -> record, ours included,
    the paused peers' left out: :func:`training`; ``paused``: how many those were) and whether any
    state donor is announced (``donors``): None to go on and plan.

    In blocking mode a peer with nobody online still looks for a group (a peer that starts at the
    same moment may come); in overlap mode it does not wait out the window."""
    others = [r for p, r in records.items() if p != me]
    if overlap and nobody_online(records, me=me, donors=donors):
        return Solo(f"no other peer training ({paused} paused)" if paused else "no other peer online")
    if 0 < max_outer_steps and others and all(r.outer_step >= max_outer_steps and r.phase_eta <= 0 for r in others):
        # they finished the run without us and wait to serve their state (StateSync.end_on_one_model)
        return Skip("the other peers finished the run (--max-outer-steps) without us")
    return None


def needs_swarm_wait(plan: RoundPlan, records: Mapping[str, Any], me: str) -> bool:
    """Whether the round's groups are smaller than the swarm (a grid, or a few peers planned as one
    group while more are online): no quorum of the swarm bounds them, so a peer ahead of the swarm
    waits for it first (node/round.py: ``Round._wait_for_swarm``)."""
    return len(plan.groups) > 1 or len(set(records) | {me}) > plan.max_group_size


def plan(step: int, inner_s: float, others: Mapping[str, Any], *, me: str, now: float,
         silent_s: Mapping[str, float], max_silent_s: float, first_round: bool, cfg: Any,
         gone: frozenset[str] | set[str] = frozenset(),
         shunned: frozenset[str] | set[str] = frozenset()) -> Planned:
    """This round's plan: whom it waits for and, when the swarm is larger than one group, our grid group.

    ``step``: our standing at the hand-off (``mixing.standing``: our outer step, unless our lineage
    restarted: rounds are planned by standing, so lineages that stand alike meet); ``inner_s``: our
    phase's seconds; ``others``: peer id -> record of the other peers; ``silent_s``: seconds each record has been unchanged as we read it;
    ``gone``: members a probe found dead (their records are still fresh): in a one-group round they
    leave the plan, and no round waits for them (:func:`after_plan` also leaves them out of the
    online count behind the majority quorum); ``shunned``: peers our averager bans or avoids
    (``NodeStats.avoided_peers``): they never join our group, so a one-group round neither plans with them nor
    waits for their ETA, which a hostile one could set to stall every round by the grace window (the
    averager leaves them out of the quorum itself). ``cfg``: the node's config
    (``averaging_window``, ``matchmaking_time``, ``group_size``, ``max_group_size``, ``max_outer_steps``).

    The grace window is half a phase of ours, within [--matchmaking-time, half the averaging window].
    The round number is the median outer step of the online peers (``grouping.round_number``): a peer
    one step behind meets the swarm's round and catches up in it. A peer already looking for a group
    in this round is due now, whatever its record's ``phase_eta`` (in overlap mode already its next
    phase's). The last round of a planned run (``--max-outer-steps``) has no grid below
    ``--max-group-size``: the peers that share that limit meet in one group and mix into one θ_global.
    """
    round_no = round_number(step, [(standing(r.outer_step, r.restarted_below), r.averaging_round)
                                   for r in others.values()])
    etas = {p: seconds_to_handoff(r.phase_eta, now, silent_s=silent_s.get(p, 0.0), max_silent_s=max_silent_s,
                                  first_round=first_round) for p, r in others.items()}
    etas.update((p, 0.0) for p, r in others.items() if r.averaging_round == round_no and etas[p] != math.inf)
    etas[me] = 0.0
    cap = cfg.max_group_size if 0 < cfg.max_outer_steps <= round_no + 1 else cfg.group_size
    grace = min(cfg.averaging_window / 2, max(cfg.matchmaking_time, inner_s / 2))
    result = plan_round(round_no, etas, max_group_size=cap, grace_s=grace)
    left_out = (set(gone) | set(shunned)) & set(others)
    if left_out and len(result.groups) == 1:  # (a grid stays as the others see it: they may not know or shun them)
        etas.update((p, math.inf) for p in left_out)
        result = plan_round(round_no, etas, max_group_size=cap, grace_s=grace)
    _, members = result.group_of(me)
    last = max((etas[p] for p in members if p not in gone), default=0.0)
    return Planned(result, now + last + ALIGN_SLACK_S)


def after_plan(planned: Planned, records: Mapping[str, Any], gone: set[str], *, me: str,
               overlap: bool) -> Solo | Skip | Join:
    """The round's decision once planned (``records``: the read it was planned from; ``gone``: its
    members found dead)."""
    result = planned.plan
    if overlap and gone and not (set(records) - gone - {me}):
        # the only other peers crashed moments ago (their records outlive them): nobody to wait for
        return Solo("no other peer online (the others are gone)")
    key, planned_members = result.group_of(me)
    grid = len(result.groups) > 1
    members = tuple(p for p in planned_members if p not in gone and p != me)
    if grid and len(planned_members) > 1 and not members:
        # the others' plans keep a crashed peer until its record expires, so nobody else comes under
        # our key: waiting out the window would stall us and the peers planned with us next
        return Skip("the other planned members are gone", key)
    return Join(result, planned.due, members, key if grid else "", online=len((set(records) | {me}) - gone))


# ---------------------------------------------------------------- after the round: what the outer step does
@dataclass(frozen=True)
class AdoptMixed:
    """The members started from different θ_global and mixed them: adopt the mixed state."""

    carry = False


@dataclass(frozen=True)
class AdoptState:
    """Adopt a downloaded canonical state; ``carry``: θ_local keeps our Δ for the next round (the
    state lacks our round); ``wasted``: our phase's work is dropped."""

    carry: bool
    wasted: bool


@dataclass(frozen=True)
class Apply:
    """θ_global ← OuterStep(θ_global, Δ): the verified average, or our own Δ (alone, a round a
    member may have kept, or late too many rounds in a row)."""

    carry = False


@dataclass(frozen=True)
class Hold:
    """Late: others are online but we were in no verified round. θ_global stays; our Δ goes into the
    next round (a solo step would start a lineage of its own)."""

    carry = True


def settle(outcome: Any, carried_rounds: int) -> AdoptMixed | AdoptState | Apply | Hold:
    """What the outer step does with a finished round (``outcome``: node/outer_sync.py's
    ``RoundOutcome``; ``carried_rounds``: late rounds in a row that its Δ already carries).

    Our Δ is in the swarm's θ_global if a verified average that the swarm kept included it. It may be
    when a member kept the round while we missed a confirmation (``maybe_kept``): carrying it then
    could apply it twice, so the round's average is applied, as a member that heard every
    confirmation does."""
    result = outcome.result
    kept = result.ok and (outcome.state is None or outcome.state.includes_round)
    carry = (not kept and not result.maybe_kept and not outcome.alone and not outcome.stale
             and carried_rounds < MAX_CARRIED_ROUNDS)
    if outcome.mixed is not None:
        return AdoptMixed()
    if outcome.state is not None:
        return AdoptState(carry=carry, wasted=not kept and not carry)
    return Apply() if kept or not carry else Hold()


def feedback_action(decision: AdoptMixed | AdoptState | Apply | Hold, outcome: Any) -> Feedback:
    """The error feedback's move for ``settle``'s ``decision`` on ``outcome`` (its ``selection`` is
    None where the round sent nothing: a solo or skipped round applies Δ alone, a stale Δ is dropped).
    A state adopted after a round we may have kept (``maybe_kept``) that includes the round holds what
    we sent: commit it, though ``settle`` counts the round's Δ wasted."""
    sent = outcome.selection is not None and (outcome.result.ok or outcome.result.maybe_kept)
    match decision:
        case AdoptState(wasted=True) if not (sent and outcome.state.includes_round):  # our Δ dropped
            return Feedback.RESET
        case Hold() | AdoptState(carry=True):
            return Feedback.KEEP
    if outcome.selection is None:
        return Feedback.KEEP
    if isinstance(decision, Apply) and not (outcome.result.ok or outcome.result.maybe_kept):
        return Feedback.COMMIT_OWN
    return Feedback.COMMIT_SENT

