"""The DiLoCo loop of one node (Douillard et al., arXiv 2311.08105, Algorithm 1), overlapped.

    for each outer step t:
        an inner phase of AdamW steps on local data (H, sized by DyLU)       θ_local
        hand-off: Δ_t = θ_global − θ_local to the averaging thread            (fp32, CPU)
                  θ_local ← OuterStep(θ_global, Δ_t)   (overlap: our Δ stands in for the average)
        ... the next inner phase runs while the group averages Δ_t (int8, verified) ...
        apply:    θ_global ← OuterStep(θ_global, Δ̄_t); θ_local moves along (node/outer_sync.py)
                  (late: no verified group while others are online: θ_global stays, Δ_t is carried)
                  checkpoint (its own thread), evaluation, metrics, peer record (housekeeping thread)

``--sync-mode blocking`` waits for each round instead. Start-up lives in node/startup.py, state
sync in node/statesync.py, the counters behind every report in node/stats.py.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable, Sequence

import torch

from diloco_swarm import __version__
from diloco_swarm.data import evaluate
from diloco_swarm.models import with_parameters
from diloco_swarm.node.checkpoint import save_checkpoint
from diloco_swarm.node.config import NodeConfig
from diloco_swarm.node.errors import Diverged, NodeError  # noqa: F401  (re-exported: cli maps NodeError to exit 2)
from diloco_swarm.node.mixing import Mixing, ThetaHistory
from diloco_swarm.node.outer_sync import Carried, Handoff, OuterSync, Preview, RoundControl, RoundOutcome
from diloco_swarm.node.report import MetricsWriter, StatusLine
from diloco_swarm.averaging.allreduce import finite_norm
from diloco_swarm.averaging.mixing import group_bits, history_length
from diloco_swarm.averaging.confirm import DIGEST_WAIT_S
from diloco_swarm.node.startup import Startup
from diloco_swarm.node.stats import NodeStats
from diloco_swarm.node.redial import REDIAL_EVERY_S, Redialer, dial_peers, gone_peers, reconnect_peers
from diloco_swarm.node.statesync import StateSync, theta_digest
from diloco_swarm.utils.hivemind_fixes import remove_socket_dir
from diloco_swarm.utils.malloc import return_freed_memory
from diloco_swarm.utils.worker import Worker

WARMUP_INNER_STEPS = 50  # linear inner-LR warm-up over the swarm's first 50 inner steps
REBOOTSTRAP_EVERY_S = 30.0  # a client alone re-dials its --initial-peers this often
CHECKPOINT_WRITE_TIMEOUT_S = 30.0  # a graceful leave waits this long for the last checkpoint write
MAX_PHASE_BATCHES = 1 << 40  # the batch stream of a phase is open-ended: the loop decides where the phase ends
ROUND_GIVE_UP_S = 15.0  # a round given up gets this long to end
ROUND_WAIT_POLL_S = 0.5  # a training thread waiting for a round looks at the stop flag this often
ALIGN_SLACK_S = 1.0  # a round waits this long past the last expected member's hand-off
SWARM_REFRESH_S = 5.0  # a phase planned before we knew our speed re-reads the swarm's records this often
MAX_CARRIED_ROUNDS = 2  # a peer late this many rounds in a row applies its carried Δ alone (bounded staleness)
GRID_DIMS_GUESS = 3  # with --target-group-size set, keep mixing references for a grid this deep until one is planned
SILENT_RECORDS = 2  # a peer whose record missed this many re-signing periods (as we read it) crashed
MOVED_ON_READ_EVERY_S = 2.0  # a late round reads the records this often to see whether its group ran without it
AHEAD_READ_EVERY_S = 1.0  # a grid round ahead of the swarm reads the records this often to see it catch up
GRID_MEMORY_S = 20.0  # a peer whose record a read missed stays in the round's grid this long (a partial read under load)
HEARD_MEMORY_S = 120.0  # how long we remember when a peer's record last changed


def seconds_to_handoff(phase_eta: float, now: float, *, silent_s: float, max_silent_s: float,
                       first_round: bool = False) -> float:
    """A peer's ETA for ``grouping.plan_round`` from its record: seconds until it hands off its phase
    (``phase_eta``, unix s; ≤ 0: it has), or ``inf``, not coming this round:

    - it is starting up (``phase_eta`` 0: no inner phase yet), unless ``first_round`` (our own first
      round since we started): peers that start together (``--wait-for-peers``) then meet in one
      group, while a running swarm does not wait for a restarted peer's imports and state download;
    - its record has not changed for ``silent_s`` > ``max_silent_s`` seconds, as we saw it (our clock,
      not the peer's): a live peer re-signs it every few seconds (dht/records.py), so it crashed, and
      its record outlives it by the DHT's TTL.

    A round that counted such a peer as due waited out its whole alignment slack, every round, for a
    member that could not come (``bench.churn``: the survivors' rounds took 4 s instead of 0.3–0.6 s)."""
    if (phase_eta <= 0.0 and not first_round) or silent_s > max_silent_s:
        return math.inf
    return phase_eta - now if phase_eta > 0.0 else 0.0


class StopFlag:
    """First SIGINT/SIGTERM asks for a graceful stop; a second one exits at once."""

    def __init__(self, status: StatusLine):
        self.event = threading.Event()
        self.status = status
        self.training = False  # set once set-up is done
        self.has_checkpoint = False  # set once a checkpoint is on disk or being written
        self.checkpoint_problem: str | None = None  # why the newest checkpoint write failed (None: it did not)
        self.round_in_flight: Callable[[], bool] = lambda: False  # set by the node

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGHUP, self._handle)  # a closed terminal or ssh session: stop cleanly too

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            for child in mp.active_children():
                with contextlib.suppress(Exception):
                    child.kill()
            remove_socket_dir()  # os._exit skips atexit
            os._exit(130)
        self.event.set()
        dropped = ", the round in flight is dropped" if self.round_in_flight() else ""
        if self.training and self.checkpoint_problem:
            self.status.log(f"stopping: {self.checkpoint_problem}{dropped} (press Ctrl+C again to quit at once)")
        elif self.training and self.has_checkpoint:
            self.status.log(f"stopping: the last checkpoint is kept{dropped} (press Ctrl+C again to quit at once)")
        elif self.training:
            self.status.log("stopping: no outer step applied yet, so there is no checkpoint to keep "
                            "(press Ctrl+C again to quit at once)")
        else:
            self.status.log("stopping: leaving before training starts (press Ctrl+C again to quit at once)")

    @property
    def requested(self) -> bool:
        return self.event.is_set()

class Node(Startup, StateSync, Mixing):
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
        self._warned_no_public = False
        self.maddrs: list[str] = []  # where others can dial us (empty until the DHT runs)
        self._last_rebootstrap = 0.0
        self._state_lock = threading.Lock()  # θ_global is read by the donation thread
        self.sync: OuterSync | None = None
        self._housekeeping = Worker("housekeeping")  # DHT upkeep: records, run spec, the swarm's records
        self._checkpoints = Worker("checkpoint")  # writes, in order; never queued behind a slow DHT call
        self._reconnect = Worker("reconnect")  # ReconnectPeers passes (node/redial.py); dials take seconds
        self._last_checkpoint = None  # future of the newest checkpoint write
        self._checkpoint_on_disk: int | None = None  # outer step of the newest checkpoint written (None: none yet)
        self._checkpoint_failure: str | None = None  # why the last write failed (said once per reason)
        self.swarm_inner_step_s: float | None = None  # the online peers' median (DyLU)
        self.swarm_phase_eta: float | None = None  # the other online peers' median phase_eta (unix time)
        self._digest_cache: tuple[int, str] | None = None  # (θ_global's write generation, digest)
        # earlier θ_global states: θ-mixing references (node/mixing.py); a set group size plans a grid from the start
        self._history_floor = history_length(GRID_DIMS_GUESS) if config.target_group_size else 1
        self._grid_records: dict[str, tuple[float, Any]] = {}  # peer id -> (time.monotonic() seen, its record)
        self._heard: dict[str, tuple[float, float]] = {}  # peer id -> (its record's `updated`, time.monotonic() we first read it)
        self._recent_peers: dict[str, tuple[float, list[str]]] = {}  # full peer id -> (time.monotonic() read, its maddrs)
        self._last_reconnect = 0.0  # time.monotonic() of the last ReconnectPeers pass
        self._reconnecting = None  # its future: one pass at a time
        self._moved_on_read: tuple[float, dict[str, Any]] = (float("-inf"), {})  # (time.monotonic(), records) of _moved_on
        self._unreachable_said = 0  # peers the last ReconnectPeers pass could not reach, as last logged
        self.history = ThetaHistory(self._history_floor)
        self._last_eval_s = 0.0  # seconds the last held-out evaluation took (prices the next one)
        self._carried: Carried | None = None  # late rounds whose Δ θ_local still holds (outer_sync.hold)
        self._last_phase_index = -1  # data and LR warm-up index of the last phase (a late round repeats no data)
        self._preview = Preview()  # of the round in flight: its average taken into θ_local as it arrives

    def run(self) -> None:
        """Set up, train until ``max_outer_steps`` or a stop signal, then leave cleanly.

        Each iteration is one DiLoCo outer step (arXiv 2311.08105, Algorithm 1): an inner phase,
        then Δ goes to the averaging. In overlap mode the round runs on the averaging thread
        during the next inner phase and is applied between two inner steps (node/outer_sync.py).

        :raises NodeError, CheckpointError, SwarmError, SpecMismatch, DatasetError: user-facing problems.
        :raises PartLost: the DHT, the averager or p2pd died under the node (node/watchdog.py).
        """
        from diloco_swarm.dht.calls import ChildUnavailable
        from diloco_swarm.node.watchdog import PartLost

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
                        if trained and self._ended_alone and self._recent_peers:
                            self.status.log(
                                f"warning: the last round of this node ran alone (no other peer of run "
                                f"'{self.spec.run_id}' was online), but it saw {len(self._recent_peers)} other peer(s) "
                                "in the last 2 minutes: they may have ended on another θ_global (compare theta_digest "
                                "in the metrics files). The others wait at the end for a peer behind only while its process answers")
                        self._end_on_one_model()  # peers late for the last round, or on another θ_global, take ours
                        break
                    self._apply_round(wait=True)  # the last round: nothing left to overlap it with
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
            if self.stop.requested and self.lost is None:  # a signal to our process group ended it too
                self.metrics.write({"event": "stop", "peer_id": self.peer_id, "outer_step": self.outer_step,
                                    "graceful": True, "goodput": round(self.stats.goodput(), 4)})
            else:
                self.lost = self.lost or str(e)
        finally:
            self._shutdown()
        if self.lost is not None:
            raise PartLost(f"{self.lost} (outer step {self.outer_step}); this node stopped. Its checkpoint is "
                           "kept: restart it with the same --state-dir to rejoin")

    def _start(self) -> bool:
        """Set-up, the optional start barrier, join sync and the first evaluation.
        :returns: False when a stop came during start-up (nothing was trained)."""
        from diloco_swarm.dht.calls import ChildUnavailable
        from diloco_swarm.dht.swarm import SwarmError

        try:
            self._setup()
        except (SwarmError, ChildUnavailable):
            if self.stop.requested:  # Ctrl+C while starting: leave quietly, nothing was trained
                self.status.log("stopped during start-up")
                return False
            raise
        if self.stop.requested:  # a stop during the (long) set-up: nothing trained, nothing to save
            self.status.log("stopped during start-up")
            return False
        self._supervise()
        self.stop.training = True
        self._wait_for_peers()
        self._join_sync()
        if self.stop.requested:
            return True  # the loop does not start; the leave writes the stop event
        self._evaluate_now()
        if self._reached_max_outer_steps():
            self.status.log(f"outer step {self.outer_step} has reached --max-outer-steps {self.cfg.max_outer_steps}; "
                            "nothing to train (the limit is the swarm's absolute outer step)")
        return True

    def _reached_max_outer_steps(self) -> bool:
        limit = self.cfg.max_outer_steps
        return 0 < limit <= self.outer_step + int(self.sync.in_flight)

    def _phase_steps(self) -> int:
        """Inner steps of the next phase: Dynamic Local Updates (DyLU, Liu et al., arXiv 2401.09135).

        A peer does H × (the swarm's median seconds per inner step ÷ its own), within
        [``min_inner_steps``, ``max_inner_steps``], so fast and slow peers finish their phases together.
        Token-weighted averaging weights their Δ by the tokens they trained. Alone, or before the
        first measurements, it is H.
        """
        H = self.spec.inner_steps
        mine, swarm = self.stats.inner_step_s, self.swarm_inner_step_s
        if not mine or not swarm:
            return H
        return self._within_dylu_range(round(H * swarm / mine))

    def _within_dylu_range(self, steps: int) -> int:
        return max(self.min_inner_steps, min(self.max_inner_steps, steps))

    def _steps_to_swarm_handoff(self, step_s: float | None) -> int | None:
        """Inner steps of ``step_s`` seconds until the other online peers' median ``phase_eta``
        (≤ 0 once it has passed); None when either is unknown."""
        if not self.swarm_phase_eta or not step_s:
            return None
        return round((self.swarm_phase_eta - time.time()) / step_s)

    def _replan_first_phase(self, steps: int, inner_s: float) -> int:
        """The target of a phase planned (H steps) before this peer had timed an inner step, once
        ``steps`` took ``inner_s`` seconds: end at the swarm's next hand-off when the others published
        one still ahead, else DyLU's H × swarm ÷ ours, else H; within the DyLU range, never below
        ``steps`` (= end now). A slow newcomer is then not a whole slow phase late for its first round.
        Also publishes the new hand-off time (``phase_eta``)."""
        step_s = inner_s / steps
        ahead = self._steps_to_swarm_handoff(step_s)
        if ahead is not None and ahead > 0:
            plan = steps + ahead
        elif self.swarm_inner_step_s:
            plan = round(self.spec.inner_steps * self.swarm_inner_step_s / step_s)
        else:
            plan = self.spec.inner_steps
        plan = max(steps, self._within_dylu_range(plan))
        self.stats.phase_eta = time.time() + (plan - steps) * step_s
        return plan

    def _inner_phase(self) -> Handoff | None:
        """One inner phase: DyLU-sized, extended while the previous round is still in flight.

        A round that finishes during the phase is applied between two inner steps. A round still
        running when the phase has its steps does not stop training: the phase goes on, up to DyLU's
        ``max_inner_steps`` (Δ, and with it the outer step, grows with the steps behind it), and then
        waits for the round, which its own time bounds end (the averaging window, then the all-reduce
        and confirmation timeouts). Past those bounds plus a margin the round is given up.
        :returns: the phase's hand-off, or None when a stop was requested or a round applied during the
            phase reached ``--max-outer-steps`` (its steps are dropped).
        :raises Diverged: the pseudo-gradient is not finite.
        :raises NodeError: the averaging thread did not end a round long after its time bounds.
        """
        spec = self.spec
        target = self._phase_steps()
        measured = bool(self.stats.inner_step_s)  # False in our first phase: planned H, re-planned once timed
        # data and LR warm-up follow the swarm's progress (outer step × H): a joiner synced to step t
        # must not take tiny steps, or its own Δ-based norm bounds would reject every honest part
        phase_index = max(self.outer_step + int(self.sync.in_flight), self._last_phase_index + 1)
        self._last_phase_index = phase_index
        # when we expect to hand this phase off: a round's leader waits for peers about to arrive
        # (the record publisher sends it within its 5 s period: no extra DHT store per phase). Not timed
        # yet: "due now", published at once (0 says "starting up"), re-planned from the first steps
        self.stats.phase_eta = time.time() + target * (self.stats.inner_step_s or 0.0)
        self.model.train()
        losses, tokens, steps = [], 0, 0
        t_last, t_refresh = time.monotonic(), float("-inf")  # (an unmeasured phase reads the swarm at its first tick)
        if not measured:
            self._housekeeping.submit(self.records.publish_now)  # "training now": a running swarm waits for us
        inner_before, tokens_window = self.stats.inner_s, 0
        for i, (x, y) in enumerate(self.sampler.batches_for_outer_step(phase_index, MAX_PHASE_BATCHES)):
            if self.stop.requested:
                self.stats.wasted_inner_s += self.stats.inner_s - inner_before
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
                    ahead = self._steps_to_swarm_handoff(self.stats.inner_step_s)
                    if ahead is not None:
                        target = self._within_dylu_range(steps + ahead)
            now = time.monotonic()
            if not measured and now - t_last >= 1.0 and losses:
                target = self._replan_first_phase(steps, self.stats.inner_s - inner_before)
                if now - t_refresh >= SWARM_REFRESH_S:  # the others' speeds and hand-off times, for the next re-plan
                    t_refresh = now
                    self._housekeeping.submit(self._dht_upkeep)
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
                if steps >= self.max_inner_steps:
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
        return self._handoff(tokens=tokens, steps=steps, inner_s=inner_s, loss=sum(losses) / len(losses))

    def _handoff(self, *, tokens: int, steps: int, inner_s: float, loss: float) -> Handoff:
        """Δ = θ_global − θ_local of the phase that just ended, with the late rounds it carries.
        :raises Diverged: the pseudo-gradient is not finite."""
        delta = self.outer.pseudo_gradient(self.params)
        if finite_norm(delta) is None:
            raise Diverged(
                f"training diverged at outer step {self.outer_step}: the pseudo-gradient has non-finite "
                f"values; the last good checkpoint is kept. If it happens again after a restart, the run's "
                f"--inner-lr or --outer-lr is too high for this model: start a new run (another --run-id) with "
                f"lower ones"
            )
        carried, self._carried = self._carried, None  # Δ already holds it: θ_local kept the late rounds' work
        return Handoff(delta=delta, tokens=tokens + (carried.tokens if carried else 0), inner_steps=steps,
                       inner_s=inner_s, loss=loss, outer_step=self.outer_step, theta_digest=self._global_digest(),
                       marks=self._reference_marks(), started=time.monotonic(), carried=carried)

    def _inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on one batch ([B, T] int64 inputs and targets); returns its loss (nats/token)."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self._autocast():
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.inner_opt.step()
        # grads live from backward to the step only: a round applied, an evaluation or a state
        # adopted between two inner steps finds their memory free (the budget, docs/architecture.md)
        self.inner_opt.zero_grad(set_to_none=True)
        self.stats.inner_steps_total += 1
        return loss.item()

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

    def _run_round(self, handoff: Handoff, control: RoundControl) -> RoundOutcome:
        """One averaging round (on the averaging thread): average Δ, then check that the members
        started from one θ_global; download the canonical state when they did not."""
        from diloco_swarm.averaging.averager import RoundResult

        state = None
        if handoff.carried is None:  # (a late peer's carried Δ is one round stale by design: it is averaged)
            try:
                state = self._catch_up(handoff.outer_step)
            except Exception as e:  # the DHT did not answer: average as usual
                self.status.log(f"could not compare our outer step with the swarm's: {e}")
        if state is not None:
            # Our Δ stands on a θ_global two or more outer steps behind what the swarm's records back (a
            # joiner whose first phase outran the swarm's start, a peer back from a long pause): averaged
            # in, it would pull the others' step with a stale direction, at its full token weight. It is
            # dropped; we adopt the swarm's state and train on from there.
            reason = f"behind the swarm (outer step {handoff.outer_step}, the swarm's {state.meta['outer_step']}): caught up"
            return RoundOutcome(RoundResult(ok=False, group_size=1, reason=reason), handoff.delta, state=state, stale=True)
        try:
            result, average, alone, group_key = self._average(handoff, control)
        except Exception as e:  # never lose the training thread to a round: it becomes a late round
            return RoundOutcome(RoundResult(ok=False, group_size=1, reason=f"round failed: {e!r}"[:200]), handoff.delta)
        outcome = RoundOutcome(result, average, alone=alone, group_key=group_key)
        if control.stop.is_set() or alone:
            return outcome
        if not result.gathered:  # no group: if the others are far ahead, our next round could never meet theirs
            try:
                outcome.state = self._catch_up(handoff.outer_step, then=handoff.outer_step)
            except Exception as e:  # the DHT or averager did not answer: the next round tries again
                self.status.log(f"could not compare our outer step with the swarm's: {e}")
            return outcome
        mine = (handoff.outer_step, handoff.theta_digest)
        if result.ok:  # members that started from different θ_global mix them (node/mixing.py)
            try:
                outcome.mixed, outcome.mixing = self._mix(result, average, mine, control)
            except Exception as e:  # the DHT did not answer (the evidence read): compare θ_global instead
                self.status.log(f"could not mix θ_global with the group after the round: {e}")
        if outcome.mixed is None and not control.stop.is_set():
            try:
                outcome.state = self._reconcile(result.gathered, mine, applied=result.ok or result.maybe_kept)
            except Exception as e:  # the DHT or averager did not answer: the round stands, the next one reconciles
                self.status.log(f"could not compare θ_global with the group after the round: {e}")
        return outcome

    def _average(self, handoff: Handoff, control: RoundControl):
        """:returns: (the round's result, the Δ to apply, whether no other peer was online)."""
        from diloco_swarm.averaging.averager import RoundResult

        own = handoff.delta  # (fp32 CPU: read by the outer step, never changed)
        if not self._public_peer_online():
            # Clients cannot form a group among themselves (nobody accepts connections): skip
            # matchmaking instead of waiting out the window. One warning per run.
            if not self._warned_no_public:
                self._warned_no_public = True
                self.status.log("warning: no public peer in the swarm, only clients (which cannot reach each "
                                "other); training solo until a public peer joins. A peer that can accept "
                                "connections (port forwarded, or a server) lets the swarm average again")
            return RoundResult(ok=False, group_size=1, reason="no public peer: every peer is a client"), own, True, ""
        records = self._read_records()
        self._note_swarm(records)  # fresh for the phase that follows this round (a re-sync aims at the swarm's hand-off)
        other_records = [r for p, r in records.items() if p != self.peer_id]
        others = bool(self.averager.donors()) or bool(other_records)
        if self.sync.overlap and not others:
            return RoundResult(ok=False, group_size=1, reason="no other peer online"), own, True, ""
        limit = self.cfg.max_outer_steps
        if 0 < limit and other_records and all(r.outer_step >= limit and r.phase_eta <= 0 for r in other_records):
            # they finished the run without us and wait to serve their state (_end_on_one_model): take it
            return RoundResult(ok=False, group_size=1, reason="the other peers finished the run (--max-outer-steps) "
                               "without us"), own, False, ""
        plan, due, gone = self._plan_round(handoff, records)
        # groups smaller than the swarm (a grid, or the few peers coming mid-run): no quorum of the swarm
        # bounds them, so a peer ahead of the swarm waits for it first
        beyond_cap = len(plan.groups) > 1 or len(set(records) | {self.peer_id}) > plan.max_group_size
        fresh = self._wait_for_swarm(handoff, control, records) if beyond_cap else None
        if fresh is not None:  # we waited for the swarm to reach our step: plan with what it is now
            records = fresh
            plan, due, gone = self._plan_round(handoff, records)
        if self.sync.overlap and gone and not (set(records) - gone - {self.peer_id}):
            # the only other peers crashed moments ago (their records outlive them): nobody to wait for
            return RoundResult(ok=False, group_size=1, reason="no other peer online (the others are gone)"), own, True, ""
        key, planned = plan.group_of(self.peer_id)
        members = tuple(p for p in planned if p not in gone)
        if len(plan.groups) > 1 and len(planned) > 1 and len(members) < 2:
            # every other member of our grid group is gone: the others' plans keep a crashed peer until its
            # record expires, so nobody else comes under our key, and waiting out the window stalled us and
            # the peers planned with us next (a newcomer's kill: 3 of 5 survivors sat out 30 s windows).
            # Late: our Δ goes into the next round
            return RoundResult(ok=False, group_size=1, reason="the other planned members are gone"), own, False, key
        # the leader starts as soon as all of them are in (hivemind's target size): the matchmaking time
        # on top only gives the slower of them (a loaded machine reads the DHT slowly) time to find it
        start = due + self.cfg.matchmaking_time
        grid = len(plan.groups) > 1  # groups smaller than the swarm: θ-mixing keeps them one model
        self.history.resize(max(self._history_floor, history_length(plan.dims if grid else 1)))
        if grid:  # peers behind the swarm at our step join this round (grouping.round_number): say so now
            self.stats.averaging_round = plan.round_no
            with contextlib.suppress(RuntimeError):  # (the node is closing)
                self._housekeeping.submit(self.records.publish_now)
        try:
            result, average = self.averager.average(
                handoff.delta, weight=max(handoff.tokens, 1),
                metadata=self._round_metadata(handoff), timeout=self.cfg.averaging_window, stop=control.stop,
                give_up=control.give_up, digest_wait=DIGEST_WAIT_S, scheduled_time=start,
                online_peers=len((set(records) | {self.peer_id}) - gone),
                group_bits=group_bits(key) if grid else "", group_size=max(2, len(members)),
                group_cap=plan.max_group_size, gone=self._gone_members,
                members=[p for p in members if p != self.peer_id], members_due=due,
                moved_on=lambda peers: self._moved_on(peers, plan.round_no))
        finally:
            self.stats.averaging_round = None
        return result, average, not others, key if grid else ""

    def _wait_for_swarm(self, handoff: Handoff, control: RoundControl,
                        records: dict[str, Any]) -> dict[str, Any] | None:
        """Before a round of groups smaller than the swarm: while our outer step is past the swarm's
        (``grouping.ahead_of_swarm``: averaging now would put us two steps ahead), re-read the records every
        :data:`AHEAD_READ_EVERY_S` until the swarm reaches our step, at most ``--averaging-window``
        seconds (the peers behind may be stuck: the round then goes on as before) or until the round is
        stopped or given up. Meanwhile our record names our round (``averaging_round``), so the peers
        that reach our step count us due now.
        :returns: the records read last (to plan anew), or None when we were not ahead (no wait).
        :raises ChildUnavailable: the DHT did not answer a read in time (the round then fails)."""
        from diloco_swarm.averaging.grouping import ahead_of_swarm

        def ahead() -> bool:
            return ahead_of_swarm(handoff.outer_step, [r.outer_step for p, r in records.items() if p != self.peer_id])

        if not ahead():
            return None
        self.stats.averaging_round = handoff.outer_step
        with contextlib.suppress(RuntimeError):  # (the node is closing)
            self._housekeeping.submit(self.records.publish_now)
        t0 = time.monotonic()
        try:
            while ahead() and time.monotonic() - t0 < self.cfg.averaging_window:
                if control.stop.wait(AHEAD_READ_EVERY_S) or control.give_up.is_set():
                    break
                records = self._read_records()
        finally:
            self.stats.averaging_round = None
            self.stats.ahead_wait_s += time.monotonic() - t0
        return records

    def _gone_members(self, peers: Sequence[str]) -> set[str]:
        """Those of a round's ``peers`` whose process is gone (``node/redial.py: ProbePeers``), for the
        digest cross-check. Only peers whose records say they serve DHT calls are asked (a client's ping
        fails although it is there), and only a failed ping counts: one that hangs while our DHT bans
        the peer may be a slow member that still confirms."""
        seen = self._grid_records  # peer id -> (when read, its record): the records _plan_round read
        askable = [p for p in peers if p in seen and seen[p][1].reachability != "client"]
        return gone_peers(self.dht, askable, stop=self.stop.event, banned_is_gone=False)

    def _moved_on(self, peers: Sequence[str], round_no: int) -> set[str]:
        """Those of a forming round's late ``peers`` whose records show an outer step past ``round_no``
        (they averaged it before we arrived: our plan counted them in, theirs counted us late) or a later
        round in flight (they planned with a newer view of the swarm, ``grouping.moved_past``), so the
        round stops waiting for them and our Δ goes into the next round. Reads the records at most every
        :data:`MOVED_ON_READ_EVERY_S`; never raises (a failed read finds nobody)."""
        from diloco_swarm.averaging.grouping import moved_past

        now = time.monotonic()
        if now - self._moved_on_read[0] >= MOVED_ON_READ_EVERY_S:
            try:
                self._moved_on_read = (now, self._read_records())
            except Exception:
                self._moved_on_read = (now, {})
        records = self._moved_on_read[1]
        return {p for p in peers if p in records
                and moved_past(round_no, records[p].outer_step, records[p].averaging_round)}

    def _read_records(self) -> dict[str, Any]:
        """The run's signed peer records, read once per round (dht/records.py).
        :raises ChildUnavailable: the DHT did not answer in time (the round then fails)."""
        from diloco_swarm.dht.records import read_peer_records

        return read_peer_records(self.dht, self.spec.run_id)

    def _plan_round(self, handoff: Handoff, records: dict[str, Any]):
        """This round's plan (``averaging/grouping.py``'s ``plan_round``: whom the round waits for and,
        when the swarm is larger than one group, the grid group we belong to), the time by which every
        expected member should have handed off (unix time; the all-reduce begins once all are in, at
        the latest ``--matchmaking-time`` after it), and the members found gone: ``(plan, due, gone)``.
        A member that dies after this plan is found gone past ``due`` (``averager.average``'s
        ``members_due``), and the round begins without it.

        Progress alignment: peers publish when they expect to hand off their phase (``phase_eta`` in
        their records). Decoupled DiLoCo's minimum quorum plus a grace window (arXiv 2604.21428;
        hivemind's ``ProgressTracker`` aligns its epochs the same way) decides whom the round waits
        for: it begins when the last of them has handed off, plus a little slack. The grace window is
        half a phase of ours, within [--matchmaking-time, half the averaging window]. A peer still
        starting up, or one that crashed, is not waited for (:func:`seconds_to_handoff`); nor is a
        member whose record is still fresh but whose process is gone: its ping fails at once
        (``node/redial.py: ProbePeers``; ``bench.churn``: the survivors' rounds took 4 s for the ~10 s
        the crashed peer's record looked alive). Gone peers do not count toward the majority quorum
        either (two survivors of four can average). The grid holds
        the peers whose records we read in the last ``GRID_MEMORY_S`` seconds: a read that misses a
        record (a loaded machine) must not give us a grid of our own.

        The grid rotates with the round number (Moshpit SGD, arXiv 2103.03239), which is the median
        outer step of the online peers' records (ours, when we are ahead): a peer one step behind the
        swarm meets the swarm's round and catches up in it, instead of planning a grid of its own; a
        peer behind it joins the round a peer at its own step already looks for a group in
        (``grouping.round_number``).
        The last round of a planned run (``--max-outer-steps``) has no grid below ``--max-group-size``:
        the peers that share that limit meet in one group and mix into one θ_global.
        """
        from diloco_swarm.averaging.grouping import plan_round, round_number

        now, seen = time.time(), time.monotonic()
        self._grid_records = {p: (t, r) for p, (t, r) in self._grid_records.items() if seen - t < GRID_MEMORY_S}
        self._grid_records.update((p, (seen, r)) for p, r in records.items() if p != self.peer_id)
        others = {p: r for p, (_, r) in self._grid_records.items()}  # peers views agree on, even after a partial read
        grace = min(self.cfg.averaging_window / 2, max(self.cfg.matchmaking_time, handoff.inner_s / 2))
        first, max_silent = self.stats.last_round is None, SILENT_RECORDS * self.records.interval_s
        round_no = round_number(handoff.outer_step, [(r.outer_step, r.averaging_round) for r in others.values()])
        etas = {p: seconds_to_handoff(r.phase_eta, now, silent_s=self._silent_s(p, seen), max_silent_s=max_silent,
                                      first_round=first) for p, r in others.items()}
        # a peer that looks for a group in this very round is due now, whatever its record's phase_eta
        # says (in overlap mode that is already its next phase's, which would count it late)
        etas.update((p, 0.0) for p, r in others.items() if r.averaging_round == round_no and etas[p] != math.inf)
        etas[self.peer_id] = 0.0
        cap = self.cfg.group_size
        if 0 < self.cfg.max_outer_steps <= round_no + 1:
            # the planned run's last round: everyone in one group (up to --max-group-size), whose θ-mixing
            # against θ_0 (node/mixing.py: the anchor) leaves a grid run on one model
            cap = self.cfg.max_group_size
        plan = plan_round(round_no, etas, max_group_size=cap, grace_s=grace)
        _, members = plan.group_of(self.peer_id)
        # a member that crashed moments ago still has a fresh record: ask whether it is there before
        # the round waits for it (clients serve no DHT calls: they cannot be asked)
        gone = gone_peers(self.dht, [p for p in members if p != self.peer_id and others[p].reachability != "client"],
                          stop=self.stop.event)
        if gone and len(plan.groups) == 1:  # (a grid stays as the others see it: they may not know yet)
            etas.update((p, math.inf) for p in gone)
            plan = plan_round(round_no, etas, max_group_size=cap, grace_s=grace)
            _, members = plan.group_of(self.peer_id)
        last = max((etas[p] for p in members if p not in gone), default=0.0)
        return plan, now + last + ALIGN_SLACK_S, gone

    def _public_peer_online(self) -> bool:
        """Whether a group can form for us: always for a full peer; a client needs a public peer."""
        from diloco_swarm.dht.records import read_peer_records

        if not self.client_mode or self.averager.donors():
            return True
        records = read_peer_records(self.dht, self.spec.run_id)
        if any(p != self.peer_id and r.reachability != "client" for p, r in records.items()):
            return True
        now = time.monotonic()
        if self.cfg.initial_peers and now - self._last_rebootstrap > REBOOTSTRAP_EVERY_S:
            # the public peers may be back (restarted at the same address): dial them again
            self._last_rebootstrap = now
            dial_peers(self.dht, self.cfg.initial_peers)
            return bool(self.averager.donors())
        return False

    def _global_digest(self) -> str:
        """Digest of θ_global, computed once per change (sha256 over every parameter is not free);
        kept only when no write began while it was computed."""
        generation = int(self.outer.generation.item())
        if self._digest_cache is not None and self._digest_cache[0] == generation:
            return self._digest_cache[1]
        digest = theta_digest(self.outer.theta)
        if int(self.outer.generation.item()) == generation:
            self._digest_cache = (generation, digest)
        return digest

    def _round_metadata(self, handoff: Handoff) -> dict[str, Any]:
        """What the group's members gather from us: the θ_global we started the round from."""
        return {"outer_step": handoff.outer_step, "spec_hash": self.spec.spec_hash(),
                "theta_digest": handoff.theta_digest, "marks": handoff.marks}

    def _donor_priority(self) -> float:
        """Our priority among state donors (hivemind's ``state_sharing_priority``): our outer step."""
        return float(self.outer_step)

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
        result = outcome.result
        self.stats.count_round(result, mixing=outcome.mixing)
        self._ended_alone = outcome.alone and outcome.state is None and outcome.mixed is None
        self._ended_in_grid = bool(outcome.group_key)  # groups smaller than the swarm: lineages by design
        round_step = handoff.outer_step + 1
        # Our Δ is in the swarm's θ_global if a verified average that the swarm kept included it. It may
        # be when a member kept the round while we missed a confirmation (maybe_kept): carrying it then
        # could apply it twice, so we apply the round's average (the averager returns it then), as a
        # member that heard every confirmation does: one θ_global when the confirmations were only slow.
        kept = result.ok and (outcome.state is None or outcome.state.includes_round)
        carry = (not kept and not result.maybe_kept and not outcome.alone and not outcome.stale
                 and (handoff.carried.rounds if handoff.carried else 0) < MAX_CARRIED_ROUNDS)
        held = False
        if outcome.mixed is not None:  # the members started from different θ_global and mixed them
            self._adopt_mixed(outcome.mixed, handoff, estimate)
        elif outcome.state is not None:  # the members started from different θ_global: adopt the canonical one
            self._adopt_state(outcome.state, handoff=handoff, estimate=estimate, carry=carry)
            if not kept and not carry:
                self.stats.wasted_inner_s += handoff.work_s  # replaced by a state that may not include it
        elif kept or not carry:
            with self._writing_state():  # a verified average, or our own Δ (alone, unconfirmed, or late too long)
                self._remember_theta()
                self.sync.apply(outcome.average, estimate)
                self.outer_step += 1
            self.stats.theta_marks.append((self.outer_step, self._global_digest()))
        else:  # late: others are online but we are in no verified round; a solo step would start a lineage
            held = True
            with self._state_lock:
                self.sync.hold(handoff.delta, estimate)
            round_step = self.outer_step
        if self.cfg.debug_dump_rounds is not None:
            self._dump_round(handoff, [] if held else outcome.average, result, held)
        if carry:
            self._carried = Carried.of(handoff)
            self.stats.late_rounds += 1
        else:
            self.stats.tokens_total += handoff.tokens
        self._after_round(handoff, outcome, round_step, during_inner_step, late=carry)

    def _after_round(self, handoff: Handoff, outcome: RoundOutcome, round_step: int, during_inner_step: int | None,
                     late: bool = False) -> None:
        """Checkpoint (written on the checkpoint thread), evaluation within its time budget, the
        metrics record and the status line; DHT upkeep on the housekeeping thread."""
        self._save_checkpoint_in_background()
        if not self.client_mode:
            self.averager.state_sharing_priority = self._donor_priority()
        self._evaluate(force=0 < self.cfg.max_outer_steps <= self.outer_step)
        self.metrics.write({**self._round_record(handoff, outcome, round_step),
                            "applied_at_inner_step": during_inner_step, "late": late})
        self._housekeeping.submit(self._dht_upkeep)
        self.stats.live["waiting"] = False  # the round is applied: the line must not say we wait for it
        self._status(force=True)
        for peer, why in outcome.result.rejected_peers.items():
            self.status.log(f"outer step {self.outer_step}: peer {peer} was left out of the round: {why}")

    def _round_record(self, handoff: Handoff, outcome: RoundOutcome, round_step: int) -> dict[str, Any]:
        """The ``outer_step`` metrics record (docs/metrics.md)."""
        result, mixing = outcome.result, outcome.mixing
        return {
            "event": "outer_step",
            "outer_step": round_step,
            "synced_to": self.outer_step if self.outer_step != round_step else None,
            "peer_id": self.peer_id,
            "sync_mode": self.spec.sync_mode,
            "group_size": result.group_size,
            "group": result.group_peer_ids,
            "group_id": result.group_id,
            "loss": handoff.loss,
            "eval_loss": self.stats.eval_loss,
            "eval_outer_step": self.stats.eval_outer_step,
            "tokens": handoff.tokens,
            "inner_steps": handoff.inner_steps,
            "bytes_sent": result.bytes_sent + (mixing.bytes_sent if mixing else 0),
            "bytes_received": result.bytes_received + (mixing.bytes_received if mixing else 0),
            "averaging_s": round(result.seconds + (mixing.seconds if mixing else 0.0), 4),
            "round_wall_s": round(time.monotonic() - handoff.started, 4),
            "previewed_tensors": self._preview.moved,
            "preview_lead_s": None if (lead := self._preview.lead_s()) is None else round(lead, 3),
            "compression": self.spec.compression,
            "round_ok": result.ok,
            "reason": result.reason,
            "rejected_peers": result.rejected_peers,
            "digest_confirmed_by": result.agreed_peers,
            "gone_peers": result.gone_peers + (mixing.gone_peers if mixing else []),
            "group_key": outcome.group_key or None,
            "mixed": outcome.mixed is not None,
            "mix_reference_step": outcome.mixed.reference_step if outcome.mixed else None,
            "mix_reason": mixing.reason if mixing and not mixing.ok else None,
            "reachability": self.reachability,
            "theta_digest": self._global_digest(),
            **self.stats.totals(),
        }

    def _evaluate(self, force: bool = False) -> None:
        """Held-out loss of θ_global, when forced or while evaluation, this one included (priced at
        the last one's cost), stays within ``--eval-budget`` of wall time; the previous value stands
        in between. Pricing the next one keeps a slow evaluation from overshooting the budget by
        one evaluation per round."""
        wall = time.monotonic() - self.stats.started
        if not force and self.stats.eval_s + self._last_eval_s > self.cfg.eval_budget * wall:
            return
        t0 = time.monotonic()
        # θ_local may run ahead of θ_global (overlap): evaluate θ_global, through the model with θ_global's
        # tensors in place of its own (on the CPU no copy at all; on a GPU one, where the grads were)
        self.stats.eval_loss = evaluate(with_parameters(self.model, self.outer.theta), self.eval_set, self.device)
        self.stats.eval_outer_step = self.outer_step
        self._last_eval_s = time.monotonic() - t0
        self.stats.eval_s += self._last_eval_s

    def _evaluate_now(self) -> None:
        """Held-out loss of θ_global now (at the start, after a state adopted at the end): an ``eval``
        metrics event and a line."""
        self._evaluate(force=True)
        self.metrics.write({"event": "eval", "peer_id": self.peer_id, "outer_step": self.outer_step,
                            "eval_loss": self.stats.eval_loss})
        self.status.log(f"held-out loss at outer step {self.outer_step}: {self.stats.eval_loss:.4f}")

    def _checkpoint(self) -> None:
        self.stop.has_checkpoint = True
        self._write_checkpoint_now()

    def _write_checkpoint_now(self) -> None:
        """Write θ_global, the momentum and the counters as they are now (any thread). The state lock
        keeps every outer step out while ``torch.save`` streams the live tensors: no snapshot copy (the
        memory budget). A round finished meanwhile waits to be applied for as long as the disk takes."""
        with self._state_lock:
            self._write_checkpoint(self._checkpoint_state())

    def _write_checkpoint(self, state: dict[str, Any]) -> None:
        """Write ``state`` (any thread). A failed write (a full disk, a read-only remount) costs only
        our restart point, not the swarm's training: it is said once per reason, in the metrics and
        at the stop, and the node trains on; the previous checkpoint stays on disk."""
        try:
            self._store_checkpoint(state)
        except OSError as e:
            reason, on_disk = e.strerror or str(e), self._checkpoint_on_disk
            held = f"the checkpoint on disk is outer step {on_disk}" if on_disk is not None else "no checkpoint is on disk yet"
            self.stop.checkpoint_problem = f"{held}: writing outer step {state['outer_step']} failed ({reason})"
            self.metrics.write({"event": "checkpoint_failed", "peer_id": self.peer_id,
                                "outer_step": state["outer_step"], "reason": reason,
                                "on_disk_outer_step": on_disk})
            if reason != self._checkpoint_failure:
                self.status.log(f"warning: could not write the checkpoint of outer step {state['outer_step']} in "
                                f"{self.cfg.state_dir} ({reason}); training goes on, but a restart would resume from "
                                f"{'the start' if on_disk is None else f'outer step {on_disk}'}. Free some space "
                                "there (or make it writable again); the next outer step tries again")
            self._checkpoint_failure = reason
            return
        if self._checkpoint_failure is not None:
            self.status.log(f"the checkpoint is written again (outer step {state['outer_step']})")
        self._checkpoint_failure, self.stop.checkpoint_problem = None, None
        self._checkpoint_on_disk = state["outer_step"]

    def _store_checkpoint(self, state: dict[str, Any]) -> None:
        """:raises OSError: the write failed (node/checkpoint.py: save_checkpoint)."""
        save_checkpoint(self.cfg.state_dir, state)

    def _checkpoint_state(self) -> dict[str, Any]:
        """What the checkpoint holds (node/checkpoint.py, format 2): the live tensors of θ_global and the
        outer momentum, not copies; hold the state lock while they are used. The inner optimizer's
        moments are not kept (docs/operations.md: what a resume loses)."""
        return {
            "spec": self.spec.model_dump(),
            "spec_hash": self.spec.spec_hash(),
            "peer_id": self.peer_id,
            "outer_step": self.outer_step,
            "inner_steps_total": self.stats.inner_steps_total,
            "tokens_total": self.stats.tokens_total,
            "outer": self.outer.state_dict(),
        }

    def _save_checkpoint_in_background(self) -> None:
        """Write the state on the checkpoint thread, from the live tensors (:meth:`_write_checkpoint_now`)."""
        self.stop.has_checkpoint = True
        self._last_checkpoint = self._checkpoints.submit(self._write_checkpoint_now)

    def _dht_upkeep(self) -> None:
        """Housekeeping thread: publish our record, refresh the run spec, read the swarm's records
        (peers seen, their speeds for DyLU, the addresses kept for restarts), and put peers the DHT
        dropped under load back into its routing table (node/redial.py)."""
        from diloco_swarm.dht.records import read_peer_records
        from diloco_swarm.dht.swarm import refresh_run_spec

        with contextlib.suppress(Exception):
            self.records.publish_now()
            refresh_run_spec(self.dht, self.spec)
            records = read_peer_records(self.dht, self.spec.run_id)
            self.stats.peers_seen = max(1, len(records))
            self._note_swarm(records)
            self._remember_peers(records)
        now = time.monotonic()
        busy = self._reconnecting is not None and not self._reconnecting.done()
        if now - self._last_reconnect >= REDIAL_EVERY_S and self._recent_peers and not busy:
            self._last_reconnect = now
            self._reconnecting = self._reconnect.submit(
                self._reconnect_peers, {p: maddrs for p, (_, maddrs) in self._recent_peers.items()})

    def _reconnect_peers(self, peers: dict[str, list[str]]) -> None:
        """Reconnect thread (a dead peer's dial takes seconds): put the peers whose records we read
        lately back into the DHT's routing table if it dropped them (node/redial.py)."""
        missing, answered = reconnect_peers(self.dht, peers, stop=self.stop.event)
        if answered:
            self.status.log(f"the DHT had dropped {answered} live peer{'s' if answered != 1 else ''} of the swarm "
                            "(calls to them timed out); they are back in its routing table")
        unreachable = missing - answered
        if unreachable != self._unreachable_said:  # said once per change: a split view of the swarm shows in the log
            self._unreachable_said = unreachable
            if unreachable:
                self.status.log(f"{unreachable} of the {len(peers)} peers whose records we read lately are not in the "
                                "DHT's routing table and did not answer a dial (gone, or unreachable from here)")

    def _silent_s(self, peer: str, now: float) -> float:
        """Seconds (``time.monotonic``) since we first read the record of ``peer`` that we read last."""
        heard = self._heard.get(peer)
        return now - heard[1] if heard is not None else 0.0

    def _note_swarm(self, records: dict[str, Any]) -> None:
        """From the peers' records: the online peers' median seconds per inner step (DyLU), the
        other peers' median hand-off time (unix s), and since when each record is unchanged (a crashed
        peer's). Called on the housekeeping and averaging threads (each attribute is replaced whole)."""
        now = time.monotonic()
        heard = {p: h for p, h in self._heard.items() if now - h[1] < HEARD_MEMORY_S}  # a record gone from this read stays silent
        heard.update((p, heard[p] if p in heard and heard[p][0] == r.updated else (r.updated, now))
                     for p, r in records.items())
        self._heard = heard
        recent = {p: v for p, v in self._recent_peers.items() if now - v[0] < HEARD_MEMORY_S}
        recent.update((p, (now, list(r.maddrs))) for p, r in records.items()
                      if p != self.peer_id and r.reachability != "client" and r.maddrs)
        self._recent_peers = recent
        speeds = sorted(r.inner_step_s for r in records.values() if r.inner_step_s > 0)
        self.swarm_inner_step_s = speeds[len(speeds) // 2] if speeds else None
        etas = sorted(r.phase_eta for p, r in records.items() if p != self.peer_id and r.phase_eta > 0)
        self.swarm_phase_eta = etas[len(etas) // 2] if etas else None

    def _record_snapshot(self) -> dict[str, Any]:
        """This peer's public record (dht/records.py), read by `status` and the dashboard."""
        if self.device.type == "cuda":
            device, precision = torch.cuda.get_device_name(self.device), "bf16-autocast"
        else:
            device, precision = str(self.device), "fp32"
        return {
            "peer_id": self.peer_id,
            "name": self.cfg.name,
            "version": __version__,
            "device": device,
            "precision": precision,
            "reachability": self.reachability,
            "outer_step": self.outer_step,
            "maddrs": [] if self.client_mode else self.maddrs,  # a client cannot be dialed
            **self.stats.peer_record(),
        }

    def _status(self, force: bool = False, **live) -> None:
        """Update the status line; ``live`` fields (inner_step, phase_steps, loss, tokens_per_s) describe the running phase."""
        self.stats.live.update(live)
        self.status.update(self.stats.status(outer_step=self.outer_step, inner_steps=self.spec.inner_steps,
                                             reachability=self.reachability), force=force)

    def _dump_round(self, handoff: Handoff, applied, result, late: bool) -> None:
        """Test-only (hidden ``--debug-dump-rounds``): what we contributed and what we applied
        (nothing in a late round: its Δ is carried)."""
        local, tokens = handoff.delta, handoff.tokens
        self.cfg.debug_dump_rounds.mkdir(parents=True, exist_ok=True)
        torch.save({"outer_step": handoff.outer_step, "peer_id": self.peer_id, "ok": result.ok, "weight": tokens,
                    "group": result.group_peer_ids, "group_id": result.group_id, "reason": result.reason,
                    "maybe_kept": result.maybe_kept, "late": late, "carried_rounds": handoff.carried.rounds if handoff.carried else 0,
                    "local": [d.detach().cpu().clone() for d in local], "applied": [a.detach().cpu().clone() for a in applied]},
                   self.cfg.debug_dump_rounds / f"{handoff.outer_step}-{self.peer_id}-"
                                                f"{result.group_id[:12] or 'solo'}-{int(time.time() * 1000)}.pt")

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _leave(self) -> None:
        """Graceful leave: apply a round that has ended, drop one still running, finish the checkpoint
        write, say goodbye."""
        if self.lost is None and self.sync is not None and self.sync.done():
            with contextlib.suppress(Exception):  # as during training; the stop line did not call it dropped
                self._apply_round()
        pending_inner_s = self.sync.pending_inner_s() + (self._carried.inner_s if self._carried else 0.0)
        self.sync.abandon(timeout=5.0)
        self.stats.wasted_inner_s += pending_inner_s
        self._housekeeping.close()
        self._reconnect.close()
        self._checkpoints.close()  # the queued checkpoint write still runs
        if self._last_checkpoint is not None:
            with contextlib.suppress(Exception):
                self._last_checkpoint.result(timeout=CHECKPOINT_WRITE_TIMEOUT_S)
        if self.stop.checkpoint_problem:
            self.status.log(f"warning: {self.stop.checkpoint_problem}")
        self.metrics.write({"event": "stop", "peer_id": self.peer_id, "outer_step": self.outer_step,
                            "graceful": self.lost is None, "reason": self.lost,
                            "goodput": round(self.stats.goodput(), 4)})
        if self.averager is not None and not self.client_mode and self.lost is None:
            with contextlib.suppress(Exception):
                self.averager.allow_state_sharing = False  # publishes "no longer a donor"
        if self.records is not None:
            self.records.stop(remove=self.lost is None)  # goodbye: our record disappears at once
        if self.lost is None:
            kept = "" if self.stop.checkpoint_problem or not self.stop.has_checkpoint else "; its checkpoint is kept"
            self.status.log(f"stopped at outer step {self.outer_step}{kept}")

    # ------------------------------------------------------------------ supervision (node/watchdog.py, node/redial.py)
    lost: str | None = None  # set when a part of this node died: the node stops with PartLost (exit 3)
    _ended_alone = False  # the last round applied was our own Δ alone (nobody online): said at the planned end
    _ended_in_grid = False  # the last round applied was planned in groups smaller than the swarm (a grid)
    watchdog = None
    _redial_known: list[str] = []

    def _supervise(self) -> None:
        """Watch the DHT, averager and p2pd processes; re-dial the known peers if we started a new swarm."""
        from diloco_swarm.node.watchdog import Watchdog, node_parts

        self.watchdog = Watchdog(node_parts(self.dht, self.averager), self._part_lost).start()
        if self._redial_known:
            Redialer(self.dht, self._redial_known, self.stop.event, on_merged=lambda n: self.status.log(
                f"found {n} of the peers this node saw before; the two swarms merge")).start()

    def _part_lost(self, what: str) -> None:
        """Watchdog callback (its thread): stop the node; the others' calls fail at once (ends them)."""
        from diloco_swarm.node.watchdog import end_processes

        if self.stop.requested:
            return  # a signal to our process group ended that part too: a normal stop
        self.lost = what
        self.stop.event.set()
        end_processes(self.averager, self.dht)  # useless without each other; every call now fails at once

    def _shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()  # the parts now end on purpose
        self.status.close()
        if self.sync is not None:
            self.sync.abandon(timeout=0.0)  # after an error: the averaging thread must not outlive us
        self._housekeeping.close()
        self._reconnect.close()
        self._checkpoints.close()
        if self.records is not None:
            self.records.stop(remove=False)
        for part in (self.averager, self.dht):
            if part is not None and part.is_alive():  # a SIGTERM to our process group may have ended it
                with contextlib.suppress(Exception):
                    part.shutdown()
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()
