"""θ-mixing on the node: members of a round that started it from different θ_global leave it holding one.

The rule (which rounds mix, the reference, the weights) is ``averaging/mixing.py``; the all-reduce is
``PseudoGradientAverager.mix``. Here: the θ_global states a node keeps as references, its
contribution (its post-step θ_global relative to the reference, and its post-step momentum), and the
mixed state the training thread adopts. A mixin of :class:`diloco_swarm.node.runner.Node`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from diloco_swarm.averaging.mixing import MAX_MARKS, MixPlan, plan_mix

State = tuple[int, str]  # (outer step, θ_global digest)


class ThetaHistory:
    """θ_global of this node's last few outer steps (fp32 CPU copies): the references θ-mixing can
    use. ``keep`` counts the current θ_global (held by the node, not here): ``keep = 1`` stores
    nothing, which is the default until the swarm averages in groups smaller than itself.

    Besides them, an *anchor*: θ_0, the run's initial θ_global, which every peer rebuilds from the
    run's seed (``models/registry.build``), so every member of any group holds it. It is the
    reference of last resort, when the members share no later state (a grid run's whole-swarm last
    round: its pairs never all held one θ_global), in place of a full-state download. Its int8
    differences grow with the distance from θ_0 (docs/architecture.md)."""

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._states: deque[tuple[State, list[torch.Tensor]]] = deque()
        self._anchor: tuple[State, list[torch.Tensor]] | None = None
        self._lock = threading.Lock()  # the training thread remembers, the averaging thread resizes and reads

    def anchor_on(self, state: State, theta: list[torch.Tensor]) -> None:
        """Keep a copy of ``theta`` (θ_0, outer step 0) as the anchor, listed before the others."""
        with self._lock:
            self._anchor = (state, [t.clone() for t in theta])

    def resize(self, keep: int) -> None:
        with self._lock:
            self._resize(keep)

    def _resize(self, keep: int) -> None:
        self.keep = max(1, keep)
        while len(self._states) > self.keep - 1:
            self._states.popleft()

    def remember(self, state: State, theta: list[torch.Tensor]) -> None:
        """Keep a copy of ``theta``, the θ_global of ``state``, which is about to change."""
        with self._lock:
            if self.keep <= 1:
                return
            self._states.append((state, [t.clone() for t in theta]))
            self._resize(self.keep)

    def states(self, most: int = MAX_MARKS) -> list[State]:
        """The (outer step, digest) pairs held here: the anchor, then the newest ``most`` − 1 others,
        newest last."""
        with self._lock:
            held = [state for state, _ in self._states if self._anchor is None or state != self._anchor[0]]
            anchor = [] if self._anchor is None else [self._anchor[0]]
            room = most - len(anchor)
            return anchor[:most] + (held[-room:] if room > 0 else [])

    def get(self, state: State) -> list[torch.Tensor] | None:
        with self._lock:
            held = [*self._states, *([self._anchor] if self._anchor is not None else [])]
            return next((theta for known, theta in held if known == state), None)


@dataclass
class MixedState:
    """A verified θ-mixing result: θ_global and the outer momentum (fp32 CPU, parameter shapes)
    every member of the round now holds, and its outer step."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    outer_step: int
    digest: str
    reference_step: int


class Mixing:
    """The node side of θ-mixing (see the module docstring)."""

    history: ThetaHistory

    def _reference_marks(self) -> list[list]:
        """The states besides the current one that we can mix against ([step, digest] pairs, for the
        round's gathered metadata)."""
        return [[step, digest] for step, digest in self.history.states()]

    def _remember_theta(self) -> None:
        """Call (holding the state lock) right before θ_global changes: keep it as a reference."""
        self.history.remember((self.outer_step, self._global_digest()), self.outer.theta)

    def _mix(self, result: Any, average: list[torch.Tensor], current: State, control: Any, gone: Any
             ) -> tuple[MixedState | None, Any]:
        """After a verified round (``result``, its average Δ̄): mix θ_global with the group when the
        rule says so (averaging/mixing.py), on the averaging thread.

        :param current: the state we started the round from.
        :param gone: ``(peers) -> the gone ones`` (node/round.py: ``Round.gone_members``).
        :returns: (the mixed state, or None when the group does not mix or the mix failed; the mixing
            round's RoundResult, or None when none ran).
        """
        plan = plan_mix(result.gathered)
        if plan is None or self.peer_id not in plan.weights:
            return None, None
        ahead = plan.outer_step - 1  # the round's step: ours, unless we are behind its members
        if ahead > current[0] and ahead > self._evidence().supported_step:
            return None, None  # a member claims a step the swarm's signed records do not back (node/statesync.py)
        with self._state_lock:  # θ_global stays as it is while our round is in flight: a consistent read
            reference = self.outer.theta if plan.reference == current else self.history.get(plan.reference)
            if reference is None:
                return None, None  # we listed it, so it was dropped since: no mix, the caller reconciles
            reference = [t.clone() for t in reference]
            theta_next, momentum_next = self.outer.preview_state(average)
        contribution = [t - r for t, r in zip(theta_next, reference)] + momentum_next
        mixing, mixed = self.averager.mix(contribution, round_result=result, weight=plan.weights[self.peer_id],
                                          planned_weights=plan.weights, stop=control.stop, gone=gone)
        if not mixing.ok:
            self.status.log(f"θ-mixing with the group failed ({mixing.reason}); comparing θ_global instead")
            return None, mixing
        return self._mixed_state(plan, reference, mixed), mixing

    @staticmethod
    def _mixed_state(plan: MixPlan, reference: list[torch.Tensor], mixed: list[torch.Tensor]) -> MixedState:
        from diloco_swarm.node.statesync import theta_digest

        n = len(reference)
        theta = [r + d for r, d in zip(reference, mixed[:n])]  # every member adds the same fp32 values: bit-identical
        return MixedState(theta=theta, momentum=mixed[n:], outer_step=plan.outer_step, digest=theta_digest(theta),
                          reference_step=plan.reference[0])

    def _adopt_mixed(self, mixed: MixedState, handoff: Any, estimate: Any) -> None:
        """θ_global, outer momentum and outer step ← the mixed state (training thread); θ_local keeps
        its progress since the hand-off (the mix holds this round's Δ̄, our Δ in it)."""
        with self._writing_state():
            self._remember_theta()
            self.sync.adopt(mixed.theta, mixed.momentum, handoff.delta, estimate, carry=False)
            self.outer_step = mixed.outer_step
        self.stats.theta_marks.append((self.outer_step, mixed.digest))
        self.stats.mixed_rounds += 1
