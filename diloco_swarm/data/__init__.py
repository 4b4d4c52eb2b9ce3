"""Byte-level datasets: corpus loading, per-peer batch sampling, evaluation.

``DatasetError`` and ``list_dataset_files`` (in ``files``) need no numpy or torch; the rest is
imported from ``corpus`` on first use, so the command line can check a dataset path quickly.
"""

from diloco_swarm.data.files import DatasetError, list_dataset_files

_FROM_CORPUS = ("BatchSampler", "Corpus", "evaluate", "held_out_batches", "load_corpus")

__all__ = ["DatasetError", "list_dataset_files", *_FROM_CORPUS]


def __getattr__(name: str):
    if name in _FROM_CORPUS:
        from diloco_swarm.data import corpus  # on first use: numpy and torch (module docstring)

        return getattr(corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
