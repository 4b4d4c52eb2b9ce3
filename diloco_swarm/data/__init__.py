"""Byte-level datasets: corpus loading, per-peer batch sampling, evaluation."""

from diloco_swarm.data.corpus import (
    BatchSampler,
    Corpus,
    DatasetError,
    evaluate,
    held_out_batches,
    load_corpus,
)

__all__ = [
    "BatchSampler",
    "Corpus",
    "DatasetError",
    "evaluate",
    "held_out_batches",
    "load_corpus",
]
