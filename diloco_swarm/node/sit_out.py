"""Carrying out a pause (node/pause.py decides it): the node ends its round in flight, trains nothing,
keeps its record published with ``paused`` set, and on resume rejoins the swarm (rule 66).

The node hands its collaborators in (:class:`SitOut`'s arguments), so this module imports nothing of
node/runner.py.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from diloco_swarm.node.pause import POLL_S, Paused, PauseWatch

PAUSED_UPKEEP_S = 10.0  # a paused node reads the swarm's records this often (its status line's peer count)


class SitOut:
    """The training thread's side of a pause.

    ``pauses``: the owner's control file and ``--active-hours`` (:class:`~diloco_swarm.node.pause.PauseWatch`);
    ``stats``: node/stats.py's counters (``paused``, ``paused_since``, ``paused_s``: goodput leaves pauses out);
    ``finish_round``: ends the round in flight by its own rules, False when a stop came meanwhile;
    ``resume``: after a pause, takes the swarm's state when it moved on (``StateSync.resume``);
    ``show``: the status line (``force``); ``say``: one log line; ``metrics``: the metrics file;
    ``whoami``: (peer id, outer step) now.
    """

    def __init__(self, pauses: PauseWatch, *, stats: Any, stop: Any, housekeeping: Any, metrics: Any,
                 finish_round: Callable[[], bool], resume: Callable[[], None], show: Callable[..., None],
                 say: Callable[[str], None], whoami: Callable[[], tuple[str, int]]):
        self.pauses, self.stats, self.stop, self.housekeeping, self.metrics = pauses, stats, stop, housekeeping, metrics
        self.finish_round, self.resume, self.show, self.say, self.whoami = finish_round, resume, show, say, whoami

    def now(self) -> Paused | None:
        """Why the node is paused now (None: it trains)."""
        return self.pauses.now()

    def __call__(self, paused: Paused) -> None:
        """Sit out ``paused`` and whatever pause follows it, until resumed or stopped. The round in flight
        ends first (applied, held or given up: never half an outer step); the record stays published and
        re-signed, saying ``paused``, so no round waits for us. On resume, the swarm's state is taken when
        the swarm moved on by two steps or more; one step behind, our next round meets the swarm's as a
        late peer's does."""
        if not self.finish_round():
            return  # a stop was requested meanwhile
        started = last_upkeep = self.stats.paused_since = time.monotonic()
        try:
            while not self.stop.requested and paused is not None:
                if paused != self.stats.paused:  # paused now, or for another reason (owner, the window)
                    self._say_paused(paused)
                if time.monotonic() - last_upkeep >= PAUSED_UPKEEP_S:
                    last_upkeep = time.monotonic()
                    self.housekeeping.upkeep_soon()
                    self.show()
                self.stop.event.wait(POLL_S)
                paused = self.pauses.now()
        finally:
            self.stats.paused, last = None, self.stats.paused
            # (a goodput read between these two lines leaves the pause out twice)
            self.stats.paused_s += time.monotonic() - started
            self.stats.paused_since = None
        if self.stop.requested:
            return
        paused_s = time.monotonic() - started
        peer_id, outer_step = self.whoami()
        self.metrics.write({"event": "resume", "peer_id": peer_id, "outer_step": outer_step,
                            "paused_s": round(paused_s, 3), "why": last.why if last else None})
        self.housekeeping.publish_soon()  # "training again": the next rounds plan with us
        self.say(f"resumed after {paused_s:.0f}s paused, at outer step {outer_step}")
        self.resume()
        self.show(force=True)

    def _say_paused(self, paused: Paused) -> None:
        """Our record, the metrics file and the log say we are paused, and why."""
        self.stats.paused = paused
        self.housekeeping.publish_soon()
        peer_id, outer_step = self.whoami()
        self.metrics.write({"event": "pause", "peer_id": peer_id, "outer_step": outer_step,
                            "why": paused.why, "until": paused.until})
        self.say(f"outer step {outer_step}: {paused.describe()}; no inner steps until then (the record stays "
                 "published; no round waits for this node)")
        self.show(force=True)
