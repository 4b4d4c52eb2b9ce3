"""Hugging Face ``datasets`` as training data: local files and folders in memory, Hub datasets streamed.

Local data (parquet, JSON Lines, CSV, text folders, Arrow folders written by ``save_to_disk``) is
read and tokenized once into a :class:`~diloco_swarm.data.corpus.Corpus`, so the usual
:class:`~diloco_swarm.data.corpus.BatchSampler` gives each peer its own order from
(seed, peer id, outer step). A Hub dataset is streamed (``streaming=True``): each outer step
opens the stream with a shuffle seed drawn from (seed, peer id, outer step) and a shuffle buffer
(:class:`StreamSampler`), so a restarted peer resumes its order without any saved position.

Held-out documents are chosen by content: a document whose text has sha256 % 50 == 0 (about 2%)
is held out, the same on every peer, whatever the order or the shard it comes from; training
never reads them.

Sources: Hugging Face ``datasets`` (``load_dataset``, ``load_from_disk``, ``IterableDataset.shuffle``);
DiLoCo (arXiv 2311.08105): each worker its own data order, one shared validation set.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco_swarm.data.corpus import Corpus, _check_positive_int
from diloco_swarm.data.files import DatasetError, _folder_files
from diloco_swarm.data.hf_source import BUILDER_BY_SUFFIX, HFSource, hf_dataset_problem
from diloco_swarm.data.tokenizer import Tokenizer, _first_line

HELD_OUT_MODULUS = 50
TOKENIZE_BATCH = 512  # documents per encode_batch call
STREAM_SHUFFLE_BUFFER = 10_000  # documents (datasets' default is 1000)
STREAM_HELD_OUT_TOKENS = 1 << 18  # tokens of held-out documents read from the head of a stream
STREAM_HELD_OUT_SCAN = 100_000  # documents scanned at most for them
_TEXT_DTYPES = ("string", "large_string")


def is_held_out(text: str) -> bool:
    """Whether a document belongs to the shared held-out set (sha256 of its UTF-8 text % 50 == 0)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def open_local(source: HFSource):
    """The ``datasets.Dataset`` of a local source's split.

    Raises:
        DatasetError: unreadable data, a missing split (the message lists those present).
    """
    import datasets  # lazy: ~0.7 s, for hf: data only (node/assets.py imports this module for every run)

    datasets.disable_progress_bars()  # ours (node/assets.py) shows progress; theirs would flood the log
    path = source.local_path
    assert path is not None
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = BUILDER_BY_SUFFIX.get(path.suffix.lower())
            if builder is None:
                raise DatasetError(f"dataset file {str(path)!r}: unknown format {path.suffix!r}; use "
                                   f"{', '.join(sorted(BUILDER_BY_SUFFIX))} or a folder")
            if source.split != "train":
                raise DatasetError(f"dataset file {str(path)!r} is one split, 'train'; use @train (or leave @SPLIT "
                                   f"out), not @{source.split}")
            loaded = datasets.load_dataset(builder, data_files={"train": str(path)}, name=source.config, split="train")
        else:
            files = [full for _, full in _folder_files(str(path))]
            if not files:
                raise DatasetError(f"dataset folder {str(path)!r} holds no files")
            # split=...: only that split is built (datasets refuses to build an empty one)
            if all(f.endswith(".txt") for f in files):  # one document per file, not per line
                loaded = datasets.load_dataset("text", data_dir=str(path), sample_by="document", split=source.split)
            else:
                loaded = datasets.load_dataset(str(path), name=source.config, split=source.split)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, DatasetGenerationError...)
        text = str(e)
        known = re.search(r"Unknown split .*one of \[(.*)\]", text)
        if known:
            raise DatasetError(f"dataset {source.name!r} has no split {source.split!r} (it has: "
                               f"{known.group(1).replace(chr(39), '')}); choose one with @SPLIT") from None
        if "corresponds to no data" in text:
            raise _empty_split(source) from None
        raise DatasetError(f"dataset {source.name!r} cannot be read: {_first_line(e)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DatasetError(f"dataset {source.name!r} has no split {source.split!r} (it has: "
                               f"{', '.join(loaded) or 'none'}); choose one with @SPLIT")
        return loaded[source.split]
    if source.split != "train":
        raise DatasetError(f"dataset {source.name!r} holds a single split, saved without a name; use @train "
                           f"(or leave @SPLIT out), not @{source.split}")
    return loaded


def _empty_split(source: HFSource) -> DatasetError:
    return DatasetError(f"dataset {source.name!r}: split {source.split!r} is empty (0 rows); choose another split "
                        "with @SPLIT")


def check_column(source: HFSource, features: Any, column_names: list[str] | None) -> None:
    """Raises DatasetError: the text column is missing or does not hold strings."""
    if column_names is not None and source.column not in column_names:
        raise DatasetError(f"dataset {source.name!r} has no column {source.column!r} in split {source.split!r} "
                           f"(columns: {', '.join(column_names) or 'none'}); choose one with #COLUMN")
    feature = features.get(source.column) if features is not None else None
    dtype = getattr(feature, "dtype", None)
    if feature is not None and dtype not in _TEXT_DTYPES:
        raise DatasetError(f"dataset {source.name!r}: column {source.column!r} holds {dtype or type(feature).__name__} "
                           "values, not text; choose a text column with #COLUMN")


def local_identity(source: HFSource) -> str:
    """``hf:local:<files>:<bytes>:<8 hex>[:CONFIG]@SPLIT#COLUMN``: the hash covers the data files' paths
    (relative to the dataset root) and sizes, as for text files, so copies at other paths agree."""
    path = source.local_path
    assert path is not None
    pairs = ([(path.name, path.stat().st_size)] if path.is_file()
             else sorted((rel, os.path.getsize(full)) for rel, full in _folder_files(str(path))))
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:8]
    config = f":{source.config}" if source.config else ""
    return f"hf:local:{len(pairs)}:{sum(s for _, s in pairs)}:{digest}{config}@{source.split}#{source.column}"


def load_hf_corpus(source: HFSource, tokenizer: Tokenizer, *, max_bytes: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Corpus:
    """Read and tokenize a local ``hf:`` dataset split into training and held-out token arrays.

    Args:
        source: a parsed ``hf:`` argument whose ``local_path`` exists.
        tokenizer: turns each document into ids; documents are joined by ``tokenizer.separator``.
        max_bytes: stop after documents holding this many UTF-8 bytes of text (smoke runs).
        progress: called as ``progress(documents_done, documents_total)`` while tokenizing.

    Returns:
        A Corpus whose ``train``/``held_out`` are 1-D uint16 (uint32 for vocabularies over 65536)
        token ids, and whose description is :func:`local_identity`.

    Raises:
        DatasetError: missing split or column, a column that is not text, an empty split, or
            data too small to hold a held-out document and a training one.
    """
    ds = open_local(source)
    check_column(source, ds.features, ds.column_names)
    if len(ds) == 0:
        raise _empty_split(source)
    dtype = token_dtype(tokenizer.vocab_size)
    sep = np.asarray(tokenizer.separator, dtype=dtype)
    train: list[np.ndarray] = []
    held: list[np.ndarray] = []
    n_docs, n_bytes, total = 0, 0, len(ds)
    for batch in ds.select_columns([source.column]).iter(batch_size=TOKENIZE_BATCH):
        texts = [t for t in batch[source.column] if t]  # None and "" carry no tokens
        if max_bytes is not None:
            kept = []
            for t in texts:
                if n_bytes >= max_bytes:
                    break
                kept.append(t)
                n_bytes += len(t.encode("utf-8", "surrogatepass"))
            texts = kept
        for text, ids in zip(texts, tokenizer.encode_batch(texts)):
            (held if is_held_out(text) else train).append(ids.astype(dtype))
        n_docs += len(batch[source.column])
        if progress is not None:
            progress(n_docs, total)
        if max_bytes is not None and n_bytes >= max_bytes:
            break
    if not train and not held:
        raise DatasetError(f"dataset {source.name!r}: column {source.column!r} of split {source.split!r} holds only "
                           "empty text")
    if not held or not train:  # too few documents for the 1-in-50 rule: hold out the last one,
        docs = train + held
        train, held = docs[:-1], docs[-1:]
        if 10 * len(held[0]) > sum(len(d) for d in docs):  # or, when it holds over a tenth of the tokens,
            last = held[0]  # its last 5% (a single document too)
            cut = len(last) - max(1, len(last) // 20)
            train, held = train + [last[:cut]], [last[cut:]]
    return Corpus(description=local_identity(source), train=_join(train, sep, dtype), held_out=_join(held, sep, dtype),
                  n_files=len(train) + len(held))


def _join(docs: list[np.ndarray], sep: np.ndarray, dtype: np.dtype) -> np.ndarray:
    parts: list[np.ndarray] = []
    for i, d in enumerate(docs):
        if i and len(sep):
            parts.append(sep)
        parts.append(d)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


# ---------------------------------------------------------------------------------------- streams


def open_hub_stream(source: HFSource) -> Callable[[], Any]:
    """A function that opens the Hub dataset's split as a ``datasets.IterableDataset`` (streaming).

    The first open happens here, so a missing dataset, split or column is reported at start.

    Raises:
        DatasetError: offline, unknown dataset/config/split, or a column that is not there (one line).
    """
    problem = hf_dataset_problem(f"hf:{source.name}")
    if problem:
        raise DatasetError(problem)

    def open_stream():
        import datasets  # lazy, as in open_local

        return datasets.load_dataset(source.name, source.config, split=source.split, streaming=True)

    try:
        stream = open_stream()
        features = stream.features
        first = next(iter(stream.take(1)), None)
    except Exception as e:
        raise DatasetError(f"dataset {source.label()!r} cannot be streamed from the Hugging Face Hub: "
                           f"{_first_line(e)}") from None
    if first is None:
        raise DatasetError(f"dataset {source.name!r}: split {source.split!r} is empty; choose another with @SPLIT")
    check_column(source, features, list(first))
    return open_stream


class StreamSampler:
    """Training batches from a streamed dataset, in an order that depends only on (seed, stream_id, outer_step).

    Each outer step opens the stream afresh and shuffles it with ``IterableDataset.shuffle(seed,
    buffer_size)`` (shard order and a buffer of documents) seeded from (seed, stream_id,
    outer_step); documents are tokenized, joined by the tokenizer's separator and cut into
    windows of seq_len + 1 tokens. Held-out documents (:func:`is_held_out`) are skipped.

    Args:
        open_stream: returns a fresh ``datasets.IterableDataset`` of the split.
        column: the text column.
        tokenizer: turns documents into ids.
        batch_size, seq_len, seed, stream_id: as :class:`~diloco_swarm.data.corpus.BatchSampler`.
        buffer_size: documents in the shuffle buffer.
    """

    def __init__(self, open_stream: Callable[[], Any], column: str, tokenizer: Tokenizer, batch_size: int,
                 seq_len: int, seed: int, stream_id: str, buffer_size: int = STREAM_SHUFFLE_BUFFER) -> None:
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("seq_len", seq_len)
        self.open_stream, self.column, self.tokenizer = open_stream, column, tokenizer
        self.batch_size, self.seq_len, self.seed, self.stream_id = batch_size, seq_len, int(seed), str(stream_id)
        self.buffer_size = buffer_size

    def batches_for_outer_step(self, outer_step: int, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The n batches of one outer step: (x, y) int64 CPU tensors of shape [batch_size, seq_len].

        Raises:
            ValueError: outer_step or n is negative or not an int.
            DatasetError: the stream ends before n batches (raised while iterating).
        """
        for name, value in (("outer_step", outer_step), ("n", n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        key = json.dumps(["diloco-swarm/stream", self.seed, self.stream_id, outer_step])
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")  # datasets wants < 2**32
        return self._batches(seed, n)

    def _batches(self, seed: int, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if n == 0:
            return
        window = self.seq_len + 1
        need = self.batch_size * window
        pending: list[int] = []
        made = 0
        stream = self.open_stream().shuffle(seed=seed, buffer_size=self.buffer_size)
        for texts in _text_batches(stream, self.column):
            texts = [t for t in texts if not is_held_out(t)]
            for ids in self.tokenizer.encode_batch(texts):
                pending.extend(ids.tolist())
                pending.extend(self.tokenizer.separator)
            while len(pending) >= need:
                rows = torch.tensor(pending[:need], dtype=torch.int64).view(self.batch_size, window)
                del pending[:need]
                yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
                made += 1
                if made == n:
                    return
        raise DatasetError(f"the dataset stream ended after {made} of {n} batches; use a larger split")


def stream_held_out(open_stream: Callable[[], Any], column: str, tokenizer: Tokenizer) -> np.ndarray:
    """Tokens of the held-out documents at the head of the (unshuffled) stream: the same on every peer."""
    dtype = token_dtype(tokenizer.vocab_size)
    out: list[int] = []
    scanned = 0
    for texts in _text_batches(open_stream(), column):
        scanned += len(texts)
        held = [t for t in texts if is_held_out(t)]
        for ids in tokenizer.encode_batch(held):
            out.extend(ids.tolist())
            out.extend(tokenizer.separator)
        if len(out) >= STREAM_HELD_OUT_TOKENS or scanned >= STREAM_HELD_OUT_SCAN:
            break
    return np.asarray(out, dtype=dtype)


def _text_batches(stream, column: str) -> Iterator[list[str]]:
    batch: list[str] = []
    for row in stream:
        text = row.get(column)
        if isinstance(text, str) and text:
            batch.append(text)
        if len(batch) >= TOKENIZE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
