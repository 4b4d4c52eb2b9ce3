"""What a node trains: its tokenizer, data and model, built from ``--tokenizer``, ``--dataset`` and
``--model``, and their identities in the run spec.

Everything local that can fail is checked here, cheapest first (model config, tokenizer, vocabulary
fit, data, then the model's weights), before the node touches the network. The files that
``diloco-node export`` needs besides the checkpoint (the model's config.json and the tokenizer's
files) are kept in ``STATE_DIR/model/`` (node/export.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diloco_swarm.data.corpus import BatchSampler, Corpus, load_corpus
from diloco_swarm.data.corpus import held_out_batches as corpus_held_out_batches
from diloco_swarm.data.files import DatasetError
from diloco_swarm.data.hf_corpus import StreamSampler, load_hf_corpus, open_hub_stream, stream_held_out, token_dtype
from diloco_swarm.data.hf_source import is_hf_dataset, parse_hf_dataset
from diloco_swarm.data.tokenizer import BYTE, TOKENIZER_FILES, copy_tokenizer_files, load_tokenizer
from diloco_swarm.models.registry import BYTE_PRESETS, build, model_vocab_size, resolve_model
from diloco_swarm.spec import RunSpec

MODEL_DIR = "model"  # in the state dir: config.json, tokenizer files, run-assets.json
ASSETS_FILE = "run-assets.json"


class AssetError(DatasetError):
    """A user-facing problem with --model, --tokenizer or --dataset; one line."""


def default_tokenizer(model_arg: str, tokenizer_arg: str | None, model_folder: Path | None) -> str:
    """The ``--tokenizer`` to use when none was given.

    Byte presets: ``byte``. ``hf:`` models: the model folder's own tokenizer when it has one.
    Llama presets: none (their vocabulary follows the tokenizer, so the choice must be explicit).

    Raises:
        AssetError: no default applies.
    """
    if tokenizer_arg:
        return tokenizer_arg
    if model_arg in BYTE_PRESETS:
        return BYTE
    if model_folder is not None and any((model_folder / n).is_file() for n in TOKENIZER_FILES):
        return str(model_folder)
    raise AssetError(f"--model {model_arg} needs --tokenizer: a tokenizer.json, a tokenizer folder or a Hub id "
                     "(OpenDiLoCo used mistralai/Mistral-7B-v0.1's), or 'byte' for a 256-token byte vocabulary")


@dataclass
class RunAssets:
    """A node's tokenizer, data and model, and the run spec with their identities filled in.

    Attributes:
        spec: the run spec with ``model``, ``dataset``, ``tokenizer`` and ``vocab_size`` set.
        model: the model on the ``meta`` device: its shapes, ``model.config.block_size`` and parameter
            count, no memory. :meth:`build_model` gives the weights, once the node's child processes
            run (forked before any model-sized buffer exists, they share none of its pages).
        corpus: in-memory tokens (``Corpus``), or None for a streamed Hub dataset.
        description: the data's identity (RunSpec.dataset), also shown in the start line.
    """

    spec: RunSpec
    tokenizer: Any
    model: Any
    corpus: Any
    description: str
    hf_config: Any = None
    stream: tuple[Callable[[], Any], str] | None = None  # (open_stream, column)
    held_out_stream_tokens: Any = None
    build: Callable[[], Any] | None = None  # -> the float32 CPU module with its weights

    def build_model(self):
        """The model with its weights: float32 CPU module, ``model(x, y) -> (logits, loss)``; the run's
        seed gives every peer the same θ_0. :raises ModelError: the weights cannot be loaded."""
        return self.build()

    def sampler(self, batch_size: int, seq_len: int, seed: int, stream_id: str):
        """Per-peer training batches: ``batches_for_outer_step(outer_step, n)`` (data/corpus.py contract)."""
        if self.stream is not None:
            open_stream, column = self.stream
            return StreamSampler(open_stream, column, self.tokenizer, batch_size, seq_len, seed, stream_id)
        return BatchSampler(self.corpus.train, batch_size, seq_len, seed=seed, stream_id=stream_id)

    def held_out_batches(self, batch_size: int, seq_len: int, n_batches: int):
        tokens = self.corpus.held_out if self.stream is None else self.held_out_stream_tokens
        return corpus_held_out_batches(tokens, batch_size, seq_len, n_batches)

    def save_for_export(self, state_dir: Path) -> None:
        """Keep the config.json and tokenizer files next to the checkpoint (``state_dir/model/``)."""
        out = state_dir / MODEL_DIR
        out.mkdir(parents=True, exist_ok=True)
        if self.hf_config is not None:
            self.hf_config.save_pretrained(str(out))
        files = copy_tokenizer_files(self.tokenizer, out)
        info = {"model": self.spec.model, "tokenizer": self.spec.tokenizer, "vocab_size": self.spec.vocab_size,
                "tokenizer_files": files}
        tmp = out / f".{ASSETS_FILE}.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, out / ASSETS_FILE)


def build_run_assets(spec: RunSpec, *, dataset: str | None, tokenizer_arg: str | None, max_bytes: int | None,
                     log: Callable[[str], None]) -> RunAssets:
    """Load the tokenizer, the data and the model of a run; return them with the completed spec.

    Args:
        spec: the run spec from the command line; ``spec.model`` is the ``--model`` argument.
        dataset: ``--dataset`` (None: the Python standard library); ``hf:...`` goes through ``datasets``.
        tokenizer_arg: ``--tokenizer`` or None (:func:`default_tokenizer`).
        max_bytes: ``--max-dataset-bytes``.
        log: one-line progress messages.

    Raises:
        DatasetError (AssetError, TokenizerError), ModelError: one line each.
    """
    source = resolve_model(spec.model)
    tok = load_tokenizer(default_tokenizer(spec.model, tokenizer_arg, source.folder))
    vocab = model_vocab_size(source, tok.vocab_size, tok.is_byte)

    stream = held_out_stream = None
    if is_hf_dataset(dataset):
        hf_source = parse_hf_dataset(dataset)
        if hf_source.local_path is not None:
            corpus = _with_progress(log, f"tokenizing {hf_source.label()}",
                                    lambda progress: _load_local(hf_source, tok, max_bytes, progress))
            description = corpus.description
        else:
            log(f"opening {hf_source.label()} from the Hugging Face Hub (streaming)")
            open_stream = open_hub_stream(hf_source)
            stream = (open_stream, hf_source.column)
            held_out_stream = stream_held_out(open_stream, hf_source.column, tok)
            corpus, description = None, hf_source.label()
    else:
        corpus = load_corpus(dataset, max_bytes=max_bytes)
        if not tok.is_byte:
            corpus = _with_progress(log, f"tokenizing {corpus.description}",
                                    lambda progress: _tokenize_byte_corpus(corpus, tok, progress))
        description = corpus.description
    if corpus is not None:
        corpus.check(spec.seq_len)
    elif len(held_out_stream) < spec.seq_len + 1:
        raise AssetError(f"dataset {description}: found only {len(held_out_stream)} held-out tokens at the head of "
                         f"the stream but --seq-len {spec.seq_len} needs {spec.seq_len + 1}")

    built = build(source, spec.seed, vocab, device="meta")
    built.module.to("meta")  # (an hf: folder's weights were loaded for their identity: freed now)
    if not tok.is_byte:
        log(f"tokenizer {tok.identity} ({tok.vocab_size} tokens) from {tok.source}; model vocabulary {vocab}")
    spec = spec.model_copy(update={"model": built.identity, "dataset": description, "tokenizer": tok.identity,
                                   "vocab_size": built.vocab_size})
    return RunAssets(spec=spec, tokenizer=tok, model=built.module, corpus=corpus, description=description,
                     hf_config=built.hf_config, stream=stream, held_out_stream_tokens=held_out_stream,
                     build=lambda: build(source, spec.seed, vocab).module)


def _load_local(source, tok, max_bytes, progress):
    return load_hf_corpus(source, tok, max_bytes=max_bytes, progress=progress)


def _tokenize_byte_corpus(corpus, tok, progress):
    """Re-tokenize a text-file corpus (bytes) with a Hugging Face tokenizer, in 64 KiB line-aligned chunks."""
    dtype = token_dtype(tok.vocab_size)

    def encode(data) -> np.ndarray:
        text = bytes(data).decode("utf-8", "replace")
        chunks, start = [], 0
        while start < len(text):
            end = text.find("\n", start + (1 << 16))
            end = len(text) if end < 0 else end + 1
            chunks.append(text[start:end])
            start = end
        ids = tok.encode_batch(chunks)
        return np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)

    train = encode(corpus.train)
    progress(1, 2)
    held = encode(corpus.held_out)
    progress(2, 2)
    return Corpus(description=corpus.description, train=train, held_out=held, n_files=corpus.n_files)


def _with_progress(log: Callable[[str], None], what: str, work: Callable[[Callable[[int, int], None]], Any]):
    """Run ``work(progress)`` under a rich progress bar on stderr (when it is a terminal); log the outcome."""
    t0 = time.monotonic()  # no line before the work: a bad dataset must end in one error line only
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(what, total=None)
        result = work(lambda done, total: bar.update(task, completed=done, total=total))
    log(f"{what}: {len(result.train) + len(result.held_out):,} tokens ({len(result.held_out):,} held out) "
        f"in {time.monotonic() - t0:.1f}s")
    return result
