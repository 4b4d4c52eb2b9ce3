"""A state donation streamed from the donor's live θ_global and outer momentum, copied only when they
are about to change.

hivemind's ``rpc_download_state`` asks the host process for its state and streams what it gets. A
copy of θ_global and the momentum for that (8 B/param) was the largest buffer a donor ever held, and
every established peer is a donor whenever someone joins. Here the host hands over its live tensors
(shared memory) with a :class:`StateSeal`: the writer's generation count, read while nothing was
being written. Before the node writes them while a stream runs (an outer step applied, a state
adopted), it asks the averager process to freeze them (:meth:`Donations.freeze`, bounded in time):
the averager process copies the state once, for all streams of that generation, and they go on from
the copy. A home uplink can take longer to send a state than a phase lasts, so a stream must outlive
the donor's next outer step. A write that found no frozen copy (the averager process did not answer
in time) breaks the seal, and the stream ends with an error instead of sending a torn state (the
asker tries again). The node holds back applying a finished round while a donation streams, until
its phase has its steps (``Node._inner_phase``), so a short donation needs no copy at all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming

FREEZE_POLL_S = 0.05  # how often the averager process looks for a freeze request while it donates


class TornState(RuntimeError):
    """The donor's state changed while it streamed, with no frozen copy to go on from."""


@dataclass(frozen=True)
class StateSeal:
    """The writer's generation count (int64[1], shared memory, bumped before every write) and its
    value when the state was read."""

    generation: torch.Tensor
    at: int

    def intact(self) -> bool:
        """Whether no write began since the seal was made."""
        return int(self.generation.item()) == self.at


class Donations:
    """The donations of one averager: the streams (averager process) and the freeze requests of the
    node (host process), which share three int64 counters in shared memory: streams in flight, the
    generation the node asks to freeze, the generation frozen. Made before the averager forks."""

    def __init__(self):
        self._counters = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._counters[1:] = -1
        # in the averager process: streams by the generation they serve, and that generation's copy
        self._live: dict[int, int] = {}
        self._frozen: dict[int, list[torch.Tensor]] = {}

    # --- the node's side ---------------------------------------------------------------------
    def streaming(self) -> bool:
        """Whether a donation streams now."""
        return bool(self._counters[0].item())

    def freeze(self, generation: int, timeout: float) -> bool:
        """Before a write to the state of ``generation``: have every stream of it go on from a copy.
        Waits at most ``timeout`` seconds. :returns: whether no stream needs the live state any more
        (False: a stream that still reads it will end torn)."""
        self._counters[1] = generation
        deadline = time.monotonic() + timeout
        while self.streaming() and int(self._counters[2].item()) != generation:
            if time.monotonic() > deadline:
                return False
            time.sleep(FREEZE_POLL_S / 5)
        return True

    # --- the averager process's side ------------------------------------------------------------
    def _freeze_if_asked(self, tensors: Sequence[torch.Tensor], seal: StateSeal) -> None:
        asked = int(self._counters[1].item())
        if asked < 0 or int(self._counters[2].item()) == asked:
            return
        if asked in self._live and asked not in self._frozen:
            if seal.at != asked:
                return  # a stream of that generation makes the copy
            copy = [t.clone() for t in tensors]
            if not seal.intact():  # the node wrote before we answered (it gave up waiting): useless
                return
            self._frozen[asked] = copy
        self._counters[2] = asked  # (nothing streams that generation: nothing to copy)

    async def _serve_freezes(self, tensors: Sequence[torch.Tensor], seal: StateSeal) -> None:
        while True:
            self._freeze_if_asked(tensors, seal)
            await asyncio.sleep(FREEZE_POLL_S)

    async def stream(self, metadata: bytes, tensors: Sequence[torch.Tensor], seal: StateSeal | None,
                     compression: CompressionBase) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's ``rpc_download_state`` stream (the metadata with the first part, then each
        tensor in parts) over the live ``tensors``, or over their frozen copy once the node asked
        for one; without a ``seal``, ``tensors`` are served as they are.

        :raises TornState: the state changed while it streamed and no copy was frozen before.
        """
        self._counters[0] += 1
        at = seal.at if seal is not None else None
        self._live[at] = self._live.get(at, 0) + 1
        watcher = asyncio.create_task(self._serve_freezes(tensors, seal)) if seal is not None else None
        try:
            first = True
            for index in range(len(tensors)):
                serialized = self._read(index, tensors, seal, compression)
                for part in split_for_streaming(serialized):
                    if first:
                        yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                        first = False
                    else:
                        yield averaging_pb2.DownloadData(tensor_part=part)
        finally:
            if watcher is not None:
                watcher.cancel()
            self._counters[0] -= 1
            self._live[at] -= 1
            if not self._live[at]:
                del self._live[at]
                self._frozen.pop(at, None)

    def _read(self, index: int, tensors: Sequence[torch.Tensor], seal: StateSeal | None,
              compression: CompressionBase):
        frozen = None
        if seal is not None:
            self._freeze_if_asked(tensors, seal)
            frozen = self._frozen.get(seal.at)
        source = tensors if frozen is None else frozen
        serialized = compression.compress(source[index], CompressionInfo.from_tensor(source[index], key=index),
                                          allow_inplace=False)
        if seal is not None and frozen is None and not seal.intact():  # written without waiting for our copy
            raise TornState("this peer's θ_global changed while its state streamed; ask again")
        return serialized
