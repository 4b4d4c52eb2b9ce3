"""``--dataset hf:NAME_OR_PATH[:CONFIG][@SPLIT][#COLUMN]``: parsing and cheap checks.

No heavy import here (the command line checks the argument before loading torch); the loading
itself is in ``hf_corpus``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from diloco_swarm.data.files import DatasetError
from diloco_swarm.data.tokenizer import _looks_like_hub_id, hub_offline

PREFIX = "hf:"
DEFAULT_SPLIT = "train"
DEFAULT_COLUMN = "text"
# datasets' builders by file suffix (packaged modules), for a single local file.
BUILDER_BY_SUFFIX = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv",
                     ".arrow": "arrow"}


@dataclass(frozen=True)
class HFSource:
    """A parsed ``hf:`` dataset argument.

    Attributes:
        name: local path (file or folder) or Hub id, as given.
        config: the dataset's configuration name (Hub datasets such as ``allenai/c4:en``), or None.
        split: the split to train on (default ``train``).
        column: the text column (default ``text``).
    """

    name: str
    config: str | None
    split: str
    column: str

    @property
    def local_path(self) -> Path | None:
        path = Path(os.path.expanduser(self.name))
        return path if path.exists() else None

    def label(self) -> str:
        return f"hf:{self.name}{':' + self.config if self.config else ''}@{self.split}#{self.column}"


def is_hf_dataset(dataset: str | None) -> bool:
    return dataset is not None and str(dataset).startswith(PREFIX)


def parse_hf_dataset(arg: str) -> HFSource:
    """Parse ``hf:NAME_OR_PATH[:CONFIG][@SPLIT][#COLUMN]``.

    Raises:
        DatasetError: an empty name, split or column.
    """
    rest = arg[len(PREFIX):]
    rest, hash_sign, column = rest.rpartition("#") if "#" in rest else (rest, "", DEFAULT_COLUMN)
    rest, at, split = rest.rpartition("@") if "@" in rest else (rest, "", DEFAULT_SPLIT)
    name, config = rest, None
    # NAME:CONFIG, unless the whole thing is an existing path (which may hold a colon)
    if ":" in rest and not Path(os.path.expanduser(rest)).exists():
        name, _, config = rest.rpartition(":")
        config = config or None
    if not name or not split or not column:
        raise DatasetError(f"--dataset {arg!r}: expected hf:NAME_OR_PATH[:CONFIG][@SPLIT][#COLUMN], "
                           "e.g. hf:allenai/c4:en@train#text or hf:./my-data@train#text")
    return HFSource(name=name, config=config, split=split, column=column)


def hf_dataset_problem(arg: str) -> str | None:
    """Why an ``hf:`` dataset cannot be opened, found without reading it (None if it may be fine)."""
    try:
        source = parse_hf_dataset(arg)
    except DatasetError as e:
        return str(e)
    if source.local_path is not None:
        return None
    if not _looks_like_hub_id(source.name):
        return (f"dataset {source.name!r} does not exist; pass a local folder or file (parquet, JSON Lines, "
                "Arrow from save_to_disk, text) or a Hub id (org/name)")
    if hub_offline():
        return (f"dataset {source.name!r} is a Hugging Face Hub id, but this machine is offline (HF_HUB_OFFLINE=1 "
                "or HF_DATASETS_OFFLINE=1); pass a local copy (save_to_disk or parquet), or go online")
    return None
