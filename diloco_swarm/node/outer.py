"""θ_global and the outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1).

θ_global and the outer momentum live in fp32 on the CPU, whatever device the model trains on.
The pseudo-gradient is Δ = θ_global − θ_local; the outer step is SGD with Nesterov momentum on
θ_global with grad = (averaged) Δ, after which the model restarts from θ_global.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn


class OuterOptimizer:
    """Holds θ_global (fp32 CPU copies of the model parameters) and ``torch.optim.SGD`` over them.

    :param params: the model parameters, in a fixed order (the order of ``model.parameters()``).
    :param lr: outer learning rate (DiLoCo default 0.7).
    :param momentum: Nesterov momentum (default 0.9); 0 gives plain SGD.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.7, momentum: float = 0.9):
        self.theta: list[torch.Tensor] = [p.detach().to("cpu", torch.float32).clone() for p in params]
        self.optimizer = torch.optim.SGD(self.theta, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def pseudo_gradient(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local, fp32 CPU tensors shaped like the parameters."""
        return [g - p.detach().to("cpu", torch.float32) for g, p in zip(self.theta, params)]

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor]) -> None:
        """One outer step on θ_global with grad = ``delta`` (fp32, parameter shapes)."""
        for theta, d in zip(self.theta, delta):
            theta.grad = d.to(torch.float32).clone()
        self.optimizer.step()
        for theta in self.theta:
            theta.grad = None

    @torch.no_grad()
    def copy_to(self, params: Iterable[nn.Parameter]) -> None:
        """θ_local ← θ_global."""
        for p, theta in zip(params, self.theta):
            p.copy_(theta.to(device=p.device, dtype=p.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"theta": [t.clone() for t in self.theta], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:raises ValueError: shapes differ from this model's."""
        theta = state["theta"]
        if len(theta) != len(self.theta) or any(a.shape != b.shape for a, b in zip(theta, self.theta)):
            raise ValueError("θ_global in the state has other shapes than this model")
        for mine, theirs in zip(self.theta, theta):
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
