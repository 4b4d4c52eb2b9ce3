"""The canonical state after a round whose members started from different θ_global
(``node/canonical.py: canonical_state``): every member, each with its own view of the swarm's
signed records, must choose the same one, or the group keeps verifying rounds while its members
stay on separate lineages."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from types import SimpleNamespace

import torch

from diloco_swarm.averaging.mixing import standing
from diloco_swarm.node.canonical import Evidence, canonical_state, gather_evidence
from diloco_swarm.node.global_state import GlobalState, ThetaHistory
from diloco_swarm.node.outer import OuterOptimizer
from diloco_swarm.node.statesync import DownloadedState, StateSync


def d(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()[:16]


def record(peer: str, step: int, marks: list[tuple[int, str]], reachability: str = "public", restarted_below: int = 0):
    """A verified record entry as ``read_peer_entries`` returns it (owner key = the peer's name)."""
    rec = SimpleNamespace(peer_id=peer, outer_step=step, reachability=reachability, restarted_below=restarted_below, paused=None,
                          theta_marks=[SimpleNamespace(step=s, digest=g) for s, g in marks])
    return SimpleNamespace(owner=f"key-{peer}", record=rec)


def choices(states: dict[str, tuple[int, str]], marks: dict[str, list[tuple[int, str]]],
            clients: frozenset[str] = frozenset()) -> dict[str, tuple[int, str]]:
    """Each member's canonical state, each from its own evidence (records of every peer, itself as ``me``)."""
    entries = [record(p, states[p][0], marks[p]) for p in states]
    donors = {p for p in states if p not in clients}
    return {me: canonical_state(states, me, gather_evidence(entries, me, states[me][0], marks[me]), donors,
                                can_donate=me not in clients)[:2]
            for me in states}


def test_a_member_alone_ahead_follows_the_others_and_they_all_agree():
    # "a" applied a round alone (its group's digest went unconfirmed): one step ahead of everyone, on
    # a lineage of its own. Each member trusts its own state, so without a shared cap "a" kept its own
    # and the others theirs, forever (the chaos test: 600 verified rounds of 4 on 2+ lineages).
    x, y = d("x"), d("y")
    states = {"a": (47, d("a-solo")), "b": (46, x), "c": (46, x), "d": (45, y)}
    marks = {"a": [(45, y), (46, x), (47, d("a-solo"))], "b": [(45, y), (46, x)], "c": [(45, y), (46, x)],
             "d": [(44, d("w")), (45, y)]}
    chosen = choices(states, marks)
    assert set(chosen.values()) == {(46, x)}, chosen


def test_in_a_pair_the_member_ahead_leads():
    states = {"a": (10, d("a")), "b": (9, d("b"))}
    marks = {"a": [(9, d("b")), (10, d("a"))], "b": [(9, d("b"))]}
    assert set(choices(states, marks).values()) == {(10, d("a"))}


def test_one_member_claiming_far_ahead_is_not_followed():
    honest = d("honest")
    states = {"a": (12, honest), "b": (12, honest), "h": (1012, d("forged"))}
    marks = {"a": [(12, honest)], "b": [(12, honest)], "h": [(1012, d("forged"))]}
    assert set(choices(states, marks).values()) == {(12, honest)}


def test_two_lineages_at_one_step_resolve_the_same_way_for_every_member():
    states = {"a": (20, d("p")), "b": (20, d("p")), "c": (20, d("q")), "e": (20, d("q"))}
    marks = {p: [(19, d("r")), s] for p, s in states.items()}
    assert len(set(choices(states, marks).values())) == 1


def test_a_restarted_lineage_stands_behind_the_state_it_could_not_download_until_it_passes_it():
    # b's join could not download a's state at outer step 8 (a asleep): b trained from θ_0 owing 8 steps
    # (restarted_below). At outer step 12 it stands at 4: a, woken at 8, keeps its state, and so does
    # every member's choice; past 16 b's lineage stands further and wins, as any newer state does
    for b_step, winner in ((12, "a"), (17, "b")):
        states = {"a": (8, d("a")), "b": (b_step, d("b"))}
        marks = {"a": [(8, d("a"))], "b": [(b_step, d("b"))]}
        entries = [record("a", 8, marks["a"]), record("b", b_step, marks["b"], restarted_below=8)]
        debts = {"a": 0, "b": 8}
        chosen = {me: canonical_state(states, me, gather_evidence(entries, me, states[me][0], marks[me], debts[me]),
                                      set(states), can_donate=True, restarts={"b": 8})[:2]
                  for me in states}
        assert set(chosen.values()) == {states[winner]}, (b_step, chosen)
        # the records back b's standing, not its outer step: a never catches up to b at 12; b catches up to a
        assert gather_evidence(entries, "a", 8, marks["a"]).supported_step == standing(b_step, 8)
        assert gather_evidence(entries, "b", b_step, marks["b"], 8).supported_step == 8


def test_a_claimed_debt_buys_nothing():
    x = d("x")
    # a donor claiming outer step 1008 owing 1000 stands at 8 like the swarm, but its outer step is backed by
    # no other record: refused (else it would pass the vouching at a step nobody holds, and move ours far ahead)
    entries = [record("a", 8, [(8, x)]), record("b", 8, [(8, x)])]
    assert "outer step 1008 is ahead" in gather_evidence(entries, "me", 8, [(8, x)]).accepts(1008, d("forged"), 1000)
    # a member claiming the majority's state with a large debt does not lower that state for the others
    states = {"a": (8, x), "b": (8, x), "h": (8, x), "c": (8, d("y"))}
    entries = [record(p, 8, [states[p]]) for p in states]
    chosen = {me: canonical_state(states, me, gather_evidence(entries, me, 8, [states[me]]), set(states),
                                  can_donate=True, restarts={"h": 10 ** 6}) for me in "abc"}
    assert set(chosen.values()) == {(8, x, 0)}, chosen
    # a trained restarted lineage never stands below a fresh start from θ_0: a later joiner takes its state
    assert [standing(k, 50) for k in (0, 1, 2, 3)] == [0, 1, 1, 2]
    assert gather_evidence([record("j1", 3, [(3, d("j1"))], restarted_below=50)], "j2", 0, []).supported_step == 2


def test_a_state_only_a_client_holds_is_not_canonical():
    # a client cannot donate its state: the newest state is then one a public member holds
    states = {"a": (8, d("a")), "b": (8, d("a")), "c": (9, d("client"))}
    marks = {"a": [(8, d("a"))], "b": [(8, d("a"))], "c": [(9, d("client"))]}
    assert set(choices(states, marks, clients=frozenset({"c"})).values()) == {(8, d("a"))}



def test_one_peer_ahead_is_not_backed_while_a_newcomer_is_online():
    # A trained alone to step 5, B and C start at once: for B, A's step needs a second owner. C at 0
    # could be an honest newcomer or a swarm restarting; trusting A alone here is what let a peer
    # claiming 1000 steps ahead lead the honest peers at a swarm's start (test_hostile_state.py). B
    # catches up at its first round with A instead (a lagging download).
    entries = [record("A", 5, [(5, d("a5"))]), record("C", 0, [])]
    assert gather_evidence(entries, "B", 0, []).supported_step == 0


def test_a_client_is_never_asked_for_a_state_download():
    # A lagging peer picks donors from the records: a client (it serves no state) holding the newest
    # step was asked first and failed ("could not connect to it"), a newcomer's finding.
    entries = [record("A", 6, [(6, d("x6"))]), record("C", 6, [(6, d("x6"))], reachability="client"),
               record("B", 6, [(6, d("x6"))])]
    evidence = gather_evidence(entries, "L", 2, [])
    assert evidence.supported_step == 6
    assert set(evidence.donors_at(6)) == {"A", "B"}


def test_only_a_peer_late_for_the_last_round_takes_the_swarms_final_state():
    # StateSync.catch_up: one step behind is normal (the next round brings the peer along), except at the
    # end of a planned run, where no next round comes: the peer would end alone on its own θ_global.
    from diloco_swarm.node.canonical import Evidence
    from diloco_swarm.node.statesync import StateSync

    p = StateSync.__new__(StateSync)
    p.cfg = SimpleNamespace(max_outer_steps=4)
    asked = []
    p.download = lambda **kw: asked.append(kw) or "the final state"
    swarm_at_4 = Evidence(supported_step=4, holders_by_step={4: {"x"}})
    assert p.catch_up(3, swarm_at_4) is None  # its last round is still to run: it may be in it
    assert p.catch_up(3, swarm_at_4, then=4) is None  # its verified last round brings it to the end too
    assert p.catch_up(3, swarm_at_4, then=3) == "the final state"  # late for the last round
    assert asked == [{"min_step": 4, "reason": "lagging", "candidates": ["x"]}]
    p.cfg.max_outer_steps = 10
    assert p.catch_up(3, swarm_at_4, then=3) is None  # not the end: it meets the next round
    p.cfg.max_outer_steps = 0
    assert p.catch_up(3, swarm_at_4, then=3) is None  # no planned end
    assert p.catch_up(2, swarm_at_4) == "the final state"  # two steps behind: lagging, as before


def test_after_its_one_canonical_download_a_finisher_follows_only_a_strict_majority():
    # StateSync.end_on_one_model: a newcomer's grid run ended with five peers on one θ_global and the
    # sixth alone on the state they had just left (each had judged the canonical state a moment apart).
    from diloco_swarm.node.canonical import majority_holders

    five_left_us = {"a": "B", "b": "B", "c": "B", "d": "B", "e": "B"}
    assert sorted(majority_holders(five_left_us, same=0)) == ["a", "b", "c", "d", "e"]
    assert majority_holders({"a": "B"}, same=0) == []  # a pair that swapped: 1 of 2 is no majority, no swap back
    assert majority_holders({"a": "B", "b": "C", "c": "B"}, same=1) == []  # 2 of 5
    assert majority_holders({"a": "B", "b": "B", "c": "B"}, same=1) == ["a", "b", "c"]  # 3 of 5
    assert majority_holders({}, same=3) == []


def _finisher(monkeypatch, reads: list[dict[str, str]], first_choice: list[str]):
    """A node at its planned end (outer step 10, holding "X") whose DHT reads return ``reads`` in turn
    (peer -> the digest it holds at step 10, or its (outer step, digest)) and whose canonical judgement
    picks ``first_choice``;
    :returns: (the node, the candidates of each diverged download it made)."""
    import diloco_swarm.node.statesync as statesync_mod
    from collections import deque

    from diloco_swarm.node.statesync import StateSync
    from diloco_swarm.node.swarm_view import SwarmView

    seen: list[dict[str, str]] = []

    def entries():
        seen.append(reads.pop(0) if len(reads) > 1 else reads[0])
        view = seen[-1]
        marks = {p: v if isinstance(v, tuple) else (10, v) for p, v in view.items()}
        return [SimpleNamespace(owner=f"key-{p}", record=SimpleNamespace(
            peer_id=p, outer_step=step, updated=1.0, reachability="public", restarted_below=0, paused=None,
            theta_marks=[SimpleNamespace(step=step, digest=g)])) for p, (step, g) in marks.items()]

    monkeypatch.setattr(statesync_mod, "read_peer_entries", lambda dht, run_id, organiser=None: entries())
    monkeypatch.setattr(statesync_mod, "gone_peers", lambda *a, **kw: set())
    clock = [0.0]  # seconds; each wait between reads advances it
    monkeypatch.setattr(statesync_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    p = StateSync.__new__(StateSync)
    held, downloads = ["X"], []
    p.client_mode, p.peer_id = False, "me"
    p.state = SimpleNamespace(step=10, restarted_below=0, standing=10, digest=lambda: held[0], marks=deque())
    p.swarm = SwarmView(me="me")
    p.stop = SimpleNamespace(requested=False, event=SimpleNamespace(wait=lambda s: clock.__setitem__(0, clock[0] + s)))
    p.stats = SimpleNamespace(phase_eta=1.0)
    p.records = SimpleNamespace(publish_now=lambda: True, interval_s=5.0)
    p.spec, p.dht, p.log = SimpleNamespace(run_id="r", organiser=None), None, lambda line: None
    p._holders_of_canonical = lambda others, mine, evidence: [q for q in first_choice if q in others]

    def sync_state(*, min_step, reason, candidates, attempts):
        downloads.append(sorted(candidates))
        held[0] = seen[-1][candidates[0]]  # the digest its holder showed in the read that chose it
        return True

    p.download_and_adopt, p.evaluate_now = sync_state, lambda: None
    return p, held, downloads


def test_a_finisher_that_judged_a_moment_before_the_others_follows_them(monkeypatch):
    # The newcomer's run: we (on X) judged Y canonical (p0 and p1 held it), while p0 and p1 judged X
    # and downloaded it; four of five then hold X and we hold Y: we follow them once more.
    p, held, downloads = _finisher(monkeypatch, [
        {"p0": "Y", "p1": "Y", "p3": "X", "p4": "X"},
        {"p0": "X", "p1": "X", "p3": "X", "p4": "X"},
        {"p0": "X", "p1": "X", "p3": "X", "p4": "X"},
    ], first_choice=["p0", "p1"])
    p.end_on_one_model()
    assert downloads == [["p0", "p1"], ["p0", "p1", "p3", "p4"]] and held == ["X"]


def test_two_finishers_that_swapped_states_do_not_swap_back(monkeypatch):
    p, held, downloads = _finisher(monkeypatch, [{"a": "Y"}, {"a": "X"}], first_choice=["a"])
    p.end_on_one_model()
    assert downloads == [["a"]] and held == ["Y"]  # 1 of 2 is no majority: it leaves on Y, as before


def test_a_finisher_that_said_it_waits_for_a_peer_behind_says_when_the_wait_ends(monkeypatch):
    # A newcomer's demo: "1 peer is still behind" was the last line, beside a summary with every peer at the end.
    p, _, _ = _finisher(monkeypatch, [{"a": (9, "W")}, {"a": "X"}], first_choice=[])
    lines = []
    p.log = lines.append
    p.end_on_one_model()
    assert lines[0].startswith("1 peer is still behind (outer step 9)")
    assert lines[1:] == ["no peer left to wait for: leaving"]

    p, _, _ = _finisher(monkeypatch, [{"a": (9, "W")}], first_choice=[])  # it never catches up
    lines.clear()
    p.log = lines.append
    p.end_on_one_model()
    assert len(lines) == 2 and lines[1].startswith("leaving after 120s with 1 peer not on this final state")


def test_a_joiner_whose_download_failed_owes_the_steps_it_could_not_download_and_an_adopted_state_clears_it():
    lines = []
    p = StateSync.__new__(StateSync)
    p.cfg, p.stop, p.log = SimpleNamespace(initial_peers=["x"]), SimpleNamespace(requested=False), lines.append
    p.averager = SimpleNamespace(donors=lambda: {"x": 8.0})
    p.evidence = lambda: Evidence(supported_step=8, holders_by_step={8: {"x"}})
    p.download_and_adopt = lambda **kw: False  # the donor fell asleep mid-download
    p.state = SimpleNamespace(step=0, restarted_below=0, standing=0)
    p.join()
    assert p.state.restarted_below == 8 and "on a new lineage that owes the 8 outer steps" in lines[-1], lines
    # a restarted node, its checkpoint on the swarm's lineage at outer step 3, owes the 5 after it
    p.state = SimpleNamespace(step=3, restarted_below=0, standing=3)
    p.join()
    assert p.state.restarted_below == 5, lines
    # adopting a state takes its debt: the donor's metadata, 0 when absent
    state = GlobalState(OuterOptimizer([torch.zeros(3)]), lock=threading.Lock(), history=ThetaHistory(), marks=deque())
    state.restarted_below = 8
    p.state, p.params = state, [torch.zeros(3)]
    p.stats = SimpleNamespace(state_syncs=0, sync_s=0.0)
    p.metrics, p.peer_id = SimpleNamespace(write=lambda r: None), "me"
    new = [torch.ones(3), torch.zeros(3)]
    p.adopt(DownloadedState(donor="x", meta={"outer_step": 9, "theta_digest": state.digest()}, tensors=new,
                            received=24, seconds=0.1, reason="lagging"))
    assert (state.step, state.restarted_below, state.standing) == (9, 0, 9)
