"""Pseudo-gradient averager: hivemind matchmaking + :class:`ConsensusAllReduceRunner`.

One call of :meth:`PseudoGradientAverager.average` is one DiLoCo sync (arXiv 2311.08105,
Algorithm 1, the "outer gradient" all-reduce): copy the local pseudo-gradient Δ in, find a
group through hivemind's matchmaking inside the window, run the butterfly all-reduce with the
int8 codec, weight peers by the tokens they processed since their last sync, and verify the
result before handing it back. Any doubt makes the round a failed round: the caller then keeps
its θ_global and carries its Δ into the next round, or applies its own Δ (node/runner.py), never
a partial or unverified average.

This module is the round itself. Its parts live beside it, one concern each: the round's inputs
(``request.py``), the group (``matchmaking.py``, ``grouping.py``), the all-reduce
(``allreduce.py``), the result and its local checks (``results.py``), the members' confirmation
(``confirm.py``), the peers kept out (``conduct.py``), the θ-mixing round (``mixing_round.py``,
planned by ``mixing.py``) and state donation and download (``state_sharing.py``, ``donation.py``).
Where hivemind looks a method up on the averager (``rpc_*`` handlers, calls through its control
pipe), that concern's methods are a mixin of :class:`PseudoGradientAverager`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time
from typing import AsyncIterator, Callable, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger

from diloco_swarm.averaging.admission import Admission
from diloco_swarm.averaging.allreduce import ConsensusAllReduceRunner, RoundStats
from diloco_swarm.averaging.bandwidth import (RECEIVE_CAP_KEY, RateLimit, advertised_mbps, gathered_caps, longest_timeout,
                                               sized_to_caps)
from diloco_swarm.averaging.codec import Int8BlockwiseCodec
from diloco_swarm.averaging.sparse import SPARSE_MODES, SparseInt8Codec
from diloco_swarm.averaging.conduct import PeerConduct
from diloco_swarm.averaging.confirm import FAILED_MARK, ConfirmedRounds
from diloco_swarm.averaging.grouping import grid_group_quorum, group_problem, majority_quorum
from diloco_swarm.averaging.matchmaking import LateMembers, await_group, configure_round, lower_target, round_settings
from diloco_swarm.averaging.mixing_round import ThetaMixing
from diloco_swarm.averaging.reachability import Responder, refusal, shown_admission
from diloco_swarm.averaging.request import GatheredEntry, RoundRequest, gathered_entries, gathered_weights
from diloco_swarm.averaging.results import RoundResult, short_reason
from diloco_swarm.averaging.state_sharing import StateProvider, StateSharing
from diloco_swarm.dht.calls import ChildUnavailable

logger = get_logger(__name__)


class _QuietExpectedFailures(logging.Filter):
    """hivemind logs a full traceback at ERROR when no group formed, and when a stop ends an all-reduce
    in flight, and a warning at each group we refuse (``_group_problem``); we report solo, abandoned
    and refused rounds ourselves."""

    EXPECTED = ("could not find a group", "All-reduce was terminated during iteration", "may not advance")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


logging.getLogger("hivemind.averaging.averager").addFilter(_QuietExpectedFailures())

AVERAGER_START_TIMEOUT_S = 120.0  # fork, replicate the DHT's libp2p client, register handlers; a busy machine
REFUSED_GROUP_PAUSE_S = 1.0  # after a group that may not advance: the same members would meet again at once

COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {
    "int8": Int8BlockwiseCodec,
    "fp16": Float16Compression,
    "fp32": NoCompression,
    **{name: functools.partial(SparseInt8Codec, per_chunk=k, resparsify=cut) for name, (k, cut) in SPARSE_MODES.items()},
}
# bytes per value of a Δ on the wire, at most (int8's per-block scales and a sparse mode's fewer values aside):
# what a round's time bound is sized by (bandwidth.group_timeout)
WIRE_BYTES_PER_VALUE = {"fp32": 4, "fp16": 2}


class PseudoGradientAverager(ConfirmedRounds, StateSharing, ThetaMixing, DecentralizedAverager):
    """``hivemind.averaging.DecentralizedAverager`` that averages pseudo-gradients verifiably.

    Besides :meth:`average`, the node calls :meth:`mix` (``mixing_round.ThetaMixing``),
    :meth:`donors`, :meth:`download_state`, :meth:`donating` and :meth:`freeze_donations`
    (``state_sharing.StateSharing``).

    :param tensors: the Δ buffers, fp32 CPU, shapes of the model parameters (shared memory).
    :param dht: a running ``hivemind.DHT``.
    :param prefix: matchmaking key; the run id, so only peers of the same run meet.
    :param compression: ``int8`` (default), ``fp16``, ``fp32`` or a sparse int8 mode (``sparse.SPARSE_MODES``:
        the all-reduce's input must then be a selection, ``node/feedback.py``).
    :param target_group_size: most peers in one group, unless a round asks for more.
    :param max_group_size: most peers a round may ask for (``--max-group-size``: the whole-swarm
        last round of a grid run); default ``target_group_size``.
    :param matchmaking_time: seconds a group leader gathers followers before it starts.
    :param allreduce_timeout: seconds the all-reduce may take once the group formed.
    :param next_chunk_timeout: seconds without a part before a peer counts as failed.
    :param max_norm_ratio: a received average whose norm exceeds this multiple of our own
        Δ's norm is discarded (hostile or broken peer); also bounds each incoming part's RMS. The
        multiple grows with the largest weight in the group over ours (``allreduce.allowed_scale``).
    :param max_upload_mbps: this peer's upload cap in Mbit/s (``--max-upload-mbps``; None: none), on every
        byte of its rounds and state donations (``bandwidth.py``).
    :param max_download_mbps: its download cap, likewise.
    :param organiser: ``RunSpec.organiser`` of a private run: only peers with a valid invitation
        meet us in a group, download our state or have us dial them back (``admission.py``);
        None (a public run) admits everyone.
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
        state_provider: StateProvider | None = None,
        organiser: str | None = None,
        max_upload_mbps: float | None = None,
        max_download_mbps: float | None = None,
        **kwargs,
    ):
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        self.compression_name = compression
        codec = COMPRESSIONS[compression]()
        self.max_norm_ratio = max_norm_ratio
        self._upload, self._download = RateLimit(max_upload_mbps), RateLimit(max_download_mbps)
        # a group waits as long as its slowest member's caps need (bandwidth.group_timeout), at least
        # --allreduce-timeout; hivemind's own wait and ours in the node allow the longest of those
        self._round_bytes = sum(t.numel() for t in tensors) * WIRE_BYTES_PER_VALUE.get(compression, 1)
        self._configured_allreduce_s = float(allreduce_timeout)
        self._allreduce_timeout_s = longest_timeout(allreduce_timeout, self._round_bytes)
        self._round_stats: dict[str, RoundStats] = {}
        self._init_state_sharing(state_provider)
        self._init_mixing()
        self._init_confirmation(dht, prefix)
        self._conduct = PeerConduct()  # the peers we ban or avoid (averager process)
        self._admission = Admission(lambda key: dht.get(key, latest=True, return_future=True), prefix, organiser)
        self._refused_group: str | None = None  # why the last group of the step in flight was refused
        self._step_in_flight = None  # the StepControl of the round in flight, in the averager process
        self._reachability = Responder()  # answers dial-back checks (public peers only)
        self._default_target_group_size = target_group_size
        self._max_group_size = max(target_group_size, max_group_size or target_group_size)
        # [round token, tensors of this round's average written so far]: the token is the node's (one
        # per use of the buffers), the count the averager process's, as the all-gather delivers them
        self._arrivals = torch.zeros(2, dtype=torch.int64).share_memory_()
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
                allreduce_timeout=self._allreduce_timeout_s,
                next_chunk_timeout=next_chunk_timeout,
                bandwidth=advertised_mbps(max_upload_mbps, max_download_mbps),
                compression=codec,
                client_mode=client_mode,
                allow_state_sharing=state_provider is not None and not client_mode,
                declare_state_period=10.0,
                **kwargs,
            )
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous_sigint)

    @property
    def allreduce_ceiling_s(self) -> float:
        """The longest a group's all-reduce may take (s): ``--allreduce-timeout``, or what a group whose
        slowest member is capped at ``bandwidth.MIN_CAP_MBPS`` needs for our Δ."""
        return self._allreduce_timeout_s

    def _command(self, method: str, **kwargs) -> None:
        """Call our ``method`` in the averager process (hivemind's control pipe); returns at once.
        :raises OSError, EOFError: that process is gone."""
        self._outer_pipe.send((method, [], kwargs))

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
        started = time.monotonic()
        try:
            await self._run_consensus(ConsensusAllReduceRunner, tensors, group_info, group_id, stats, count=True,
                                      **kwargs)
        finally:
            stats.allreduce_s = time.monotonic() - started

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
            upload=self._upload,
            download=self._download,
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
        entries = gathered_entries(group_info.gathered, self.serializer.loads)  # the one parse of the members' bytes
        problem = self._group_problem(entries)
        if problem is not None:  # every member reads the same gathered bytes: all refuse alike, before any part moves
            future = self._running_groups.get(group_info.group_id)
            if future is not None and not future.done():
                future.cancel()  # a part request already waiting on the group ends
            await asyncio.sleep(REFUSED_GROUP_PAUSE_S)
            self._refused_group = problem
            raise AllreduceException(f"the group may not advance: {problem}")  # hivemind retries within the window
        self._remember_group(group_info)  # its θ-mixing all-reduce may follow
        try:
            kwargs, timeout = self._sized_to_caps(entries, kwargs)
            kwargs["gathered_weights"] = gathered_weights(entries)
            gathered = await asyncio.wait_for(super()._aggregate_with_group(group_info, min_vector_size, **kwargs),
                                              timeout)
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
            self._conduct.judge(stats)
        return {"gathered": gathered, "stats": dataclasses.asdict(stats), "avoided": self._conduct.shunned_peers()}

    def _sized_to_caps(self, entries: Sequence[GatheredEntry | None], kwargs: dict) -> tuple[dict, float]:
        """A group's all-reduce sized to its members' caps (``bandwidth.sized_to_caps`` of their gathered
        ``entries``): the runner's ``kwargs`` and the seconds the whole all-reduce may take, within
        :attr:`allreduce_ceiling_s`."""
        timeouts = (self._configured_allreduce_s, self._allreduce_timeout_s)
        return sized_to_caps(kwargs, gathered_caps(entries), timeouts, self._round_bytes)

    def _group_problem(self, entries: Sequence[GatheredEntry | None]) -> str | None:
        """Why this group must not run its round (``grouping.group_problem`` of the members' gathered
        metadata, ``entries``), or None. Every member reads the same gathered bytes, so all judge alike."""
        if any(entry is None for entry in entries):
            return None  # hivemind's own parse of the same bytes fails the round just after
        return group_problem([entry.meta for entry in entries], self._default_target_group_size)

    async def _step(self, *, step, future_for_init):
        """hivemind's step, with the round's group key, target size and quorum from what ``average()``
        put in our gathered data (:meth:`_round_settings`), and matchmaking that skips the leaders we
        avoid (``matchmaking.configure_round``)."""
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is not None:
            bits, target, online, cap = self._round_settings(step)
            quorum = grid_group_quorum(target) if bits else self._quorum(online, cap)
            configure_round(matchmaking, bits=bits, target=target, quorum=quorum, avoids=self._conduct.shuns,
                            admits=self._admission.admits)
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
        this round (``matchmaking.round_settings``): our defaults where they are missing or malformed."""
        return round_settings(step.data_for_gather, self.serializer, default_target=self._default_target_group_size,
                              max_group_size=self._max_group_size)

    def _quorum(self, online: int | None, max_group_size: int) -> int:
        """``grouping.majority_quorum`` of the ``online`` peers count that ``average()`` gathered
        (under the plan's cap ``max_group_size``), without the peers we ban or avoid (they never join
        our groups); 2 without a count."""
        if online is None:
            return 2
        return majority_quorum(max(1, online - self._conduct.shunned()), max_group_size)

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
        """As a group leader, turn away peers that sent us invalid data or refused our valid part before,
        and, in a private run, peers without a valid invitation."""
        peer = context.remote_id.to_base58()
        if self._conduct.shuns(peer) or not await self._admission.admits(peer):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_check_reachability(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """Dial a joining peer back from a fresh libp2p host (averaging/reachability.py); in a private
        run, only a peer with a valid invitation."""
        shown = shown_admission(bytes(request.metadata))
        if not await self._admission.admits(context.remote_id.to_base58(), shown=shown):
            return refusal("this private run does not admit you: no valid invitation")
        return await self._reachability.answer(request, context.remote_id)

    async def _lower_target(self, target: int) -> None:
        """Lower the forming group's target size to ``target`` (``matchmaking.lower_target``)."""
        await lower_target(getattr(self, "_matchmaking", None), target)

    # --- runs in the caller's process -------------------------------------------------
    def average(self, request: RoundRequest) -> tuple[RoundResult, list[torch.Tensor]]:
        """Average ``request.delta`` with a group of peers (the round's settings and bounds: the other
        fields of :class:`~diloco_swarm.averaging.request.RoundRequest`); return the verified result.

        :returns: the round's result and the Δ to apply: the group's average when ``ok``, and when
            the round failed only for want of confirmations (``maybe_kept``: no member contradicted
            our digest, so those that heard every confirmation keep this very average; applying it
            too keeps us on their θ_global), else ``request.delta`` itself (fp32 CPU). The average is
            the shared buffers themselves, valid until the next call (which writes them): apply it first.
        """
        started = time.perf_counter()
        local = [d.detach().to("cpu", torch.float32) for d in request.delta]  # (read, never changed: no copy)
        with self.get_tensors() as buffers:
            for buf, d in zip(buffers, local):
                buf.copy_(d)
        scheduled_time = request.scheduled_time
        try:
            if not self.is_alive():
                return RoundResult.solo(started, "the averager process is gone"), local
            if self.client_mode:
                # A client never leads: its scheduled time only goes into its join requests, and a leader
                # that begins later than that refuses it (BAD_EXPIRATION_TIME), each declaration tried
                # once. A client late for its own plan was refused by every leader until its window
                # ended; it now takes any leader that begins within its window.
                scheduled_time = get_dht_time() + 0.9 * request.timeout
            elif scheduled_time is not None:
                scheduled_time = min(scheduled_time, get_dht_time() + 0.9 * request.timeout)
            gather = {**request.gather(), RECEIVE_CAP_KEY: self._download.mbps}  # members pace their sends to it
            control = self.step(weight=float(request.weight), gather=gather, timeout=request.timeout,
                                allow_retries=True, wait=False, scheduled_time=scheduled_time)
            late = LateMembers(request, default_size=self._default_target_group_size)
            # hivemind bounds the step in the averager process; the deadline bounds our wait if that process dies
            deadline = time.monotonic() + request.timeout + self._allreduce_timeout_s + 30.0
            control, why = await_group(control, deadline=deadline, alive=self.is_alive, late=late, stop=request.stop,
                                       give_up=request.give_up,
                                       lower_target=lambda size: self._command("_lower_target", target=size))
            if why is not None:
                return RoundResult.solo(started, why), local
        except Exception as e:  # no group in the window, or the all-reduce failed outright
            return RoundResult.solo(started, short_reason(e)), local
        if control is None:
            return RoundResult.solo(started, "no group formed"), local

        stats = RoundStats(**control["stats"])
        result = RoundResult.of_allreduce(stats, {str(k): v for k, v in (control["gathered"] or {}).items()},
                                          avoided=control.get("avoided"))
        with self.get_tensors() as buffers:
            # the shared buffers themselves, not a copy (the memory budget): nothing writes them again
            # before the next average(), and the node applies this round before it hands off the next
            averaged = list(buffers)
        problem = self._verify(stats, local, averaged, result, weight=float(request.weight),
                               digest_wait=request.digest_wait, stop=request.stop, gone=request.gone)
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
