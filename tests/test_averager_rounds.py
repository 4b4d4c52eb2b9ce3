"""Real averagers over 127.0.0.1 (``PseudoGradientAverager``): a client that joins a round beginning
later than its own plan, and the round's average as it arrives (``arrived`` / ``peek``), which the node
previews into θ_local before the round is verified (node/outer_sync.py, ``OuterSync.correct``).

A client (NAT: it dials out only, so it never leads a group). hivemind's leader refuses a follower
whose join request expires before the leader begins (BAD_EXPIRATION_TIME), and a follower asks each
leader declaration once. A client that handed off late for its own plan (its request expiring a few
seconds ahead) was refused by the full peers' next round, which begins at their own scheduled time;
in a 3-node overlap swarm (2 full peers, 1 client) the client then missed every other round: 30 s
windows with "could not find a group", then a download that dropped its Δ, while the full peers
waited for it each time.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from averagerlib import averagers
from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.averaging.request import RoundRequest

SHAPES = [(256, 64), (64,), (64, 32), (32,)]
LEADER_BEGINS_IN_S = 10.0  # the full peers' planned start, well past the client's own plan


def _delta(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=g) for s in SHAPES]


def _averagers(prefix: str, target_group_size: int, clients: tuple[bool, ...], types: tuple[type, ...] = (),
               max_group_size: int | None = None):
    """averagerlib.averagers of :data:`SHAPES`."""
    return averagers(prefix, target_group_size, clients, SHAPES, types, max_group_size=max_group_size)


def test_a_round_request_refuses_inputs_out_of_range_and_gathers_the_settings_its_averager_reads_back():
    from hivemind.utils import MSGPackSerializer

    from diloco_swarm.averaging.matchmaking import round_settings

    base = dict(delta=_delta(0), weight=100, metadata={"outer_step": 4}, timeout=30.0)
    for bad in ({"weight": 0}, {"weight": -1.0}, {"weight": float("nan")}, {"timeout": 0.0},
                {"timeout": float("inf")}, {"digest_wait": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RoundRequest(**{**base, **bad})
    for bad in ({"weight": "100"}, {"metadata": None}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            RoundRequest(**{**base, **bad})
    request = RoundRequest(**base, online_peers=5, group_bits="10", group_size=3, group_cap=4)
    gathered = request.gather()
    assert gathered == {"outer_step": 4, "weight": 100.0, "online_peers": 5, "group_bits": "10", "group_size": 3,
                        "group_cap": 4}
    data = MSGPackSerializer.dumps([0.0, 0, MSGPackSerializer.dumps(gathered)])  # as hivemind's step() sends it
    assert round_settings(data, MSGPackSerializer, default_target=2, max_group_size=8) == ("10", 3, 5, 4)
    assert round_settings(MSGPackSerializer.dumps([0.0, 0, MSGPackSerializer.dumps(RoundRequest(**base).gather())]),
                          MSGPackSerializer, default_target=2, max_group_size=8) == ("", 2, None, 2)


@pytest.mark.timeout(180)
def test_a_client_joins_a_round_that_begins_later_than_its_own_plan():
    # Two full peers plan their round of 3 to begin in 10 s; the client, handing off 1 s later,
    # planned to begin at once (it was late for the round its plan saw). Without the fix the leader
    # refused it, began with the other full peer at its scheduled time, and the client's round failed.
    with _averagers("client-join", 3, (False, False, True)) as averagers:
        results: list = [None] * 3
        started = time.time()

        def run(i: int, scheduled_time: float) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=40.0, scheduled_time=scheduled_time,
                group_size=3))[0]

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


@pytest.mark.timeout(120)
def test_every_tensor_of_the_average_arrives_under_the_rounds_token_with_the_verified_values():
    with _averagers("arrivals", 2, (False, False)) as averagers:
        tokens = [a.begin_arrivals() for a in averagers]
        assert [a.arrived() for a in averagers] == [(t, 0) for t in tokens]  # nothing arrived yet
        results: list = [None, None]

        def run(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=30.0, group_size=2))

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


@pytest.mark.timeout(360)
def test_a_member_a_step_behind_and_one_at_the_newest_step_never_average_in_a_swarm_of_three():
    # The fault-free 3-peer split (docs/decisions.md): peer 0 a step behind met peer 1's round and,
    # next, peer 2's, and two verified averages made two θ_global of one outer step. Every member reads
    # the same gathered steps and refuses that group before any part moves; hivemind's matchmaking
    # then retries within the window, and the round forms once peer 2 (at the newest step) is in.
    with _averagers("step-quorum", 3, (False, False, False)) as averagers:
        results: list = [None] * 3

        def run(i: int, step: int, timeout: float) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={"outer_step": step}, timeout=timeout,
                scheduled_time=time.time(), online_peers=3, group_size=3))[0]

        pair = [threading.Thread(target=run, args=(i, step, 8.0), daemon=True) for i, step in ((0, 3), (1, 4))]
        for t in pair:
            t.start()
        for t in pair:
            t.join(timeout=60.0)
        assert all(r is not None for r in results[:2]), "a round did not end"
        assert not any(r.ok for r in results[:2]), [(r.group_size, r.reason) for r in results[:2]]
        # refused by the rule: "no group that may advance formed (…)", or the refusal itself when the window
        # ran out during hivemind's retry ("the group may not advance: …", CI 2026-12-04)
        assert all("may advance" in r.reason or "may not advance" in r.reason for r in results[:2]), \
            [r.reason for r in results[:2]]

        # the same pair, and peer 2 at the newest step joining 3 s later: a round forms with peer 2 in it.
        # One more try when no round was kept: under load hivemind's matchmaking can drop a member from the
        # group its leader assembled, and the other two then run a partial round (CI, 2026-12-04); the
        # node's next round tries again the same way
        for attempt in range(2):
            results = [None] * 3
            threads = [threading.Thread(target=run, args=(i, step, 30.0), daemon=True) for i, step in ((0, 3), (1, 4))]
            for t in threads:
                t.start()
            time.sleep(3.0)
            threads.append(threading.Thread(target=run, args=(2, 4, 30.0), daemon=True))
            threads[-1].start()
            for t in threads:
                t.join(timeout=90.0)
            assert all(r is not None for r in results), "a round did not end"
            kept = [r for r in results if r.ok]
            if kept:
                break
        assert len(kept) >= 2 and len({r.digest for r in kept}) == 1, [(r.group_size, r.reason) for r in results]
        for r in kept:  # every kept round holds both peers at the newest step
            assert {averagers[1].peer_id.to_base58(), averagers[2].peer_id.to_base58()} <= set(r.group_peer_ids), r


@pytest.mark.timeout(180)
def test_a_late_member_whose_planned_group_already_averaged_stops_waiting_for_it():
    # bench scale, groups of 4: peers 1 and 2 counted peer 0 late and averaged as a pair; peer 0's own
    # plan still held them, and it waited out its whole 30 s window for a group that had run (then the
    # next round's partner waited out its window for peer 0). Their records show a later outer step:
    # peer 0 must stop waiting for them and carry its Δ into the next round.
    window_s = 60.0
    with _averagers("moved-on", 3, (False, False, False)) as averagers:
        ids = [a.peer_id.to_base58() for a in averagers]
        results: list = [None] * 3
        finished: set[str] = set()

        def on_time(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={"outer_step": 4}, timeout=30.0, scheduled_time=time.time(),
                online_peers=3, group_size=2, members=[ids[1 - i]], members_due=time.time()))[0]
            finished.add(ids[i])

        pair = [threading.Thread(target=on_time, args=(i,), daemon=True) for i in (0, 1)]
        for t in pair:
            t.start()
        for t in pair:
            t.join(timeout=60.0)
        assert all(r is not None and r.ok and r.group_size == 2 for r in results[:2]), results[:2]

        started = time.time()
        late = averagers[2].average(RoundRequest(
            delta=_delta(2), weight=100.0, metadata={"outer_step": 4}, timeout=window_s,
            scheduled_time=started + 0.9 * window_s, online_peers=3, group_size=3, members=ids[:2], members_due=started,
            gone=lambda peers: set(), moved_on=lambda peers: {p for p in peers if p in finished}))[0]
        assert not late.ok and late.reason == "the other planned members averaged without us (we were late)", late
        assert time.time() - started < 15.0, "the late member waited for a group that had already averaged"


@pytest.mark.timeout(240)
def test_a_grid_group_whose_members_hand_off_in_two_halves_averages_as_one_group():
    # bench scale, groups of 4: the members of a grid group hand off in two pairs (each pair had just
    # finished a round together); the first pair's leader began when its time was up, the second pair
    # made a group of its own under the same key: two averages, and no crossing of the grid that round.
    # A grid group needs a majority of its planned members (grouping.grid_group_quorum): the first pair
    # keeps looking and the four average once.
    with _averagers("grid-halves", 4, (False,) * 4) as averagers:
        results: list = [None] * 4

        def run(i: int) -> None:
            if i >= 2:
                time.sleep(6.0)  # past the first pair's scheduled time + matchmaking time
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={"outer_step": 4}, timeout=40.0, scheduled_time=time.time(),
                online_peers=8, group_bits="1", group_size=4))[0]

        _on_threads(run, 4, timeout=90.0)
        assert all(r is not None for r in results), "a round did not end"
        assert [r.group_size for r in results] == [4] * 4, [(r.group_size, r.reason) for r in results]
        assert all(r.ok for r in results) and len({r.digest for r in results}) == 1, [r.reason for r in results]


@pytest.mark.timeout(240)
def test_two_minorities_of_a_grid_runs_one_group_round_never_both_advance():
    # A newcomer's grid run (6 peers, --target-group-size 4): its last round, planned under
    # --max-group-size as one group of everyone, ran as a trio and a pair, each planning only the peers
    # it expected; both verified, and the run ended on two models. The quorum was capped at the planned
    # size (2: "any 2 peers") and the step rule skipped rounds with more online peers than the target
    # group size. Under the plan's cap (8 here) a one-group round needs a majority of the online peers at
    # its step: the pair keeps looking and joins the trio, or is refused.
    with _averagers("one-group", 2, (False,) * 5, max_group_size=8) as averagers:
        results: list = [None] * 5

        def run(i: int) -> None:
            if i < 2:
                time.sleep(1.0)  # the trio's leader is in first
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={"outer_step": 9}, timeout=12.0, scheduled_time=time.time(),
                online_peers=5, group_size=2 if i < 2 else 3, group_cap=8))[0]

        _on_threads(run, 5, timeout=90.0)
        assert all(r is not None for r in results), "a round did not end"
        kept = [r for r in results if r.ok]
        assert kept and len({r.digest for r in kept}) == 1, [(r.group_size, r.reason) for r in results]
        assert all(r.group_size >= 3 for r in kept), [(r.group_size, r.reason) for r in results]


@pytest.mark.timeout(120)
def test_a_grid_runs_one_group_plan_of_a_pair_averages_beyond_the_cap():
    # The other side of the test above: mid-run, a grid run (--target-group-size 2) of 6 online peers
    # plans one group when only 2 of them are coming (the others start up or are behind). 6 online peers
    # are more than the plan's cap: the pair is not the whole swarm's round, and may average.
    with _averagers("pair-mid-run", 2, (False,) * 2) as averagers:
        results: list = [None] * 2

        def run(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={"outer_step": 5 + i}, timeout=20.0, scheduled_time=time.time(),
                online_peers=6, group_size=2, group_cap=2))[0]

        _on_threads(run, 2, timeout=60.0)
        assert all(r is not None and r.ok and r.group_size == 2 for r in results), results
        assert results[0].digest == results[1].digest


def _on_threads(run, n: int, timeout: float = 60.0) -> None:
    """``run(i)`` for i in range(n), each on a thread, all joined (each at most ``timeout`` s)."""
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


class FailsOnItsSideOnce(PseudoGradientAverager):
    """Runs its first all-reduce to the end (the others receive every part), then fails on its side:
    a part that arrived too late for it, as seen in ``bench scale`` under load."""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        if not getattr(self, "_failed_once", False):
            self._failed_once = True
            raise RuntimeError("fault: this member's side of the all-reduce failed")


FailsOnItsSideOnce.__name__ = FailsOnItsSideOnce.__qualname__ = PseudoGradientAverager.__name__  # RPC names follow it


@pytest.mark.timeout(120)
def test_a_member_whose_side_of_the_allreduce_failed_says_so_and_the_others_are_late_at_once():
    # bench scale (whole swarm of 8): one member's side of the all-reduce failed and hivemind retried it
    # in a new group, while its 6 partners waited 15 s for its confirmation and each applied its own Δ:
    # 7 θ_global at one outer step. Its "failed" now reaches them in-band at once: they are late alike.
    with _averagers("side-failed", 2, (False, False), types=(FailsOnItsSideOnce,)) as averagers:
        results: list = [None, None]

        def run(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=20.0, scheduled_time=time.time(), group_size=2))

        _on_threads(run, 2)
        (failed, _), (partner, average) = results
        assert not failed.ok, failed
        assert not partner.ok and not partner.maybe_kept and "partial round" in partner.reason, partner
        assert partner.group_size == 2 and partner.seconds < 10.0, partner  # not the 15 s digest wait
        for got, own in zip(average, _delta(1)):  # late: its own Δ comes back, to be carried
            assert torch.equal(got, own)


class ConfirmsLate(PseudoGradientAverager):
    """Confirms its average only after its partner's digest wait ran out (a starved process)."""

    def _cross_check(self, stats, result, digest_wait, stop=None, gone=None):
        time.sleep(CONFIRM_LATE_S)
        return super()._cross_check(stats, result, digest_wait, stop, gone)


ConfirmsLate.__name__ = ConfirmsLate.__qualname__ = PseudoGradientAverager.__name__  # RPC names follow it
CONFIRM_LATE_S = 6.0


@pytest.mark.timeout(120)
def test_a_member_that_missed_a_confirmation_applies_the_average_its_partner_keeps():
    # bench scale (whole swarm of 8): 6 members missed one member's confirmation and each applied its
    # own Δ, while that member kept the average: 7 θ_global at one outer step. A member that heard no
    # contradiction now returns the round's average, the one its partner keeps.
    with _averagers("confirms-late", 2, (False, False), types=(PseudoGradientAverager, ConfirmsLate)) as averagers:
        results: list = [None, None]

        def run(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=20.0, scheduled_time=time.time(), group_size=2,
                digest_wait=3.0 if i == 0 else 30.0))

        _on_threads(run, 2)
        (impatient, average), (late, kept) = results
        assert late.ok, late  # it heard our confirmation: it keeps the average
        assert not impatient.ok and impatient.maybe_kept and "did not confirm" in impatient.reason, impatient
        for got, want in zip(average, kept):
            assert torch.equal(got, want)


class SeesCancelLate(PseudoGradientAverager):
    """Reads its step as live the first time it asks after the node cancelled it, as when the group it
    looked for formed in the same moment (hivemind's ``_step`` then runs that group's all-reduce)."""

    async def _step(self, *, step, future_for_init):
        cancelled, asked = step.cancelled, []

        def cancelled_once_late() -> bool:
            if not asked and step._cancel is not None and step._cancel.done():
                asked.append(True)
                return False
            return cancelled()

        step.cancelled = cancelled_once_late
        return await super()._step(step=step, future_for_init=future_for_init)


SeesCancelLate.__name__ = SeesCancelLate.__qualname__ = PseudoGradientAverager.__name__  # RPC names follow it
GIVE_UP_AFTER_S = 4.0
ROUND_BEGINS_IN_S = 10.0


@pytest.mark.timeout(120)
def test_a_member_that_left_the_round_while_its_group_formed_never_has_its_delta_applied():
    # A NAT test's dumps: a member gave up its round ("the other planned members averaged without
    # us"), yet its averager ran the group's all-reduce 15 s later. The others waited out the digest
    # wait for its confirmation and applied the average holding its Δ, which it carried on into its
    # next round: its Δ counted twice. It now says "failed" in-band: the others are late, on their own Δ.
    with _averagers("left-round", 4, (False, False, False), types=(PseudoGradientAverager,) * 2 + (SeesCancelLate,)) \
            as averagers:
        results: list = [None] * 3
        begins, give_up = time.time() + ROUND_BEGINS_IN_S, threading.Event()

        def run(i: int) -> None:  # a planned group of 4 that only 3 join: the leader waits until it begins
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=25.0, scheduled_time=begins, group_size=4,
                give_up=give_up if i == 2 else None))

        threading.Timer(GIVE_UP_AFTER_S, give_up.set).start()
        _on_threads(run, 3)
        (left, _) = results[2]
        assert not left.ok and left.reason == "no group before the next inner phase ended", left
        for i in (0, 1):
            result, delta = results[i]
            assert result.group_size == 3, result  # the member that left still ran the all-reduce
            assert not result.ok and not result.maybe_kept, result
            for got, own in zip(delta, _delta(i)):  # late: its own Δ comes back, to be carried
                assert torch.equal(got, own)
