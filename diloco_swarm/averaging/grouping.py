"""Who averages with whom in an outer step: progress alignment, then a rotating Moshpit grid.

A pure function of the round number, the expected peers and their ETAs (no I/O, no hivemind
import), so the node and ``bench/simscale.py`` run the very same rule.

The rule, for round ``t`` (the outer step the peers are finishing):

1. **Progress alignment** (Decoupled DiLoCo's minimum quorum + grace window): each peer publishes
   its ETA, the seconds until its inner phase ends. The round waits for the ``quorum`` share of the
   peers (by ETA order, at least one) plus ``grace_s``: ``deadline = ETA of the ceil(quorum·n)-th
   peer + grace_s``. Peers with ``ETA ≤ deadline`` are *expected*; the others are *late*: they
   fold their Δ into the next round (token-weighted) instead of forming a group of their own.
2. **Everyone, when the swarm fits**: when the coming peers (expected and late) number at most
   ``max_group_size``, one group of all expected peers (key ``"r{t}:all"``).
3. **A rotating grid beyond the cap** (Moshpit SGD, Ryabinin et al., arXiv 2103.03239): the
   coming peers (late ones too, so that slightly different views of the ETAs give the same grid;
   they are then left out of their group), ranked by sha256 of their peer id, sit on a ``d``-dimensional
   grid (``d`` the smallest with ``max_group_size**d ≥ n``) whose lines are as long as the cap
   allows: from the last dimension down, each side is the fewest slabs of at most
   ``max_group_size**i`` peers that hold them (8 peers under a cap of 4: 4 × 2; 65 under 64: 33 × 2);
   rank ``r`` has the mixed-radix digits of ``r`` as coordinates. In round ``t`` the groups are
   made of whole lines along dimension ``k = t mod d`` (a line: the peers whose coordinates agree
   everywhere but at ``k``): consecutive lines are packed into groups of about ``n / ceil(n / max_group_size)`` peers,
   never more than the cap, and a peer left alone by a partial line joins the smallest group (which
   may then hold one more than the cap). Lines of different dimensions cross, so consecutive rounds
   mix every group, and on a full grid every peer holds the exact global average after ``d``
   consecutive rounds (Moshpit's exact-averaging setting; packed lines keep it). Long lines make
   the groups as large as the cap allows: 8 peers under a cap of 4 on a 3 × 3 grid had lines of
   3, 3 and 2, so their "groups of 4" were trios and pairs, and a pair whose member was late
   stranded the other (``bench scale``); on the 4 × 2 grid every round is two groups of 4. Cutting
   the line order into balanced blocks instead keeps corner blocks together in every dimension (8
   peers on a 3 × 3 grid in groups of 4: three peers always met each other and only each other,
   ``bench scale``). The rank hash is fixed, so the grid changes only when the coming peers do.

    plan = plan_round(t, {"QmA": 12.0, "QmB": 14.5, ...}, max_group_size=64, grace_s=10.0)
    plan.groups          # {key: (peer ids, sorted)}
    plan.group_of("QmA") # (key, members); a late peer gets ("r{t}:late", (itself,))
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Sequence

DEFAULT_MAX_GROUP_SIZE = 64
DEFAULT_QUORUM = 0.5
DEFAULT_GRACE_S = 10.0


@dataclass(frozen=True)
class RoundPlan:
    """The groups of one round. Times are seconds from the moment the ETAs were read."""

    round_no: int
    deadline_s: float  # expected peers finish by then (inf when no peer is expected)
    expected: tuple[str, ...]  # sorted
    late: tuple[str, ...]  # sorted: they fold their Δ into the next round
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> members (sorted)
    sides: tuple[int, ...] = ()  # the grid's side along each dimension (none: everyone in one group)
    max_group_size: int = DEFAULT_MAX_GROUP_SIZE  # the cap the plan was made under

    @property
    def dims(self) -> int:
        """Grid dimensions (1 = everyone in one group)."""
        return len(self.sides) or 1

    def group_of(self, peer_id: str) -> tuple[str, tuple[str, ...]]:
        """``(group key, members)`` of ``peer_id``; a late or unknown peer gets ``("r{t}:late", (peer_id,))``."""
        for key, members in self.groups.items():
            if peer_id in members:
                return key, members
        return f"r{self.round_no}:late", (peer_id,)


@lru_cache(maxsize=1 << 16)
def _rank_key(peer_id: str) -> bytes:
    return hashlib.sha256(peer_id.encode("utf-8", "surrogatepass")).digest()


def _grid(n: int, cap: int) -> tuple[int, ...]:
    """The grid's sides for ``n`` peers, first dimension first: the fewest dims with cap**dims ≥ n;
    from the last dimension down, each side is the fewest slabs of at most cap**i peers that hold
    the peers left, and the first side the peers left in one slab (so lines are as long as the cap
    allows, and balanced)."""
    dims = 1
    while cap ** dims < n:
        dims += 1
    sides, left = [], n
    for i in range(dims - 1, 0, -1):
        side = max(2, math.ceil(left / cap ** i))
        sides.append(side)
        left = math.ceil(left / side)
    return (max(2, left), *reversed(sides))


def _pack_lines(lines: list[list[str]], n: int, cap: int) -> list[list[str]]:
    """Whole lines, in order, packed into groups of about ``n / ceil(n / cap)`` peers and never more
    than ``cap``; a peer left alone (a line of one with no room beside it) joins the smallest group,
    which may then hold ``cap + 1``: nobody averages alone while others average."""
    target = math.ceil(n / math.ceil(n / cap))
    groups: list[list[str]] = []
    for line in lines:
        if groups and len(groups[-1]) < target and len(groups[-1]) + len(line) <= cap:
            groups[-1].extend(line)
        else:
            groups.append(list(line))
    alone = [g[0] for g in groups if len(g) == 1]
    if len(alone) > 1:  # the peers of partial lines pair up among themselves
        groups = [g for g in groups if len(g) > 1]
        groups += [alone[i:i + cap] for i in range(0, len(alone), cap)]
    single = next((g for g in groups if len(g) == 1), None)
    if single is not None and len(groups) > 1:
        groups.remove(single)
        min(groups, key=len).extend(single)
    return groups


def majority_quorum(online: int, max_group_size: int = DEFAULT_MAX_GROUP_SIZE) -> int:
    """The fewest members a group of this round may start with (hivemind's ``min_group_size``).

    A strict majority of the ``online`` peers, so two disjoint groups can never both form in one
    outer step: the swarm cannot split into lineages that each think their round was whole. A
    minority that misses the round keeps looking and meets the majority's next round, where the
    state rule (node/statesync.py) brings it onto the majority's θ_global. When the swarm is
    larger than one group can hold, groups are necessarily disjoint (the grid above mixes them):
    any 2 peers may form one (a grid group's own quorum is :func:`grid_group_quorum`).

    :param online: peers of the run online now, this one included (≥ 1).
    :returns: an int in [2, max_group_size].
    """
    if online > max_group_size:
        return 2
    return min(max_group_size, max(2, online // 2 + 1))


def grid_group_quorum(planned: int) -> int:
    """The fewest members a grid group of ``planned`` expected peers may start with: a strict
    majority of them (at least 2), so the group cannot run as two disjoint halves under its one
    key. Members that finish a round together hand off together: a leader whose time was up began
    with the half that was in, the other half made a second group, and the two halves, which had
    just averaged among themselves, again missed the crossing that mixes the grid (``bench scale``,
    8 peers in groups of 4: two pairs per group, 3 rounds without a crossing). A minority keeps
    looking within the averaging window and is joined by the rest; planned members found gone
    lower ``planned`` (``PseudoGradientAverager._lower_target``).

    :param planned: the group's expected members, this peer included (≥ 1).
    :returns: an int in [2, max(2, planned)].
    """
    return max(2, planned // 2 + 1)


def is_count(v: object, low: int = 0, high: int | None = None) -> bool:
    """Whether an untrusted value (a peer's record, gathered data) is an int (not a bool) in
    ``[low, high]`` (no upper bound when ``high`` is None)."""
    return isinstance(v, int) and not isinstance(v, bool) and low <= v and (high is None or v <= high)


def gathered_weight(meta: object) -> float | None:
    """The ``weight`` (tokens) in a member's untrusted gathered metadata ``meta`` (``request.RoundRequest.gather``):
    a float where it is a finite int or float (not a bool), else None."""
    weight = meta.get("weight") if isinstance(meta, dict) else None
    ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
    return float(weight) if ok else None


def swarm_step(own_step: int, steps: Sequence[object]) -> int:
    """The swarm's outer step as a peer at ``own_step`` sees it: the upper median of the other peers'
    claimed ``steps`` (untrusted: values that are not ints ≥ 0 are ignored) and ours."""
    valid = sorted([s for s in steps if is_count(s)] + [own_step])
    return valid[len(valid) // 2]


def ahead_of_swarm(own_step: int, steps: Sequence[object]) -> bool:
    """Whether a grid round at ``own_step`` must wait for the swarm before it plans: the peer is past
    :func:`swarm_step`, so averaging would put it two steps ahead of the swarm.

    Grid groups are disjoint, so no quorum of the swarm bounds them: a pair of fast peers that the
    grid puts together in consecutive rounds averages step after step while the others take one
    (the 6-peer pairs test in CI: d and e, both alone on partial lines of a 2 × 2 × 2 grid, averaged
    steps 3 and 4 within 3 s). The peers behind then download state (``lagging``) and partners at
    different steps miss each other, so the grid stops mixing. Waiting until the swarm reaches our
    step bounds the spread to one step (bounded staleness, as Async Local-SGD's, arXiv 2401.09135);
    in overlap mode the inner phase goes on meanwhile. A claim far ahead (a liar) moves the upper
    median only as one peer of many.
    """
    return own_step > swarm_step(own_step, steps)


def step_quorum_problem(steps: Sequence[object], online: int) -> str | None:
    """Why a whole-swarm group must not run its round (a line), or None when it may.

    :func:`majority_quorum` counts members, not the outer step each starts the round from, so a
    member a step behind could make up a "majority" with one peer at the newest step while another
    peer at that step pairs with someone else: two verified averages, two θ_global of one outer
    step. Seen with no fault at all (3 tiny peers on 2 busy cores: 7 outer steps on 2 lineages,
    every round "ok"). The group advances the newest step ``s`` among its members, so the members at
    ``s`` must be more than half of the online peers that are not behind in this group:
    ``k > (online − b) / 2``. Two disjoint groups can then never advance the same step
    (``k + k' > online − (b + b')/2 ≥ online − b − b'``, more peers than there are outside both
    groups' behind members). A member behind ``s`` contributes its stale Δ, then catches up
    (node/statesync.py). Two peers one step apart still average (``k = 1 > (2 − 1) / 2``).

    :param steps: each member's claimed outer step (untrusted: anything but an int ≥ 0 counts as
        neither at ``s`` nor behind it).
    :param online: peers of the run online now, as the group agrees on it (≥ 1).
    """
    valid = [s for s in steps if is_count(s)]
    if not valid:
        return "no member gave a valid outer step"
    newest = max(valid)
    at_newest = valid.count(newest)
    behind = len(valid) - at_newest
    if 2 * at_newest > max(1, online - behind):
        return None
    return (f"{at_newest} of {len(steps)} members at outer step {newest}, more than half of the "
            f"{max(1, online - behind)} online peers not behind it needed")


def group_problem(metas: Sequence[Mapping[str, object]], default_cap: int) -> str | None:
    """Why this whole-swarm group must not run its round (:func:`step_quorum_problem` of the members'
    gathered outer steps, with the upper median of their online-peer counts), or None.

    Every member reads the same gathered bytes, so all judge alike. Not judged: grid groups (group
    bits set), rounds without counts, and swarms larger than the plans' cap (the upper median of the
    members' ``group_cap``, else ``default_cap``): a grid run's plan mid-run is one group when only a
    few peers are coming, and those few may average; its last round, planned under
    ``--max-group-size``, is judged.

    :param metas: each member's gathered metadata (untrusted: ``outer_step``, ``online_peers``,
        ``group_cap``, ``group_bits``).
    """
    if any(m.get("group_bits") for m in metas):
        return None
    claims, caps = _upper_median(metas, "online_peers"), _upper_median(metas, "group_cap")
    if claims is None:
        return None
    online = max(len(metas), claims)
    if online > (caps if caps is not None else default_cap):
        return None
    return step_quorum_problem([m.get("outer_step") for m in metas], online)


def _upper_median(metas: Sequence[Mapping[str, object]], name: str) -> int | None:
    """The upper median of the members' claimed ``name`` (untrusted: only ints ≥ 1 count), or None:
    a few members cannot move it past what most of them said."""
    claims = sorted(v for v in (m.get(name) for m in metas) if is_count(v, 1))
    return claims[len(claims) // 2] if claims else None


def round_number(own_step: int, others: Sequence[tuple[int, int | None]]) -> int:
    """The round a peer at outer step ``own_step`` plans (:func:`plan_round`'s ``round_no``), from the
    ``(outer step, round in flight or None)`` of the other peers' records.

    The swarm's round is the upper median of the outer steps (ours included), or ours when we are
    ahead: a peer one step behind meets the swarm's round and catches up in it, instead of planning a
    grid of its own. The median moves while the swarm advances, so two peers behind it at one step
    that read the records a moment apart could plan different rounds and wait out their windows for
    each other (the 6-peer pairs test in CI: two peers at step 9 planned r9 and r10, and each was the
    other's planned partner in both). So a peer behind the median takes the newest round that a peer
    at its own step is already looking for a group in (its record's ``averaging_round``), when there
    is one between its step and the median; a peer that waits in an older round than a planned
    partner's stops waiting (:func:`moved_past`) and meets it in that round next time.

    :param own_step: this peer's outer step (≥ 0).
    :param others: the other peers' claimed (outer step, round in flight); untrusted values that are
        not ints ≥ 0 are ignored.
    :returns: an int ≥ ``own_step``.
    """
    swarm = max(own_step, swarm_step(own_step, [s for s, _ in others]))
    joined = [r for s, r in others if s == own_step and is_count(r) and own_step <= r <= swarm]
    return max(joined) if swarm > own_step and joined else swarm


def moved_past(round_no: int, outer_step: object, averaging_round: object) -> bool:
    """Whether a planned member will not come to round ``round_no`` any more: its record shows an
    outer step past it (it averaged the round without us) or a later round in flight (it looks for a
    group there, :func:`round_number`). Untrusted values that are not ints count as neither."""
    return any(is_count(v) and v > round_no for v in (outer_step, averaging_round))


def plan_round(
    round_no: int,
    etas: Mapping[str, float],
    *,
    max_group_size: int = DEFAULT_MAX_GROUP_SIZE,
    quorum: float = DEFAULT_QUORUM,
    grace_s: float = DEFAULT_GRACE_S,
) -> RoundPlan:
    """Groups for round ``round_no`` of the peers in ``etas`` (see the module docstring).

    :param round_no: the outer step being averaged (≥ 0); it rotates the grid dimension.
    :param etas: ``{peer id: seconds until its inner phase ends}`` (≤ 0: done already); NaN or
        negative-infinite ETAs count as 0, ``+inf`` as "not coming this round".
    :param max_group_size: the most peers in one group (≥ 2).
    :param quorum: share of peers (by ETA order) the round waits for before the grace window, in (0, 1].
    :param grace_s: seconds after the quorum's ETA that a peer may still arrive (≥ 0).
    :raises ValueError: a bad ``round_no``, ``max_group_size``, ``quorum`` or ``grace_s``.
    """
    if round_no < 0:
        raise ValueError(f"round_no must be ≥ 0, got {round_no}")
    if max_group_size < 2:
        raise ValueError(f"max_group_size must be ≥ 2, got {max_group_size}")
    if not 0.0 < quorum <= 1.0:
        raise ValueError(f"quorum must be in (0, 1], got {quorum}")
    if not grace_s >= 0.0:
        raise ValueError(f"grace_s must be ≥ 0, got {grace_s}")
    clean = {str(p): (0.0 if e != e or e < 0 else float(e)) for p, e in etas.items()}
    coming = sorted((e, p) for p, e in clean.items() if e != math.inf)
    if not coming:
        return RoundPlan(round_no, math.inf, (), tuple(sorted(clean)), max_group_size=max_group_size)
    q = min(len(coming), max(1, math.ceil(quorum * len(coming))))
    deadline = coming[q - 1][0] + grace_s
    expected = sorted(p for e, p in coming if e <= deadline)
    late = tuple(sorted(p for p in clean if clean[p] > deadline))
    if len(expected) <= max_group_size and len(coming) <= max_group_size:
        return RoundPlan(round_no, deadline, tuple(expected), late, {f"r{round_no}:all": tuple(expected)},
                         max_group_size=max_group_size)
    # The grid places every coming peer, the late ones too: peers that read the ETAs a moment apart
    # (one sees a peer just inside the deadline, another just outside) still agree on the groups.
    grid = [p for _, p in coming]
    n = len(grid)
    sides = _grid(n, max_group_size)
    k = round_no % len(sides)
    ranked = sorted(grid, key=_rank_key)

    lines: dict[tuple[int, ...], list[str]] = {}  # the other coordinates -> the line's peers
    for r, peer in enumerate(ranked):
        digits, rest = [], r
        for side in sides:  # mixed radix: the first dimension varies fastest
            digits.append(rest % side)
            rest //= side
        lines.setdefault(tuple(digits[:k] + digits[k + 1:]), []).append(peer)
    on_time = set(expected)
    groups: dict[str, tuple[str, ...]] = {}
    for g, cell in enumerate(_pack_lines([lines[key] for key in sorted(lines)], n, max_group_size)):
        members = tuple(sorted(p for p in cell if p in on_time))
        if members:
            groups[f"r{round_no}:d{k}:g{g}"] = members
    return RoundPlan(round_no, deadline, tuple(expected), late, groups, sides, max_group_size)


def group_for(
    round_no: int,
    peer_id: str,
    etas: Mapping[str, float],
    **kwargs,
) -> tuple[str, tuple[str, ...]]:
    """``(group key, expected members)`` of ``peer_id`` in round ``round_no``: :func:`plan_round`'s
    answer for one peer (``etas`` must include ``peer_id``; keyword arguments as there)."""
    return plan_round(round_no, etas, **kwargs).group_of(peer_id)
