"""Which θ_global the swarm backs: pure functions of the swarm's signed records and a round's members.

A node acts on another peer's claim (adopts its state, follows its outer step) only with evidence
from more than one record owner (:class:`Evidence`, :func:`gather_evidence`); the members of a round
that started it from different θ_global pick the same canonical one (:func:`canonical_state`), and
peers that judged apart settle on a strict majority's (:func:`majority_holders`). No I/O: the node's
state sync (``statesync.py``) reads the records and downloads what these functions choose.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Container, Mapping

from diloco_swarm.averaging.mixing import round_step, standing
from diloco_swarm.dht.lineages import marks_of

EVIDENCE_QUORUM = 2  # distinct signing keys whose records must back a claim before a peer acts on it


@dataclass
class Evidence:
    """What the swarm's signed records back, as one node sees it.

    ``supported_step``: the newest standing (``mixing.standing``: a record's outer step, unless its
    lineage restarted and owes steps) that at least
    :data:`EVIDENCE_QUORUM` distinct record owners (signing keys) have reached, or all of them when
    fewer are online: one peer claiming to be far ahead does not move it; ``supported_raw_step``:
    the same rule over the records' outer steps themselves (a claimed debt must not carry a forged
    step past it). ``vouched``: the (outer step, θ digest) pairs that as many owners hold in their θ
    marks, this node included, with the peer ids of the other holders. ``holders_by_step``: peer ids
    by their record's standing.
    """

    supported_step: int = 0
    supported_raw_step: int = 0
    vouched: dict[tuple[int, str], set[str]] = field(default_factory=dict)
    holders_by_step: dict[int, set[str]] = field(default_factory=dict)  # peer ids whose record is at a step
    clients: set[str] = field(default_factory=set)  # peer ids whose records say client: they donate no state

    def accepts(self, step: int, digest: str, restarted_below: int = 0) -> str | None:
        """Why a state (outer step, θ digest, its lineage's restart debt) may not be adopted, or None.

        Neither its standing nor its outer step may be ahead of the supported ones, and when other
        peers vouch for a digest at its outer step it must be one of them.
        """
        if step > self.supported_raw_step:
            return f"its outer step {step} is ahead of what other peers' signed records back ({self.supported_raw_step})"
        if standing(step, restarted_below) > self.supported_step:
            return (f"it stands at {standing(step, restarted_below)} (outer step {step}, owing {restarted_below}), "
                    f"ahead of what other peers' signed records back ({self.supported_step})")
        at_step = {d for (s, d) in self.vouched if s == step}
        if at_step and digest not in at_step:
            return f"other peers' signed records vouch for another θ_global at outer step {step}"
        return None

    def donors_at(self, min_step: int) -> list[str]:
        """Peers to download a state of ``min_step`` or later from: those vouched for first; never a
        client (it serves no state: asking it only costs a failed dial)."""
        vouched = sorted({p for (s, _), peers in self.vouched.items() if s >= min_step for p in peers} - self.clients)
        rest = sorted({p for s, peers in self.holders_by_step.items() if s >= min_step for p in peers}
                      - set(vouched) - self.clients)
        random.shuffle(rest)
        return vouched + rest


def gather_evidence(entries, me: str, my_step: int = 0, my_marks=(), my_debt: int = 0) -> Evidence:
    """:class:`Evidence` from ``dht.records.read_peer_entries`` output (verified, signed records),
    seen by peer ``me`` at outer step ``my_step``, owing ``my_debt`` (``mixing.standing``), with
    θ marks ``my_marks`` ((step, digest) pairs).

    Our own step backs claims up to it, and our own marks vouch with one other owner's: we trust
    our own state. Counting ourselves also makes every member of a round rank the same states the
    same way, so they agree on the canonical one.

    One peer's word, however advanced, never makes a state canonical: owner keys sign the records,
    so a single hostile peer cannot speak for others (docs/architecture.md, threat model).
    """
    claims: dict[tuple[int, str], dict[str, str]] = {}  # state -> {owner: the peer id its record names}
    steps: dict[str, int] = {}  # owner -> its standing
    raw: dict[str, int] = {}  # owner -> its outer step
    owners: set[str] = set()  # every owner of a record, paused ones too: the quorum's size
    evidence = Evidence()
    for step, digest in marks_of(list(my_marks)).items():
        claims.setdefault((step, digest), {})[""] = me  # "": our own key, never an owner fingerprint
    for entry in entries or []:
        record = entry.record
        if record is None or record.peer_id == me:
            continue
        stands = standing(record.outer_step, record.restarted_below)
        owners.add(entry.owner)
        if getattr(record, "paused", None) is None:  # a paused peer's step says where it stopped, not the swarm
            steps[entry.owner] = max(steps.get(entry.owner, 0), stands)
            raw[entry.owner] = max(raw.get(entry.owner, 0), record.outer_step)
        if record.reachability == "client":
            evidence.clients.add(record.peer_id)
        evidence.holders_by_step.setdefault(stands, set()).add(record.peer_id)
        for step, digest in marks_of([(m.step, m.digest) for m in record.theta_marks]).items():
            claims.setdefault((step, digest), {})[entry.owner] = record.peer_id
    # a step that we reached ourselves backs a peer's claim up to it: we trust our own state
    # a paused owner makes no claim, but counts in the quorum: a lone trainer beside paused peers is one
    # peer's word, as it would be beside training ones
    evidence.supported_step = _supported(steps.values(), standing(my_step, my_debt), len(owners))
    evidence.supported_raw_step = _supported(raw.values(), my_step, len(owners))
    vouch_quorum = min(EVIDENCE_QUORUM, len(owners) + 1)
    evidence.vouched = {state: set(who.values()) - {me} for state, who in claims.items() if len(who) >= vouch_quorum}
    return evidence


def _supported(claims, mine: int, owners: int) -> int:
    """The newest of ``claims`` (one per training record owner) that :data:`EVIDENCE_QUORUM` owners
    reached (all ``owners``, paused ones included, when fewer), or ours (``mine``) up to the newest
    claim: we trust our own state."""
    ranked = sorted(claims, reverse=True)
    quorum = min(EVIDENCE_QUORUM, max(1, owners))
    return max(ranked[quorum - 1] if len(ranked) >= quorum else 0, min(mine, ranked[0]) if ranked else 0)


def majority_holders(others: dict[str, str], same: int) -> list[str]:
    """The peers of ``others`` (peer id -> the θ digest it holds at our outer step, not ours) that hold
    the digest a strict majority of the peers at our step hold, this peer and the ``same`` others
    holding ours counted; [] when no other digest has one. A strict majority is unique, so peers that
    follow it never swap states."""
    if not others:
        return []
    digest, votes = Counter(others.values()).most_common(1)[0]
    return [p for p, d in others.items() if d == digest] if 2 * votes > len(others) + same + 1 else []


def canonical_state(entries: dict[str, tuple[int, str]], me: str, evidence: Evidence, donors: Container[str],
                    can_donate: bool, restarts: Mapping[str, int] | None = None) -> tuple[int, str, int]:
    """The (outer step, θ digest, debt) the members of a round should all hold, as member ``me`` sees it.

    ``entries``: peer id -> the state it started the round from (the round's gathered metadata, the
    same for every member); ``restarts``: peer id -> its lineage's restart debt (absent: 0), from the
    same metadata. Each member's claim (outer step, digest, debt) is a candidate of its own, so a
    member claiming another's state with a larger debt does not lower that state; candidates are
    compared by standing (``mixing.standing``: the outer step, unless a lineage restarted). A
    candidate stands no further than the round (``mixing.round_step``: the newest standing half the
    members reached), is backed by the swarm's signed records (``evidence``) and can be donated by
    its holder (``donors``; ours when ``can_donate``: a client cannot serve it). The candidate standing furthest wins, then a vouched one, then the one most
    members hold, then digest order; with no candidate, every state is one.

    The step cap is what keeps the members agreeing: each member always trusts its own state, so a
    member alone ahead of the others (it applied a round alone) would keep choosing its own state
    while the others, whose records do not back its step, chose theirs, and every later round would
    verify while leaving them on separate lineages (seen in the chaos test: 600 "ok" rounds of 4).
    """
    claims = {p: (e[0], e[1], (restarts or {}).get(p, 0)) for p, e in entries.items()}
    cap = round_step(standing(step, debt) for step, _, debt in claims.values())
    eligible = {c for p, c in claims.items() if standing(c[0], c[2]) <= cap and (
        (p in donors and evidence.accepts(*c) is None) or (p == me and can_donate))}
    votes = Counter(c for c in claims.values() if c in eligible or not eligible)
    return max(votes, key=lambda c: (standing(c[0], c[2]), c[:2] in evidence.vouched, votes[c], c[1], -c[2]))
