"""Network checks that need neither torch nor hivemind (the command line runs them before those imports)."""

from __future__ import annotations

import difflib
import errno
import ipaddress
import socket
from collections.abc import Callable


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


# ---------------------------------------------------------------------------------------- multiaddrs
# Which part of a multiaddr is wrong, for every parser of one (--initial-peers, --announce, probe: hivemind's
# or py-multiaddr's), so that a mistyped peer id is not reported as a mistyped address.

PEER_ID_CHARS = 46  # the base58 "Qm..." peer id every node prints (a multihash of its RSA key)
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
# first characters of a CIDv1 string (multibase codes, as hivemind's multiaddr parser reads them)
_MULTIBASE_CODES = frozenset("0679fFvVtTbBcChkKZzmMuU")


def _port(value: str) -> str | None:
    try:
        return None if 0 <= int(value, 10) <= 65535 else "a port is 0 to 65535"
    except ValueError:
        return "a port is a number, 0 to 65535"


def _peer_id(value: str) -> str | None:
    """Why hivemind's parser (``multiaddr/codecs/cid.py``) would certainly refuse this peer id, or None.
    The ``Qm...`` form every node prints is 46 base58 characters; any other form is a CIDv0 with the
    identity hash (it starts with ``1``) or a CIDv1 that opens with a multibase code."""
    if not value.isascii() or not value.isalnum():
        return "letters and digits only"
    if value.startswith("Qm"):
        if len(value) != PEER_ID_CHARS:
            return f"{len(value)} characters, where the ids nodes print have {PEER_ID_CHARS}"
        wrong = sorted(set(value) - _BASE58)
        if wrong:
            return f"{wrong[0]!r} is not a base58 character"
    elif not value.startswith("1") and value[0] not in _MULTIBASE_CODES:
        return f"the ids nodes print begin with Qm and have {PEER_ID_CHARS} characters"
    return None


def _ip(kind: type) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        try:
            kind(value)
        except ValueError:
            return ""
        return None
    return check


def _nonempty(value: str) -> str | None:
    return None if value else ""


# protocol: (what its value is, a cheap check of it: why the value is wrong, or None)
_VALUES: dict[str, tuple[str, Callable[[str], str | None]]] = {
    "ip4": ("IPv4 address", _ip(ipaddress.IPv4Address)), "ip6": ("IPv6 address", _ip(ipaddress.IPv6Address)),
    "tcp": ("port", _port), "udp": ("port", _port), "dccp": ("port", _port), "sctp": ("port", _port),
    "p2p": ("peer id", _peer_id), "dns": ("host name", _nonempty), "dns4": ("host name", _nonempty),
    "dns6": ("host name", _nonempty), "dnsaddr": ("host name", _nonempty),
}
# protocols without a value
_NO_VALUE = frozenset({"udt", "utp", "quic", "quic-v1", "http", "https", "tls", "ws", "wss", "p2p-circuit",
                       "p2p-websocket-star", "p2p-webrtc-star", "p2p-webrtc-direct"})


def _unknown(name: str) -> str:
    known = ["ip4", "tcp", "p2p", "ip6", "dns4", "dns6", "dns", *_VALUES, *_NO_VALUE]  # ours first
    swapped = [k for k in known if sorted(k) == sorted(name)]  # letters swapped: tpc for tcp
    close = swapped or difflib.get_close_matches(name, known, n=1)
    return f"has an unknown protocol '{name}'" + (f" (did you mean {close[0]}?)" if close else "")


def multiaddr_problem(addr: str, parses: Callable[[str], object] | None = None,
                      unknown: bool = True) -> str | None:
    """Which part of ``addr`` is wrong, as the rest of a sentence that begins with the address:
    ``has a bad peer id 'QmX...x' after /p2p/: 47 characters, where the ids nodes print have 46``,
    ``has a bad port '99999' after /tcp/: a port is 0 to 65535``, ``is not a multiaddr``; None when no
    part is found wrong.

    The protocols nodes print have a cheap check of their value; ``parses``, the authoritative parser
    (hivemind's or py-multiaddr's ``Multiaddr``, which raises on a bad address), is then tried on each
    longer prefix, so the first part it refuses is named even where the cheap check cannot tell (a peer
    id of another form). The walk ends at the first protocol it does not know: with ``unknown``, that
    protocol is the problem (with the known one its name is closest to), else None (the parser decides).
    """
    if not addr.startswith("/"):
        return "is not a multiaddr"
    parts, done = addr.rstrip("/").split("/")[1:], ""
    while parts:
        name = parts.pop(0)
        done += "/" + name
        if name in _NO_VALUE:
            continue
        if name not in _VALUES:
            return _unknown(name) if unknown else None
        what, check = _VALUES[name]
        if not parts:
            return f"ends without the {what} after /{name}/"
        value = parts.pop(0)
        done += "/" + value
        why = check(value)
        if why is None and parses is not None:
            try:
                parses(done)
            except Exception:  # hivemind's and py-multiaddr's parsers raise several types
                why = "copy it again, whole, from the node's output" if name == "p2p" else ""
        if why is not None:
            return f"has a bad {what} '{value}' after /{name}/" + (f": {why}" if why else "")
    return None
