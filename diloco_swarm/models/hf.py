"""Hugging Face causal language models (``transformers``) behind the node's model interface.

The node calls ``model(x, y) -> (logits, loss)`` and reads ``model.config.block_size``
(see :class:`~diloco_swarm.models.gpt.GPT`); :class:`CausalLM` gives a ``transformers``
``*ForCausalLM`` that interface, so the DiLoCo loop does not change.

Presets follow OpenDiLoCo (Jaghouar et al. 2024, arXiv 2407.07852), which trained Llama models of
150M and 1.1B parameters (Hub configs ``PrimeIntellect/llama-150m-fresh`` and
``PrimeIntellect/llama-1b-fresh``); the vocabulary is the run's tokenizer's (rounded up to a
multiple of 64), not a fixed one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# "lazy": transformers (~0.6 s) loads on first use, and each class with its own module (LlamaConfig
# ~0.8 s, AutoModelForCausalLM ~0.3 s): node/export.py imports this module for every export.

# Shapes of LlamaConfig; vocab_size comes from the tokenizer. Parameter counts: tests/test_hf_models.py.
LLAMA_PRESETS: dict[str, dict[str, int]] = {
    # ~3.5M with a 512-token vocabulary: CPUs and tests.
    "llama-tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                       max_position_embeddings=1024),
    # OpenDiLoCo 150M (arXiv 2407.07852, Hub: PrimeIntellect/llama-150m-fresh).
    "llama-150m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                       max_position_embeddings=1024),
    # OpenDiLoCo 1.1B (arXiv 2407.07852, Hub: PrimeIntellect/llama-1b-fresh; TinyLlama's shape).
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     max_position_embeddings=2048),
}
VOCAB_MULTIPLE = 64  # embedding rows are padded to a multiple of this (faster matmuls)
# Keys of a config.json that do not change the model's maths (left out of its identity hash).
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                         "use_cache", "_attn_implementation_autoset", "output_attentions", "output_hidden_states",
                         "return_dict", "_commit_hash"}


@dataclass(frozen=True)
class LMConfig:
    """What the node reads of a model's shape: ``block_size`` (longest sequence, tokens) and ``vocab_size``."""

    block_size: int
    vocab_size: int


class CausalLM(nn.Module):
    """A ``transformers`` causal LM with the node's interface.

    Args:
        hf_model: a ``PreTrainedModel`` with a causal LM head (``AutoModelForCausalLM``).

    Attributes:
        hf: the wrapped model (its parameters are this module's, in the same order).
        config: :class:`LMConfig`; block_size is ``max_position_embeddings`` (or ``n_positions``).
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        c = hf_model.config
        block = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
        self.config = LMConfig(block_size=int(block), vocab_size=int(c.vocab_size))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits and, given targets, the mean cross-entropy.

        Args:
            idx: int64 token ids, shape [B, T], T <= config.block_size.
            targets: optional int64 ids of the next tokens, shape [B, T] (already shifted).

        Returns:
            (logits [B, T, vocab_size] in the parameters' or autocast dtype, loss: scalar nats/token or None).

        Raises:
            ValueError: idx is not 2-D, T exceeds block_size, or targets' shape differs.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.config.block_size}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must match idx shape {tuple(idx.shape)}")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:  # targets are already shifted: not the HF labels convention
            loss = F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss


def padded_vocab(n: int) -> int:
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def llama_config(preset: str, vocab_size: int):
    """``transformers.LlamaConfig`` of a preset with ``vocab_size`` embedding rows.

    Raises:
        ValueError: unknown preset.
    """
    from transformers import LlamaConfig  # lazy

    if preset not in LLAMA_PRESETS:
        raise ValueError(f"unknown Llama preset {preset!r}; choose one of: {', '.join(LLAMA_PRESETS)}")
    shape = LLAMA_PRESETS[preset]
    return LlamaConfig(vocab_size=vocab_size, num_key_value_heads=shape["num_attention_heads"],
                       tie_word_embeddings=False, rms_norm_eps=1e-5, **shape)


def model_from_config(config, seed: int, device: str = "cpu") -> CausalLM:
    """A freshly initialised model (``AutoModelForCausalLM.from_config``) in float32 on the CPU
    (``device="meta"``: the shapes alone, no memory).

    The same config and seed give bitwise identical parameters on the same torch build (the
    global torch RNG is left as it was), so peers start from one θ without transferring it.
    """
    from transformers import AutoModelForCausalLM  # lazy

    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return CausalLM(model.float().train())


def config_identity(config) -> str:
    """sha256 (16 hex) of the config's canonical JSON, without keys that do not change the maths."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_identity(model: nn.Module) -> str:
    """sha256 (16 hex) over the model's parameters (names, shapes, float32 bytes), in order."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(t.shape)}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()[:16]


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def load_pretrained(folder: Path) -> CausalLM:
    """``AutoModelForCausalLM.from_pretrained(folder)`` in float32 on the CPU, in training mode."""
    from transformers import AutoModelForCausalLM  # lazy
    from transformers.utils import logging as hf_logging  # lazy

    hf_logging.disable_progress_bar()  # no "Loading weights: 100%" bar in the node's log
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return CausalLM(model.float().train())


def save_config(config: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
