"""θ_global as this node holds it: the tensors and outer momentum (``OuterOptimizer``), the outer
step, the state lock, the earlier states kept for θ-mixing, and the marks our record publishes.

Three threads meet here: the training thread changes θ_global (a round applied, a state adopted),
the averaging thread reads it (θ-mixing), and the averager process streams it to a joiner
(``averaging/donation.py``). Every change goes through :meth:`GlobalState.moving_to`, so the history,
the marks and a donation in progress see each change the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any, Callable, Iterator

import torch

from diloco_swarm.averaging.donation import StateSeal
from diloco_swarm.averaging.mixing import MAX_MARKS, standing
from diloco_swarm.averaging.results import tensors_digest
from diloco_swarm.node.outer import OuterOptimizer

State = tuple[int, str]  # (outer step, θ_global digest)
FREEZE_WAIT_S = 10.0  # for the averager process to copy a state it is donating, before we write ours


def theta_digest(theta: list[torch.Tensor]) -> str:
    """sha256 (16 hex digits) of θ_global's fp32 bytes (``averaging.results.tensors_digest``)."""
    return tensors_digest(theta)


class ThetaHistory:
    """θ_global of this node's last few outer steps (fp32 CPU copies): the references θ-mixing can
    use. ``keep`` counts the current θ_global (held by the node, not here): ``keep = 1`` stores
    nothing, which is the default until the swarm averages in groups smaller than itself.

    Besides them, an *anchor*: θ_0, the run's initial θ_global, which every peer rebuilds from the
    run's seed (``models/registry.build``), so every member of any group holds it. It is the
    reference of last resort, when the members share no later state (a grid run's whole-swarm last
    round: its pairs never all held one θ_global), in place of a full-state download. Its int8
    differences grow with the distance from θ_0 (docs/architecture.md)."""

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._states: deque[tuple[State, list[torch.Tensor]]] = deque()
        self._anchor: tuple[State, list[torch.Tensor]] | None = None
        self._lock = threading.Lock()  # the training thread remembers, the averaging thread resizes and reads

    def anchor_on(self, state: State, theta: list[torch.Tensor]) -> None:
        """Keep a copy of ``theta`` (θ_0, outer step 0) as the anchor, listed before the others."""
        with self._lock:
            self._anchor = (state, [t.clone() for t in theta])

    def resize(self, keep: int) -> None:
        with self._lock:
            self._resize(keep)

    def _resize(self, keep: int) -> None:
        self.keep = max(1, keep)
        while len(self._states) > self.keep - 1:
            self._states.popleft()

    def remember(self, state: State, theta: list[torch.Tensor]) -> None:
        """Keep a copy of ``theta``, the θ_global of ``state``, which is about to change."""
        with self._lock:
            if self.keep <= 1:
                return
            self._states.append((state, [t.clone() for t in theta]))
            self._resize(self.keep)

    def states(self, most: int = MAX_MARKS) -> list[State]:
        """The (outer step, digest) pairs held here: the anchor, then the newest ``most`` − 1 others,
        newest last."""
        with self._lock:
            held = [state for state, _ in self._states if self._anchor is None or state != self._anchor[0]]
            anchor = [] if self._anchor is None else [self._anchor[0]]
            room = most - len(anchor)
            return anchor[:most] + (held[-room:] if room > 0 else [])

    def get(self, state: State) -> list[torch.Tensor] | None:
        with self._lock:
            held = [*self._states, *([self._anchor] if self._anchor is not None else [])]
            return next((theta for known, theta in held if known == state), None)


class GlobalState:
    """θ_global, its outer momentum and outer step (see the module docstring).

    :param outer: θ_global (fp32 CPU, the model's parameter shapes) and the outer Nesterov optimizer.
    :param lock: the state lock; the checkpoint writer holds it too while it reads the live tensors.
    :param history: earlier θ_global states, the references of θ-mixing (:class:`ThetaHistory`).
    :param marks: (outer step, digest) of the states we held, newest last: published in our record
        (``NodeStats.theta_marks``), the evidence a joiner trusts (node/canonical.py).
    :param averager: the averager that may be donating this state (None in tests).
    :param log: one line to the user.
    """

    def __init__(self, outer: OuterOptimizer, *, lock: threading.Lock, history: ThetaHistory, marks: deque,
                 averager: Any = None, log: Callable[[str], None] = print, step: int = 0):
        self.outer, self.lock, self.history, self.marks = outer, lock, history, marks
        self.averager, self.log = averager, log
        self.step = step  # the outer step θ_global is at
        # the outer steps its lineage owes for a restart from θ_0 (averaging/mixing.py: standing): set
        # when our join's download failed, taken with every adopted state, kept by our own outer steps
        self.restarted_below = 0
        self._digest_cache: tuple[int, str] | None = None  # (θ_global's write generation, digest)

    @property
    def theta(self) -> list[torch.Tensor]:
        return self.outer.theta

    @property
    def standing(self) -> int:
        """Where θ_global stands among lineages (``mixing.standing``): the outer step, less the debt."""
        return standing(self.step, self.restarted_below)

    def digest(self) -> str:
        """Digest of θ_global, computed once per change (sha256 over every parameter is not free);
        kept only when no write began while it was computed."""
        generation = int(self.outer.generation.item())
        if self._digest_cache is not None and self._digest_cache[0] == generation:
            return self._digest_cache[1]
        digest = theta_digest(self.outer.theta)
        if int(self.outer.generation.item()) == generation:
            self._digest_cache = (generation, digest)
        return digest

    def reference_marks(self) -> list[list]:
        """The states besides the current one that we can mix against ([step, digest] pairs, for the
        round's gathered metadata)."""
        return [[step, digest] for step, digest in self.history.states()]

    def for_donation(self, spec_hash: str, peer_id: str) -> tuple[dict[str, Any], list[torch.Tensor], StateSeal]:
        """(metadata, the live θ_global + outer momentum tensors, their seal), read under the state
        lock: the averager process streams them as they are, and copies them only when we are about
        to write them (:meth:`writing`, averaging/donation.py)."""
        with self.lock:
            seal = StateSeal(self.outer.generation, int(self.outer.generation.item()))
            meta = {"outer_step": self.step, "restarted_below": self.restarted_below, "spec_hash": spec_hash,
                    "theta_digest": self.digest(), "peer_id": peer_id}
            return meta, self.outer.theta + self.outer.momentum_buffers(), seal

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The state lock, for a change of θ_global or the momentum: a donation streaming them goes on
        from a copy the averager process makes first (averaging/donation.py); past
        :data:`FREEZE_WAIT_S` the write goes ahead and such a stream ends (the asker tries again)."""
        with self.lock:
            if self.averager is not None and self.averager.donating():
                if not self.averager.freeze_donations(int(self.outer.generation.item()), timeout=FREEZE_WAIT_S):
                    self.log("a state donation in progress was cut: the averager did not copy the state in time")
            yield

    @contextlib.contextmanager
    def moving_to(self, step: int, digest: str | None = None, restarted_below: int | None = None) -> Iterator[None]:
        """Change θ_global inside this block; it then stands at outer step ``step`` (with the lineage
        debt ``restarted_below`` of an adopted state; None keeps ours: our own outer step). The state it
        leaves is kept as a θ-mixing reference, and the new one is marked (``digest``, when the caller
        knows it, else computed)."""
        with self.writing():
            self.history.remember(self.current(), self.outer.theta)
            yield
            self.step = step
            if restarted_below is not None:
                self.restarted_below = restarted_below
        self.marks.append((self.step, digest or self.digest()))

    def mark(self) -> None:
        """Mark the state we hold now (a resumed checkpoint: with another holder's record, evidence
        for a joiner)."""
        self.marks.append(self.current())

    def current(self) -> State:
        """(outer step, digest) of θ_global now."""
        return self.step, self.digest()
