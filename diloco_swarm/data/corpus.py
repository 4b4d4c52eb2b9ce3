"""Byte-level text corpora, per-peer batch sampling and held-out evaluation.

A token is one byte (0..255) of a file's content, so no tokenizer has to be
agreed on or shipped between peers. Everything here is deterministic from
(files, seed, peer id, outer step): a peer that restarts at outer step k reads
exactly the batches it would have read, and every peer evaluates on the same
held-out windows.

Sources:
  - Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models": each worker trains on its own data shard/order and all
    workers are evaluated on one shared validation set.
  - Karpathy, nanoGPT, train.py get_batch(): random windows x = data[i:i+T],
    y = data[i+1:i+T+1].
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from diloco_swarm.data.files import DatasetError, list_dataset_files

__all__ = [
    "DatasetError",
    "Corpus",
    "load_corpus",
    "BatchSampler",
    "held_out_batches",
    "evaluate",
]

# Bytes inspected for NUL when deciding that a file is binary (like git/grep).
_BINARY_SNIFF_BYTES = 8192
# A file goes to held-out when sha256(relative path) % _HELD_OUT_MODULUS == 0 (~2%).
_HELD_OUT_MODULUS = 50


@dataclass
class Corpus:
    """A loaded byte corpus split into training and held-out tokens.

    Attributes:
        description: identifies the data so peers can compare: "python-stdlib"
            for the default corpus, else
            "files:<n_files>:<total_bytes>:<8 hex of sha256 over (path, size)>".
        train: uint8, 1-D; the training files joined by a b"\\n" byte.
        held_out: uint8, 1-D; the held-out files joined by a b"\\n" byte (or
            the last 5% of the bytes when there is a single file).
        n_files: number of non-empty text files loaded (both splits).
        label: what the user named (``--dataset``'s path or glob), for messages; "" = ``description``.
    """

    description: str
    train: np.ndarray
    held_out: np.ndarray
    n_files: int
    label: str = ""

    def check(self, seq_len: int) -> None:
        """Check that both splits can hold one training window.

        Args:
            seq_len: tokens per training sequence; a window needs seq_len + 1
                bytes (inputs plus the shifted targets).

        Raises:
            ValueError: if seq_len is not a positive int.
            DatasetError: if train or held_out has fewer than seq_len + 1 bytes.
        """
        _check_positive_int("seq_len", seq_len)
        need = seq_len + 1
        unit = "bytes" if self.train.dtype == np.uint8 else "tokens"  # hf_corpus.py: token ids
        name = repr(self.label) if self.label else self.description  # the user's words, not the identity
        if len(self.train) < need:
            raise DatasetError(
                f"dataset {name} has only {len(self.train)} training {unit} but "
                f"seq_len {seq_len} needs at least {need}; use more text or a smaller seq_len"
            )
        if len(self.held_out) < need:
            raise DatasetError(
                f"dataset {name} has only {len(self.held_out)} held-out {unit} but "
                f"seq_len {seq_len} needs at least {need}; use more or larger files or documents "
                f"(the held-out part is about 1 in {_HELD_OUT_MODULUS}, else the last one) "
                f"or a smaller seq_len"
            )


def load_corpus(dataset: str | os.PathLike | None, *, max_bytes: int | None = None) -> Corpus:
    """Load a byte-level corpus and split it into training and held-out parts.

    Args:
        dataset: None for the built-in default, the .py files of the running
            interpreter's standard library (without site-packages,
            test/tests/idlelib folders and __pycache__). Otherwise a path to a
            text file, to a folder (every regular file below it, skipping
            hidden files and folders), or a glob pattern (recursive "**"
            allowed). Files whose first 8 KiB contain a NUL byte are treated
            as binary and skipped; "~" is expanded.
        max_bytes: if given, read at most this many bytes of file content
            (files in sorted order, the last one cut); for tests and smoke runs.

    Returns:
        A Corpus. Files are ordered by their path relative to the dataset
        root (a file's root is its folder; a glob's root is its leading part
        without wildcards), so peers holding the same files at different
        absolute paths get the same bytes, split and description. The
        held-out part holds the files with sha256(relative path) % 50 == 0,
        or the last file when that would leave either part empty, or the last
        5% of the bytes when only one file was loaded.

    Raises:
        DatasetError: if the path does not exist, the glob matches no file,
            a folder has no files, every file is empty or binary, a file
            cannot be read, or max_bytes is not a positive int.
    """
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0
    ):
        raise DatasetError(f"max_bytes must be a positive number of bytes, got {max_bytes!r}")

    files, label, description = list_dataset_files(dataset)
    loaded = _read_files(files, max_bytes)
    if not loaded:
        raise DatasetError(
            f"dataset {label!r} has no usable text: its {len(files)} file(s) are all empty or "
            f"binary (NUL bytes in the first 8 KiB); point it at UTF-8 text files"
        )

    if description is None:
        total = sum(len(data) for _, data in loaded)
        pairs = sorted((rel, len(data)) for rel, data in loaded)
        digest = hashlib.sha256(json.dumps(pairs).encode("ascii")).hexdigest()[:8]
        description = f"files:{len(loaded)}:{total}:{digest}"

    if len(loaded) == 1:
        data = loaded[0][1]
        # max(1, ...) so that any file of 2+ bytes has a non-empty held-out part
        cut = len(data) - max(1, len(data) // 20)
        train = np.frombuffer(data, dtype=np.uint8, count=cut).copy()
        held_out = np.frombuffer(data, dtype=np.uint8, offset=cut).copy()
    else:
        is_held = [_held_out_hash(rel) % _HELD_OUT_MODULUS == 0 for rel, _ in loaded]
        if all(is_held) or not any(is_held):
            is_held = [False] * (len(loaded) - 1) + [True]
        train = _join([data for (_, data), h in zip(loaded, is_held) if not h])
        held_out = _join([data for (_, data), h in zip(loaded, is_held) if h])

    return Corpus(description=description, train=train, held_out=held_out, n_files=len(loaded), label=str(label))


def _held_out_hash(rel: str) -> int:
    # surrogateescape: Linux file names need not be valid UTF-8
    return int(hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest(), 16)


def _read_files(files: list[tuple[str, str]], max_bytes: int | None) -> list[tuple[str, bytes]]:
    loaded: list[tuple[str, bytes]] = []
    remaining = max_bytes
    for rel, full in files:
        if remaining == 0:
            break
        try:
            with open(full, "rb") as f:
                # read at least the sniff window so the binary test ignores the cut
                want = -1 if remaining is None or remaining >= sys.maxsize else max(remaining, _BINARY_SNIFF_BYTES)
                data = f.read(want)
        except OSError as e:
            raise DatasetError(
                f"cannot read dataset file {full!r}: {e.strerror or e}; fix its permissions "
                f"or remove it"
            ) from e
        if not data or b"\0" in data[:_BINARY_SNIFF_BYTES]:
            continue
        if remaining is not None:
            data = data[:remaining]
            remaining -= len(data)
        loaded.append((rel, data))
    return loaded


def _join(parts: list[bytes]) -> np.ndarray:
    # Preallocate instead of b"\n".join() + copy: one pass, one buffer.
    out = np.empty(sum(map(len, parts)) + max(len(parts) - 1, 0), dtype=np.uint8)
    pos = 0
    for i, data in enumerate(parts):
        if i:
            out[pos] = ord("\n")
            pos += 1
        out[pos : pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        pos += len(data)
    return out


class BatchSampler:
    """Random training windows whose order depends only on (seed, stream_id, outer_step).

    There is no sampler state to checkpoint: a peer that resumes at outer
    step k draws exactly the batches it drew (or would have drawn) the first
    time. Peers pass their peer id as stream_id so each reads its own order.
    Determinism holds for a given numpy version (numpy's Generator streams
    are not promised to be identical across releases).

    Args:
        tokens: 1-D integer array of token ids (normally Corpus.train, uint8);
            kept by reference, not copied.
        batch_size: sequences per batch (B).
        seq_len: tokens per sequence (T).
        seed: run-wide seed shared by all peers.
        stream_id: identifies this reader, e.g. the peer id.

    Raises:
        ValueError: if batch_size or seq_len is not a positive int, or tokens
            is not a 1-D integer array.
        DatasetError: if tokens has fewer than seq_len + 1 entries.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, stream_id: str
    ) -> None:
        _check_positive_int("batch_size", batch_size)
        self.tokens = _check_tokens(tokens, seq_len)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = int(seed)
        self.stream_id = str(stream_id)

    def batches_for_outer_step(
        self, outer_step: int, n: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the n batches of one outer step.

        Batches are drawn one after another from one generator, so the first
        k batches are the same for any n >= k.

        Args:
            outer_step: index of the outer (DiLoCo) step, >= 0.
            n: number of batches, usually the inner steps per outer step; >= 0.

        Yields:
            (x, y): int64 CPU tensors of shape [batch_size, seq_len], with
            y[:, t] the token after x[:, t]; windows start uniformly at random.

        Raises:
            ValueError: if outer_step or n is negative or not an int (raised
                at the call, not at the first next()).
        """
        for name, value in (("outer_step", outer_step), ("n", n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        key = json.dumps(["diloco-swarm/batches", self.seed, self.stream_id, outer_step])
        seed = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "big")
        return self._batches(np.random.default_rng(seed), n)

    def _batches(
        self, rng: np.random.Generator, n: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Highest start is len - seq_len - 1 so the target window fits.
        high = len(self.tokens) - self.seq_len
        for _ in range(n):
            starts = rng.integers(0, high, size=self.batch_size)
            yield _windows(self.tokens, starts, self.seq_len)


def held_out_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches: batch_size * n_batches evenly spaced windows.

    No randomness, so every peer and every evaluation see the same windows.
    Windows overlap when tokens is shorter than the windows laid end to end.

    Args:
        tokens: 1-D integer array (normally Corpus.held_out, uint8).
        batch_size: sequences per batch (B).
        seq_len: tokens per sequence (T).
        n_batches: number of batches, >= 0.

    Returns:
        A list of n_batches (x, y) pairs of int64 CPU tensors of shape
        [batch_size, seq_len], y being x shifted by one token; the first
        window starts at 0 and the last one ends at the last token.

    Raises:
        ValueError: if a size is not a positive int (n_batches: >= 0), or
            tokens is not a 1-D integer array.
        DatasetError: if tokens has fewer than seq_len + 1 entries.
    """
    _check_positive_int("batch_size", batch_size)
    tokens = _check_tokens(tokens, seq_len)
    if not isinstance(n_batches, int) or isinstance(n_batches, bool) or n_batches < 0:
        raise ValueError(f"n_batches must be an int >= 0, got {n_batches!r}")
    total = batch_size * n_batches
    max_start = len(tokens) - seq_len - 1
    # integer arithmetic: identical on every platform
    starts = np.arange(total, dtype=np.int64) * max_start // max(total - 1, 1)
    return [
        _windows(tokens, starts[i : i + batch_size], seq_len)
        for i in range(0, total, batch_size)
    ]


def _windows(
    tokens: np.ndarray, starts: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    # copies, so x and y are contiguous and own their memory
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_tokens(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    _check_positive_int("seq_len", seq_len)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}"
        )
    if len(tokens) < seq_len + 1:
        raise DatasetError(
            f"only {len(tokens)} tokens but seq_len {seq_len} needs at least {seq_len + 1}; "
            f"use more text or a smaller seq_len"
        )
    return tokens


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: str | torch.device,
) -> float:
    """Mean cross-entropy of model on batches, in nats per token.

    The model is put in eval mode (no dropout) and its previous mode is
    restored afterwards, even on error.

    Args:
        model: a module already on device whose forward(x, y) returns
            (logits, loss) with loss the mean over the batch's tokens, like
            diloco_swarm.models.GPT.
        batches: (x, y) pairs of int64 tensors of shape [B, T], e.g. from
            held_out_batches(); moved to device here.
        device: where to run, e.g. "cpu" or "cuda:0".

    Returns:
        The token-weighted mean loss over all batches (nats/token).

    Raises:
        ValueError: if batches is empty.
    """
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        n_tokens = 0
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            _, loss = model(x, y)
            # weight by tokens so batches of different sizes average correctly
            total += loss.double() * y.numel()
            n_tokens += y.numel()
        if n_tokens == 0:
            raise ValueError("evaluate() got no batches (or only empty ones)")
        # one host sync at the end, not one per batch
        return total.item() / n_tokens
    finally:
        model.train(was_training)
