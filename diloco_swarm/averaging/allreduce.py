"""Butterfly all-reduce in which every member applies bit-identical averages.

hivemind's ``AllReduceRunner`` (butterfly all-reduce: each member reduces one slice of the
flat vector) returns *deltas* ``average - my_input`` through the lossy codec, and a reducer
keeps its own slice exact. With int8 that leaves each member with a slightly different
average, and θ_global drifts apart across peers round after round.

:class:`ConsensusAllReduceRunner` changes three things and keeps hivemind's matchmaking,
partitioning, load balancing and timeouts:

1. A reducer returns the encoded **average itself**, and applies to its own slice exactly the
   bytes it sends (decode(encode(avg))). Every member decodes the same bytes, so all members
   end the round with bit-identical values.
2. Incoming parts are checked before they are summed: the sender must use our codec, its
   weight must be finite, within bounds and the one it gathered to the group (what the ledger
   witnesses), its values finite, and their RMS no more than
   ``max_part_rms_ratio`` times the reducer's own part, scaled by how many more tokens the
   sender trained on (:func:`allowed_scale`); our own part counts as at least ``RMS_FLOOR``. A sender that breaks a
   rule is refused for the round and named; in a Δ round a part only over the size bound is left out of
   our slice instead, as an outlier's, and the round goes on (``RoundStats.oversized_senders``).
3. A reducer combines its slice's parts with a robust rule, not the streaming weighted mean
   (``reducer.RobustPartReducer``: ``robust.skipped_mean``, the weighted mean of the parts within τ of
   the kept parts' centre, outliers left out), and names the senders whose parts were outliers on
   most of its slice (``RoundStats.outlier_senders``).
4. Bytes on the wire and every failure (banned sender, failed reducer) are counted for the
   round report, because ``DecentralizedAverager.step()`` returns normally even when no part
   arrived.

It also watches the members it still waits for (:meth:`ConsensusAllReduceRunner._watch_members`):
after a killed member, a survivor's stream from it could stay silent, not broken, until hivemind's
``reducer_timeout`` (``bench.churn``: two survivors waited 20 s, to the all-reduce timeout, at
76.7% of their results, while a third member's streams broke at once).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from diloco_swarm.averaging.bandwidth import RateLimit, pace, stream_share
from diloco_swarm.averaging.reducer import RobustPartReducer
from diloco_swarm.averaging.sparse import SparseInt8Codec

logger = get_logger(__name__)

MAX_SENDER_WEIGHT = 1e12  # tokens; far above any honest round
REFUSED_OUR_PART = "refused our part"  # a reducer's reason in RoundStats.failed_reducers when it refused us
RMS_FLOOR = 1e-3  # the smallest RMS our own Δ counts as in the size bounds (covers an all-zero local part)
MAX_WEIGHT_SCALE = 64.0  # most an honest Δ's size bound grows for a sender that trained more tokens than us
SIZE_REASON = "above the bound"  # a part over the size bound: a judgement, so its sender is avoided a while, not banned
# in a refusal for a part's weight that differs from the sender's gathered one: not proof either (the gathered list is
# the leader's copy, which a hostile leader could alter to frame a member), so the sender is avoided a while, not banned
WEIGHT_REASON = "not the weight it gathered"
GONE_REASON = "gone: its averager did not answer a call"  # a member found dead mid-round (never banned: it may restart)
MEMBER_WATCH_AFTER_S = 1.0  # an all-reduce still waiting for a member after this long asks whether it is there ...
MEMBER_WATCH_EVERY_S = 1.0  # ... and again this often
MEMBER_CALL_TIMEOUT_S = 1.0  # a call that fails (not merely slow) within this long: the member is gone
OUTLIER_SHARE = 0.5  # a sender whose parts were outliers on at least this share of our slice is named (outlier_senders)


def allowed_scale(ratio: float, weight: float, own_weight: float) -> float:
    """How much larger than ours a member's Δ may be: ``ratio`` × its tokens / our tokens, within
    [1, MAX_WEIGHT_SCALE]. Δ grows with the inner steps behind it, and an honest phase can be far
    longer than ours (DyLU sizes phases by speed; an overlapped phase runs on while its round is in
    flight), so a fixed bound against our own Δ refused honest peers. The cap keeps a sender that
    claims a huge weight from also sending a huge Δ."""
    return ratio * min(max(1.0, weight / max(own_weight, 1e-12)), MAX_WEIGHT_SCALE)


@dataclass
class RoundStats:
    """What one all-reduce round did, as seen by this member (plain data: it crosses a process pipe)."""

    group_id: str = ""
    group_peer_ids: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_s: float = 0.0  # from the all-reduce's start in our averager process to its end
    failed_values: int = 0
    total_values: int = 0
    rejected_senders: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    # peer id -> why: a part over the size bound, left out of our slice (a Δ round goes on without it)
    oversized_senders: dict[str, str] = field(default_factory=dict)
    failed_reducers: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    # peer id -> share of the values we reduced on which its part was an outlier, left out (>= OUTLIER_SHARE; never
    # us). Not a failure: the round keeps the robust average
    outlier_senders: dict[str, float] = field(default_factory=dict)
    # the other senders whose parts our robust reducer weighed on our slice (outlier_senders among them): whose
    # outlier record this round counts in (conduct.py). Empty where the reducer is the plain mean (θ-mixing)
    scored_senders: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.failed_values == 0 and not self.rejected_senders and not self.failed_reducers

    @property
    def named_peers(self) -> dict[str, str]:
        """Peer id -> why this member's view of the round lacks it. A refused sender's reason wins
        over its failure as a reducer: the refusal is the cause (a member whose parts were refused
        drops its round, so it then sends nothing back as a reducer either)."""
        return {**self.failed_reducers, **self.rejected_senders}


def finite_norm(tensors: Sequence[torch.Tensor]) -> float | None:
    """L2 norm over every value of ``tensors`` (any shapes, float dtypes; accumulated per tensor in
    its own dtype, fp16/bf16 in fp32, then summed in fp64), or None when a value is NaN or ±Inf.

    One fused pass (``torch.linalg.vector_norm``) instead of an ``isfinite`` mask and then a square:
    a NaN or Inf makes the norm non-finite, so only then (or when finite values overflow fp32's
    square) the exact elementwise check runs. At 50M values: 0.03 s against 0.8 s for the two passes.
    """
    total = 0.0
    for t in tensors:
        if not t.numel():
            continue
        wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None  # no narrowing of fp64
        norm = float(torch.linalg.vector_norm(t.detach().reshape(-1), dtype=wide))
        if not math.isfinite(norm):
            if not bool(torch.isfinite(t).all()):
                return None
            return math.inf  # finite values too large for fp32: above any bound
        total += norm * norm
    return math.sqrt(total)


def _rms(t: torch.Tensor) -> float:
    """RMS of our own part (finite: it passed the runner's check before the round)."""
    norm = finite_norm([t])
    return norm / math.sqrt(t.numel()) if t.numel() and norm is not None else 0.0


def _part_bytes(message: averaging_pb2.AveragingData) -> int:
    """Bytes a cap counts for one message of an all-reduce: its tensor part (the rest is a few bytes)."""
    return len(message.tensor_part.buffer)


class ConsensusAllReduceRunner(AllReduceRunner):
    """``hivemind.averaging.allreduce.AllReduceRunner`` with identical results on all members.

    Outputs are absolute averages (not deltas) of the flattened tensors, fp32, in the order
    and shapes of ``tensors``. See the module docstring for the rules.

    :param stats: filled in during the round.
    :param max_part_rms_ratio: bound on an incoming part's RMS relative to ours, for a sender
        with our weight (:func:`allowed_scale`).
    :param upload: our upload cap, shared by every stream of the averager process (``bandwidth.py``);
        each part and each average we send waits for it. None: no cap.
    :param download: our download cap: each part and average we receive is read no faster.
    :param receive_caps: the download cap each member stated (``bandwidth.RECEIVE_CAP_KEY``, untrusted), in
        ``ordered_peer_ids``' order: what we send a capped member is paced to its share
        (``bandwidth.stream_share``).
    :param gathered_weights: the weight each member gathered to the group (``request.gathered_weights``), in
        ``ordered_peer_ids``' order: a sender's parts must carry it. None (θ-mixing): not checked here.
    """

    reducer_type: type[TensorPartReducer] = RobustPartReducer  # how our slice's parts are combined

    def __init__(self, *args, stats: RoundStats, max_part_rms_ratio: float, upload: RateLimit | None = None,
                 download: RateLimit | None = None, receive_caps: Sequence | None = None,
                 gathered_weights: Sequence | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._gathered_weights = {peer.to_base58(): w for peer, w in zip(self.ordered_peer_ids, gathered_weights or ())}
        self._upload, self._download = upload or RateLimit(None), download or RateLimit(None)
        caps = list(receive_caps or [])
        self._towards = {peer: stream_share(caps[i] if i < len(caps) else None, len(self.ordered_peer_ids))
                         for i, peer in enumerate(self.ordered_peer_ids)}
        if self.reducer_type is not type(self.tensor_part_reducer):
            self.tensor_part_reducer.finished.set()  # hivemind's, never used: no "received 0%" warning when collected
            self.tensor_part_reducer = self.reducer_type(tuple(part.shape for part in self.parts_for_local_averaging),
                                                         len(self.sender_peer_ids))
        self.tensor_part_container.return_deltas = False  # failed reducers then yield our own values
        self.stats = stats
        self.stats.group_id = self.group_id.hex() if isinstance(self.group_id, bytes) else str(self.group_id)
        self.stats.group_peer_ids = [p.to_base58() for p in self.ordered_peer_ids]
        self.stats.total_values = self.tensor_part_container.total_size
        self.max_part_rms_ratio = max_part_rms_ratio
        self._compression = self.tensor_part_container.compression
        self._sparse = isinstance(self._compression, SparseInt8Codec)  # its limits depend on the group (averaging/sparse.py)
        self._local_part_rms = [_rms(p) for p in self.parts_for_local_averaging]
        self._encoded_averages: dict[int, asyncio.Future] = {}
        self._reducer_calls: dict[PeerID, asyncio.Task] = {}  # members whose averages of their parts we still await
        self._senders_done: set[PeerID] = set()  # senders that gave us all their parts
        self._gone: set[PeerID] = set()

    async def run(self) -> AsyncIterator[torch.Tensor]:
        """hivemind's run, with :meth:`_watch_members` alongside (until its last task ended)."""
        watch = asyncio.ensure_future(self._watch_members())
        try:
            async for output in super().run():
                yield output
        finally:
            watch.cancel()
            self._name_outliers()

    def _name_outliers(self) -> None:
        """``stats.outlier_senders``: the other senders whose parts were outliers on at least
        :data:`OUTLIER_SHARE` of the values they gave our slice; ``stats.scored_senders``: every other
        sender that gave our slice values."""
        reducer = self.tensor_part_reducer
        if not isinstance(reducer, RobustPartReducer):
            return
        for index, peer in enumerate(self.sender_peer_ids):
            given, out = reducer.reduced_values[index], reducer.outlier_values[index]
            if peer == self.peer_id or not given:
                continue
            self.stats.scored_senders.append(peer.to_base58())
            if out >= OUTLIER_SHARE * given:
                self.stats.outlier_senders[peer.to_base58()] = round(out / given, 3)

    async def _watch_members(self) -> None:
        """Every :data:`MEMBER_WATCH_EVERY_S` after :data:`MEMBER_WATCH_AFTER_S`, call each member we
        still wait for (as its reducer or as a sender; clients serve no calls) with an empty
        ``rpc_round_outcome`` request, answered at once by a live averager (averaging/confirm.py).
        A call that fails is a member gone: stop waiting for it (:meth:`_drop_gone`). The new
        stream also makes our p2p daemon write to the dead connection, which may break the silent
        streams on it first."""
        await asyncio.sleep(MEMBER_WATCH_AFTER_S)
        we_reduce = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)] > 0
        while not self._future.done():
            waiting = [peer for peer, mode in zip(self.ordered_peer_ids, self.modes)
                       if peer != self.peer_id and mode != AveragingMode.CLIENT and peer not in self._gone
                       and (peer in self._reducer_calls
                            or (we_reduce and peer in self.sender_peer_ids and peer not in self._senders_done
                                and peer not in self.banned_senders))]
            answers = await asyncio.gather(*(self._answers(peer) for peer in waiting))
            for peer, answered in zip(waiting, answers):
                if not answered:
                    await self._drop_gone(peer)
            await asyncio.sleep(MEMBER_WATCH_EVERY_S)

    async def _answers(self, peer: PeerID) -> bool:
        """False when a call to ``peer``'s averager fails within :data:`MEMBER_CALL_TIMEOUT_S`;
        True when it answers or is merely slow (a loaded member is not gone)."""
        try:
            await asyncio.wait_for(self._get_peer_stub(peer).rpc_round_outcome(averaging_pb2.DownloadData()),
                                   MEMBER_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            return True
        except Exception as e:
            logger.debug(f"member {peer} is gone: {e!r}")
            return False
        return True

    async def _drop_gone(self, peer: PeerID) -> None:
        """Stop waiting for a dead member: as our reducer its parts are missing (our view is partial,
        so nobody keeps the round); as a sender, we reduce without its parts, as hivemind does after
        ``sender_timeout``: each part has one reducer, whose bytes every member applies, so the
        members' averages still agree."""
        self._gone.add(peer)
        call = self._reducer_calls.get(peer)
        if call is not None:
            call.cancel()  # its own handler registers the missing parts (_communicate_with_peer)
        if peer in self.sender_peer_ids and peer not in self._senders_done:
            await self._ban_sender(peer)

    async def _encoded_average(self, part_index: int, averaged_part: torch.Tensor):
        """Encode our average of a part once; every member gets (and we apply) these bytes."""
        future = self._encoded_averages.get(part_index)
        if future is None:
            future = self._encoded_averages[part_index] = asyncio.ensure_future(
                asyncio.get_event_loop().run_in_executor(
                    None, lambda: self._compression.compress_average(averaged_part, len(self.sender_peer_ids))
                    if self._sparse else self._compression.compress(averaged_part, CompressionInfo.from_tensor(averaged_part))
                )
            )
        return await future

    async def _communicate_with_peer(self, peer_id):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                if self._sparse:  # our own part counts as the others see theirs: what the wire would carry
                    tensor_part = self._compression.as_received(tensor_part)
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                serialized = await self._encoded_average(part_index, averaged_part)
                canonical = self._decode_average(serialized)
                self.tensor_part_container.register_processed_part(peer_index, part_index, canonical)
            return

        self._reducer_calls[peer_id] = asyncio.current_task()
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            expected_parts = self.tensor_part_container.num_parts_by_peer[peer_index]
            part_index = 0

            def _try_deserialize(msg):
                if msg.code == averaging_pb2.PROTOCOL_VIOLATION:
                    raise AllreduceException(f"{peer_id} {REFUSED_OUR_PART}")
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                if msg.tensor_part.compression != self._compression.compression_type:
                    raise AllreduceException(f"{peer_id} answered with another codec")
                return self._decode_average(msg.tensor_part), len(msg.tensor_part.buffer)

            async for averaged, n_bytes in amap_in_executor(
                _try_deserialize,
                self._download.paced(aiter_with_timeout(stream, self.reducer_timeout), _part_bytes),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index >= expected_parts:
                    raise AllreduceException(f"{peer_id} sent more parts than expected")
                if finite_norm([averaged]) is None:
                    raise AllreduceException(f"{peer_id} sent a non-finite average")
                self.stats.bytes_received += n_bytes
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != expected_parts:
                raise AllreduceException(f"{peer_id} sent {part_index} parts, expected {expected_parts}")
        except BaseException as e:
            reason = (GONE_REASON if peer_id in self._gone else
                      f"its averaged part did not come within {self.reducer_timeout:g} s" if isinstance(e, TimeoutError)
                      else repr(e) if isinstance(e, Exception) else type(e).__name__)
            self.stats.failed_reducers[peer_id.to_base58()] = reason[:200]
            self.tensor_part_container.register_failed_reducer(peer_index)
            self.stats.failed_values = self.tensor_part_container.failed_size
            if isinstance(e, Exception):
                logger.debug(f"reducer {peer_id} failed: {e!r}")
                await self._stop_waiting_for(peer_id)
            if peer_id in self._gone and isinstance(e, asyncio.CancelledError):
                return  # we cancelled it (_drop_gone): the round goes on without that member
            raise
        finally:
            self._reducer_calls.pop(peer_id, None)

    async def rpc_aggregate_part(self, stream, context) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, with the averages we send back paced to our upload cap and to the sender's stated
        download cap where they leave: hivemind holds a non-reducing member's averages until it has sent
        all its parts, then sends them at once."""
        towards = self._towards.get(context.remote_id) or RateLimit(None)
        async for message in super().rpc_aggregate_part(stream, context):
            await pace(_part_bytes(message), self._upload, towards)
            yield message

    async def _handle_missing_senders(self) -> None:
        """hivemind's (a sender that has not started within ``sender_timeout`` is banned), but it ends
        with the round. hivemind's ``run()`` awaits this task after the round has finished, so a member
        that never sent (a crash; banned meanwhile) held the end of every survivor's round for the
        whole ``sender_timeout`` although nothing was left to wait for."""
        started = asyncio.ensure_future(self.all_senders_started.wait())
        try:
            await asyncio.wait({started, self._future}, timeout=self.sender_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if self.all_senders_started.is_set() or self._future.done():
            return
        for peer_id in self.sender_peer_ids:
            if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                await self._ban_sender(peer_id)

    async def _stop_waiting_for(self, failed_reducer) -> None:
        """A member failed as our reducer before it sent us anything as a sender: ban it as a sender now.

        A crash closes its connections, so our call to it usually fails at once, while hivemind waits
        its ``sender_timeout`` (10 s) for parts that will never come (``bench.churn``: rounds ended 10 s
        after a member was killed). Our view of the round is partial from this moment, so no member
        keeps it (every member must confirm the same average): waiting only delays every member's
        verdict, and our reduction finishes without it."""
        if failed_reducer in self.sender_peer_ids and failed_reducer not in self.active_senders:
            await self._ban_sender(failed_reducer)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        towards = self._towards[self.ordered_peer_ids[peer_index]]
        async for message in super()._generate_input_for_peer(peer_index):
            await pace(_part_bytes(message), self._upload, towards)
            self.stats.bytes_sent += len(message.tensor_part.buffer)
            yield message

    def _check_sender_part(self, sender: str, part_index: int, tensor_part: torch.Tensor, weight: float,
                           compression) -> str | None:
        if compression != self._compression.compression_type:
            return "sent parts in another codec"
        if not (math.isfinite(weight) and 0.0 <= weight <= MAX_SENDER_WEIGHT):
            return f"sent an invalid weight {weight!r}"
        if sender in self._gathered_weights and weight != self._gathered_weights[sender]:
            return f"sent parts at weight {weight!r}, {WEIGHT_REASON} ({self._gathered_weights[sender]!r})"
        if part_index >= len(self.parts_for_local_averaging):
            return "sent more parts than expected"
        if tensor_part.shape != self.parts_for_local_averaging[part_index].shape:
            return "sent a part of the wrong shape"
        norm = finite_norm([tensor_part])
        if norm is None:
            return "sent non-finite values"
        bound = self._rms_bound(part_index, weight)
        part_rms = norm / math.sqrt(tensor_part.numel()) if tensor_part.numel() else 0.0
        if part_rms > bound:
            return f"sent a part with RMS {part_rms:.3g}, {SIZE_REASON} {bound:.3g}"
        return None

    def _decode_part(self, serialized) -> torch.Tensor | None:
        """A sender's part, decoded by our codec instance (a sparse one knows the run's entries per chunk);
        None for a part in another codec, never decoded (:meth:`_check_sender_part` refuses it first).
        :raises CodecError: a malformed part."""
        return self._compression.extract(serialized) if serialized.compression == self._compression.compression_type else None

    def _decode_average(self, serialized) -> torch.Tensor:
        """A reducer's average (checked for its codec by the caller). :raises CodecError: a malformed one."""
        if self._sparse:
            return self._compression.extract_average(serialized, len(self.sender_peer_ids))
        return deserialize_torch_tensor(serialized)

    def _rms_bound(self, part_index: int, weight: float) -> float:
        """The largest RMS a sender of ``weight`` may send for part ``part_index``."""
        return allowed_scale(self.max_part_rms_ratio, weight, self.weight) * max(self._local_part_rms[part_index], RMS_FLOOR)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        sender_id = self.sender_peer_ids[sender_index]
        part_index = 0
        try:

            def _deserialize(msg):
                return self._decode_part(msg.tensor_part), msg.weight, msg.tensor_part.compression, len(
                    msg.tensor_part.buffer
                )

            async for tensor_part, weight, compression, n_bytes in amap_in_executor(
                _deserialize, self._download.paced(stream, _part_bytes), max_prefetch=self.tensor_part_container.prefetch
            ):
                self.stats.bytes_received += n_bytes
                problem = self._check_sender_part(sender_id.to_base58(), part_index, tensor_part, weight, compression)
                left_out = problem is not None and SIZE_REASON in problem and isinstance(
                    self.tensor_part_reducer, RobustPartReducer)
                if left_out and sender_id.to_base58() not in self.stats.oversized_senders:  # a judgement, not proof
                    logger.warning(f"Leaving out peer {sender_id.to_base58()}'s part: it {problem}")
                    self.stats.oversized_senders[sender_id.to_base58()] = problem
                elif problem is not None and not left_out:
                    self.stats.rejected_senders[sender_id.to_base58()] = problem
                    logger.warning(f"Rejected peer {sender_id.to_base58()}: it {problem}")
                    # say so: a sender whose part was valid learns that we refused it (averager.py avoids us then)
                    yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                    break
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight,
                        **({"left_out": True} if left_out else {}))  # (hivemind's plain reducer takes no flag)
                    part_index += 1
                except Exception:  # BannedException: the sender was banned while we waited
                    self.stats.rejected_senders.setdefault(sender_id.to_base58(), "banned (too slow)")
                    break
                serialized = await self._encoded_average(part_index - 1, averaged_part)
                self.stats.bytes_sent += len(serialized.buffer)  # (paced where it leaves: rpc_aggregate_part)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        except Exception as e:  # a malformed part (CodecError) ends this sender's stream
            self.stats.rejected_senders[sender_id.to_base58()] = f"sent a malformed part ({e})"[:200]
            logger.warning(f"Rejected peer {sender_id.to_base58()}: malformed part ({e})")
        finally:
            if part_index == self.tensor_part_reducer.num_parts:
                self._senders_done.add(sender_id)
            elif sender_id in self._gone:  # a dead member, not a misbehaving one: not named as rejected
                await self._ban_sender(sender_id)
            else:
                self.stats.rejected_senders.setdefault(sender_id.to_base58(), "did not send all parts")
                await self._ban_sender(sender_id)


class MixingAllReduceRunner(ConsensusAllReduceRunner):
    """The all-reduce of a θ-mixing round (averaging/mixing.py): the same consensus and checks, and the
    plain weighted mean (members of different lineages differ by whole rounds of training, and members
    behind the round send parts at weight 0: the skipped mean's count-based centre would leave out the
    one lineage that differs, which the mix exists to bring in; docs/decisions.md, *Robust aggregation*), but
    every sender's weight must be the one the group's :class:`~diloco_swarm.averaging.mixing.MixPlan`
    gives it (1 or 0, known to every member), and a part's RMS is bounded against our own whole
    contribution (θ differences and momentum) rather than scaled by tokens: a member behind the round
    may hold the reference itself, so its own θ-difference part is zero.

    :param planned_weights: peer id (base58) -> the weight the plan gives it.
    """

    reducer_type = TensorPartReducer

    def __init__(self, *args, planned_weights: dict[str, float], **kwargs):
        super().__init__(*args, **kwargs)
        self.planned_weights = dict(planned_weights)
        whole = finite_norm(list(self.parts_for_local_averaging)) or 0.0
        size = sum(p.numel() for p in self.parts_for_local_averaging)
        self._contribution_rms = whole / math.sqrt(size) if size else 0.0

    def _check_sender_part(self, sender: str, part_index: int, tensor_part: torch.Tensor, weight: float,
                           compression) -> str | None:
        if weight != self.planned_weights.get(sender):
            return f"sent weight {weight!r}, the round's plan gives it {self.planned_weights.get(sender)!r}"
        return super()._check_sender_part(sender, part_index, tensor_part, weight, compression)

    def _rms_bound(self, part_index: int, weight: float) -> float:
        return self.max_part_rms_ratio * max(self._local_part_rms[part_index], self._contribution_rms, RMS_FLOOR)
