"""State sync: a peer's θ_global, outer momentum and outer step, downloaded and adopted.

- **Join sync**: a late joiner adopts the state of the most advanced peer (:meth:`StateSync.join`).
- **Reconcile**: after a round, the members that started it from a θ_global other than the
  canonical one download the canonical state, and a peer more than one outer step behind the
  swarm downloads the newest (:meth:`StateSync.reconcile`, on the averaging thread; the training
  thread adopts it, :meth:`StateSync.adopt`).
- **The end of a run**: a finisher serves its state to the peers still behind
  (:meth:`StateSync.end_on_one_model`).

The state this peer donates is read from ``GlobalState.for_donation`` (node/global_state.py). Every
payload comes from an untrusted peer and is checked against the run spec before anything changes. Which state the swarm's records back, and which one a
round's members settle on, are the pure rules of ``node/canonical.py``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diloco_swarm.averaging.grouping import is_count
from diloco_swarm.averaging.mixing import MAX_DEBT, restart_of, standing
from diloco_swarm.dht.records import live_records, read_peer_entries
from diloco_swarm.node.canonical import Evidence, canonical_state, gather_evidence, majority_holders
from diloco_swarm.node.global_state import GlobalState, theta_digest
from diloco_swarm.node.redial import dial_peers, gone_peers

MAX_DONOR_TRIES = 4
STATE_CHUNK_TIMEOUT_S = 10.0
EVIDENCE_RETRY_S = 0.5  # a fresh round's output may take a moment to reach its members' records
FINISH_LINGER_S = 120.0  # at --max-outer-steps, a node serves its state this long at most to peers still behind
LINGER_POLL_S = 1.0  # ... and re-reads their records this often
MAX_END_SYNCS = 3  # diverged downloads at the end of a run: the canonical state once, then a majority's
# ... and counts a silent peer gone (or its own DHT lost) once every probe (read) failed or hung for this
# long: pings that hang past their 1 s bound for a few seconds on a loaded host are no crash (CI saw
# finishers leave a paused peer behind on 1 hung ping, and once more under a 3-in-a-row rule), and the
# wait is 120 s long
LINGER_GONE_AFTER_S = 10.0


@dataclass
class DownloadedState:
    """A peer's checked state (θ_global + outer momentum tensors, fp32 CPU) and where it came from."""

    donor: str
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    received: int  # bytes
    seconds: float
    reason: str  # join | diverged | lagging
    includes_round: bool = False  # a member's state after the round just averaged (our Δ is in it when that was ok)


class StateSync:
    """Join sync, reconcile, catch-up and the end-of-run wait of one node (see the module docstring).

    :param state: this node's θ_global (node/global_state.py).
    :param sync: θ_local's side of the outer step (``OuterSync``): a state adopted after a round keeps
        θ_local's progress since the hand-off.
    :param params: the model's parameters (θ_local): a state adopted before training is copied there.
    :param averager: downloads states and lists the donors (``PseudoGradientAverager``).
    :param records: our record's publisher (a state adopted at the end is published at once).
    :param swarm: the others as their records say (``SwarmView``: the peers seen lately).
    :param checkpoints: the checkpoint writer (a state adopted before training is written at once).
    :param evaluate_now: held-out loss of θ_global now, with its line (after a state adopted at the end).
    :param stop: the node's ``StopFlag``.
    """

    def __init__(self, state: GlobalState, *, sync: Any, params: list[torch.Tensor], averager: Any, dht: Any,
                 spec: Any, cfg: Any, peer_id: str, client_mode: bool, stats: Any, metrics: Any, records: Any,
                 swarm: Any, checkpoints: Any, evaluate_now: Callable[[], None], stop: Any,
                 log: Callable[[str], None], feedback: Any = None):
        self.state, self.sync, self.params, self.averager, self.dht = state, sync, params, averager, dht
        self.spec, self.cfg, self.peer_id, self.client_mode = spec, cfg, peer_id, client_mode
        self.stats, self.metrics, self.records, self.swarm = stats, metrics, records, swarm
        self.checkpoints, self.evaluate_now, self.stop, self.log = checkpoints, evaluate_now, stop, log
        self.feedback = feedback  # node.feedback.ErrorFeedback in a sparse mode: a downloaded state drops its residual
        self._unsupported_claims: set[str] = set()  # peers warned of once (:meth:`_warn_unsupported`)

    def _check(self, meta: Any, tensors: list[torch.Tensor], min_step: int) -> str | None:
        """Why a downloaded state is unusable, or None. The donor is untrusted."""
        n = len(self.state.theta)
        if not isinstance(meta, dict):
            return "no metadata"
        if meta.get("spec_hash") != self.spec.spec_hash():
            return "it belongs to another run spec"
        step, restart = meta.get("outer_step"), restart_of(meta)
        if not is_count(step, 0, (1 << 53) - 1) or restart is None:
            return "no valid outer step"
        if standing(step, restart) < min_step:
            return f"it stands at {standing(step, restart)} (outer step {step}), older than {min_step}"
        if len(tensors) != 2 * n:
            return f"{len(tensors)} tensors instead of {2 * n}"
        for t, ref in zip(tensors, self.state.theta + self.state.theta):
            if t.shape != ref.shape or t.dtype != torch.float32:
                return "tensor shapes or dtypes differ from this model"
            if not torch.isfinite(t).all():
                return "non-finite values"
        if theta_digest(tensors[:n]) != meta.get("theta_digest"):
            return "θ_global does not match its digest"
        return None

    def join(self) -> None:
        """Late joiner: adopt the state of the most advanced peer if it is ahead of ours (not once a
        stop was requested: the node leaves with the state it has)."""
        if not self.cfg.initial_peers or self.stop.requested:
            return
        deadline = time.monotonic() + 5.0
        donors: dict[str, float] = {}
        while not donors and time.monotonic() < deadline and not self.stop.requested:
            donors = self.averager.donors()
            if not donors:
                time.sleep(0.5)
        if not donors:
            # Bootstrap check (guards against DHT splits, hivemind #624): we were given initial
            # peers but see nobody of this run. Re-bootstrap once, then warn in one line.
            dial_peers(self.dht, self.cfg.initial_peers)
            time.sleep(1.0)
            donors = self.averager.donors()
        if not donors:
            self.log(f"warning: this node sees no other peer of run '{self.spec.run_id}' yet; check "
                            "--run-id and --initial-peers. Training alone until peers appear; starting from "
                            + ("our checkpoint" if self.state.step else "the initial weights"))
            return
        evidence = self.evidence()
        newest = evidence.supported_step
        if newest <= self.state.standing:
            return
        synced = self.download_and_adopt(min_step=newest, reason="join", attempts=3, candidates=evidence.donors_at(newest))
        if not synced and not self.stop.requested:  # a stop cuts the download short: nothing to report
            # Training on from here starts a lineage of our own. It owes the outer steps we could not
            # download: it replaces the swarm's state (its holder asleep, say) only once it stands further,
            # never for its step count alone (mixing.standing)
            owed = min(newest - self.state.standing, MAX_DEBT - self.state.restarted_below)
            self.state.restarted_below += owed
            self.log(f"could not download the swarm's state (outer step {newest}); continuing from outer step "
                     f"{self.state.step} on a new lineage that owes the {owed} outer steps it could not download: "
                     f"the swarm's lineage stays ahead until ours has made {owed} more outer steps than it")

    def resume(self) -> bool:
        """After a pause (node/pause.py): adopt the newest state the swarm's records back when it stands more
        than one outer step ahead of ours (the lagging rule, as :meth:`catch_up`); one step behind is a late
        peer's normal case, met in the next round. :returns: True when a state was adopted."""
        if self.stop.requested:
            return False
        evidence = self.evidence()
        newest = evidence.supported_step
        if newest <= self.state.standing + 1:
            return False
        return self.download_and_adopt(min_step=newest, reason="resume", candidates=evidence.donors_at(newest))

    def evidence(self) -> Evidence:
        """:func:`gather_evidence` from a fresh read of the swarm's signed records."""
        entries = read_peer_entries(self.dht, self.spec.run_id, organiser=self.spec.organiser)
        return gather_evidence(entries, self.peer_id, self.state.step, self.state.marks.copy(), self.state.restarted_below)



    def reconcile(self, gathered: dict[str, Any], mine: tuple[int, str], applied: bool = True) -> "DownloadedState | None":
        """After a round: if the group's members started it from different θ_global, the
        members not holding the canonical one (among the states the swarm's records back and a
        member can donate: newest outer step, then vouched, then most members, then digest order)
        download it from one that does; and a peer more than one outer step behind the supported
        step downloads too (lagging peer). See :class:`Evidence`.

        ``applied``: the round was verified, so the canonical members move on one outer step
        (a failed round is late for every member: they keep their θ_global).
        :returns: the state to adopt instead of applying the round, or None."""
        entries: dict[str, tuple[int, str]] = {}
        restarts: dict[str, int] = {}  # peer id -> its lineage's debt (mixing.standing)
        for peer, meta in gathered.items():
            if isinstance(meta, dict) and isinstance(meta.get("outer_step"), int) and isinstance(
                meta.get("theta_digest"), str
            ) and restart_of(meta) is not None:
                entries[peer], restarts[peer] = (meta["outer_step"], meta["theta_digest"]), restart_of(meta)
        entries[self.peer_id], restarts[self.peer_id] = mine, restarts.get(self.peer_id, self.state.restarted_below)
        evidence = self.evidence()
        newest = evidence.supported_step
        if len(set(entries.values())) > 1:
            claims = {p: (*e, restarts[p]) for p, e in entries.items()}  # (outer step, digest, debt)
            for peer, claim in claims.items():
                if peer != self.peer_id and standing(claim[0], claim[2]) > newest + 1:  # one step ahead: records on their way
                    self._warn_unsupported(peer, claim[0])
            canonical = canonical_state(entries, self.peer_id, evidence, self.averager.donors(),
                                        can_donate=not self.client_mode, restarts=restarts)
            if claims[self.peer_id] != canonical:  # (a holder whose record says client serves no state: never asked)
                holders = [p for p, c in claims.items() if c == canonical and p not in evidence.clients]
                target = standing(canonical[0], canonical[2])
                # behind the canonical state: a late peer, not a lineage of its own
                reason = "lagging" if target > standing(mine[0], restarts[self.peer_id]) else "diverged"
                state = self.download(min_step=target + int(applied), reason=reason,
                                             candidates=holders, attempts=6)
                if state is not None:
                    state.includes_round = True
                return state
        stands = standing(mine[0], restarts[self.peer_id])
        return self.catch_up(stands, evidence, then=stands + int(applied))

    def catch_up(self, step: int, evidence: Evidence | None = None, *,
                  then: int | None = None) -> "DownloadedState | None":
        """The newest state the swarm's records back, downloaded, when it stands more than one outer step
        ahead of ``step`` (our standing, ``mixing.standing``: a lagging peer, its whole group or its lone
        round fell behind), else None.

        ``then``: the outer step this peer holds once its round is applied, when the round has ended
        (None while it is still to run). The swarm's state is then also taken when it has reached our
        ``--max-outer-steps`` ahead of ``then``: a peer late for the last round has no next round to
        meet the others in, and would end the run alone on its own θ_global (the finishers wait for it:
        :meth:`end_on_one_model`)."""
        evidence = evidence or self.evidence()
        newest = evidence.supported_step
        limit = self.cfg.max_outer_steps
        at_end = then is not None and 0 < limit <= newest and newest > then
        if newest > step + 1 or at_end:
            return self.download(min_step=newest, reason="lagging", candidates=evidence.donors_at(newest))
        return None

    def end_on_one_model(self, in_grid: bool = False) -> None:
        """At the planned end (``--max-outer-steps``): stay online, at most :data:`FINISH_LINGER_S`,
        until every peer of the run holds our θ_global or has left. Our record says we train no more
        (``phase_eta`` 0), so no round waits for us. A client serves no state (nobody can dial it)
        and leaves at once; so does a node asked to stop.

        - **Peers behind** our step download our state (:meth:`catch_up`) instead of ending alone on
          their own θ_global. We wait for those whose live record is behind, and for the peers we
          saw in the last 2 minutes whose record then expired (3 re-signing periods) while their
          process still answers a ping: a node paused or starved for longer than that, or restarted,
          is still coming. A paused one (its record's ``paused``) is not waited for. One that said goodbye left; one whose pings all fail (or hang past their
          bound) for :data:`LINGER_GONE_AFTER_S` crashed or left; a client cannot be asked, so its
          expired record ends the wait for it. A DHT that answers no read for as long ends the wait.
        - **Peers at our step on another θ_global** (the last round failed its confirmation, e.g. a
          member stopped before it confirmed, and each member applied its own Δ): the canonical
          state among them (:func:`canonical_state`, the rule of a round's members) wins; we download
          it once when it is not ours (reason ``diverged``), and wait for the others while it is; after
          that, only a state a strict majority of them holds moves us again (:func:`majority_holders`). Not
          in a grid (groups smaller than the swarm): there the groups' θ_global differ by design
          (θ-mixing keeps them close), and every peer downloading one would swamp its holders.
        """
        if self.client_mode or self.stop.requested:
            return
        self.stats.phase_eta = 0.0
        self.records.publish_now()
        deadline, said, synced = time.monotonic() + FINISH_LINGER_S, False, 0  # (synced: diverged downloads made)
        # peer id -> (its outer step, its record's owner, whether it answers pings); None: not known
        behind: dict[str, tuple[int | None, str | None, bool]] = {p: (None, None, True) for p in self.swarm.recent_peers}
        unanswered_since: dict[str, float] = {}  # silent peer -> when its first probe of a failing run ended
        unread_since: float | None = None  # when the first DHT read of a failing run ended
        while not self.stop.requested and time.monotonic() < deadline:
            entries = read_peer_entries(self.dht, self.spec.run_id, organiser=self.spec.organiser)
            if entries is None:  # the DHT did not answer: for long, nobody can find us either
                unread_since = time.monotonic() if unread_since is None else unread_since
                if time.monotonic() - unread_since >= LINGER_GONE_AFTER_S:
                    if said:
                        self.log("the DHT has not answered for a while: leaving")
                    return
                self.stop.event.wait(LINGER_POLL_S)
                continue
            unread_since = None
            records = live_records(entries)
            others: dict[str, str] = {}  # peer id -> the θ digest it holds at our step, when not ours
            mine, same = self.state.digest(), 0  # (same: the other peers at our step that hold ours)
            for e in entries:
                r = e.record
                if r is None or r.peer_id == self.peer_id or records.get(r.peer_id) is not r:
                    continue
                if r.paused is not None:  # (node/pause.py) it may be paused for hours: nobody waits for it
                    behind.pop(r.peer_id, None)
                    continue
                if standing(r.outer_step, r.restarted_below) < self.state.standing:
                    behind[r.peer_id] = (r.outer_step, e.owner, r.reachability != "client")
                    continue
                behind.pop(r.peer_id, None)
                digest = next((m.digest for m in r.theta_marks if m.step == self.state.step), None)
                if (r.outer_step, r.restarted_below) == (self.state.step, self.state.restarted_below) and \
                        digest not in (None, mine) and not in_grid:
                    others[r.peer_id] = digest
                same += r.outer_step == self.state.step and digest == mine
            farewells = {e.owner for e in entries if e.record is None}
            for p in [p for p in behind if p not in records]:  # its record expired or said goodbye
                _, owner, askable = behind[p]
                if owner in farewells or not askable:
                    del behind[p]
            silent = [p for p in behind if p not in records]
            # a ping that hangs counts as a miss here: a peer that left leaves an address that may never answer
            unanswered = gone_peers(self.dht, silent, stop=self.stop.event, only_answers_count=True)
            probed = time.monotonic()
            unanswered_since = {p: t for p, t in unanswered_since.items() if p in silent}
            for p in silent:
                if p not in unanswered:
                    unanswered_since.pop(p, None)
                elif probed - unanswered_since.setdefault(p, probed) >= LINGER_GONE_AFTER_S:
                    behind.pop(p, None)
            if others:
                if synced < 1:
                    evidence = gather_evidence(entries, self.peer_id, self.state.step, self.state.marks.copy(),
                                               self.state.restarted_below)
                    holders = self._holders_of_canonical(others, mine, evidence)
                elif synced < MAX_END_SYNCS:
                    # Two peers that judged apart (their reads a moment apart) must not swap states forever,
                    # and one must not stay alone on the state the others just left (a newcomer's grid run:
                    # five peers on one θ_global, the sixth on the one they had held): after one download,
                    # only the state a strict majority of the peers at our step holds moves us
                    holders = majority_holders(others, same)
                else:
                    holders = []
                if not holders and synced and same + 1 <= len(others):
                    others = {}  # ours is no majority either: nobody follows us, nobody to wait for
                elif holders:
                    synced += 1
                    if self.download_and_adopt(min_step=self.state.standing, reason="diverged", candidates=holders,
                                               attempts=3):
                        self.evaluate_now()
                        self.records.publish_now()
                    continue
            if not behind and not others:
                if said:  # the line above said we wait: say the wait is over, or the summary reads as a contradiction
                    self.log("no peer left to wait for: leaving")
                return
            # a silent peer is named once it answered: one that just left (its goodbye unseen) never does
            if not said and (others or any(p in records or p not in unanswered for p in behind)):
                said = True
                n = len(behind) + len(others)
                who, it = ("1 peer is", "it") if n == 1 else (f"{n} peers are", "them")
                steps = [s for s, _, _ in behind.values() if s is not None]
                where = (f"behind (outer step {min(steps)})" if steps else
                         "silent (no fresh record) but answering" if behind else
                         f"on another θ_global at outer step {self.state.step}")
                self.log(f"{who} still {where}: serving {it} this final state for up to "
                                f"{FINISH_LINGER_S:.0f}s before leaving (Ctrl+C leaves now)")
            self.stop.event.wait(LINGER_POLL_S)
        if said and not self.stop.requested:
            n = len(behind) + len(others)
            self.log(f"leaving after {FINISH_LINGER_S:.0f}s with {'1 peer' if n == 1 else f'{n} peers'} not on this "
                     "final state: they catch up from another peer or end on their own")

    def _holders_of_canonical(self, others: dict[str, str], mine: str, evidence: Evidence) -> list[str]:
        """Of the peers at our outer step that hold another θ_global (``others``: peer id -> digest), those
        holding the canonical one (:func:`canonical_state`) when it is not ours ``mine``; else []."""
        at_step = {p: (self.state.step, d) for p, d in others.items()}
        at_step[self.peer_id] = (self.state.step, mine)
        canonical = canonical_state(at_step, self.peer_id, evidence, self.averager.donors(), can_donate=True,
                                    restarts={p: self.state.restarted_below for p in at_step})  # (others: ours)
        return [] if canonical[1] == mine else [p for p, d in others.items() if d == canonical[1]]

    def _warn_unsupported(self, peer: str, step: int) -> None:
        """Name, once per peer, a peer that claims an outer step other peers' signed records do not back."""
        if peer not in self._unsupported_claims:
            self._unsupported_claims.add(peer)
            self.log(f"warning: peer {peer} claims outer step {step}, which no other peer's signed record "
                            "backs; not following it")

    def download(self, *, min_step: int, reason: str, candidates: list[str] | None = None,
                        attempts: int = 1) -> "DownloadedState | None":
        """Download θ_global, outer momentum and outer step from a live peer (any thread; adopts nothing).

        Donors: ``candidates`` if given, else the most advanced peers that share state (a random
        one first, so no single donor is choked), then the others. Each payload is checked
        against the run spec before use; a failed or bad donor is skipped.
        :returns: the checked state, or None when no donor gave a usable one.
        """
        max_bytes = 2 * sum(t.numel() for t in self.state.theta) * 4 + (1 << 20)
        t0 = time.monotonic()
        ahead: dict[str, str] = {}  # donor -> why the records do not back its state yet (said once, at the end)
        for attempt in range(attempts):
            if self.stop.requested:
                return None
            evidence = self.evidence()
            if candidates is not None:
                order = [p for p in candidates if p != self.peer_id]
                random.shuffle(order)
            else:
                donors = {p: s for p, s in self.averager.donors().items() if s >= min_step}
                if not donors:
                    return None
                best = max(donors.values())
                top = [p for p, s in donors.items() if s == best]
                rest = sorted((p for p in donors if donors[p] != best), key=lambda p: -donors[p])
                random.shuffle(top)
                order = top + rest
            for peer in order[:MAX_DONOR_TRIES]:
                try:
                    meta, tensors, received = self.averager.download_state(
                        peer, timeout=STATE_CHUNK_TIMEOUT_S, max_bytes=max_bytes, stop=self.stop.event
                    )
                except Exception as e:
                    self.log(f"state download from {peer} failed: {_download_problem(e)}")
                    continue
                problem = self._check(meta, tensors, min_step)
                if problem is not None:
                    if "older than" not in problem:
                        self.log(f"refused the state of {peer}: {problem}")
                    continue
                state = (meta["outer_step"], meta["theta_digest"], restart_of(meta))
                if evidence.accepts(*state) is not None:
                    evidence = self.evidence()  # the records of a fresh round may just be arriving
                    problem = evidence.accepts(*state)
                    if problem is not None:
                        ahead[peer] = problem
                        continue
                return DownloadedState(donor=peer, meta=meta, tensors=tensors, received=received,
                                       seconds=time.monotonic() - t0, reason=reason)
            if attempt + 1 < attempts:
                time.sleep(EVIDENCE_RETRY_S)
        for peer, problem in ahead.items():
            self.log(f"refused the state of {peer}: {problem}")
        return None

    def adopt(self, state: "DownloadedState", handoff=None, estimate=None, carry: bool = False) -> None:
        """θ_global, outer momentum and outer step ← a downloaded state. θ_local ← θ_global before
        training (join sync); after a round (``handoff``, ``estimate``: node/outer_sync.py), θ_local
        keeps its progress since the hand-off, and the hand-off's Δ when ``carry``."""
        before, n = self.state.step, len(self.state.theta)
        with self.state.moving_to(state.meta["outer_step"], state.meta["theta_digest"], restart_of(state.meta)):
            if handoff is None:
                self.state.outer.load_theta_and_momentum(state.tensors[:n], state.tensors[n:])
                self.state.outer.copy_to(self.params)
            else:
                self.sync.adopt(state.tensors[:n], state.tensors[n:], handoff.delta, estimate, carry=carry)
        self.stats.state_syncs += 1
        self.stats.sync_s += state.seconds
        self.metrics.write({"event": "state_sync", "peer_id": self.peer_id, "donor": state.donor,
                            "reason": state.reason, "from_outer_step": before, "outer_step": self.state.step,
                            "bytes": state.received, "seconds": round(state.seconds, 3),
                            "theta_digest": state.meta["theta_digest"]})
        self.log(f"state sync ({state.reason}): outer step {before} -> {self.state.step} from {state.donor} "
                 f"({state.received / 1e6:.1f} MB in {state.seconds:.1f}s)")

    def download_and_adopt(self, *, min_step: int, reason: str, candidates: list[str] | None = None,
                           attempts: int = 1) -> bool:
        """Download a live peer's state and adopt it now (before training: join sync).
        :returns: True when a state was adopted."""
        state = self.download(min_step=min_step, reason=reason, candidates=candidates, attempts=attempts)
        if state is None:
            return False
        self.adopt(state)
        if self.feedback is not None:  # our residual stood on the state we left (rule 64); before the checkpoint
            self.feedback.reset()
        self.checkpoints.write_now()
        return True


def _download_problem(e: BaseException) -> str:
    """One line for a failed state download; libp2p's dial failure ("Connect failed. msg=failed to
    dial: ... all dials failed") in words."""
    text = str(e).strip() or type(e).__name__
    if "failed to dial" in text or "Connect failed" in text:
        return "could not connect to it (it may have just left or restarted)"
    if "this peer's θ_global" in text:  # the donor's TornState (averaging/donation.py), as its handler said it
        return "its θ_global changed while it streamed (an outer step of its own); trying the next donor"
    return text
