"""The Δ size bound of the all-reduce, on two real averagers over 127.0.0.1.

An honest peer that trained many more tokens than us sends a much larger Δ; it must be averaged,
not refused (a refusal used to ban it from our groups for good: a two-peer swarm then never
averaged again). The same Δ with our weight is over the bound: its parts in our slice are left out,
the round goes on (both members hold the same average), and its sender is avoided for a while.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

import math

from diloco_swarm.averaging.allreduce import MAX_WEIGHT_SCALE, SIZE_REASON, allowed_scale, finite_norm
from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.averaging.request import RoundRequest
from diloco_swarm.averaging.results import tensors_digest
from diloco_swarm.dht.swarm import start_dht, visible_maddrs

SHAPES = [(64, 32), (32,)]


def test_allowed_scale_grows_with_the_senders_tokens_within_the_cap():
    assert allowed_scale(10.0, 100.0, 100.0) == 10.0
    assert allowed_scale(10.0, 50.0, 100.0) == 10.0  # fewer tokens than us: never below the ratio
    assert allowed_scale(10.0, 400.0, 100.0) == 40.0
    assert allowed_scale(10.0, 1e12, 1.0) == 10.0 * MAX_WEIGHT_SCALE
    assert allowed_scale(10.0, 5.0, 0.0) == 10.0 * MAX_WEIGHT_SCALE  # our weight 0: the cap holds


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_norm_is_the_l2_norm_and_none_for_any_non_finite_value(bad):
    tensors = [torch.randn(37, 5), torch.tensor(3.0), torch.zeros(0), torch.randn(9)[::2], torch.randn(6).half(),
               torch.randn(4, dtype=torch.float64), torch.randn(3).bfloat16()]
    exact = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))
    assert finite_norm(tensors) == pytest.approx(exact, rel=1e-6)
    assert finite_norm([]) == 0.0
    for i in (0, 3, 4, 5, 6):  # a bad value in any tensor, any dtype
        spoiled = [t.clone() for t in tensors]
        spoiled[i].view(-1)[1] = bad
        assert finite_norm(spoiled) is None
    assert finite_norm([torch.full((4,), 3e38)]) == math.inf  # finite, but beyond fp32: above any bound


def test_digest_hashes_the_fp32_bytes_in_order():
    tensors = [torch.randn(3, 4), torch.tensor(2.0), torch.randn(8)[::2]]
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.float().contiguous().numpy().tobytes())
    assert tensors_digest(tensors) == h.hexdigest()[:16]
    assert tensors_digest(tensors[::-1]) != tensors_digest(tensors)


def _delta(scale: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * 1e-2 * torch.randn(s, generator=g) for s in SHAPES]


def _round(averagers, deltas, weights):
    results = [None, None]

    def run(i):
        results[i] = averagers[i].average(RoundRequest(
            delta=deltas[i], weight=weights[i], metadata={}, timeout=30.0, digest_wait=10.0))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90.0)
    assert all(r is not None for r in results), "a round did not return within 90 s"
    return [r for r, _ in results]


@pytest.mark.timeout(300)
def test_a_larger_delta_from_a_peer_that_trained_more_tokens_is_averaged():
    first = start_dht(initial_peers=[], host="127.0.0.1", port=0)
    second = start_dht(initial_peers=visible_maddrs(first), host="127.0.0.1", port=0)
    zeros = [torch.zeros(s) for s in SHAPES]
    averagers = [PseudoGradientAverager([z.clone() for z in zeros], dht, prefix="size-bound", target_group_size=2,
                                        matchmaking_time=2.0, allreduce_timeout=30.0) for dht in (first, second)]
    try:
        small, large = _delta(1.0, 0), _delta(30.0, 1)  # 30× the RMS: above the 10× bound at equal weight

        # 1. The larger Δ behind 50× the tokens: averaged, and both members hold the same average.
        for _ in range(2):  # a second try only after the rare partial round, which is not what this checks
            rounds = _round(averagers, [small, large], [100.0, 5000.0])
            if all(r.ok for r in rounds) or any(r.avoided_peers for r in rounds):
                break
        assert all(r.ok and r.group_size == 2 for r in rounds), [(r.ok, r.reason) for r in rounds]
        assert rounds[0].digest == rounds[1].digest
        assert not any(r.outlier_peers or r.avoided_peers for r in rounds), [(r.outlier_peers, r.avoided_peers)
                                                                             for r in rounds]  # nothing left out

        # 2. A Δ 12× ours at our weight: over the bound in the small one's slice, left out there; the round goes on
        # (30× would fail it anyway: the large one reduces its own slice, and the average passes 10× our norm)
        over = _delta(12.0, 2)
        for _ in range(2):  # a second try only after the rare partial round, which is not what this checks
            rounds = _round(averagers, [small, over], [100.0, 100.0])
            if all(r.ok for r in rounds) or rounds[0].avoided_peers:
                break
        assert all(r.ok and r.group_size == 2 for r in rounds), [(r.ok, r.reason) for r in rounds]
        assert rounds[0].digest == rounds[1].digest
        over_id = averagers[1].peer_id.to_base58()
        avoided = rounds[0].avoided_peers or {}
        assert SIZE_REASON in avoided.get(over_id, ""), avoided  # "its Δ was too large (...)": for a while
        assert rounds[0].outlier_peers.get(over_id) == 1.0, rounds[0].outlier_peers  # all it gave our slice
        assert not rounds[1].avoided_peers  # its own view: nothing wrong with the small one
    finally:
        for part in (*averagers, second, first):
            part.shutdown()
