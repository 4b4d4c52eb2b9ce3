"""Bandwidth caps: a volunteer's ``--max-upload-mbps`` / ``--max-download-mbps``, and rounds sized to them.

Both caps are kept by the peers that send, in the averager process, where the bytes move:

- **upload**: every tensor part and every average of our all-reduces (``allreduce.py``, θ-mixing
  included) and every chunk of our state donations (``state_sharing.py``) waits for one
  :class:`RateLimit`, shared by all the streams of the process;
- **download**: a capped peer states its download cap in the metadata it gathers to its group
  (:data:`RECEIVE_CAP_KEY`), and each member paces what it sends that peer to the cap's share
  (:func:`stream_share`); the capped peer also reads no faster than its cap (what a peer that ignores
  the stated cap, or a state donor, sends is held back by libp2p's flow control once the buffers on the
  way are full: those buffers, about a megabyte, arrive at the link's speed first).

Rounds are sized to the caps, not failed by them:

- each member advertises its bandwidth in matchmaking (hivemind's ``bandwidth``: the smaller of its
  caps, :func:`advertised_mbps`; :data:`UNCAPPED_MBPS` without one), and hivemind's load balancing
  gives a capped member a smaller slice of the all-reduce to reduce;
- every member waits for the group as long as its slowest member's bytes take at its cap
  (:func:`group_timeout`), never less than ``--allreduce-timeout``.

Speeds are Mbit/s (10^6 bits per second), as a home internet plan states them; caps are on the link,
so the payload a limit lets through is :data:`WIRE_OVERHEAD` below it.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, AsyncIterator, Iterable, Optional, Sequence, TypeVar

T = TypeVar("T")

# the bandwidth an uncapped peer advertises for load balancing: a capped peer gets a share of the
# reduction proportional to its cap against this (hivemind treats an unstated bandwidth as the mean of
# the stated ones, which would give a capped peer an equal share)
UNCAPPED_MBPS = 100.0
# the lowest cap accepted: a donor serves its state at least this fast (state_sharing.MIN_STATE_RATE_BPS: a
# joiner's bound on a download), and a hivemind part (2^19 bytes on the wire) takes 2.3 s at it
MIN_CAP_MBPS = 2.0
MAX_CAP_MBPS = 100_000.0
# bytes on the link per byte of payload a limit counts: TCP/IP headers (66 B per 1448-byte segment, 4.6%),
# libp2p's noise and yamux framing, and the ACKs of the other direction (tests/test_bandwidth_netns.py measures it)
WIRE_OVERHEAD = 1.08
# the streams sharing a limit take turns in slices of this many bytes (pace): at the lowest cap a slice takes
# 0.28 s, so a donation's chunk waits about that per stream of a round, not a whole part's 2.3 s
PACE_SLICE_BYTES = 1 << 16
# a round's bytes at the slowest member's cap, times this, bound the group's all-reduce: the slowest
# member sends its whole Δ once and its slice's averages to each member (hivemind's load balancing
# keeps that slice small), and every member waits on it
TIMEOUT_MARGIN = 3.0


def bytes_per_second(mbps: float) -> float:
    return mbps * 1e6 / 8


class RateLimit:
    """Pace bytes to ``mbps`` Mbit/s on the link: each ``await take(n)`` returns when ``n`` more bytes of
    payload (times :data:`WIRE_OVERHEAD`) fit the rate.

    A token bucket with no burst: a message goes once its bytes have had their time at the rate, after
    those booked before them (:func:`pace` books in slices, so streams take turns): a lone stream never
    sees more than the rate. A message under two limits leaves at the later of its two times, so messages
    held by a receiver's share may leave together with later ones, a short burst above the rate.

    Shared by the coroutines of one event loop (it holds no loop state, so it is made in the node's
    process and used in the averager's after the fork). ``mbps`` None: no limit.
    """

    def __init__(self, mbps: Optional[float]):
        self.mbps = mbps
        self._rate = None if mbps is None else bytes_per_second(mbps) / WIRE_OVERHEAD  # of payload
        self._paid_until = 0.0  # monotonic time at which the bytes taken so far have gone out at the rate

    def reserve(self, n_bytes: int) -> float:
        """Book ``n_bytes`` at the rate: the ``time.monotonic()`` at which they may go (now, without a limit)."""
        now = time.monotonic()
        if self._rate is None or n_bytes <= 0:
            return now
        self._paid_until = max(self._paid_until, now) + n_bytes / self._rate
        return self._paid_until

    async def take(self, n_bytes: int) -> None:
        await pace(n_bytes, self)

    async def paced(self, messages: AsyncIterator[T], size) -> AsyncIterator[T]:
        """``messages``, each one let through once its ``size(message)`` bytes fit the rate."""
        async for message in messages:
            await self.take(size(message))
            yield message


async def pace(n_bytes: int, *limits: RateLimit) -> None:
    """Wait until ``n_bytes`` fit every one of ``limits`` (booked on each at once: a message under two caps
    goes at the slower one's pace, not at the sum of both waits), one :data:`PACE_SLICE_BYTES` slice at a
    time: the streams that share a limit take turns by slices, so a state donation's chunk never waits
    behind a whole hivemind part (2^19 bytes) of every stream of a round."""
    left = n_bytes
    while True:
        piece = min(left, PACE_SLICE_BYTES)
        wait = max((limit.reserve(piece) for limit in limits), default=0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        left -= piece
        if left <= 0:
            return


RECEIVE_CAP_KEY = "receive_mbps"  # our gathered metadata: the download cap members pace their sends to us by


def stated_mbps(value: Any) -> Optional[float]:
    """An untrusted bandwidth a peer stated (Mbit/s): within [:data:`MIN_CAP_MBPS`, :data:`MAX_CAP_MBPS`], or
    None for anything that is not a finite positive number (no cap stated)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return min(max(float(value), MIN_CAP_MBPS), MAX_CAP_MBPS)


def stream_share(receive_mbps: Any, group_size: int) -> RateLimit:
    """What one member may send a member that stated ``receive_mbps`` (untrusted; no cap: no limit), in a
    group of ``group_size``: an equal share of its cap among the others, which all send to it at once
    (the replies to its own parts, from every reducer; the parts of its slice, hivemind's load balancing
    keeps small for a capped peer)."""
    cap = stated_mbps(receive_mbps)
    return RateLimit(None if cap is None else cap / max(1, group_size - 1))


def advertised_mbps(max_upload_mbps: Optional[float], max_download_mbps: Optional[float]) -> float:
    """What a peer advertises in matchmaking for load balancing: its smaller cap, or :data:`UNCAPPED_MBPS`
    (a reducer receives its slice from every member and sends the average back to each: both ways count)."""
    caps = [c for c in (max_upload_mbps, max_download_mbps) if c is not None]
    return min(caps) if caps else UNCAPPED_MBPS


def slowest_mbps(bandwidths: Iterable[Any]) -> float:
    """The smallest of the bandwidths a group's members stated (Mbit/s, untrusted: :func:`stated_mbps`); none
    stated counts as :data:`UNCAPPED_MBPS`."""
    return min((b for b in map(stated_mbps, bandwidths) if b is not None), default=UNCAPPED_MBPS)


def group_timeout(configured_s: float, round_bytes: int, bandwidths: Iterable[Any]) -> float:
    """Seconds a group's all-reduce may take: ``configured_s`` (``--allreduce-timeout``), or longer when the
    :func:`slowest_mbps` of ``bandwidths`` needs :data:`TIMEOUT_MARGIN` × ``round_bytes`` (one Δ on the wire)
    longer."""
    return max(float(configured_s),
               TIMEOUT_MARGIN * round_bytes * WIRE_OVERHEAD / bytes_per_second(slowest_mbps(bandwidths)))


def part_timeouts(sender_s: float, reducer_s: float, part_bytes: int, group_size: int,
                  bandwidths: Iterable[Any]) -> tuple[float, float]:
    """hivemind's waits between two parts of one stream (a sender's, a reducer's: ``sender_s`` and
    ``reducer_s``, from ``--allreduce-timeout``'s sibling ``next_chunk_timeout``), grown to the group's
    :func:`slowest_mbps`: a capped member's upload is shared by its streams to the (``group_size`` − 1)
    others, and a capped receiver's cap by theirs to it, so one stream moves a part of ``part_bytes`` (on
    the wire, at most hivemind's ``part_size_bytes``) in (``group_size`` − 1) parts' time; times
    :data:`TIMEOUT_MARGIN`. The reducer's stays twice the sender's, as hivemind requires it longer."""
    gap = (TIMEOUT_MARGIN * max(1, group_size - 1) * part_bytes * WIRE_OVERHEAD
           / bytes_per_second(slowest_mbps(bandwidths)))
    sender = max(float(sender_s), gap)
    return sender, max(float(reducer_s), 2 * sender)


def longest_timeout(configured_s: float, round_bytes: int) -> float:
    """The most :func:`group_timeout` can give any group (its slowest member at :data:`MIN_CAP_MBPS`): what
    the node and hivemind's own wait allow the all-reduce, so that a group sized to a slow member is
    never cut by them first."""
    return group_timeout(configured_s, round_bytes, [MIN_CAP_MBPS])


def gathered_caps(entries: Sequence[Any]) -> tuple[list, list]:
    """(the bandwidths the members advertised in matchmaking, the download caps they stated:
    :data:`RECEIVE_CAP_KEY`), in the group's order, from their decoded gathered entries
    (``request.gathered_entries``); untrusted, anything (None where unreadable, or where an entry holds
    other than hivemind's three fields)."""
    bandwidths, receive_caps = [], []
    for entry in entries:
        readable = entry is not None and len(entry.fields) == 3  # (bandwidth, mode, metadata), as hivemind sends it
        bandwidths.append(entry.fields[0] if readable else None)
        receive_caps.append(entry.meta.get(RECEIVE_CAP_KEY) if readable else None)
    return bandwidths, receive_caps


def sized_to_caps(kwargs: dict, caps: tuple[list, list], timeouts: tuple[float, float],
                  round_bytes: int) -> tuple[dict, float]:
    """A group's all-reduce sized to its members' caps (:func:`gathered_caps`): the runner's ``kwargs``
    with the download caps they stated (``receive_caps``) and hivemind's waits between parts grown to the
    slowest cap (:func:`part_timeouts`), and the seconds the whole all-reduce may take
    (:func:`group_timeout` of ``timeouts[0]``, ``--allreduce-timeout``, within ``timeouts[1]``, the
    ceiling: :func:`longest_timeout`)."""
    bandwidths, receive_caps = caps
    stated = [*bandwidths, *receive_caps]  # a member that advertises more than it receives is held to the less
    sender_s, reducer_s = part_timeouts(kwargs["sender_timeout"], kwargs["reducer_timeout"],
                                        kwargs["part_size_bytes"], len(bandwidths), stated)
    timeout = min(group_timeout(timeouts[0], round_bytes, stated), timeouts[1])
    return {**kwargs, "receive_caps": receive_caps, "sender_timeout": sender_s, "reducer_timeout": reducer_s}, timeout
