"""The θ-mixing round: the averager's part (``mixing.py`` plans it, the node applies it).

After a verified round whose members hold different θ_global, the same group runs a second
consensus all-reduce over each member's contribution (``node/mixing.py``): the same members in the
same order, under a group id derived from the round's (``mixing.mixing_group_id``), with the weights
of the plan, verified like a round (every part checked, every member confirming the same digest).
:class:`ThetaMixing` holds the averager's methods for it: the caller's :meth:`~ThetaMixing.mix`, the
averager process's ``_mix_round`` (through hivemind's control pipe) and its ``rpc_aggregate_part``
(hivemind's handler, looked up on the averager), so it is a mixin of
``averager.PseudoGradientAverager``, not a helper object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import Any, AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import achain, anext, as_aiter

from diloco_swarm.averaging.allreduce import MixingAllReduceRunner, RoundStats
from diloco_swarm.averaging.codec import Int8BlockwiseCodec
from diloco_swarm.averaging.confirm import DIGEST_WAIT_S, FAILED_MARK
from diloco_swarm.averaging.mixing import mixing_group_id
from diloco_swarm.averaging.request import gathered_entries
from diloco_swarm.averaging.results import GoneProbe, RoundResult, short_reason
from diloco_swarm.averaging.sparse import SparseInt8Codec
from diloco_swarm.dht.calls import bounded
from diloco_swarm.utils.hivemind_fixes import keep_task_alive

logger = get_logger(__name__)

RECENT_GROUPS = 8  # rounds whose group may still run its θ-mixing all-reduce
MIX_START_WAIT_S = DIGEST_WAIT_S + 15.0  # a member's mix request waits this long for our own mix to start


class ThetaMixing:
    """The averager's θ-mixing round (a mixin of ``averager.PseudoGradientAverager``: it runs the
    all-reduce through that class's ``_run_consensus``, judges the members with its ``_conduct``,
    and verifies the result with its ``_verify`` and ``_confirmation``, ``confirm.ConfirmedRounds``).
    Call :meth:`_init_mixing` before the averager process starts."""

    def _init_mixing(self) -> None:
        self._recent_groups: dict[bytes, Any] = {}  # group id -> hivemind GroupInfo, newest last

    def _remember_group(self, group_info) -> None:
        """(averager process) A group that formed: its θ-mixing all-reduce may follow."""
        self._recent_groups[group_info.group_id] = group_info
        while len(self._recent_groups) > RECENT_GROUPS:
            del self._recent_groups[next(iter(self._recent_groups))]

    # --- runs in the averager process -------------------------------------------------
    @keep_task_alive
    async def _mix_round(self, group_id: str, tensors: list[torch.Tensor], weight: float,
                         planned_weights: dict[str, float], future: MPFuture):
        """The θ-mixing all-reduce of recent round ``group_id`` (hex): the same members in the same
        order, ``tensors`` (shared memory) averaged in place; resolves ``future`` with its RoundStats."""
        try:
            group_info = self._recent_groups.get(bytes.fromhex(group_id))
            if group_info is None:
                raise RuntimeError("the round is no longer among our recent ones")
            mix_id = mixing_group_id(group_info.group_id)
            entries = gathered_entries(group_info.gathered, self.serializer.loads)
            if any(entry is None for entry in entries):  # (the round's all-reduce read the same bytes, and ran)
                raise RuntimeError("a member's gathered data does not decode")
            download = [b if AveragingMode(m) != AveragingMode.CLIENT else 0.0
                        for b, m, *_ in (entry.fields for entry in entries)]
            kwargs, timeout = self._sized_to_caps(entries, dict(self.allreduce_kwargs))
            min_vector_size = kwargs.pop("min_vector_size")
            if isinstance(kwargs.get("compression"), SparseInt8Codec):  # θ-mixing stays dense int8 in a sparse run:
                kwargs["compression"] = Int8BlockwiseCodec()  # θ differences are not pseudo-gradients (issue 38)
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, sum(t.numel() for t in tensors), download, min_vector_size)
            self._running_groups.setdefault(mix_id, asyncio.Future())  # unless a member's request made it
            stats = RoundStats()
            try:
                await asyncio.wait_for(self._run_consensus(
                    MixingAllReduceRunner, tensors, group_info, mix_id, stats, planned_weights=planned_weights,
                    peer_fractions=fractions, weight=float(weight), **kwargs), timeout=timeout)
            finally:
                self._running_groups.pop(mix_id, None)
                self._conduct.judge(stats)
            future.set_result(dataclasses.asdict(stats))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(short_reason(e)))

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler; a part for the θ-mixing all-reduce of one of our recent rounds waits
        (at most :data:`MIX_START_WAIT_S`) for our own mix to start instead of being refused."""
        request = await anext(stream)
        mixes = {mixing_group_id(g) for g in self._recent_groups}
        if request.group_id in mixes and request.group_id not in self._running_groups:
            waiting = self._running_groups[request.group_id] = asyncio.Future()

            def drop_if_unstarted():
                if not waiting.done():
                    waiting.cancel()
                    if self._running_groups.get(request.group_id) is waiting:
                        del self._running_groups[request.group_id]

            asyncio.get_event_loop().call_later(MIX_START_WAIT_S, drop_if_unstarted)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    # --- runs in the caller's process -------------------------------------------------
    def mix(self, contribution: Sequence[torch.Tensor], *, round_result: RoundResult, weight: float,
            planned_weights: dict[str, float], digest_wait: float = DIGEST_WAIT_S,
            stop: threading.Event | None = None, gone: GoneProbe | None = None) -> tuple[RoundResult, list[torch.Tensor]]:
        """θ-mixing (averaging/mixing.py): a second consensus all-reduce in the group of the verified
        round ``round_result``, over ``contribution`` (fp32 CPU tensors: this member's θ differences
        to the plan's reference, then its outer momentum), verified like a round (every part checked,
        every member confirming the same digest).

        :param weight: this member's weight in the plan (1 or 0); ``planned_weights`` every member's.
        :param gone: as in ``request.RoundRequest`` (the input of ``PseudoGradientAverager.average``).
        :returns: the mixing round's result and the mixed tensors (``contribution``'s shapes) when
            ``ok``, else a copy of ``contribution``. Never raises for a failed or silent group.
        """
        started = time.perf_counter()
        local = [t.detach().to("cpu", torch.float32).clone() for t in contribution]
        shared = [t.clone().share_memory_() for t in local]  # the averager process writes the average into them

        def start() -> MPFuture:
            future = MPFuture()
            self._command("_mix_round", group_id=round_result.group_id, tensors=shared, weight=float(weight),
                          planned_weights=dict(planned_weights), future=future)
            return future

        try:
            stats = RoundStats(**bounded(self, "θ-mixing all-reduce", start, self._allreduce_timeout_s + 10.0, stop))
        except Exception as e:
            with contextlib.suppress(Exception):  # so the other members do not wait for our digest
                mix_id = mixing_group_id(bytes.fromhex(round_result.group_id)).hex()
                self._confirmation.publish(RoundStats(group_id=mix_id, group_peer_ids=round_result.group_peer_ids),
                                           FAILED_MARK)
            return RoundResult(ok=False, group_size=round_result.group_size, group_peer_ids=round_result.group_peer_ids,
                               reason=f"mixing: {short_reason(e)}", seconds=time.perf_counter() - started), local
        result = RoundResult.of_allreduce(stats)
        averaged = [t.clone() for t in shared]
        # weight 1: the weights are the plan's, no token scaling
        problem = self._verify(stats, local, averaged, result, weight=1.0, digest_wait=digest_wait, stop=stop, gone=gone)
        result.seconds = time.perf_counter() - started
        if problem is not None:
            result.reason = f"mixing: {problem}"
            logger.warning(f"θ-mixing round failed ({problem}); each member keeps its own θ_global")
            return result, local
        result.ok = True
        return result, averaged
