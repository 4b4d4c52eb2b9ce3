"""Network checks that need neither torch nor hivemind (the command line runs them before those imports)."""

from __future__ import annotations

import errno
import socket


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound for TCP right now, as one line for the user; None if it can.

    Port 0 (any free port) is always fine.
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use; pick another with --port (0 = any free port)"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None
