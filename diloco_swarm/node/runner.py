"""The DiLoCo loop of one node (Douillard et al., arXiv 2311.08105, Algorithm 1), overlapped.

    for each outer step t:
        an inner phase of AdamW steps on local data (H, sized by DyLU)       θ_local
        hand-off: Δ_t = θ_global − θ_local to the averaging thread            (fp32, CPU)
                  θ_local ← OuterStep(θ_global, Δ_t)   (overlap: our Δ stands in for the average)
        ... the next inner phase runs while the group averages Δ_t (int8, verified) ...
        apply:    θ_global ← OuterStep(θ_global, Δ̄_t); θ_local moves along (node/outer_sync.py)
                  (late: no verified group while others are online: θ_global stays, Δ_t is carried)
                  checkpoint (its own thread), evaluation, metrics, peer record (housekeeping thread)

``--sync-mode blocking`` waits for each round instead.

Where the rest lives: the round on the averaging thread in node/round.py (:meth:`Round.run`), its
decisions in node/round_policy.py (applied here by :meth:`Node._apply_round`); θ_global and its outer
step in node/global_state.py; start-up and leave in node/startup.py; the node's other collaborators
(state sync, θ-mixing, checkpoint writer, housekeeping, evaluation, supervisor, DyLU) each in its own
module; the counters in node/stats.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from diloco_swarm import __version__
from diloco_swarm.averaging.allreduce import finite_norm
from diloco_swarm.averaging.mixing import history_length
from diloco_swarm.dht.calls import ChildUnavailable
from diloco_swarm.node import round_policy as policy
from diloco_swarm.node.checkpoint_writer import CheckpointWriter
from diloco_swarm.node.config import NodeConfig
from diloco_swarm.node.evaluation import Evaluation
from diloco_swarm.node.errors import Diverged, NodeError  # noqa: F401  (re-exported: cli maps NodeError to exit 2)
from diloco_swarm.node.housekeeping import Housekeeping
from diloco_swarm.node.invitation import OurPass
from diloco_swarm.node.global_state import GlobalState, ThetaHistory
from diloco_swarm.node.mixing import ThetaMixer
from diloco_swarm.node.outer_sync import Carried, Handoff, OuterSync, Preview, RoundOutcome
from diloco_swarm.node.pause import PauseWatch
from diloco_swarm.node.report import MetricsWriter, StatusLine, round_fields
from diloco_swarm.node.round import Round
from diloco_swarm.node.signals import StopFlag
from diloco_swarm.node.sit_out import SitOut
from diloco_swarm.node.startup import Startup, autocast, device_and_precision
from diloco_swarm.node.statesync import StateSync
from diloco_swarm.node.stats import NodeStats
from diloco_swarm.node.swarm_view import SwarmView
from diloco_swarm.node.watchdog import PartLost, Supervisor
from diloco_swarm.utils import clock
from diloco_swarm.utils.malloc import return_freed_memory

WARMUP_INNER_STEPS = 50  # linear inner-LR warm-up over the swarm's first 50 inner steps
MAX_PHASE_BATCHES = 1 << 40  # the batch stream of a phase is open-ended: the loop decides where the phase ends
ROUND_GIVE_UP_S = 15.0  # a round given up gets this long to end
ROUND_WAIT_POLL_S = 0.5  # a training thread waiting for a round looks at the stop flag this often
SWARM_REFRESH_S = 5.0  # a phase planned before we knew our speed re-reads the swarm's records this often
GRID_DIMS_GUESS = 3  # with --target-group-size set, keep mixing references for a grid this deep until one is planned


class Node(Startup):
    """One DiLoCo peer. Build with a :class:`NodeConfig`, then :meth:`run`."""

    def __init__(self, config: NodeConfig, status: StatusLine | None = None):
        return_freed_memory()  # before any model-sized buffer (utils/malloc.py)
        self.cfg = config
        self.spec = config.spec
        self.status = status or StatusLine()
        self.stop = StopFlag(self.status)
        # (a round that has already ended is still applied: only one still running is dropped)
        self.stop.round_in_flight = lambda: self.sync is not None and self.sync.in_flight and not self.sync.done()
        self.stats = NodeStats()
        self.our_pass = OurPass(config.invitation, self.status.log)
        self.dht = None
        self.averager = None
        self.lock = None
        try:
            self.metrics = MetricsWriter(config.metrics_file)
        except OSError as e:  # a folder, or a path that cannot be written
            reason = e.strerror or str(e)
            raise NodeError(f"--metrics-file {config.metrics_file}: {reason[:1].lower()}{reason[1:]}") from None
        self.records = None
        self.client_mode = config.client_mode  # may switch on at start when we are unreachable
        self.reachability = "client" if config.client_mode else "unverified"  # public | unverified | client
        self.maddrs: list[str] = []  # where others can dial us (empty until the DHT runs)
        self._state_lock = threading.Lock()  # θ_global is read by the donation thread (GlobalState.lock)
        self.state: GlobalState | None = None  # θ_global, its momentum and outer step (node/global_state.py), built at start
        self.state_sync: StateSync | None = None  # join sync, reconcile, the end of a run (node/statesync.py), built at start
        self.mixer: ThetaMixer | None = None  # θ-mixing (node/mixing.py), built at start
        self.sync: OuterSync | None = None
        self.feedback = None  # node.feedback.ErrorFeedback of a sparse --compression, built at start
        self.checkpoints = CheckpointWriter(config.state_dir, state=self._checkpoint_state, lock=self._state_lock,
                                            metrics=self.metrics, log=self.status.log, stop=self.stop)
        self.swarm = SwarmView()  # the others as their records say (node/swarm_view.py)
        self.supervisor = Supervisor(self.stop, self.status.log)  # exit 3 when the DHT or averager dies (node/watchdog.py)
        self.housekeeping = Housekeeping(stats=self.stats, swarm=self.swarm, log=self.status.log, stop=self.stop.event)
        self.round: Round | None = None  # the averaging thread's side of the outer step (node/round.py), built at start
        # earlier θ_global states: θ-mixing references (node/global_state.py); a set group size plans a grid from the start
        self._history_floor = history_length(GRID_DIMS_GUESS) if config.target_group_size else 1
        self.history = ThetaHistory(self._history_floor)
        self.evaluate = Evaluation(config.eval_budget, self.stats)  # held-out loss of θ_global (node/evaluation.py)
        self._carried: Carried | None = None  # late rounds whose Δ θ_local still holds (outer_sync.hold)
        self._last_phase_index = -1  # data and LR warm-up index of the last phase (a late round repeats no data)
        self._preview = Preview()  # of the round in flight: its average taken into θ_local as it arrives
        # `diloco-node pause`, --active-hours (node/pause.py decides, node/sit_out.py carries it out)
        self.sit_out = SitOut(PauseWatch(config.state_dir, config.active_hours), stats=self.stats, stop=self.stop,
                              housekeeping=self.housekeeping, metrics=self.metrics,
                              finish_round=lambda: not self.sync.in_flight or self._finish_round_in_flight(),
                              resume=self._resume_from_pause, show=self._status, say=self.status.log,
                              whoami=lambda: (self.peer_id, self.outer_step))
        self._unsent_tokens = 0  # tokens of a phase cut short by a pause: θ_local keeps its steps for the next hand-off

    def run(self) -> None:
        """Set up, train until ``max_outer_steps`` or a stop signal, then leave cleanly.

        Each iteration is one DiLoCo outer step (arXiv 2311.08105, Algorithm 1): an inner phase,
        then Δ goes to the averaging (:meth:`Round.run`, node/round.py). In overlap mode the round
        runs on the averaging thread during the next inner phase and is applied between two inner
        steps (:meth:`_apply_round`, node/outer_sync.py).

        :raises NodeError, CheckpointError, SwarmError, SpecMismatch, DatasetError: user-facing problems.
        :raises PartLost: the DHT, the averager or p2pd died under the node (node/watchdog.py).
        """
        self.stop.install()
        self.stats.started = time.monotonic()
        try:
            if not self._start():
                return
            trained = False
            while not self.stop.requested:
                if self._reached_max_outer_steps():
                    if not self.sync.in_flight:
                        if trained:  # (reached before any training: _start said so)
                            self.status.log(f"outer step {self.outer_step} has reached --max-outer-steps "
                                            f"{self.cfg.max_outer_steps}; leaving")
                        if trained and self._ended_alone and self.swarm.recent_peers:
                            self.status.log(
                                f"warning: the last round of this node ran alone (no other peer of run "
                                f"'{self.spec.run_id}' was online), but it saw {len(self.swarm.recent_peers)} other peer(s) "
                                "in the last 2 minutes: they may have ended on another θ_global (compare theta_digest "
                                "in the metrics files). The others wait at the end for a peer behind only while its process answers")
                        # peers late for the last round, or on another θ_global, take ours
                        self.state_sync.end_on_one_model(in_grid=self._ended_in_grid)
                        break
                    self._apply_round(wait=True)  # the last round: nothing left to overlap it with
                    continue
                paused = self.sit_out.now()
                if paused is not None:
                    self.sit_out(paused)
                    continue
                handoff = self._inner_phase()
                trained = True
                if handoff is None:
                    continue  # stop requested mid-phase, or a state adopted in it reached --max-outer-steps
                self._hand_off(handoff)
                if not self.sync.overlap:
                    self._apply_round(wait=True)
            self._leave()
        except ChildUnavailable as e:  # a DHT/averager call failed: a part died or hangs (dht/calls.py)
            if self.stop.requested and self.supervisor.lost is None:  # a signal to our process group ended it too
                self.metrics.write({"event": "stop", "peer_id": self.peer_id, "outer_step": self.outer_step,
                                    "graceful": True, "goodput": round(self.stats.goodput(), 4)})
            else:
                self.supervisor.lost = self.supervisor.lost or str(e)
        finally:
            self._shutdown()
        if self.supervisor.lost is not None:
            raise PartLost(f"{self.supervisor.lost} (outer step {self.outer_step}); this node stopped. Its checkpoint is "
                           "kept: restart it with the same --state-dir to rejoin")

    def _reached_max_outer_steps(self) -> bool:
        limit = self.cfg.max_outer_steps
        return 0 < limit <= self.outer_step + int(self.sync.in_flight)

    def _inner_phase(self) -> Handoff | None:
        """One inner phase: DyLU-sized, extended while the previous round is still in flight.

        A round that finishes during the phase is applied between two inner steps. A round still
        running when the phase has its steps does not stop training: the phase goes on, up to DyLU's
        2H (``node/dylu.py``; Δ, and with it the outer step, grows with the steps behind it), and then
        waits for the round, which its own time bounds end (the averaging window, then the all-reduce
        and confirmation timeouts). Past those bounds plus a margin the round is given up.
        :returns: the phase's hand-off, or None when a stop was requested or a round applied during the
            phase reached ``--max-outer-steps`` (its steps are dropped).
        :raises Diverged: the pseudo-gradient is not finite.
        :raises NodeError: the averaging thread did not end a round long after its time bounds.
        """
        spec = self.spec
        target = self.phases.steps(self.stats.inner_step_s, self.swarm.inner_step_s)  # DyLU
        measured = bool(self.stats.inner_step_s)  # False in our first phase: planned H, re-planned once timed
        # data and LR warm-up follow the swarm's progress (outer step × H): a joiner synced to step t
        # must not take tiny steps, or its own Δ-based norm bounds would reject every honest part
        phase_index = max(self.outer_step + int(self.sync.in_flight), self._last_phase_index + 1)
        self._last_phase_index = phase_index
        # when we expect to hand this phase off: a round's leader waits for peers about to arrive
        # (the record publisher sends it within its 5 s period: no extra DHT store per phase). Not timed
        # yet: "due now", published at once (0 says "starting up"), re-planned from the first steps
        self.stats.phase_eta = clock.now() + target * (self.stats.inner_step_s or 0.0)
        self.model.train()
        losses, tokens, steps = [], 0, 0
        t_last, t_refresh = time.monotonic(), float("-inf")  # (an unmeasured phase reads the swarm at its first tick)
        if not measured:
            self.housekeeping.publish_soon()  # "training now": a running swarm waits for us
        inner_before, tokens_window = self.stats.inner_s, 0
        for i, (x, y) in enumerate(self.sampler.batches_for_outer_step(phase_index, MAX_PHASE_BATCHES)):
            if self.stop.requested:
                self.stats.wasted_inner_s += self.stats.inner_s - inner_before
                return None
            if self.sit_out.now() is not None:  # θ_local keeps the steps so far: the next hand-off carries them
                self._unsent_tokens += tokens
                return None
            t0 = time.monotonic()
            lr_scale = min(1.0, (phase_index * spec.inner_steps + i + 1) / WARMUP_INNER_STEPS)
            for group in self.inner_opt.param_groups:
                group["lr"] = spec.inner_lr * lr_scale
            loss = self._inner_step(x, y)
            steps, tokens, tokens_window = steps + 1, tokens + x.numel(), tokens_window + x.numel()
            losses.append(loss)
            self.stats.inner_s += time.monotonic() - t0
            if self.sync.in_flight and not self.sync.done():
                self._preview_arrived()
            # a round that has ended waits while a donation streams our θ_global, until the phase has
            # its steps: applying it would first have the averager process copy the state (donation.py)
            if self.sync.done() and (steps >= target or not self.averager.donating()):
                syncs = self.stats.state_syncs
                self._apply_round(during_inner_step=steps)
                if self._reached_max_outer_steps():
                    break  # a state adopted with the round is at our planned end: nothing more to hand off
                if self.stats.state_syncs != syncs:
                    # θ_local moved onto an adopted state with its progress: the phase now ends when the
                    # swarm's does (a full phase more would make us late for every round after)
                    ahead = self.phases.steps_to(self.swarm.phase_eta, self.stats.inner_step_s, clock.now())
                    if ahead is not None:
                        target = self.phases.within(steps + ahead)
            now = time.monotonic()
            if not measured and now - t_last >= 1.0 and losses:
                target, self.stats.phase_eta = self.phases.replan_first(
                    steps, self.stats.inner_s - inner_before, swarm_eta=self.swarm.phase_eta,
                    swarm_s=self.swarm.inner_step_s, now=clock.now())  # published with our record
                if now - t_refresh >= SWARM_REFRESH_S:  # the others' speeds and hand-off times, for the next re-plan
                    t_refresh = now
                    self.housekeeping.upkeep_soon()
            if now - t_last >= 1.0 and losses:  # (empty right after a restarted phase)
                self._status(inner_step=steps, phase_steps=target, loss=sum(losses[-20:]) / len(losses[-20:]),
                             tokens_per_s=tokens_window / max(now - t_last, 1e-9))
                t_last, tokens_window = now, 0
            if steps >= target:
                if not self.sync.in_flight:
                    break
                if self.sync.overdue(self.round_deadline_s):
                    self._give_up_round()
                    break
                if steps >= self.phases.max_steps:
                    # Δ grows with the steps behind it, and so does the outer step: beyond DyLU's range
                    # an ever longer phase would make it ever larger. Wait for the round instead.
                    if not self._finish_round_in_flight():
                        self.stats.wasted_inner_s += self.stats.inner_s - inner_before
                        return None
                    break
        inner_s = self.stats.inner_s - inner_before
        if self._reached_max_outer_steps():
            # A round applied in this phase brought a state at or past --max-outer-steps (a peer behind the
            # swarm at its end). Handing this phase off would average a round past the end (seen in `bench
            # scale`: two peers reached outer step 11 of 10, and a third downloaded it).
            self.stats.wasted_inner_s += inner_s
            return None
        self.stats.inner_step_s = inner_s / steps
        self.stats.tokens_per_s = tokens / max(inner_s, 1e-9)
        self._status(inner_step=steps, phase_steps=target, loss=sum(losses[-20:]) / len(losses[-20:]),
                     tokens_per_s=self.stats.tokens_per_s)
        return self._phase_handoff(tokens=tokens, steps=steps, inner_s=inner_s, loss=sum(losses) / len(losses))

    def _phase_handoff(self, *, tokens: int, steps: int, inner_s: float, loss: float) -> Handoff:
        """Δ = θ_global − θ_local of the phase that just ended, with the late rounds it carries.
        :raises Diverged: the pseudo-gradient is not finite."""
        delta = self.state.outer.pseudo_gradient(self.params)
        if finite_norm(delta) is None:
            raise Diverged(
                f"training diverged at outer step {self.outer_step}: the pseudo-gradient has non-finite "
                f"values; the last good checkpoint is kept. If it happens again after a restart, the run's "
                f"--inner-lr or --outer-lr is too high for this model: start a new run (another --run-id) with "
                f"lower ones"
            )
        carried, self._carried = self._carried, None  # Δ already holds it: θ_local kept the late rounds' work
        tokens, self._unsent_tokens = tokens + self._unsent_tokens, 0  # (a phase cut short by a pause)
        return Handoff(delta=delta, tokens=tokens + (carried.tokens if carried else 0), inner_steps=steps,
                       inner_s=inner_s, loss=loss, outer_step=self.outer_step, restarted_below=self.state.restarted_below,
                       theta_digest=self.state.digest(), marks=self.state.reference_marks(), started=time.monotonic(),
                       carried=carried)

    def _inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on one batch ([B, T] int64 inputs and targets); returns its loss (nats/token)."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.device):
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.inner_opt.step()
        # grads live from backward to the step only: a round applied, an evaluation or a state
        # adopted between two inner steps finds their memory free (the budget, docs/architecture.md)
        self.inner_opt.zero_grad(set_to_none=True)
        self.stats.inner_steps_total += 1
        return loss.item()

    def _resume_from_pause(self) -> None:
        if self.state_sync.resume():  # the swarm moved on: θ_local now starts at its state
            self._carried, self._unsent_tokens = None, 0

    def _finish_round_in_flight(self) -> bool:
        """Wait for the round in flight and apply it (giving it up past its time bounds).
        :returns: False when a stop was requested meanwhile (the round stays in flight for the leave)."""
        self._status(force=True, waiting=True)
        try:
            while self.sync.in_flight and not self.sync.overdue(self.round_deadline_s):
                if self.stop.requested:
                    return False
                with contextlib.suppress(TimeoutError):
                    self._apply_round(wait=True, timeout=ROUND_WAIT_POLL_S)
                    return True
            if self.sync.in_flight:
                self._give_up_round()
            return True
        finally:
            self.stats.live["waiting"] = False

    def _give_up_round(self) -> None:
        """The round in flight outlived its own time bounds: stop looking for a group and apply
        what it has within seconds; a round that still does not end stops the node."""
        self.sync.give_up_matchmaking()
        try:
            self._apply_round(wait=True, timeout=ROUND_GIVE_UP_S)
        except TimeoutError:
            raise NodeError(f"the averaging round of outer step {self.outer_step} did not end within "
                            f"{self.round_deadline_s + ROUND_GIVE_UP_S:.0f}s of its start; the averager is stuck. "
                            "The last checkpoint is kept; restart the node") from None

    def _hand_off(self, handoff: Handoff) -> None:
        """Give Δ to the averaging thread; in overlap mode θ_local jumps to the eager estimate."""
        self.metrics.write({"event": "averaging_start", "peer_id": self.peer_id, "outer_step": handoff.outer_step,
                            "inner_steps": handoff.inner_steps})
        self._status()
        self._preview = Preview(token=self.averager.begin_arrivals() if self.sync.overlap else 0)
        self.sync.hand_off(handoff)

    def _preview_arrived(self) -> None:
        """Overlap: θ_local takes each tensor of the round's average as soon as the all-gather has
        delivered it, before the round is verified (``OuterSync.correct``: the verified apply, a late
        round's hold and an adopted state stay exact)."""
        preview = self._preview
        if not preview.token:
            return
        current, n = self.averager.arrived()
        while current == preview.token and preview.read < n:
            value = self.averager.peek(preview.read, preview.token)
            if value is None:  # the buffers moved on to another round
                break
            if self.sync.preview_part(preview.read, value):
                preview.moved += 1
                preview.first_at = preview.first_at or time.monotonic()
            preview.read += 1

    @property
    def outer_step(self) -> int:
        """The outer step θ_global is at (0 until the training state is built)."""
        return self.state.step if self.state is not None else 0

    def _state_for_donation(self):
        """The averager's ``state_provider``: the live state it streams to a joiner (``GlobalState.for_donation``).
        :raises RuntimeError: the training state is not built yet (start-up): the asker tries another donor."""
        if self.state is None:
            raise RuntimeError("this peer is still starting up")
        return self.state.for_donation(self.spec.spec_hash(), self.peer_id)

    def _round_metadata(self, handoff: Handoff) -> dict[str, Any]:  # (tests/faults.py forges it here)
        return handoff.round_metadata(self.spec.spec_hash())

    def _donor_priority(self) -> float:  # among state donors (hivemind's state_sharing_priority): our standing
        return float(self.state.standing if self.state is not None else 0)

    def _apply_round(self, wait: bool = False, timeout: float | None = None,
                     during_inner_step: int | None = None) -> None:
        """Apply the finished round (waiting for it at most ``timeout`` s when ``wait``): the outer
        step on θ_global, or the adoption of a canonical state; then the checkpoint, evaluation and
        reports. :raises TimeoutError: the round is still running (it stays in flight)."""
        t0 = time.monotonic()
        try:
            handoff, outcome, estimate = self.sync.take(timeout=timeout if wait else 0)
        finally:
            self.stats.averaging_s += time.monotonic() - t0  # time the training thread waited for the round
        self.stats.count_round(outcome.result, mixing=outcome.mixing, me=self.peer_id)
        self._ended_alone = outcome.alone and outcome.state is None and outcome.mixed is None
        self._ended_in_grid = bool(outcome.group_key)  # groups smaller than the swarm: lineages by design
        round_step = handoff.outer_step + 1
        decision = policy.settle(outcome, handoff.carried.rounds if handoff.carried else 0)
        match decision:
            case policy.AdoptMixed():  # the members started from different θ_global and mixed them
                self.mixer.adopt(outcome.mixed, handoff, estimate, self.sync)
            case policy.AdoptState(carry=carry, wasted=wasted):  # the canonical θ_global of the group or swarm
                self.state_sync.adopt(outcome.state, handoff=handoff, estimate=estimate, carry=carry)
                if wasted:
                    self.stats.wasted_inner_s += handoff.work_s  # replaced by a state that may not include it
            case policy.Apply():  # a verified average, or our own Δ
                with self.state.moving_to(self.outer_step + 1):
                    self.sync.apply(outcome.average, estimate)
            case policy.Hold():  # late: θ_global stays, θ_local keeps Δ for the next round
                with self.state.lock:
                    self.sync.hold(handoff.delta, estimate)
                round_step = self.outer_step
        if self.feedback is not None:  # a sparse mode: what the round sent of Δ + e leaves the residual (or not)
            with self.state.lock:
                self.feedback.settle(policy.feedback_action(decision, outcome), handoff.delta, outcome.selection)
        if decision.carry:
            self._carried = Carried.of(handoff)
            self.stats.late_rounds += 1
        else:
            self.stats.tokens_total += handoff.tokens
        self._after_round(handoff, outcome, round_step, during_inner_step, late=decision.carry)

    def _after_round(self, handoff: Handoff, outcome: RoundOutcome, round_step: int, during_inner_step: int | None,
                     late: bool = False) -> None:
        """Checkpoint (written on the checkpoint thread), evaluation within its time budget, the
        metrics record and the status line; DHT upkeep on the housekeeping thread."""
        if not self.client_mode:
            self.averager.state_sharing_priority = self._donor_priority()
        try:
            self.evaluate(self.state.theta, self.outer_step, force=0 < self.cfg.max_outer_steps <= self.outer_step)
        finally:  # after the evaluation, so the checkpoint's eval curve holds it; whatever the evaluation did
            self.checkpoints.write_in_background()
        self.metrics.write({**self._round_record(handoff, outcome, round_step),
                            "applied_at_inner_step": during_inner_step, "late": late})
        self.housekeeping.upkeep_soon()
        self.stats.live["waiting"] = False  # the round is applied: the line must not say we wait for it
        self._status(force=True)
        for peer, why in outcome.result.rejected_peers.items():
            self.status.log(f"outer step {self.outer_step}: peer {peer} was left out of the round: {why}")
        if outcome.result.outlier_peers:
            self.status.log(f"outer step {self.outer_step}: " + "; ".join(
                f"peer {peer} sent an outlier Δ, left out of {share:.0%} of our slice"
                for peer, share in outcome.result.outlier_peers.items()))

    def _round_record(self, handoff: Handoff, outcome: RoundOutcome, round_step: int) -> dict[str, Any]:
        """The ``outer_step`` metrics record (docs/metrics.md): the round's fields, and where θ_global stands
        (``synced_to``: a state adopted with the round moved it off ``round_step``, what the round produced)."""
        return {"event": "outer_step", "outer_step": self.outer_step, "restarted_below": self.state.restarted_below,
                "synced_to": self.outer_step if self.outer_step != round_step else None, "peer_id": self.peer_id,
                "sync_mode": self.spec.sync_mode, "compression": self.spec.compression,
                **round_fields(handoff, outcome, self._preview), "eval_loss": self.stats.eval_loss,
                "eval_outer_step": self.stats.eval_outer_step, "reachability": self.reachability,
                "theta_digest": self.state.digest(), **self.stats.totals()}

    def _evaluate_now(self) -> None:
        """Held-out loss of θ_global now (at the start, after a state adopted at the end): an event, a line."""
        self.evaluate(self.state.theta, self.outer_step, force=True)
        self.metrics.write({"event": "eval", "peer_id": self.peer_id, "outer_step": self.outer_step,
                            "eval_loss": self.stats.eval_loss})
        self.status.log(f"held-out loss at outer step {self.outer_step}: {self.stats.eval_loss:.4f}")

    def _checkpoint_state(self) -> dict[str, Any]:
        """What the checkpoint holds (node/checkpoint.py, format 2): the live tensors of θ_global and the
        outer momentum, not copies; hold the state lock while they are used. The inner optimizer's
        moments are not kept (docs/operations.md: what a resume loses)."""
        return {"spec": self.spec.model_dump(), "spec_hash": self.spec.spec_hash(), "peer_id": self.peer_id,
                "outer_step": self.outer_step, "restarted_below": self.state.restarted_below,
                "inner_steps_total": self.stats.inner_steps_total, "tokens_total": self.stats.tokens_total,
                "outer": self.state.outer.state_dict(),  # a sparse mode's residual too (node/feedback.py)
                "ledger": self.stats.ledger_state(),  # our rounds, our partners', our last leaderboard (dht/ledger.py)
                "eval_curve": self.stats.eval_curve,  # held-out loss by outer step, for export's model card
                **({"feedback": self.feedback.residual} if self.feedback is not None else {})}

    def _record_snapshot(self) -> dict[str, Any]:
        """This peer's public record (dht/records.py), read by `status` and the dashboard."""
        device, precision = device_and_precision(self.device)
        return {
            "peer_id": self.peer_id,
            "name": self.cfg.name,
            "version": __version__,
            "device": device,
            "precision": precision,
            "reachability": self.reachability,
            "outer_step": self.outer_step,
            "restarted_below": self.state.restarted_below if self.state is not None else 0,
            "maddrs": [] if self.client_mode else self.maddrs,  # a client cannot be dialed
            **self.stats.peer_record(),
            "admission": self.our_pass(self.peer_id),  # a private run's pass (node/invitation.py); None in a public one
        }

    def _status(self, force: bool = False, **live) -> None:
        """Update the status line; ``live`` fields (inner_step, phase_steps, loss, tokens_per_s) describe the running phase."""
        self.stats.live.update(live)
        self.status.update(self.stats.status(outer_step=self.outer_step, inner_steps=self.spec.inner_steps,
                                             reachability=self.reachability), force=force)

    _ended_alone = False  # the last round applied was our own Δ alone (nobody online): said at the planned end
    _ended_in_grid = False  # the last round applied was planned in groups smaller than the swarm (a grid)
    _redial_known: list[str] = []  # the peers a restarted node knew, when it started a new swarm (startup.py)
