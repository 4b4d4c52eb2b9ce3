"""Tokenizers of a run: bytes (token = one byte, today's default) or a Hugging Face tokenizer.

A Hugging Face tokenizer comes from a local ``tokenizer.json``, a local folder saved with
``save_pretrained``, or a Hub id (downloaded with ``huggingface_hub.snapshot_download``, so a
cached copy works offline). Its identity in the run spec is a hash of its files, so peers that
tokenize differently refuse each other before training.

Heavy libraries (transformers, huggingface_hub, numpy) are imported on first use: join's input check
(cli/precheck.py) imports this module before the node's slow imports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_swarm.data.files import DatasetError

if TYPE_CHECKING:
    import numpy as np

BYTE = "byte"
# The files a Hugging Face tokenizer may be made of (transformers' *_FILE_NAMES); the identity hashes those present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")


class TokenizerError(DatasetError):
    """A tokenizer cannot be loaded; the message is one line: what is wrong, what to do."""


@dataclass
class Tokenizer:
    """What the data pipeline needs of a tokenizer.

    Attributes:
        identity: ``"byte"``, or ``"sha256:<16 hex>"`` over the tokenizer's files (names and contents).
        vocab_size: number of distinct token ids it emits (ids are in ``[0, vocab_size)``).
        separator: token ids put between two documents: the EOS token of a Hugging Face tokenizer
            (none if it has no EOS), ``b"\\n"`` for bytes (as the text-file corpora do).
        source: local folder or file the tokenizer was read from; None for bytes.
    """

    identity: str
    vocab_size: int
    separator: list[int]
    source: Path | None = None
    _hf: Any = field(default=None, repr=False)

    @property
    def is_byte(self) -> bool:
        return self.identity == BYTE

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens (documents are joined by ``separator``).

        Returns:
            one 1-D int64 array per text. Bytes: the UTF-8 encoding; Hugging Face: the fast
            (Rust) tokenizer's ``encode_batch``, run on all cores.
        """
        import numpy as np  # lazy (module docstring)

        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.int64) for t in texts]
        encodings = self._hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(ids).decode("utf-8", "replace")
        return self._hf.decode(ids)

    def save(self, out: Path) -> list[str]:
        """Write the tokenizer's files into folder ``out`` (``save_pretrained``); none for bytes.

        Returns:
            the names of the files written.
        """
        if self._hf is None:
            return []
        out.mkdir(parents=True, exist_ok=True)
        return [Path(p).name for p in self._hf.save_pretrained(str(out))]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(identity=BYTE, vocab_size=256, separator=[ord("\n")])


def tokenizer_problem(arg: str) -> str | None:
    """Cheap check of ``--tokenizer`` (no import of transformers): why it cannot work, or None."""
    if arg == BYTE:
        return None
    path = Path(os.path.expanduser(arg))
    if path.exists():
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            return (f"--tokenizer {arg!r}: the folder holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
                    "pass a folder written by save_pretrained, a tokenizer.json, or a Hub id")
        return None
    if _looks_like_hub_id(arg):
        return None
    return f"--tokenizer {arg!r} does not exist; pass 'byte', a tokenizer.json, a tokenizer folder, or a Hub id (org/name)"


def load_tokenizer(arg: str) -> Tokenizer:
    """The tokenizer named by ``--tokenizer``.

    Args:
        arg: ``"byte"``; a ``tokenizer.json`` file; a folder holding tokenizer files; or a
            Hugging Face Hub id (``org/name``), fetched (tokenizer files only) unless cached.

    Raises:
        TokenizerError: the file or folder is missing or unreadable, or a Hub id cannot be fetched
            (offline, unknown id, network error).
    """
    if arg == BYTE:
        return byte_tokenizer()
    problem = tokenizer_problem(arg)
    if problem:
        raise TokenizerError(problem)
    path = Path(os.path.expanduser(arg))
    if not path.exists():
        path = fetch_from_hub(arg, allow_patterns=list(TOKENIZER_FILES), what="--tokenizer")
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy (module docstring)

        if path.is_file():
            hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
            files = [path]
        else:
            if (path / "tokenizer_config.json").is_file() or (path / "config.json").is_file():
                hf = AutoTokenizer.from_pretrained(str(path))
            else:
                hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
            files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    except Exception as e:  # transformers raises OSError, ValueError, JSON errors, Rust exceptions...
        raise TokenizerError(f"--tokenizer {arg!r} cannot be loaded: {_first_line(e)}") from None
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"--tokenizer {arg!r} has no fast (Rust) tokenizer; convert it to a tokenizer.json")
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        digest.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    eos = hf.eos_token_id
    return Tokenizer(identity=f"sha256:{digest.hexdigest()[:16]}", vocab_size=len(hf),
                     separator=[] if eos is None else [int(eos)], source=path, _hf=hf)


def _looks_like_hub_id(arg: str) -> bool:
    """``org/name`` or ``name``, and not a path under a local folder (``data/mine`` where ``data/``
    exists is a mistyped path, not a Hub id to wait 25 s of retries for)."""
    parts = arg.split("/")
    if len(parts) == 2 and os.path.isdir(parts[0]):
        return False
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") for p in parts) and not arg.startswith(("~", "/"))


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``, ``TRANSFORMERS_OFFLINE``) forbids the Hub."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def fetch_from_hub(repo_id: str, *, allow_patterns: list[str], what: str) -> Path:
    """Local folder with ``repo_id``'s files (``huggingface_hub.snapshot_download``; the cache first).

    Raises:
        TokenizerError: offline and not cached, unknown repository, or a network error (one line).
    """
    from huggingface_hub import snapshot_download  # lazy (module docstring)

    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, local_files_only=hub_offline()))
    except Exception as e:
        if hub_offline():
            raise TokenizerError(f"{what} {repo_id!r} is a Hugging Face Hub id, but this machine is offline "
                                 "(HF_HUB_OFFLINE=1) and it is not in the local cache; pass a local path, or go "
                                 "online once to cache it") from None
        raise TokenizerError(f"{what} {repo_id!r}: cannot fetch it from the Hugging Face Hub ({_first_line(e)}); "
                             "check the id and the network, or pass a local path") from None


def copy_tokenizer_files(tok: Tokenizer, out: Path) -> list[str]:
    """Copy a tokenizer's own files (or write them with save_pretrained) into ``out``."""
    if tok.is_byte:
        return []
    if tok.source is not None and tok.source.is_dir():
        names = [n for n in TOKENIZER_FILES if (tok.source / n).is_file()]
        out.mkdir(parents=True, exist_ok=True)
        if tok.source.resolve() == out.resolve():
            return names
        for n in names:
            shutil.copyfile(tok.source / n, out / n)
        if "tokenizer_config.json" in names:
            return names
    return tok.save(out)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]
