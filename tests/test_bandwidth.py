"""Bandwidth caps (averaging/bandwidth.py): the pacing, what a peer advertises, and the time a group gets.

The caps measured on a real link (a node in a network namespace) are tests/test_bandwidth_netns.py's.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from diloco_swarm.averaging.bandwidth import (
    MAX_CAP_MBPS, MIN_CAP_MBPS, PACE_SLICE_BYTES, TIMEOUT_MARGIN, UNCAPPED_MBPS, WIRE_OVERHEAD, RateLimit, advertised_mbps,
    bytes_per_second, group_timeout, longest_timeout, pace, part_timeouts, stated_mbps, stream_share)
from diloco_swarm.averaging.state_sharing import transfer_timeout


def _send(limit: RateLimit, sizes: list[int]) -> float:
    """Seconds until the last of ``sizes`` may go, two coroutines sharing ``limit``."""

    async def sender(part: list[int]) -> None:
        for n in part:
            await limit.take(n)

    async def main() -> float:
        started = time.monotonic()
        await asyncio.gather(sender(sizes[::2]), sender(sizes[1::2]))
        return time.monotonic() - started

    return asyncio.run(main())


def test_a_cap_paces_every_stream_of_the_process_together():
    limit = RateLimit(4.0)  # 500,000 B/s
    sizes = [50_000] * 20  # 1 MB: each message goes once its bytes had their time at the cap
    elapsed = _send(limit, sizes)
    floor = sum(sizes) * WIRE_OVERHEAD / bytes_per_second(4.0)  # 2.16 s
    assert elapsed >= 0.98 * floor, f"1 MB went out in {elapsed:.2f}s at a 4 Mbit/s cap (at least {floor:.2f}s)"
    assert elapsed < floor + 1.5, f"the cap slowed 1 MB to {elapsed:.2f}s (the cap alone: {floor:.2f}s)"


def test_no_cap_is_no_wait():
    assert _send(RateLimit(None), [10**9] * 4) < 0.5


def test_paced_lets_every_message_through_in_order():
    async def source():
        for i in range(5):
            yield bytes(10_000 * (i + 1))

    async def main():
        return [len(m) async for m in RateLimit(100.0).paced(source(), len)]

    assert asyncio.run(main()) == [10_000, 20_000, 30_000, 40_000, 50_000]


def test_a_peer_advertises_its_smaller_cap():
    assert advertised_mbps(None, None) == UNCAPPED_MBPS
    assert advertised_mbps(8.0, None) == 8.0
    assert advertised_mbps(20.0, 5.0) == 5.0


def test_a_group_waits_for_its_slowest_member():
    round_bytes = 10_000_000  # a 10M-parameter model's int8 Δ
    # no cap in the group: --allreduce-timeout
    assert group_timeout(60.0, round_bytes, [None, UNCAPPED_MBPS, UNCAPPED_MBPS]) == 60.0
    # a member capped at 4 Mbit/s: 10 MB take 20 s at its cap (and the link's headers), times the margin
    assert group_timeout(60.0, round_bytes, [UNCAPPED_MBPS, 4.0]) == pytest.approx(TIMEOUT_MARGIN * 20.0 * WIRE_OVERHEAD)
    # --allreduce-timeout stays the floor
    assert group_timeout(600.0, round_bytes, [4.0]) == 600.0


@pytest.mark.parametrize("hostile", [0.0, -5.0, math.nan, math.inf, "fast", [1], 1e-9])
def test_an_advertised_bandwidth_cannot_stretch_a_group_beyond_the_longest_wait(hostile):
    round_bytes = 10_000_000
    timeout = group_timeout(60.0, round_bytes, [UNCAPPED_MBPS, hostile])
    assert 60.0 <= timeout <= longest_timeout(60.0, round_bytes)
    assert longest_timeout(60.0, round_bytes) == pytest.approx(
        TIMEOUT_MARGIN * round_bytes * WIRE_OVERHEAD / bytes_per_second(MIN_CAP_MBPS))


def test_a_donor_at_the_lowest_cap_serves_within_a_joiners_bound_while_its_rounds_take_half_its_cap():
    state_bytes, chunk = 1_200_000_000, 2**20  # llama-150m's θ_global and outer momentum in fp32
    donor = RateLimit(MIN_CAP_MBPS)
    started = time.monotonic()
    for _ in range(state_bytes // chunk):  # (booked, not slept: the pacing's arithmetic)
        donor.reserve(chunk)  # a chunk of the state
        done = donor.reserve(chunk)  # as many bytes of the donor's own rounds in between
    bound = transfer_timeout(10.0, state_bytes)
    assert done - started <= bound, f"a 2 Mbit/s donor needs {done - started:.0f}s for 1.2 GB, beyond the joiner's {bound:.0f}s"


def test_a_state_chunk_takes_its_turn_between_the_parts_of_a_rounds_streams():
    """A donor's upload cap is shared by its round's streams (hivemind parts of 2^19 bytes) and a state
    donation. Booked whole, a chunk waited for one part of every stream: at 2 Mbit/s in a group of 6, 11.6 s,
    past a joiner's wait for a chunk (statesync.STATE_CHUNK_TIMEOUT_S). Booked in slices, the streams take
    turns: it waits for about a slice of each (here at 80 Mbit/s: 0.04 s, not 0.28)."""
    upload, part, chunk, streams = RateLimit(80.0), 2**19, 2**16, 5

    async def main() -> float:
        async def stream():
            for _ in range(2):
                await pace(part, upload)

        tasks = [asyncio.create_task(stream()) for _ in range(streams)]
        await asyncio.sleep(0.01)  # the round's parts are booked first
        started = time.monotonic()
        await pace(chunk, upload)
        waited = time.monotonic() - started
        await asyncio.gather(*tasks)
        return waited

    waited = asyncio.run(main())
    per_byte = WIRE_OVERHEAD / bytes_per_second(80.0)
    whole_parts = streams * part * per_byte  # 0.28 s
    assert waited <= 1.5 * (streams + 1) * PACE_SLICE_BYTES * per_byte + 0.05 < whole_parts, (waited, whole_parts)


def test_two_caps_on_one_message_pace_it_at_the_slower_one():
    upload, towards = RateLimit(8.0), RateLimit(8.0)

    async def main() -> float:
        started = time.monotonic()
        for _ in range(10):
            await pace(50_000, upload, towards)
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    one_cap = 10 * 50_000 * WIRE_OVERHEAD / bytes_per_second(8.0)  # 0.54 s
    assert 0.98 * one_cap <= elapsed < 1.5 * one_cap, f"{elapsed:.2f}s at two 8 Mbit/s caps (one cap: {one_cap:.2f}s)"


def test_the_waits_between_parts_grow_with_the_slowest_cap_and_the_group():
    part = 2**19  # hivemind's part_size_bytes: a part's bytes on the wire
    assert part_timeouts(10.0, 20.0, part, 3, [UNCAPPED_MBPS] * 3) == (10.0, 20.0)
    # 8 members, one capped at 2 Mbit/s: its upload is shared by 7 streams, each part 2.3 s at the cap
    sender, reducer = part_timeouts(10.0, 20.0, part, 8, [UNCAPPED_MBPS, MIN_CAP_MBPS])
    per_stream_part = 7 * part * WIRE_OVERHEAD / bytes_per_second(MIN_CAP_MBPS)
    assert sender == pytest.approx(TIMEOUT_MARGIN * per_stream_part) and sender > per_stream_part
    assert reducer == 2 * sender


@pytest.mark.parametrize("value, stated", [(8, 8.0), (8.5, 8.5), (0.001, MIN_CAP_MBPS), (1e30, MAX_CAP_MBPS),
                                           (None, None), (0, None), (-1.0, None), (math.nan, None),
                                           (math.inf, None), (True, None), ("8", None), ([8], None)])
def test_a_stated_bandwidth_is_bounded_or_ignored(value, stated):
    assert stated_mbps(value) == stated


def test_each_member_sends_a_capped_peer_its_share_of_the_cap():
    assert stream_share(8.0, 5).mbps == 2.0  # four members send to it at once
    assert stream_share(8.0, 2).mbps == 8.0
    assert stream_share(None, 5).mbps is None
    assert stream_share("lots", 5).mbps is None


@pytest.mark.timeout(240)
def test_a_member_at_the_lowest_cap_in_a_group_of_six_is_waited_for_and_the_round_verifies():
    """Six real averagers, one capped at 2 Mbit/s up. hivemind gives it no slice to reduce (it advertised 2
    against 100), so it sends each of the five others a part of 2^19 bytes, all at once over its one cap: the
    first part reaches the last of them after ~11 s, past hivemind's 10 s wait for a sender to start. The
    group's waits grow to its slowest cap, so the round verifies on every member, with the capped member's
    upload at its cap."""
    import threading

    from averagerlib import averagers
    from diloco_swarm.averaging.averager import PseudoGradientAverager
    from diloco_swarm.averaging.request import RoundRequest

    class Capped(PseudoGradientAverager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, max_upload_mbps=MIN_CAP_MBPS, **kwargs)

    Capped.__name__ = Capped.__qualname__ = PseudoGradientAverager.__name__  # (hivemind's RPC namespace)
    n, values = 6, 5 * 540_000  # five slices of one part each
    deltas = [[torch.randn(values, generator=torch.Generator().manual_seed(i))] for i in range(n)]
    results: list = [None] * n
    with averagers("capped-six", n, (False,) * n, [(values,)], (PseudoGradientAverager,) * (n - 1) + (Capped,),
                   allreduce_timeout=20.0) as group:
        def run(i: int) -> None:
            results[i] = group[i].average(RoundRequest(delta=deltas[i], weight=100.0, metadata={}, timeout=30.0,
                                                       group_size=n))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150.0)
    assert all(r is not None for r in results), "a member's round did not end"
    assert all(r.ok for r, _ in results), [(r.ok, r.reason) for r, _ in results]
    assert len({r.digest for r, _ in results}) == 1
    capped = results[-1][0]
    floor = capped.bytes_sent * WIRE_OVERHEAD / bytes_per_second(MIN_CAP_MBPS)
    assert capped.bytes_sent >= values and capped.seconds >= 0.95 * floor, (capped.bytes_sent, capped.seconds, floor)
