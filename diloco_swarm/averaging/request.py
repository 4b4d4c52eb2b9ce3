"""What one pseudo-gradient averaging round is asked to do: :class:`RoundRequest`, the input of
``PseudoGradientAverager.average`` (``averager.py``).

The node builds one per round (``node/round.py``: ``Round._all_reduce``) from its Δ, its tokens and
the round's plan. Part of it travels: :meth:`RoundRequest.gather` is the metadata every member's
averager gathers from every other (``docs/protocol.md``), read back in the averager process by
``matchmaking.round_settings``; the rest stays in the caller's process and bounds its waits.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from diloco_swarm.averaging.confirm import DIGEST_WAIT_S
from diloco_swarm.averaging.grouping import gathered_weight
from diloco_swarm.averaging.results import GoneProbe


@dataclass(frozen=True, kw_only=True)
class RoundRequest:
    """One round's inputs to ``PseudoGradientAverager.average``.

    :param delta: this peer's pseudo-gradient Δ: one tensor per averaged buffer, the buffers' shapes
        and order (the model's parameters); any dtype and device, read as fp32 on the CPU, never changed.
    :param weight: tokens this peer processed since its last sync (> 0): its weight in the group's
        average, and gathered by every member (the largest scales the bound on the average's norm).
    :param metadata: small msgpack-able dict gathered from every member (outer step, θ digest...);
        the averager adds the round's settings to it (:meth:`gather`), which win over keys of the same name.
    :param timeout: seconds to wait for a group before giving up (a solo round).
    :param digest_wait: seconds to wait for every other member's digest of the average
        (returns as soon as all arrived or one differs); a member still silent then makes
        the round failed.
    :param stop: when set, the round in flight is abandoned (graceful leave).
    :param give_up: when set while still looking for a group, stop looking (a solo round);
        a group that already formed finishes its all-reduce.
    :param scheduled_time: DHT time (s) at which the all-reduce should begin (hivemind's
        ``step(scheduled_time=...)``): the leader waits for followers until then, at most 0.9 of
        ``timeout`` from the call. A client (it never leads) ignores it and joins any leader that
        begins within ``timeout``. None: hivemind's default (now + the averager's matchmaking time).
    :param online_peers: peers of the run online now, this one included: a group must then
        hold a strict majority of them (``grouping.majority_quorum``); None: any 2 peers.
    :param group_bits: hivemind group bits of this round's planned group (``mixing.group_bits``
        of a ``grouping.plan_round`` key): only peers with the same bits meet; "" = the run's one key.
    :param group_size: the planned group's size, this peer included (the leader starts once it is
        full); None: the averager's ``target_group_size``.
    :param group_cap: the most peers the round's plan put in one group (``grouping.RoundPlan.
        max_group_size``); None: the averager's ``target_group_size``. A group without bits while
        ``online_peers`` is at most this is the whole swarm's round: it needs a majority of them
        and its members' outer steps are judged (``grouping.step_quorum_problem``), however few
        peers the plan expected; beyond the cap any 2 peers may average.
    :param gone: ``gone(peer_ids)`` returns those whose process is gone (bounded in time, never
        raises); the digest cross-check stops waiting for them (``confirm.Confirmation.cross_check``),
        and so does a group still forming past ``members_due``. None: wait for every member.
    :param members: the planned group's other members (peer ids, base58); with ``members_due``.
    :param members_due: unix time (s) by which every one of ``members`` should have joined. While the
        group still forms after it, every ``matchmaking.LATE_MEMBER_PROBE_EVERY_S`` the members that are
        gone are asked for (``gone``) and taken off the target size (``matchmaking.lower_target``): a
        member killed after the round was planned no longer holds the others until
        ``scheduled_time``; when none is left, the round ends at once (solo, not ``ok``).
        None: never asked.
    :param moved_on: ``moved_on(peer_ids)`` returns those that finished this round without us (their
        records show a later outer step: they averaged before we arrived); asked with ``gone``, and
        those are dropped alike, so a late peer stops waiting for a group that already ran.
    :raises TypeError, ValueError: ``weight``, ``timeout`` or ``digest_wait`` is not a number in its
        range, or ``metadata`` is not a dict.
    """

    delta: Sequence[torch.Tensor] = field(repr=False)
    weight: float
    metadata: dict[str, Any]
    timeout: float
    digest_wait: float = DIGEST_WAIT_S
    stop: threading.Event | None = None
    give_up: threading.Event | None = None
    scheduled_time: float | None = None
    online_peers: int | None = None
    group_bits: str = ""
    group_size: int | None = None
    group_cap: int | None = None
    gone: GoneProbe | None = None
    members: Sequence[str] = ()
    members_due: float | None = None
    moved_on: GoneProbe | None = None

    def __post_init__(self):
        weight, timeout, digest_wait = (_number(self, name) for name in ("weight", "timeout", "digest_wait"))
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"RoundRequest.weight must be a positive number of tokens, got {self.weight!r}")
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"RoundRequest.timeout must be a positive number of seconds, got {self.timeout!r}")
        if not digest_wait >= 0:
            raise ValueError(f"RoundRequest.digest_wait must be a non-negative number of seconds, "
                             f"got {self.digest_wait!r}")
        if not isinstance(self.metadata, dict):
            raise TypeError(f"RoundRequest.metadata must be a dict, got {type(self.metadata).__name__}")

    def gather(self) -> dict[str, Any]:
        """The metadata this peer's averager sends every member (hivemind's ``gather``): ``metadata``
        and the round's settings (``docs/protocol.md``; read back by ``matchmaking.round_settings``)."""
        return {**self.metadata, "weight": float(self.weight), "online_peers": self.online_peers,
                "group_bits": self.group_bits, "group_size": self.group_size, "group_cap": self.group_cap}


class GatheredEntry(NamedTuple):
    """One member's entry in its group's gathered data, decoded (:func:`gathered_entries`); untrusted."""

    fields: Sequence  # hivemind's (advertised bandwidth, averaging mode, metadata bytes); a modified peer may send more
    meta: dict  # the metadata decoded (:meth:`RoundRequest.gather`); {} where it is not a dict


def gathered_entries(gathered: Sequence[bytes], loads: Callable[[bytes], Any]) -> list[GatheredEntry | None]:
    """Each member's entry from hivemind's gathered bytes, in the group's order (``loads``: the averager's
    serializer): the one parse of them (weights, caps, the group's judgement); None where the entry or its
    metadata (the entry's third field) does not decode. Every byte came from another peer: nothing is checked
    but that it decodes."""
    entries: list[GatheredEntry | None] = []
    for g in gathered:
        try:
            fields = loads(g)
            meta = loads(fields[2])
        except Exception:  # malformed gathered data: hivemind's own parsing refuses the group
            entries.append(None)
            continue
        entries.append(GatheredEntry(fields, meta if isinstance(meta, dict) else {}))
    return entries


def gathered_weights(entries: Sequence[GatheredEntry | None]) -> list[float | None]:
    """Each member's ``weight`` (:meth:`RoundRequest.gather`) from its gathered entry (:func:`gathered_entries`),
    in the group's order; None where unreadable or not a finite number (untrusted: ``grouping.gathered_weight``)."""
    return [None if entry is None else gathered_weight(entry.meta) for entry in entries]


def _number(request: RoundRequest, name: str) -> float:
    value = getattr(request, name)
    if not isinstance(value, numbers.Real):  # int, float, numpy scalars
        raise TypeError(f"RoundRequest.{name} must be a number, got {value!r}")
    return float(value)
