"""The held-out loss of θ_global, within a share of wall time (``--eval-budget``)."""

from __future__ import annotations

import time
from typing import Any

from diloco_swarm.data import evaluate
from diloco_swarm.models import with_parameters


class Evaluation:
    """Evaluates θ_global on the held-out batches when forced, or while evaluation, this one
    included (priced at the last one's cost), stays within ``budget`` × the node's wall time; the
    previous value stands in between. Pricing the next one keeps a slow evaluation from
    overshooting the budget by one evaluation per round. Results go to ``stats`` (node/stats.py)."""

    def __init__(self, budget: float, stats: Any):
        self.budget, self.stats = budget, stats
        self.model = self.eval_set = self.device = None  # set by start()
        self._last_s = 0.0  # seconds the last evaluation took

    def start(self, model: Any, eval_set: list, device: Any) -> None:
        self.model, self.eval_set, self.device = model, eval_set, device

    def __call__(self, theta: list, outer_step: int, force: bool = False) -> None:
        """``theta``: θ_global's tensors (shaped like the model's parameters) at ``outer_step``."""
        wall = time.monotonic() - self.stats.started
        if not force and self.stats.eval_s + self._last_s > self.budget * wall:
            return
        t0 = time.monotonic()
        # θ_local may run ahead of θ_global (overlap): evaluate θ_global, through the model with θ_global's
        # tensors in place of its own (on the CPU no copy at all; on a GPU one, where the grads were)
        self.stats.note_eval(outer_step, evaluate(with_parameters(self.model, theta), self.eval_set, self.device))
        self._last_s = time.monotonic() - t0
        self.stats.eval_s += self._last_s
