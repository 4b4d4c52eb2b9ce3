"""Error feedback of the sparse modes: what a peer did not send of its Δ, kept and sent later.

SparseLoCo (Sarfi et al., arXiv 2508.15706, Algorithm 1; after EF-SGD, Karimireddy et al., arXiv
1901.09847): a peer sends ``C(Δ + e)``, the top entries of each chunk in int8 (averaging/sparse.py),
and keeps ``e ← Δ + e − C(Δ + e)``. Nothing is lost: over any run of rounds, what was sent plus the
residual equals the sum of the Δs (exact up to fp32 addition).

The residual is this peer's state (fp32, θ's shapes, 4 B/param), checkpointed with θ_global. What
happens to it is ``round_policy.feedback_action``'s decision, applied by the node after each round:

* the group's average (or a mix or state that includes it) was applied: ``commit`` what the wire
  carried (``sent``); our own selection applied alone (a failed round no longer carried): ``commit``
  the selection's exact values;
* a late round, or a state adopted while Δ is carried: nothing, the next round sends Δ + e again;
* our Δ dropped (caught up, a state adopted that lacks our round, Δ not carried): ``reset``: the
  residual stands on the same stale θ_global as the dropped Δ;
* a solo or skipped round applies Δ alone: nothing, the residual waits for the next group.

A state download gives a joiner θ_global, never a residual (it is a peer's own): it starts at zero,
and a node that downloads a state (a join, the end of a run: ``StateSync.download_and_adopt``) resets
its own before that state's checkpoint is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from diloco_swarm.averaging import sparse


class Feedback(Enum):
    """What the error feedback does after a round (``round_policy.feedback_action`` decides it)."""

    COMMIT_SENT = "commit-sent"  # the group's average holds what the wire carried of our selection
    COMMIT_OWN = "commit-own"  # our selection itself was applied, alone (a failed round not carried)
    KEEP = "keep"  # nothing of the selection was applied: Δ + e goes into the next round again
    RESET = "reset"  # our Δ was dropped: the residual stands on the same stale θ_global


@dataclass
class Selection:
    """What one round sends of Δ + e.

    :param dense: per tensor, Δ + e at the selected positions and 0 elsewhere (fp32, θ's shapes): the
        all-reduce's input, whose wire encoding decodes to ``sent``. Dropped (None) once the round ran.
    :param positions: per tensor, the selected flat positions (int64 ``[m]``).
    :param raw: per tensor, Δ + e at ``positions`` (fp32 ``[m]``).
    :param sent: per tensor, what the wire carries there (fp32 ``[m]``; 0 where the code rounded to 0).
    """

    dense: list[torch.Tensor] | None
    positions: list[torch.Tensor]
    raw: list[torch.Tensor]
    sent: list[torch.Tensor]


class ErrorFeedback:
    """The residual ``e`` and the selection of each round (module docstring).

    :param shapes: θ's tensor shapes, in order.
    :param per_chunk: entries kept per chunk of ``sparse.CHUNK`` values (``sparse.SPARSE_MODES``).
    """

    def __init__(self, shapes: Sequence[torch.Size], per_chunk: int):
        self.per_chunk = per_chunk
        self.residual = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    @torch.no_grad()
    def select(self, delta: Sequence[torch.Tensor]) -> Selection:
        """The top ``per_chunk`` entries of each chunk of Δ + e, per tensor (``delta``: fp32 CPU, θ's shapes;
        neither it nor ``e`` changes). One tensor-sized temporary at a time besides ``dense``."""
        dense, positions, raw, sent = [], [], [], []
        for d, e in zip(delta, self.residual):
            target = d.to(torch.float32) + e
            where, values, received = sparse.sparsify(target, self.per_chunk)  # (one selection: the costly part)
            chosen = torch.zeros(target.numel(), dtype=torch.float32)
            chosen[where] = values
            dense.append(chosen.reshape(target.shape))
            positions.append(where)
            raw.append(values)
            sent.append(received)
        return Selection(dense, positions, raw, sent)

    @torch.no_grad()
    def commit(self, delta: Sequence[torch.Tensor], selection: Selection, exact: bool = False) -> None:
        """``e ← Δ + e − sent`` (``exact``: the selection's own values were applied, ``e ← Δ + e − raw``)."""
        for d, e, where, values in zip(delta, self.residual, selection.positions,
                                       selection.raw if exact else selection.sent):
            e.add_(d.to(torch.float32))  # (e + Δ: the same fp32 sum select() took)
            e.view(-1)[where] -= values

    def settle(self, action: Feedback, delta: Sequence[torch.Tensor], selection: Selection | None) -> None:
        """Carry out ``action`` for the round that sent ``selection`` of ``delta`` + e."""
        if action is Feedback.RESET:
            self.reset()
        elif action is not Feedback.KEEP and selection is not None:
            self.commit(delta, selection, exact=action is Feedback.COMMIT_OWN)

    def reset(self) -> None:
        for e in self.residual:
            e.zero_()

    def load(self, residual: Sequence[torch.Tensor]) -> None:
        """Take a checkpoint's residual. :raises ValueError: another count, shape or a non-finite value."""
        if len(residual) != len(self.residual) or any(
                not isinstance(r, torch.Tensor) or r.shape != e.shape for r, e in zip(residual, self.residual)):
            raise ValueError("the error-feedback residual does not fit this model")
        if not all(bool(torch.isfinite(r).all()) for r in residual):
            raise ValueError("the error-feedback residual holds a non-finite value")
        for e, r in zip(self.residual, residual):
            e.copy_(r)
