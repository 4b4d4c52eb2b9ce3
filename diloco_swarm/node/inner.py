"""The inner optimizer: AdamW (DiLoCo, arXiv 2311.08105), in full precision or in 8 bits.

``adamw8bit`` is bitsandbytes' ``AdamW8bit`` (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861): both moments in uint8 with one float32 absmax per block of 256,
2 B/param instead of AdamW's 8, so a 1B model's training state fits a consumer GPU. It is local to
the peer (like ``--batch-size``): its state never leaves it and is not in the run spec.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # (the CLI reads INNER_OPTIMIZERS without importing torch)
    import torch

INNER_OPTIMIZERS = ("adamw", "adamw8bit")
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


class InnerOptimizerError(Exception):
    """The chosen inner optimizer cannot run here (one line)."""


def build_inner_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW over ``params`` (betas 0.9/0.95, weight decay 0.1), the moments in fp32 (``adamw``,
    8 B/param) or uint8 (``adamw8bit``, 2 B/param plus 4 B per 256 values).

    :raises ValueError: an unknown ``name``.
    :raises InnerOptimizerError: ``adamw8bit`` without bitsandbytes installed.
    """
    import torch  # here, not at the top: the CLI imports INNER_OPTIMIZERS for --help (torch ~1.5 s)

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if name == "adamw8bit":
        return import_bitsandbytes().optim.AdamW8bit(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown inner optimizer {name!r}; choose one of {', '.join(INNER_OPTIMIZERS)}")


def import_bitsandbytes():
    """``import bitsandbytes``, quiet and offline: its CPU backend would fetch a kernel from the
    Hugging Face Hub at import (the ``kernels`` package) and log a warning when that fails; neither
    belongs on a volunteer's screen, and the node fetches nothing at run time.

    :raises InnerOptimizerError: bitsandbytes is not installed.
    """
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    hidden = "kernels" not in sys.modules
    if hidden:
        sys.modules["kernels"] = None  # ImportError inside bitsandbytes: no Hub call
    try:
        import bitsandbytes  # only when chosen (adamw8bit), with the Hub kernels hidden as above
    except ImportError as e:
        raise InnerOptimizerError(f"--inner-optimizer adamw8bit needs bitsandbytes ({e}); install it with "
                                  "pip install bitsandbytes, or use --inner-optimizer adamw") from None
    finally:
        quiet.setLevel(level)
        if hidden:
            with contextlib.suppress(KeyError):
                del sys.modules["kernels"]
    return bitsandbytes
