"""The first phase of a peer that has not timed an inner step yet: planned H, then re-planned from
its first timed steps and the swarm's records (Node._replan_first_phase, node/runner.py); and which
peers' ETAs a round waits for (node/runner.py: seconds_to_handoff)."""

import math
import time
from types import SimpleNamespace

from diloco_swarm.node.runner import Node


def peer(swarm_eta=None, swarm_step_s=None, H=100) -> Node:
    """A node with only what DyLU's planning reads (no model, DHT or averager)."""
    p = Node.__new__(Node)
    p.spec, p.swarm_phase_eta, p.swarm_inner_step_s = SimpleNamespace(inner_steps=H), swarm_eta, swarm_step_s
    p.min_inner_steps, p.max_inner_steps, p.stats = H // 4, 2 * H, SimpleNamespace(phase_eta=0.0)
    return p


def test_a_slow_newcomer_aims_at_the_swarms_next_hand_off():
    p = peer(swarm_eta=time.time() + 3.0, swarm_step_s=0.035)
    target = p._replan_first_phase(steps=10, inner_s=1.05)  # 0.105 s per step: 3x slower
    assert 32 <= target <= 40  # 10 done + ~29 until the hand-off 3 s ahead (less if this test ran slowly), not H = 100
    assert abs(p.stats.phase_eta - (time.time() + (target - 10) * 0.105)) < 1.0  # published


def test_without_a_hand_off_ahead_it_scales_h_by_speed_and_never_undoes_steps():
    past = time.time() - 5.0
    assert peer(swarm_eta=past, swarm_step_s=0.035)._replan_first_phase(steps=10, inner_s=1.05) == 33
    assert peer(swarm_step_s=0.035)._replan_first_phase(steps=60, inner_s=6.3) == 60  # past its plan: end now
    assert peer(swarm_step_s=1.0)._replan_first_phase(steps=10, inner_s=1.0) == 200  # faster: capped at 2H
    assert peer()._replan_first_phase(steps=10, inner_s=1.0) == 100  # nothing known: H
    assert peer(swarm_eta=time.time() + 0.5)._replan_first_phase(steps=5, inner_s=0.5) == 25  # ≥ H/4


def test_a_running_swarm_waits_neither_for_a_starting_peer_nor_for_one_that_crashed():
    from diloco_swarm.averaging.grouping import plan_round
    from diloco_swarm.node.runner import seconds_to_handoff

    now, quiet = 1000.0, dict(silent_s=1.0, max_silent_s=10.0)
    assert seconds_to_handoff(0.0, now, **quiet) == math.inf  # starting up: not waited for...
    assert seconds_to_handoff(0.0, now, first_round=True, **quiet) == 0.0  # ...but in our own first round
    assert seconds_to_handoff(now - 2.0, now, **quiet) == -2.0  # handed off: in matchmaking now
    assert seconds_to_handoff(now - 20.0, now, **quiet) == -20.0  # alive (its record changes): in a long round
    assert seconds_to_handoff(now + 3.0, now, **quiet) == 3.0
    assert seconds_to_handoff(now + 3.0, now, silent_s=12.0, max_silent_s=10.0) == math.inf  # crashed
    etas = {"me": 0.0, "b": seconds_to_handoff(now - 1.0, now, **quiet), "starting": seconds_to_handoff(0.0, now, **quiet),
            "gone": seconds_to_handoff(now + 1.0, now, silent_s=30.0, max_silent_s=10.0)}
    plan = plan_round(5, etas, grace_s=3.0)
    assert plan.group_of("me")[1] == ("b", "me")  # the round's group: it starts once both are in


def test_a_record_that_stops_changing_counts_as_silent_from_the_first_read_of_it():
    p = Node.__new__(Node)
    p._heard, p._recent_peers, p.swarm_inner_step_s, p.swarm_phase_eta, p.peer_id = {}, {}, None, None, "me"
    rec = lambda updated: SimpleNamespace(updated=updated, inner_step_s=0.1, phase_eta=0.0,  # noqa: E731
                                          reachability="public", maddrs=["/ip4/127.0.0.1/tcp/1"])
    p._note_swarm({"a": rec(5.0), "b": rec(7.0), "me": rec(1.0)})
    assert sorted(p._recent_peers) == ["a", "b"]  # the peers the DHT should keep (node/redial.py)
    t_first = p._heard["a"][1]
    p._note_swarm({"a": rec(5.0), "b": rec(8.0)})  # a: the same record (silent); b: re-signed
    assert p._heard["a"][1] == t_first and p._heard["b"][0] == 8.0
    p._note_swarm({"b": rec(9.0)})  # a's record expired from the DHT: still silent since the first read
    assert p._heard["a"][1] == t_first and p._silent_s("a", t_first + 12.0) == 12.0
    assert "a" in p._recent_peers  # gone from the read, still pinged for a while: the DHT may have dropped it


def test_a_late_round_counts_as_moved_on_only_the_members_past_its_round():
    # Node._moved_on: a member whose record shows an outer step past the round averaged it without us,
    # and one looking for a group in a later round will not come to ours. One at the round's step may
    # still come (a behind peer's round is the swarm's, not its own step).
    p = Node.__new__(Node)
    steps = {"ahead": (6, None), "in-round": (5, None), "behind": (4, None), "later-round": (4, 6)}
    reads = []
    p._moved_on_read = (float("-inf"), {})
    p._read_records = lambda: reads.append(1) or {k: SimpleNamespace(outer_step=s, averaging_round=r)
                                                  for k, (s, r) in steps.items()}
    assert p._moved_on(["ahead", "in-round", "behind", "later-round", "unknown"], round_no=5) == {"ahead", "later-round"}
    assert p._moved_on(["ahead", "in-round"], round_no=4) == {"ahead", "in-round"}
    assert len(reads) == 1  # read at most every MOVED_ON_READ_EVERY_S

    def fail():
        raise TimeoutError("the DHT did not answer")

    p._moved_on_read, p._read_records = (float("-inf"), {}), fail
    assert p._moved_on(["ahead"], round_no=5) == set()  # a failed read finds nobody


def test_a_peer_that_looks_for_a_group_in_the_round_being_planned_is_due_now(monkeypatch):
    # In overlap mode a peer in its round already publishes its next phase's hand-off time: read as its
    # ETA, it counted late for the very round it waits in (bench scale, groups of 4: a pair planned
    # without the other pair of its grid group). Its record's averaging_round says where it is.
    import diloco_swarm.node.runner as runner_mod

    monkeypatch.setattr(runner_mod, "gone_peers", lambda *a, **kw: set())
    p = Node.__new__(Node)
    now = time.time()
    rec = lambda eta, rnd: SimpleNamespace(outer_step=3, phase_eta=eta, averaging_round=rnd,  # noqa: E731
                                           reachability="public")
    far = now + 60.0  # its next phase's end: past any grace window here
    p._grid_records = {"in-round": (time.monotonic(), rec(far, 3)), "elsewhere": (time.monotonic(), rec(far, None)),
                       **{f"due{i}": (time.monotonic(), rec(now - 1.0, None)) for i in range(3)}}
    p.cfg = SimpleNamespace(averaging_window=30.0, matchmaking_time=2.0, group_size=64, max_outer_steps=0,
                            max_group_size=64)
    p.stats, p.records, p._heard = SimpleNamespace(last_round={}), SimpleNamespace(interval_s=5.0), {}
    p.peer_id, p.dht, p.stop = "me", None, SimpleNamespace(event=None)
    handoff = SimpleNamespace(outer_step=3, inner_s=4.0)
    plan, due, gone = p._plan_round(handoff, {})
    assert plan.round_no == 3 and "in-round" in plan.expected and "elsewhere" in plan.late, plan
    assert due < now + 10.0 and gone == set()


def test_a_grid_round_ahead_of_the_swarm_waits_until_the_swarm_reaches_its_step():
    # Node._wait_for_swarm: at outer step 4 with four of six peers at 3, it re-reads the records until
    # half the swarm is at 4, naming its round in its record meanwhile; bounded by --averaging-window
    import threading

    from diloco_swarm.node.outer_sync import RoundControl

    rec = lambda step: SimpleNamespace(outer_step=step)  # noqa: E731
    reads = [{"me": rec(4), "e": rec(4), "a": rec(3), "b": rec(3), "c": rec(3), "f": rec(3)}] * 2
    reads.append({**reads[0], "a": rec(4)})
    p = Node.__new__(Node)
    p.peer_id, p.cfg = "me", SimpleNamespace(averaging_window=30.0)
    p.stats, published = SimpleNamespace(averaging_round=None, ahead_wait_s=0.0), []
    p.records = SimpleNamespace(publish_now=lambda: published.append(p.stats.averaging_round))
    p._housekeeping = SimpleNamespace(submit=lambda fn: fn())
    p._read_records = lambda: reads.pop(0)
    control = RoundControl()
    waits: list[float] = []
    control.stop = SimpleNamespace(wait=lambda s: waits.append(s) or False, is_set=lambda: False)
    handoff = SimpleNamespace(outer_step=4)
    last = p._wait_for_swarm(handoff, control, reads.pop(0))
    assert last["a"].outer_step == 4 and len(waits) == 2 and published == [4] and p.stats.averaging_round is None
    assert p.stats.ahead_wait_s > 0

    # not ahead: no read, no wait
    waits.clear()
    assert p._wait_for_swarm(SimpleNamespace(outer_step=3), control, last) is None and waits == []

    # bounded: a swarm that never catches up is waited for --averaging-window seconds at most
    p.cfg.averaging_window = 0.05
    p._read_records = lambda: {"me": rec(4), "a": rec(3), "b": rec(3)}
    control.stop = threading.Event()
    t0 = time.monotonic()
    p._wait_for_swarm(handoff, control, p._read_records())
    assert time.monotonic() - t0 < 2.0


def _rounder(records: dict, plan, gone: set):
    """A node whose _average reads ``records`` and plans ``plan`` (finding ``gone`` gone), with no
    averager: :returns: (the node, the calls of _wait_for_swarm)."""
    from diloco_swarm.node.outer_sync import RoundControl

    p = Node.__new__(Node)
    p.peer_id, p.client_mode, p._warned_no_public = "me", False, False
    p.cfg = SimpleNamespace(max_outer_steps=0, averaging_window=30.0, matchmaking_time=2.0)
    p.sync = SimpleNamespace(overlap=True)
    p.averager = SimpleNamespace(donors=lambda: {}, average=lambda *a, **kw: (_ for _ in ()).throw(
        AssertionError("no round may start")))
    p._read_records, p._note_swarm = (lambda: records), (lambda r: None)
    p._plan_round = lambda handoff, recs: (plan, time.time(), gone)
    waits = []
    p._wait_for_swarm = lambda handoff, control, recs: waits.append(handoff.outer_step)
    return p, waits, RoundControl()


def test_a_grid_group_whose_other_members_are_all_gone_ends_at_once():
    # A newcomer killed 1 of 6 peers in pairs: its partners' next plans still held it (its record lives
    # on, and the others' grids keep it), the probe found it gone, and each partner sat out its 30 s
    # window under a key nobody else would use, stalling the peers planned with it next
    from diloco_swarm.averaging.grouping import plan_round

    records = {p: SimpleNamespace(outer_step=5, reachability="public") for p in ("me", "dead", "a", "b", "c", "d")}
    plan = plan_round(5, {p: 0.0 for p in records}, max_group_size=2)
    partner = [q for q in plan.group_of("me")[1] if q != "me"]
    p, waits, control = _rounder(records, plan, set(partner))
    handoff = SimpleNamespace(outer_step=5, delta=[], tokens=1)
    t0 = time.monotonic()
    result, average, alone, key = p._average(handoff, control)
    assert time.monotonic() - t0 < 1.0
    assert not result.ok and result.reason == "the other planned members are gone" and not alone and key
    assert waits == [5]  # (a grid round checks first whether it is ahead of the swarm)


def test_a_pair_planned_as_one_group_beyond_the_cap_checks_whether_it_is_ahead():
    # A newcomer's kill: with the others late in its plan, a fast pair planned one group of 2 ("r7:all")
    # among 6 online peers and ran 3 steps ahead; only grid plans waited for the swarm
    from diloco_swarm.averaging.grouping import plan_round

    records = {p: SimpleNamespace(outer_step=s, reachability="public")
               for p, s in (("me", 7), ("fast", 7), ("a", 6), ("b", 6), ("c", 5), ("d", 5))}
    etas = {"me": 0.0, "fast": 0.0, **{q: float("inf") for q in "abcd"}}
    plan = plan_round(7, etas, max_group_size=2)
    assert len(plan.groups) == 1
    p, waits, control = _rounder(records, plan, set())
    p.averager.average = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("stop here"))
    p._round_metadata = lambda handoff: {}
    p.history, p._history_floor = SimpleNamespace(resize=lambda n: None), 0
    p.stats = SimpleNamespace(averaging_round=None)
    try:
        p._average(SimpleNamespace(outer_step=7, delta=[], tokens=1), control)
    except RuntimeError:
        pass
    assert waits == [7]
    # the whole swarm within the cap: the step rule bounds its one group, no wait
    waits.clear()
    within = plan_round(7, etas, max_group_size=64)
    p._plan_round = lambda handoff, recs: (within, time.time(), set())
    try:
        p._average(SimpleNamespace(outer_step=7, delta=[], tokens=1), control)
    except RuntimeError:
        pass
    assert waits == []
