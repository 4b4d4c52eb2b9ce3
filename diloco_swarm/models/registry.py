"""``--model``: byte-level GPT presets, Llama presets, or ``hf:PATH_OR_ID``; their identity in the run spec.

    tiny | small | base                 byte-level GPT (models/gpt.py); vocabulary 256, tokenizer ``byte`` only
    llama-tiny | llama-150m | llama-1b  transformers LlamaForCausalLM from a config (models/hf.py), initialised
                                        from the run's seed; vocabulary = the tokenizer's, rounded up to 64
    hf:PATH_OR_ID                       a causal LM config.json (local folder, or Hub id when online); its
                                        weights, when the folder has them, are the starting θ_global

Identity (RunSpec.model): the preset name, or ``hf:config=<16 hex>`` plus ``,weights=<16 hex>`` when
weights were loaded, so peers holding other configs or weights refuse each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_swarm.data.tokenizer import (TOKENIZER_FILES, TokenizerError, _first_line, _looks_like_hub_id,
                                         fetch_from_hub, hub_offline)

if TYPE_CHECKING:
    from torch import nn

# "lazy": torch (~1.5 s) and transformers (~0.6 s) load only where a model is built or an hf: config
# read; join's --model check (cli/precheck.py) imports this module before the node loads them.

BYTE_PRESETS = ("tiny", "small", "base")
LLAMA_PRESET_NAMES = ("llama-tiny", "llama-150m", "llama-1b")  # keys of models.hf.LLAMA_PRESETS
HF_PREFIX = "hf:"
MODEL_CHOICES = (*BYTE_PRESETS, *LLAMA_PRESET_NAMES, "hf:PATH_OR_ID")


class ModelError(ValueError):
    """A user-facing model problem; the message is one line."""


@dataclass
class ModelSource:
    """A resolved ``--model``: kind is "byte", "llama" or "hf"; folder/config only for "hf"."""

    arg: str
    kind: str
    folder: Path | None = None
    config: Any = None


@dataclass
class BuiltModel:
    """A model ready to train, and what the run spec and the export need of it.

    Attributes:
        module: float32 CPU module with the node's interface (``model(x, y) -> (logits, loss)``).
        identity: RunSpec.model.
        vocab_size: RunSpec.vocab_size (embedding rows).
        hf_config: the transformers config (None for the byte presets).
    """

    module: "nn.Module"
    identity: str
    vocab_size: int
    hf_config: Any = None


def model_problem(arg: str) -> str | None:
    """Cheap check of ``--model`` (no heavy import): why it is not a model, or None."""
    if arg in BYTE_PRESETS or arg in LLAMA_PRESET_NAMES:
        return None
    if arg.startswith(HF_PREFIX):
        name = arg[len(HF_PREFIX):]
        path = Path(os.path.expanduser(name))
        if path.exists():
            if not (path / "config.json").is_file():
                return f"--model {arg!r}: the folder has no config.json; pass a folder written by save_pretrained"
            return None
        if not _looks_like_hub_id(name):
            return f"--model {arg!r}: {name!r} does not exist; pass a local model folder or a Hub id (org/name)"
        if hub_offline():
            return (f"--model {arg!r} is a Hugging Face Hub id, but this machine is offline (HF_HUB_OFFLINE=1) "
                    "and hf: models are read from a local folder then; pass a local folder")
        return None
    return f"--model {arg!r} is not a model; choose one of: {', '.join(MODEL_CHOICES)}"


def resolve_model(arg: str) -> ModelSource:
    """Resolve ``--model``; for ``hf:`` read its config (fetching config and weights from the Hub for an id).

    Raises:
        ModelError: unknown name, missing folder or config, offline Hub id, unreadable config.
    """
    problem = model_problem(arg)
    if problem:
        raise ModelError(problem)
    if arg in BYTE_PRESETS:
        return ModelSource(arg, "byte")
    if arg in LLAMA_PRESET_NAMES:
        return ModelSource(arg, "llama")
    name = arg[len(HF_PREFIX):]
    folder = Path(os.path.expanduser(name))
    if not folder.exists():
        try:
            folder = fetch_from_hub(name, what="--model", allow_patterns=[
                "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                *TOKENIZER_FILES])
        except TokenizerError as e:
            raise ModelError(str(e)) from None
    try:
        from transformers import AutoConfig  # lazy: transformers

        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ModelError(f"--model {arg!r}: config.json cannot be read: {_first_line(e)}") from None
    _require_causal_lm(arg, config)
    return ModelSource(arg, "hf", folder, config)


CAUSAL_ARCHITECTURE_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # transformers' names of next-token heads


def _require_causal_lm(arg: str, config: Any) -> None:
    """DiLoCo's inner steps train next-token prediction: an encoder (BERT's masked LM) or an
    encoder-decoder config would build and then train something else.
    :raises ModelError: the config says so (``is_encoder_decoder``, or ``architectures`` with no
        causal LM head); a config without ``architectures`` is taken at its word."""
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"--model {arg!r} is an encoder-decoder model ({config.model_type}), not a causal language "
                         f"model; DiLoCo here trains next-token prediction: use a decoder-only config "
                         f"(its architectures end in {' or '.join(CAUSAL_ARCHITECTURE_SUFFIXES)})")
    names = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if names and not any(a.endswith(CAUSAL_ARCHITECTURE_SUFFIXES) for a in names):
        raise ModelError(f"--model {arg!r} is {', '.join(names)}, not a causal language model; DiLoCo here trains "
                         f"next-token prediction: use a decoder-only config (its architectures end in "
                         f"{' or '.join(CAUSAL_ARCHITECTURE_SUFFIXES)})")


def model_vocab_size(source: ModelSource, tokenizer_vocab: int, tokenizer_is_byte: bool) -> int:
    """Embedding rows of the model for a tokenizer of ``tokenizer_vocab`` ids.

    Raises:
        ModelError: a byte preset with another tokenizer, or a model vocabulary smaller than the tokenizer's.
    """
    if source.kind == "byte":
        if not tokenizer_is_byte:
            raise ModelError(f"--model {source.arg} is a byte-level preset (256 tokens); use --tokenizer byte, or a "
                             f"llama-* preset or an hf: model with this tokenizer")
        return 256
    if source.kind == "llama":
        from diloco_swarm.models.hf import padded_vocab  # lazy: torch

        return padded_vocab(tokenizer_vocab)
    vocab = int(getattr(source.config, "vocab_size", 0) or 0)
    if tokenizer_vocab > vocab:
        raise ModelError(f"the tokenizer has {tokenizer_vocab} tokens but the vocabulary of --model {source.arg} "
                         f"holds {vocab}; use the model's own tokenizer or a model with vocab_size >= {tokenizer_vocab}")
    return vocab


def build(source: ModelSource, seed: int, vocab_size: int, device: str = "cpu") -> BuiltModel:
    """Build the model of a resolved source (float32, CPU, training mode).

    ``device="meta"`` gives the shapes alone (no memory, no initialisation), except for an ``hf:``
    folder with weights: its identity hashes the weights, so they are loaded (then freed by the caller).

    Raises:
        ModelError: an hf: config that is not a causal LM, or weights that cannot be loaded.
    """
    if source.kind == "byte":
        from diloco_swarm.models.gpt import build_model  # lazy: torch

        return BuiltModel(build_model(source.arg, seed=seed, device=device), source.arg, 256)
    from diloco_swarm.models import hf  # lazy: torch

    if source.kind == "llama":
        config = hf.llama_config(source.arg, vocab_size)
        return BuiltModel(hf.model_from_config(config, seed, device), source.arg, vocab_size, config)
    assert source.folder is not None
    try:
        if hf.has_weights(source.folder):
            module = hf.load_pretrained(source.folder)
            identity = f"hf:config={hf.config_identity(source.config)},weights={hf.weights_identity(module)}"
        else:
            module = hf.model_from_config(source.config, seed, device)
            identity = f"hf:config={hf.config_identity(source.config)}"
    except Exception as e:
        raise ModelError(f"--model {source.arg!r} cannot be built as a causal language model: {_first_line(e)}") from None
    return BuiltModel(module, identity, vocab_size, source.config)
