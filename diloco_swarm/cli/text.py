"""Terminal-safe text: what a peer or a user typed must not drive the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_RUN_ID = "diloco-demo"  # the run of every command given no --run-id (join, status, dashboard)
DEFAULT_STATE_DIR = Path("diloco-state")  # the state dir of join, pause and resume given no --state-dir


def printable(value: Any) -> str:
    """``str(value)`` fit for one terminal line: whitespace (newlines, tabs) becomes a space, and other
    non-printable characters (ANSI escape sequences' ESC, bidi overrides, zero-width marks) are dropped.

    Text built from the result must still not be parsed as rich markup: print it as ``rich.text.Text``
    or through ``rich.markup.escape``.
    """
    s = str(value)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else " " if c.isspace() else "" for c in s)
