"""θ-mixing (averaging/mixing.py, PseudoGradientAverager.mix, node/mixing.py): members of a round that
hold different θ_global leave it holding one, bit for bit, without a state download."""

from __future__ import annotations

import pytest
import torch

from diloco_swarm.averaging.mixing import MAX_MARKS, group_bits, history_length, mixing_group_id, plan_mix
from diloco_swarm.node.global_state import ThetaHistory

D = {c: c * 16 for c in "abcdef"}  # θ digests (16 hex digits)


def meta(step: int, digest: str, *marks) -> dict:
    return {"outer_step": step, "theta_digest": digest, "marks": [list(m) for m in marks]}


def test_a_group_that_holds_one_state_does_not_mix():
    assert plan_mix({"A": meta(5, D["a"], (4, D["b"])), "B": meta(5, D["a"]), "C": meta(5, D["a"])}) is None
    assert plan_mix({"A": meta(5, D["a"])}) is None  # a group of one


def test_lineages_at_the_round_step_mix_against_the_newest_state_all_hold():
    gathered = {"A": meta(5, D["a"], (3, D["c"]), (4, D["d"])),
                "B": meta(5, D["b"], (3, D["c"]), (4, D["d"])),
                "C": meta(5, D["a"], (2, D["e"]), (3, D["c"]))}
    plan = plan_mix(gathered)
    assert plan.reference == (3, D["c"])  # (4, d) is newer, but C does not hold it
    assert plan.weights == {"A": 1.0, "B": 1.0, "C": 1.0} and plan.outer_step == 6
    # a member's own current state is a reference too
    assert plan_mix({"A": meta(5, D["a"], (4, D["d"])), "B": meta(5, D["b"], (5, D["a"]))}).reference == (5, D["a"])


def test_without_a_common_state_there_is_no_mix():
    assert plan_mix({"A": meta(5, D["a"], (4, D["c"])), "B": meta(5, D["b"], (4, D["d"]))}) is None


def test_members_behind_the_round_weigh_0_and_mix_only_when_cheaper_than_their_downloads():
    # two members, one a step behind: a mix (2 int8 tensor sets) moves fewer bytes than its download (8 B/value)
    plan = plan_mix({"A": meta(6, D["a"], (5, D["c"])), "B": meta(5, D["c"])})
    assert plan.weights == {"A": 1.0, "B": 0.0} and plan.reference == (5, D["c"]) and plan.outer_step == 7
    # four members, one behind: its download is cheaper than the group's mix; two behind: the mix is
    ahead = {p: meta(6, D["a"], (5, D["c"])) for p in "ABC"}
    assert plan_mix({**ahead, "D": meta(5, D["c"])}) is None
    two = plan_mix({"A": meta(6, D["a"], (5, D["c"])), "B": meta(6, D["a"], (5, D["c"])),
                    "C": meta(5, D["c"]), "D": meta(5, D["c"])})
    assert two.weights == {"A": 1.0, "B": 1.0, "C": 0.0, "D": 0.0}


def test_one_member_claiming_to_be_far_ahead_gains_no_weight_or_step():
    plan = plan_mix({"A": meta(5, D["a"], (4, D["c"])), "B": meta(5, D["b"], (4, D["c"])),
                     "L": meta(1005, D["e"], (4, D["c"]))})
    assert plan.outer_step == 6 and plan.weights == {"A": 1.0, "B": 1.0, "L": 1.0}
    four = plan_mix({p: meta(5, D["a"], (4, D["c"])) for p in "ABC"} | {"L": meta(1005, D["e"], (4, D["c"]))})
    assert four.outer_step == 6 and four.weights == {"A": 1.0, "B": 1.0, "C": 1.0, "L": 1.0}
    # the same θ_global claimed at two steps is one lineage: nothing to mix
    assert plan_mix({"A": meta(5, D["a"]), "B": meta(5, D["a"]), "L": meta(1005, D["a"], (5, D["a"]))}) is None


def test_a_restarted_lineage_mixes_as_where_it_stands_and_the_mix_keeps_the_least_debt():
    # B restarted from θ_0 owing 8 outer steps (restarted_below): at outer step 12 it stands at 4, behind A
    restarted = {**meta(12, D["b"], (0, D["f"])), "restarted_below": 8}
    plan = plan_mix({"A": meta(8, D["a"], (0, D["f"])), "B": restarted})
    assert plan.weights == {"A": 1.0, "B": 0.0} and plan.outer_step == 9 and plan.restarted_below == 0
    # past A's step by more than its debt, it leads, and the mixed state keeps its debt
    ahead = plan_mix({"A": meta(8, D["a"], (0, D["f"])), "B": {**restarted, "outer_step": 17}})
    assert ahead.weights == {"A": 0.0, "B": 1.0} and ahead.outer_step == 18 and ahead.restarted_below == 8
    for bad in (-1, True, "8", 2 ** 60):
        assert plan_mix({"A": meta(8, D["a"], (0, D["f"])), "B": {**restarted, "restarted_below": bad}}) is None


@pytest.mark.parametrize("bad", [
    None, [], {"outer_step": 5}, meta(-1, D["a"]), meta(True, D["a"]), meta(5, "ZZ" * 8), meta(5, D["a"][:15]),
    {**meta(5, D["a"]), "marks": "(4, x)"}, meta(5, D["a"], (4,)), meta(5, D["a"], (4, D["b"], 1)),
    meta(5, D["a"], *[(i, D["c"]) for i in range(MAX_MARKS + 1)]), meta(2 ** 60, D["a"]),
])
def test_malformed_metadata_from_a_member_means_no_mix(bad):
    assert plan_mix({"A": meta(5, D["a"], (4, D["c"])), "B": meta(5, D["b"], (4, D["c"])), "X": bad}) is None


def test_group_bits_and_mixing_ids_are_fixed_functions_of_the_key_and_the_round():
    assert group_bits("r3:d1:g0") == group_bits("r3:d1:g0") and len(group_bits("r3:d1:g0")) == 32
    assert set(group_bits("r3:d1:g0")) <= {"0", "1"}
    assert len({group_bits(f"r{t}:d{t % 3}:g{g}") for t in range(20) for g in range(8)}) == 160
    gid = bytes(range(32))
    assert mixing_group_id(gid) == mixing_group_id(bytes(gid)) and len(mixing_group_id(gid)) == 32
    assert mixing_group_id(gid) != gid and mixing_group_id(mixing_group_id(gid)) != mixing_group_id(gid)


def test_theta_history_keeps_the_last_states_as_copies():
    assert history_length(1) == 1 and history_length(3) == 4
    history = ThetaHistory(keep=3)
    theta = [torch.zeros(3)]
    for step in range(4):
        history.remember((step, D["abcdef"[step]]), theta)
        theta[0] += 1  # the node's θ_global changes in place after each remember
    assert history.states() == [(2, D["c"]), (3, D["d"])]  # keep = 3 counts the current θ_global
    assert torch.equal(history.get((2, D["c"]))[0], torch.full((3,), 2.0)) and history.get((0, D["a"])) is None
    history.resize(1)
    assert history.states() == [] and (history.remember((9, D["a"]), theta) or history.states() == [])


def test_the_anchor_theta_0_is_listed_first_kept_through_resizes_and_is_a_reference_of_last_resort():
    history = ThetaHistory(keep=3)
    history.anchor_on((0, D["f"]), [torch.full((3,), 7.0)])
    for step in range(1, 5):
        history.remember((step, D["abcdef"[step - 1]]), [torch.full((3,), float(step))])
    assert history.states() == [(0, D["f"]), (3, D["c"]), (4, D["d"])]
    assert history.states(most=2) == [(0, D["f"]), (4, D["d"])]  # a mark budget keeps the anchor and the newest
    history.resize(1)
    assert history.states() == [(0, D["f"])] and torch.equal(history.get((0, D["f"]))[0], torch.full((3,), 7.0))
    # three pairs of a grid meet in one group (a grid run's last round): they share only θ_0, and mix against it
    pairs = {"A": meta(9, D["a"], (0, D["f"])), "B": meta(9, D["a"], (0, D["f"])), "C": meta(9, D["b"], (0, D["f"])),
             "D": meta(9, D["b"], (0, D["f"])), "E": meta(9, D["c"], (0, D["f"])), "F": meta(9, D["c"], (0, D["f"]))}
    plan = plan_mix(pairs)
    assert plan is not None and plan.reference == (0, D["f"]) and plan.outer_step == 10
    assert set(plan.weights.values()) == {1.0}


# --- the mixing all-reduce between real averagers over 127.0.0.1 ------------------------------------

SHAPES = [(96, 40), (33,)]


@pytest.fixture(scope="module")
def averagers():
    from diloco_swarm.averaging.averager import PseudoGradientAverager
    from diloco_swarm.dht.swarm import start_dht, visible_maddrs

    first = start_dht(initial_peers=[], host="127.0.0.1", port=0)
    dhts = [first] + [start_dht(initial_peers=visible_maddrs(first), host="127.0.0.1", port=0) for _ in range(2)]
    made = [PseudoGradientAverager([torch.zeros(s) for s in SHAPES], dht, prefix="mixing-test", target_group_size=3,
                                   matchmaking_time=2.0, allreduce_timeout=30.0) for dht in dhts]
    yield made
    for part in (*made, *dhts[::-1]):
        part.shutdown()


def _tensors(scale: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.timeout(240)
def test_a_group_mixes_to_one_bit_identical_state_and_a_wrong_weight_is_refused(averagers):
    """Three members: A and B hold different θ_global at the round's step, C is a step behind. After
    the verified Δ round they plan the same mix from the gathered metadata; all three end with the same
    bytes, the weight-1 members' mean within the int8 error, C included (it catches up)."""
    from averagerlib import in_threads

    from diloco_swarm.averaging.request import RoundRequest

    ids = [a.peer_id.to_base58() for a in averagers]
    metas = [meta(5, D["a"], (4, D["c"])), meta(5, D["b"], (4, D["c"])), meta(4, D["c"])]
    for attempt in range(2):  # a second try only after the rare partial round, which is not what this checks
        rounds = in_threads(lambda i: averagers[i].average(RoundRequest(
            delta=_tensors(1e-2, i), weight=100.0, metadata=metas[i], timeout=30.0, digest_wait=10.0)), 3)
        if all(r.ok for r, _ in rounds):
            break
    assert all(r.ok and r.group_size == 3 for r, _ in rounds), [(r.ok, r.reason) for r, _ in rounds]
    plans = [plan_mix(r.gathered) for r, _ in rounds]
    assert all(p == plans[0] for p in plans) and plans[0].reference == (4, D["c"])
    assert plans[0].weights == {ids[0]: 1.0, ids[1]: 1.0, ids[2]: 0.0}
    contributions = [_tensors(5e-2, 10 + i) + _tensors(1e-2, 20 + i) for i in range(3)]  # θ differences, momentum
    mixes = in_threads(lambda i: averagers[i].mix(contributions[i], round_result=rounds[i][0],
                                                  weight=plans[0].weights[ids[i]],
                                                  planned_weights=plans[0].weights, digest_wait=10.0), 3)
    assert all(m.ok for m, _ in mixes), [(m.ok, m.reason) for m, _ in mixes]
    assert len({m.digest for m, _ in mixes}) == 1 and all(m.bytes_sent > 0 for m, _ in mixes)
    assert all(torch.equal(a, b) for _, t in mixes[1:] for a, b in zip(t, mixes[0][1]))  # bit-identical
    exact = [(a + b) / 2 for a, b in zip(contributions[0], contributions[1])]  # C weighs 0
    for mixed, want in zip(mixes[0][1], exact):
        assert float((mixed - want).norm() / want.norm()) < 0.02  # int8 twice: each part, then the average

    # C claims weight 1 although the plan gives it 0: its reducers refuse it, and no member keeps the mix
    rounds = in_threads(lambda i: averagers[i].average(RoundRequest(
        delta=_tensors(1e-2, i), weight=100.0, metadata=metas[i], timeout=30.0, digest_wait=10.0)), 3)
    assert all(r.ok for r, _ in rounds), [(r.ok, r.reason) for r, _ in rounds]
    claimed = [plans[0].weights[ids[0]], plans[0].weights[ids[1]], 1.0]
    mixes = in_threads(lambda i: averagers[i].mix(contributions[i], round_result=rounds[i][0], weight=claimed[i],
                                                  planned_weights=plans[0].weights, digest_wait=10.0), 3)
    assert not any(m.ok for m, _ in mixes), [(m.ok, m.reason) for m, _ in mixes]
    refusals = [why for m, _ in mixes for why in m.rejected_peers.values()]
    assert any("the round's plan gives it 0.0" in why for why in refusals), refusals
    for (m, t), own in zip(mixes, contributions):  # a failed mix hands back our own contribution
        assert all(torch.equal(a, b) for a, b in zip(t, own))
