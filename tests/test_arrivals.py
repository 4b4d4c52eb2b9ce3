"""The round's average as it arrives (``PseudoGradientAverager.arrived`` / ``peek``), which the node
previews into θ_local before the round is verified (node/outer_sync.py, ``OuterSync.correct``).
Real averagers over 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.dht.swarm import start_dht, visible_maddrs

SHAPES = [(256, 64), (64,), (64, 32), (32,)]


@pytest.mark.timeout(120)
def test_every_tensor_of_the_average_arrives_under_the_rounds_token_with_the_verified_values():
    dhts = [start_dht(initial_peers=[], host="127.0.0.1", port=0)]
    dhts.append(start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0))
    averagers: list[PseudoGradientAverager] = []
    try:
        for dht in dhts:
            averagers.append(PseudoGradientAverager([torch.zeros(s) for s in SHAPES], dht, prefix="arrivals",
                                                    target_group_size=2, matchmaking_time=2.0))
        tokens = [a.begin_arrivals() for a in averagers]
        assert [a.arrived() for a in averagers] == [(t, 0) for t in tokens]  # nothing arrived yet
        results: list = [None, None]

        def run(i: int) -> None:
            g = torch.Generator().manual_seed(i)
            results[i] = averagers[i].average([1e-2 * torch.randn(s, generator=g) for s in SHAPES],
                                              weight=100.0, metadata={}, timeout=30.0, group_size=2)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60.0)
        for averager, token, (result, average) in zip(averagers, tokens, results):
            assert result.ok, result.reason
            assert averager.arrived() == (token, len(SHAPES))
            for i, value in enumerate(average):
                assert torch.equal(averager.peek(i, token), value)  # the preview is the verified average
            assert averager.peek(0, token + 1) is None  # another round's token reads nothing
            assert averager.begin_arrivals() == token + 1 and averager.arrived() == (token + 1, 0)
    finally:
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
