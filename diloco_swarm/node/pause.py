"""Pausing a node without leaving the run: whether it trains now, as a pure function of its owner's
control file, its ``--active-hours`` window and the local clock; node/runner.py carries it out.

The owner's word is a file in the state dir (:data:`CONTROL_FILE`), written by ``diloco-node pause`` and
removed by ``diloco-node resume``: it outlives a restart (a node started on a paused state dir starts
paused), needs no socket or signal, and the node polls it at most once a second (one ``stat``).

    hours = ActiveHours.parse("22:00-07:00")      # local time; may wrap midnight
    decide(owner_paused=False, hours=hours, now=datetime.now())   # -> Paused("active_hours", "22:00") or None

A paused node finishes (or abandons, by the usual rules) its round in flight, trains nothing, keeps its
record published with ``paused`` set, and no round waits for it (docs/architecture.md, rule 66).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

CONTROL_FILE = "paused"  # in the state dir: present = paused by its owner
POLL_S = 1.0  # the control file and the clock are looked at this often

_WINDOW = re.compile(r"^\s*([0-9]{1,2}):([0-9]{2})\s*-\s*([0-9]{1,2}):([0-9]{2})\s*$")


@dataclass(frozen=True)
class ActiveHours:
    """A daily window of local time in which the node trains, ``start`` to ``end`` in minutes after
    midnight; ``end < start`` wraps midnight (22:00-07:00 trains at night)."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> "ActiveHours":
        """``HH:MM-HH:MM`` (00:00 to 23:59; 24-hour clock).
        :raises ValueError: with the one line to show (a bad format, an hour past 23, a minute past 59,
            or an empty window)."""
        m = _WINDOW.match(text or "")
        if m is None:
            raise ValueError(f"--active-hours {text!r}: expected HH:MM-HH:MM in local time, e.g. 22:00-07:00")
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
            raise ValueError(f"--active-hours {text!r}: hours run 00-23 and minutes 00-59, e.g. 22:00-07:00")
        if (h1, m1) == (h2, m2):
            raise ValueError(f"--active-hours {text!r}: the window is empty (start = end); leave the flag out to "
                             "train all day")
        return cls(h1 * 60 + m1, h2 * 60 + m2)

    def contains(self, minute: int) -> bool:
        """Whether ``minute`` (after local midnight, 0-1439) is inside the window (start included, end not)."""
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end  # wraps midnight

    def __str__(self) -> str:
        return f"{_hhmm(self.start)}-{_hhmm(self.end)}"


def _hhmm(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


@dataclass(frozen=True)
class Paused:
    """Why a node does not train now: ``owner`` (``diloco-node pause``) or ``active_hours`` (outside its
    window, which opens again at ``until``, HH:MM local time)."""

    why: Literal["owner", "active_hours"]
    until: str | None = None

    def describe(self) -> str:
        """The status line's words: ``paused by its owner until diloco-node resume`` / ``paused: outside
        active hours until 22:00``."""
        if self.why == "owner":
            return "paused by its owner until diloco-node resume"
        return f"paused: outside active hours until {self.until}"


def decide(*, owner_paused: bool, hours: ActiveHours | None, now: datetime) -> Paused | None:
    """Whether the node is paused at local time ``now``, and why; None: it trains. The owner's pause
    comes first (it lasts until ``resume``; a window only pauses outside its hours)."""
    if owner_paused:
        return Paused("owner")
    if hours is not None and not hours.contains(now.hour * 60 + now.minute):
        return Paused("active_hours", _hhmm(hours.start))
    return None


def control_path(state_dir: Path) -> Path:
    return Path(state_dir) / CONTROL_FILE


def request_pause(state_dir: Path, now: float | None = None) -> bool:
    """Write the control file (``{"since": unix s}``). :returns: False when it was already there.
    :raises OSError: the state dir cannot be written."""
    path = control_path(state_dir)
    if path.exists():
        return False
    tmp = path.with_name(f".{CONTROL_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"since": round(time.time() if now is None else now, 3)}) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: the node never reads half a file (it only looks at its presence anyway)
    return True


def clear_pause(state_dir: Path) -> bool:
    """Remove the control file. :returns: False when there was none. :raises OSError: it cannot be removed."""
    try:
        control_path(state_dir).unlink()
    except FileNotFoundError:
        return False
    return True


class PauseWatch:
    """The node's side: :meth:`now` says whether it is paused, reading the control file and the clock at
    most every :data:`POLL_S` seconds (the training thread asks between two inner steps)."""

    def __init__(self, state_dir: Path, hours: ActiveHours | None):
        self.path, self.hours = control_path(state_dir), hours
        self._checked, self._last = float("-inf"), None

    def now(self) -> Paused | None:
        t = time.monotonic()
        if t - self._checked >= POLL_S:
            self._checked = t
            self._last = decide(owner_paused=self.path.exists(), hours=self.hours, now=datetime.now())
        return self._last
