"""Stop signals that arrive while ``diloco-node join`` is still loading (torch, hivemind: seconds).

A signal in that window was lost (an import swallowed the ``KeyboardInterrupt``) or killed the
process mid-start. Nothing is saved or started before the node runs, so :func:`catch_early`
makes SIGINT, SIGTERM and SIGHUP end the command at once with exit 0 and one line, until the
node installs its own handler (``node/runner.py: StopFlag``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from diloco_swarm.utils.signals import STOP_SIGNALS


def _leave(signum, frame) -> None:
    try:
        sys.stderr.write("stopped during start-up\n")
        sys.stderr.flush()
        # the socket directory exists once hivemind's fixes loaded; os._exit skips their atexit hook
        # (looked up, not imported: this module must not load hivemind)
        fixes = sys.modules.get("diloco_swarm.utils.hivemind_fixes")
        if fixes is not None:
            fixes.remove_socket_dir()
    finally:
        os._exit(0)


def catch_early() -> None:
    """From now on (main thread only), a stop signal ends the process at once, until the node's handler replaces this."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _leave)
