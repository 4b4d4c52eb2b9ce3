"""A small byte-level GPT, written in the style of nanoGPT's model.py.

The whole model lives in this one file: a frozen config dataclass, the
transformer blocks, the GPT module, named presets and a deterministic builder.

Sources:
  - Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"
    (GPT-2): pre-LayerNorm blocks, init std 0.02, residual projections scaled
    by 1/sqrt(2 * n_layer).
  - Karpathy, nanoGPT, model.py (https://github.com/karpathy/nanoGPT): layout,
    module names (c_attn, c_proj, c_fc, wte, wpe, ln_f) and weight tying.
  - Press & Wolf 2017, "Using the Output Embedding to Improve Language
    Models": tying the token embedding and the output head.
  - Vaswani et al. 2017, "Attention Is All You Need": scaled dot-product
    attention, here through torch.nn.functional.scaled_dot_product_attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS", "build_model", "num_parameters", "with_parameters"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model.

    Attributes:
        vocab_size: number of token ids; 256 because a token is one byte.
        block_size: longest sequence (tokens) the model accepts; it is also
            the number of learned position embeddings.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide n_embd.
        n_embd: width of the residual stream (channels).
        dropout: dropout probability used in training, in [0, 1).

    Raises:
        ValueError: if a size is not a positive int, n_embd is not a multiple
            of n_head, or dropout is outside [0, 1).
    """

    vocab_size: int = 256
    block_size: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            # bool is an int subclass; GPTConfig(n_layer=True) is a bug, not a size
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


# Parameter counts (with weight tying) are printed by tests/test_models.py.
PRESETS: dict[str, GPTConfig] = {
    # ~0.49M: fast enough for CPU tests and smoke runs.
    "tiny": GPTConfig(block_size=512, n_layer=2, n_head=4, n_embd=128),
    # ~11M: nanoGPT's "baby GPT" shape (shakespeare_char).
    "small": GPTConfig(block_size=1024, n_layer=6, n_head=6, n_embd=384),
    # ~100M: GPT-2 small width and head size, 14 layers instead of 12 because
    # the 256-entry byte vocabulary leaves the embeddings almost empty.
    "base": GPTConfig(block_size=1024, n_layer=14, n_head=12, n_embd=768),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: x[B, T, C] -> y[B, T, C]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # q, k and v for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model over bytes.

    Token and learned position embeddings, n_layer pre-LayerNorm blocks, a
    final LayerNorm and a bias-free output head whose weight is the token
    embedding (tied). Parameters are initialised GPT-2 style from the global
    torch RNG; use build_model() for a seeded, reproducible init.

    Args:
        config: model shape, see GPTConfig.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tie: one Parameter shared by input embedding and output head.
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # Each block adds two residual projections; scaling keeps the
        # residual stream's variance from growing with depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # LayerNorm keeps its default init: weight 1, bias 0.

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the mean loss.

        Args:
            idx: int64 token ids in [0, vocab_size), shape [B, T], on the
                model's device; T <= config.block_size.
            targets: optional int64 ids of the next tokens, shape [B, T]
                (usually idx shifted left by one).

        Returns:
            (logits, loss): logits has shape [B, T, vocab_size] and the
            dtype of the model's parameters (or of an active autocast);
            loss is a scalar float tensor, the mean cross-entropy in
            nats/token over all B*T positions, or None without targets.

        Raises:
            ValueError: if idx is not 2-D, T > config.block_size, or targets
                has a different shape than idx.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds the model's block_size "
                f"{self.config.block_size}; use seq_len <= {self.config.block_size}"
            )
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} must match idx shape {tuple(idx.shape)}"
            )

        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))

        loss = None
        if targets is not None:
            # reshape, not view: targets may be a non-contiguous slice
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def build_model(preset: str, seed: int, device: str = "cpu") -> GPT:
    """Build a preset GPT with a reproducible initialisation.

    Two calls with the same preset and seed return models with bitwise
    identical parameters (on the same torch build), so every peer can start
    from the same weights without transferring them. The global torch RNG is
    left exactly as it was.

    Args:
        preset: a key of PRESETS ("tiny", "small", "base").
        seed: any int accepted by torch.manual_seed.
        device: "cpu", or "meta" for the shapes alone (no memory, no initialisation).

    Returns:
        A GPT on ``device`` with float32 parameters, in training mode.

    Raises:
        ValueError: if preset is not a key of PRESETS.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    # Always init on the CPU (even under torch.set_default_device("cuda")):
    # CPU and CUDA generators give different numbers. devices=[] because no
    # CUDA RNG is used, so none needs saving.
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return GPT(PRESETS[preset])


def num_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in model; shared (tied) tensors count once.

    Args:
        model: any torch module (the count includes position embeddings).

    Returns:
        The parameter count (elements, not bytes).
    """
    # Module.parameters() already yields a shared Parameter only once.
    return sum(p.numel() for p in model.parameters())


class _WithParameters(nn.Module):
    """``model`` run with other tensors in place of its parameters (``torch.func.functional_call``)."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.model, self._tensors = model, tensors

    def forward(self, *args):
        return torch.func.functional_call(self.model, self._tensors, args)


def with_parameters(model: nn.Module, tensors: list[torch.Tensor]) -> nn.Module:
    """A module that runs ``model`` with ``tensors`` in place of its parameters (same order and shapes
    as ``model.parameters()``; tied parameters stay tied), without copying the model: the evaluation
    of θ_global beside a training θ_local. Tensors on another device or dtype than the parameter's
    are moved for the call (one copy); on the same device and dtype none is made.

    :raises ValueError: ``tensors`` has another count than the model's parameters.
    """
    named = list(model.named_parameters())
    if len(named) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for a model of {len(named)} parameters")
    return _WithParameters(model, {name: t.to(device=p.device, dtype=p.dtype) for (name, p), t in zip(named, tensors)})
