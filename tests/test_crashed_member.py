"""Members that crash mid-round: after the all-reduce, before confirming the average; and before
joining a group they were planned into. Real averagers over 127.0.0.1.

A crash (the whole peer: its p2p daemon dies with it) makes its ping fail at once. The survivors
must not wait out the digest wait meant for slow members (``bench.churn``: two survivors waited
15 s each, then dropped the round). The crash is SIGKILL of the member's averager process, its DHT
process and their p2pd, as ``bench.churn`` kills whole peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest
import torch

from diloco_swarm.averaging.allreduce import ConsensusAllReduceRunner
from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.averaging.request import RoundRequest
from diloco_swarm.dht.swarm import start_dht, visible_maddrs
from diloco_swarm.node.redial import gone_peers
from swarmlib import process_tree

SHAPES = [(1024, 256), (256,)]
SLOW_MEMBER_S = 120.0  # the time bounds for slow members in these tests: a survivor that waits them out fails
SURVIVORS_DONE_WAIT_S = 30.0  # the crashing member waits this long at most for the survivors' all-reduce


def _crash(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ReachesCrossCheck(PseudoGradientAverager):
    """A survivor: says when its all-reduce is done and checked (it begins the digest cross-check)."""

    all_reduce_done: list[threading.Event] = []  # one per survivor, in creation order

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._done = threading.Event()
        ReachesCrossCheck.all_reduce_done.append(self._done)

    def _cross_check(self, stats, result, digest_wait, stop=None, gone=None):
        self._done.set()
        return super()._cross_check(stats, result, digest_wait, stop, gone)


class CrashAfterAllReduce(PseudoGradientAverager):
    """Crashes (its averager process, its DHT process and their p2pd) once the all-reduce is done on
    every member, before confirming the average. Its own all-reduce ends when it holds every averaged
    part, which may be before its averaged part reached the others (CI saw that: a partial round,
    which no member may keep, so not this case); it waits for the survivors, bounded."""

    crash_pids: list[int] = []

    def _cross_check(self, stats, result, digest_wait, stop=None, gone=None):
        for done in ReachesCrossCheck.all_reduce_done:
            done.wait(SURVIVORS_DONE_WAIT_S)
        _crash([self.pid, *self.crash_pids])
        return "crashed"


for cls in (ReachesCrossCheck, CrashAfterAllReduce):
    cls.__name__ = cls.__qualname__ = PseudoGradientAverager.__name__  # RPC names follow it


def _delta(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=g) for s in SHAPES]


@contextlib.contextmanager
def _peers(n: int):
    """``n`` DHTs on 127.0.0.1 (the others bootstrap from the first) and a list for their averagers;
    all are shut down at the end (a crashed one quietly)."""
    dhts = [start_dht(initial_peers=[], host="127.0.0.1", port=0)]
    dhts += [start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0) for _ in range(n - 1)]
    averagers: list = []
    try:
        yield dhts, averagers
    finally:
        for part in averagers:
            with contextlib.suppress(Exception):
                part.shutdown()
        for dht in dhts:
            dht.shutdown()


def _three_averagers(dhts, averagers: list, prefix: str, third: type | None = PseudoGradientAverager) -> None:
    """A and B, then C of type ``third`` (None: no averager for C), for groups of 3, with time bounds
    for slow members that a survivor fails if it waits them out."""
    kwargs = dict(prefix=prefix, target_group_size=3, matchmaking_time=3.0,
                  allreduce_timeout=SLOW_MEMBER_S, next_chunk_timeout=SLOW_MEMBER_S / 2)
    ReachesCrossCheck.all_reduce_done = []
    averagers += [ReachesCrossCheck([torch.zeros(s) for s in SHAPES], dht, **kwargs) for dht in dhts[:2]]
    if third is not None:
        averagers.append(third([torch.zeros(s) for s in SHAPES], dhts[2], **kwargs))


def _gone(dht):
    """The node's probe for gone members (``Round.gone_members``, node/round.py), through ``dht``."""
    return lambda peers: gone_peers(dht, peers, banned_is_gone=False)


def _start_round_of_three(dhts, averagers, results: list, ended: list) -> list[threading.Thread]:
    """A, B and C average once, each on a thread; A and B with the gone probe. Fills ``results`` (3)
    and, for A and B, ``ended`` (time.monotonic())."""

    def run(i: int) -> None:
        results[i] = averagers[i].average(RoundRequest(
            delta=_delta(i), weight=100.0, metadata={}, timeout=30.0, digest_wait=SLOW_MEMBER_S, group_size=3,
            gone=_gone(dhts[i]) if i < 2 else None))[0]
        if i < 2:
            ended[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    return threads


def _round_of_three(crashing: type):
    """Survivors A and B and the failing member C average once; returns (A's and B's results, C)."""
    with _peers(3) as (dhts, averagers):
        CrashAfterAllReduce.crash_pids = process_tree(dhts[2].pid)  # C's DHT process and its p2pd
        _three_averagers(dhts, averagers, "crashed-member", crashing)
        results, ended = [None] * 3, [None] * 2
        threads = _start_round_of_three(dhts, averagers, results, ended)
        deadline = time.monotonic() + SLOW_MEMBER_S
        for t in threads[:2]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert results[0] is not None and results[1] is not None, "a survivor waited out the bound for slow members"
        return results[:2], averagers[2]


@pytest.mark.timeout(240)
def test_survivors_keep_a_round_whose_member_crashed_before_confirming():
    (a, b), crashed = _round_of_three(CrashAfterAllReduce)
    crashed_id = crashed.peer_id.to_base58()
    assert a.group_size == b.group_size == 3, (a.reason, b.reason)
    assert a.ok and b.ok, (a.reason, b.reason)
    assert a.digest == b.digest  # one average kept by both survivors
    assert a.gone_peers == b.gone_peers == [crashed_id]
    assert a.agreed_peers == b.agreed_peers == 1


@pytest.mark.timeout(240)
def test_a_forming_group_begins_without_a_planned_member_that_crashed():
    # C was planned into the round (its record said it would hand off now) and crashed before it
    # joined. The survivors must begin once they find it gone past its due time, not at the round's
    # scheduled time (bench.churn: 4 s rounds after a kill, at every kill that fell in matchmaking).
    scheduled_in_s = 60.0
    with _peers(3) as (dhts, averagers):
        _three_averagers(dhts, averagers, "planned-member-crashed", third=None)  # C is only planned
        crashed_id = dhts[2].peer_id.to_base58()
        ids = [a.peer_id.to_base58() for a in averagers]
        results: list = [None] * 2
        _crash(process_tree(dhts[2].pid))  # C's DHT process and its p2pd
        started = time.time()

        def run(i: int) -> None:
            results[i] = averagers[i].average(RoundRequest(
                delta=_delta(i), weight=100.0, metadata={}, timeout=scheduled_in_s + 30.0, group_size=3,
                scheduled_time=started + scheduled_in_s, members=[ids[1 - i], crashed_id], members_due=started,
                gone=_gone(dhts[i])))[0]

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=scheduled_in_s + 60.0)
        a, b = results
        assert a is not None and b is not None, "a survivor's round did not end"
        assert a.ok and b.ok, (a.reason, b.reason)
        assert a.group_size == b.group_size == 2 and a.digest == b.digest
        # began long before the scheduled time (without the probe: at it, after 60 s)
        assert a.seconds < scheduled_in_s / 2 and b.seconds < scheduled_in_s / 2, (a.seconds, b.seconds)


@pytest.mark.timeout(240)
def test_a_round_whose_only_planned_partner_crashed_ends_at_once():
    # Two peers: the partner was planned in and crashed. Without it nobody is left: the round must not
    # wait out its 60 s window (training waits for a round once its next phase reached its longest).
    with _peers(2) as (dhts, averagers):
        crashed_id = dhts[1].peer_id.to_base58()
        averager = PseudoGradientAverager([torch.zeros(s) for s in SHAPES], dhts[0], prefix="partner-crashed",
                                          target_group_size=2, matchmaking_time=3.0)
        averagers.append(averager)
        _crash(process_tree(dhts[1].pid))
        started = time.time()
        result = averager.average(RoundRequest(
            delta=_delta(0), weight=100.0, metadata={}, timeout=60.0, group_size=2, scheduled_time=started + 50.0,
            members=[crashed_id], members_due=started, gone=_gone(dhts[0])))[0]
        assert not result.ok and result.reason == "the other planned members are gone", result.reason
        assert time.time() - started < 15.0


def _stall_then_crash_round(tmp_path):
    """A, B and C average; C hangs in the all-reduce before it sends a part, then crashes (SIGKILL of
    its averager process, its DHT process and their p2pd). :returns: A's and B's results, C's peer id,
    seconds from the crash to the survivors' last result."""
    marker = tmp_path / "stalled"

    class StallingRunner(ConsensusAllReduceRunner):
        async def _generate_input_for_peer(self, peer_index: int):
            marker.touch()
            await asyncio.sleep(3600)  # hangs before its first part: the others wait for it as a sender
            yield  # (an async generator)

    class Stalling(PseudoGradientAverager):
        async def _run_consensus(self, runner_type, *args, **kwargs):
            if runner_type is ConsensusAllReduceRunner:  # the round's all-reduce
                runner_type = StallingRunner
            await super()._run_consensus(runner_type, *args, **kwargs)

    Stalling.__name__ = Stalling.__qualname__ = PseudoGradientAverager.__name__  # RPC names follow it
    with _peers(3) as (dhts, averagers):
        _three_averagers(dhts, averagers, "stalled-member", Stalling)
        results, ended = [None] * 3, [None] * 2
        threads = _start_round_of_three(dhts, averagers, results, ended)
        deadline = time.monotonic() + 60.0
        while not marker.exists():
            assert time.monotonic() < deadline, "C never reached its all-reduce"
            time.sleep(0.05)
        time.sleep(0.5)  # the survivors are waiting on C's streams now
        _crash([averagers[2].pid, *process_tree(dhts[2].pid)])
        crashed_at = time.monotonic()
        for t in threads[:2]:
            t.join(timeout=SLOW_MEMBER_S)
        assert results[0] is not None and results[1] is not None, "a survivor waited out the bound for slow members"
        return results[0], results[1], averagers[2].peer_id.to_base58(), max(ended) - crashed_at


@pytest.mark.timeout(300)
def test_survivors_stop_waiting_for_a_member_that_crashed_mid_allreduce(tmp_path):
    # C sent no part, so the survivors average without it: ended long before hivemind's sender
    # timeout (60 s here; without the watch they waited it out), agreeing, and C is known gone
    a, b, crashed_id, seconds = _stall_then_crash_round(tmp_path)
    assert seconds < SLOW_MEMBER_S / 4, seconds
    assert a.ok and b.ok and a.digest == b.digest, (a.reason, b.reason)
    assert a.gone_peers == b.gone_peers == [crashed_id]
