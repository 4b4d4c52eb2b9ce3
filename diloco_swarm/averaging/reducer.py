"""The reducer of our all-reduce: hivemind's ``TensorPartReducer`` with each part combined by the robust rule.

hivemind's reducer sums its senders' parts as they stream in; a robust rule needs all of a part's values at
once (``robust.skipped_mean``), so :class:`RobustPartReducer` keeps them until the part is complete and
combines them off the event loop. ``allreduce.ConsensusAllReduceRunner`` uses it for every Δ round.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException, TensorPartReducer

from diloco_swarm.averaging.robust import skipped_mean


class RobustPartReducer(TensorPartReducer):
    """hivemind's ``TensorPartReducer`` whose parts are combined by ``robust.skipped_mean``, not summed as they come.

    The same interface and the same handling of missing senders: a sender banned or dropped before part i
    (``on_sender_failed``) is not waited for from part i on, and the parts it gave before count. The parts of
    the current part index are kept until every sender still expected gave its own, then combined in the
    event loop's default executor (10-60 ms for 0.5M values and 5-8 senders; the event loop keeps serving
    the streams meanwhile). Memory: one part is hivemind's part size (2**19 bytes on the wire, about 0.5M
    values, 2 MB in fp32), so n senders hold about 2n MB, plus as much while they are combined.

    Per sender it counts the values of our slice it contributed to (``reduced_values``) and those on which
    its part was an outlier, left out (``outlier_values``); a part the all-reduce found over the size bound
    (``left_out``) is one of those without being judged, and weighs in neither the centre nor the mean.
    """

    def __init__(self, part_shapes, num_senders: int):
        # (sender index, part, weight, left out) of the current part
        self._parts: list[tuple[int, torch.Tensor, float, bool]] = []
        self._combining = False
        self.reduced_values = [0] * num_senders
        self.outlier_values = [0] * num_senders
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        self.accumulator = None  # hivemind's running sum: unused here
        self._parts = []

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0, left_out: bool = False) -> torch.Tensor:
        """Keep ``tensor_part`` of ``sender_index`` for part ``part_index`` (``left_out``: an outlier without a
        vote); return the part's robust average once every expected sender gave its own.
        :raises BannedException: the sender was banned meanwhile; ``AllreduceException``: the reducer was
            finalized meanwhile."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # the parts before it are still being combined
            finished = asyncio.ensure_future(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        future = self.current_part_future
        self._parts.append((sender_index, tensor_part, weight, left_out))
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders and not self._combining:
            self._combining = True
            asyncio.ensure_future(self._combine(self.current_part_future, self._parts,
                                                self.part_shapes[self.current_part_index]))

    async def _combine(self, future: asyncio.Future, parts: list[tuple[int, torch.Tensor, float, bool]], shape) -> None:
        """The robust average of ``parts`` (off the event loop) into ``future``; then the next part index."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, _combine_parts, parts, shape)
        except Exception as e:
            if not future.done():
                future.set_exception(AllreduceException(f"could not combine a part: {e!r}"))
            self.finalize()  # no later part can be combined: the senders waiting for one must not spin
            return
        if self.finished.is_set() or future.done():  # finalized meanwhile (its future cancelled)
            return
        value, outliers = result
        for (sender, part, _, _), out in zip(parts, outliers):
            self.reduced_values[sender] += part.numel()
            self.outlier_values[sender] += part.numel() if out else 0
        future.set_result(value)
        self._combining = False
        self.reset_accumulators()


def _combine_parts(parts: list[tuple[int, torch.Tensor, float, bool]], shape) -> tuple[torch.Tensor, list[bool]]:
    """(The skipped mean of the parts not left out, reshaped to ``shape``; which senders were outliers, the left-out
    ones among them). No part to combine: zeros."""
    judged = [(part, weight) for _, part, weight, left_out in parts if not left_out]
    if not judged:
        return torch.zeros(shape), [True] * len(parts)
    stack = torch.stack([part.reshape(-1).to(torch.float32) for part, _ in judged])
    robust = skipped_mean(stack, torch.tensor([w for _, w in judged], dtype=torch.float64))
    verdicts = iter(robust.outliers)
    return robust.value.reshape(shape), [True if left_out else next(verdicts) for *_, left_out in parts]
