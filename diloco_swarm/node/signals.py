"""Stop signals: while ``diloco-node join`` is still loading, and while the node runs.

A signal while torch and hivemind load (seconds) was lost (an import swallowed the
``KeyboardInterrupt``) or killed the process mid-start. Nothing is saved or started before the node
runs, so :func:`catch_early` makes SIGINT, SIGTERM and SIGHUP end the command at once with exit 0
and one line, until the node installs its own handler (:class:`StopFlag`). This module must not
load hivemind: the CLI imports it first.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any, Callable

from diloco_swarm.utils.signals import STOP_SIGNALS


def _remove_socket_dir() -> None:
    """The socket directory exists once hivemind's fixes loaded; os._exit skips their atexit hook
    (looked up, not imported: this module must not load hivemind)."""
    fixes = sys.modules.get("diloco_swarm.utils.hivemind_fixes")
    if fixes is not None:
        fixes.remove_socket_dir()


def _leave(signum, frame) -> None:
    try:
        sys.stderr.write("stopped during start-up\n")
        sys.stderr.flush()
        _remove_socket_dir()
    finally:
        os._exit(0)


def catch_early() -> None:
    """From now on (main thread only), a stop signal ends the process at once, until the node's handler replaces this."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _leave)


class StopFlag:
    """First SIGINT/SIGTERM asks for a graceful stop; a second one exits at once."""

    def __init__(self, status: Any):  # node.report.StatusLine
        self.event = threading.Event()
        self.status = status
        self.training = False  # set once set-up is done
        self.has_checkpoint = False  # set once a checkpoint is on disk or being written
        self.checkpoint_problem: str | None = None  # why the newest checkpoint write failed (None: it did not)
        self.round_in_flight: Callable[[], bool] = lambda: False  # set by the node

    def install(self) -> None:
        for sig in STOP_SIGNALS:  # (SIGHUP: a closed terminal or ssh session stops cleanly too)
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            for child in mp.active_children():
                with contextlib.suppress(Exception):
                    child.kill()
            _remove_socket_dir()
            os._exit(130)
        self.event.set()
        dropped = ", the round in flight is dropped" if self.round_in_flight() else ""
        if self.training and self.checkpoint_problem:
            self.status.log(f"stopping: {self.checkpoint_problem}{dropped} (press Ctrl+C again to quit at once)")
        elif self.training and self.has_checkpoint:
            self.status.log(f"stopping: the last checkpoint is kept{dropped} (press Ctrl+C again to quit at once)")
        elif self.training:
            self.status.log("stopping: no outer step applied yet, so there is no checkpoint to keep "
                            "(press Ctrl+C again to quit at once)")
        else:
            self.status.log("stopping: leaving before training starts (press Ctrl+C again to quit at once)")

    @property
    def requested(self) -> bool:
        return self.event.is_set()
