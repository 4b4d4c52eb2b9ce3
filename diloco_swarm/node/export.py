"""``diloco-node export``: θ_global of a node's checkpoint as a Hugging Face model folder.

The folder holds ``config.json``, ``model.safetensors`` (``save_pretrained``) and the run's tokenizer
files, so ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it. Llama presets and
``hf:`` models export their own config (kept in ``STATE_DIR/model/`` by node/assets.py). The
byte-level presets (tiny, small, base) export as GPT-2 (``GPT2LMHeadModel``): the nanoGPT layout maps
onto it with its Linear weights transposed to GPT-2's Conv1D, and the exact (erf) GELU; their
tokenizer is bytes (token id = byte value), so no tokenizer files are written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from diloco_swarm.data.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer
from diloco_swarm.models import hf
from diloco_swarm.models.gpt import build_model
from diloco_swarm.models.registry import BYTE_PRESETS, LLAMA_PRESET_NAMES
from diloco_swarm.node.assets import ASSETS_FILE, MODEL_DIR
from diloco_swarm.node.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from diloco_swarm.node.model_card import CARD_NAME, loss_curve, merged_curve, model_card
from diloco_swarm.spec import RunSpec

# "lazy": transformers (~0.6 s) and its classes (AutoConfig ~0.3 s, GPT-2's ~1.2 s) load on first use:
# an export, and node_model (tests), load only those of their model.

EXPORT_INFO = "diloco-export.json"
METRICS_NAME = "metrics.jsonl"  # export reads STATE_DIR/metrics.jsonl for the card's loss curve unless told another
_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class ExportError(Exception):
    """The export cannot be made; the message is one line (nothing is written)."""


def read_global_state(state_dir: Path) -> tuple[Any, list[torch.Tensor], dict[str, Any]]:
    """(RunSpec, θ_global as fp32 CPU tensors in parameter order, the checkpoint) of a state dir.

    Raises:
        ExportError: no state dir or no checkpoint, or a checkpoint without a valid spec or θ.
        CheckpointError: the checkpoint is corrupt or truncated.
    """
    if not state_dir.is_dir():
        raise ExportError(f"--state-dir {state_dir} does not exist; pass the --state-dir of a node that trained")
    ckpt = load_checkpoint(checkpoint_path(state_dir))
    if ckpt is None:
        raise ExportError(f"--state-dir {state_dir} holds no checkpoint ({checkpoint_path(state_dir).name}); a node "
                          "writes one after its first outer step")
    try:
        spec = RunSpec.model_validate(ckpt.get("spec"))
        theta = ckpt["outer"]["theta"]
        if not isinstance(theta, list) or not all(torch.is_tensor(t) for t in theta):
            raise TypeError("θ_global is not a list of tensors")
    except (ValidationError, KeyError, TypeError) as e:
        raise ExportError(f"checkpoint {checkpoint_path(state_dir)} has no valid run spec or θ_global "
                          f"({type(e).__name__}); it is not a diloco-swarm node checkpoint") from None
    return spec, theta, ckpt


def node_model(state_dir: Path) -> tuple[nn.Module, Any, Any]:
    """The node's own model holding θ_global: ``(module, spec, transformers config or None)``.

    ``module(x, y) -> (logits, loss)`` as in training (float32, CPU, eval mode).

    Raises:
        ExportError, CheckpointError: see :func:`read_global_state`; a model config that is missing
            (an hf: model whose ``STATE_DIR/model/config.json`` is gone) or θ that does not fit it.
    """
    spec, theta, _ = read_global_state(state_dir)
    if spec.model in BYTE_PRESETS:
        module, config = build_model(spec.model, seed=0), None
    else:
        folder = state_dir / MODEL_DIR
        if (folder / "config.json").is_file():
            from transformers import AutoConfig  # lazy

            config = AutoConfig.from_pretrained(str(folder))
        elif spec.model in LLAMA_PRESET_NAMES:
            config = hf.llama_config(spec.model, spec.vocab_size)
        else:
            raise ExportError(f"{folder / 'config.json'} is missing: the model config of '{spec.model}' is needed; "
                              "restart the node once with the same --model to write it again")
        module = hf.model_from_config(config, seed=0)
    params = list(module.parameters())
    if len(params) != len(theta) or any(p.shape != t.shape for p, t in zip(params, theta)):
        raise ExportError(f"θ_global in {checkpoint_path(state_dir)} ({len(theta)} tensors) does not fit model "
                          f"'{spec.model}' ({len(params)} tensors); the model config in {state_dir / MODEL_DIR} "
                          "belongs to another run")
    with torch.no_grad():
        for p, t in zip(params, theta):
            p.copy_(t.to(torch.float32))
    return module.eval(), spec, config


def gpt_to_gpt2(module: nn.Module):
    """A ``transformers.GPT2LMHeadModel`` holding a byte-level GPT's weights (see the module docstring).

    Raises:
        ExportError: the weights do not map (a GPT-2 of this transformers version lacks a parameter).
    """
    from transformers import GPT2Config, GPT2LMHeadModel  # lazy

    c = module.config
    config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                        n_head=c.n_head, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    gpt2 = GPT2LMHeadModel(config)
    mapped = {}
    for name, tensor in module.state_dict().items():
        mapped[name] = tensor.t().contiguous() if name.endswith(_GPT2_TRANSPOSED) else tensor
    missing, unexpected = gpt2.load_state_dict(mapped, strict=False)
    params = {n for n, _ in gpt2.named_parameters()}
    if unexpected or any(m in params for m in missing):
        raise ExportError(f"the byte-level GPT does not map onto transformers' GPT-2 (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    return gpt2.eval()


def export_model(state_dir: Path, out: Path, metrics_file: Path | None = None) -> dict[str, Any]:
    """Write θ_global of ``state_dir``'s checkpoint as a Hugging Face model folder ``out``, with its model
    card (``README.md``: node/model_card.py).

    The folder is written next to ``out`` and renamed into place, so ``out`` is complete or absent.
    ``metrics_file``: the node's ``--metrics-file``, for the card's held-out loss curve (default
    ``STATE_DIR/metrics.jsonl``; a missing file leaves the curve out).

    Returns:
        what was exported: model identity, outer step, architecture, files written.

    Raises:
        ExportError: see :func:`node_model`; ``out`` exists and is not empty; ``out`` cannot be
            written (the disk write failed; ``out`` is not created).
        CheckpointError: a corrupt checkpoint.
    """
    if metrics_file is not None and not metrics_file.is_file():
        what = "is not a file" if metrics_file.exists() else "does not exist"
        raise ExportError(f"--metrics-file {metrics_file} {what}; give the node's --metrics-file, or leave it out "
                          "(the checkpoint keeps the held-out loss curve)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is an existing file; choose a new folder (nothing was written)")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} already exists and is not empty; choose a new folder (nothing was written)")
    try:  # before the checkpoint is read (seconds): an unwritable --out is said at once
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:  # the message names --out, not the temp folder next to it
        raise ExportError(f"--out {out} cannot be written ({e.strerror or type(e).__name__}); choose a writable "
                          "folder (nothing was written)") from None
    try:
        module, spec, config = node_model(state_dir)
        _, _, ckpt = read_global_state(state_dir)
        hf_model = gpt_to_gpt2(module) if config is None else module.hf
        from transformers.utils import logging as hf_logging  # lazy

        hf_logging.disable_progress_bar()  # one summary line from the CLI instead
        tokenizer_files = _copy_tokenizer(state_dir / MODEL_DIR, tmp)
        if config is not None and tokenizer_files:
            _use_tokenizer_special_ids(hf_model, tmp)
        hf_model.save_pretrained(str(tmp), safe_serialization=True)
        info = {"model": spec.model, "tokenizer": spec.tokenizer, "vocab_size": spec.vocab_size,
                "architecture": type(hf_model).__name__, "run_id": spec.run_id, "dataset": spec.dataset,
                "outer_step": int(ckpt.get("outer_step", 0)), "tokens_total": int(ckpt.get("tokens_total", 0)),
                "tokenizer_files": tokenizer_files,
                "note": "token id = byte value (UTF-8)" if spec.tokenizer == "byte" else None}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        curve = merged_curve(ckpt.get("eval_curve"),
                             loss_curve(metrics_file or state_dir / METRICS_NAME, str(ckpt.get("peer_id") or "") or None))
        (tmp / CARD_NAME).write_text(model_card(spec, ckpt, info, curve), encoding="utf-8")
        _follow_umask(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and str(e.filename or tmp).startswith(str(tmp)):  # disk full, quota: name --out
            raise ExportError(f"--out {out} cannot be written ({e.strerror or type(e).__name__}); "
                              "nothing was written") from None
        raise
    info["files"] = sorted(p.name for p in out.iterdir())
    return info


def _follow_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes of a folder and files the user made (0755 and 0644
    under a umask of 022): an export is made to be shared. mkdtemp made the folder 0700, and a writer may
    make its file 0600; only secrets stay that way (invites.write_private: keys, invitations)."""
    umask = os.umask(0o022)  # reading the umask sets it: put it back at once (export runs no other thread that writes)
    os.umask(umask)
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _use_tokenizer_special_ids(hf_model, folder: Path) -> None:
    """Set the model's bos/eos/pad token ids (config and generation config) to the run's tokenizer's.

    A preset's ``LlamaConfig`` keeps transformers' defaults (bos 1, eos 2), which name other tokens
    of a run's own tokenizer: ``generate()`` would stop on the wrong one. Training never reads them.
    """
    try:
        tok = load_tokenizer(str(folder))._hf
    except TokenizerError:
        return  # the folder is exported as it is; the ids stay the config's
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    for target in (hf_model.config, getattr(hf_model, "generation_config", None)):
        if target is not None:
            for name, value in ids.items():
                setattr(target, name, value)


def _copy_tokenizer(folder: Path, out: Path) -> list[str]:
    names = []
    info = folder / ASSETS_FILE
    if info.is_file():
        try:
            names = [n for n in json.loads(info.read_text()).get("tokenizer_files", []) if n in TOKENIZER_FILES]
        except (ValueError, AttributeError):
            names = []
    names = names or [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    copied = []
    for n in names:
        if (folder / n).is_file():
            shutil.copyfile(folder / n, out / n)
            copied.append(n)
    return copied


__all__ = ["ExportError", "CheckpointError", "export_model", "node_model", "read_global_state", "gpt_to_gpt2"]
