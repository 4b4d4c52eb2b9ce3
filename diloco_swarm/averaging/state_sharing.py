"""Sharing a peer's state: the averager's side of a state donation, the donor's and the joiner's.

A donor declares itself in the DHT (hivemind's ``{prefix}.all_averagers`` key, priority = outer
step) and streams its live state to whoever asks (``rpc_download_state``, over ``donation.py``'s
:class:`~diloco_swarm.averaging.donation.Donations`); a joiner lists the donors
(:func:`state_donors`) and reads one stream into tensors, bounded in bytes and in time
(:func:`fetch_state`, :func:`transfer_timeout`). :class:`StateSharing` holds the averager's methods
for both: hivemind looks several of them up on the averager itself (``rpc_download_state``,
``get_current_state``, ``_declare_for_download_periodically``, and ``_download_state_from`` through
its control pipe), so they are a mixin of ``averager.PseudoGradientAverager``, not a helper object.
The payload is unchecked here: the node validates it against the run spec (node/statesync.py).
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, AsyncIterator, Callable

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from diloco_swarm.averaging.bandwidth import MIN_CAP_MBPS, WIRE_OVERHEAD, RateLimit, bytes_per_second
from diloco_swarm.averaging.donation import Donations, StateSeal
from diloco_swarm.averaging.results import short_reason
from diloco_swarm.dht.calls import ChildGone, ChildUnavailable, bounded, dht_get
from diloco_swarm.utils.hivemind_fixes import keep_task_alive, send_result

logger = get_logger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor], StateSeal]]

# a state download may last as long as its largest payload takes at half the payload rate of the lowest
# upload cap a donor may set (2 Mbit/s, a home uplink's, shared with the donor's own rounds; a stalled donor
# is cut by the per-chunk timeout): a fixed bound refused every download over a few hundred MB
MIN_STATE_RATE_BPS = bytes_per_second(MIN_CAP_MBPS) / WIRE_OVERHEAD / 2


def state_donors(dht, prefix: str) -> dict[str, float]:
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


def transfer_timeout(timeout: float, max_bytes: int) -> float:
    """Seconds a whole download may take: 4× the per-chunk ``timeout`` plus ``max_bytes`` at
    :data:`MIN_STATE_RATE_BPS`."""
    return 4 * timeout + max_bytes / MIN_STATE_RATE_BPS


async def fetch_state(stub, serializer, *, timeout: float, max_bytes: int,
                      download: RateLimit | None = None) -> tuple[Any, list[torch.Tensor], int]:
    """Read one donor's state: ``stub`` is the averager's stub of that donor (its ``rpc_download_state``),
    ``serializer`` decodes the metadata.

    :param timeout: seconds allowed between chunks (our own pacing by ``download`` not counted).
    :param download: our download cap (bandwidth.py), or None.
    :returns: (the donor's metadata, its tensors as sent, bytes received).
    :raises ValueError: more than ``max_bytes`` arrived, or a tensor came incomplete (:func:`tensor_from_parts`).
    """
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    metadata, parts, tensors, received = None, [], [], 0
    async for message in aiter_with_timeout(stream, timeout=timeout):
        received += message.ByteSize()
        if received > max_bytes:
            raise ValueError(f"donor sent more than {max_bytes} bytes")
        if download is not None:
            await download.take(message.ByteSize())
        if message.metadata and metadata is None:
            metadata = serializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:
            tensors.append(tensor_from_parts(parts))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        tensors.append(tensor_from_parts(parts))
    return metadata, tensors, received


def tensor_from_parts(parts: list) -> torch.Tensor:
    """One tensor of a state stream from its chunks (hivemind's ``combine_from_streaming``).

    :raises ValueError: the chunks do not make a whole tensor: the stream was cut (a donor that left
        mid-transfer) or the donor sent garbage. One line, instead of torch's reshape error.
    """
    try:
        whole = combine_from_streaming(parts)
        if whole.compression != runtime_pb2.CompressionType.NONE:  # donors send fp32 (hivemind's state_compression)
            raise ValueError("a compressed state tensor")  # (another codec's decoder could grow a few bytes to GBs)
        return deserialize_torch_tensor(whole)
    except Exception:
        raise ValueError("a tensor in the state stream is incomplete or malformed (did the donor leave mid-transfer?)") from None


class StateSharing:
    """The averager's state donation and download (a mixin of a hivemind ``DecentralizedAverager``
    that also has a ``_command(method, **kwargs)`` into its process and an ``_admission``,
    admission.py). Call :meth:`_init_state_sharing` before the averager process starts."""

    def _init_state_sharing(self, state_provider: StateProvider | None) -> None:
        """``state_provider()`` gives our state to donate: (metadata, the live θ_global + outer momentum
        tensors, their :class:`StateSeal`); None: this peer donates nothing."""
        self._state_provider = state_provider
        self._donations = Donations()  # our state streamed to joiners (donation.py), counted in shared memory

    # --- runs in the averager process -------------------------------------------------
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

    @keep_task_alive
    async def _download_state_from(self, peer: str, timeout: float, max_bytes: int, total_timeout: float,
                                   future: MPFuture):
        """Stream one donor's state (:func:`fetch_state`), bounded in bytes and time."""
        try:
            if not await self._admission.admits(peer):  # a private run's stranger serves us nothing
                raise RuntimeError(f"peer {peer} shows no valid invitation to this private run")
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            fetch = fetch_state(stub, self.serializer, timeout=timeout, max_bytes=max_bytes, download=self._download)
            send_result(future, await asyncio.wait_for(fetch, timeout=total_timeout))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(short_reason(e)))

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, streaming our live state with its seal (donation.py): no snapshot; in a private
        run, only to a peer with a valid invitation."""
        if not self.allow_state_sharing or not await self._admission.admits(context.remote_id.to_base58()):
            return  # hivemind's refusal: the asker tries another donor
        metadata, tensors, seal = await self._get_current_state_from_host_process()
        async for message in self._upload.paced(self._donations.stream(metadata, tensors, seal, self.state_compression),
                                                lambda m: m.ByteSize()):
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
            ``max_bytes`` at :data:`MIN_STATE_RATE_BPS` (:func:`transfer_timeout`).
        :param max_bytes: refuse a payload larger than this.
        :param stop: when set, the download is abandoned at once (graceful leave).
        :raises RuntimeError: the donor failed, timed out or sent too much; ChildUnavailable (a
            RuntimeError) when the averager process is gone or ``stop`` was set. The payload itself is
            unchecked: the caller validates it against the run spec.
        """

        def start() -> MPFuture:
            future = MPFuture()
            self._command("_download_state_from", peer=peer, timeout=timeout, max_bytes=max_bytes, total_timeout=total,
                          future=future)
            return future

        total = transfer_timeout(timeout, max_bytes)
        return bounded(self, f"state download from {peer}", start, total + 5, stop)


def _log_declare_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug(f"declaring this peer as a state donor failed: {task.exception()!r}")
