"""How many θ_global lineages the online peers hold: one pure function of their verified records.

Every peer's signed record (``dht/records.py``) carries ``theta_marks``: its last
:data:`MAX_THETA_MARKS` ``{"step": s, "digest": d}`` pairs, where ``d`` is the digest
(``averaging.results.tensors_digest``) of the θ_global the peer held at the end of outer step
``s``: its own round's result, or the state it resumed from or downloaded. Peers that averaged
together in a confirmed round hold the same digest at that step; peers that never met hold
different ones. The same marks are the evidence a peer needs before it adopts another's state
(``node/statesync.py``).

The rule (documented in docs/protocol.md and docs/dashboard.md):

- a **compared step** is an outer step that at least two peers hold a mark for (peers at
  different outer steps are compared at a step they all passed, within the last 8);
- the **lineage count** is the number of distinct digests at the newest compared step (with a
  single peer holding marks: 1; with no mark at all, or no step held by two peers: unknown);
- the swarm has **split** when the newest :data:`SPLIT_STEPS` consecutive compared steps each
  have two or more lineages *and* the peers fall into two or more sets that held no common digest
  at any of those steps: groups that keep not meeting, not one unlucky round, and not the groups
  of a rotating grid (``--target-group-size``), which hold one lineage each at every step but meet
  other groups' peers from round to round.

No I/O, no hivemind import: ``status``, the dashboard's JSON and ``/metrics`` (through
``dashboard.state.summarize``) and a light client that reads records some other way share it.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Iterable, Mapping

MAX_THETA_MARKS = 8  # (step, digest) pairs per record: compares peers up to 7 outer steps apart
SPLIT_STEPS = 3  # consecutive compared steps with 2+ lineages before we call it a split
DIGEST_PATTERN = r"^[0-9a-f]{8,64}$"
_DIGEST = re.compile(DIGEST_PATTERN)
_MAX_STEP = 10**18


def marks_of(raw: Any) -> dict[int, str]:
    """``{outer_step: digest}`` from one record's ``theta_marks`` (a list, tuple or deque of dicts or
    pairs, oldest first).

    Malformed entries are skipped; a repeated step keeps its last digest; at most
    :data:`MAX_THETA_MARKS` of the newest steps are kept, so a hostile list cannot grow the work.
    """
    out: dict[int, str] = {}
    if not isinstance(raw, (list, tuple, deque)):
        return out
    for item in list(raw)[-4 * MAX_THETA_MARKS:]:
        if isinstance(item, Mapping):
            step, digest = item.get("step"), item.get("digest")
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            step, digest = item
        else:
            continue
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
            continue
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            continue
        out[step] = digest
    newest = sorted(out)[-MAX_THETA_MARKS:]
    return {s: out[s] for s in newest}


def lineage_summary(marks_by_peer: Mapping[str, Any]) -> dict[str, Any]:
    """Lineages among peers, from their ``theta_marks``.

    :param marks_by_peer: ``{peer key: theta_marks}`` for the peers to count (the online ones);
        any hashable key (peer id, record owner).
    :returns: ``lineages`` (int, or None when unknown), ``compared_step`` (the outer step they are
        counted at, or None), ``peers_compared`` (peers holding a mark at that step), ``split``
        (bool), ``split_steps`` (consecutive compared steps, ending at ``compared_step``, with 2+
        lineages), ``split_sets`` (once ``split_steps`` ≥ :data:`SPLIT_STEPS`: the sets of peers that
        held no common digest at the last :data:`SPLIT_STEPS` of them; else 1), ``by_step``
        (``[[step, peers, lineages], ...]`` for the compared steps, oldest first, at most
        :data:`MAX_THETA_MARKS`) and ``warning`` (one line when split, else None).
    """
    marks = {peer: m for peer, m in ((p, marks_of(raw)) for p, raw in marks_by_peer.items()) if m}
    holders: dict[int, list[str]] = {}
    for m in marks.values():
        for step, digest in m.items():
            holders.setdefault(step, []).append(digest)
    compared = sorted(s for s, ds in holders.items() if len(ds) >= 2)[-MAX_THETA_MARKS:]
    by_step = [[s, len(holders[s]), len(set(holders[s]))] for s in compared]
    summary: dict[str, Any] = {"lineages": None, "compared_step": None, "peers_compared": 0, "split": False,
                               "split_steps": 0, "split_sets": 1, "by_step": by_step, "warning": None}
    if not compared:
        if len(marks) == 1:
            (only,) = marks.values()
            summary.update(lineages=1, compared_step=max(only), peers_compared=1)
        return summary
    newest = compared[-1]
    streak = 0
    for s in range(newest, newest - len(compared) - 1, -1):
        if s not in holders or len(holders[s]) < 2 or len(set(holders[s])) < 2:
            break
        streak += 1
    lineages = len(set(holders[newest]))
    sets = _apart(marks, range(newest - SPLIT_STEPS + 1, newest + 1)) if streak >= SPLIT_STEPS else 1
    split = sets >= 2
    summary.update(lineages=lineages, compared_step=newest, peers_compared=len(holders[newest]), split=split,
                   split_steps=streak, split_sets=sets)
    if split:
        summary["warning"] = (
            f"the swarm has split: its peers hold {lineages} different θ_global lineages, in {sets} sets of peers "
            f"that held no common θ_global at any of the last {SPLIT_STEPS} outer steps compared (up to {newest}); "
            "groups that no longer meet train separate models")
    return summary


def _apart(marks: Mapping[str, Mapping[int, str]], window: Iterable[int]) -> int:
    """How many sets the peers with a mark in ``window`` fall into, two peers joined when they held
    the same digest at a step of it (union-find)."""
    steps = set(window)
    parent: dict[str, str] = {}

    def root(p: str) -> str:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    first_holder: dict[tuple[int, str], str] = {}
    for peer, m in marks.items():
        for step, digest in m.items():
            if step in steps:
                parent.setdefault(peer, peer)
                other = first_holder.setdefault((step, digest), peer)
                parent[root(peer)] = root(other)
    return len({root(p) for p in parent})


def lineage_summary_of_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`lineage_summary` over peer rows (record fields plus ``owner``/``state``): the online ones."""
    return lineage_summary({str(r.get("owner") or r.get("peer_id")): r.get("theta_marks")
                            for r in rows if r.get("state") == "online"})
