"""This process's clock for every time another peer reads: the machine's clock as it read at start,
advanced by a clock that never steps.

Peers compare each other's unix times: DHT expirations (a record lives 15 s, a group request a few
seconds), matchmaking's scheduled times, records' ``updated`` and ``phase_eta``. hivemind checks that
two peers' clocks agree within 3 s once, at the bootstrap ping, and reads ``time.time`` ever after.
A machine's clock that NTP steps later (a laptop waking from sleep) then cut its node off: stepped
back 30 s, its records expired in the other peers' DHT as they were stored, and the other peer of a
two-peer swarm averaged alone; stepped 8 s, both peers' group requests expired and both waited out
every averaging window (issue 37, measured with a shim on ``clock_gettime``).

:func:`now` reads the machine's clock once, when this module is imported (before the node forks its
DHT and averager processes, which inherit the reading), and from then on adds the seconds of
Linux's ``CLOCK_BOOTTIME``: a monotonic clock that counts suspended time too, so a wake from sleep
moves it as it moves the machine's clock; NTP's rate corrections slew it, NTP's steps never reach
it. hivemind's ``get_dht_time`` is pointed here (utils/hivemind_fixes.py). A node that keeps its
own clock after the machine's stepped says so in one line (:class:`ClockWatch`); a restart takes the
machine's clock again, and the bootstrap ping checks it against the swarm's.
"""

from __future__ import annotations

import sys
import time

# the most two peers' clocks may differ: hivemind's MAX_DHT_TIME_DISCREPANCY_SECONDS, which it checks
# at the bootstrap ping (named here: this module must not import hivemind, the light client reads it)
CLOCK_TOLERANCE_S = 3.0

# a clock that counts suspended time and never steps: Linux's CLOCK_BOOTTIME (its CLOCK_MONOTONIC, and so
# time.monotonic, stops while the machine sleeps); macOS's CLOCK_MONOTONIC (the light client's machines)
_STEADY = getattr(time, "CLOCK_BOOTTIME", None) or (time.CLOCK_MONOTONIC if sys.platform == "darwin" else None)


def _steady() -> float:
    return time.clock_gettime(_STEADY) if _STEADY is not None else time.monotonic()


_START_WALL = time.time()  # read once per process tree: forked children inherit both readings
_START_STEADY = _steady()


def now() -> float:
    """Unix seconds by this process's clock: the machine's clock at start plus the steady seconds since."""
    return _START_WALL + (_steady() - _START_STEADY)


def machine_offset() -> float:
    """Seconds the machine's clock reads ahead of :func:`now` (negative: behind): the sum of its steps
    since start, plus the drift between the two clocks (milliseconds a day)."""
    return time.time() - now()


def started_at() -> float:
    """The machine's clock (unix s) when this process tree read it."""
    return _START_WALL


class ClockWatch:
    """Says, in one line, when the machine's clock has moved away from this process's :func:`now`
    by more than :data:`CLOCK_TOLERANCE_S`, and again only when it moves that much more (or back)."""

    def __init__(self) -> None:
        self._said = 0.0  # the offset last said (0: none)

    def check(self, where: str = "") -> str | None:
        """The line to log now, or None. :param where: when it was seen (``"at outer step 7"``)."""
        offset = machine_offset()
        if abs(offset - self._said) <= CLOCK_TOLERANCE_S:
            return None
        self._said = offset
        started = time.strftime("%H:%M:%S", time.localtime(started_at()))
        if abs(offset) <= CLOCK_TOLERANCE_S:
            return (f"this machine's clock agrees with this node's own again (within {offset:+.1f} s){_at(where)}; "
                    f"the node keeps the clock it started with at {started}")
        return (f"warning: this machine's clock jumped {'back' if offset < 0 else 'ahead'} {abs(offset):.1f} s"
                f"{_at(where)} (NTP, or a wake from sleep?): this node keeps the clock it started with at {started}, "
                "which agreed with the swarm's then, so the peers still take its records and group requests. A "
                "restart of the node takes the machine's clock again, and refuses it if it is not within "
                f"{CLOCK_TOLERANCE_S:g} s of the swarm's")


def _at(where: str) -> str:
    return f" {where}" if where else ""
