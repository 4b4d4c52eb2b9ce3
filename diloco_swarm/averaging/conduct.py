"""Which peers an averager keeps out of its groups, judged by their conduct in its all-reduces.

A member whose part broke the protocol (refused for anything but being slow, incomplete or above
the size bound) is banned for the averager's life: we never join a group it leads, nor let it join
ours. A judgement that is not proof is a while's avoidance instead: a Δ above the size bound; a
reducer that refused our valid part :data:`AVOID_AFTER_REFUSALS` times within :data:`AVOID_MEMORY_S`;
a sender whose parts our reducer left out as outliers (``allreduce.RoundStats.outlier_senders``) in
:data:`AVOID_AFTER_OUTLIER_ROUNDS` rounds in a row in which it sent parts to our slice. Lives in the
averager process; :meth:`PeerConduct.shunned_peers` is what the node publishes (``RoundResult.avoided_peers``).
"""

from __future__ import annotations

import time
from typing import Callable

from hivemind.utils import get_logger

from diloco_swarm.averaging.allreduce import REFUSED_OUR_PART, SIZE_REASON, WEIGHT_REASON, RoundStats

logger = get_logger(__name__)

AVOID_AFTER_REFUSALS = 2  # a reducer that refused our valid part this many times within AVOID_MEMORY_S ...
AVOID_MEMORY_S = 600.0
AVOID_REFUSER_S = 300.0  # ... is avoided this long (one refusal can be an honest peer's bound at a bad moment)
AVOID_AFTER_OUTLIER_ROUNDS = 3  # a sender left out as an outlier in this many of its rounds with us in a row ...
# ... is avoided this long. Not banned: an outlier is a judgement, not proof (an honest peer whose data
# or phase differs from the group's may be one for a while), so it may come back and be judged again.
AVOID_OUTLIER_S = 3600.0


class PeerConduct:
    """The peers this averager bans (for good) or avoids (until a time), by peer id (base58).

    :param clock: seconds, monotonic (``time.monotonic``; a test's own clock).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.banned: dict[str, str] = {}  # peer id -> why
        self._avoided: dict[str, tuple[float, str]] = {}  # peer id -> (clock time until which we avoid it, why)
        self._refusals: dict[str, list[float]] = {}  # peer id -> when it refused our valid part (clock)
        self._outlier_rounds: dict[str, int] = {}  # peer id -> its rounds with us in a row in which it was an outlier

    def judge(self, stats: RoundStats) -> None:
        """Ban or avoid the members whose conduct in a finished all-reduce showed them hostile."""
        for peer, reason in {**stats.oversized_senders, **stats.rejected_senders}.items():
            if SIZE_REASON in reason:  # a judgement on an unusual Δ, not proof: avoid it a while
                self.avoid(peer, AVOID_REFUSER_S, f"its Δ was too large ({reason})")
            elif WEIGHT_REASON in reason:  # the leader's gathered list may be the liar: avoid it a while
                self.avoid(peer, AVOID_REFUSER_S, f"its parts' weight was not the one gathered ({reason})")
            elif "too slow" not in reason and "did not send all parts" not in reason:
                self.banned[peer] = f"it broke the protocol ({reason})"  # never lead it again
        for peer, reason in stats.failed_reducers.items():
            # Our part was valid (we are honest): that reducer refuses honest members. A reducer
            # that timed out is not avoided: under load an honest one does too, and a crashed one is gone.
            if REFUSED_OUR_PART in reason:
                now = self._clock()
                recent = [t for t in self._refusals.get(peer, []) if now - t < AVOID_MEMORY_S] + [now]
                self._refusals[peer] = recent
                if len(recent) >= AVOID_AFTER_REFUSALS:
                    self.avoid(peer, AVOID_REFUSER_S, f"it refused our valid part {len(recent)} times")
        self._score_outliers(stats)

    def _score_outliers(self, stats: RoundStats) -> None:
        """Count each sender's rounds in a row with an outlier part; a round in which it sent parts to
        our slice and was no outlier resets its count. A round without its parts (another group, a
        θ-mixing round, whose plain mean names no outlier) leaves the count as it is."""
        for peer in [*stats.scored_senders, *(p for p in stats.outlier_senders if p not in stats.scored_senders)]:
            if peer not in stats.outlier_senders:
                self._outlier_rounds.pop(peer, None)
                continue
            rounds = self._outlier_rounds.get(peer, 0) + 1
            if rounds < AVOID_AFTER_OUTLIER_ROUNDS:
                self._outlier_rounds[peer] = rounds
                continue
            del self._outlier_rounds[peer]  # judged afresh once the avoidance ends
            self.avoid(peer, AVOID_OUTLIER_S, f"its Δ was an outlier in {rounds} rounds in a row")

    def avoid(self, peer: str, seconds: float, why: str) -> None:
        """Neither join a group this peer leads nor let it join ours, for ``seconds``."""
        held = self._avoided.pop(peer, None)  # (re-inserted: shunned_peers() lists the newest avoidance last)
        until = self._clock() + seconds
        self._avoided[peer] = held if held is not None and held[0] > until else (until, why)  # the longer one holds
        logger.warning(f"Avoiding peer {peer} for {seconds:.0f}s: {why}")

    def avoids(self, peer: str) -> bool:
        """Whether ``peer`` is avoided now (an avoidance that ran out is forgotten)."""
        held = self._avoided.get(peer)
        if held is not None and self._clock() >= held[0]:
            del self._avoided[peer]
            return False
        return held is not None

    def shuns(self, peer: str) -> bool:
        """Whether ``peer`` is banned or avoided now: it may not join our groups."""
        return peer in self.banned or self.avoids(peer)

    def shunned(self) -> int:
        """How many peers are banned or avoided now (they never join our groups, so no quorum counts them)."""
        return len(self.shunned_peers())

    def shunned_peers(self) -> dict[str, str]:
        """Peer id -> why, of every peer banned or avoided now (the banned first, then the avoided, newest last)."""
        avoided = {p: self._avoided[p][1] for p in list(self._avoided) if p not in self.banned and self.avoids(p)}
        return {**self.banned, **avoided}
