"""Atomic checkpoints of a node's DiLoCo state.

Layout in the state dir: ``checkpoint.pt``, one file. A write goes to a temp file, is fsynced and
renamed over the current one; then the directory is fsynced. At every instant ``checkpoint.pt`` is
a complete file, and nothing good is ever deleted by a failed write; no second copy is kept (format
1 kept the one before as ``checkpoint.prev.pt``: removed after the first write of format 2).
``torch.save`` streams each tensor's bytes from its own memory, so the caller hands the live
tensors in (while nothing changes them: node/runner.py holds the state lock) and no snapshot is
copied. Files are read with ``torch.load(weights_only=True, mmap=True)``: plain tensors and numbers
only, their bytes read from the page cache as used. A state that this loader would refuse is
rejected at save time (the new file is read back, memory-mapped, before it replaces anything),
never discovered at the next start.

Format 2 holds θ_global and the outer momentum (8 B/param), the counters and the run spec, and in a
sparse mode the error-feedback residual (``feedback``, 4 B/param: node/feedback.py); format 1
also held the inner optimizer's state (16 B/param in all) and still loads (its inner state is not
used: docs/operations.md says what a resume loses).
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"  # format 1's copy of the checkpoint before: removed, never written
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# The temp files of save_checkpoint: mkstemp's ".checkpoint.XXXXXXXX.tmp" and ".checkpoint.prev.pt.tmp".
TEMP_PREFIX, TEMP_SUFFIX = ".checkpoint.", ".tmp"


class CheckpointError(Exception):
    """A checkpoint exists but cannot be used (corrupt, truncated, or of another run)."""


def checkpoint_path(state_dir: Path) -> Path:
    return state_dir / CHECKPOINT_NAME


def save_checkpoint(state_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically as ``state_dir/checkpoint.pt``, replacing the one before (and a
    format-1 ``checkpoint.prev.pt``) once the new file is complete and loadable.

    :param state: tensors (CPU; streamed from their memory, so nothing may change them during the
        call), numbers, strings, lists and dicts of those.
    :returns: the checkpoint path.
    :raises OSError: the disk write failed (the previous checkpoint is untouched).
    :raises TypeError: ``state`` holds objects that ``torch.load(weights_only=True)`` refuses
        (nothing is written; the previous checkpoint is untouched).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    target = state_dir / CHECKPOINT_NAME
    fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=state_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            out = _WriteErrorRecorder(f)
            try:
                torch.save({"format_version": FORMAT_VERSION, **state}, out)
                f.flush()
                os.fsync(f.fileno())
            except Exception as e:
                error = out.error or (e if isinstance(e, OSError) else None)
                if error is None:
                    raise
                raise OSError(error.errno, f"{error.strerror or error} while writing the checkpoint", str(target)) from e
        _check_loadable(Path(tmp_name))
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    (state_dir / PREVIOUS_NAME).unlink(missing_ok=True)  # format 1's second copy: superseded now
    return target


def remove_stale_temp_files(state_dir: Path) -> list[Path]:
    """Delete the temp files that a write cut short (a second Ctrl+C, a crash) left in ``state_dir``.

    Only :func:`save_checkpoint`'s own temp names (and format 1's ``.checkpoint.prev.pt.tmp``), only
    directly in ``state_dir``, only regular files; ``checkpoint.pt`` and ``checkpoint.prev.pt`` are
    never touched. Call it while holding
    the state dir lock, so that no other node is writing there.

    :returns: the files removed.
    """
    removed = []
    if not state_dir.is_dir():
        return removed
    for path in state_dir.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
        if path.name in (CHECKPOINT_NAME, PREVIOUS_NAME) or path.is_symlink() or not path.is_file():
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


class _WriteErrorRecorder:
    """The file object handed to ``torch.save``. torch turns a failed write (disk full, quota)
    into an opaque ``RuntimeError`` ("unexpected pos"); this keeps the ``OSError`` behind it."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def _check_loadable(path: Path) -> None:
    """Read ``path`` back as :func:`load_checkpoint` will (memory-mapped: cheap for big tensors).

    :raises TypeError: the restricted loader refuses an object in the file.
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise TypeError(f"checkpoint state cannot be loaded back with weights_only=True ({_reason(e)})") from None
    del loaded


def _reason(e: BaseException) -> str:
    """A short, single-line account of why ``torch.load`` failed."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)  # torch's weights_only refusal names the class
    if found:
        return f"it holds a {found.group(1)}, not only tensors, numbers, strings, lists and dicts"
    if "Weights only load failed" in text:
        details = [line.split("WeightsUnpickler error:", 1)[1] for line in text.splitlines() if "WeightsUnpickler error:" in line]
        return (details[0].strip() if details else "it holds objects that weights_only=True refuses")[:120]
    first = text.strip().splitlines()[0].strip() if text.strip() else type(e).__name__
    return first[:120]


def _reads_through(path: Path) -> bool:
    """True when every byte of ``path`` can be read: a load that failed anyway failed on the content."""
    try:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    except OSError:
        return False
    return True


def _failed_crc(path: Path) -> str | None:
    """The first entry of the zip file ``path`` (torch.save's format) whose bytes do not match the
    CRC-32 the writer recorded (``zipfile.ZipFile.testzip``), or None when all match."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        return f"its zip directory ({type(e).__name__})"


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """Read a checkpoint written by :func:`save_checkpoint` (format 1 or 2); ``None`` if the file does
    not exist. Its tensors are memory-mapped from the file (copy what you keep: the file may be
    replaced).

    :raises CheckpointError: the file is unreadable, truncated or not one of ours; the message
        names the file and how to start fresh. The file is never modified.
    """
    if not path.exists():
        return None
    how_to = (
        f"move it away to start fresh (mv {path} {path}.bad)"
        + (f", or restore the previous one (cp {path.parent / PREVIOUS_NAME} {path})"
           if (path.parent / PREVIOUS_NAME).exists() and path.name != PREVIOUS_NAME else "")
    )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except OSError as e:
        if not _reads_through(path):  # the disk or the permissions, not the bytes
            raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or type(e).__name__}); {how_to}") from None
        # torch's own seek or read past the end of a cut file (EINVAL): the file itself is damaged
        reason = "not a complete PyTorch file" if not zipfile.is_zipfile(path) else (e.strerror or type(e).__name__)
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({reason}); {how_to}") from None
    except Exception as e:
        if not zipfile.is_zipfile(path):
            reason = "not a complete PyTorch file"
        else:
            reason = _reason(e)
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({reason}); {how_to}") from None
    damaged = _failed_crc(path)
    if damaged is not None:  # torch.load reads stored bytes without checking them: flipped bits load as values
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({damaged} fails its CRC-32 check); {how_to}")
    if not isinstance(state, dict) or state.get("format_version") not in READABLE_VERSIONS:
        found = state.get("format_version") if isinstance(state, dict) else None
        what = (f"of format {found}, newer than this version reads (update diloco-swarm)" if isinstance(found, int)
                and found > FORMAT_VERSION else f"not a diloco-swarm checkpoint of format {FORMAT_VERSION}")
        raise CheckpointError(f"checkpoint {path} is {what}; {how_to}")
    return state
