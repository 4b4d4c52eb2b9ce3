"""The inner optimizer (node/inner.py): AdamW, and bitsandbytes' AdamW8bit on the CPU as on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from diloco_swarm.models import build_model
from diloco_swarm.node.inner import INNER_OPTIMIZERS, build_inner_optimizer


def train(name: str, steps: int = 40) -> tuple[list[float], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    opt = build_inner_optimizer(name, model.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):  # one batch, learnt by heart: the loss must fall fast
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


@pytest.mark.timeout(120)
def test_adamw8bit_trains_like_adamw_with_a_quarter_of_the_moments():
    full, adamw = train("adamw")
    eight, adamw8 = train("adamw8bit")
    assert eight[-1] < 0.5 * eight[0] and full[-1] < 0.5 * full[0]
    assert abs(eight[-1] - full[-1]) < 0.25 * full[0]  # same ballpark at equal steps (bench quality for more)

    def moment_bytes(opt):
        return sum(v.nbytes for state in opt.state.values() for k, v in state.items()
                   if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq", "state1", "state2"))
    sizes = [p.numel() for group in adamw.param_groups for p in group["params"]]
    assert moment_bytes(adamw) == 8 * sum(sizes)
    small = sum(n for n in sizes if n < 4096)  # bitsandbytes keeps tensors under 4,096 values in fp32
    assert moment_bytes(adamw8) <= 2 * (sum(sizes) - small) + 8 * small < 3 * sum(sizes)


def test_an_unknown_inner_optimizer_is_refused():
    with pytest.raises(ValueError, match="adamw, adamw8bit"):
        build_inner_optimizer("sgd", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert INNER_OPTIMIZERS == ("adamw", "adamw8bit")


@pytest.mark.timeout(120)
def test_bitsandbytes_imports_quietly_and_offline():
    """Its CPU backend would ask the Hugging Face Hub for a kernel at import and log the failure."""
    script = ("import os; os.environ.pop('HF_HUB_OFFLINE', None)\n"
              "from diloco_swarm.node.inner import import_bitsandbytes\n"
              "import sys; bnb = import_bitsandbytes(); print('kernels' in sys.modules and sys.modules['kernels'] is not None)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" and "Failed to load" not in out.stderr and out.stderr.strip() == "", out.stderr
