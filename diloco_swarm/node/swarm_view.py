"""What one peer knows of the swarm from the signed records it read (dht/records.py).

Written by the housekeeping thread (every upkeep), the averaging thread (once per round) and, before
training, the training thread (the ``--wait-for-peers`` barrier: ``Startup._live_peers``); read
by the training thread (DyLU), the round (who is silent, the grid's members) and the end of a run
(whom to wait for). Each attribute is replaced whole, never changed in place, so readers on other
threads need no lock.

A record's ``updated`` is its owner's clock when it signed it, and we read it after that: a fresh one
(changed since our last read) never looks newer than our clock unless the two clocks disagree. One
that looks newer by more than the swarm's tolerance is said once (:meth:`SwarmView.note`): the peers
whose clocks run ahead then take our records and group requests as expired.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from diloco_swarm.utils import clock

logger = logging.getLogger(__name__)

HEARD_MEMORY_S = 120.0  # how long we remember when a peer's record last changed
GRID_MEMORY_S = 20.0  # a peer whose record a read missed stays in the round's grid this long (a partial read under load)


class SwarmView:
    """The other peers as this peer read them: speeds, hand-off times, silence, addresses."""

    def __init__(self, me: str = ""):
        self.me = me  # our own peer id (set once the DHT runs)
        self.inner_step_s: float | None = None  # the online peers' median seconds per inner step (DyLU)
        self.phase_eta: float | None = None  # the other online peers' median hand-off time (unix s)
        self.heard: dict[str, tuple[float, float]] = {}  # peer id -> (its record's `updated`, time.monotonic() first read)
        self.recent_peers: dict[str, tuple[float, list[str]]] = {}  # peer id -> (time.monotonic() read, its maddrs)
        self.grid_records: dict[str, tuple[float, Any]] = {}  # peer id -> (time.monotonic() read, its record)
        self._lead_said = 0.0  # seconds ahead of our clock of the fresh records last said (0: none)

    def note(self, records: Mapping[str, Any]) -> None:
        """Take one read of the records: the medians, and since when each record is unchanged (a
        crashed peer's record outlives it by the DHT's TTL, unchanged)."""
        now = time.monotonic()
        self._note_clocks({p: r.updated for p, r in records.items()
                           if p != self.me and (p not in self.heard or self.heard[p][0] != r.updated)})
        heard = {p: h for p, h in self.heard.items() if now - h[1] < HEARD_MEMORY_S}  # a record gone from this read stays silent
        heard.update((p, heard[p] if p in heard and heard[p][0] == r.updated else (r.updated, now))
                     for p, r in records.items())
        self.heard = heard
        recent = {p: v for p, v in self.recent_peers.items() if now - v[0] < HEARD_MEMORY_S}
        recent.update((p, (now, list(r.maddrs))) for p, r in records.items()
                      if p != self.me and r.reachability != "client" and r.maddrs)
        self.recent_peers = recent
        # a paused peer (node/pause.py) keeps its last speed and hand-off time: neither sizes our phases
        training = {p: r for p, r in records.items() if getattr(r, "paused", None) is None}
        speeds = sorted(r.inner_step_s for r in training.values() if r.inner_step_s > 0)
        self.inner_step_s = speeds[len(speeds) // 2] if speeds else None
        etas = sorted(r.phase_eta for p, r in training.items() if p != self.me and r.phase_eta > 0)
        self.phase_eta = etas[len(etas) // 2] if etas else None

    def _note_clocks(self, fresh: Mapping[str, float]) -> None:
        """One line when fresh records (peer id -> ``updated``) carry times ahead of our clock by more than
        the swarm's tolerance, and again only when that lead moves by as much."""
        if not fresh:
            return
        peer, updated = max(fresh.items(), key=lambda item: item[1])
        lead = updated - clock.now()
        if lead <= clock.CLOCK_TOLERANCE_S:
            self._lead_said = 0.0
        elif abs(lead - self._lead_said) > clock.CLOCK_TOLERANCE_S:
            self._lead_said = lead
            logger.warning(
                f"warning: peer {peer}'s record carries a time {lead:.1f} s ahead of this node's clock (peers' clocks "
                f"may differ by {clock.CLOCK_TOLERANCE_S:g} s): one of the two machines' clocks is wrong, and while "
                "they disagree that peer takes this node's records and group requests as expired. Sync the clock "
                "with NTP and restart the node whose machine's clock is wrong")

    def live(self, records: Mapping[str, Any], max_silent_s: float, now: float | None = None) -> set[str]:
        """The other peers of ``records`` (one read, after :meth:`note`) whose record changed within
        ``max_silent_s`` as we read it: a crashed peer's record outlives it, unchanged."""
        now = time.monotonic() if now is None else now
        return {p for p in records if p != self.me and self.silent_s(p, now) <= max_silent_s}

    def silent_s(self, peer: str, now: float) -> float:
        """Seconds (``time.monotonic``) since we first read the record of ``peer`` that we read last."""
        heard = self.heard.get(peer)
        return now - heard[1] if heard is not None else 0.0

    def round_peers(self, records: Mapping[str, Any], paused: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The other peers a round plans with: this read's, plus those a read of the last
        :data:`GRID_MEMORY_S` seconds held (a read that misses a record, on a loaded machine, must not
        give us a grid of our own), less the ``paused`` ones this read found (no round waits for them).
        peer id -> its record."""
        seen = time.monotonic()
        kept = {p: (t, r) for p, (t, r) in self.grid_records.items() if seen - t < GRID_MEMORY_S and p not in paused}
        kept.update((p, (seen, r)) for p, r in records.items() if p != self.me)
        self.grid_records = kept
        return {p: r for p, (_, r) in kept.items()}
