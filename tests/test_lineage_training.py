"""A lineage carries its training (``lineage_tokens``: tokens trained into θ_global since θ_0), and a
node never adopts a state with less behind it than its own, whatever its outer step (issue 37,
item 4: a joiner whose download failed while its donor slept restarted from θ_0, made more solo
outer steps than the founder had, and the founder, woken, caught up with that scratch lineage).

Pure rules here (node/canonical.py, averaging/mixing.py, statesync's choices from record sets);
the swarm test with real nodes and SIGSTOP/SIGCONT is tests/test_lineage_swarm.py.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from diloco_swarm.averaging.mixing import applied_lineage_tokens, mixed_lineage_tokens, plan_mix, round_tokens
from diloco_swarm.dht.lineages import MAX_LINEAGE_TOKENS, lineage_tokens_of, tokens_text
from diloco_swarm.dht.records import PeerRecord, normalize_snapshot
from diloco_swarm.node.canonical import (Evidence, canonical_state, gather_evidence, lineage_problem,
                                         record_lineage_problem)


def d(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()[:16]


def entry(peer: str, step: int, lineage: object, marks: list[tuple[int, str]] | None = None):
    """A verified record entry as ``read_peer_entries`` returns it (owner key = the peer's name)."""
    rec = SimpleNamespace(peer_id=peer, outer_step=step, reachability="public", lineage_tokens=lineage,
                          theta_marks=[SimpleNamespace(step=s, digest=g) for s, g in marks or [(step, d(peer))]])
    return SimpleNamespace(owner=f"key-{peer}", record=rec)


# ------------------------------------------------------------------ the claim and the rule
@pytest.mark.parametrize("value", [None, "9800000", 1.5e6, True, -1, MAX_LINEAGE_TOKENS + 1, [3], {"a": 1}])
def test_a_missing_or_malformed_lineage_claim_is_no_evidence(value):
    assert lineage_tokens_of(value) is None
    assert lineage_problem(value, 9_800_000) is None  # no evidence: the outer-step rules decide alone


def test_more_outer_steps_with_less_training_are_refused_and_more_training_is_adopted():
    assert lineage_problem(6_100_000, 9_800_000) == "6.1M tokens behind it, ours 9.8M"
    assert lineage_problem(9_800_000, 9_800_000) is not None  # equal: not more, not adopted
    assert lineage_problem(9_800_001, 9_800_000) is None
    assert lineage_problem(0, 0) is not None  # a scratch state never replaces another scratch state
    assert [tokens_text(n) for n in (950, 61_440, 6_100_000, 2 * 10**9)] == ["950", "61.4k", "6.1M", "2.0G"]


def test_records_carry_the_claim_bounded_and_an_older_peers_record_without_it_still_reads():
    base = {"peer_id": "QmA", "outer_step": 4, "tokens_total": 10}
    assert normalize_snapshot(base, now=1.0)["lineage_tokens"] is None
    assert normalize_snapshot({**base, "lineage_tokens": 9_800_000}, now=1.0)["lineage_tokens"] == 9_800_000
    assert normalize_snapshot({**base, "lineage_tokens": -5}, now=1.0)["lineage_tokens"] == 0
    assert normalize_snapshot({**base, "lineage_tokens": float("nan")}, now=1.0)["lineage_tokens"] == 0
    assert normalize_snapshot({**base, "lineage_tokens": 10**30}, now=1.0)["lineage_tokens"] == MAX_LINEAGE_TOKENS
    record = normalize_snapshot(base, now=1.0)
    del record["lineage_tokens"]  # an older peer's record: the field absent
    assert PeerRecord.parse_obj(record).lineage_tokens is None
    with pytest.raises(ValueError):
        PeerRecord.parse_obj({**record, "lineage_tokens": "9800000"})  # strict: the schema refuses a string


# ------------------------------------------------------------------ catch-up: the founder that slept
def state_sync(lineage_tokens: int, evidence: Evidence, max_outer_steps: int = 0):
    """A StateSync with only what ``catch_up`` reads; its downloads and lines are recorded."""
    from diloco_swarm.node.statesync import StateSync

    p = StateSync.__new__(StateSync)
    p.cfg = SimpleNamespace(max_outer_steps=max_outer_steps)
    p.state, p._refused_lineages = SimpleNamespace(lineage_tokens=lineage_tokens, step=4), set()
    p.asked, p.lines = [], []
    p.download = lambda **kw: p.asked.append(kw) or "a state"
    p.log = p.lines.append
    p.evidence = lambda: evidence
    return p


def test_a_founder_refuses_a_scratch_lineage_at_a_newer_outer_step_and_says_so_once():
    # A: outer step 4, 9.8M tokens behind θ_global. B restarted from θ_0 and made 6 solo steps of
    # 6.1M tokens in all: two steps "ahead", the old rule caught up with it.
    evidence = gather_evidence([entry("B", 6, 6_100_000)], "A", 4, [(4, d("A"))])
    assert evidence.supported_step == 6 and evidence.lineage["B"] == (6, 6_100_000)
    p = state_sync(9_800_000, evidence)
    assert p.catch_up(4) is None and p.catch_up(4) is None and p.asked == []
    assert p.lines == ["not adopting peer B's state at outer step 6: 6.1M tokens behind it, ours 9.8M "
                       "(a lineage with less training, e.g. restarted from the initial weights)"]


def test_a_lagging_peer_still_catches_up_with_a_more_trained_state_or_one_that_says_nothing():
    more = gather_evidence([entry("B", 6, 12_000_000)], "A", 4, [(4, d("A"))])
    p = state_sync(9_800_000, more)
    assert p.catch_up(4) == "a state" and p.asked == [{"min_step": 6, "reason": "lagging", "candidates": ["B"]}]
    older = gather_evidence([entry("B", 6, None)], "A", 4, [(4, d("A"))])  # a record without the claim
    p = state_sync(9_800_000, older)
    assert p.catch_up(4) == "a state" and p.lines == []
    # of two donors at the newest step, only the one with more training behind it is asked
    both = gather_evidence([entry("B", 6, 6_100_000), entry("C", 6, 12_000_000)], "A", 4, [(4, d("A"))])
    p = state_sync(9_800_000, both)
    assert p.catch_up(4) == "a state" and p.asked[0]["candidates"] == ["C"] and len(p.lines) == 1


def downloading(lineage_tokens: int, evidence: Evidence, served: dict):
    """A StateSync whose averager serves ``served`` (peer -> state metadata) and whose checks pass."""
    from diloco_swarm.node.statesync import StateSync

    p = StateSync.__new__(StateSync)
    p.state = SimpleNamespace(theta=[torch.zeros(2)], lineage_tokens=lineage_tokens)
    p.peer_id, p._refused_lineages, p.lines = "A", set(), []
    p.stop = SimpleNamespace(requested=False, event=None)
    p.averager = SimpleNamespace(download_state=lambda peer, **kw: (served[peer], [], 0))
    p._check = lambda meta, tensors, min_step: None
    p.evidence, p.log = (lambda: evidence), p.lines.append
    return p


def test_a_downloaded_state_is_judged_by_its_own_claim_and_its_claim_must_match_its_record():
    evidence = Evidence(supported_step=6, lineage={"B": (6, 6_100_000), "C": (5, 12_000_000)})
    meta = lambda step, tokens: {"outer_step": step, "theta_digest": d(f"{step}"), "lineage_tokens": tokens}  # noqa: E731
    # B's record said 6.1M at step 6; its state says 20M at step 6: a lie, refused like a bad digest
    p = downloading(9_800_000, evidence, {"B": meta(6, 20_000_000)})
    assert p.download(min_step=6, reason="lagging", candidates=["B"]) is None
    assert "differ from its signed record's (6100000) at outer step 6" in p.lines[0]
    assert record_lineage_problem(evidence, "C", 6, 1) is None  # C's record is at step 5: it may just lag
    # a state whose own claim is no more than ours is refused, unless it is a round's canonical state
    p = downloading(9_800_000, evidence, {"C": meta(6, 9_000_000)})
    assert p.download(min_step=6, reason="lagging", candidates=["C"]) is None and "9.0M tokens behind" in p.lines[0]
    p = downloading(9_800_000, evidence, {"C": meta(6, 9_000_000)})
    assert p.download(min_step=6, reason="diverged", candidates=["C"], at_any_training=True).donor == "C"


def test_a_resumed_node_with_more_training_does_not_join_a_scratch_swarm():
    from diloco_swarm.node.statesync import StateSync

    p = StateSync.__new__(StateSync)
    p.cfg = SimpleNamespace(initial_peers=["/ip4/127.0.0.1/tcp/1"])
    p.stop = SimpleNamespace(requested=False)
    p.averager = SimpleNamespace(donors=lambda: {"B": 6.0})
    p.state, p._refused_lineages, p.lines = SimpleNamespace(lineage_tokens=9_800_000, step=4), set(), []
    p.evidence = lambda: gather_evidence([entry("B", 6, 6_100_000)], "A", 4, [(4, d("A"))])
    p.log, p.download_and_adopt = p.lines.append, lambda **kw: pytest.fail("downloaded a less trained state")
    p.join()
    assert len(p.lines) == 1 and p.lines[0].startswith("not adopting peer B's state at outer step 6")


# ------------------------------------------------------------------ a round of the two lineages
def test_the_members_of_a_round_pick_the_more_trained_lineage_whatever_its_outer_step():
    a4, b6 = (4, d("A4")), (6, d("B6"))
    states = {"A": a4, "B": b6}
    trained = {"A": 9_800_000, "B": 6_100_000}
    for me, other in (("A", "B"), ("B", "A")):
        evidence = gather_evidence([entry(other, states[other][0], trained[other])], me, states[me][0], [states[me]])
        assert canonical_state(states, me, evidence, {"A", "B"}, can_donate=True, lineage=trained) == a4
    # equal training (or none said): today's order, the newest step first
    for lineage in ({"A": 5, "B": 5}, {}, {"A": "x", "B": None}):
        evidence = gather_evidence([entry("A", 4, None)], "B", 6, [b6])
        assert canonical_state(states, "B", evidence, {"A", "B"}, can_donate=True, lineage=lineage) == b6


def meta(step: int, digest: str, *marks, lineage=None, weight=100.0) -> dict:
    return {"outer_step": step, "theta_digest": digest, "marks": [list(m) for m in marks],
            "lineage_tokens": lineage, "weight": weight}


def test_a_more_trained_member_behind_the_round_step_is_not_mixed_onto_a_lesser_lineage():
    # The pair's round step is the member ahead's: A, behind, would get weight 0 and B's θ_global.
    theta0 = (0, d("theta0"))
    gathered = {"A": meta(4, d("A4"), theta0, lineage=9_800_000), "B": meta(6, d("B6"), theta0, lineage=6_100_000)}
    assert plan_mix(gathered) is None  # the caller compares them: A's is canonical
    gathered["A"]["lineage_tokens"] = 1_000  # behind and less trained: a late peer, mixed in as before
    plan = plan_mix(gathered)
    assert plan is not None and plan.weights == {"A": 0.0, "B": 1.0}
    assert plan.lineage_tokens == 6_100_000 + 200  # the most trained member's, plus the round's tokens
    gathered["A"]["lineage_tokens"], gathered["B"]["lineage_tokens"] = 9_800_000, None  # B says nothing
    assert plan_mix(gathered) is not None  # no evidence against B: mixed as before


def test_a_rounds_tokens_are_its_members_weights_and_garbage_counts_nothing():
    gathered = {"A": {"weight": 640.0}, "B": {"weight": 2560}, "C": {"weight": "9e99"}, "D": {"weight": float("nan")},
                "E": {"weight": True}, "F": "not a dict", "G": {"weight": -5.0}, "H": {"weight": 1e30}}
    assert round_tokens(gathered) == 3200
    assert mixed_lineage_tokens({"A": {"weight": 10, "lineage_tokens": 7}, "B": {"weight": 5, "lineage_tokens": "9"}}) == 22
    assert mixed_lineage_tokens({p: {"weight": 1e18, "lineage_tokens": MAX_LINEAGE_TOKENS} for p in "AB"}) \
        == MAX_LINEAGE_TOKENS


def test_an_applied_round_adds_the_groups_tokens_and_a_solo_step_our_own():
    from diloco_swarm.averaging.mixing import lineage_after_round

    handoff = SimpleNamespace(tokens=640, theta_digest=d("x"))
    group = SimpleNamespace(gathered={"A": {"weight": 640.0, "theta_digest": d("x"), "lineage_tokens": 1_000},
                                      "B": {"weight": 2560.0, "theta_digest": d("x"), "lineage_tokens": 1_000}},
                            ok=True, maybe_kept=False)
    assert lineage_after_round(group, handoff.theta_digest, 1_000, handoff.tokens) == 1_000 + 3_200
    group.ok, group.maybe_kept = False, True  # unconfirmed, its average applied as the members that kept it do
    assert lineage_after_round(group, handoff.theta_digest, 1_000, handoff.tokens) == 1_000 + 3_200
    failed = SimpleNamespace(gathered=group.gathered, ok=False, maybe_kept=False)  # our own Δ alone
    assert lineage_after_round(failed, handoff.theta_digest, 1_000, handoff.tokens) == 1_000 + 640
    alone = SimpleNamespace(gathered={}, ok=False, maybe_kept=False)
    assert lineage_after_round(alone, handoff.theta_digest, 1_000, 0) == 1_001


def test_members_that_started_from_one_theta_agree_on_its_training_after_the_round():
    # B resumed from a checkpoint older than the field (0); A held 5,000 at the same θ_global. A
    # member at another θ_global (C, reconciled after the round) does not count.
    gathered = {"A": {"weight": 100.0, "theta_digest": d("x"), "lineage_tokens": 5_000},
                "B": {"weight": 100.0, "theta_digest": d("x"), "lineage_tokens": 0},
                "C": {"weight": 100.0, "theta_digest": d("y"), "lineage_tokens": 10**9},
                "D": {"weight": 100.0, "theta_digest": d("x"), "lineage_tokens": "10**12"}}
    assert {applied_lineage_tokens(gathered, d("x"), ours) for ours in (5_000, 0)} == {5_400}