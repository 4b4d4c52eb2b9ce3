"""A state donation streamed from the donor's live θ_global and outer momentum, with no snapshot.

hivemind's ``rpc_download_state`` asks the host process for its state and streams what it gets. A
copy of θ_global and the momentum for that (8 B/param) was the largest buffer a donor ever held, and
every established peer is a donor whenever someone joins. Here the host hands over its live tensors
(shared memory) with a :class:`StateSeal`: the writer's generation count, read while nothing was
being written. The stream checks the seal after reading each tensor; a write meanwhile (an outer
step applied, a state adopted) breaks it, and the stream ends with an error instead of sending a
torn state (the asker tries another donor, or again). The node holds back applying a finished round
while a donation streams, until its phase needs the round (``Node._inner_phase``), so a stream is
rarely cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming


class TornState(RuntimeError):
    """The donor's state changed while it streamed."""


@dataclass(frozen=True)
class StateSeal:
    """The writer's generation count (int64[1], shared memory, bumped before every write) and its
    value when the state was read."""

    generation: torch.Tensor
    at: int

    def intact(self) -> bool:
        """Whether no write began since the seal was made."""
        return int(self.generation.item()) == self.at


async def stream_state(metadata: bytes, tensors: Sequence[torch.Tensor], seal: StateSeal | None,
                       compression: CompressionBase, donations: torch.Tensor) -> AsyncIterator[averaging_pb2.DownloadData]:
    """hivemind's ``rpc_download_state`` stream (the metadata with the first part, then each tensor
    in parts) over live tensors, checked against ``seal`` after each tensor is read. ``donations``
    (int64[1], shared memory) counts the streams in flight while this one runs.

    :raises TornState: the state changed while it streamed (nothing of the torn tensor is sent).
    """
    donations.add_(1)
    try:
        first = True
        for index, tensor in enumerate(tensors):
            serialized = compression.compress(tensor, CompressionInfo.from_tensor(tensor, key=index), allow_inplace=False)
            if seal is not None and not seal.intact():
                raise TornState("this peer's θ_global changed while its state streamed; ask again")
            for part in split_for_streaming(serialized):
                if first:
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                    first = False
                else:
                    yield averaging_pb2.DownloadData(tensor_part=part)
    finally:
        donations.sub_(1)
