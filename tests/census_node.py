"""A ``diloco-node`` whose node counts the tensors it holds (``python tests/census_node.py join ...``).

The node is the product's, subclassed (faults and probes live in the tests): after every applied
round, while a checkpoint is written and when it serves a donation, it lists every tensor of
the process (``gc``), keeps one per storage (shared storages and views count once, by data pointer),
and appends ``{"at", "outer_step", "params", "bytes", "tensors", "file_mapped_bytes"}`` to
``$CENSUS_FILE`` (JSON Lines). Storages in a file mapping (the checkpoint writer reads its file back
memory-mapped, node/checkpoint.py) are page cache, not the node's memory: counted apart.
The averager's shared buffers are counted too: they are mapped in this process. Right after it adopts
a downloaded state, it also records ``averager_shm_bytes``: the shared memory its averager process
still maps (the download came through it).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diloco_swarm.node import runner  # noqa: E402
from diloco_swarm.node.runner import Node  # noqa: E402

_lock = threading.Lock()


def file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from a regular file other than torch's shared memory:
    a checkpoint read back memory-mapped (node/checkpoint.py: its pages are the page cache's, read
    on demand, not the node's memory)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and "/torch_" not in fields[5] and not fields[5].startswith("/dev/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def held_storages() -> tuple[int, int, int]:
    """(bytes, count, file-mapped bytes) of the distinct storages of every CPU tensor in this process;
    storages in a file mapping are counted apart, in the third figure."""
    mapped = file_mappings()  # before and after the scan: a check may map and unmap meanwhile
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # (tensors being torn down on another thread, or without storage)
            continue
    mapped += file_mappings()
    in_file = {ptr for ptr in seen if any(start <= ptr < end for start, end in mapped)}
    return (sum(n for ptr, n in seen.items() if ptr not in in_file), len(seen),
            sum(seen[ptr] for ptr in in_file))


def shm_mapped(pid: int) -> int:
    """Bytes of torch's shared-memory files (``/dev/shm/torch_*``) mapped by process ``pid``."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/torch_" in fields[5]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            total += end - start
    return total


class CensusNode(Node):
    def _census(self, at: str) -> None:
        with _lock:
            nbytes, count, file_mapped = held_storages()
            with open(os.environ["CENSUS_FILE"], "a") as f:
                f.write(json.dumps({"at": at, "outer_step": self.outer_step, "bytes": nbytes, "tensors": count,
                                    "file_mapped_bytes": file_mapped,
                                    "params": sum(p.numel() for p in self.params)}) + "\n")

    def _after_round(self, *args, **kwargs) -> None:
        super()._after_round(*args, **kwargs)
        self._census("round")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        store = self.checkpoints.store

        def census_then_store(state) -> None:
            self._census("checkpoint")  # (on the checkpoint thread, training going on meanwhile)
            store(state)

        self.checkpoints.store = census_then_store

    def _setup(self) -> None:
        super()._setup()
        adopt = self.state_sync.adopt

        def adopt_then_census(state, *args, **kwargs) -> None:
            adopt(state, *args, **kwargs)
            del state
            with _lock:
                with open(os.environ["CENSUS_FILE"], "a") as f:
                    f.write(json.dumps({"at": "download", "outer_step": self.outer_step,
                                        "averager_shm_bytes": shm_mapped(self.averager.pid),
                                        "params": sum(p.numel() for p in self.params)}) + "\n")

        self.state_sync.adopt = adopt_then_census

    def _state_for_donation(self):
        served = super()._state_for_donation()
        self._census("donation")
        return served


if __name__ == "__main__":
    runner.Node = CensusNode  # `diloco-node join` imports its node class from there as it starts the node
    from diloco_swarm.cli import main

    sys.argv = ["diloco-node", *sys.argv[1:]]
    main()
