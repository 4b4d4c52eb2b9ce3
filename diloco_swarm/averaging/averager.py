"""Pseudo-gradient averager: hivemind matchmaking + :class:`ConsensusAllReduceRunner`.

One call of :meth:`PseudoGradientAverager.average` is one DiLoCo sync (arXiv 2311.08105,
Algorithm 1, the "outer gradient" all-reduce): copy the local pseudo-gradient Δ in, find a
group through hivemind's matchmaking inside the window, run the butterfly all-reduce with the
int8 codec, weight peers by the tokens they processed since their last sync, and verify the
result before handing it back. Any doubt makes the round a failed round: the caller then keeps
its θ_global and carries its Δ into the next round, or applies its own Δ (node/runner.py), never
a partial or unverified average.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import signal
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter
from hivemind.utils.streaming import combine_from_streaming

from diloco_swarm.averaging.allreduce import (
    MixingAllReduceRunner,
    REFUSED_OUR_PART,
    RMS_FLOOR,
    SIZE_REASON,
    ConsensusAllReduceRunner,
    RoundStats,
    allowed_scale,
    finite_norm,
)
from diloco_swarm.averaging.codec import Int8BlockwiseCodec
from diloco_swarm.averaging.confirm import DIGEST_WAIT_S, FAILED_MARK, OutcomeBoard, ask_outcomes, valid_outcome
from diloco_swarm.averaging.donation import Donations, StateSeal
from diloco_swarm.averaging.grouping import grid_group_quorum, is_count, majority_quorum, step_quorum_problem
from diloco_swarm.averaging.mixing import mixing_group_id
from diloco_swarm.averaging.reachability import Responder
from diloco_swarm.dht.calls import ChildGone, ChildUnavailable, bounded, dht_get, dht_store
from diloco_swarm.utils.hivemind_fixes import keep_task_alive, send_result

logger = get_logger(__name__)


class _QuietExpectedFailures(logging.Filter):
    """hivemind logs a full traceback at ERROR when no group formed, and when a stop ends an all-reduce
    in flight, and a warning at each group we refuse (``_group_problem``); we report solo, abandoned
    and refused rounds ourselves."""

    EXPECTED = ("could not find a group", "All-reduce was terminated during iteration", "may not advance")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


logging.getLogger("hivemind.averaging.averager").addFilter(_QuietExpectedFailures())

_STILL_LOOKING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)


def _cancel_step(control) -> None:
    """``StepControl.cancel()`` in an order without hivemind's race (1.1.12): its ``cancel`` wakes the
    averager process (the ``_cancel`` future) before it marks the step cancelled, so the averager could
    read the step as live, go on with the group it then found and run its all-reduce after the node had
    left the round: a member that never confirms, and whose Δ it carries on while the others apply it
    (seen in a NAT test's dumps; 1 in ~15 give-ups in a 3-averager reproduction). The shared state first."""
    MPFuture.cancel(control)
    if control._trigger is not None:
        control._trigger.cancel()
    if control._cancel is not None and not control._cancel.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            control._cancel.set_result(None)


def _log_declare_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug(f"declaring this peer as a state donor failed: {task.exception()!r}")


AVOID_AFTER_REFUSALS = 2  # a reducer that refused our valid part this many times within AVOID_MEMORY_S ...
AVOID_MEMORY_S = 600.0
AVOID_REFUSER_S = 300.0  # ... is avoided this long (one refusal can be an honest peer's bound at a bad moment)

AVERAGER_START_TIMEOUT_S = 120.0  # fork, replicate the DHT's libp2p client, register handlers; a busy machine
INBAND_GRACE_S = 1.0  # members' in-band answers usually arrive within this; the DHT copies are read after it
GONE_PROBE_EVERY_S = 2.0  # how often a cross-check asks whether its silent members are gone (each ask: a DHT ping)
LATE_MEMBER_PROBE_EVERY_S = 0.5  # how often a group still forming past its members' due time asks which are gone
GoneProbe = Callable[[Sequence[str]], set]  # probe(peer ids) -> those of them it finds (gone, or moved on); never raises
RECENT_GROUPS = 8  # rounds whose group may still run its θ-mixing all-reduce (averaging/mixing.py)
MIX_START_WAIT_S = DIGEST_WAIT_S + 15.0  # a member's mix request waits this long for our own mix to start
# a state download may last as long as its largest payload takes at 2 Mbit/s (a home uplink's donor; a
# stalled one is cut by the per-chunk timeout): a fixed bound refused every download over a few hundred MB
MIN_STATE_RATE_BPS = 250_000
REFUSED_GROUP_PAUSE_S = 1.0  # after a group that may not advance: the same members would meet again at once

COMPRESSIONS: dict[str, type[CompressionBase]] = {
    "int8": Int8BlockwiseCodec,
    "fp16": Float16Compression,
    "fp32": NoCompression,
}


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 (first 16 hex digits) over the raw fp32 bytes of ``tensors``, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())  # the buffer itself, no bytes copy
    return h.hexdigest()[:16]


@dataclass
class RoundResult:
    """Outcome of one averaging round, from this peer's point of view.

    ``ok`` is true only when a group of at least two formed, every part of every member
    arrived and passed the checks, the average is finite and within the norm bound, and
    **every** member published the same digest of the average in time (a member that saw a
    partial round publishes "failed" instead). When ``ok`` is false the caller gets its own Δ back.
    """

    ok: bool
    group_size: int  # 1 = no group (solo round)
    reason: str = ""
    group_peer_ids: list[str] = field(default_factory=list)
    group_id: str = ""  # hivemind's group id (hex): the same for every member of the round
    gathered: dict[str, Any] = field(default_factory=dict)  # peer id -> its metadata
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    matchmaking_s: float = 0.0
    rejected_peers: dict[str, str] = field(default_factory=dict)
    digest: str = ""
    agreed_peers: int = 0  # members (besides us) whose published digest matched ours
    gone_peers: list[str] = field(default_factory=list)  # silent members found gone: not waited for (_cross_check)
    # we published our digest and no member contradicted it, but not all confirmed in time: a member
    # that heard every confirmation may have kept the round (and our Δ in it), so we apply it too
    maybe_kept: bool = False


def _tensor_from_parts(parts: list) -> torch.Tensor:
    """One tensor of a state stream from its chunks (hivemind's ``combine_from_streaming``).

    :raises ValueError: the chunks do not make a whole tensor: the stream was cut (a donor that left
        mid-transfer) or the donor sent garbage. One line, instead of torch's reshape error.
    """
    try:
        return deserialize_torch_tensor(combine_from_streaming(parts))
    except Exception:
        raise ValueError("a tensor in the state stream is incomplete or malformed (did the donor leave mid-transfer?)") from None


class PseudoGradientAverager(DecentralizedAverager):
    """``hivemind.averaging.DecentralizedAverager`` that averages pseudo-gradients verifiably.

    :param tensors: the Δ buffers, fp32 CPU, shapes of the model parameters (shared memory).
    :param dht: a running ``hivemind.DHT``.
    :param prefix: matchmaking key; the run id, so only peers of the same run meet.
    :param compression: ``int8`` (default), ``fp16`` or ``fp32``.
    :param target_group_size: most peers in one group, unless a round asks for more.
    :param max_group_size: most peers a round may ask for (``--max-group-size``: the whole-swarm
        last round of a grid run); default ``target_group_size``.
    :param matchmaking_time: seconds a group leader gathers followers before it starts.
    :param allreduce_timeout: seconds the all-reduce may take once the group formed.
    :param next_chunk_timeout: seconds without a part before a peer counts as failed.
    :param max_norm_ratio: a received average whose norm exceeds this multiple of our own
        Δ's norm is discarded (hostile or broken peer); also bounds each incoming part's RMS. The
        multiple grows with the largest weight in the group over ours (``allreduce.allowed_scale``).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        compression: str = "int8",
        target_group_size: int = 4,
        max_group_size: int | None = None,
        matchmaking_time: float = 5.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        max_norm_ratio: float = 10.0,
        client_mode: bool | None = None,
        state_provider: Callable[[], tuple[dict[str, Any], list[torch.Tensor], StateSeal]] | None = None,
        **kwargs,
    ):
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        self.compression_name = compression
        codec = COMPRESSIONS[compression]()
        self.max_norm_ratio = max_norm_ratio
        self._allreduce_timeout_s = float(allreduce_timeout)
        self._round_stats: dict[str, RoundStats] = {}
        self._state_provider = state_provider
        self._banned_peers: set[str] = set()  # lives in the averager process
        self._avoided_peers: dict[str, float] = {}  # peer id -> time.monotonic() until which we avoid it
        self._refused_group: str | None = None  # why the last group of the step in flight was refused
        self._step_in_flight = None  # the StepControl of the round in flight, in the averager process
        self._refusals: dict[str, list[float]] = {}  # peer id -> when it refused our valid part (monotonic)
        self._reachability = Responder()  # answers dial-back checks (public peers only)
        self._outcomes = OutcomeBoard()  # our outcomes of recent rounds, asked by their members (confirm.py)
        self._recent_groups: dict[bytes, Any] = {}  # group id -> hivemind GroupInfo, newest last (θ-mixing)
        self._default_target_group_size = target_group_size
        self._max_group_size = max(target_group_size, max_group_size or target_group_size)
        # [round token, tensors of this round's average written so far]: the token is the node's (one
        # per use of the buffers), the count the averager process's, as the all-gather delivers them
        self._arrivals = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._donations = Donations()  # our state streamed to joiners (donation.py), counted in shared memory
        # hivemind's run_in_background() sets SIGINT to SIG_IGN in *our* process (meaning the
        # child); keep the child's SIG_IGN but give the caller its Ctrl+C handler back.
        previous_sigint = signal.getsignal(signal.SIGINT)
        try:
            super().__init__(
                averaged_tensors=tensors,
                dht=dht,
                start=True,
                prefix=prefix,
                target_group_size=target_group_size,
                min_group_size=2,
                min_matchmaking_time=matchmaking_time,
                request_timeout=max(0.5, min(3.0, matchmaking_time / 3)),  # hivemind: must be < matchmaking time
                allreduce_timeout=allreduce_timeout,
                next_chunk_timeout=next_chunk_timeout,
                compression=codec,
                client_mode=client_mode,
                allow_state_sharing=state_provider is not None and not client_mode,
                declare_state_period=10.0,
                **kwargs,
            )
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous_sigint)


    # --- bounds on waiting for the averager process (dht/calls.py has those for the DHT) ---------
    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind waits for the new process with no limit (forever, if its DHT process died)."""
        try:
            super().run_in_background(await_ready=await_ready, timeout=AVERAGER_START_TIMEOUT_S if timeout is None
                                      else timeout)
        except TimeoutError:
            if self._ready.done():  # the averager's own error, not our wait
                raise
            self.terminate()
            raise ChildUnavailable(f"the averager process did not start within {AVERAGER_START_TIMEOUT_S:.0f}s") from None

    @contextlib.contextmanager
    def get_tensors(self):
        """hivemind's ``get_tensors``, bounded: the lock is shared with the averager process, which
        may have died holding it. :raises ChildUnavailable: not acquired within the all-reduce timeout."""
        if not self.lock_averaged_tensors.acquire(timeout=self._allreduce_timeout_s + 30.0):
            raise ChildUnavailable("the averaged tensors stayed locked by the averager process; is it stuck?")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    # --- runs in the averager process -------------------------------------------------
    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        stats = self._round_stats[group_id.hex()] = RoundStats()
        await self._run_consensus(ConsensusAllReduceRunner, tensors, group_info, group_id, stats, count=True,
                                  **kwargs)

    async def _run_consensus(self, runner_type: type[ConsensusAllReduceRunner], tensors, group_info, group_id: bytes,
                             stats: RoundStats, count: bool = False, **kwargs) -> None:
        """One consensus all-reduce of ``tensors`` in place (absolute averages) with ``group_info``'s
        members, under ``group_id`` (already registered in ``_running_groups``); with ``count``, each
        tensor written is counted in the shared arrivals (:meth:`arrived`)."""
        runner = runner_type(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            stats=stats,
            max_part_rms_ratio=self.max_norm_ratio,
            **kwargs,
        )
        self._outcomes.expect(stats.group_id, stats.group_peer_ids)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        i = 0
        if count:
            self._arrivals[1] = 0
        async for averaged in runner:
            tensors[i].copy_(averaged.reshape(tensors[i].shape))  # absolute values, not deltas
            i += 1
            if count:
                self._arrivals[1] = i  # after the copy: the node reads tensor i - 1 once it sees i
        self.last_updated = get_dht_time()
        self._state_updated.set()
        stats.failed_values = runner.tensor_part_container.failed_size

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        problem = self._group_problem(group_info)
        if problem is not None:  # every member reads the same gathered bytes: all refuse alike, before any part moves
            future = self._running_groups.get(group_info.group_id)
            if future is not None and not future.done():
                future.cancel()  # a part request already waiting on the group ends
            await asyncio.sleep(REFUSED_GROUP_PAUSE_S)
            self._refused_group = problem
            raise AllreduceException(f"the group may not advance: {problem}")  # hivemind retries within the window
        self._recent_groups[group_info.group_id] = group_info  # its θ-mixing all-reduce may follow
        while len(self._recent_groups) > RECENT_GROUPS:
            del self._recent_groups[next(iter(self._recent_groups))]
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            step = self._step_in_flight
            if step is not None and step.cancelled():
                # the node left this round while its group formed or ran (a stop; or a give-up that met the
                # group's start): the others get every part, and hear that we keep nothing of it, so nobody
                # applies an average whose Δ we carry on, and nobody waits out the digest wait for us
                self._outcomes.settle(group_info.group_id.hex(), FAILED_MARK)
        except BaseException:
            # our side of the all-reduce failed (hivemind then retries in a new group): the members that
            # ask whether we keep this round hear "failed" now and are late alike, instead of waiting out
            # the digest wait for us and applying an average whose Δ we carry on (bench scale, 2026-12-04)
            self._outcomes.settle(group_info.group_id.hex(), FAILED_MARK)
            raise
        finally:
            stats = self._round_stats.pop(group_info.group_id.hex(), RoundStats())
            self._round_stats.clear()
            self._judge_members(stats)
        return {"gathered": gathered, "stats": dataclasses.asdict(stats)}

    def _group_problem(self, group_info) -> str | None:
        """Why this whole-swarm group must not run its round (``grouping.step_quorum_problem`` of the
        members' gathered outer steps, with the upper median of their online-peer counts), or None.
        Every member reads the same gathered bytes, so all judge alike. Not judged: grid groups (group
        bits set), rounds without counts, and swarms larger than the plans' cap (the upper median of the
        members' ``group_cap``): a grid run's plan mid-run is one group when only a few peers are coming,
        and those few may average; its last round, planned under ``--max-group-size``, is judged."""
        try:
            metas = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        except Exception:
            return None  # hivemind's own parse of the same bytes fails the round just after
        metas = [m if isinstance(m, dict) else {} for m in metas]
        if any(m.get("group_bits") for m in metas):
            return None
        claims, caps = _upper_median(metas, "online_peers"), _upper_median(metas, "group_cap")
        if claims is None:
            return None
        online = max(len(metas), claims)
        if online > (caps if caps is not None else self._default_target_group_size):
            return None
        return step_quorum_problem([m.get("outer_step") for m in metas], online)

    def _judge_members(self, stats: RoundStats) -> None:
        """Ban or avoid the members whose conduct in a finished all-reduce showed them hostile."""
        for peer, reason in stats.rejected_senders.items():
            if SIZE_REASON in reason:  # a judgement on an unusual Δ, not proof: avoid it a while
                self._avoid(peer, AVOID_REFUSER_S, f"its Δ was too large ({reason})")
            elif "too slow" not in reason and "did not send all parts" not in reason:
                self._banned_peers.add(peer)  # broke the protocol: never lead it again
        for peer, reason in stats.failed_reducers.items():
            # Our part was valid (we are honest): that reducer refuses honest members. A reducer
            # that timed out is not avoided: under load an honest one does too, and a crashed one is gone.
            if REFUSED_OUR_PART in reason:
                now = time.monotonic()
                recent = [t for t in self._refusals.get(peer, []) if now - t < AVOID_MEMORY_S] + [now]
                self._refusals[peer] = recent
                if len(recent) >= AVOID_AFTER_REFUSALS:
                    self._avoid(peer, AVOID_REFUSER_S, f"it refused our valid part {len(recent)} times")

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
            bandwidths, mode_ids, _ = zip(*map(self.serializer.loads, group_info.gathered))
            download = [b if AveragingMode(m) != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, mode_ids)]
            kwargs = dict(self.allreduce_kwargs)
            min_vector_size = kwargs.pop("min_vector_size")
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, sum(t.numel() for t in tensors), download, min_vector_size)
            self._running_groups.setdefault(mix_id, asyncio.Future())  # unless a member's request made it
            stats = RoundStats()
            try:
                await asyncio.wait_for(self._run_consensus(
                    MixingAllReduceRunner, tensors, group_info, mix_id, stats, planned_weights=planned_weights,
                    peer_fractions=fractions, weight=float(weight), **kwargs), timeout=self._allreduce_timeout_s)
            finally:
                self._running_groups.pop(mix_id, None)
                self._judge_members(stats)
            future.set_result(dataclasses.asdict(stats))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(_short_reason(e) if str(e) else type(e).__name__))

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler; a part for the θ-mixing all-reduce of one of our recent rounds waits
        (at most ``MIX_START_WAIT_S``) for our own mix to start instead of being refused."""
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

    def _avoid(self, peer: str, seconds: float, why: str) -> None:
        """Neither join a group this peer leads nor let it join ours, for ``seconds``."""
        self._avoided_peers[peer] = time.monotonic() + seconds
        logger.warning(f"Avoiding peer {peer} for {seconds:.0f}s: {why}")

    def _avoids(self, peer: str) -> bool:
        until = self._avoided_peers.get(peer)
        if until is not None and time.monotonic() >= until:
            del self._avoided_peers[peer]
            return False
        return until is not None

    async def _step(self, *, step, future_for_init):
        """hivemind's step, with matchmaking that skips the leaders we avoid (installed once), and the
        round's group key, target size and quorum from what ``average()`` put in our gathered data
        (:meth:`_round_settings`)."""
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is not None:
            bits, target, online, cap = self._round_settings(step)
            quorum = grid_group_quorum(target) if bits else self._quorum(online, cap)
            matchmaking.group_key_manager.group_bits = bits
            # hivemind's leader begins once its followers fill the target, whatever the quorum: a group
            # planned smaller than the quorum (late peers) waits for some of them
            matchmaking.target_group_size = max(target, quorum)
            matchmaking.min_group_size = quorum
        if matchmaking is not None and not getattr(matchmaking, "_skips_avoided_leaders", False):
            request_join_group = matchmaking._request_join_group

            async def _request_join_group(leader):
                if self._avoids(leader.to_base58()):
                    return None  # hivemind's matchmaking then tries the next potential leader
                return await request_join_group(leader)

            async def keep_our_key(group_info):  # hivemind would rotate group bits itself; we set them per round
                return None

            matchmaking._request_join_group = _request_join_group
            matchmaking.group_key_manager.update_key_on_group_assembled = keep_our_key
            matchmaking._skips_avoided_leaders = True
        self._refused_group = None
        self._step_in_flight = step  # its cancellation is read once its all-reduce ran (_aggregate_with_group)
        set_exception = step.set_exception

        def explain_refusals(e):  # a round that ends without a group after refusing one says why
            if self._refused_group is not None and "could not find a group" in str(e):
                e = AllreduceException(f"no group that may advance formed (the last one refused: {self._refused_group})")
            return set_exception(e)

        step.set_exception = explain_refusals
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        except concurrent.futures.InvalidStateError:
            if not step.cancelled():
                raise
            # the node stopped waiting (the others moved on, a stop) while a retry's all-reduce still ran:
            # hivemind's set_result on the cancelled step raises, a traceback nobody reads
            logger.debug("an all-reduce finished after the node had cancelled its step; its result is dropped")

    def _round_settings(self, step) -> tuple[str, int, int | None, int]:
        """(group bits, target group size, online peers, the plan's cap) that ``average()`` gathered for
        this round: our defaults (no bits: the run's one key) where they are missing or malformed."""
        try:
            _, _, user_data = self.serializer.loads(step.data_for_gather)
            data = self.serializer.loads(user_data)
        except Exception:
            data = {}
        data = data if isinstance(data, dict) else {}
        bits, target, online = data.get("group_bits"), data.get("group_size"), data.get("online_peers")
        cap = data.get("group_cap")
        if not (isinstance(bits, str) and len(bits) <= 64 and set(bits) <= {"0", "1"}):
            bits = ""
        # a planned group may hold one more than the cap (grouping.plan_round: nobody averages alone)
        if not is_count(target, 2, self._max_group_size + 1):
            target = self._default_target_group_size
        if not is_count(online):
            online = None
        if not is_count(cap, 2, self._max_group_size):
            cap = self._default_target_group_size
        return bits, target, online, cap

    def _quorum(self, online: int | None, max_group_size: int) -> int:
        """``grouping.majority_quorum`` of the ``online`` peers count that ``average()`` gathered
        (under the plan's cap ``max_group_size``), without the peers we ban or avoid (they never join
        our groups); 2 without a count."""
        if online is None:
            return 2
        shunned = len(self._banned_peers) + sum(1 for p in list(self._avoided_peers) if self._avoids(p))
        return majority_quorum(max(1, online - shunned), max_group_size)

    async def _declare_for_download_periodically(self):
        """hivemind's, with each declaration's outcome read: a store that times out (our DHT process
        was busy, e.g. while this node's main process was stopped) is logged at debug level instead of
        asyncio's "Task exception was never retrieved" traceback (hivemind 1.1.12 never reads it)."""
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or sharing_was_allowed:  # also once after it was switched off
                store = self.dht.store(download_key, subkey=self.peer_id.to_bytes(),
                                       value=self.state_sharing_priority if self.allow_state_sharing else None,
                                       expiration_time=expiration_time, return_future=True)
                task = asyncio.create_task(asyncio.wait_for(store, timeout=expiration_time - get_dht_time()))
                task.add_done_callback(_log_declare_failure)
                sharing_was_allowed = self.allow_state_sharing
            self._state_updated.clear()  # declare again after the period, or as soon as the field changes
            try:
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time()))
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self, timeout) -> None:
        # hivemind 1.1.12 calls .finalize() on the values of _running_groups, which are futures of the
        # runners (a traceback when a node stops mid all-reduce): finalize the runners ourselves
        remaining = set()
        for group in list(self._running_groups.values()):
            with contextlib.suppress(Exception):
                if group.done() and not group.cancelled():
                    remaining.update(group.result().finalize(cancel=True))
                else:
                    group.cancel()
        self._running_groups.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*remaining, return_exceptions=True), timeout)
        try:
            await super()._shutdown(timeout)
        finally:
            # hivemind never closes the averager's replica of the DHT's libp2p client, so every run left
            # a hivemind-p2pclient-*.sock behind; _terminate() closes it and removes that socket
            # (a replica owns no daemon: the DHT's p2pd keeps running until the DHT shuts down).
            p2p = getattr(self, "_p2p", None)
            if p2p is not None:
                with contextlib.suppress(Exception):
                    p2p._terminate()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """As a group leader, turn away peers that sent us invalid data or refused our valid part before."""
        peer = context.remote_id.to_base58()
        if peer in self._banned_peers or self._avoids(peer):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_check_reachability(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Dial a joining peer back from a fresh libp2p host (averaging/reachability.py)."""
        return await self._reachability.answer(request, context.remote_id)

    async def rpc_round_outcome(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """A member of one of our recent rounds asks what we apply (in-band confirmation, confirm.py)."""
        return await self._outcomes.answer(request, context.remote_id.to_base58())

    async def _settle_outcome(self, group_id: str, outcome: str) -> None:
        self._outcomes.settle(group_id, outcome)

    @keep_task_alive
    async def _ask_outcomes(self, group_id: str, peers: list[str], timeout: float, future: MPFuture):
        """Ask the other members of a round for their outcomes (confirm.ask_outcomes), over our own connections."""
        async def call(peer: str, request: averaging_pb2.DownloadData):
            return await self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix).rpc_round_outcome(request)

        try:
            future.set_result(await ask_outcomes(call, group_id, peers, timeout))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(_short_reason(e) if str(e) else type(e).__name__))

    @keep_task_alive
    async def _download_state_from(self, peer: str, timeout: float, max_bytes: int, total_timeout: float,
                                   future: MPFuture):
        """Stream one donor's state (hivemind's ``rpc_download_state``), bounded in bytes and time."""
        try:

            async def fetch():
                stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
                stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                metadata, parts, tensors, received = None, [], [], 0
                async for message in aiter_with_timeout(stream, timeout=timeout):
                    received += message.ByteSize()
                    if received > max_bytes:
                        raise ValueError(f"donor sent more than {max_bytes} bytes")
                    if message.metadata and metadata is None:
                        metadata = self.serializer.loads(message.metadata)
                    if message.tensor_part.dtype and parts:
                        tensors.append(_tensor_from_parts(parts))
                        parts = []
                    parts.append(message.tensor_part)
                if parts:
                    tensors.append(_tensor_from_parts(parts))
                return metadata, tensors, received

            send_result(future, await asyncio.wait_for(fetch(), timeout=total_timeout))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(_short_reason(e) if str(e) else type(e).__name__))

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest,
                                 _context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, streaming our live state with its seal (donation.py): no snapshot."""
        if not self.allow_state_sharing:
            return  # hivemind's refusal: the asker tries another donor
        metadata, tensors, seal = await self._get_current_state_from_host_process()
        async for message in self._donations.stream(metadata, tensors, seal, self.state_compression):
            yield message

    # --- runs in the caller's process -------------------------------------------------
    def get_current_state(self):
        """Serve our state to a downloading peer (hivemind calls this in our process, in a thread):
        (metadata, the live tensors, their :class:`StateSeal`), passed on as hivemind's third field."""
        if self._state_provider is None:
            raise RuntimeError("this peer does not share its state")
        return self._state_provider()

    def donating(self) -> bool:
        """Whether a state donation is streaming now (from the averager process)."""
        return self._donations.streaming()

    def freeze_donations(self, generation: int, timeout: float) -> bool:
        """Before the node writes its state of write ``generation``: the donations streaming it go on
        from a copy the averager process makes (donation.py). :returns: False when that took longer
        than ``timeout`` seconds (such a stream ends torn)."""
        return self._donations.freeze(generation, timeout)

    def donors(self) -> dict[str, float]:
        """Peers that share their state, with their priority (= their outer step): ``{peer_id: step}``."""
        try:
            out = state_donors(self.dht, self.prefix)
        except ChildGone:
            raise  # the node's watchdog ends the node
        except ChildUnavailable as e:  # a slow DHT (a loaded machine): no donor visible this time
            logger.debug(f"reading the state donors: {e}")
            return {}
        out.pop(self.peer_id.to_base58(), None)
        return out

    def download_state(self, peer: str, *, timeout: float, max_bytes: int,
                       stop: threading.Event | None = None) -> tuple[Any, list[torch.Tensor], int]:
        """Download one donor's (metadata, tensors, bytes received).

        :param timeout: seconds allowed between chunks; the whole transfer gets 4× that plus
            ``max_bytes`` at :data:`MIN_STATE_RATE_BPS`.
        :param max_bytes: refuse a payload larger than this.
        :param stop: when set, the download is abandoned at once (graceful leave).
        :raises RuntimeError: the donor failed, timed out or sent too much; ChildUnavailable (a
            RuntimeError) when the averager process is gone or ``stop`` was set. The payload itself is
            unchecked: the caller validates it against the run spec.
        """

        def start() -> MPFuture:
            future = MPFuture()
            self._outer_pipe.send(("_download_state_from", [], dict(peer=peer, timeout=timeout, max_bytes=max_bytes,
                                                                   total_timeout=total, future=future)))
            return future

        total = 4 * timeout + max_bytes / MIN_STATE_RATE_BPS
        return bounded(self, f"state download from {peer}", start, total + 5, stop)

    def average(
        self,
        delta: Sequence[torch.Tensor],
        *,
        weight: float,
        metadata: dict[str, Any],
        timeout: float,
        digest_wait: float = DIGEST_WAIT_S,
        stop: threading.Event | None = None,
        give_up: threading.Event | None = None,
        scheduled_time: float | None = None,
        online_peers: int | None = None,
        group_bits: str = "",
        group_size: int | None = None,
        group_cap: int | None = None,
        gone: GoneProbe | None = None,
        members: Sequence[str] = (),
        members_due: float | None = None,
        moved_on: GoneProbe | None = None,
    ) -> tuple[RoundResult, list[torch.Tensor]]:
        """Average ``delta`` with a group of peers; return the verified result.

        :param delta: this peer's pseudo-gradient, fp32, shapes of the averaged tensors.
        :param weight: tokens this peer processed since its last sync (> 0).
        :param metadata: small msgpack-able dict gathered from every member (outer step...); the
            averager adds ``weight`` to it.
        :param timeout: seconds to wait for a group before giving up (a solo round).
        :param digest_wait: seconds to wait for every other member's digest of the average
            (returns as soon as all arrived or one differs); a member still silent then makes
            the round failed.
        :param stop: when set, the round in flight is abandoned (graceful leave).
        :param give_up: when set while still looking for a group, stop looking (a solo round);
            a group that already formed finishes its all-reduce.
        :param scheduled_time: DHT time at which the all-reduce should begin (hivemind's
            ``step(scheduled_time=...)``): the leader waits for followers until then. A client
            (it never leads) ignores it and joins any leader that begins within ``timeout``.
        :param online_peers: peers of the run online now, this one included: a group must then
            hold a strict majority of them (``grouping.majority_quorum``); None: any 2 peers.
        :param group_bits: hivemind group bits of this round's planned group (``mixing.group_bits``
            of a ``grouping.plan_round`` key): only peers with the same bits meet; "" = the run's one key.
        :param group_size: the planned group's size (the leader starts once it is full); None: the
            averager's ``target_group_size``.
        :param group_cap: the most peers the round's plan put in one group (``grouping.RoundPlan.
            max_group_size``); None: the averager's ``target_group_size``. A group without bits while
            ``online_peers`` is at most this is the whole swarm's round: it needs a majority of them
            and its members' outer steps are judged (``grouping.step_quorum_problem``), however few
            peers the plan expected; beyond the cap any 2 peers may average.
        :param gone: ``gone(peer_ids)`` returns those whose process is gone (bounded in time, never
            raises); the digest cross-check stops waiting for them (:meth:`_cross_check`), and so
            does a group still forming past ``members_due``. None: wait for every member.
        :param members: the planned group's other members (peer ids); with ``members_due``.
        :param members_due: unix time by which every one of ``members`` should have joined. While the
            group still forms after it, every :data:`LATE_MEMBER_PROBE_EVERY_S` the members that are
            gone are asked for (``gone``) and taken off the target size (:meth:`_drop_members`): a
            member killed after the round was planned no longer holds the others until
            ``scheduled_time``; when none is left, the round ends at once (solo, not ``ok``).
        :param moved_on: ``moved_on(peer_ids)`` returns those that finished this round without us (their
            records show a later outer step: they averaged before we arrived); asked with ``gone``, and
            those are dropped alike, so a late peer stops waiting for a group that already ran.
        :returns: the round's result and the Δ to apply: the group's average when ``ok``, and when
            the round failed only for want of confirmations (``maybe_kept``: no member contradicted
            our digest, so those that heard every confirmation keep this very average; applying it
            too keeps us on their θ_global), else ``delta`` itself (fp32 CPU). The average is the
            shared buffers themselves, valid until the next call (which writes them): apply it first.
        """
        started = time.perf_counter()
        local = [d.detach().to("cpu", torch.float32) for d in delta]  # (read, never changed: no copy)
        with self.get_tensors() as buffers:
            for buf, d in zip(buffers, local):
                buf.copy_(d)
        try:
            if not self.is_alive():
                return self._solo(started, reason="the averager process is gone"), local
            if self.client_mode:
                # A client never leads: its scheduled time only goes into its join requests, and a leader
                # that begins later than that refuses it (BAD_EXPIRATION_TIME), each declaration tried
                # once. A client late for its own plan was refused by every leader until its window
                # ended; it now takes any leader that begins within its window.
                scheduled_time = get_dht_time() + 0.9 * timeout
            elif scheduled_time is not None:
                scheduled_time = min(scheduled_time, get_dht_time() + 0.9 * timeout)
            gather = {**metadata, "weight": float(weight), "online_peers": online_peers, "group_bits": group_bits,
                      "group_size": group_size, "group_cap": group_cap}
            control = self.step(weight=float(weight), gather=gather, timeout=timeout, allow_retries=True, wait=False,
                                scheduled_time=scheduled_time)
            # hivemind bounds the step in the averager process; this bounds our wait if that process dies
            deadline = time.monotonic() + timeout + self._allreduce_timeout_s + 30.0
            late = _LateMembers(members, members_due, group_size or self._default_target_group_size,
                                gone if members_due is not None else None, moved_on)
            while True:
                try:
                    control = control.result(timeout=0.25)
                    break
                except TimeoutError:
                    if stop is not None and stop.is_set():
                        _cancel_step(control)
                        return self._solo(started, reason="stopping"), local
                    if give_up is not None and give_up.is_set() and control.stage in _STILL_LOOKING:
                        _cancel_step(control)
                        return self._solo(started, reason="no group before the next inner phase ended"), local
                    if not self.is_alive() or time.monotonic() > deadline:
                        with contextlib.suppress(Exception):
                            _cancel_step(control)
                        why = "the averager process is gone" if not self.is_alive() else "the averager did not answer"
                        return self._solo(started, reason=why), local
                    if control.stage in _STILL_LOOKING and late.drop_gone():
                        if late.size < 2:  # nobody planned is left to average with: do not wait out the window
                            _cancel_step(control)
                            why = ("the other planned members averaged without us (we were late)" if late.moved
                                   else "the other planned members are gone")
                            return self._solo(started, reason=why), local
                        self._drop_members(late.size)
        except Exception as e:  # no group in the window, or the all-reduce failed outright
            return self._solo(started, reason=_short_reason(e)), local
        if control is None:
            return self._solo(started, reason="no group formed"), local

        stats = RoundStats(**control["stats"])
        gathered = {str(k): v for k, v in (control["gathered"] or {}).items()}
        result = RoundResult(
            ok=False,
            group_size=max(1, len(stats.group_peer_ids)),
            group_peer_ids=stats.group_peer_ids,
            group_id=stats.group_id,
            gathered=gathered,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            rejected_peers=stats.named_peers,
        )
        with self.get_tensors() as buffers:
            # the shared buffers themselves, not a copy (the memory budget): nothing writes them again
            # before the next average(), and the node applies this round before it hands off the next
            averaged = list(buffers)
        problem = self._check_round(stats, local, averaged, weight=float(weight), gathered=gathered)
        if problem is None:
            result.digest = tensors_digest(averaged)
            problem = self._cross_check(stats, result, digest_wait, stop, gone)
        elif len(stats.group_peer_ids) >= 2:
            self._publish_outcome(stats, FAILED_MARK)  # so the others never keep a partial average
        result.seconds = time.perf_counter() - started
        if problem is not None:
            result.reason = problem
            if result.maybe_kept:
                logger.warning(f"Averaging round unconfirmed ({problem}); its average is applied, as the members "
                               "that heard every confirmation do")
                return result, averaged
            logger.warning(f"Averaging round failed ({problem}); the average is not used")
            return result, local
        result.ok = True
        return result, averaged

    def begin_arrivals(self) -> int:
        """Call before :meth:`average` when its arrivals will be read (:meth:`arrived`): a new round
        token, no tensor arrived yet. :returns: the token."""
        token = int(self._arrivals[0]) + 1
        self._arrivals[0] = token
        self._arrivals[1] = 0
        return token

    def arrived(self) -> tuple[int, int]:
        """``(token, n)``: the first ``n`` tensors of the round in flight hold the group's average
        (``average``'s all-gather has delivered them; not yet verified); ``token`` names the round."""
        token, n = self._arrivals.tolist()
        return int(token), int(n)

    def peek(self, index: int, token: int) -> torch.Tensor | None:
        """Arrived tensor ``index`` (fp32, its parameter's shape) of round ``token``: the shared buffer
        itself, not a copy (the memory budget), read without the buffers' lock (the averager process
        holds it for the whole all-reduce; an arrived tensor is not written again in that round, nor
        before the next :meth:`average`). None when the buffers moved on to another use."""
        return self._averaged_tensors[index] if int(self._arrivals[0]) == token else None

    def _drop_members(self, target: int) -> None:
        """Lower the forming group's target size to ``target`` (≥ 2; members found gone); as its
        leader, begin at once when the followers already reach it (:meth:`_lower_target`)."""
        self._outer_pipe.send(("_lower_target", [], dict(target=target)))

    async def _lower_target(self, target: int) -> None:
        """(averager process) hivemind's leader begins when its followers fill ``target_group_size``
        (``Matchmaking.rpc_join_group``) or at the declared expiration time; lowering the target when
        no more followers will come begins it now, with at least ``min_group_size`` (the quorum)."""
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None or not matchmaking.is_looking_for_group:
            return  # the group formed meanwhile (or the round ended): nothing to shorten
        async with matchmaking.lock_request_join_group:
            matchmaking.target_group_size = max(2, min(matchmaking.target_group_size or target, target))
            if matchmaking.group_key_manager.group_bits:  # a grid group: a majority of the members still coming
                matchmaking.min_group_size = min(matchmaking.min_group_size, grid_group_quorum(target))
            size = len(matchmaking.current_followers) + 1
            if (matchmaking.current_followers and matchmaking.current_leader is None
                    and matchmaking.is_looking_for_group and not matchmaking.assembled_group.done()
                    and size >= max(matchmaking.target_group_size, matchmaking.min_group_size)):
                logger.debug(f"beginning with {size} peers: the others planned for this round are gone")
                await matchmaking.leader_assemble_group()

    def mix(self, contribution: Sequence[torch.Tensor], *, round_result: RoundResult, weight: float,
            planned_weights: dict[str, float], digest_wait: float = DIGEST_WAIT_S,
            stop: threading.Event | None = None, gone: GoneProbe | None = None) -> tuple[RoundResult, list[torch.Tensor]]:
        """θ-mixing (averaging/mixing.py): a second consensus all-reduce in the group of the verified
        round ``round_result``, over ``contribution`` (fp32 CPU tensors: this member's θ differences
        to the plan's reference, then its outer momentum), verified like a round (every part checked,
        every member confirming the same digest).

        :param weight: this member's weight in the plan (1 or 0); ``planned_weights`` every member's.
        :param gone: as in :meth:`average`.
        :returns: the mixing round's result and the mixed tensors (``contribution``'s shapes) when
            ``ok``, else a copy of ``contribution``. Never raises for a failed or silent group.
        """
        started = time.perf_counter()
        local = [t.detach().to("cpu", torch.float32).clone() for t in contribution]
        shared = [t.clone().share_memory_() for t in local]  # the averager process writes the average into them

        def start() -> MPFuture:
            future = MPFuture()
            self._outer_pipe.send(("_mix_round", [], dict(group_id=round_result.group_id, tensors=shared,
                                                         weight=float(weight), planned_weights=dict(planned_weights),
                                                         future=future)))
            return future

        try:
            stats = RoundStats(**bounded(self, "θ-mixing all-reduce", start, self._allreduce_timeout_s + 10.0, stop))
        except Exception as e:
            with contextlib.suppress(Exception):  # so the other members do not wait for our digest
                mix_id = mixing_group_id(bytes.fromhex(round_result.group_id)).hex()
                self._publish_outcome(RoundStats(group_id=mix_id, group_peer_ids=round_result.group_peer_ids), FAILED_MARK)
            return RoundResult(ok=False, group_size=round_result.group_size, group_peer_ids=round_result.group_peer_ids,
                               reason=f"mixing: {_short_reason(e)}", seconds=time.perf_counter() - started), local
        result = RoundResult(ok=False, group_size=max(1, len(stats.group_peer_ids)), group_peer_ids=stats.group_peer_ids,
                             group_id=stats.group_id, bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
                             rejected_peers=stats.named_peers)
        averaged = [t.clone() for t in shared]
        problem = self._check_round(stats, local, averaged, weight=1.0, gathered={})  # weights are the plan's: no token scaling
        if problem is None:
            result.digest = tensors_digest(averaged)
            problem = self._cross_check(stats, result, digest_wait, stop, gone)
        elif len(stats.group_peer_ids) >= 2:
            self._publish_outcome(stats, FAILED_MARK)
        result.seconds = time.perf_counter() - started
        if problem is not None:
            result.reason = f"mixing: {problem}"
            logger.warning(f"θ-mixing round failed ({problem}); each member keeps its own θ_global")
            return result, local
        result.ok = True
        return result, averaged

    def _solo(self, started: float, reason: str) -> RoundResult:
        return RoundResult(ok=False, group_size=1, reason=reason, seconds=time.perf_counter() - started)

    def _check_round(self, stats: RoundStats, local, averaged, *, weight: float,
                     gathered: dict[str, Any]) -> str | None:
        if len(stats.group_peer_ids) < 2:
            return "no group formed"
        if stats.rejected_senders:
            return "rejected " + ", ".join(f"{p} ({r})" for p, r in stats.rejected_senders.items())
        if stats.failed_reducers or stats.failed_values:
            return f"partial round: {stats.failed_values} of {stats.total_values} values missing"
        avg_norm = finite_norm(averaged)
        if avg_norm is None:
            return "the average is not finite"
        local_norm = finite_norm(local) or 0.0  # ours is finite: the runner checked Δ before the round
        scale = allowed_scale(self.max_norm_ratio, _largest_weight(gathered), weight)
        floor = RMS_FLOOR * math.sqrt(sum(d.numel() for d in local))  # the parts' RMS floor, as a norm
        if avg_norm > scale * max(local_norm, floor):
            return f"the average's norm {avg_norm:.3g} exceeds {scale:.3g}x our own ({local_norm:.3g})"
        return None

    def _round_key(self, stats: RoundStats) -> str:
        return f"{self.prefix}_round_{stats.group_id}"

    def _publish_outcome(self, stats: RoundStats, outcome: str) -> None:
        """Say our outcome of the round (its digest, or "failed"): in-band to the members that ask us
        (confirm.py), and in the DHT for those that cannot (a client dials out only). The DHT store runs
        on a helper thread: a member that asked us in-band does not wait for it."""
        with contextlib.suppress(BrokenPipeError, ConnectionError, EOFError, OSError):  # process gone: the DHT copy stands
            self._outer_pipe.send(("_settle_outcome", [], dict(group_id=stats.group_id, outcome=outcome)))
        threading.Thread(target=self._store_outcome, args=(stats, outcome), name="round-outcome", daemon=True).start()

    def _store_outcome(self, stats: RoundStats, outcome: str) -> None:
        try:
            dht_store(self.dht, self._round_key(stats), outcome, subkey=self.peer_id.to_base58(),
                      expiration_time=get_dht_time() + 120)
        except Exception as e:  # the members that need this copy then report us silent
            logger.debug(f"could not publish the round outcome: {_short_reason(e)}")

    def _ask_members(self, stats: RoundStats, others: set[str], timeout: float) -> MPFuture | None:
        """Start asking the other members for their outcomes in-band; None if the averager process is gone."""
        future = MPFuture()
        try:
            self._outer_pipe.send(("_ask_outcomes", [], dict(group_id=stats.group_id, peers=sorted(others),
                                                             timeout=timeout, future=future)))
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            return None
        return future

    def _read_outcomes(self, stats: RoundStats, others: set[str], timeout: float,
                       stop: threading.Event | None) -> dict[str, str]:
        """The members' outcomes published in the DHT (the copies of those we could not ask).
        :raises ChildUnavailable: the DHT did not answer, or ``stop`` was set."""
        found = dht_get(self.dht, self._round_key(stats), latest=True, timeout=timeout, stop=stop)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {p: o for p, o in ((str(k), valid_outcome(v.value)) for k, v in found.value.items()) if p in others and o}

    def _cross_check(self, stats: RoundStats, result: RoundResult, digest_wait: float,
                     stop: threading.Event | None = None, gone: GoneProbe | None = None) -> str | None:
        """Every member says the digest of the average it would apply, or "failed"; the round
        counts only when all of them match ours (no member keeps a different value). Members
        are asked in-band first (confirm.py); after ``INBAND_GRACE_S``, the DHT copies stand in
        for those not heard from (clients, peers we cannot dial). A set ``stop`` abandons the
        round at once (returns "stopping").

        A member still silent then is asked whether it is there (``gone``, every
        ``GONE_PROBE_EVERY_S``): one whose process is gone (it crashed after the all-reduce) can
        keep no other value, so it is no longer waited for (``result.gone_peers``). Our view of the
        all-reduce was complete, so it had sent all its parts. Without this the others waited out
        the whole digest wait and then dropped the round (``bench.churn``: two survivors, 15 s each)."""
        others = set(stats.group_peer_ids) - {self.peer_id.to_base58()}
        self._publish_outcome(stats, result.digest)
        result.maybe_kept = True  # every way out but a contradiction leaves open that a member kept the round
        started = time.monotonic()
        deadline = started + digest_wait
        asking = self._ask_members(stats, others, digest_wait)
        outcomes: dict[str, str] = {}
        next_probe = started + INBAND_GRACE_S
        while True:
            if asking is not None and asking.done():
                with contextlib.suppress(Exception):  # the averager failed to ask: the DHT copies stand in
                    outcomes = {**asking.result(), **outcomes}
                asking = None
            problem = _judge(outcomes, others, result.digest)
            result.agreed_peers = sum(1 for p in others if outcomes.get(p) == result.digest)
            if problem is not None:
                result.maybe_kept = False  # a member said "failed" or another digest: nobody can keep it
                return problem
            if result.agreed_peers == len(others):
                return None
            if stop is not None and stop.is_set():
                return "stopping"
            now = time.monotonic()
            if now > deadline:
                silent = sorted(others - set(outcomes))
                return f"members did not confirm the average within {digest_wait:.0f}s: " + ", ".join(silent)
            if gone is not None and now >= next_probe:
                next_probe = now + GONE_PROBE_EVERY_S
                left = gone(sorted(others - set(outcomes))) & others
                if left:
                    others -= left
                    result.gone_peers = sorted({*result.gone_peers, *left})
                    continue  # judged again at once: the members still there may all have confirmed
            if asking is None or now - started > INBAND_GRACE_S:
                try:
                    outcomes = {**self._read_outcomes(stats, others, max(1.0, deadline - now), stop), **outcomes}
                except ChildUnavailable as e:
                    return "stopping" if stop is not None and stop.is_set() else f"could not read the round digests ({e})"
                pause = 0.2
            else:  # the in-band answers wake us as soon as they are in
                pause = max(0.0, min(0.25, INBAND_GRACE_S - (now - started)))
            if asking is not None:
                with contextlib.suppress(Exception):
                    asking.result(timeout=pause)
            elif stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)


class _LateMembers:
    """The planned members of a forming group that have not made it by their due time: which are gone
    or moved on (asked through ``gone`` and ``moved_on`` at most every :data:`LATE_MEMBER_PROBE_EVERY_S`),
    and the group's size without them (``size``, this peer included). With no ``gone`` or no due time
    it never asks."""

    def __init__(self, members: Sequence[str], due: float | None, size: int, gone: GoneProbe | None,
                 moved_on: GoneProbe | None = None):
        self.members, self.size, self.gone, self.moved_on = list(members), size, gone, moved_on
        self.lost: set[str] = set()
        self.moved: set[str] = set()  # of ``lost``: those that finished the round without us
        self._next = due if due is not None else math.inf  # (unix s) the first ask

    def drop_gone(self) -> bool:
        """Ask once it is time; :returns: whether members were found gone or moved on since the last ask."""
        if self.gone is None or time.time() < self._next:
            return False
        left = [p for p in self.members if p not in self.lost]
        found = self.gone(left) & set(left) if left else set()
        rest = [p for p in left if p not in found]
        moved = self.moved_on(rest) & set(rest) if rest and self.moved_on is not None else set()
        self._next = time.time() + LATE_MEMBER_PROBE_EVERY_S
        if not found and not moved:
            return False
        self.lost |= found | moved
        self.moved |= moved
        self.size -= len(found) + len(moved)
        return True


def _judge(outcomes: dict[str, str], others: set[str], digest: str) -> str | None:
    """Why the round cannot be kept given the ``outcomes`` heard so far (peer id -> digest or
    FAILED_MARK), or None while no member contradicts our average's ``digest``."""
    failed = sorted(p for p in others if outcomes.get(p) == FAILED_MARK)
    if failed:
        return "members saw a partial round: " + ", ".join(failed)
    mismatched = sorted(p for p in others if p in outcomes and outcomes[p] != digest)
    if mismatched:
        return "members hold a different average: " + ", ".join(mismatched)
    return None


def state_donors(dht: DHT, prefix: str) -> dict[str, float]:
    """Peers of run ``prefix`` that share their state (public, non-client peers), from hivemind's
    ``{prefix}.all_averagers`` DHT key: ``{peer_id: priority}`` (priority = outer step).

    :raises ChildUnavailable: the DHT process is gone or did not answer in time (dht/calls.py)."""
    found = dht_get(dht, f"{prefix}.all_averagers", latest=True)
    out: dict[str, float] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for peer, item in found.value.items():
        value = getattr(item, "value", None)
        if isinstance(value, (int, float)) and math.isfinite(value):
            try:
                out[PeerID(peer).to_base58() if isinstance(peer, bytes) else str(peer)] = float(value)
            except Exception:
                continue
    return out


def _largest_weight(gathered: dict[str, Any]) -> float:
    """The largest ``weight`` a group member claimed in its gathered metadata (untrusted: 0 if none is valid)."""
    largest = 0.0
    for meta in gathered.values():
        weight = meta.get("weight") if isinstance(meta, dict) else None
        if isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight):
            largest = max(largest, float(weight))
    return largest


def _upper_median(metas: list[dict], field: str) -> int | None:
    """The upper median of the members' claimed ``field`` (untrusted: only ints ≥ 1 count), or None:
    a few members cannot move it past what most of them said."""
    claims = sorted(v for v in (m.get(field) for m in metas) if is_count(v, 1))
    return claims[len(claims) // 2] if claims else None


def _short_reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:160]
