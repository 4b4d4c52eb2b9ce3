"""A client (NAT: it dials out only, so it never leads a group) joins a leader whose round begins
later than the client's own plan said. Real averagers over 127.0.0.1.

hivemind's leader refuses a follower whose join request expires before the leader begins
(BAD_EXPIRATION_TIME), and a follower asks each leader declaration once. A client that handed off
late for its own plan (its request expiring a few seconds ahead) was refused by the full peers'
next round, which begins at their own scheduled time; in a 3-node overlap swarm (2 full peers, 1
client) the client then missed every other round: 30 s windows with "could not find a group", then
a download that dropped its Δ (goodput 4–9%), while the full peers waited for it each time.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.dht.swarm import start_dht, visible_maddrs

SHAPES = [(512, 64), (64,)]
LEADER_BEGINS_IN_S = 10.0  # the full peer's planned start, well past the client's own plan


def _delta(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.timeout(180)
def test_a_client_joins_a_round_that_begins_later_than_its_own_plan():
    # Two full peers plan their round of 3 to begin in 10 s; the client, handing off 1 s later,
    # planned to begin at once (it was late for the round its plan saw). Without the fix the leader
    # refused it, began with the other full peer at its scheduled time, and the client's round failed.
    dhts = [start_dht(initial_peers=[], host="127.0.0.1", port=0)]
    dhts.append(start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0))
    dhts.append(start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0, client_mode=True))
    averagers: list[PseudoGradientAverager] = []
    try:
        kwargs = dict(prefix="client-join", target_group_size=3, matchmaking_time=2.0)
        for i, dht in enumerate(dhts):
            averagers.append(PseudoGradientAverager([torch.zeros(s) for s in SHAPES], dht, client_mode=i == 2,
                                                    **kwargs))
        results: list = [None] * 3
        started = time.time()

        def run(i: int, scheduled_time: float) -> None:
            results[i] = averagers[i].average(_delta(i), weight=100.0, metadata={}, timeout=40.0,
                                              scheduled_time=scheduled_time, group_size=3)[0]

        threads = [threading.Thread(target=run, args=(i, started + LEADER_BEGINS_IN_S), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        threads.append(threading.Thread(target=run, args=(2, time.time()), daemon=True))
        threads[-1].start()
        for t in threads:
            t.join(timeout=90.0)
        assert all(r is not None for r in results), "a round did not end"
        assert [r.group_size for r in results] == [3, 3, 3], [(r.group_size, r.reason) for r in results]
        assert all(r.ok for r in results) and len({r.digest for r in results}) == 1, [r.reason for r in results]
        assert averagers[2].client_mode and not averagers[0].client_mode
    finally:
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
