"""The peers a node has seen, kept in its state dir so that a restart finds the swarm again.

A node restarted without ``--initial-peers`` (typically the first node of a run, which never had
any) would otherwise start a second, separate swarm under the same run id: nobody dials it. So
each node writes ``state_dir/peers.json`` with the multiaddrs that other full peers publish in
their signed records (dht/records.py), and a restart without ``--initial-peers`` dials those.
If none answers, the node starts a new swarm, as before.

The file is a cache, never trusted: an unreadable or foreign file is ignored (and rewritten), every
address is re-parsed, and its ``/p2p/`` part must be the peer that published it, so the libp2p
handshake of a dial checks that the address reaches that peer.

    {"run_id": "my-run", "peers": {"<peer id>": {"maddrs": ["/ip4/.../tcp/.../p2p/<peer id>"], "seen": 1764480000.0}}}
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from hivemind.utils.multiaddr import Multiaddr

from diloco_swarm.utils.net import port_problem

logger = logging.getLogger(__name__)

FILE_NAME = "peers.json"
MAX_PEERS = 16  # most recently seen first
MAX_MADDRS_PER_PEER = 4
MAX_FILE_BYTES = 1 << 20
FORGET_AFTER_S = 14 * 24 * 3600.0  # a peer unseen this long is dropped
PORT_FILE = "listen-port"  # the TCP port of this node's last run, as text


def known_peers_path(state_dir: Path) -> Path:
    return Path(state_dir) / FILE_NAME


def previous_port(state_dir: Path, host: str) -> int:
    """The TCP port this node listened on in its last run if it is free on ``host`` now, else 0 (any).

    Other peers keep this node's multiaddrs (in their ``peers.json``, in the join lines users paste),
    so a restart with ``--port 0`` on the same port keeps those addresses valid: a whole run restarted
    at once finds itself again."""
    try:
        port = int((Path(state_dir) / PORT_FILE).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return 0
    return port if 1 <= port <= 65535 and port_problem(host, port) is None else 0


def save_port(state_dir: Path, maddrs: Iterable[str]) -> None:
    """Keep the TCP port of this node's published ``maddrs`` for :func:`previous_port`. Never raises."""
    for addr in maddrs:
        try:
            port = int(Multiaddr(addr).value_for_protocol("tcp"))
        except Exception:
            continue
        tmp = Path(state_dir) / f".{PORT_FILE}.tmp"
        try:
            tmp.write_text(str(port), encoding="ascii")
            os.replace(tmp, Path(state_dir) / PORT_FILE)
        except OSError as e:
            logger.debug(f"could not keep the listen port: {e}")
        return


def usable_maddrs(peer_id: str, maddrs: Iterable[Any]) -> list[str]:
    """The addresses of ``maddrs`` that parse as multiaddrs and end in ``/p2p/<peer_id>`` (TCP, no relay),
    deduplicated, at most :data:`MAX_MADDRS_PER_PEER`: public IPs first, then private, then loopback
    (a node on 0.0.0.0 lists every interface, docker bridges included)."""
    out: list[str] = []
    for a in maddrs:
        if not isinstance(a, str) or len(a) > 256 or "/p2p-circuit" in a:
            continue
        try:
            addr = Multiaddr(a)
            if addr.value_for_protocol("p2p") != peer_id or "/tcp/" not in a:
                continue
        except Exception:
            continue
        if str(addr) not in out:
            out.append(str(addr))
    return sorted(out, key=_reach_rank)[:MAX_MADDRS_PER_PEER]


def _reach_rank(addr: str) -> int:
    """0 for a public IP (or a DNS name), 1 for a private one, 2 for loopback or link-local."""
    parts = addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return 0
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return 0
    if ip.is_loopback or ip.is_link_local:
        return 2
    return 1 if ip.is_private else 0


def load_known_peers(state_dir: Path, run_id: str, *, now: float | None = None,
                     warn: Callable[[str], None] | None = None) -> list[str]:
    """Multiaddrs to dial for ``run_id``, the most recently seen peers first.

    :param warn: called with one line when the file exists but is unusable (unreadable, not a
        regular file, too large, not our JSON, no usable address); it is then ignored.
    :returns: ``[]`` when the file is missing, unusable, or of another run (never raises: the file
        is a cache).
    """
    path = known_peers_path(state_dir)
    entries, problem = _read(path, run_id)
    if problem and warn is not None:
        warn(f"warning: ignoring {path}: {problem}")
    now = time.time() if now is None else now
    ordered = sorted(entries.items(), key=lambda kv: -kv[1]["seen"])
    return [a for peer, e in ordered if now - e["seen"] <= FORGET_AFTER_S for a in e["maddrs"]]


def remember_peers(state_dir: Path, run_id: str, seen: Mapping[str, Iterable[Any]], *, me: str,
                   now: float | None = None) -> int:
    """Merge ``seen`` (``{peer_id: its multiaddrs}``, seen now) into ``state_dir/peers.json``.

    Our own peer id and addresses that are not usable (:func:`usable_maddrs`) are left out; the file
    keeps the :data:`MAX_PEERS` most recently seen peers. The write is atomic (temp file + rename).
    :returns: the number of peers kept. Errors writing the file are logged, never raised.
    """
    path = known_peers_path(state_dir)
    now = time.time() if now is None else now
    entries, _ = _read(path, run_id)
    for peer, maddrs in seen.items():
        if not isinstance(peer, str) or peer == me:
            continue
        usable = usable_maddrs(peer, maddrs)
        if usable:
            entries[peer] = {"maddrs": usable, "seen": now}
    kept = dict(sorted(((p, e) for p, e in entries.items() if now - e["seen"] <= FORGET_AFTER_S),
                       key=lambda kv: -kv[1]["seen"])[:MAX_PEERS])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"run_id": run_id, "peers": kept}, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning(f"could not write {path}: {e}")
        tmp.unlink(missing_ok=True)
    return len(kept)


def _read(path: Path, run_id: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """``({peer_id: {"maddrs": [...], "seen": float}}, problem)`` of ``run_id`` from the file; bad
    entries dropped. ``problem`` says why a file that exists gave nothing usable (else None)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, e.strerror or str(e)
    if not stat.S_ISREG(info.st_mode):  # a directory, a FIFO (reading one would block), a device
        return {}, "not a regular file"
    if info.st_size > MAX_FILE_BYTES:
        return {}, f"larger than {MAX_FILE_BYTES} bytes"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        return {}, e.strerror or str(e)
    except ValueError:
        return {}, "not valid JSON"
    if not isinstance(doc, dict) or not isinstance(doc.get("peers"), dict) or not isinstance(doc.get("run_id"), str):
        return {}, 'not a peers file (expected {"run_id": ..., "peers": {...}})'
    if doc["run_id"] != run_id:
        return {}, None  # another run's peers: nothing wrong, nothing for us
    out: dict[str, dict[str, Any]] = {}
    for peer, e in doc["peers"].items():
        if not isinstance(e, dict) or not isinstance(e.get("seen"), (int, float)) or not isinstance(e.get("maddrs"), list):
            continue
        usable = usable_maddrs(peer, e["maddrs"])
        if usable:
            out[peer] = {"maddrs": usable, "seen": float(e["seen"])}
    if doc["peers"] and not out:
        return {}, f"none of its {len(doc['peers'])} entries has a usable address (/ip4|ip6/.../tcp/.../p2p/<that peer id>)"
    return out, None
