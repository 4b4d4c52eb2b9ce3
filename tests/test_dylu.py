"""The first phase of a peer that has not timed an inner step yet: planned H, then re-planned from
its first timed steps and the swarm's records (node/dylu.py: PhasePlanner.replan_first); which
peers' ETAs a round waits for (node/round_policy.py: seconds_to_handoff, plan), and the round's
reads of the swarm (node/round.py, node/swarm_view.py)."""

import math
import time
from types import SimpleNamespace

from diloco_swarm.node import round_policy as policy
from diloco_swarm.node.dylu import PhasePlanner
from diloco_swarm.node.outer_sync import RoundControl
from diloco_swarm.node.round import Round, RoundParts
from diloco_swarm.node.runner import Node
from diloco_swarm.node.swarm_view import SwarmView


def replan(steps, inner_s, swarm_eta=None, swarm_step_s=None, H=100) -> int:
    """DyLU's re-plan of a first phase (H planned before any step was timed)."""
    return PhasePlanner(H).replan_first(steps, inner_s, swarm_eta=swarm_eta, swarm_s=swarm_step_s, now=time.time())[0]


def test_a_slow_newcomer_aims_at_the_swarms_next_hand_off():
    target, eta = PhasePlanner(100).replan_first(10, 1.05, swarm_eta=time.time() + 3.0, swarm_s=0.035,
                                                 now=time.time())  # 0.105 s per step: 3x slower
    assert 32 <= target <= 40  # 10 done + ~29 until the hand-off 3 s ahead (less if this test ran slowly), not H = 100
    assert abs(eta - (time.time() + (target - 10) * 0.105)) < 1.0  # the hand-off time to publish


def test_without_a_hand_off_ahead_it_scales_h_by_speed_and_never_undoes_steps():
    past = time.time() - 5.0
    assert replan(10, 1.05, swarm_eta=past, swarm_step_s=0.035) == 33
    assert replan(60, 6.3, swarm_step_s=0.035) == 60  # past its plan: end now
    assert replan(10, 1.0, swarm_step_s=1.0) == 200  # faster: capped at 2H
    assert replan(10, 1.0) == 100  # nothing known: H
    assert replan(5, 0.5, swarm_eta=time.time() + 0.5) == 25  # ≥ H/4


def test_a_phase_takes_h_scaled_by_the_swarms_speed_over_ours_within_its_range():
    dylu = PhasePlanner(100)
    assert dylu.steps(None, 0.1) == dylu.steps(0.1, None) == 100  # not measured yet: H
    assert dylu.steps(0.2, 0.1) == 50 and dylu.steps(0.1, 1.0) == 200 and dylu.steps(1.0, 0.1) == 25


def test_a_running_swarm_waits_neither_for_a_starting_peer_nor_for_one_that_crashed():
    from diloco_swarm.averaging.grouping import plan_round
    from diloco_swarm.node.round_policy import seconds_to_handoff

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
    view = SwarmView(me="me")
    rec = lambda updated: SimpleNamespace(updated=updated, inner_step_s=0.1, phase_eta=0.0,  # noqa: E731
                                          reachability="public", maddrs=["/ip4/127.0.0.1/tcp/1"])
    view.note({"a": rec(5.0), "b": rec(7.0), "me": rec(1.0)})
    assert sorted(view.recent_peers) == ["a", "b"]  # the peers the DHT should keep (node/redial.py)
    t_first = view.heard["a"][1]
    view.note({"a": rec(5.0), "b": rec(8.0)})  # a: the same record (silent); b: re-signed
    assert view.heard["a"][1] == t_first and view.heard["b"][0] == 8.0
    view.note({"b": rec(9.0)})  # a's record expired from the DHT: still silent since the first read
    assert view.heard["a"][1] == t_first and view.silent_s("a", t_first + 12.0) == 12.0
    assert "a" in view.recent_peers  # gone from the read, still pinged for a while: the DHT may have dropped it


def test_the_start_barrier_counts_peers_whose_records_are_fresh_and_whose_ping_did_not_fail(monkeypatch):
    # Startup._live_peers (--wait-for-peers): a SIGKILLed peer's record stays fresh for up to 15 s, its ping fails
    from diloco_swarm.node import startup

    asked = []

    def gone_peers(dht, peers, **kwargs):
        asked.append((sorted(peers), kwargs.get("banned_is_gone")))
        return {"killed"}

    monkeypatch.setattr(startup, "gone_peers", gone_peers)
    node = SimpleNamespace(swarm=SwarmView(me="me"), records=SimpleNamespace(interval_s=5.0), peer_id="me", dht=None,
                           stop=SimpleNamespace(event=None))
    rec = lambda reachability="public": SimpleNamespace(updated=3.0, inner_step_s=0.0, phase_eta=0.0,  # noqa: E731
                                                        reachability=reachability, maddrs=[])
    node.swarm.heard = {"silent": (3.0, time.monotonic() - 11.0)}  # its record unchanged for over 2 periods
    records = {"me": rec(), "live": rec(), "killed": rec(), "client": rec("client"), "silent": rec()}
    assert startup.Startup._live_peers(node, records) == {"live", "client"}
    # a client serves no DHT calls (its record alone counts); a hung ping is no death, even while banned
    assert asked == [(["killed", "live"], False)]


def make_round(records=None, **parts) -> Round:
    """A :class:`Round` over stand-ins: no DHT, averager or node (``records``: what each read returns)."""
    defaults = dict(cfg=SimpleNamespace(averaging_window=30.0, matchmaking_time=2.0, group_size=64, max_group_size=64,
                                        max_outer_steps=0, initial_peers=[]),
                    run_id="r", organiser=None, peer_id="me", averager=SimpleNamespace(donors=dict), dht=None,
                    records=SimpleNamespace(interval_s=5.0, publish_now=lambda: True),
                    stats=SimpleNamespace(last_round={}, averaging_round=None, ahead_wait_s=0.0), log=print,
                    housekeeping=None, swarm=SwarmView(me="me"),
                    history=SimpleNamespace(resize=lambda n: None), history_floor=0, stop=None, overlap=True,
                    client_mode=False, metadata=lambda handoff: {}, catch_up=None, reconcile=None, mix=None)
    r = Round(RoundParts(**{**defaults, **parts}))
    r.p.housekeeping = r.p.housekeeping or SimpleNamespace(publish_soon=lambda: r.p.records.publish_now())
    if records is not None:
        r._read_records = records if callable(records) else (lambda: records)
    return r


def test_a_late_round_counts_as_moved_on_only_the_members_past_its_round():
    # Round.moved_on: a member whose record shows an outer step past the round averaged it without us,
    # and one looking for a group in a later round will not come to ours. One at the round's step may
    # still come (a behind peer's round is the swarm's, not its own step).
    steps = {"ahead": (6, None), "in-round": (5, None), "behind": (4, None), "later-round": (4, 6)}
    reads = []
    r = make_round(lambda: reads.append(1) or {k: SimpleNamespace(outer_step=s, restarted_below=0, averaging_round=n)
                                               for k, (s, n) in steps.items()})
    assert r.moved_on(["ahead", "in-round", "behind", "later-round", "unknown"], round_no=5) == {"ahead", "later-round"}
    assert r.moved_on(["ahead", "in-round"], round_no=4) == {"ahead", "in-round"}
    assert len(reads) == 1  # read at most every MOVED_ON_READ_EVERY_S

    def fail():
        raise TimeoutError("the DHT did not answer")

    r = make_round(fail)
    assert r.moved_on(["ahead"], round_no=5) == set()  # a failed read finds nobody


def test_a_peer_that_looks_for_a_group_in_the_round_being_planned_is_due_now():
    # In overlap mode a peer in its round already publishes its next phase's hand-off time: read as its
    # ETA, it counted late for the very round it waits in (bench scale, groups of 4: a pair planned
    # without the other pair of its grid group). Its record's averaging_round says where it is.
    now = time.time()
    rec = lambda eta, rnd: SimpleNamespace(outer_step=3, restarted_below=0, phase_eta=eta, averaging_round=rnd,  # noqa: E731
                                           reachability="public")
    far = now + 60.0  # its next phase's end: past any grace window here
    others = {"in-round": rec(far, 3), "elsewhere": rec(far, None), **{f"due{i}": rec(now - 1.0, None) for i in range(3)}}
    cfg = make_round().p.cfg
    planned = policy.plan(3, 4.0, others, me="me", now=now, silent_s={}, max_silent_s=10.0, first_round=False, cfg=cfg)
    assert planned.plan.round_no == 3 and "in-round" in planned.plan.expected and "elsewhere" in planned.plan.late
    assert planned.due < now + 10.0


def test_a_grid_round_ahead_of_the_swarm_waits_until_the_swarm_reaches_its_step():
    # Round._wait_for_swarm: at outer step 4 with four of six peers at 3, it re-reads the records until
    # half the swarm is at 4, naming its round in its record meanwhile; bounded by --averaging-window
    import threading

    rec = lambda step: SimpleNamespace(outer_step=step, restarted_below=0)  # noqa: E731
    reads = [{"me": rec(4), "e": rec(4), "a": rec(3), "b": rec(3), "c": rec(3), "f": rec(3)}] * 2
    reads.append({**reads[0], "a": rec(4)})
    published = []
    r = make_round(lambda: reads.pop(0))
    r.p.records.publish_now = lambda: published.append(r.p.stats.averaging_round)
    control = RoundControl()
    waits: list[float] = []
    control.stop = SimpleNamespace(wait=lambda s: waits.append(s) or False, is_set=lambda: False)
    handoff = SimpleNamespace(outer_step=4, standing=4)
    last = r._wait_for_swarm(handoff, control, reads.pop(0))
    assert last["a"].outer_step == 4 and len(waits) == 2 and published == [4] and r.p.stats.averaging_round is None
    assert r.p.stats.ahead_wait_s > 0

    # not ahead: no read, no wait
    waits.clear()
    assert r._wait_for_swarm(SimpleNamespace(outer_step=3, standing=3), control, last) is None and waits == []

    # bounded: a swarm that never catches up is waited for --averaging-window seconds at most
    r.p.cfg.averaging_window = 0.05
    r._read_records = lambda: {"me": rec(4), "a": rec(3), "b": rec(3)}
    control.stop = threading.Event()
    t0 = time.monotonic()
    r._wait_for_swarm(handoff, control, r._read_records())
    assert time.monotonic() - t0 < 2.0


def _rounder(records: dict, plan, gone: set):
    """A round that reads ``records`` and plans ``plan`` (finding ``gone`` gone), whose averager must
    not be called: :returns: (the round, the calls of _wait_for_swarm, a control)."""
    averager = SimpleNamespace(donors=dict, average=lambda *a, **kw: (_ for _ in ()).throw(
        AssertionError("no round may start")))
    r = make_round(records, averager=averager, swarm=SimpleNamespace(note=lambda recs: None))
    r._plan = lambda handoff, recs: (policy.Planned(plan, time.time()), gone)
    waits = []
    r._wait_for_swarm = lambda handoff, control, recs: waits.append(handoff.outer_step)
    return r, waits, RoundControl()


def test_a_grid_group_whose_other_members_are_all_gone_ends_at_once():
    # A newcomer killed 1 of 6 peers in pairs: its partners' next plans still held it (its record lives
    # on, and the others' grids keep it), the probe found it gone, and each partner sat out its 30 s
    # window under a key nobody else would use, stalling the peers planned with it next
    from diloco_swarm.averaging.grouping import plan_round

    records = {p: SimpleNamespace(outer_step=5, restarted_below=0, reachability="public") for p in ("me", "dead", "a", "b", "c", "d")}
    plan = plan_round(5, {p: 0.0 for p in records}, max_group_size=2)
    partner = [q for q in plan.group_of("me")[1] if q != "me"]
    r, waits, control = _rounder(records, plan, set(partner))
    handoff = SimpleNamespace(outer_step=5, standing=5, delta=[], tokens=1)
    t0 = time.monotonic()
    outcome = r._average(handoff, control)
    assert time.monotonic() - t0 < 1.0
    assert not outcome.result.ok and outcome.result.reason == "the other planned members are gone"
    assert not outcome.alone and outcome.group_key
    assert waits == [5]  # (a grid round checks first whether it is ahead of the swarm)


def test_a_pair_planned_as_one_group_beyond_the_cap_checks_whether_it_is_ahead():
    # A newcomer's kill: with the others late in its plan, a fast pair planned one group of 2 ("r7:all")
    # among 6 online peers and ran 3 steps ahead; only grid plans waited for the swarm
    from diloco_swarm.averaging.grouping import plan_round

    records = {p: SimpleNamespace(outer_step=s, restarted_below=0, reachability="public")
               for p, s in (("me", 7), ("fast", 7), ("a", 6), ("b", 6), ("c", 5), ("d", 5))}
    etas = {"me": 0.0, "fast": 0.0, **{q: float("inf") for q in "abcd"}}
    plan = plan_round(7, etas, max_group_size=2)
    assert len(plan.groups) == 1
    r, waits, control = _rounder(records, plan, set())
    r.p.averager.average = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("stop here"))
    try:
        r._average(SimpleNamespace(outer_step=7, standing=7, delta=[], tokens=1), control)
    except RuntimeError:
        pass
    assert waits == [7]
    # the whole swarm within the cap: the step rule bounds its one group, no wait
    waits.clear()
    within = plan_round(7, etas, max_group_size=64)
    r._plan = lambda handoff, recs: (policy.Planned(within, time.time()), set())
    try:
        r._average(SimpleNamespace(outer_step=7, standing=7, delta=[], tokens=1), control)
    except RuntimeError:
        pass
    assert waits == []
