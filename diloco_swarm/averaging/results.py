"""What one averaging round hands back, and the checks its average must pass on our side.

:class:`RoundResult` is a round's outcome as this peer sees it (the pseudo-gradient round and the
θ-mixing round alike); :func:`check_round` is what the average must pass before this peer even
offers its digest (:func:`tensors_digest`) to the other members (``confirm.py``). Plain data and
pure functions, shared by the averager and the confirmation, so neither imports the other.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from diloco_swarm.averaging.allreduce import RMS_FLOOR, RoundStats, allowed_scale, finite_norm
from diloco_swarm.averaging.grouping import gathered_weight

GoneProbe = Callable[[Sequence[str]], set]  # probe(peer ids) -> those of them it finds (gone, or moved on); never raises


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 (first 16 hex digits) over the raw fp32 bytes of ``tensors``, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())  # the buffer itself, no bytes copy
    return h.hexdigest()[:16]


@dataclass
class RoundResult:
    """Outcome of one averaging round, from this peer's point of view.

    ``ok`` is true only when a group of at least two formed, every part of every member
    arrived and passed the checks (in a Δ round a part only over the size bound is left out of its
    slice instead, ``RoundStats.oversized_senders``), the average is finite and within the norm bound, and
    **every** member published the same digest of the average in time (a member that saw a
    partial round publishes "failed" instead). When ``ok`` is false the caller gets its own Δ back.
    """

    ok: bool
    group_size: int  # 1 = no group (solo round)
    reason: str = ""
    group_peer_ids: list[str] = field(default_factory=list)
    group_id: str = ""  # hivemind's group id (hex): the same for every member of the round
    gathered: dict[str, Any] = field(default_factory=dict)  # peer id -> its metadata
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    allreduce_s: float = 0.0  # of ``seconds``: the all-reduce alone, once the group formed (0 where none ran)
    rejected_peers: dict[str, str] = field(default_factory=dict)
    # peer id -> share of the values we reduced on which its part was an outlier, left out (allreduce.RoundStats.
    # outlier_senders): its Δ lay far from the others'; the round keeps the robust average
    outlier_peers: dict[str, float] = field(default_factory=dict)
    # peer id -> why, of every peer our averager banned or avoids once this round's members were judged
    # (conduct.PeerConduct.shunned_peers); None where no all-reduce ran (the node keeps what it last heard)
    avoided_peers: dict[str, str] | None = None
    digest: str = ""
    agreed_peers: int = 0  # members (besides us) whose published digest matched ours
    gone_peers: list[str] = field(default_factory=list)  # silent members found gone: not waited for (confirm.py)
    # we published our digest and no member contradicted it, but not all confirmed in time: a member
    # that heard every confirmation may have kept the round (and our Δ in it), so we apply it too
    maybe_kept: bool = False

    @classmethod
    def solo(cls, started: float, reason: str) -> RoundResult:
        """A round without a group; ``started``: its ``time.perf_counter()`` at the start."""
        return cls(ok=False, group_size=1, reason=reason, seconds=time.perf_counter() - started)

    @classmethod
    def of_allreduce(cls, stats: RoundStats, gathered: dict[str, Any] | None = None,
                     avoided: dict[str, str] | None = None) -> RoundResult:
        """The not yet verified (``ok=False``) result of a finished all-reduce: its group and traffic;
        ``avoided``: the peers our averager shuns after it (``avoided_peers``)."""
        return cls(ok=False, group_size=max(1, len(stats.group_peer_ids)), group_peer_ids=stats.group_peer_ids,
                   group_id=stats.group_id, gathered=gathered if gathered is not None else {},
                   bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received, allreduce_s=stats.allreduce_s,
                   rejected_peers=stats.named_peers,
                   outlier_peers=dict(stats.outlier_senders), avoided_peers=avoided)


def check_round(stats: RoundStats, local: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor], *,
                weight: float, gathered: dict[str, Any], max_norm_ratio: float) -> str | None:
    """Why the average of a finished all-reduce must not be kept, or None.

    :param local: our own input (fp32, the averaged tensors' shapes); ``averaged``: the group's average.
    :param weight: our weight in the round (tokens; 1.0 where the weights are the plan's, θ-mixing).
    :param gathered: peer id -> its gathered metadata; the largest ``weight`` claimed in it widens the
        norm bound (``allreduce.allowed_scale``).
    :param max_norm_ratio: the averager's bound on the average's norm, as a multiple of our own.
    """
    if len(stats.group_peer_ids) < 2:
        return "no group formed"
    if stats.rejected_senders:
        return "rejected " + ", ".join(f"{p} ({r})" for p, r in stats.rejected_senders.items())
    if stats.failed_reducers or stats.failed_values:
        return f"partial round: {stats.failed_values} of {stats.total_values} values missing"
    avg_norm = finite_norm(averaged)
    if avg_norm is None:
        return "the average is not finite"
    local_norm = finite_norm(local) or 0.0  # ours is finite: the runner checked Δ before the round
    scale = allowed_scale(max_norm_ratio, _largest_weight(gathered), weight)
    floor = RMS_FLOOR * math.sqrt(sum(d.numel() for d in local))  # the parts' RMS floor, as a norm
    if avg_norm > scale * max(local_norm, floor):
        return f"the average's norm {avg_norm:.3g} exceeds {scale:.3g}x our own ({local_norm:.3g})"
    return None


def _largest_weight(gathered: dict[str, Any]) -> float:
    """The largest ``weight`` a group member claimed in its gathered metadata (untrusted: 0 if none is valid)."""
    return max([0.0, *(w for w in map(gathered_weight, gathered.values()) if w is not None)])


def short_reason(e: BaseException) -> str:
    """The first line of ``e`` (at most 160 characters), or its type's name: a round's ``reason``."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:160]
