"""Model definitions: a byte-level GPT with named size presets (gpt), Hugging Face causal LMs (hf), and
``--model`` resolution (registry).

Names from ``gpt`` are imported on first use, so ``registry``'s cheap checks do not import torch.
"""

_FROM_GPT = ("GPT", "GPTConfig", "PRESETS", "build_model", "num_parameters", "with_parameters")

__all__ = list(_FROM_GPT)


def __getattr__(name: str):
    if name in _FROM_GPT:
        from diloco_swarm.models import gpt  # on first use: torch (module docstring)

        return getattr(gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
