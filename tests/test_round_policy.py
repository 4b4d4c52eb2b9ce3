"""The round's decisions (node/round_policy.py), from record sets as a round reads them: who is
online, what the plan leaves us, and what the outer step does with each kind of outcome."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from diloco_swarm.averaging.grouping import plan_round
from diloco_swarm.node import round_policy as policy

CFG = SimpleNamespace(averaging_window=30.0, matchmaking_time=2.0, group_size=64, max_group_size=64, max_outer_steps=0)
NOW = 1_000_000.0


def rec(step=5, eta=NOW - 1.0, rnd=None, reach="public"):
    """One peer's record, with the fields a round reads (dht/records.py: PeerRecord)."""
    return SimpleNamespace(outer_step=step, restarted_below=0, phase_eta=eta, averaging_round=rnd, reachability=reach)


def plan_of(records, me="me", cfg=CFG, gone=frozenset(), step=5, silent=None, shunned=frozenset()):
    others = {p: r for p, r in records.items() if p != me}
    return policy.plan(step, 10.0, others, me=me, now=NOW, silent_s=silent or {}, max_silent_s=10.0,
                       first_round=False, cfg=cfg, gone=gone, shunned=shunned)


def test_nobody_else_online_is_a_solo_round_in_overlap_mode_only():
    assert policy.before_plan({"me": rec()}, me="me", donors=False, overlap=True, max_outer_steps=0) == \
        policy.Solo("no other peer online")
    # blocking: a peer that starts at the same moment may still come; a donor counts as online
    assert policy.before_plan({"me": rec()}, me="me", donors=False, overlap=False, max_outer_steps=0) is None
    assert policy.before_plan({"me": rec()}, me="me", donors=True, overlap=True, max_outer_steps=0) is None


def test_others_that_finished_the_run_are_not_averaged_with_but_caught_up_with():
    done = {"me": rec(8), "a": rec(10, eta=0.0), "b": rec(10, eta=0.0)}
    decision = policy.before_plan(done, me="me", donors=True, overlap=True, max_outer_steps=10)
    assert isinstance(decision, policy.Skip) and "finished the run" in decision.reason
    still_training = {**done, "b": rec(10, eta=NOW + 5)}  # one of them still hands off a phase: average
    assert policy.before_plan(still_training, me="me", donors=True, overlap=True, max_outer_steps=10) is None


def test_a_crashed_peer_is_not_waited_for_and_nobody_else_makes_the_round_solo():
    records = {"me": rec(), "a": rec(), "dead": rec(eta=NOW + 3.0)}
    planned = plan_of(records, silent={"dead": 30.0})  # its record stopped changing 30 s ago
    assert "dead" in planned.plan.late and planned.due == pytest.approx(NOW + policy.ALIGN_SLACK_S)
    join = policy.after_plan(planned, records, set(), me="me", overlap=True)
    assert isinstance(join, policy.Join) and join.members == ("a",) and join.group_key == "" and join.online == 3
    # the only other peer's process is gone, its record still fresh: nobody to wait for
    pair = {"me": rec(), "a": rec()}
    assert policy.after_plan(plan_of(pair, gone={"a"}), pair, {"a"}, me="me", overlap=True) == \
        policy.Solo("no other peer online (the others are gone)")


def test_a_member_found_gone_in_a_one_group_round_leaves_the_plan_and_its_eta():
    records = {"me": rec(), "a": rec(), "slow": rec(eta=NOW + 3.0)}  # within the grace window (5 s)
    assert plan_of(records).due == pytest.approx(NOW + 3.0 + policy.ALIGN_SLACK_S)  # waits for the slow one
    planned = plan_of(records, gone={"slow"})
    assert "slow" not in planned.plan.expected and planned.due == pytest.approx(NOW + policy.ALIGN_SLACK_S)


def test_a_peer_we_avoid_is_not_planned_with_nor_waited_for_in_one_group_but_stays_in_a_grid():
    # it never joins our group: a plan that counted it would wait out its (maybe hostile) ETA and the leader
    # the matchmaking time for a member that cannot come
    records = {"me": rec(), "a": rec(), "b": rec(), "avoided": rec(eta=NOW + 4.0)}
    assert plan_of(records).due == pytest.approx(NOW + 4.0 + policy.ALIGN_SLACK_S)
    planned = plan_of(records, shunned={"avoided"})
    assert "avoided" not in planned.plan.expected and planned.due == pytest.approx(NOW + policy.ALIGN_SLACK_S)
    join = policy.after_plan(planned, records, set(), me="me", overlap=True)
    assert join.members == ("a", "b") and join.online == 4  # (the averager takes it out of the quorum's count)
    grid = {**{p: rec() for p in ("me", "a", "b", "c", "d")}, "avoided": rec()}
    cfg = SimpleNamespace(**{**vars(CFG), "group_size": 2})
    assert plan_of(grid, cfg=cfg, shunned={"avoided"}).plan.groups == plan_of(grid, cfg=cfg).plan.groups


def test_a_grid_group_whose_others_are_gone_is_late_not_solo():
    records = {p: rec() for p in ("me", "a", "b", "c", "d", "e")}
    cfg = SimpleNamespace(**{**vars(CFG), "group_size": 2})
    planned = plan_of(records, cfg=cfg)
    key, members = planned.plan.group_of("me")
    assert len(planned.plan.groups) > 1 and len(members) == 2
    partner = {q for q in members if q != "me"}
    decision = policy.after_plan(planned, records, partner, me="me", overlap=True)
    assert decision == policy.Skip("the other planned members are gone", key)
    join = policy.after_plan(planned, records, set(), me="me", overlap=True)
    assert isinstance(join, policy.Join) and join.group_key == key and join.members == tuple(partner)
    assert policy.needs_swarm_wait(planned.plan, records, "me")


def test_the_last_round_of_a_planned_run_is_one_group_up_to_max_group_size():
    records = {p: rec(9) for p in ("me", "a", "b", "c")}
    cfg = SimpleNamespace(**{**vars(CFG), "group_size": 2, "max_outer_steps": 10})
    assert len(plan_of(records, cfg=cfg, step=9).plan.groups) == 1  # round 9 is the last: one group
    assert len(plan_of({p: rec(7) for p in records}, cfg=cfg, step=7).plan.groups) == 2  # before it: a grid


def test_seconds_to_handoff_leaves_out_a_starting_peer_except_in_our_first_round():
    assert policy.seconds_to_handoff(0.0, NOW, silent_s=0.0, max_silent_s=10.0) == math.inf
    assert policy.seconds_to_handoff(0.0, NOW, silent_s=0.0, max_silent_s=10.0, first_round=True) == 0.0


def outcome(ok=False, maybe_kept=False, alone=False, stale=False, state=None, mixed=None):
    return SimpleNamespace(result=SimpleNamespace(ok=ok, maybe_kept=maybe_kept), alone=alone, stale=stale,
                           state=state, mixed=mixed)


@pytest.mark.parametrize("case, carried, expected", [
    (outcome(ok=True), 0, policy.Apply()),  # a verified average
    (outcome(alone=True), 0, policy.Apply()),  # nobody online: our own Δ
    (outcome(maybe_kept=True), 0, policy.Apply()),  # a member may have kept it: never carry it twice
    (outcome(), 0, policy.Hold()),  # late: others online, no verified group
    (outcome(), policy.MAX_CARRIED_ROUNDS - 1, policy.Hold()),
    (outcome(), policy.MAX_CARRIED_ROUNDS, policy.Apply()),  # late too long: bounded staleness
    (outcome(ok=True, mixed=object()), 0, policy.AdoptMixed()),
    (outcome(ok=True, state=SimpleNamespace(includes_round=True)), 0, policy.AdoptState(carry=False, wasted=False)),
    (outcome(ok=True, state=SimpleNamespace(includes_round=False)), 0, policy.AdoptState(carry=True, wasted=False)),
    (outcome(stale=True, state=SimpleNamespace(includes_round=False)), 0, policy.AdoptState(carry=False, wasted=True)),
    (outcome(state=SimpleNamespace(includes_round=False)), policy.MAX_CARRIED_ROUNDS,
     policy.AdoptState(carry=False, wasted=True)),
])
def test_settle_decides_what_the_outer_step_does(case, carried, expected):
    decision = policy.settle(case, carried)
    assert decision == expected
    assert decision.carry == (isinstance(expected, policy.Hold) or getattr(expected, "carry", False))


def test_a_peer_in_the_planned_round_is_due_now_whatever_its_next_phase_says():
    records = {"me": rec(3), "in-round": rec(3, eta=NOW + 60, rnd=3), "elsewhere": rec(3, eta=NOW + 60),
               "a": rec(3), "b": rec(3)}
    plan = plan_of(records, step=3).plan
    assert "in-round" in plan.expected and "elsewhere" in plan.late
    assert plan == plan_round(3, {"me": 0.0, "in-round": 0.0, "elsewhere": 60.0, "a": -1.0, "b": -1.0},
                              max_group_size=64, grace_s=5.0)
