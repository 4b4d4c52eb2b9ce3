"""``diloco-node pause`` and ``resume``: tell the node running on a state dir to stop training for now (it
stays in the swarm, known as paused) or to train again, through the control file in that dir
(node/pause.py). Whether a node runs there is whether it holds the state dir's lock (dht/swarm.py:
``StateDirLock``).

Exit codes: 0 the running node was told; 1 no node runs on that state dir (the pause is still recorded,
or cleared, for its next ``join``); 2 bad input (no such state dir).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from diloco_swarm.cli.common import err, fail, require_node
from diloco_swarm.cli.text import DEFAULT_STATE_DIR, printable

NOT_RUNNING = 1
STATE_DIR_HELP = "State dir of the node (its `join --state-dir`)."


def _node_running(state_dir: Path, command: str) -> bool:
    """Whether a node holds ``state_dir``'s lock (it must exist). :raises typer.Exit: code 2, no such dir."""
    require_node(command)
    if not state_dir.is_dir():
        what = "is a file, not a directory" if state_dir.exists() else "no such directory"
        raise fail(f"--state-dir {state_dir}: {what}; give the state dir of the node to {command} "
                   f"(its `diloco-node join --state-dir`)")
    from diloco_swarm.dht.swarm import StateDirBusy, StateDirLock, SwarmError  # lazy: hivemind
    from diloco_swarm.node.config import IDENTITY_FILE

    if not (state_dir / IDENTITY_FILE).is_file():  # a typo's folder, or ~: write nothing there
        raise fail(f"--state-dir {state_dir} is not a node's state dir (it holds no {IDENTITY_FILE}); give the state "
                   f"dir of the node to {command} (its `diloco-node join --state-dir`)")

    try:
        StateDirLock(state_dir).release()  # (taken for a moment: only a running node would refuse it)
    except StateDirBusy:
        return True
    except SwarmError as e:
        raise fail(str(e))
    return False


def _say(line: str) -> None:
    print(printable(line), flush=True)


def pause(
    state_dir: Annotated[Path, typer.Option(help=STATE_DIR_HELP)] = DEFAULT_STATE_DIR,
) -> None:
    """Pause the node running on --state-dir without leaving the run.

    It finishes (or abandons, by the usual rules) its round in flight, then runs no inner step: its record
    stays in the swarm, marked paused, and no round waits for it. `diloco-node resume` makes it train again,
    catching up with the swarm first. The pause is a file in the state dir: it outlives a restart (a `join`
    on a paused state dir starts paused). Exit 1 when no node runs there (the pause is recorded anyway).
    """
    from diloco_swarm.node.pause import request_pause  # lazy (stdlib only): keeps --help fast

    running = _node_running(state_dir, "pause")
    try:
        new = request_pause(state_dir)
    except OSError as e:
        raise fail(f"--state-dir {state_dir}: cannot write its pause file ({e.strerror or e})")
    resume_cmd = f"diloco-node resume --state-dir {state_dir}"
    if running:
        _say(f"{'paused' if new else 'already paused'}: the node on {state_dir} ends its round in flight, then "
             f"trains no more (it stays in the swarm, marked paused); `{resume_cmd}` resumes it")
        return
    err.print(escape(printable(
        f"no node is running on {state_dir}; the pause is recorded: the next `diloco-node join --state-dir "
        f"{state_dir}` starts paused (`{resume_cmd}` clears it)")), soft_wrap=True)
    raise typer.Exit(NOT_RUNNING)


def resume(
    state_dir: Annotated[Path, typer.Option(help=STATE_DIR_HELP)] = DEFAULT_STATE_DIR,
) -> None:
    """Resume the node paused with `diloco-node pause` on --state-dir: it catches up with the swarm (a state
    download when the swarm moved on by two outer steps or more) and trains again. A node outside its
    --active-hours still waits for them. Exit 1 when no node runs there (a recorded pause is cleared anyway).
    """
    from diloco_swarm.node.pause import clear_pause  # lazy (stdlib only)

    running = _node_running(state_dir, "resume")
    try:
        was_paused = clear_pause(state_dir)
    except OSError as e:
        raise fail(f"--state-dir {state_dir}: cannot remove its pause file ({e.strerror or e})")
    if running:
        _say(f"resumed: the node on {state_dir} trains again (after catching up with the swarm if it moved on)"
             if was_paused else f"the node on {state_dir} was not paused by `diloco-node pause`; nothing to resume "
             "(outside its --active-hours it waits for them)")
        return
    err.print(escape(printable(
        f"no node is running on {state_dir}; " + ("the recorded pause is cleared: the next `diloco-node join` "
                                                 "on it trains at once" if was_paused else "nothing to resume"))),
        soft_wrap=True)
    raise typer.Exit(NOT_RUNNING)
