"""The overlapped outer step (node/outer_sync.py) against a fake averager with injected events.

The fake plays the averaging thread's part: each round's outcome is scripted (a verified group
average, a failed round, a round that keeps looking for a group until told to give up, one that
hangs), in the manner of torchft's ``EventInjector`` and hivemind's fault-tolerance tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from diloco_swarm.node.outer import OuterOptimizer
from diloco_swarm.node.outer_sync import Handoff, OuterSync, RoundControl, RoundOutcome

pytestmark = pytest.mark.timeout(60)


@dataclass
class Result:  # the fields of averaging.results.RoundResult that the sync and the node read
    ok: bool
    group_size: int
    reason: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    maybe_kept: bool = False
    avoided_peers: dict | None = None  # None: no group, the node keeps the peers it last heard of
    group_peer_ids: tuple = ()  # a verified round's members go into the contribution ledger (node/stats.py)
    gathered: dict = field(default_factory=dict)


class FakeAverager:
    """Scripted rounds: ``events[i]`` is what round i does.

    - ``("ok", avg)``: a verified group average ``avg`` (list of tensors);
    - ``("unconfirmed", avg)``: its average ``avg``, confirmed by us, not by every member (``maybe_kept``);
    - ``"fail"``: the group's round fails (others are online: a late round); our own Δ comes back;
    - ``"alone"``: no other peer is online; our own Δ comes back;
    - ``"looking"``: no group until ``give_up`` (then a solo round);
    - ``"hang"``: never returns until ``stop``.
    """

    def __init__(self, events):
        self.events = list(events)
        self.rounds = 0
        self.entered = threading.Event()

    def __call__(self, handoff: Handoff, control: RoundControl) -> RoundOutcome:
        event = self.events[self.rounds]
        self.rounds += 1
        self.entered.set()
        own = [d.clone() for d in handoff.delta]
        if isinstance(event, tuple) and event[0] == "ok":
            return RoundOutcome(Result(True, 2), [a.clone() for a in event[1]])
        if event == "fail":
            return RoundOutcome(Result(False, 2, "partial round"), own)
        if isinstance(event, tuple) and event[0] == "unconfirmed":  # a member was silent and may have kept it
            return RoundOutcome(Result(False, 2, "members did not confirm", maybe_kept=True), [a.clone() for a in event[1]])
        if event == "alone":
            return RoundOutcome(Result(False, 1, "no other peer online"), own, alone=True)
        if event == "looking":
            assert control.give_up.wait(10), "the training thread never gave up the round"
            return RoundOutcome(Result(False, 1, "no group"), own)
        if event == "hang":
            control.stop.wait(30)
            return RoundOutcome(Result(False, 1, "stopping"), own)
        raise AssertionError(event)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


@torch.no_grad()
def inner_phase(params, steps: int = 3, seed: int = 1) -> None:
    """A deterministic stand-in for H inner steps: move each parameter toward a fixed target."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.add_(0.1 * (torch.randn(p.shape, generator=gen) - p))


def handoff(outer: OuterOptimizer, params, step: int = 0) -> Handoff:
    return Handoff(delta=outer.pseudo_gradient(params), tokens=100, inner_steps=3, inner_s=0.1, loss=1.0,
                   outer_step=step, theta_digest="x")


def setup(events, overlap=True):
    m = model()
    params = list(m.parameters())
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9)
    fake = FakeAverager(events)
    return params, outer, fake, OuterSync(outer, params, fake, overlap=overlap)


def clone(ts):
    return [t.detach().clone() for t in ts]


def test_overlap_starts_the_next_phase_from_the_eager_estimate():
    params, outer, fake, sync = setup(["hang"])
    inner_phase(params)
    h = handoff(outer, params)
    expected = outer.preview(h.delta)
    theta_before = clone(outer.theta)
    sync.hand_off(h)
    assert sync.in_flight
    assert all(torch.equal(p, e) for p, e in zip(params, expected))  # θ_local ← θ̂ at once
    assert all(torch.equal(a, b) for a, b in zip(outer.theta, theta_before))  # θ_global waits for the round
    sync.abandon(timeout=5)
    assert not sync.in_flight
    assert all(torch.equal(a, b) for a, b in zip(outer.theta, theta_before))  # a dropped round changes nothing


def test_a_solo_round_costs_nothing():
    """Own Δ applied (a solo round): θ_global lands on θ̂ exactly; the progress since stays."""
    params, outer, fake, sync = setup(["fail"])
    inner_phase(params)
    h = handoff(outer, params)
    sync.hand_off(h)
    estimate = clone(params)
    inner_phase(params, seed=2)  # the next phase trains while the round runs
    before_apply = clone(params)
    handed, outcome, est = sync.take(timeout=5)
    sync.apply(outcome.average, est)
    assert all(torch.equal(t, e) for t, e in zip(outer.theta, estimate))
    assert all(torch.equal(p, b) for p, b in zip(params, before_apply))  # zero correction


def test_a_group_average_is_applied_one_round_late_keeping_local_progress():
    params, outer, _, _ = setup([])
    inner_phase(params)
    h = handoff(outer, params)
    average = [d * 0.5 + 0.01 for d in h.delta]  # the group's Δ̄ differs from ours
    params, outer, fake, sync = setup([("ok", average)])
    inner_phase(params)
    h = handoff(outer, params)
    reference = OuterOptimizer(clone(outer.theta), lr=0.7, momentum=0.9)
    sync.hand_off(h)
    estimate = clone(params)
    inner_phase(params, seed=2)
    progress = [p - e for p, e in zip(params, estimate)]
    _, outcome, est = sync.take(timeout=5)
    sync.apply(outcome.average, est)
    reference.step(average)
    assert all(torch.equal(a, b) for a, b in zip(outer.theta, reference.theta))  # θ_global: the verified average
    for p, theta, prog in zip(params, outer.theta, progress):  # θ_local = θ_global + the progress since hand-off
        torch.testing.assert_close(p - theta, prog, rtol=0, atol=1e-6)
    # the next Δ is relative to the new θ_global: exactly the progress made in this phase
    for d, prog in zip(outer.pseudo_gradient(params), progress):
        torch.testing.assert_close(d, -prog, rtol=0, atol=1e-6)


def _previewed_round(event, preview_values, hold: bool = False):
    """Hand off, train, preview ``preview_values`` (tensor index -> Δ̄ part) mid-phase, train more, then
    apply (or hold) the round. :returns: (θ_global, θ_local, the phase's progress, previews taken)."""
    params, outer, fake, sync = setup([event])
    inner_phase(params)
    h = handoff(outer, params)
    sync.hand_off(h)
    estimate = clone(params)
    inner_phase(params, seed=2)
    moved = [sync.preview_part(i, v) for i, v in preview_values.items()]
    inner_phase(params, seed=3)
    _, outcome, est = sync.take(timeout=5)
    progress = [p - e for p, e in zip(params, est)]  # since the hand-off, previews excluded
    if hold:
        sync.hold(h.delta, est)
    else:
        sync.apply(outcome.average, est)
    return clone(outer.theta), clone(params), progress, moved, h, estimate


def test_a_previewed_average_moves_theta_local_and_the_verified_apply_stays_exact():
    """Parts of the round's average reach θ_local as they arrive (OuterSync.correct); θ_global moves only
    at the verified apply, and θ_local ends where it would without the previews: θ_global + progress."""
    params, outer, _, _ = setup([])
    inner_phase(params)
    average = [d * 0.5 + 0.01 for d in handoff(outer, params).delta]
    plain = _previewed_round(("ok", average), {})
    previewed = _previewed_round(("ok", average), {0: average[0], 2: average[2]})
    assert previewed[3] == [True, True]
    for a, b in zip(plain[0], previewed[0]):  # θ_global: the same verified step
        assert torch.equal(a, b)
    for theta, local, prog in zip(previewed[0], previewed[1], previewed[2]):
        torch.testing.assert_close(local - theta, prog, rtol=0, atol=1e-6)
    # the preview itself: right after it, θ_local[0] stood on OuterStep(θ_global, Δ̄)[0] + progress
    params, outer, fake, sync = setup(["hang"])
    inner_phase(params)
    h = handoff(outer, params)
    sync.hand_off(h)
    inner_phase(params, seed=2)
    before = clone(params)
    eager = outer.preview(h.delta)
    assert sync.preview_part(0, average[0])
    target = outer.preview_tensor(0, average[0])
    torch.testing.assert_close(params[0] - before[0], target - eager[0], rtol=0, atol=1e-6)
    assert torch.equal(params[1], before[1])  # tensors that did not arrive stay
    sync.abandon(timeout=5)


def test_a_previewed_round_that_fails_is_undone_exactly():
    """A late round after previews: θ_global stays, the next Δ is the held Δ plus the progress."""
    params, outer, _, _ = setup([])
    inner_phase(params)
    average = [d * 0.5 + 0.01 for d in handoff(outer, params).delta]
    theta, local, progress, moved, h, _ = _previewed_round("fail", {1: average[1], 3: average[3]}, hold=True)
    assert moved == [True, True]
    for t, l, held, prog in zip(theta, local, h.delta, progress):
        torch.testing.assert_close(t - l, held - prog, rtol=0, atol=1e-6)


def test_a_preview_refuses_non_finite_or_huge_values_and_waits_in_blocking_mode():
    params, outer, _, _ = setup([])
    inner_phase(params)
    average = [d * 0.5 for d in handoff(outer, params).delta]
    bad = {0: torch.full_like(average[0], float("nan")), 1: average[1] * 1e6}
    _, _, _, moved, _, _ = _previewed_round(("ok", average), bad)
    assert moved == [False, False]
    params, outer, fake, sync = setup(["hang"], overlap=False)
    inner_phase(params)
    sync.hand_off(handoff(outer, params))
    before = clone(params)
    assert not sync.preview_part(0, average[0])  # blocking: θ_local waits for the round
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    sync.abandon(timeout=5)


def test_overlap_with_solo_rounds_follows_blocking_exactly():
    """With no group (own Δ every round), overlapped and blocking DiLoCo train the same θ_global."""
    trajectories = {}
    for overlap in (True, False):
        params, outer, fake, sync = setup(["fail"] * 4, overlap=overlap)
        for t in range(4):
            inner_phase(params, seed=t)
            sync.hand_off(handoff(outer, params, t))
            _, outcome, est = sync.take(timeout=5)
            sync.apply(outcome.average, est)
        trajectories[overlap] = clone(outer.theta)
    for a, b in zip(trajectories[True], trajectories[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_held_round_keeps_theta_global_and_carries_delta():
    """A late round: θ_global stays; the next Δ is the held Δ plus the progress made since (overlap),
    or the held Δ itself (blocking: nothing trained since)."""
    for overlap in (True, False):
        params, outer, fake, sync = setup(["fail"], overlap=overlap)
        inner_phase(params)
        h = handoff(outer, params)
        theta_before = clone(outer.theta)
        sync.hand_off(h)
        estimate = clone(params)
        if overlap:
            inner_phase(params, seed=2)
        progress = [p - e for p, e in zip(params, estimate)]
        _, outcome, est = sync.take(timeout=5)
        sync.hold(h.delta, est)
        assert all(torch.equal(a, b) for a, b in zip(outer.theta, theta_before))
        for d, held, prog in zip(outer.pseudo_gradient(params), h.delta, progress):
            torch.testing.assert_close(d, held - prog, rtol=0, atol=1e-6)


def test_an_adopted_state_keeps_local_progress_and_carries_delta_only_when_asked():
    for carry in (False, True):
        params, outer, fake, sync = setup(["fail"])
        inner_phase(params)
        h = handoff(outer, params)
        sync.hand_off(h)
        estimate = clone(params)
        inner_phase(params, seed=2)
        progress = [p - e for p, e in zip(params, estimate)]
        _, _, est = sync.take(timeout=5)
        theta = [t + 0.5 for t in outer.theta]
        momentum = [torch.full_like(t, 0.25) for t in outer.theta]
        sync.adopt(theta, momentum, h.delta, est, carry=carry)
        assert all(torch.equal(a, b) for a, b in zip(outer.theta, theta))
        assert all(torch.equal(a, b) for a, b in zip(outer.momentum_buffers(), momentum))
        for p, t, prog, d in zip(params, theta, progress, h.delta):  # θ_local = θ_global + progress (− Δ)
            torch.testing.assert_close(p - t, prog - d if carry else prog, rtol=0, atol=1e-6)


def bare_node(events, overlap=True):
    """A :class:`Node` with only what applying a round reads: θ_global, the sync, the counters
    (no model, DHT or averager); its round records are (outer step, late, tokens) tuples."""
    from diloco_swarm.node.global_state import GlobalState, ThetaHistory
    from diloco_swarm.node.mixing import ThetaMixer
    from diloco_swarm.node.runner import Node
    from diloco_swarm.node.stats import NodeStats

    params, outer, fake, sync = setup(events, overlap=overlap)
    node = Node.__new__(Node)
    node.params, node.sync, node.stats, node.peer_id, node._unsent_tokens = params, sync, NodeStats(), "me", 0
    node.state = GlobalState(outer, lock=threading.Lock(), history=ThetaHistory(), marks=node.stats.theta_marks)
    node.state.digest = lambda: f"step {node.state.step}"
    node.mixer = ThetaMixer(node.state, averager=None, peer_id="me", stats=node.stats, supported_step=lambda: 0,
                            log=print)
    node.cfg, node._carried, node.records, node.feedback = SimpleNamespace(), None, [], None
    node._after_round = lambda h, result, step, during, late=False: node.records.append((step, late, h.tokens))
    return node


def one_outer_step(node, seed: int) -> None:
    """An inner phase of 100 tokens, the hand-off, and the round applied after the next phase's training."""
    inner_phase(node.params, seed=seed)
    node.sync.hand_off(node._phase_handoff(tokens=100, steps=3, inner_s=1.0, loss=1.0))
    if node.sync.overlap:
        inner_phase(node.params, seed=seed + 100)
    node._apply_round(wait=True, timeout=5)


def test_a_late_peer_keeps_its_lineage_and_folds_its_delta_into_the_next_round():
    """Decoupled DiLoCo's late fragments (arXiv 2604.21428): a round that forms no verified group
    while others are online leaves θ_global and the outer step alone, and the next round's Δ and
    weight carry its work; nothing is wasted."""
    node = bare_node(["fail", ("ok", [torch.zeros_like(p) for p in model().parameters()])])
    theta0 = clone(node.state.outer.theta)
    one_outer_step(node, seed=1)
    assert node.outer_step == 0 and all(torch.equal(a, b) for a, b in zip(node.state.outer.theta, theta0))
    assert node.records == [(0, True, 100)] and node.stats.late_rounds == 1 and node.stats.tokens_total == 0
    assert node._carried.rounds == 1 and node._carried.tokens == 100 and node._carried.inner_s == 1.0
    one_outer_step(node, seed=2)
    assert node.outer_step == 1 and node.records[-1] == (1, False, 200)  # weighted by both phases' tokens
    assert node.stats.tokens_total == 200 and node._carried is None and node.stats.wasted_inner_s == 0


def test_late_rounds_are_bounded_then_applied_alone():
    node = bare_node(["fail"] * 4)
    for t in range(4):
        one_outer_step(node, seed=t)
    assert [(step, late) for step, late, _ in node.records] == [(0, True), (0, True), (1, False), (1, True)]
    assert node.records[2][2] == 300 and node.stats.tokens_total == 300 and node._carried.tokens == 100


def test_a_peer_alone_steps_at_once():
    node = bare_node(["alone"])
    one_outer_step(node, seed=1)
    assert node.outer_step == 1 and node.records == [(1, False, 100)] and node._carried is None


def test_a_round_another_member_may_have_kept_is_applied_never_carried():
    """Carrying a Δ that a member's kept average already holds would apply it twice: the node applies
    the round's average (what the averager returns for an unconfirmed round), as that member did."""
    average = [torch.full_like(p, 0.5) for p in model().parameters()]
    node = bare_node([("unconfirmed", average)])
    expected = clone(node.state.outer.preview(average))  # θ_global after one outer step on that average
    one_outer_step(node, seed=1)
    assert node.outer_step == 1 and node.records == [(1, False, 100)] and node._carried is None
    for got, want in zip(node.state.outer.theta, expected):
        torch.testing.assert_close(got, want)


def test_overlap_with_late_rounds_follows_blocking_exactly():
    """Held rounds then an own-Δ step: overlapped and blocking DiLoCo land on the same θ_global."""
    trajectories = {}
    for overlap in (True, False):
        node = bare_node(["fail"] * 3 + ["alone"], overlap=overlap)
        for t in range(4):
            inner_phase(node.params, seed=t)
            node.sync.hand_off(node._phase_handoff(tokens=100, steps=3, inner_s=1.0, loss=1.0))
            node._apply_round(wait=True, timeout=5)
        assert node.outer_step == 2
        trajectories[overlap] = clone(node.state.outer.theta)
    for a, b in zip(trajectories[True], trajectories[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_giving_up_matchmaking_ends_the_round_as_solo():
    params, outer, fake, sync = setup(["looking"])
    inner_phase(params)
    sync.hand_off(handoff(outer, params))
    assert fake.entered.wait(5)
    time.sleep(0.2)
    assert not sync.done()  # still looking for a group
    sync.give_up_matchmaking()
    _, outcome, _ = sync.take(timeout=5)
    assert outcome.result.group_size == 1


def test_a_hung_round_does_not_hold_the_node_at_stop():
    params, outer, fake, sync = setup(["hang"])
    inner_phase(params)
    sync.hand_off(handoff(outer, params))
    assert fake.entered.wait(5)
    with pytest.raises(TimeoutError):
        sync.take(timeout=0.2)
    assert sync.in_flight  # a timed-out wait leaves the round in flight
    t0 = time.monotonic()
    sync.abandon(timeout=2)
    assert time.monotonic() - t0 < 3


def test_one_round_at_a_time():
    params, outer, fake, sync = setup(["hang"])
    sync.hand_off(handoff(outer, params))
    with pytest.raises(RuntimeError, match="in flight"):
        sync.hand_off(handoff(outer, params))
    sync.abandon(timeout=2)
    with pytest.raises(RuntimeError, match="no round"):
        sync.take(timeout=0)


def test_a_mixed_state_is_adopted_with_its_outer_step_keeping_local_progress():
    """θ-mixing (node/mixing.py): the group's mixed θ_global, momentum and outer step replace ours;
    θ_local keeps the progress made since the hand-off; the earlier θ_global stays as a reference."""
    from diloco_swarm.node.global_state import ThetaHistory
    from diloco_swarm.node.mixing import MixedState

    node = bare_node([])
    node.state.history = ThetaHistory(keep=3)
    inner_phase(node.params, seed=1)
    h = node._phase_handoff(tokens=100, steps=3, inner_s=1.0, loss=1.0)
    theta0 = clone(node.state.outer.theta)
    mixed = MixedState(theta=[t + 0.25 for t in theta0], momentum=[torch.full_like(t, 0.5) for t in theta0],
                       outer_step=4, digest="ab" * 8, reference_step=0)
    node.sync.run_round = lambda handoff, control: RoundOutcome(Result(True, 2), [d.clone() for d in handoff.delta],
                                                               mixed=mixed, group_key="r0:d0:g0")
    node.sync.hand_off(h)
    estimate = clone(node.params)
    inner_phase(node.params, seed=2)
    progress = [p - e for p, e in zip(node.params, estimate)]
    node._apply_round(wait=True, timeout=5)
    # the round's record keeps the step it averaged (its synced_to says where the mix took us)
    assert node.outer_step == 4 and node.records == [(1, False, 100)] and node.stats.mixed_rounds == 1
    assert all(torch.equal(a, b) for a, b in zip(node.state.outer.theta, mixed.theta))
    assert all(torch.equal(a, b) for a, b in zip(node.state.outer.momentum_buffers(), mixed.momentum))
    for p, t, prog in zip(node.params, mixed.theta, progress):
        torch.testing.assert_close(p - t, prog, rtol=0, atol=1e-6)
    assert node.state.history.states() == [(0, "step 0")]
    assert all(torch.equal(a, b) for a, b in zip(node.state.history.get((0, "step 0")), theta0))
    assert node.stats.theta_marks[-1] == (4, "ab" * 8) and node.stats.state_syncs == 0



@pytest.mark.parametrize("kind", ["lagging", "mixed", "diverged"])
def test_an_outer_step_record_names_the_step_of_the_state_whose_digest_it_carries(kind):
    """Issue 39: a joiner handed off at outer step 0, then adopted the swarm's state of step 2 with the
    round; its ``outer_step`` record said step 1 (the hand-off's step + 1) with step 2's digest. A
    record's step and digest are now read from the same θ_global: the adopted state's (mixed or
    downloaded, any step); ``synced_to`` says a state moved us off the step the round produced."""
    from diloco_swarm.averaging.results import RoundResult
    from diloco_swarm.node.mixing import MixedState
    from diloco_swarm.node.outer_sync import Preview

    node = bare_node([])
    written = []
    node._after_round = lambda h, outcome, step, during, late=False: written.append(node._round_record(h, outcome, step))
    node.peer_id, node.reachability, node._preview = "me", "public", Preview()
    node.spec = SimpleNamespace(sync_mode="overlap", compression="int8")
    to = {"lagging": 2, "mixed": 4, "diverged": 1}[kind]
    adopted = [t + 0.5 for t in node.state.outer.theta]

    def adopt(state, handoff, estimate, carry):  # statesync.adopt's move, without a download
        with node.state.moving_to(to):
            node.sync.adopt(adopted, [torch.zeros_like(t) for t in adopted], handoff.delta, estimate, carry=carry)

    node.state_sync = SimpleNamespace(adopt=adopt)
    mixed = MixedState(theta=adopted, momentum=[torch.zeros_like(t) for t in adopted], outer_step=to,
                       digest="ab" * 8, reference_step=0) if kind == "mixed" else None
    state = SimpleNamespace(includes_round=kind == "lagging") if kind != "mixed" else None
    node.sync.run_round = lambda handoff, control: RoundOutcome(
        RoundResult(ok=kind != "diverged", group_size=2), [d.clone() for d in handoff.delta], state=state, mixed=mixed)
    one_outer_step(node, seed=1)  # handed off at outer step 0
    record = written[-1]
    assert node.outer_step == to and record["outer_step"] == to
    assert record["theta_digest"] == node.state.digest() == f"step {to}"  # (bare_node's digest names the step)
    assert record["synced_to"] == (None if to == 1 else to)  # the round alone produced step 1
