"""Which peers an averager keeps out of its groups, judged by their conduct in its all-reduces.

A member whose part broke the protocol (refused for anything but being slow, incomplete or above
the size bound) is banned for the averager's life: we never join a group it leads, nor let it join
ours. A judgement that is not proof is a while's avoidance instead: a Δ above the size bound, or a
reducer that refused our valid part :data:`AVOID_AFTER_REFUSALS` times within :data:`AVOID_MEMORY_S`.
Lives in the averager process.
"""

from __future__ import annotations

import time

from hivemind.utils import get_logger

from diloco_swarm.averaging.allreduce import REFUSED_OUR_PART, SIZE_REASON, RoundStats

logger = get_logger(__name__)

AVOID_AFTER_REFUSALS = 2  # a reducer that refused our valid part this many times within AVOID_MEMORY_S ...
AVOID_MEMORY_S = 600.0
AVOID_REFUSER_S = 300.0  # ... is avoided this long (one refusal can be an honest peer's bound at a bad moment)


class PeerConduct:
    """The peers this averager bans (for good) or avoids (until a time), by peer id (base58)."""

    def __init__(self):
        self.banned: set[str] = set()
        self._avoided: dict[str, float] = {}  # peer id -> time.monotonic() until which we avoid it
        self._refusals: dict[str, list[float]] = {}  # peer id -> when it refused our valid part (monotonic)

    def judge(self, stats: RoundStats) -> None:
        """Ban or avoid the members whose conduct in a finished all-reduce showed them hostile."""
        for peer, reason in stats.rejected_senders.items():
            if SIZE_REASON in reason:  # a judgement on an unusual Δ, not proof: avoid it a while
                self.avoid(peer, AVOID_REFUSER_S, f"its Δ was too large ({reason})")
            elif "too slow" not in reason and "did not send all parts" not in reason:
                self.banned.add(peer)  # broke the protocol: never lead it again
        for peer, reason in stats.failed_reducers.items():
            # Our part was valid (we are honest): that reducer refuses honest members. A reducer
            # that timed out is not avoided: under load an honest one does too, and a crashed one is gone.
            if REFUSED_OUR_PART in reason:
                now = time.monotonic()
                recent = [t for t in self._refusals.get(peer, []) if now - t < AVOID_MEMORY_S] + [now]
                self._refusals[peer] = recent
                if len(recent) >= AVOID_AFTER_REFUSALS:
                    self.avoid(peer, AVOID_REFUSER_S, f"it refused our valid part {len(recent)} times")

    def avoid(self, peer: str, seconds: float, why: str) -> None:
        """Neither join a group this peer leads nor let it join ours, for ``seconds``."""
        self._avoided[peer] = time.monotonic() + seconds
        logger.warning(f"Avoiding peer {peer} for {seconds:.0f}s: {why}")

    def avoids(self, peer: str) -> bool:
        """Whether ``peer`` is avoided now (an avoidance that ran out is forgotten)."""
        until = self._avoided.get(peer)
        if until is not None and time.monotonic() >= until:
            del self._avoided[peer]
            return False
        return until is not None

    def shuns(self, peer: str) -> bool:
        """Whether ``peer`` is banned or avoided now: it may not join our groups."""
        return peer in self.banned or self.avoids(peer)

    def shunned(self) -> int:
        """How many peers are banned or avoided now (they never join our groups, so no quorum counts them)."""
        return len(self.banned) + sum(1 for p in list(self._avoided) if self.avoids(p))
