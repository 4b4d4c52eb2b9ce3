"""Network checks that need neither torch nor hivemind (the command line runs them before those imports)."""

from __future__ import annotations

import errno
import ipaddress
import socket


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot be a node's listen address (libp2p needs an IP literal), or None."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return (f"--host: '{host}' is not an IP address; use 0.0.0.0 (every interface), 127.0.0.1 (this machine "
                "only) or one of this machine's addresses")
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound for TCP right now, as one line for the user; None if it can.

    Port 0 (any free port) is fine when ``host`` is an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use; pick another with --port (0 = any free port)"
            where = host if port == 0 else f"{host}:{port}"
            return f"cannot listen on {where}: {e.strerror}"
    return None
