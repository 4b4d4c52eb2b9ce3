"""The grouping rule (diloco_swarm.averaging.grouping): progress alignment and the rotating Moshpit grid."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from diloco_swarm.averaging.grouping import group_for, moved_past, plan_round, round_number


def peers(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Qm{rng.getrandbits(64):016x}" for _ in range(n)]


def check_partition(plan, cap: int) -> None:
    seen = list(itertools.chain.from_iterable(plan.groups.values()))
    assert sorted(seen) == list(plan.expected) and len(seen) == len(set(seen))
    assert all(1 <= len(m) <= cap for m in plan.groups.values())


def test_everyone_in_one_group_when_the_swarm_fits_under_the_cap():
    ids = peers(6)
    plan = plan_round(3, {p: 1.0 + i for i, p in enumerate(ids)}, max_group_size=64, grace_s=60.0)
    assert plan.groups == {"r3:all": tuple(sorted(ids))} and plan.late == ()
    for p in ids:
        assert group_for(3, p, {q: 1.0 for q in ids}) == ("r3:all", tuple(sorted(ids)))


def test_a_slower_peer_within_the_grace_window_is_expected_and_a_much_slower_one_is_late():
    etas = {"QmA": 10.0, "QmB": 10.5, "QmC": 11.0, "QmD": 13.0, "QmE": 200.0, "QmF": math.inf}
    plan = plan_round(0, etas, quorum=0.5, grace_s=5.0)  # the quorum (3 of 6) is in at 11 s: deadline 16 s
    assert plan.deadline_s == 16.0
    assert plan.expected == ("QmA", "QmB", "QmC", "QmD") and plan.late == ("QmE", "QmF")
    assert plan.group_of("QmE") == ("r0:late", ("QmE",))
    # a 30% slower peer (13 s vs 10 s) is in the round with a 5 s grace window
    assert "QmD" in plan.group_of("QmA")[1]
    # odd inputs: NaN and negative ETAs count as "done"; nobody coming gives no group
    assert plan_round(0, {"QmA": float("nan"), "QmB": -3.0}).expected == ("QmA", "QmB")
    empty = plan_round(0, {"QmA": math.inf})
    assert empty.groups == {} and empty.late == ("QmA",) and empty.deadline_s == math.inf


@pytest.mark.parametrize("n,cap", [(256, 16), (65, 64), (1024, 64), (1000, 10), (300, 4)])
def test_the_grid_partitions_the_peers_within_the_cap_and_mixes_everyone_in_dims_rounds(n, cap):
    ids = peers(n, seed=n)
    etas = {p: 0.0 for p in ids}
    first = plan_round(0, etas, max_group_size=cap)
    dims = first.dims
    assert dims == len(first.sides) >= 2 and max(first.sides) <= cap and math.prod(first.sides) >= n
    # union of the groups over `dims` consecutive rounds connects every peer (information reaches all)
    parent = {p: p for p in ids}

    def find(p):
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for t in range(5, 5 + dims):
        plan = plan_round(t, etas, max_group_size=cap)
        check_partition(plan, cap)
        assert sum(len(m) == 1 for m in plan.groups.values()) <= 1  # at most one peer averages alone
        for members in plan.groups.values():
            for p in members[1:]:
                parent[find(p)] = find(members[0])
    assert len({find(p) for p in ids}) == 1
    # groups change between rounds: a peer does not keep its group
    a, b = plan_round(0, etas, max_group_size=cap), plan_round(1, etas, max_group_size=cap)
    assert a.group_of(ids[0])[1] != b.group_of(ids[0])[1]


def test_a_full_grid_gives_the_exact_global_average_after_dims_rounds():
    # Moshpit SGD's exact-averaging setting (arXiv 2103.03239): 8 x 8 grid, groups of 8
    ids = peers(64, seed=7)
    rng = random.Random(1)
    value = {p: rng.uniform(-1, 1) for p in ids}
    mean = sum(value.values()) / len(value)
    etas = {p: 0.0 for p in ids}
    for t in range(2):
        plan = plan_round(t, etas, max_group_size=8)
        assert plan.sides == (8, 8) and all(len(m) == 8 for m in plan.groups.values())
        for members in plan.groups.values():
            avg = sum(value[p] for p in members) / len(members)
            for p in members:
                value[p] = avg
    assert max(abs(v - mean) for v in value.values()) < 1e-12


def test_every_peer_computes_the_same_groups():
    ids = peers(200, seed=3)
    etas = {p: random.Random(p).uniform(0, 20) for p in ids}
    plan = plan_round(9, etas, max_group_size=16, grace_s=3.0)
    for p in plan.expected:
        key, members = group_for(9, p, dict(reversed(list(etas.items()))), max_group_size=16, grace_s=3.0)
        assert plan.groups[key] == members and p in members


def test_bad_parameters_raise():
    for kwargs in ({"max_group_size": 1}, {"quorum": 0.0}, {"quorum": 1.5}, {"grace_s": -1.0},
                   {"grace_s": float("nan")}):
        with pytest.raises(ValueError):
            plan_round(0, {"QmA": 1.0}, **kwargs)
    with pytest.raises(ValueError):
        plan_round(-1, {"QmA": 1.0})


def test_majority_quorum_forbids_two_groups_in_one_round():
    from diloco_swarm.averaging.grouping import majority_quorum

    assert [majority_quorum(n) for n in range(1, 8)] == [2, 2, 2, 3, 3, 4, 4]
    for n in range(2, 65):  # two disjoint groups of at least the quorum never fit in n peers
        assert 2 * majority_quorum(n) > n
    assert majority_quorum(65, max_group_size=64) == 2  # beyond one group: disjoint groups are the grid's job
    assert majority_quorum(10, max_group_size=4) == 2


def test_a_member_behind_does_not_make_up_a_majority_for_the_newest_step():
    """The fault-free 3-peer split (docs/decisions.md: "a majority of the peers not behind"): a peer a step behind met one
    peer's round, then the other's, and the two pairs each made their own θ_global of one outer step."""
    from diloco_swarm.averaging.grouping import step_quorum_problem

    assert step_quorum_problem([3, 4], online=3) is not None  # d1 behind + d2: d3 could advance step 4 too
    assert step_quorum_problem([4, 4], online=3) is None
    assert step_quorum_problem([3, 4, 4], online=3) is None  # the behind member joins the majority's round
    assert step_quorum_problem([3, 4], online=2) is None  # two peers a step apart: nobody else can advance 4
    assert step_quorum_problem([4, 4, 3], online=4) is None  # the 4th peer alone cannot advance step 4
    assert step_quorum_problem([4, 3], online=4) is not None
    assert step_quorum_problem([4, 4], online=4) is not None  # as majority_quorum: 2 of 4 is not a majority
    assert step_quorum_problem([9, 4, 4], online=3) is None  # a claim far ahead does not block the honest majority
    assert step_quorum_problem([9, 4], online=3) is not None
    assert step_quorum_problem(["4", None, True, -1], online=3) is not None  # untrusted claims count for nothing
    assert step_quorum_problem([4, "x", 4], online=3) is None


@pytest.mark.parametrize("online", range(2, 9))
def test_two_disjoint_groups_never_advance_the_same_step(online):
    """Exhaustively for small swarms: no two disjoint groups that pass the rule both advance step s."""
    import itertools

    from diloco_swarm.averaging.grouping import step_quorum_problem

    for steps in itertools.product((0, 1), repeat=online):  # each peer at step 0 or 1
        peers = range(online)
        for mask in itertools.product((0, 1, 2), repeat=online):  # 0: outside, 1: group A, 2: group B
            a = [steps[p] for p in peers if mask[p] == 1]
            b = [steps[p] for p in peers if mask[p] == 2]
            if len(a) >= 2 and len(b) >= 2 and step_quorum_problem(a, online) is None \
                    and step_quorum_problem(b, online) is None:
                assert max(a) != max(b), (steps, mask)


@pytest.mark.parametrize("n,cap", [(8, 4), (6, 2), (8, 2), (9, 4), (12, 4), (5, 2), (7, 4)])
def test_groups_are_whole_lines_that_cross_from_round_to_round(n, cap):
    """Consecutive rounds group along crossing lines: on a full grid whose lines are the groups, no two
    peers meet in two rounds in a row; where lines are packed into a group (a side below the group
    size) or the grid is partial, a peer meets again fewer than half of its group (at most one peer).
    Nobody averages alone, and a group holds at most the cap (one more for a left-over peer).
    Balanced blocks of the line order instead kept 3 of 8 peers together every round (bench scale)."""
    for seed in range(10):
        ids = peers(n, seed=seed)
        etas = {p: 0.0 for p in ids}
        plans = [plan_round(t, etas, max_group_size=cap) for t in range(4)]
        for plan in plans:
            assert sorted(p for m in plan.groups.values() for p in m) == sorted(ids)
            assert all(2 <= len(m) <= cap + 1 for m in plan.groups.values()), plan.groups
            assert sum(len(m) > cap for m in plan.groups.values()) <= 1
        for a, b in zip(plans, plans[1:]):
            lines_are_groups = math.prod(a.sides) == n and all(
                len(m) == plan.sides[plan.round_no % plan.dims] for plan in (a, b) for m in plan.groups.values())
            for p in ids:
                kept = set(a.group_of(p)[1]) & set(b.group_of(p)[1]) - {p}
                allowed = 0 if lines_are_groups else max(1, (len(b.group_of(p)[1]) - 1) // 2)
                assert len(kept) <= allowed, (p, a.groups, b.groups)


@pytest.mark.parametrize("n,cap,sides", [(8, 4, (4, 2)), (1024, 16, (16, 16, 4)), (12, 4, (4, 3)),
                                         (1024, 64, (64, 16))])
def test_a_grid_of_long_lines_forms_groups_at_the_cap_and_averages_exactly(n, cap, sides):
    """Lines as long as the cap allows: 8 peers under a cap of 4 average in two groups of 4 every
    round (a 3 x 3 grid gave trios and pairs, and a pair whose member was late stranded the other:
    bench scale); lines packed into groups keep Moshpit's exact global average after ``dims`` rounds."""
    ids = peers(n, seed=n)
    etas = {p: 0.0 for p in ids}
    rng = random.Random(2)
    value = {p: rng.uniform(-1, 1) for p in ids}
    mean = sum(value.values()) / n
    for t in range(len(sides)):
        plan = plan_round(t, etas, max_group_size=cap)
        assert plan.sides == sides
        assert min(len(m) for m in plan.groups.values()) >= min(cap, n // len(plan.groups)), plan.groups
        for members in plan.groups.values():
            avg = sum(value[p] for p in members) / len(members)
            value.update((p, avg) for p in members)
    assert max(abs(v - mean) for v in value.values()) < 1e-12
    # round 0 runs along the first side, the longest: each group is one whole line
    assert sorted(len(m) for m in plan_round(0, etas, max_group_size=cap).groups.values())[-1] == sides[0]


def test_a_grid_group_starts_with_a_majority_of_its_planned_members():
    from diloco_swarm.averaging.grouping import grid_group_quorum

    assert [grid_group_quorum(n) for n in (1, 2, 3, 4, 5, 8, 64, 65)] == [2, 2, 2, 3, 3, 5, 33, 33]
    for planned in range(2, 70):  # two disjoint groups under one key can never both start
        assert 2 * grid_group_quorum(planned) > planned


def test_the_round_number_is_the_swarms_median_step_or_ours_when_ahead():
    assert round_number(5, [(5, None)] * 5) == 5
    assert round_number(9, [(10, None), (10, None), (10, None), (9, None), (8, None)]) == 10  # one behind: the swarm's
    assert round_number(12, [(10, None)] * 5) == 12  # ahead: ours
    assert round_number(0, []) == 0
    # untrusted claims that are not ints ≥ 0 are ignored
    assert round_number(3, [("x", None), (True, 7), (-1, None), (3.5, None), (4, "4")]) == 4


def test_peers_behind_the_swarm_at_one_step_plan_one_round_whenever_they_read_the_records():
    # CI, the 6-peer pairs test: c (step 9) planned r9 with a as its partner; a (step 9) read the records
    # a moment later, after three peers had reached step 10, and planned r10, where c was again its
    # partner. Each waited out its window for the other. Now a sees c looking for a group in r9 and joins it.
    swarm_moved = [(10, None), (10, None), (10, None), (8, None)]
    assert round_number(9, swarm_moved + [(9, None)]) == 10  # (before c's record says where it waits)
    assert round_number(9, swarm_moved + [(9, 9)]) == 9
    # the newest round a peer at our step waits in, between our step and the swarm's
    assert round_number(9, [(11, None)] * 4 + [(9, 10), (9, 9)]) == 10
    assert round_number(9, [(11, None)] * 4 + [(9, 12)]) == 11  # past the swarm: not taken
    assert round_number(9, [(11, None)] * 4 + [(8, 10)]) == 11  # another step's round: not taken
    assert round_number(11, [(11, None)] * 4 + [(11, 12)]) == 11  # not behind: our own step, as before


def test_a_planned_member_in_a_later_round_or_past_ours_will_not_come():
    assert moved_past(9, 10, None) and moved_past(9, 9, 10) and moved_past(9, 8, 10)
    assert not moved_past(9, 9, None) and not moved_past(9, 9, 9) and not moved_past(9, 9, 8)
    assert not moved_past(9, "10", None) and not moved_past(9, 9, True) and not moved_past(9, None, 10.5)


def test_a_grid_round_waits_while_its_peer_is_past_the_swarms_step():
    from diloco_swarm.averaging.grouping import ahead_of_swarm, swarm_step

    # CI, 6 peers in pairs: d and e averaged step 3, then planned step 4 while the others were at 3
    assert swarm_step(4, [4, 3, 3, 3, 3]) == 3 and ahead_of_swarm(4, [4, 3, 3, 3, 3])
    assert not ahead_of_swarm(4, [4, 4, 3, 3, 3])  # half the swarm at 4: the upper median is 4
    assert not ahead_of_swarm(3, [4, 4, 3, 3, 3])  # at or behind the swarm: never waits
    assert not ahead_of_swarm(4, [3])  # a pair: the upper median of two is the step ahead
    assert not ahead_of_swarm(7, [])  # alone
    # untrusted claims: junk is ignored, one liar far ahead moves the median as one peer of six
    assert ahead_of_swarm(4, [3, 3, 3, 10**18, "4", None, True, -1])
    assert not ahead_of_swarm(4, [3, 3, 10**18, 10**18])
