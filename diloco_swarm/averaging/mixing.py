"""θ-mixing: members of a round that hold different θ_global leave it holding one.

Moshpit SGD (Ryabinin et al., arXiv 2103.03239) averages the *parameters* within each group, and
groups that change every round spread every peer's progress through the swarm. DiLoCo peers
whose groups are smaller than the swarm (``--target-group-size``, or a swarm beyond
``--max-group-size``) end each round with one θ_global per group; the next round's groups mix
members of different groups. After the round's verified pseudo-gradient average Δ̄, such a group
runs a second all-reduce in the same group (``averager.PseudoGradientAverager.mix``):

    each member i:  θ'_i, m'_i = OuterStep(θ_i, m_i, Δ̄)                  (its own post-step state)
    all-reduce:     D = Σ w_i (θ'_i − θ_ref) / Σ w_i,   M = Σ w_i m'_i / Σ w_i   (int8, verified)
    every member:   θ_global ← θ_ref + D,  momentum ← M,  outer step ← S + 1

``θ_ref`` is the newest θ_global that every member still holds bit for bit (each keeps its last
few; the grid of ``grouping.py`` makes the members of a round the members of the same group ``d``
rounds earlier, so they share the θ_global that round produced). Relative to it the differences
are a few outer updates, so int8 loses as little as it does on Δ; every member decodes the same
bytes, so all end bit-identical. The outer step is linear in (θ, momentum, Δ̄), so mixing the
post-step states equals one outer step on the mixed pre-step states.

This module is the pure part: which rounds mix, against which reference, with which weights. Every
member computes it from the same gathered metadata, so they agree without a message.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from diloco_swarm.averaging.grouping import is_count

MAX_MARKS = 8  # (outer step, θ digest) pairs a member may list in its gathered metadata
DOWNLOAD_BYTES_PER_VALUE = 8  # a state download: θ_global + outer momentum, fp32
MIX_BYTES_PER_VALUE = 2  # a mix: two int8 tensor sets (θ differences and momentum)
_DIGEST = re.compile(r"[0-9a-f]{16}")

State = tuple[int, str]  # (outer step, θ_global digest)
MAX_DEBT = (1 << 53) - 1  # the most outer steps a lineage may owe (``restarted_below``): an exact float


def standing(outer_step: int, restarted_below: int = 0) -> int:
    """Where a θ_global stands when the swarm chooses between lineages (an int ≥ 0): its outer step
    when its lineage never restarted; else the larger of its outer step less the steps it owes
    (``restarted_below``: the steps a joiner could not download when its download failed and it
    trained on alone) and half its outer step, rounded up. A lineage that restarted from θ_0 owing N
    replaces the one it could not download (then at N) only past outer step 2N, and never stands
    below a fresh start: outer step alone cannot tell a restart from progress (docs/architecture.md,
    rule 59)."""
    return max(outer_step - restarted_below, (outer_step + 1) // 2) if restarted_below else outer_step


def first_step_at(at: int, restarted_below: int) -> int:
    """The first outer step at which a lineage owing ``restarted_below`` stands at ``at`` (≥ 0): the
    inverse of :func:`standing`."""
    return at if not restarted_below or at == 0 else min(at + restarted_below, 2 * at - 1)


def restart_of(meta: Any) -> int | None:
    """A member's ``restarted_below`` from its gathered metadata or state-download metadata
    (untrusted; absent means 0), or None when malformed."""
    value = meta.get("restarted_below", 0) if isinstance(meta, dict) else None
    return value if is_count(value, 0, MAX_DEBT) else None


@dataclass(frozen=True)
class MixPlan:
    """How one group mixes θ_global after its verified round.

    ``reference``: the (outer step, digest) of the θ_global every member holds, the origin of the
    differences. ``weights``: peer id -> 1.0 for the members at the round's outer step, 0.0 for
    those behind it (they receive the mixed state but do not pull the others back).
    ``outer_step``: every member's outer step after the mix; ``restarted_below``: the mixed state's
    lineage debt (:func:`standing`), the least of the weighted members'.
    """

    reference: State
    weights: dict[str, float]
    outer_step: int
    restarted_below: int = 0


def mixing_group_id(group_id: bytes) -> bytes:
    """The all-reduce id of a round's mix: derived from the round's own group id (the same length),
    so its members need no message to agree on it, and it names no other round."""
    return hashlib.sha256(b"diloco-mix:" + bytes(group_id)).digest()[:len(group_id)]


def group_bits(key: str) -> str:
    """hivemind group bits (a string of 32 '0'/'1') for a group key of ``grouping.plan_round``."""
    return format(int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big"), "032b")


def states_of(meta: Any) -> tuple[State, list[State]] | None:
    """(the state a member started the round from, the states it can serve as a reference) from its
    gathered metadata (untrusted), or None when malformed. Its start state is always a reference."""
    if not isinstance(meta, dict):
        return None
    step, digest, marks = meta.get("outer_step"), meta.get("theta_digest"), meta.get("marks", [])
    if not _valid_state(step, digest) or not isinstance(marks, list) or len(marks) > MAX_MARKS:
        return None
    held = [(step, digest)]
    for mark in marks:
        if not (isinstance(mark, (list, tuple)) and len(mark) == 2 and _valid_state(*mark)):
            return None
        held.append((int(mark[0]), str(mark[1])))
    return (step, digest), held


def _valid_state(step: Any, digest: Any) -> bool:
    return is_count(step, 0, (1 << 53) - 1) and isinstance(digest, str) and bool(_DIGEST.fullmatch(digest))


def plan_mix(gathered: Mapping[str, Any]) -> MixPlan | None:
    """Whether a group whose Δ round verified mixes θ_global, and how (a :class:`MixPlan`), or None.

    - ``S``, the round's standing (:func:`standing`: the outer step, unless a lineage restarted), is
      the newest start standing that half the members (rounded up) have reached. Members at ``S`` or later weigh 1; those behind weigh 0 (a late peer catches up
      without pulling the others back). In a group of three or more, one member claiming to be far
      ahead cannot give itself the only weight; in a pair the member ahead leads the mix, as bounded
      (``allreduce.MixingAllReduceRunner``) as its Δ already was in the round.
    - A group mixes when its members at ``S`` hold two or more θ_global (lineages: a mix keeps every
      one's progress, where a download would discard all but one), or when enough are behind that
      the mix moves fewer bytes than their state downloads (:data:`DOWNLOAD_BYTES_PER_VALUE` each,
      against :data:`MIX_BYTES_PER_VALUE` per member in the all-reduce).
    - The reference is the newest state every member lists; without one there is no mix (the
      caller falls back to downloading the canonical state).

    :param gathered: peer id -> that member's gathered metadata (``outer_step``, ``theta_digest``,
        ``marks``: further [step, digest] pairs it holds), every member of the round included.
    """
    members, stands, restarts = {}, {}, {}
    for peer, meta in gathered.items():
        parsed, restart = states_of(meta), restart_of(meta)
        if parsed is None or restart is None:
            return None
        members[str(peer)], restarts[str(peer)] = parsed, restart
        stands[str(peer)] = standing(parsed[0][0], restart)
    if len(members) < 2:
        return None
    step = round_step(stands.values())
    current = {p for p in members if stands[p] >= step}
    lineages = {members[p][0][1] for p in current}  # digests: one θ_global claimed at two steps is one
    behind = len(members) - len(current)
    if len(lineages) == 1 and not _mix_is_cheaper(behind, len(members)):
        return None
    common = set.intersection(*(set(held) for _, held in members.values()))
    if not common:
        return None
    reference = max(common)
    debt = min(restarts[p] for p in current)  # the leaders' lineage that owes least
    return MixPlan(reference=reference, weights={p: float(p in current) for p in sorted(members)},
                   outer_step=first_step_at(step, debt) + 1, restarted_below=debt)


def round_step(start_steps: Iterable[int]) -> int:
    """The outer step a round's members are at: the newest start step that half of them (rounded up)
    reached. Every member computes it from the same gathered metadata. In a group of three or more,
    one member ahead of the others (a forged claim, or a round it applied alone) does not move it; in
    a pair it is the member ahead.

    :raises ValueError: no steps.
    """
    steps = sorted(start_steps, reverse=True)
    if not steps:
        raise ValueError("a round has members")
    return steps[(len(steps) + 1) // 2 - 1]


def _mix_is_cheaper(behind: int, group: int) -> bool:
    """Whether mixing moves fewer bytes than ``behind`` members downloading the state (a butterfly
    all-reduce sends about 2(n−1)/n values per value and member, so n members move about 2(n−1))."""
    return behind > 0 and behind * DOWNLOAD_BYTES_PER_VALUE > MIX_BYTES_PER_VALUE * 2 * (group - 1)


def history_length(grid_dims: int) -> int:
    """θ_global states a peer keeps as mixing references (the current one included): the grid's
    dimensions plus one (the members of a round last shared a state ``dims`` rounds ago; one more
    survives one failed round in between); 1 (no copies) when the swarm averages in one group."""
    return grid_dims + 1 if grid_dims > 1 else 1
