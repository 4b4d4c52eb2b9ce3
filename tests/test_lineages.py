"""θ_global lineage counting (diloco_swarm.dht.lineages) on synthetic records, and where it shows:
``summarize`` (status, /api/v1/state), the dashboard card and Prometheus."""

from __future__ import annotations

import hashlib
import time
from collections import deque

from prometheus_client.parser import text_string_to_metric_families

from diloco_swarm.dashboard.metrics import make_registry, render_metrics
from diloco_swarm.dashboard.render import render_live
from diloco_swarm.dashboard.state import SwarmState, summarize
from diloco_swarm.dht.lineages import MAX_THETA_MARKS, SPLIT_STEPS, lineage_summary, marks_of
from diloco_swarm.dht.records import PeerEntry, PeerRecord, normalize_snapshot


def d(label: str, step: int) -> str:
    """A distinct 16-hex-digit digest per (lineage label, step)."""
    return hashlib.sha256(f"{label}/{step}".encode()).hexdigest()[:16]


def marks(lineage_by_step: dict[int, str]) -> list[dict]:
    return [{"step": s, "digest": d(lab, s)} for s, lab in sorted(lineage_by_step.items())]


def steps(first: int, last: int, label: str) -> dict[int, str]:
    return {s: label for s in range(first, last + 1)}


def test_one_lineage():
    peers = {p: marks(steps(1, 6, "x")) for p in "abcd"}
    s = lineage_summary(peers)
    assert (s["lineages"], s["compared_step"], s["peers_compared"], s["split"], s["warning"]) == (1, 6, 4, False, None)
    assert s["by_step"][-1] == [6, 4, 1] and len(s["by_step"]) == 6


def test_two_lineages_but_not_yet_a_split():
    # pairs that split two steps ago: 2 lineages, but not for SPLIT_STEPS steps in a row
    peers = {"a": marks({**steps(1, 4, "x"), 5: "p", 6: "p"}), "b": marks({**steps(1, 4, "x"), 5: "p", 6: "p"}),
             "c": marks({**steps(1, 4, "x"), 5: "q", 6: "q"}), "d": marks({**steps(1, 4, "x"), 5: "q", 6: "q"})}
    s = lineage_summary(peers)
    assert s["lineages"] == 2 and s["split_steps"] == 2 and s["split"] is False and s["warning"] is None


def test_split_that_persists_is_reported_and_healing_clears_it():
    pair1 = steps(1, 2, "x") | steps(3, 6, "p")
    pair2 = steps(1, 2, "x") | steps(3, 6, "q")
    s = lineage_summary({"a": marks(pair1), "b": marks(pair1), "c": marks(pair2), "d": marks(pair2)})
    assert s["split"] is True and s["split_steps"] == 4 >= SPLIT_STEPS and s["lineages"] == 2
    assert "split" in s["warning"] and "2 different" in s["warning"]
    # one round where all four met: one lineage again, no warning
    healed = {p: marks(m | {7: "all"}) for p, m in {"a": pair1, "b": pair1, "c": pair2, "d": pair2}.items()}
    s = lineage_summary(healed)
    assert (s["lineages"], s["split"], s["split_steps"]) == (1, False, 0)


def test_three_pairs_that_never_meet_again():
    # the 6 peers with --target-group-size 2: 3 fixed pairs from round 3 on
    peers = {}
    for i, lab in enumerate("pqr"):
        for p in (f"{lab}1", f"{lab}2"):
            peers[p] = marks(steps(1, 2, "x") | steps(3, 8, lab))
    s = lineage_summary(peers)
    assert (s["lineages"], s["split"], s["compared_step"], s["peers_compared"]) == (3, True, 8, 6)


def test_a_rotating_grid_holds_several_lineages_but_has_not_split():
    # 4 peers in pairs that change every round (a grid with θ-mixing): 2 lineages at every step, yet
    # every peer meets another pair's peer within any 3 steps: no warning (a newcomer saw one)
    pairings = [("ab", "cd"), ("ac", "bd"), ("ad", "bc")]
    held = {p: {} for p in "abcd"}
    for step in range(1, 9):
        for pair in pairings[step % 3]:
            for p in pair:
                held[p][step] = f"{pair}-{step}"
    peers = {p: [{"step": s_, "digest": d(lab, s_)} for s_, lab in sorted(m.items())] for p, m in held.items()}
    s = lineage_summary(peers)
    assert s["lineages"] == 2 and s["split_steps"] == 8 and s["split_sets"] == 1
    assert s["split"] is False and s["warning"] is None
    # the same pairs at every step: apart for good
    fixed = {p: [{"step": s_, "digest": d("ab" if p in "ab" else "cd", s_)} for s_ in range(1, 9)] for p in "abcd"}
    s = lineage_summary(fixed)
    assert s["split"] is True and s["split_sets"] == 2 and "2 sets of peers" in s["warning"]


def test_peers_at_different_outer_steps_are_compared_at_a_step_they_all_passed():
    # b is one step behind a; c lags 3 steps; all in one lineage where they overlap
    a = marks(steps(3, 10, "x"))
    b = marks(steps(2, 9, "x"))
    c = marks(steps(1, 7, "x"))
    s = lineage_summary({"a": a, "b": b, "c": c})
    assert (s["lineages"], s["compared_step"], s["peers_compared"]) == (1, 9, 2)
    assert [row for row in s["by_step"] if row[0] == 7] == [[7, 3, 1]]
    # c held something else at step 7: two lineages there, yet the newest compared step has one
    c2 = marks(steps(1, 6, "x") | {7: "other"})
    s = lineage_summary({"a": a, "b": b, "c": c2})
    assert s["lineages"] == 1 and [7, 3, 2] in s["by_step"] and s["split"] is False


def test_unknown_and_single_peer():
    assert lineage_summary({})["lineages"] is None
    assert lineage_summary({"a": [], "b": None})["lineages"] is None
    s = lineage_summary({"a": marks(steps(1, 3, "x"))})
    assert (s["lineages"], s["compared_step"], s["peers_compared"]) == (1, 3, 1)
    # two peers with no step in common (more than 8 outer steps apart): unknown, not "2"
    far = lineage_summary({"a": marks(steps(1, 8, "x")), "b": marks(steps(20, 27, "x"))})
    assert far["lineages"] is None and far["compared_step"] is None


def test_hostile_marks_are_bounded_and_skipped():
    junk = [None, 5, "x", {"step": -1, "digest": "ab" * 8}, {"step": True, "digest": "ab" * 8},
            {"step": 3, "digest": "XYZ"}, [1, 2, 3], {"step": 2**70, "digest": "ab" * 8}]
    assert marks_of(junk) == {}
    huge = [{"step": i, "digest": f"{i:016x}"} for i in range(10_000)]
    assert list(marks_of(huge)) == list(range(10_000 - MAX_THETA_MARKS, 10_000))
    assert lineage_summary({"a": "not a list", "b": junk})["lineages"] is None
    # what the node hands its record publisher: a deque of (step, digest) tuples
    assert marks_of(deque([(4, "ab" * 8), (5, "cd" * 8)], maxlen=MAX_THETA_MARKS)) == {4: "ab" * 8, 5: "cd" * 8}


def rec(peer: str, theta_marks: list[dict], **over) -> PeerRecord:
    return PeerRecord.parse_obj(normalize_snapshot(
        {"peer_id": peer, "name": peer.lower(), "outer_step": theta_marks[-1]["step"] if theta_marks else 0,
         "theta_marks": theta_marks, **over}, now=1000.0))


def test_status_dashboard_and_metrics_show_the_same_count():
    pair1 = marks(steps(1, 2, "x") | steps(3, 6, "p"))
    pair2 = marks(steps(1, 2, "x") | steps(3, 6, "q"))
    lone = marks(steps(1, 6, "z"))
    st = SwarmState("r", stale_after_s=20, gone_after_s=60)
    now = time.time()
    entries = [PeerEntry(o, rec(o.upper(), m), now + 30) for o, m in (("a", pair1), ("b", pair1), ("c", pair2),
                                                                       ("d", pair2))]
    st.update(entries, now=now)
    doc = st.snapshot(now=now)
    assert doc["totals"]["lineages"] == 2 and doc["totals"]["split"] is True
    assert doc["totals"]["lineage"]["by_step"][-1] == [6, 4, 2]
    html = render_live(doc)
    assert 'id="split-warning"' in html and 'id="total-lineages"' in html
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(make_registry(st)).decode())}
    assert families["diloco_swarm_lineages"].samples[0].value == 2
    assert families["diloco_swarm_split"].samples[0].value == 1
    # a stale peer does not count: rows as `status` builds them
    rows = [{**e.record.dict(), "owner": e.owner, "state": "online"} for e in entries]
    rows.append({**rec("E", lone).dict(), "owner": "e", "state": "stale"})
    assert summarize(rows)["lineages"] == 2
    rows[-1]["state"] = "online"
    assert summarize(rows)["lineages"] == 3
    # one lineage: no warning on the page, split gauge 0
    st2 = SwarmState("r")
    st2.update([PeerEntry(o, rec(o.upper(), pair1), now + 30) for o in "ab"], now=now)
    assert 'id="split-warning"' not in render_live(st2.snapshot(now=now))
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(make_registry(st2)).decode())}
    assert families["diloco_swarm_lineages"].samples[0].value == 1
    assert families["diloco_swarm_split"].samples[0].value == 0
