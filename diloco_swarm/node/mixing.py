"""θ-mixing on the node: members of a round that started it from different θ_global leave it holding one.

The rule (which rounds mix, the reference, the weights) is ``averaging/mixing.py``; the all-reduce is
``PseudoGradientAverager.mix``; the θ_global states a node keeps as references are ``ThetaHistory``
(node/global_state.py). Here: a node's contribution (its post-step θ_global relative to the
reference, and its post-step momentum), and the mixed state the training thread adopts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from diloco_swarm.averaging.mixing import MixPlan, plan_mix, standing
from diloco_swarm.node.global_state import GlobalState, State, theta_digest


@dataclass
class MixedState:
    """A verified θ-mixing result: θ_global and the outer momentum (fp32 CPU, parameter shapes)
    every member of the round now holds, and its outer step."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    outer_step: int
    digest: str
    reference_step: int
    restarted_below: int = 0  # the mixed lineage's debt (averaging/mixing.py: standing)


class ThetaMixer:
    """The node side of θ-mixing (see the module docstring).

    :param state: this node's θ_global.
    :param averager: runs the mixing all-reduce (``PseudoGradientAverager.mix``).
    :param supported_step: ``() -> the newest standing the swarm's signed records back``
        (``StateSync.evidence``): a member claiming more is not followed.
    """

    def __init__(self, state: GlobalState, *, averager: Any, peer_id: str, stats: Any,
                 supported_step: Callable[[], int], log: Callable[[str], None]):
        self.state, self.averager, self.peer_id, self.stats = state, averager, peer_id, stats
        self.supported_step, self.log = supported_step, log

    def mix(self, result: Any, average: list[torch.Tensor], current: State, control: Any, gone: Any
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
        ahead = standing(plan.outer_step - 1, plan.restarted_below)  # the round's: ours, unless we are behind
        if ahead > standing(current[0], self.state.restarted_below) and ahead > self.supported_step():
            return None, None  # a member claims a step the swarm's signed records do not back (node/statesync.py)
        state = self.state
        with state.lock:  # θ_global stays as it is while our round is in flight: a consistent read
            reference = state.theta if plan.reference == current else state.history.get(plan.reference)
            if reference is None:
                return None, None  # we listed it, so it was dropped since: no mix, the caller reconciles
            reference = [t.clone() for t in reference]
            theta_next, momentum_next = state.outer.preview_state(average)
        contribution = [t - r for t, r in zip(theta_next, reference)] + momentum_next
        mixing, mixed = self.averager.mix(contribution, round_result=result, weight=plan.weights[self.peer_id],
                                          planned_weights=plan.weights, stop=control.stop, gone=gone)
        if not mixing.ok:
            self.log(f"θ-mixing with the group failed ({mixing.reason}); comparing θ_global instead")
            return None, mixing
        return mixed_state(plan, reference, mixed), mixing

    def adopt(self, mixed: MixedState, handoff: Any, estimate: Any, sync: Any) -> None:
        """θ_global, outer momentum and outer step ← the mixed state (training thread); θ_local keeps
        its progress since the hand-off (the mix holds this round's Δ̄, our Δ in it; ``sync``:
        node/outer_sync.py's ``OuterSync``)."""
        with self.state.moving_to(mixed.outer_step, mixed.digest, mixed.restarted_below):
            sync.adopt(mixed.theta, mixed.momentum, handoff.delta, estimate, carry=False)
        self.stats.mixed_rounds += 1


def mixed_state(plan: MixPlan, reference: list[torch.Tensor], mixed: list[torch.Tensor]) -> MixedState:
    """The state every member holds after a mixing round: ``reference`` + the mixed differences."""
    n = len(reference)
    theta = [r + d for r, d in zip(reference, mixed[:n])]  # every member adds the same fp32 values: bit-identical
    return MixedState(theta=theta, momentum=mixed[n:], outer_step=plan.outer_step, digest=theta_digest(theta),
                      reference_step=plan.reference[0], restarted_below=plan.restarted_below)
