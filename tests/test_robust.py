"""The reducers' robust rule (averaging/robust.py: the skipped mean) on
synthetic parts, the reducer that runs it (reducer.RobustPartReducer) against hivemind's semantics
for senders that fail, and four real averagers with one hostile member.

Honest parts must come out as their weighted mean (within the int8 codec's error: the result is
sent in int8 anyway); a minority of hostile parts (−8 × Δ, a random direction at 5 × ‖Δ‖, a huge
claimed weight) must leave the result near the honest peers' mean, where the plain mean is far off.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
import torch
from hivemind.averaging.partition import BannedException, TensorPartReducer

from diloco_swarm.averaging import codec, robust
from diloco_swarm.averaging.reducer import RobustPartReducer
from diloco_swarm.averaging.robust import (centered_clip, coordinate_median, skipped_mean, trimmed_mean,
                                           weighted_mean)

D = 50_000  # values per part (hivemind's parts hold up to ~0.5M)


def honest_parts(n: int, seed: int = 0, noise: float = 1.0, scales=None) -> torch.Tensor:
    """``n`` honest Δ parts ``[n, D]``: a shared direction plus each peer's own noise (``noise`` × its size;
    DiLoCo peers train on different batches), each × its ``scales`` (a longer phase, a larger Δ), int8-coded."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g)
    rows = [(common + noise * torch.randn(D, generator=g)) * (1.0 if scales is None else scales[i]) for i in range(n)]
    return torch.stack([codec.roundtrip(r) for r in rows])


def int8_error(x: torch.Tensor) -> float:
    """The largest round-trip error of the int8 codec on ``x``: half a code of the largest block scale."""
    return float(x.abs().max()) / 254


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x - reference) / torch.linalg.vector_norm(reference))


def hostile_scaled(parts: torch.Tensor, k: int, factor: float = -8.0) -> torch.Tensor:
    out = parts.clone()
    out[-k:] = parts[-k:] * factor
    return out


def hostile_random(parts: torch.Tensor, k: int, factor: float = 5.0, seed: int = 1) -> torch.Tensor:
    g, out = torch.Generator().manual_seed(seed), parts.clone()
    for i in range(parts.shape[0] - k, parts.shape[0]):
        r = torch.randn(D, generator=g)
        out[i] = r * (factor * torch.linalg.vector_norm(parts[i]) / torch.linalg.vector_norm(r))
    return out


# --- the rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("noise, scales", [(0.1, None), (1.0, None), (3.0, None), (1.0, [0.25, 0.5, 1.0, 1.5, 2.0])],
                         ids=["close", "noisy", "mostly-noise", "dylu-phases"])
def test_honest_parts_come_out_as_their_weighted_mean(noise, scales):
    """Honest peers with different token weights, and Δs of different sizes (DyLU phases of H/4 to 2H):
    nobody is left out and the result is the weighted mean, far within the int8 error it is sent with.
    CenteredClip (a candidate) too, where the phases are equal."""
    parts = honest_parts(5, noise=noise, scales=scales)
    weights = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0]) if scales else torch.tensor([3.0, 1.0, 2.0, 1.0, 5.0])
    mean = weighted_mean(parts, weights)
    for rule in (skipped_mean,) if scales else (skipped_mean, centered_clip):
        got = rule(parts, weights)
        assert got.outliers == [False] * 5, rule.__name__
        assert float((got.value - mean).abs().max()) <= 0.01 * int8_error(mean), rule.__name__


def test_two_senders_are_averaged_as_they_are_however_far_apart():
    """With two parts nothing says which one is wrong: the weighted mean, nobody left out."""
    parts = hostile_scaled(honest_parts(2), 1, factor=-8.0)
    got = skipped_mean(parts, torch.tensor([1.0, 3.0]))
    assert got.outliers == [False, False] and got.iterations == 0
    assert torch.allclose(got.value, weighted_mean(parts, torch.tensor([1.0, 3.0])))


@pytest.mark.parametrize("n, k, attack", [(5, 1, "scale"), (5, 1, "random"), (8, 2, "scale"), (8, 2, "random"),
                                          (3, 1, "scale"), (5, 2, "scale")])
def test_a_hostile_minority_barely_moves_the_result_and_is_named(n, k, attack):
    """1 of 5 and 2 of 8 (issue 37's targets), 1 of 3 (the smallest robust group) and 2 of 5: the result
    is the honest peers' weighted mean while the plain mean is pulled far off, and exactly the hostile
    senders are outliers (weights 1..n: the hostile senders claim the most tokens, up to 5/3 of the median;
    a random direction deviates across the centre, which no claim forgives)."""
    honest = honest_parts(n)
    parts = hostile_scaled(honest, k) if attack == "scale" else hostile_random(honest, k)
    weights = torch.arange(1.0, n + 1.0)
    target = weighted_mean(honest[:n - k], weights[:n - k])
    plain = relative_error(weighted_mean(parts, weights), target)
    got = skipped_mean(parts, weights)
    assert got.outliers == [False] * (n - k) + [True] * k
    assert float((got.value - target).abs().max()) <= 0.01 * int8_error(target)
    assert plain > 0.5


@pytest.mark.parametrize("distance", [2.0, 4.0, 5.5, 8.0])
def test_a_hostile_part_placed_near_the_others_pulls_at_most_its_share_of_tau(distance):
    """The attacker that knows the rule puts its part where it is kept, against the honest direction,
    ``distance`` median distances away: kept or left out, it moves the result by at most its weight's
    share of τ (kept inside τ) and not at all once left out."""
    honest = honest_parts(4)
    target = honest.mean(0)
    yardstick = float(torch.linalg.vector_norm(honest - target, dim=1).median())
    hostile = target - distance * yardstick * target / torch.linalg.vector_norm(target)
    parts = torch.cat([honest, hostile[None]])
    got = skipped_mean(parts, torch.ones(5))
    moved = float(torch.linalg.vector_norm(got.value - target))
    if got.outliers[-1]:
        assert moved <= 1e-4 * float(torch.linalg.vector_norm(target))
    else:
        assert moved <= got.tau / 5 * 1.001
    assert got.outliers[:4] == [False] * 4
    assert got.outliers[-1] == (distance > robust.TAU_FACTOR)


def test_a_long_phase_may_lie_further_along_the_centre_but_no_claim_widens_tau_against_it():
    """A peer whose DyLU phase was 4× the median carries about 4× the centre: with its tokens it is kept
    (its step further along the centre's direction is forgiven) and the result is the weighted mean;
    claiming the median weight, the same part is an outlier. −8 × Δ claiming the most tokens there are
    is left out all the same: a deviation against the centre counts in full."""
    honest = honest_parts(5, noise=0.3)
    long_phase = honest.clone()
    long_phase[-1] = codec.roundtrip(honest[-1] * 4.0)
    weights = torch.tensor([1.0, 1.0, 2.0, 2.0, 8.0])  # the median weight is 2: the long phase has reach 4
    got = skipped_mean(long_phase, weights)
    assert got.outliers == [False] * 5
    mean = weighted_mean(long_phase, robust.capped_weights(weights.double()))
    assert float((got.value - mean).abs().max()) <= 0.01 * int8_error(mean)
    assert skipped_mean(long_phase, torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0])).outliers[-1]
    assert skipped_mean(hostile_scaled(honest, 1), weights).outliers == [False] * 4 + [True]


def test_a_sender_claiming_a_huge_weight_counts_as_a_few_honest_ones():
    """Tokens are claimed by the sender: the centre counts senders, so a hostile one claiming 10⁶ × the
    others' tokens is still left out (the plain mean follows it entirely); kept, it would count as
    ``WEIGHT_CAP`` × their median."""
    honest = honest_parts(5)
    parts = hostile_scaled(honest, 1)
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e6])
    target = weighted_mean(honest[:4], weights[:4])
    got = skipped_mean(parts, weights)
    assert got.outliers == [False] * 4 + [True]
    assert float((got.value - target).abs().max()) <= 0.01 * int8_error(target)
    assert relative_error(weighted_mean(parts, weights), target) > 5.0
    assert torch.equal(robust.capped_weights(weights.double()), torch.tensor([1.0, 1.0, 1.0, 1.0, robust.WEIGHT_CAP],
                                                                             dtype=torch.float64))


def test_the_coordinate_rules_resist_the_same_minority_but_do_not_return_the_honest_mean():
    """The candidates it was measured against: robust too, but on honest parts they drop the tails of
    every coordinate, so their result is not the weighted mean."""
    honest = honest_parts(5)
    parts, weights = hostile_scaled(honest, 1), torch.ones(5)
    target = weighted_mean(honest[:4], weights[:4])
    plain = relative_error(weighted_mean(parts, weights), target)
    for rule in (trimmed_mean, coordinate_median):
        assert relative_error(rule(parts, weights), target) < 0.3 * plain, rule.__name__
        assert relative_error(rule(honest, weights), weighted_mean(honest, weights)) > 0.05, rule.__name__


def test_coordinate_rules_on_a_small_example():
    parts = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [100.0, -1000.0]])
    weights = torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0])
    # trimmed (one each end): coordinate 0 keeps 2, 3, 4 at weights 1, 2, 1; coordinate 1 keeps 10, 20, 30
    assert torch.allclose(trimmed_mean(parts, weights), torch.tensor([3.0, (10 + 20 + 2 * 30) / 4]))
    # weighted median: the first value whose cumulative weight reaches half of 6
    assert torch.equal(coordinate_median(parts, weights), torch.tensor([3.0, 20.0]))


def test_identical_parts_and_zero_weights():
    parts = torch.ones(4, 8)
    got = skipped_mean(parts, torch.ones(4))
    assert torch.equal(got.value, torch.ones(8)) and got.outliers == [False] * 4
    assert torch.equal(weighted_mean(parts, torch.zeros(4)), torch.zeros(8))


@pytest.mark.parametrize("parts, weights, said", [
    (torch.ones(3, 4, dtype=torch.float64), torch.ones(3), "float32"),
    (torch.ones(12), torch.ones(3), "n_senders, part_numel"),
    (torch.ones(3, 4), torch.ones(2), "2 weights for 3 parts"),
    (torch.ones(3, 4), torch.tensor([1.0, -1.0, 1.0]), "non-negative"),
    (torch.ones(3, 4), torch.tensor([1.0, math.nan, 1.0]), "finite"),
])
def test_bad_input_is_refused(parts, weights, said):
    for rule in robust.RULES.values():
        with pytest.raises(ValueError, match=said):
            rule(parts, weights)


# --- the reducer ------------------------------------------------------------------------------------
def _reduce(make_reducer, parts_by_sender, weights, fail_before: dict[int, int] | None = None,
            left_out: frozenset[tuple[int, int]] = frozenset()):
    """A reducer from ``make_reducer()``; every sender submits its parts in order, concurrently (as their
    streams do); a sender in ``fail_before`` is dropped (``on_sender_failed``) before that part; a
    (sender, part) in ``left_out`` is submitted as over the size bound. :returns: (each sender's results,
    the reducer)."""
    reducer = None

    async def sender(i):
        out = []
        for j, part in enumerate(parts_by_sender[i]):
            if (fail_before or {}).get(i) == j:
                reducer.on_sender_failed(i)
                return out
            try:
                flag = {"left_out": True} if (i, j) in left_out else {}
                out.append(await reducer.accumulate_part(i, j, part, weight=weights[i], **flag))
            except BannedException:
                return out
        return out

    async def main():
        nonlocal reducer
        reducer = make_reducer()  # (it makes asyncio futures: inside the loop)
        return await asyncio.wait_for(asyncio.gather(*(sender(i) for i in range(len(parts_by_sender)))), 30)

    return asyncio.run(main()), reducer


def _parts(n: int, n_parts: int, hostile: int = 0) -> list[list[torch.Tensor]]:
    stacks = [honest_parts(n, seed=p) for p in range(n_parts)]
    stacks = [hostile_scaled(s, hostile) if hostile else s for s in stacks]
    return [[stacks[p][i] for p in range(n_parts)] for i in range(n)]


def test_the_reducer_returns_the_streaming_mean_on_honest_parts():
    """RobustPartReducer against hivemind's TensorPartReducer on the same honest parts: the same
    averages (up to float rounding), every sender gets every part's result."""
    parts, weights = _parts(4, 3), [1.0, 2.0, 1.0, 3.0]
    got, _ = _reduce(lambda: RobustPartReducer([(D,)] * 3, 4), parts, weights)
    plain, _ = _reduce(lambda: TensorPartReducer([(D,)] * 3, 4), parts, weights)
    for ours, theirs in zip(got, plain):
        assert len(ours) == 3
        for a, b in zip(ours, theirs):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_the_reducer_leaves_a_hostile_sender_out_and_counts_its_values():
    parts = _parts(5, 2, hostile=1)
    got, reducer = _reduce(lambda: RobustPartReducer([(D,)] * 2, 5), parts, [1.0] * 5)
    for p in range(2):
        honest_mean = torch.stack([parts[i][p] for i in range(4)]).mean(0)
        assert all(torch.allclose(got[i][p], honest_mean, atol=1e-6) for i in range(5))
    assert reducer.reduced_values == [2 * D] * 5
    assert reducer.outlier_values == [0, 0, 0, 0, 2 * D]


def test_a_part_over_the_size_bound_is_left_out_unjudged_and_its_sender_still_gets_the_average():
    """The all-reduce leaves a part over the size bound out of its slice (allreduce.py) and keeps the round:
    that part weighs in neither the centre nor the mean, counts as outlier values, and its sender gets the
    part's average as everyone does (nothing partial)."""
    parts = _parts(4, 2)
    parts[3][1] = parts[3][1] * 1e6  # only its second part is over the bound
    got, reducer = _reduce(lambda: RobustPartReducer([(D,)] * 2, 4), parts, [1.0] * 4, left_out=frozenset({(3, 1)}))
    assert [len(r) for r in got] == [2, 2, 2, 2]
    assert all(torch.allclose(got[i][0], torch.stack([p[0] for p in parts]).mean(0), atol=1e-6) for i in range(4))
    assert all(torch.allclose(got[i][1], torch.stack([p[1] for p in parts[:3]]).mean(0), atol=1e-6) for i in range(4))
    assert reducer.outlier_values == [0, 0, 0, D] and reducer.reduced_values == [2 * D] * 4
    alone, _ = _reduce(lambda: RobustPartReducer([(D,)], 2), [[parts[0][0]], [parts[1][0]]], [1.0, 1.0],
                       left_out=frozenset({(0, 0), (1, 0)}))  # nothing left to combine: zeros, not an error
    assert all(float(r[0].abs().max()) == 0.0 for r in alone)


def test_a_sender_dropped_mid_round_counts_for_the_parts_it_gave_and_is_not_waited_for():
    """hivemind's semantics: a sender dropped before part 1 is in part 0's result, not in part 1's,
    and the others' part 1 completes without it."""
    parts, weights = _parts(3, 2), [1.0, 1.0, 1.0]
    got, _ = _reduce(lambda: RobustPartReducer([(D,)] * 2, 3), parts, weights, fail_before={2: 1})
    assert [len(r) for r in got] == [2, 2, 1]
    assert torch.allclose(got[0][0], torch.stack([p[0] for p in parts]).mean(0), atol=1e-6)
    assert torch.allclose(got[0][1], torch.stack([parts[0][1], parts[1][1]]).mean(0), atol=1e-6)


def test_a_reducer_finalized_while_it_combines_cancels_the_waiting_senders():
    async def main():
        reducer = RobustPartReducer([(D,)], 2)
        waits = [asyncio.ensure_future(reducer.accumulate_part(i, 0, torch.ones(D), weight=1.0)) for i in range(2)]
        await asyncio.sleep(0)  # both parts are in: the combination is running
        reducer.finalize()
        results = await asyncio.gather(*waits, return_exceptions=True)
        await asyncio.sleep(0.5)  # the combination ends after the finalize, and changes nothing
        return reducer, results

    reducer, results = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert reducer.finished.is_set()


# --- in the all-reduce: real averagers over 127.0.0.1 ----------------------------------------------
ROUND_SHAPES = [(256, 512), (512,)]
PART_BYTES = 2 ** 14  # about 16k values a part: every member reduces a few parts of the 131,584 values


def _round_deltas(n: int, hostile: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    common = [1e-2 * torch.randn(s, generator=g) for s in ROUND_SHAPES]
    deltas = [[c + 1e-2 * torch.randn(s, generator=g) for c, s in zip(common, ROUND_SHAPES)] for _ in range(n)]
    return [d if i < n - hostile else [-8.0 * t for t in d] for i, d in enumerate(deltas)]


@contextlib.contextmanager
def _averagers(kinds: list, prefix: str):
    """One real averager of each class in ``kinds`` (each on its own DHT, on 127.0.0.1), shut down at the end."""
    from diloco_swarm.dht.swarm import start_dht, visible_maddrs

    dhts = [start_dht(initial_peers=[], host="127.0.0.1", port=0)]
    dhts += [start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0) for _ in kinds[1:]]
    averagers = [kind([torch.zeros(s) for s in ROUND_SHAPES], dht, prefix=prefix, target_group_size=len(kinds),
                      matchmaking_time=3.0, allreduce_timeout=30.0, part_size_bytes=PART_BYTES)
                 for kind, dht in zip(kinds, dhts)]
    try:
        yield averagers
    finally:
        for part in (*averagers, *dhts[::-1]):
            part.shutdown()


def _one_round(averagers, deltas) -> list[tuple]:
    """Every averager averages its Δ at once (weight 100): each one's (RoundResult, applied tensors)."""
    from averagerlib import in_threads

    from diloco_swarm.averaging.request import RoundRequest

    n = len(averagers)

    def run(i):
        result, applied = averagers[i].average(RoundRequest(
            delta=deltas[i], weight=100.0, metadata={}, timeout=30.0, digest_wait=10.0, group_size=n))
        return result, [a.clone() for a in applied]

    return in_threads(run, n)


@pytest.mark.timeout(300)
def test_four_averagers_keep_one_hostile_delta_out_agree_bit_for_bit_and_name_it():
    """3 honest averagers and one that sends −8 × its Δ (inside the 10× size bound): every member keeps
    the same verified average, the honest members' mean within int8 error (the plain mean is far), and
    the honest members name the hostile one."""
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    n = 4
    deltas = _round_deltas(n, hostile=1)
    with _averagers([PseudoGradientAverager] * n, "robust-round") as averagers:
        for _ in range(2):  # a second try only after the rare partial round, which is not what this checks
            results = _one_round(averagers, deltas)
            if all(r.ok for r, _ in results):
                break
        assert all(r.ok and r.group_size == n for r, _ in results), [(r.ok, r.reason) for r, _ in results]
        assert len({r.digest for r, _ in results}) == 1
        hostile_id = averagers[-1].peer_id.to_base58()
    for result, _ in results[:-1]:
        assert set(result.outlier_peers) == {hostile_id}, result.outlier_peers
        assert result.avoided_peers == {}  # one outlier round is not enough to avoid it (conduct.py)
    flat = [torch.cat([t.reshape(-1) for t in d]) for d in deltas]
    honest_mean, plain = torch.stack(flat[:-1]).mean(0), torch.stack(flat).mean(0)
    got = torch.cat([t.reshape(-1) for t in results[0][1]])
    # parts travel in int8 twice (to the reducer, then its average back): within 2 codec errors
    assert float((got - honest_mean).abs().max()) <= 2 * int8_error(torch.stack(flat[:-1]).abs().max(0).values)
    assert relative_error(plain, honest_mean) > 1.0


def _weight_liar():
    """An averager class (built here: tests/faults.py holds the node-level faults) that gathers its true weight
    to the group, then sends its parts at 4× that weight: the reducers' mean would weigh it so, the ledger not."""
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        return await PseudoGradientAverager._aggregate_with_group(self, group_info, min_vector_size,
                                                                  **{**kwargs, "weight": 4 * kwargs["weight"]})

    # hivemind names every RPC protocol after the servicer class's name (tests/faults.py does the same)
    name = PseudoGradientAverager.__name__
    return type(name, (PseudoGradientAverager,), {"__qualname__": name, "_aggregate_with_group": _aggregate_with_group})


@pytest.mark.timeout(300)
def test_a_sender_whose_parts_carry_another_weight_than_it_gathered_is_refused_and_named():
    """A member's parts must carry the weight it gathered to the group (what the contribution ledger counts):
    3 honest averagers refuse the parts of one that gathers 100 tokens and sends its parts at 400, and name it;
    nobody keeps that round (each holds its Δ, as after any refused part)."""
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    n = 4
    deltas = _round_deltas(n, hostile=0)
    with _averagers([PseudoGradientAverager] * (n - 1) + [_weight_liar()], "weight-liar") as averagers:
        for _ in range(3):  # another try only when matchmaking left a member out, which is not what this checks
            results = [r for r, _ in _one_round(averagers, deltas)]
            if all(r.group_size == n for r in results):
                break
        liar = averagers[-1].peer_id.to_base58()
    named = [r.rejected_peers.get(liar, "") for r in results[:-1] if r.group_size == n]
    assert named and all("sent parts at weight 400.0, not the weight it gathered (100.0)" in why for why in named), (
        [(r.ok, r.reason, r.rejected_peers) for r in results])
    assert not any(r.ok for r in results), "a member kept an average with the liar's parts in it"  # held, as after any refusal
    # avoided a while, not banned: the gathered list is the leader's copy, which a hostile leader could alter
    assert all("not the one gathered" in r.avoided_peers.get(liar, "") for r in results[:-1] if r.group_size == n)
