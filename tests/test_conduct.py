"""Which peers an averager keeps out of its groups (averaging/conduct.py), judged on round reports alone.

The outlier score (issue 37, item 2): a sender left out as an outlier in ``AVOID_AFTER_OUTLIER_ROUNDS``
of its rounds with us in a row is avoided for ``AVOID_OUTLIER_S``; a clean round with us resets its count,
a round without it leaves the count alone, and the avoidance runs out.
"""

from __future__ import annotations

import pytest

from diloco_swarm.averaging import conduct as conduct_module
from diloco_swarm.averaging.allreduce import REFUSED_OUR_PART, SIZE_REASON, WEIGHT_REASON, RoundStats
from diloco_swarm.averaging.conduct import (AVOID_AFTER_OUTLIER_ROUNDS, AVOID_OUTLIER_S, AVOID_REFUSER_S,
                                            PeerConduct)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def conduct() -> tuple[PeerConduct, Clock]:
    clock = Clock()
    return PeerConduct(clock=clock), clock


def round_with(outliers=(), clean=()) -> RoundStats:
    """A round in which ``outliers`` and ``clean`` sent parts to our slice, ``outliers`` left out."""
    return RoundStats(scored_senders=[*outliers, *clean], outlier_senders={p: 0.97 for p in outliers})


def test_an_outlier_in_enough_rounds_in_a_row_is_avoided_and_named_once(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(conduct_module.logger, "warning", warnings.append)
    judge, _ = conduct()
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS - 1):
        judge.judge(round_with(outliers=["X"], clean=["A"]))
        assert not judge.shuns("X")
    judge.judge(round_with(outliers=["X"], clean=["A"]))
    assert judge.shuns("X") and not judge.shuns("A")
    assert judge.shunned() == 1
    why = judge.shunned_peers()["X"]
    assert f"outlier in {AVOID_AFTER_OUTLIER_ROUNDS} rounds in a row" in why
    assert warnings == [f"Avoiding peer X for {AVOID_OUTLIER_S:.0f}s: {why}"]


def test_a_clean_round_with_us_resets_the_count_and_a_round_without_the_peer_does_not():
    judge, _ = conduct()
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS - 1):
        judge.judge(round_with(outliers=["X"]))
    judge.judge(round_with(clean=["X"]))  # it sent to us and was no outlier: judged afresh
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS - 1):
        judge.judge(round_with(outliers=["X"]))
        judge.judge(round_with(clean=["A"]))  # another group, or a θ-mixing round: X's count stays
        judge.judge(RoundStats())
    assert not judge.shuns("X")
    judge.judge(round_with(outliers=["X"]))
    assert judge.shuns("X")


def test_the_avoidance_runs_out_and_the_peer_is_judged_afresh():
    judge, clock = conduct()
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS):
        judge.judge(round_with(outliers=["X"]))
    clock.now += AVOID_OUTLIER_S - 1
    assert judge.shuns("X")
    clock.now += 1
    assert not judge.shuns("X") and judge.shunned() == 0 and judge.shunned_peers() == {}
    judge.judge(round_with(outliers=["X"]))  # its count started again at the avoidance
    assert not judge.shuns("X")


def test_an_outlier_named_without_its_scored_round_still_counts():
    """``outlier_senders`` is a subset of ``scored_senders``; a report that lacks the latter (an older
    averager's stats) still counts its outliers."""
    judge, _ = conduct()
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS):
        judge.judge(RoundStats(outlier_senders={"X": 1.0}))
    assert judge.shuns("X")


@pytest.mark.parametrize("reason, banned", [
    ("sent a part in another codec", True),
    (f"its part's RMS is {SIZE_REASON}", False),  # avoided a while instead
    (f"sent parts at weight 400.0, {WEIGHT_REASON} (100.0)", False),  # the leader may have altered the list: avoided
    ("too slow", False),
    ("did not send all parts", False),
])
def test_protocol_breakers_are_banned_with_their_reason(reason, banned):
    judge, clock = conduct()
    judge.judge(RoundStats(rejected_senders={"B": reason}))
    assert ("B" in judge.banned) is banned
    if banned:
        clock.now += 10 * AVOID_OUTLIER_S
        assert judge.shuns("B") and reason in judge.shunned_peers()["B"]
    elif SIZE_REASON in reason or WEIGHT_REASON in reason:
        assert ("too large" if SIZE_REASON in reason else "not the one gathered") in judge.shunned_peers()["B"]
        clock.now += AVOID_REFUSER_S
        assert not judge.shuns("B")
    else:
        assert not judge.shuns("B")


def test_a_sender_whose_part_was_left_out_as_too_large_is_avoided_a_while_not_banned():
    # a Δ round keeps going without that part (allreduce.py: RoundStats.oversized_senders), the judgement stands
    judge, clock = conduct()
    judge.judge(RoundStats(oversized_senders={"B": f"sent a part with RMS 9, {SIZE_REASON} 1"}))
    assert "B" not in judge.banned and "too large" in judge.shunned_peers()["B"]
    clock.now += AVOID_REFUSER_S
    assert not judge.shuns("B")


def test_shunned_peers_lists_the_banned_then_the_avoided_newest_last():
    judge, _ = conduct()
    judge.judge(RoundStats(failed_reducers={"R": REFUSED_OUR_PART}))
    judge.judge(RoundStats(failed_reducers={"R": REFUSED_OUR_PART}, rejected_senders={"B": "bad codec"}))
    judge.avoid("Y", 60, "a test")
    judge.avoid("R", 600, "again")  # avoided anew, for longer: now the newest
    assert list(judge.shunned_peers()) == ["B", "Y", "R"]
    assert judge.shunned_peers()["R"] == "again"
    judge.avoid("R", 60, "a shorter one")  # a shorter avoidance does not cut a longer one short
    assert judge.shunned_peers()["R"] == "again"
    assert judge.shunned() == 3


def test_the_node_publishes_whom_its_averager_shuns_as_of_its_last_round_with_a_group():
    """conduct -> ``RoundResult.avoided_peers`` (averager.py) -> ``NodeStats`` -> the signed record's
    ``avoided_peers``; a round without an all-reduce (solo) tells nothing, so the last word stays."""
    import time

    from diloco_swarm.averaging.results import RoundResult
    from diloco_swarm.dht.records import normalize_snapshot
    from diloco_swarm.node.stats import NodeStats

    judge, _ = conduct()
    for _ in range(AVOID_AFTER_OUTLIER_ROUNDS):
        judge.judge(round_with(outliers=["X"], clean=["A"]))
    stats = NodeStats()
    members = RoundStats(group_peer_ids=["Me", "A", "X"])
    stats.count_round(RoundResult.of_allreduce(members, avoided=judge.shunned_peers()))
    stats.count_round(RoundResult.solo(time.perf_counter(), "no group formed"))
    record = normalize_snapshot({"peer_id": "Me", **stats.peer_record()}, now=1.0)
    assert record["avoided_peers"] == [{"peer_id": "X", "why": judge.shunned_peers()["X"]}]
    stats.count_round(RoundResult.of_allreduce(RoundStats(group_peer_ids=["Me", "A"]), avoided={}))
    assert normalize_snapshot({"peer_id": "Me", **stats.peer_record()}, now=1.0)["avoided_peers"] == []
