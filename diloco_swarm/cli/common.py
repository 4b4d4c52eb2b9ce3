"""What every ``diloco-node`` command shares: the one-line error and its exit code, the check of float
flags, and whether this install can train (the ``[node]`` extra).

The command modules (``app.py``, ``status.py``, ``dashboard.py``, ``probe.py``) import this; it imports
none of them, and neither torch nor hivemind.
"""

from __future__ import annotations

import importlib.util
import math

import typer
from rich.console import Console
from rich.markup import escape

from diloco_swarm.cli.text import printable

err = Console(stderr=True, highlight=False)

USAGE_ERROR = 2


def fail(message: str, code: int = USAGE_ERROR) -> "typer.Exit":
    """Print ``error: message`` as one line on stderr; return the ``typer.Exit`` to raise."""
    # paths, globs and peer errors may hold newlines, terminal escapes or [brackets]
    one_line = " ".join(printable(message).split())
    err.print(f"[bold red]error:[/] {escape(one_line)}", soft_wrap=True)
    return typer.Exit(code)


def require_finite(**flags: float) -> None:
    """Refuse an ``inf`` or ``nan`` value of a float flag (click's ranges let ``inf`` through, and a
    timeout or an interval of ``inf`` would make a call unbounded). Keyword names are the flags' names.

    :raises typer.Exit: code 2, after one ``error:`` line naming the flag.
    """
    for name, value in flags.items():
        if not math.isfinite(value):
            raise fail(f"--{name.replace('_', '-')} must be a finite number, got {value}")


NODE_MODULES = ("torch", "hivemind")  # the [node] extra (pyproject.toml)
# the commands that run on the base install (the light client, the invitation keys); every other one
# calls require_node first (tests/test_light.py runs each of those on a simulated base install)
LIGHT_COMMANDS = ("status", "dashboard", "probe", "invite")


def node_missing() -> str | None:
    """The first training-node module this install lacks (the ``[node]`` extra), or None; imports nothing."""
    for module in NODE_MODULES:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):
            return module
    return None


def require_node(command: str) -> None:
    """Exit 2 with an install hint when ``command`` (join, demo, export: any command outside
    ``LIGHT_COMMANDS``) needs the training node and this install lacks it; call it before any import
    of torch or hivemind."""
    missing = node_missing()
    if missing is not None:
        raise fail(f"`diloco-node {command}` needs the node extra ({missing} is not installed): "
                   f"pip install 'diloco-swarm[node]'  ({', '.join(LIGHT_COMMANDS[:-1])} and {LIGHT_COMMANDS[-1]} "
                   "work without it)")
