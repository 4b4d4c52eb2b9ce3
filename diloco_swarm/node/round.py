"""One averaging round, on the averaging thread: the DiLoCo outer step's communication half.

    Round.run(handoff, control):
        catch up       behind the swarm by two outer steps or more: adopt its state, drop our Δ
        average        decide (round_policy: Solo / Skip / Join), then int8 all-reduce in the group
        mix            members that started from different θ_global mix them (node/mixing.py)
        reconcile      or adopt the canonical θ_global (node/statesync.py)

Whom to average with is node/round_policy.py's pure functions; this class reads the records,
probes members, waits and calls the averager. The training thread applies the outcome (``Node._apply_round``,
through ``round_policy.settle``). Like torchft's ``DiLoCo.perform_sync``, but membership is read from
the DHT's signed records each round instead of a lighthouse's quorum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from diloco_swarm.averaging.confirm import DIGEST_WAIT_S
from diloco_swarm.averaging.grouping import ahead_of_swarm, moved_past
from diloco_swarm.averaging.mixing import group_bits, history_length, standing
from diloco_swarm.averaging.request import RoundRequest
from diloco_swarm.averaging.results import RoundResult
from diloco_swarm.dht.records import read_peer_records
from diloco_swarm.node import round_policy as policy
from diloco_swarm.node.outer_sync import Handoff, RoundControl, RoundOutcome
from diloco_swarm.node.redial import dial_peers, gone_peers
from diloco_swarm.utils import clock

REBOOTSTRAP_EVERY_S = 30.0  # a client alone re-dials its --initial-peers this often
MOVED_ON_READ_EVERY_S = 2.0  # a late round reads the records this often to see whether its group ran without it
AHEAD_READ_EVERY_S = 1.0  # a grid round ahead of the swarm reads the records this often to see it catch up


@dataclass
class RoundParts:
    """What a round works with, passed in by the node (no back-references to it).

    ``catch_up(step, then=None)``, ``reconcile(gathered, mine, applied=)`` and
    ``mix(result, average, mine, control, gone=)``: the node's state sync and θ-mixing
    (node/statesync.py, node/mixing.py). ``metadata(handoff)``: what the group gathers from us.
    """

    cfg: Any  # NodeConfig
    run_id: str
    organiser: str | None  # RunSpec.organiser: a private run reads only its invited peers' records
    peer_id: str
    averager: Any  # PseudoGradientAverager
    dht: Any
    records: Any  # dht.publisher.PeerRecordPublisher (its interval_s)
    stats: Any  # node.stats.NodeStats
    log: Callable[[str], None]
    housekeeping: Any  # node.housekeeping.Housekeeping
    swarm: Any  # node.swarm_view.SwarmView
    history: Any  # node.global_state.ThetaHistory
    history_floor: int
    stop: Any  # threading.Event: the node is leaving
    overlap: bool
    client_mode: bool
    metadata: Callable[[Handoff], dict[str, Any]]
    catch_up: Callable[..., Any]
    reconcile: Callable[..., Any]
    mix: Callable[..., Any]
    feedback: Any = None  # node.feedback.ErrorFeedback in a sparse mode: what the all-reduce sends of Δ


class Round:
    """The averaging thread's side of the outer step (see the module docstring)."""

    def __init__(self, parts: RoundParts):
        self.p = parts
        self._warned_no_public = False
        self._last_rebootstrap = 0.0
        self._moved_on_read: tuple[float, dict[str, Any]] = (float("-inf"), {})  # (time.monotonic(), records)
        self._paused: frozenset[str] = frozenset()  # the peers whose records, as read last, say they are paused

    def run(self, handoff: Handoff, control: RoundControl) -> RoundOutcome:
        """One round, in its phases. Never raises: a failure is an outcome with ``ok=False``, which
        ``round_policy.settle`` then holds (Δ carried) or applies (nobody else online, late too long)."""
        caught_up = self._catch_up_before(handoff)
        if caught_up is not None:  # far behind the swarm: adopt its state, our stale Δ is dropped
            return caught_up
        try:
            outcome = self._average(handoff, control)
        except Exception as e:  # never lose the training thread to a round: it becomes a late round
            return RoundOutcome(RoundResult(ok=False, group_size=1, reason=f"round failed: {e!r}"[:200]), handoff.delta)
        if control.stop.is_set() or outcome.alone:  # leaving, or a solo round: nothing to compare
            return outcome
        if not outcome.result.gathered:  # no group: if the others are far ahead, our next round could never meet theirs
            outcome.state = self._try(self.p.catch_up, handoff.standing, then=handoff.standing)
            return outcome
        self._mix_or_reconcile(outcome, handoff, control)  # one θ_global for the group
        return outcome

    def _catch_up_before(self, handoff: Handoff) -> RoundOutcome | None:
        """Our Δ stands on a θ_global two or more outer steps behind the swarm's: averaged in, it would
        pull the others' step with a stale direction at its full token weight. Instead it is dropped
        and the swarm's state adopted. (A late peer's carried Δ is one round stale by design: averaged.)"""
        if handoff.carried is not None:
            return None
        state = self._try(self.p.catch_up, handoff.standing)
        if state is None:
            return None
        owed = f" owing {handoff.restarted_below} for a restart" if handoff.restarted_below else ""  # (mixing.standing)
        reason = f"behind the swarm (outer step {handoff.outer_step}{owed}, the swarm's {state.meta['outer_step']}): caught up"
        return RoundOutcome(RoundResult(ok=False, group_size=1, reason=reason), handoff.delta, state=state, stale=True)

    def _mix_or_reconcile(self, outcome: RoundOutcome, handoff: Handoff, control: RoundControl) -> None:
        """After a round with a group: members that started from different θ_global mix them
        (node/mixing.py); when they did not mix, the canonical θ_global is compared and, if ours is not
        it, downloaded (node/statesync.py). A failure leaves the round standing; the next one reconciles."""
        result, mine = outcome.result, (handoff.outer_step, handoff.theta_digest)
        if result.ok:
            outcome.mixed, outcome.mixing = self._try(self.p.mix, result, outcome.average, mine, control,
                                                      gone=self.gone_members,
                                                      what="mix θ_global with the group after the round") or (None, None)
        if outcome.mixed is None and not control.stop.is_set():
            outcome.state = self._try(self.p.reconcile, result.gathered, mine, applied=result.ok or result.maybe_kept,
                                      what="compare θ_global with the group after the round")

    def _try(self, call: Callable[..., Any], *args, what: str = "compare our outer step with the swarm's", **kwargs):
        """``call``, or None with one line when the DHT or the averager did not answer (the round goes on)."""
        try:
            return call(*args, **kwargs)
        except Exception as e:
            self.p.log(f"could not {what}: {e}")
            return None

    def _average(self, handoff: Handoff, control: RoundControl) -> RoundOutcome:
        """Decide whom to average with (round_policy), then average Δ with that group."""
        p, own = self.p, handoff.delta  # (fp32 CPU: read by the outer step, never changed)
        records = self._read_records()
        if not self._public_peer_online(records):
            if not self._redial_public_peers():
                # clients cannot form a group among themselves (nobody accepts connections): train solo
                if not self._warned_no_public:
                    self._warned_no_public = True
                    p.log("warning: no public peer in the swarm, only clients (which cannot reach each other); "
                          "training solo until a public peer joins. A peer that can accept connections (port "
                          "forwarded, or a server) lets the swarm average again")
                return self._skipped(policy.Solo("no public peer: every peer is a client"), own)
            records = self._read_records()  # a public peer answered the re-dial: read who is there now
        p.swarm.note(records)  # fresh for the phase that follows this round (a re-sync aims at the swarm's hand-off)
        donors = bool(set(p.averager.donors()) - self._paused)  # a paused peer still serves its state: no round partner
        alone = policy.nobody_online(records, me=p.peer_id, donors=donors)
        early = policy.before_plan(records, me=p.peer_id, donors=donors, overlap=p.overlap,
                                   max_outer_steps=p.cfg.max_outer_steps, paused=len(self._paused))
        if early is not None:
            return self._skipped(early, own)
        planned, gone = self._plan(handoff, records)
        if policy.needs_swarm_wait(planned.plan, records, p.peer_id):
            fresh = self._wait_for_swarm(handoff, control, records)
            if fresh is not None:  # we waited for the swarm to reach our step: plan with what it is now
                records = fresh
                planned, gone = self._plan(handoff, records)
        decision = policy.after_plan(planned, records, gone, me=p.peer_id, overlap=p.overlap)
        if not isinstance(decision, policy.Join):
            return self._skipped(decision, own)
        result, average, selection = self._all_reduce(handoff, control, decision)
        return RoundOutcome(result, average, alone=alone, group_key=decision.group_key, selection=selection)

    @staticmethod
    def _skipped(decision: policy.Solo | policy.Skip, own: list) -> RoundOutcome:
        """The outcome of a round that averaged nothing: our own Δ stands."""
        match decision:
            case policy.Solo(reason=reason):
                return RoundOutcome(RoundResult(ok=False, group_size=1, reason=reason), own, alone=True)
            case policy.Skip(reason=reason, group_key=key):
                return RoundOutcome(RoundResult(ok=False, group_size=1, reason=reason), own, group_key=key)

    def _all_reduce(self, handoff: Handoff, control: RoundControl, join: policy.Join):
        """The group's int8 all-reduce of Δ (in a sparse mode, of the feedback's selection of Δ + e),
        verified (averaging/averager.py). The leader starts as soon as every member is in (hivemind's
        target size): the matchmaking time on top only gives the slower of them (a loaded machine reads
        the DHT slowly) time to find it. :returns: (result, the Δ to apply, the selection or None)."""
        p, plan = self.p, join.plan
        selection = p.feedback.select(handoff.delta) if p.feedback is not None else None
        grid = bool(join.group_key)  # groups smaller than the swarm: θ-mixing keeps them one model
        p.history.resize(max(p.history_floor, history_length(plan.dims if grid else 1)))
        if grid:  # peers behind the swarm at our step join this round (grouping.round_number): say so now
            p.stats.averaging_round = plan.round_no
            p.housekeeping.publish_soon()
        try:
            result, average = p.averager.average(RoundRequest(
                delta=handoff.delta if selection is None else selection.dense, weight=max(handoff.tokens, 1),
                metadata=p.metadata(handoff), timeout=p.cfg.averaging_window, stop=control.stop,
                give_up=control.give_up, digest_wait=DIGEST_WAIT_S, scheduled_time=join.due + p.cfg.matchmaking_time,
                online_peers=join.online, group_bits=group_bits(join.group_key) if grid else "",
                group_size=max(2, len(join.members) + 1), group_cap=plan.max_group_size, gone=self.gone_members,
                members=list(join.members), members_due=join.due,
                moved_on=lambda peers: self.moved_on(peers, plan.round_no)))
            if selection is not None:
                selection.dense = None  # (the averager's buffers hold it now; a failed round's ``average`` is this list)
            return result, average, selection
        finally:
            p.stats.averaging_round = None

    def _plan(self, handoff: Handoff, records: dict[str, Any]) -> tuple[policy.Planned, set[str]]:
        """The round's plan (``round_policy.plan``) and the planned members found gone: a member that
        crashed moments ago still has a fresh record, so it is pinged before the round waits for it
        (clients serve no DHT calls: they cannot be asked). A member that dies after this plan is
        found gone past ``due`` (``RoundRequest.members_due``)."""
        p = self.p
        others = p.swarm.round_peers(records, paused=self._paused)
        seen = time.monotonic()
        view = dict(me=p.peer_id, silent_s={q: p.swarm.silent_s(q, seen) for q in others},
                    max_silent_s=policy.SILENT_RECORDS * p.records.interval_s, first_round=p.stats.last_round is None,
                    cfg=p.cfg, shunned=frozenset(p.stats.avoided_peers))  # (as of the last all-reduce that ran)
        planned = policy.plan(handoff.standing, handoff.inner_s, others, now=clock.now(), **view)
        _, members = planned.plan.group_of(p.peer_id)
        gone = gone_peers(p.dht, [q for q in members if q != p.peer_id and others[q].reachability != "client"],
                          stop=p.stop)
        if gone:
            planned = policy.plan(handoff.standing, handoff.inner_s, others, now=clock.now(), gone=gone, **view)
        return planned, gone

    def _wait_for_swarm(self, handoff: Handoff, control: RoundControl,
                        records: dict[str, Any]) -> dict[str, Any] | None:
        """Before a round of groups smaller than the swarm: while our outer step is past the swarm's
        (``grouping.ahead_of_swarm``: averaging now would put us two steps ahead), re-read the records every
        :data:`AHEAD_READ_EVERY_S` until the swarm reaches our step, at most ``--averaging-window``
        seconds (the peers behind may be stuck) or until the round is stopped or given up. Meanwhile
        our record names our round (``averaging_round``), so the peers that reach our step count us due.
        :returns: the records read last (to plan anew), or None when we were not ahead (no wait).
        :raises ChildUnavailable: the DHT did not answer a read in time (the round then fails)."""
        p = self.p

        def ahead() -> bool:
            return ahead_of_swarm(handoff.standing, [standing(r.outer_step, r.restarted_below)
                                                     for q, r in records.items() if q != p.peer_id])

        if not ahead():
            return None
        p.stats.averaging_round = handoff.standing
        p.housekeeping.publish_soon()
        t0 = time.monotonic()
        try:
            while ahead() and time.monotonic() - t0 < p.cfg.averaging_window:
                if control.stop.wait(AHEAD_READ_EVERY_S) or control.give_up.is_set():
                    break
                records = self._read_records()
        finally:
            p.stats.averaging_round = None
            p.stats.ahead_wait_s += time.monotonic() - t0
        return records

    def gone_members(self, peers: Sequence[str]) -> set[str]:
        """Those of a round's ``peers`` whose process is gone (``node/redial.py: ProbePeers``), for the
        digest cross-check. Only peers whose records say they serve DHT calls are asked (a client's ping
        fails although it is there), and only a failed ping counts: one that hangs while our DHT bans
        the peer may be a slow member that still confirms."""
        seen = self.p.swarm.grid_records  # peer id -> (when read, its record): the records the plan read
        askable = [q for q in peers if q in seen and seen[q][1].reachability != "client"]
        return gone_peers(self.p.dht, askable, stop=self.p.stop, banned_is_gone=False)

    def moved_on(self, peers: Sequence[str], round_no: int) -> set[str]:
        """Those of a forming round's late ``peers`` whose records show an outer step past ``round_no``
        (they averaged it before we arrived: our plan counted them in, theirs counted us late) or a later
        round in flight (they planned with a newer view of the swarm, ``grouping.moved_past``), so the
        round stops waiting for them and our Δ goes into the next round; so has one whose record says it
        paused since our plan (it hands off no Δ until resumed). Reads the records at most every
        :data:`MOVED_ON_READ_EVERY_S`; never raises (a failed read finds nobody)."""
        now = time.monotonic()
        if now - self._moved_on_read[0] >= MOVED_ON_READ_EVERY_S:
            try:
                self._moved_on_read = (now, self._read_records())
            except Exception:
                self._moved_on_read = (now, {})
        records = self._moved_on_read[1]
        return {q for q in peers if q in self._paused or q in records
                and moved_past(round_no, standing(records[q].outer_step, records[q].restarted_below),
                               records[q].averaging_round)}

    def _read_records(self) -> dict[str, Any]:
        """The run's signed peer records (dht/records.py) of the peers that train now (paused ones left out).
        :raises ChildUnavailable: the DHT did not answer in time (the round then fails)."""
        records = read_peer_records(self.p.dht, self.p.run_id, organiser=self.p.organiser)
        training = policy.training(records)  # no round plans with, counts or waits for a paused peer
        self._paused = frozenset(records) - frozenset(training)
        return training

    def _public_peer_online(self, records: dict[str, Any]) -> bool:
        """Whether a group can form for us: always for a full peer; a client needs a public peer
        (a state donor, or a record that is not a client's)."""
        p = self.p
        if not p.client_mode or p.averager.donors():
            return True
        return any(q != p.peer_id and r.reachability != "client" for q, r in records.items())

    def _redial_public_peers(self) -> bool:
        """A client with no public peer online re-dials its ``--initial-peers``, at most every
        :data:`REBOOTSTRAP_EVERY_S` (they may be back, restarted at the same address).
        :returns: whether a state donor is announced now."""
        p, now = self.p, time.monotonic()
        if p.cfg.initial_peers and now - self._last_rebootstrap > REBOOTSTRAP_EVERY_S:
            # the public peers may be back (restarted at the same address): dial them again
            self._last_rebootstrap = now
            dial_peers(p.dht, p.cfg.initial_peers)
            return bool(p.averager.donors())
        return False
