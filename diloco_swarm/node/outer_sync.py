"""Overlapped outer steps: the next inner phase runs while the group averages Δ.

Blocking DiLoCo (Douillard et al., arXiv 2311.08105) stops training for the whole round:
matchmaking, the all-reduce and its verification. Overlapped DiLoCo hides the round behind the
next inner phase, as eager updates do (Kale et al., arXiv 2502.12996, "1-outer-step eager"):

    end of phase t:   Δ_t = θ_global^t − θ_local             (hand-off, round t starts in the background)
                      θ_local ← θ̂ = OuterStep(θ_global^t, Δ_t)  (eager: our own Δ stands in for the average)
    during phase t+1: round t ends with the verified average Δ̄_t (or our own Δ_t: a solo round)
                      θ_global^{t+1} = OuterStep(θ_global^t, Δ̄_t)
                      θ_local ← θ_local + (θ_global^{t+1} − θ̂)     (keeps the progress made since the hand-off)
    end of phase t+1: Δ_{t+1} = θ_global^{t+1} − θ_local

θ_global only ever moves by verified averages (or our own Δ when nobody else is online), so every
member of a round still holds bit-identical θ_global; only θ_local runs one round "eagerly" ahead. A
solo round costs nothing: θ_global^{t+1} equals θ̂ bit for bit (:meth:`OuterOptimizer.preview`), so
the correction is zero. The checkpoint holds (θ_global, momentum, outer step) of the last applied
round, never an eager estimate, so a crash at any moment resumes from a state an outer step produced.

A **late** round (others are online, but this peer's round formed no verified group) is held, not
applied alone (:meth:`OuterSync.hold`): θ_global and the momentum stay at outer step t, θ_local undoes
the eager jump and keeps Δ_t, so the next hand-off carries it (Δ = Δ_t + the next phase's progress,
weighted by both phases' tokens), as Decoupled DiLoCo folds late fragments into the next round
(arXiv 2604.21428). A solo outer step would start a lineage of its own that only a full-state
download can heal. An adopted state (:meth:`OuterSync.adopt`) keeps θ_local's progress the same way.

:class:`OuterSync` owns the round in flight and the correction arithmetic; the caller (node/runner.py)
owns the outer-step counter, the lock around θ_global, and what happens after a round.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from diloco_swarm.averaging.mixing import standing
from diloco_swarm.node.outer import OuterOptimizer
from diloco_swarm.utils.worker import Worker

SYNC_MODES = ("overlap", "blocking")
PREVIEW_MAX_NORM_RATIO = 10.0  # an arriving average beyond this multiple of our own Δ's norm waits for the round's checks


@dataclass
class Handoff:
    """What a finished inner phase hands to the averaging.

    ``delta``: Δ = θ_global − θ_local, fp32 CPU tensors shaped like the parameters.
    """

    delta: list[torch.Tensor]
    tokens: int  # tokens behind Δ, carried rounds' included (the round's averaging weight)
    inner_steps: int  # inner steps of the phase (adaptive, DyLU)
    inner_s: float  # wall seconds of the phase's inner steps
    loss: float | None  # mean training loss of the phase
    outer_step: int  # θ_global's outer step at the hand-off
    theta_digest: str  # digest of θ_global at the hand-off
    marks: list = field(default_factory=list)  # [step, digest] of earlier θ_global we hold (mixing references)
    started: float = 0.0  # time.monotonic() of the hand-off
    carried: "Carried | None" = None  # late rounds whose Δ this one carries
    restarted_below: int = 0  # θ_global's lineage debt at the hand-off (averaging/mixing.py: standing)

    @property
    def standing(self) -> int:
        """Where θ_global stood among lineages at the hand-off (``mixing.standing``)."""
        return standing(self.outer_step, self.restarted_below)

    def round_metadata(self, spec_hash: str) -> dict[str, Any]:
        """What the group's members gather from us (docs/protocol.md): the θ_global we started the round from."""
        return {"outer_step": self.outer_step, "spec_hash": spec_hash, "theta_digest": self.theta_digest,
                "marks": self.marks, "restarted_below": self.restarted_below}

    @property
    def work_s(self) -> float:
        """Inner seconds behind Δ: this phase's and those of the late rounds it carries."""
        return self.inner_s + (self.carried.inner_s if self.carried else 0.0)


@dataclass
class Carried:
    """The work of late rounds that the next hand-off's Δ carries (see :meth:`OuterSync.hold`)."""

    rounds: int = 0  # consecutive late rounds
    tokens: int = 0
    inner_s: float = 0.0  # wall seconds of their inner steps

    @classmethod
    def of(cls, handoff: Handoff) -> "Carried":
        """What carrying ``handoff``'s Δ into the next round adds up to."""
        before = handoff.carried or cls()
        return cls(rounds=before.rounds + 1, tokens=handoff.tokens, inner_s=handoff.work_s)


@dataclass
class Preview:
    """How much of the round in flight's average reached θ_local before the round was applied
    (:meth:`OuterSync.preview_part`); reported in the round's metrics record."""

    token: int = 0  # the averager's round token (0: nothing to preview, e.g. blocking mode)
    read: int = 0  # tensors read so far, in order
    moved: int = 0  # of them, those θ_local took (the others were refused)
    first_at: float | None = None  # time.monotonic() of the first tensor taken

    def lead_s(self) -> float | None:
        """Seconds from the first tensor taken until now (the apply), or None when none was."""
        return None if self.first_at is None else time.monotonic() - self.first_at


@dataclass
class RoundControl:
    """Signals from the training thread to the round in flight.

    ``give_up``: the next inner phase ran out of steps while this round still looked for a group:
    stop looking (a group that already formed still finishes). ``stop``: the node is leaving.
    """

    give_up: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class RoundOutcome:
    """What the averaging thread returns for one round.

    ``average``: the Δ to apply (the verified group average, or our own Δ). ``state``: instead of
    applying ``average``, adopt this downloaded state (θ_global + momentum of a canonical peer);
    ``mixed``: instead, adopt the state the group's θ-mixing produced (node/mixing.py); their shapes
    are the caller's business. ``mixing``: the mixing round's result, when one ran. ``alone``: nobody
    to average with (no other peer online, or only clients, which cannot reach each other): a solo
    outer step is then right; otherwise an unverified round is late, see :meth:`OuterSync.hold`.
    ``group_key``: the planned group's key when the swarm averages in groups smaller than itself
    (``grouping.plan_round``; θ-mixing then merges their lineages), "" when it averages as one.
    ``stale``: our Δ was computed on a θ_global two or more outer steps behind the swarm's, so it
    was not averaged and is dropped; ``state`` is the swarm's, to adopt. ``selection``: in a sparse
    mode, what the all-reduce sent of Δ + e (``round_policy.feedback_action`` decides its fate).
    """

    result: Any  # averaging.averager.RoundResult
    average: list[torch.Tensor]
    state: Any = None
    alone: bool = False
    group_key: str = ""
    mixed: Any = None  # node.mixing.MixedState
    mixing: Any = None  # averaging.averager.RoundResult of the mixing all-reduce
    stale: bool = False
    selection: Any = None  # node.feedback.Selection: what a sparse round sent of Δ + e (None: nothing sent)


class Estimate:
    """θ̂, the eager start of the current phase, kept as what it is made of rather than a model-sized
    copy (the memory budget): tensor ``i`` is ``OuterStep(θ_global, source_i)[i]``, with ``source_i``
    the hand-off's Δ_i, or the round's average for tensor ``i`` once θ_local took it (``taken``).
    Computed from θ_global and the momentum as they are now, so read it before an outer step or an
    adopted state changes them (:class:`OuterSync` does)."""

    def __init__(self, outer: OuterOptimizer, delta: Sequence[torch.Tensor]):
        self.outer, self.delta = outer, delta
        self.taken: dict[int, torch.Tensor] = {}  # tensor index -> the average θ_local took for it

    def tensor(self, index: int) -> torch.Tensor:
        """θ̂'s tensor ``index``: a new fp32 CPU tensor."""
        return self.outer.preview_tensor(index, self.taken.get(index, self.delta[index]))

    def __len__(self) -> int:
        return len(self.delta)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self.delta):
            raise IndexError(index)
        return self.tensor(index)


@dataclass
class _Pending:
    handoff: Handoff
    control: RoundControl
    future: Future
    estimate: Estimate | None  # θ̂, the eager start of the current phase (None: blocking)


class OuterSync:
    """The round in flight between two inner phases, and how a finished one is applied.

    :param outer: θ_global and the outer Nesterov optimizer.
    :param params: the model parameters (θ_local), in θ_global's order; any device.
    :param run_round: ``(handoff, control) -> RoundOutcome``; runs on this object's averaging thread.
        It must return (not raise) for every round; it should honour ``control`` within seconds.
    :param overlap: True = overlapped (eager) rounds; False = blocking rounds (the caller waits).
    :param stop: the node's stop event; every round's ``control.stop`` (a graceful leave abandons
        the round in flight at once).
    """

    def __init__(self, outer: OuterOptimizer, params: Sequence[nn.Parameter],
                 run_round: Callable[[Handoff, RoundControl], RoundOutcome], *, overlap: bool,
                 stop: threading.Event | None = None):
        self.outer, self.params, self.run_round, self.overlap = outer, list(params), run_round, overlap
        self._stop = stop if stop is not None else threading.Event()
        self._worker = Worker("averaging")
        self._pending: _Pending | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def done(self) -> bool:
        """Whether the round in flight has finished (its outcome can be applied without waiting)."""
        return self._pending is not None and self._pending.future.done()

    @torch.no_grad()
    def hand_off(self, handoff: Handoff) -> None:
        """Start the round of ``handoff.delta`` in the background; in overlap mode θ_local jumps to θ̂.

        :raises RuntimeError: a round is still in flight (apply it first).
        """
        if self._pending is not None:
            raise RuntimeError("a round is still in flight")
        estimate = None
        if self.overlap:
            estimate = Estimate(self.outer, handoff.delta)
            for index, p in enumerate(self.params):
                p.copy_(estimate.tensor(index).to(device=p.device, dtype=p.dtype))
        control = RoundControl(stop=self._stop)
        future = self._worker.submit(self.run_round, handoff, control)
        self._pending = _Pending(handoff, control, future, estimate)

    def preview_part(self, index: int, average: torch.Tensor) -> bool:
        """Move θ_local's tensor ``index`` onto the round's average for it as soon as it has arrived,
        before the round is verified (overlap only; see :meth:`correct`).

        :param average: the group's Δ̄ for tensor ``index``, fp32, that tensor's shape; kept (not
            copied) until the round is applied, so it must not change meanwhile.
        :returns: whether θ_local moved (False: blocking mode, no round in flight, or a value refused).
        """
        pending = self._pending
        if pending is None or pending.estimate is None:
            return False
        return self.correct(index, average, pending.estimate, pending.handoff.delta[index])

    @torch.no_grad()
    def correct(self, index: int, average: torch.Tensor, estimate: Estimate,
                delta: torch.Tensor | None = None) -> bool:
        """θ_local[index] += OuterStep(θ_global, average)[index] − θ̂[index], then θ̂[index] ← that step.

        The round's average reaches θ_local part by part as the all-gather delivers it, instead of
        a whole phase late (the staleness of eager updates, arXiv 2502.12996, shrinks with the time
        the own-Δ estimate stands in). θ̂ moves by the same amount, so θ_local − θ̂ stays the progress
        since the hand-off: :meth:`apply`, :meth:`hold` and :meth:`adopt` land exactly where they
        would without the preview, and θ_global still moves only by verified averages. A value that
        is not finite, or whose norm exceeds :data:`PREVIEW_MAX_NORM_RATIO` × our own Δ's (``delta``),
        is refused: the round's own checks decide about it.

        :param estimate: θ̂, the eager start of the current phase; its tensor ``index`` moves too.
        :returns: whether θ_local moved.
        """
        average = average.to(torch.float32)
        if not bool(torch.isfinite(average).all()):
            return False
        if delta is not None and float(average.norm()) > PREVIEW_MAX_NORM_RATIO * float(delta.norm()) + 1e-12:
            return False
        step = self.outer.preview_tensor(index, average)
        p = self.params[index]
        p.add_((step - estimate.tensor(index)).to(device=p.device, dtype=p.dtype))
        estimate.taken[index] = average
        return True

    def overdue(self, seconds: float) -> bool:
        """Whether the round in flight was handed off more than ``seconds`` ago."""
        return self._pending is not None and time.monotonic() - self._pending.handoff.started > seconds

    def pending_inner_s(self) -> float:
        """Inner seconds whose Δ is in the round in flight, carried rounds' included (0 when none)."""
        return self._pending.handoff.work_s if self._pending is not None else 0.0

    def give_up_matchmaking(self) -> None:
        if self._pending is not None:
            self._pending.control.give_up.set()

    def take(self, timeout: float | None = None) -> tuple[Handoff, RoundOutcome, Estimate | None]:
        """Wait (at most ``timeout`` seconds) for the round in flight and detach it.

        :returns: (its hand-off, its outcome, the eager estimate θ̂ or None), for :meth:`apply`.
        :raises TimeoutError: still running after ``timeout`` (it stays in flight).
        :raises RuntimeError: no round in flight.
        """
        if self._pending is None:
            raise RuntimeError("no round in flight")
        outcome = self._pending.future.result(timeout=timeout)
        pending, self._pending = self._pending, None
        return pending.handoff, outcome, pending.estimate

    @torch.no_grad()
    def apply(self, average: Sequence[torch.Tensor], estimate: Estimate | None) -> None:
        """θ_global ← OuterStep(θ_global, average); move θ_local onto the new θ_global.

        Overlap: θ_local += θ_global_new − θ̂ (the progress since the hand-off is kept).
        Blocking: θ_local ← θ_global_new. Tensor by tensor: no model-sized temporary.
        :raises ValueError: ``average`` does not fit θ_global (nothing changes).
        """
        self.outer.check_like_theta(average, "the outer gradient")
        for index, p in enumerate(self.params):
            reference = estimate.tensor(index) if estimate is not None else None  # (before θ_global moves)
            self.outer.step_tensor(index, average[index])
            self._move_local(index, reference)

    @torch.no_grad()
    def hold(self, delta: Sequence[torch.Tensor], estimate: Estimate | None) -> None:
        """A late round: θ_global and the outer momentum stay; θ_local keeps ``delta`` (the hand-off's Δ,
        fp32, parameter shapes) and the progress since, so the next hand-off's Δ carries it.

        Overlap: θ_local += θ_global − Δ − θ̂ (the eager jump undone). Blocking: θ_local is unchanged.
        """
        if estimate is None:
            return
        for index in range(len(self.params)):
            self._move_local(index, self._carry_reference(index, delta, estimate))

    @torch.no_grad()
    def adopt(self, theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], delta: Sequence[torch.Tensor],
              estimate: Estimate | None, *, carry: bool) -> None:
        """θ_global, outer momentum ← a downloaded state (fp32, parameter shapes); θ_local keeps its
        progress since the hand-off, and ``delta`` too when ``carry`` (the round's average that built
        the state did not include it).
        :raises ValueError: the state's count or shapes differ from θ_global (nothing changes)."""
        self.outer.check_state(theta, momentum)
        for index in range(len(self.params)):
            if carry:
                reference = self._carry_reference(index, delta, estimate)
            else:
                reference = estimate.tensor(index) if estimate is not None else None
            self.outer.load_tensor(index, theta[index], momentum[index])
            self._move_local(index, reference)

    def _carry_reference(self, index: int, delta: Sequence[torch.Tensor], estimate: Estimate | None) -> torch.Tensor:
        """Where θ_local's tensor ``index`` would stand had it kept Δ, measured against θ_global now:
        θ̂ + Δ (overlap), θ_global (blocking, where θ_local = θ_global − Δ still)."""
        if estimate is None:
            return self.outer.theta[index].clone()
        return estimate.tensor(index).add_(delta[index].to(torch.float32))

    @torch.no_grad()
    def _move_local(self, index: int, reference: torch.Tensor | None) -> None:
        """θ_local[index] += θ_global[index] − ``reference`` (the progress beyond the reference is
        kept); θ_local[index] ← θ_global[index] when ``reference`` is None."""
        p, new = self.params[index], self.outer.theta[index]
        if reference is None:
            p.copy_(new.to(device=p.device, dtype=p.dtype))
        else:
            p.add_((new - reference).to(device=p.device, dtype=p.dtype))

    def abandon(self, timeout: float) -> None:
        """Leave the round in flight (graceful stop): signal it and wait at most ``timeout`` s.
        Its Δ is dropped: θ_global stays at the last applied round."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.control.stop.set()
            pending.control.give_up.set()
            try:
                pending.future.result(timeout=timeout)
            except Exception:
                pass  # a failing or slow round at shutdown changes nothing: its Δ is dropped anyway
        self._worker.close()
