"""Which files a dataset argument names; no file is read, and no numpy or torch is imported, so
``diloco-node join`` can refuse a bad ``--dataset`` before its slow imports."""

from __future__ import annotations

import glob
import itertools
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path, PurePath

# Folder names never read from the standard library.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
_GLOB_MAGIC = re.compile(r"[*?\[]")


class DatasetError(ValueError):
    """A user-facing data problem; the message is one line: what is wrong, what to do."""


def list_dataset_files(
    dataset: str | os.PathLike | None, *, first_only: bool = False
) -> tuple[list[tuple[str, str]], str, str | None]:
    """The files of a dataset, as :func:`~diloco_swarm.data.corpus.load_corpus` describes them.

    Args:
        first_only: stop at the first file found (a quick check that the dataset has one).

    Returns:
        ``(files, label, description)``: ``files`` are ``(path relative to the dataset root, full path)``
        pairs sorted by relative path (only the first found with ``first_only``); ``label`` names the
        dataset in messages; ``description`` is "python-stdlib" for the default corpus, else None
        (computed from the loaded bytes).

    Raises:
        DatasetError: if the path does not exist, the glob matches no file, or a folder has no files.
    """
    if dataset is None:
        root = sysconfig.get_paths()["stdlib"]
        files = _collect(_stdlib_files(root), first_only)
        label, description = f"python-stdlib ({root})", "python-stdlib"
        if not files:
            raise DatasetError(
                f"found no .py files in the Python standard library at {root!r}; "
                f"pass a dataset path instead"
            )
    else:
        label = os.fspath(dataset)
        path = os.path.expanduser(label)
        if os.path.isfile(path):
            files = [(PurePath(path).name, path)]
        elif os.path.isdir(path):
            files = _collect(_folder_files(path), first_only)
            if not files:
                raise DatasetError(
                    f"dataset folder {label!r} contains no files (hidden files are skipped); "
                    f"add text files or pass another path"
                )
        elif _GLOB_MAGIC.search(path):
            files = _collect(_glob_files(path), first_only)
            if not files:
                raise DatasetError(
                    f"dataset glob {label!r} matched no files; check the pattern "
                    f"(use '**' with a folder to search recursively)"
                )
        elif os.path.exists(path):  # a device, a FIFO, a socket
            raise DatasetError(f"dataset path {label!r} is not a regular file or a folder; pass a text file, a folder "
                               "or a glob pattern")
        else:
            raise DatasetError(
                f"dataset path {label!r} does not exist; pass a text file, a folder or a glob "
                f"pattern, or no dataset for the built-in Python stdlib corpus"
            )
        description = None  # computed from what is actually loaded
    return files, label, description


def _collect(files: Iterator[tuple[str, str]], first_only: bool) -> list[tuple[str, str]]:
    return list(itertools.islice(files, 1)) if first_only else sorted(files)


def _stdlib_files(root: str) -> Iterator[tuple[str, str]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.isfile(full):
                yield Path(full).relative_to(root).as_posix(), full


def _folder_files(root: str) -> Iterator[tuple[str, str]]:
    # followlinks=False: a symlink loop must not hang the loader
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and os.path.isfile(full):
                yield Path(full).relative_to(root).as_posix(), full


def _glob_files(pattern: str) -> Iterator[tuple[str, str]]:
    # Root = leading components without wildcards, so relative paths (and thus
    # order, split and description) do not depend on where the data lives.
    parts = PurePath(pattern).parts
    n_plain = next(i for i, part in enumerate(parts) if _GLOB_MAGIC.search(part))
    root = os.path.abspath(os.path.join(*parts[:n_plain]) if n_plain else ".")
    seen = set()
    for match in glob.iglob(pattern, recursive=True):
        if os.path.isfile(match):
            full = os.path.abspath(match)
            rel = Path(os.path.relpath(full, root)).as_posix()
            if rel not in seen:
                seen.add(rel)
                yield rel, full
