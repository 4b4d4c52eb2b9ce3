"""How many inner steps a phase takes: Dynamic Local Updates (DyLU, Liu et al., Async Local-SGD,
arXiv 2401.09135). Fast and slow peers finish their phases together; token-weighted averaging
weights their Δ by the tokens they trained. Pure arithmetic over the peer's and the swarm's speeds."""

from __future__ import annotations

from dataclasses import dataclass

MIN_INNER_STEPS_FRACTION = 0.25  # DyLU range: a phase plans H/4 .. 2H inner steps
MAX_INNER_STEPS_FACTOR = 2


@dataclass(frozen=True)
class PhasePlanner:
    """DyLU for a run of ``inner_steps`` (H) per outer step, within [H/4, 2H]."""

    inner_steps: int

    @property
    def min_steps(self) -> int:
        return max(1, round(self.inner_steps * MIN_INNER_STEPS_FRACTION))

    @property
    def max_steps(self) -> int:
        return self.inner_steps * MAX_INNER_STEPS_FACTOR

    def within(self, steps: int) -> int:
        return max(self.min_steps, min(self.max_steps, steps))

    def steps(self, mine_s: float | None, swarm_s: float | None) -> int:
        """Inner steps of the next phase: H × (the swarm's median seconds per inner step ÷ ours),
        within the range; H alone or before the first measurements."""
        if not mine_s or not swarm_s:
            return self.inner_steps
        return self.within(round(self.inner_steps * swarm_s / mine_s))

    @staticmethod
    def steps_to(eta: float | None, step_s: float | None, now: float) -> int | None:
        """Inner steps of ``step_s`` seconds until ``eta`` (unix s; the other peers' median hand-off;
        ≤ 0 once it has passed); None when either is unknown."""
        if not eta or not step_s:
            return None
        return round((eta - now) / step_s)

    def replan_first(self, steps: int, inner_s: float, *, swarm_eta: float | None, swarm_s: float | None,
                     now: float) -> tuple[int, float]:
        """The target of a phase planned (H steps) before this peer had timed an inner step, once
        ``steps`` took ``inner_s`` seconds: end at the swarm's next hand-off (``swarm_eta``, unix s)
        when one is still ahead, else DyLU's H × swarm ÷ ours, else H; within the range, never below
        ``steps`` (= end now). A slow newcomer is then not a whole slow phase late for its first round.
        :returns: (the target, the new hand-off time to publish, unix s)."""
        step_s = inner_s / steps
        ahead = self.steps_to(swarm_eta, step_s, now)
        if ahead is not None and ahead > 0:
            plan = steps + ahead
        elif swarm_s:
            plan = round(self.inner_steps * swarm_s / step_s)
        else:
            plan = self.inner_steps
        plan = max(steps, self.within(plan))
        return plan, now + (plan - steps) * step_s
