"""Tests for diloco_swarm.data.corpus: loading, splitting, sampling, evaluation."""

import hashlib
import math
import os

import numpy as np
import pytest
import torch

from diloco_swarm.data import (
    BatchSampler,
    Corpus,
    DatasetError,
    evaluate,
    held_out_batches,
    load_corpus,
)
from diloco_swarm.models import build_model


def _write_tree(root, files):
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def _text_files(n=12, size=300):
    return {
        f"dir{i % 3}/file{i:02d}.txt": (f"file {i} says hello. " * size).encode()[:size]
        for i in range(n)
    }


def _is_held(rel):
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 50 == 0


# --- load_corpus ---------------------------------------------------------------


def test_default_corpus_is_python_stdlib():
    corpus = load_corpus(None, max_bytes=2_000_000)
    assert corpus.description == "python-stdlib"
    assert corpus.train.dtype == np.uint8 and corpus.train.ndim == 1
    assert corpus.held_out.dtype == np.uint8 and corpus.held_out.ndim == 1
    assert len(corpus.train) > 1_000_000 and len(corpus.held_out) > 0
    assert corpus.n_files > 10
    # max_bytes counts file content; separators add n_files - 1 bytes
    assert len(corpus.train) + len(corpus.held_out) == 2_000_000 + corpus.n_files - 2
    assert b"def " in corpus.train.tobytes()
    corpus.check(seq_len=256)


def test_default_corpus_is_reproducible():
    a = load_corpus(None, max_bytes=200_000)
    b = load_corpus(None, max_bytes=200_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.held_out, b.held_out)


def test_single_file_holds_out_last_five_percent(tmp_path):
    data = bytes(range(32, 127)) * 20  # 1900 bytes
    (tmp_path / "book.txt").write_bytes(data)
    corpus = load_corpus(str(tmp_path / "book.txt"))
    assert corpus.n_files == 1
    assert corpus.train.tobytes() == data[:1805]
    assert corpus.held_out.tobytes() == data[1805:]
    assert corpus.description.startswith("files:1:1900:")


def test_folder_dataset_splits_by_path_hash(tmp_path):
    files = _text_files(n=120, size=100)
    files[".hidden.txt"] = b"secret " * 50
    files[".git/config"] = b"[core] " * 50
    files["image.bin"] = b"\x89PNG\x00\x00" + b"x" * 100
    files["empty.txt"] = b""
    root = _write_tree(tmp_path / "data", files)

    corpus = load_corpus(root)  # PathLike is accepted too
    text = sorted(rel for rel in files if rel.startswith("dir"))
    held = [rel for rel in text if _is_held(rel)]
    assert held, "fixture should put at least one file in held-out"
    train = [rel for rel in text if not _is_held(rel)]
    assert corpus.n_files == 120
    assert corpus.train.tobytes() == b"\n".join(files[r] for r in train)
    assert corpus.held_out.tobytes() == b"\n".join(files[r] for r in held)
    assert corpus.description.startswith("files:120:12000:")


def test_folder_without_hash_selected_file_holds_out_last_file(tmp_path):
    files = {f"f{i}.txt": (b"%d" % i) * 100 for i in range(3)}
    assert not any(_is_held(rel) for rel in files)
    corpus = load_corpus(str(_write_tree(tmp_path, files)))
    assert corpus.held_out.tobytes() == files["f2.txt"]
    assert corpus.train.tobytes() == files["f0.txt"] + b"\n" + files["f1.txt"]


def test_glob_dataset(tmp_path):
    files = _text_files(n=6)
    files["dir0/notes.md"] = b"# markdown " * 40
    root = _write_tree(tmp_path, files)
    corpus = load_corpus(str(root / "**" / "*.txt"))
    assert corpus.n_files == 6
    joined = corpus.train.tobytes() + corpus.held_out.tobytes()
    assert b"markdown" not in joined and b"file 5 says" in joined


def test_max_bytes_cuts_the_last_file(tmp_path):
    files = {f"f{i}.txt": bytes([65 + i]) * 100 for i in range(5)}
    corpus = load_corpus(str(_write_tree(tmp_path, files)), max_bytes=250)
    assert corpus.n_files == 3
    assert corpus.description.startswith("files:3:250:")
    # no file is hash-selected, so the (cut) last file is held out
    assert corpus.held_out.tobytes() == b"C" * 50
    assert corpus.train.tobytes() == b"A" * 100 + b"\n" + b"B" * 100


def test_max_bytes_beyond_any_file_reads_them_whole(tmp_path):
    # --max-dataset-bytes 1e23 raised OverflowError from file.read (an index-sized integer)
    files = {f"f{i}.txt": bytes([65 + i]) * 100 for i in range(3)}
    corpus = load_corpus(str(_write_tree(tmp_path, files)), max_bytes=10**23)
    assert corpus.n_files == 3 and len(corpus.train) + len(corpus.held_out) >= 300


def test_a_path_that_is_no_file_or_folder_says_so(tmp_path):
    with pytest.raises(DatasetError, match="is not a regular file or a folder"):
        load_corpus("/dev/null")


def test_description_ignores_absolute_location(tmp_path):
    files = _text_files()
    a = load_corpus(str(_write_tree(tmp_path / "machine_a" / "corpus", files)))
    b = load_corpus(str(_write_tree(tmp_path / "elsewhere" / "deeper" / "corpus", files)))
    assert a.description == b.description
    assert np.array_equal(a.train, b.train) and np.array_equal(a.held_out, b.held_out)
    ga = load_corpus(str(tmp_path / "machine_a" / "corpus" / "**" / "*.txt"))
    gb = load_corpus(str(tmp_path / "elsewhere" / "deeper" / "corpus" / "**" / "*.txt"))
    assert ga.description == gb.description == a.description
    # changing a file size changes the description
    files["dir0/file00.txt"] += b"!"
    c = load_corpus(str(_write_tree(tmp_path / "machine_c", files)))
    assert c.description != a.description


def test_missing_path_raises(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DatasetError, match="does not exist") as e:
        load_corpus(missing)
    assert missing in str(e.value) and "\n" not in str(e.value)


def test_empty_folder_raises(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="contains no files") as e:
        load_corpus(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(e.value)


def test_binary_only_folder_raises(tmp_path):
    files = {"a.bin": b"\x00\x01\x02" * 10, "b.dat": b"ok\x00", "c.txt": b""}
    root = _write_tree(tmp_path / "bin", files)
    with pytest.raises(DatasetError, match="empty or binary") as e:
        load_corpus(str(root))
    assert str(root) in str(e.value)


def test_glob_without_match_raises(tmp_path):
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(DatasetError, match="matched no files") as e:
        load_corpus(pattern)
    assert pattern in str(e.value)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)
    with pytest.raises(DatasetError):
        load_corpus(None, max_bytes=0)


def test_check_rejects_too_small_splits():
    corpus = Corpus("x", np.zeros(100, np.uint8), np.zeros(10, np.uint8), 2)
    corpus.check(seq_len=9)
    with pytest.raises(DatasetError, match="held-out"):
        corpus.check(seq_len=10)
    with pytest.raises(DatasetError, match="training"):
        corpus.check(seq_len=100)


def test_a_too_small_file_is_named_by_its_path_not_its_identity(tmp_path):
    (tmp_path / "small.txt").write_text("hello")
    corpus = load_corpus(tmp_path / "small.txt")
    with pytest.raises(DatasetError, match="training") as e:
        corpus.check(seq_len=64)
    assert str(tmp_path / "small.txt") in str(e.value) and "files:" not in str(e.value)


# --- sampling ------------------------------------------------------------------

TOKENS = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)


def _collect(sampler, step, n):
    return list(sampler.batches_for_outer_step(step, n))


def _same(a, b):
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)
    )


def test_sampler_batches_are_shifted_windows():
    sampler = BatchSampler(TOKENS, batch_size=4, seq_len=32, seed=0, stream_id="peer-a")
    batches = _collect(sampler, 0, 3)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (4, 32)
        assert x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
        assert torch.equal(x[:, 1:], y[:, :-1])
        # TOKENS counts up mod 256, so every window must too
        assert torch.equal(y, (x + 1) % 256)


def test_sampler_is_deterministic_per_seed_stream_and_step():
    a = BatchSampler(TOKENS, 4, 32, seed=0, stream_id="peer-a")
    a_again = BatchSampler(TOKENS, 4, 32, seed=0, stream_id="peer-a")
    assert _same(_collect(a, 5, 3), _collect(a_again, 5, 3))
    # a restarted peer resuming at step 5 needs no state from steps 0..4
    _collect(a, 0, 7)
    assert _same(_collect(a, 5, 3), _collect(a_again, 5, 3))
    # prefix-stable: fewer batches are the first ones of more batches
    assert _same(_collect(a, 5, 2), _collect(a_again, 5, 3)[:2])

    ref = _collect(a, 5, 3)
    assert not _same(ref, _collect(BatchSampler(TOKENS, 4, 32, 0, "peer-b"), 5, 3))
    assert not _same(ref, _collect(BatchSampler(TOKENS, 4, 32, 1, "peer-a"), 5, 3))
    assert not _same(ref, _collect(a, 6, 3))


def test_sampler_validates_arguments():
    with pytest.raises(DatasetError, match="seq_len"):
        BatchSampler(TOKENS[:32], 4, 32, 0, "p")
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(TOKENS, 0, 32, 0, "p")
    sampler = BatchSampler(TOKENS, 4, 32, 0, "p")
    with pytest.raises(ValueError, match="outer_step"):
        sampler.batches_for_outer_step(-1, 2)
    # shortest possible data: only one window fits
    one = BatchSampler(TOKENS[:33], 2, 32, 0, "p")
    (x, y), = _collect(one, 0, 1)
    assert torch.equal(x[0], torch.arange(32)) and torch.equal(x[0], x[1])


def test_held_out_batches_are_fixed_and_evenly_spaced():
    a = held_out_batches(TOKENS, batch_size=3, seq_len=16, n_batches=4)
    b = held_out_batches(TOKENS, batch_size=3, seq_len=16, n_batches=4)
    assert _same(a, b) and len(a) == 4
    x0, y0 = a[0]
    xl, yl = a[-1]
    assert x0.shape == (3, 16) and x0.dtype == torch.int64
    assert torch.equal(x0[0], torch.from_numpy(TOKENS[:16].astype(np.int64)))
    assert torch.equal(yl[-1], torch.from_numpy(TOKENS[-16:].astype(np.int64)))
    assert held_out_batches(TOKENS, 3, 16, 0) == []
    with pytest.raises(DatasetError):
        held_out_batches(TOKENS[:10], 3, 16, 1)


# --- evaluate ------------------------------------------------------------------


def test_evaluate_returns_mean_loss_and_restores_mode():
    model = build_model("tiny", seed=0)
    model.transformer.drop.p = 0.5  # would make train-mode losses random
    batches = held_out_batches(TOKENS, batch_size=2, seq_len=32, n_batches=3)
    assert model.training
    loss = evaluate(model, batches, "cpu")
    assert model.training
    assert isinstance(loss, float) and abs(loss - math.log(256)) < 0.3
    assert evaluate(model, batches, torch.device("cpu")) == loss
    model.eval()
    assert evaluate(model, batches, "cpu") == loss and not model.training
    with pytest.raises(ValueError):
        evaluate(model, [], "cpu")
