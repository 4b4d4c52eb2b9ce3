"""DHT upkeep off the training thread: our record, the run spec, the swarm's records, and the
routing table (node/redial.py). Each call into the DHT is time-bounded (dht/calls.py); a slow one
delays only the next upkeep."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from diloco_swarm.dht.ledger import keep_records, leaderboard
from diloco_swarm.dht.records import read_peer_records
from diloco_swarm.dht.swarm import refresh_run_spec
from diloco_swarm.node.round_policy import SILENT_RECORDS
from diloco_swarm.node.redial import REDIAL_EVERY_S, reconnect_peers
from diloco_swarm.utils.worker import Worker


class Housekeeping:
    """The ``housekeeping`` thread (records, run spec, the swarm's records) and the ``reconnect``
    thread (dials take seconds). ``remember_peers(records)``: keeps the addresses for restarts
    (node/known_peers.py)."""

    def __init__(self, *, stats: Any, swarm: Any, log: Callable[[str], None], stop: Any):
        self.stats, self.swarm, self.log, self.stop = stats, swarm, log, stop
        self.spec = self.dht = self.records = self.remember_peers = None  # set by start()
        self.me = ""  # our peer id (set by start()): our own row of the leaderboard is first-hand
        self._worker = Worker("housekeeping")
        self._reconnect = Worker("reconnect")
        self._last_reconnect = 0.0  # time.monotonic() of the last ReconnectPeers pass
        self._reconnecting = None  # its future: one pass at a time
        self._unreachable_said = 0  # peers the last pass could not reach, as last logged

    def start(self, spec: Any, dht: Any, records: Any, remember_peers: Callable[[dict], None], me: str = "") -> None:
        """Once the DHT runs and our record is published (``spec``: the run spec, RunSpec; ``me``: our peer id)."""
        self.spec, self.dht, self.records, self.remember_peers, self.me = spec, dht, records, remember_peers, me

    def submit(self, fn: Callable[[], Any]):
        """Run ``fn`` on the housekeeping thread. :raises RuntimeError: it is closed."""
        return self._worker.submit(fn)

    def publish_soon(self) -> None:
        """Re-publish our record now (a new phase, a round named in it), unless the node is closing."""
        with contextlib.suppress(RuntimeError):
            self._worker.submit(self.records.publish_now)

    def upkeep(self) -> None:
        """Publish our record, refresh the run spec, read the swarm's records (peers seen, their speeds
        for DyLU, the addresses kept for restarts, the leaderboard), and put peers the DHT dropped under load back into
        its routing table. Never raises."""
        with contextlib.suppress(Exception):
            self.records.publish_now()
            refresh_run_spec(self.dht, self.spec)
            records = read_peer_records(self.dht, self.spec.run_id, organiser=self.spec.organiser)
            self.swarm.note(records)
            # live peers, us included, as the --wait-for-peers barrier counts them (a crashed peer's record
            # outlives it unchanged): the status line's `peers N`
            self.stats.peers_seen = 1 + len(self.swarm.live(records, SILENT_RECORDS * self.records.interval_s))
            self.remember_peers(records)
            if records:  # our view of the ledger, peers that left included, kept in the checkpoint for export's card
                self.stats.ledger_records = keep_records(self.stats.ledger_records, records)
                self.stats.leaderboard = leaderboard(self.stats.ledger_records,
                                                     first_hand={self.me, *self.stats.rounds_with})
        now = time.monotonic()
        busy = self._reconnecting is not None and not self._reconnecting.done()
        if now - self._last_reconnect >= REDIAL_EVERY_S and self.swarm.recent_peers and not busy:
            self._last_reconnect = now
            self._reconnecting = self._reconnect.submit(
                self._reconnect_peers, {p: maddrs for p, (_, maddrs) in self.swarm.recent_peers.items()})

    def upkeep_soon(self) -> None:
        """:meth:`upkeep` on the housekeeping thread, unless the node is closing."""
        with contextlib.suppress(RuntimeError):
            self._worker.submit(self.upkeep)

    def _reconnect_peers(self, peers: dict[str, list[str]]) -> None:
        """Reconnect thread: put the peers whose records we read lately back into the DHT's routing
        table if it dropped them (node/redial.py)."""
        missing, answered = reconnect_peers(self.dht, peers, stop=self.stop)
        if answered:
            self.log(f"the DHT had dropped {answered} live peer{'s' if answered != 1 else ''} of the swarm "
                     "(calls to them timed out); they are back in its routing table")
        unreachable = missing - answered
        if unreachable != self._unreachable_said:  # said once per change: a split view of the swarm shows in the log
            self._unreachable_said = unreachable
            if unreachable:
                self.log(f"{unreachable} of the {len(peers)} peers whose records we read lately are not in the "
                         "DHT's routing table and did not answer a dial (gone, or unreachable from here)")

    def close(self) -> None:
        self._worker.close()
        self._reconnect.close()
