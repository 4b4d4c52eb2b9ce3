"""θ_global and the outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1).

θ_global and the outer momentum live in fp32 on the CPU, whatever device the model trains on, in
shared memory: the averager process streams them to a joining peer as they are, with no snapshot
(``generation`` tells it whether they changed meanwhile; averaging/donation.py). The step and its
preview run one tensor at a time, so no model-sized temporary exists (the memory budget).
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
        self.theta: list[torch.Tensor] = [p.detach().to("cpu", torch.float32).clone().share_memory_() for p in params]
        # torch's SGD holds the hyper-parameters and the momentum (its state_dict is the checkpoint's
        # format); the step itself is step_tensor's, one tensor at a time
        self.optimizer = torch.optim.SGD(self.theta, lr=lr, momentum=momentum, nesterov=momentum > 0)
        if momentum > 0:  # zeros from the start: the first step's buf·momentum + Δ is Δ, as torch's clone
            for theta in self.theta:
                self.optimizer.state[theta]["momentum_buffer"] = torch.zeros_like(theta).share_memory_()
        # bumped before every write to θ_global or the momentum (int64, shared memory): a reader outside
        # our process (a state donation) knows its copy is whole when the count did not move meanwhile
        self.generation = torch.zeros(1, dtype=torch.int64).share_memory_()

    def _will_write(self) -> None:
        self.generation.add_(1)

    @torch.no_grad()
    def pseudo_gradient(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local, fp32 CPU tensors shaped like the parameters.

        :raises ValueError: ``params`` are not this model's (count or shapes differ).
        """
        params = list(params)
        self.check_like_theta(params, "the parameters")
        return [g - p.detach().to("cpu", torch.float32) for g, p in zip(self.theta, params)]

    def check_like_theta(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """:raises ValueError: ``tensors`` (named ``what`` in the message) has another count or shapes than θ_global."""
        if len(tensors) != len(self.theta):
            raise ValueError(f"{what}: {len(tensors)} tensors, θ_global has {len(self.theta)}")
        for i, (t, theta) in enumerate(zip(tensors, self.theta)):
            if not isinstance(t, torch.Tensor) or t.shape != theta.shape:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{what}: tensor {i} has shape {shape}, θ_global's is {tuple(theta.shape)}")

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor]) -> None:
        """One outer step on θ_global with grad = ``delta`` (fp32, parameter shapes; read, not changed,
        and not copied).

        :raises ValueError: ``delta`` has another count or shapes than θ_global (nothing changes).
        """
        self.check_like_theta(delta, "the outer gradient")
        for index, d in enumerate(delta):
            self.step_tensor(index, d)

    @torch.no_grad()
    def step_tensor(self, index: int, delta: torch.Tensor) -> None:
        """:meth:`step` for θ_global's tensor ``index`` alone (the step is elementwise): torch's
        single-tensor SGD with Nesterov momentum (dampening 0, no weight decay), op for op, so every
        member that applies one average holds the same bits, and :meth:`preview` lands on it exactly.
        Temporaries are one tensor's size, never the model's. ``delta``: fp32, that tensor's shape
        (checked by the caller)."""
        group = self.optimizer.param_groups[0]
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        theta, grad = self.theta[index], delta.to(torch.float32)
        self._will_write()
        if momentum != 0:
            buf = self.optimizer.state[theta]["momentum_buffer"]
            buf.mul_(momentum).add_(grad)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        theta.add_(grad, alpha=-lr)

    @torch.no_grad()
    def preview(self, delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """θ_global after :meth:`step` with grad = ``delta``, without changing θ_global or the momentum.

        The eager local update of overlapped DiLoCo (Kale et al., arXiv 2502.12996): the next inner
        phase starts from the outer step our own Δ would give, while the group's average is in flight.
        Same arithmetic as ``torch.optim.SGD`` (dampening 0, no weight decay), so a solo round's
        :meth:`step` lands exactly on the preview.

        :param delta: fp32 tensors shaped like θ_global.
        :returns: new fp32 CPU tensors shaped like θ_global.
        :raises ValueError: ``delta`` has another count or shapes than θ_global.
        """
        return self.preview_state(delta)[0]

    @torch.no_grad()
    def preview_state(self, delta: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(θ_global, outer momentum) after :meth:`step` with grad = ``delta``, nothing changed
        (:meth:`preview`'s arithmetic); the momentum is zeros when the optimizer has none.

        :returns: two lists of new fp32 CPU tensors shaped like θ_global.
        :raises ValueError: ``delta`` has another count or shapes than θ_global.
        """
        self.check_like_theta(delta, "the outer gradient")
        thetas, buffers = [], []
        for index, d in enumerate(delta):
            theta, buf = self._preview_one(index, d)
            thetas.append(theta)
            buffers.append(buf)
        return thetas, buffers

    @torch.no_grad()
    def preview_tensor(self, index: int, delta: torch.Tensor) -> torch.Tensor:
        """θ_global's tensor ``index`` after :meth:`step`, from that tensor's outer gradient alone
        (the step is elementwise): :meth:`preview`'s arithmetic for one tensor, nothing changed.

        :param delta: fp32, the shape of θ_global's tensor ``index``.
        :returns: a new fp32 CPU tensor.
        :raises ValueError: ``index`` is out of range or ``delta`` has another shape.
        """
        if not 0 <= index < len(self.theta) or not isinstance(delta, torch.Tensor) \
                or delta.shape != self.theta[index].shape:
            raise ValueError(f"the outer gradient of tensor {index} does not fit θ_global")
        return self._preview_one(index, delta)[0]

    def _preview_one(self, index: int, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.optimizer.param_groups[0]
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        theta = self.theta[index]
        grad = delta.to(torch.float32)
        if momentum == 0:
            return theta.add(grad, alpha=-lr), torch.zeros_like(theta)
        buf = self.optimizer.state[theta]["momentum_buffer"].mul(momentum).add_(grad)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
        return theta.add(grad, alpha=-lr), buf

    @torch.no_grad()
    def copy_to(self, params: Iterable[nn.Parameter]) -> None:
        """θ_local ← θ_global."""
        for p, theta in zip(params, self.theta):
            p.copy_(theta.to(device=p.device, dtype=p.dtype))

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer momentum of each θ_global tensor (zeros before the first outer step), fp32 CPU:
        the live buffers, not copies (the next outer step changes them); new zeros without momentum."""
        if self.optimizer.defaults["momentum"] == 0:
            return [torch.zeros_like(theta) for theta in self.theta]
        return [self.optimizer.state[theta]["momentum_buffer"] for theta in self.theta]

    @torch.no_grad()
    def load_theta_and_momentum(self, theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> None:
        """Adopt another peer's θ_global and outer momentum (a state download), copied into our own
        buffers. :raises ValueError: counts or shapes differ (checked before anything changes)."""
        self.check_state(theta, momentum)
        for index, (t, m) in enumerate(zip(theta, momentum)):
            self.load_tensor(index, t, m)

    def check_state(self, theta: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> None:
        """:raises ValueError: ``theta`` or ``momentum`` has another count or shapes than θ_global."""
        if len(theta) != len(self.theta) or len(momentum) != len(self.theta):
            raise ValueError("state has a different number of tensors than this model")
        if any(t.shape != mine.shape or m.shape != mine.shape for mine, t, m in zip(self.theta, theta, momentum)):
            raise ValueError("state has other shapes than this model")

    @torch.no_grad()
    def load_tensor(self, index: int, theta: torch.Tensor, momentum: torch.Tensor) -> None:
        """θ_global's tensor ``index`` and its momentum ← ``theta``, ``momentum`` (shapes checked by
        :meth:`check_state`)."""
        mine = self.theta[index]
        self._will_write()
        mine.copy_(theta)
        if self.optimizer.defaults["momentum"] > 0:
            self.optimizer.state[mine]["momentum_buffer"].copy_(momentum)

    def state_dict(self) -> dict[str, Any]:
        """θ_global and the optimizer's state dict: the live tensors, not copies (a checkpoint writes
        them while the caller keeps every outer step out, node/runner.py)."""
        return {"theta": self.theta, "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:raises ValueError: shapes differ from this model's (nothing is changed then)."""
        theta = state["theta"]
        if len(theta) != len(self.theta) or any(
            not isinstance(a, torch.Tensor) or a.shape != b.shape for a, b in zip(theta, self.theta)
        ):
            raise ValueError("θ_global in the state has other shapes than this model")
        # Check the momentum too before changing anything: a bad buffer would only fail at the next step.
        for index, param_state in dict(state["optimizer"].get("state", {})).items():
            buf = param_state.get("momentum_buffer") if isinstance(param_state, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(self.theta) or (
                buf is not None and (not isinstance(buf, torch.Tensor) or buf.shape != self.theta[index].shape)
            ):
                raise ValueError("the outer momentum in the state has other shapes than this model")
        ours = self.momentum_buffers() if self.optimizer.defaults["momentum"] > 0 else None
        self._will_write()
        for mine, theirs in zip(self.theta, theta):
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
        if ours is not None:  # back into our own (shared) buffers, not the memory-mapped file's
            for mine, buf in zip(self.theta, ours):
                loaded = self.optimizer.state[mine].get("momentum_buffer")
                buf.copy_(loaded) if isinstance(loaded, torch.Tensor) else buf.zero_()
                self.optimizer.state[mine]["momentum_buffer"] = buf
