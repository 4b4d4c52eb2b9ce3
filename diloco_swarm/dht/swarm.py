"""Swarm membership over ``hivemind.DHT``: bootstrap, identity, the run spec record.

DHT keys of a run (see docs/protocol.md):

- ``{run_id}_spec``: the :class:`~diloco_swarm.spec.RunSpec` as a dict, refreshed by every peer.
- ``{run_id}_peers``: one signed record per peer (see :mod:`diloco_swarm.dht.records`).
- ``{run_id}.all_averagers``: hivemind's list of state donors, priority = their outer step.
- ``{run_id}_round_{group_id}``: one subkey per member, the digest of the average it applied.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import platform
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from hivemind import DHT
from hivemind.p2p import PeerID, p2p_daemon
from hivemind.utils.multiaddr import Multiaddr

from diloco_swarm.dht.errors import SwarmError  # noqa: F401  (re-exported: callers catch it from here)
from diloco_swarm.dht.calls import DHT_CALL_TIMEOUT_S, dht_get, dht_run, dht_store, dht_visible_maddrs
from diloco_swarm.spec import RunSpec, SpecMismatch, parse_published_spec
from diloco_swarm.utils import clock
from diloco_swarm.utils import hivemind_fixes  # noqa: F401  (patches hivemind before any DHT forks)
from diloco_swarm.utils.net import host_problem, multiaddr_problem, port_problem

SPEC_TTL_S = 3600.0



class BootstrapFailed(SwarmError):
    """None of the initial peers answered."""


class InitialPeersAreUs(BootstrapFailed):
    """The ``--initial-peers`` name this node's own peer id (a copied state dir, or its own address)."""


def parse_initial_peers(values: Sequence[str]) -> list[str]:
    """Check multiaddrs such as ``/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...``.

    Accepts several per argument separated by spaces or commas.

    :raises SwarmError: a value that is not a multiaddr (naming the part that is wrong), or lacks the
        ``/p2p/<peer id>`` part.
    """
    peers: list[str] = []
    for value in values:
        for item in value.replace(",", " ").split():
            try:
                addr = Multiaddr(item)
            except Exception:  # say which part is wrong: a mistyped peer id is not a mistyped address
                problem = multiaddr_problem(item, Multiaddr) or "is not a multiaddr"
                raise SwarmError(f"--initial-peers: '{item}' {problem} (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)")
            if "/p2p/" not in str(addr):
                raise SwarmError(f"--initial-peers: '{item}' lacks the /p2p/PEER_ID part; copy the full address a node prints")
            peers.append(str(addr))
    return peers


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The ``/p2p/<peer id>`` parts of multiaddrs (base58), in order, without duplicates."""
    out: list[str] = []
    for a in maddrs:
        peer = str(a).rsplit("/p2p/", 1)[-1] if "/p2p/" in str(a) else ""
        if peer and "/" not in peer and peer not in out:
            out.append(peer)
    return out


def p2pd_problem() -> str | None:
    """Why hivemind's bundled libp2p daemon (``p2pd``) cannot run on this host, or None."""
    machine, system = platform.machine().lower(), platform.system()
    if system != "Linux" or machine not in ("x86_64", "amd64"):
        daemon = Path(p2p_daemon.__file__).parent.parent / "hivemind_cli" / "p2pd"
        if not daemon.exists() or not os.access(daemon, os.X_OK):
            return (f"hivemind's libp2p daemon (p2pd) is not available for {system} {machine}: hivemind's "
                    "wheel bundles it for Linux x86-64 only. Run the node under Linux x86-64 (WSL2 on Windows, "
                    "a Linux VM or container on macOS), or build p2pd from source (docs/networking.md)")
    return None


def check_port_free(host: str, port: int) -> None:
    """Fail early, with a clear message, when ``host:port`` cannot be bound (TCP).

    :raises SwarmError: the port is in use or the address is not local.
    """
    problem = port_problem(host, port)
    if problem is not None:
        raise SwarmError(problem)


def is_loopback_host(host: str) -> bool:
    """Whether ``--host`` is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_maddrs(host: str, port: int) -> list[str]:
    proto = "ip6" if ":" in host else "ip4"
    return [f"/{proto}/{host}/tcp/{port}"]


class StateDirBusy(SwarmError):
    """Another process (a running node) holds the state dir's lock."""


class StateDirLock:
    """An exclusive POSIX lock on ``state_dir/node.lock``: one node per state dir.

    :raises StateDirBusy: another process holds the lock.
    :raises SwarmError: the directory cannot be created or written.
    """

    def __init__(self, state_dir: Path):
        self._fd = -1
        if state_dir.exists() and not state_dir.is_dir():
            raise SwarmError(f"state dir {state_dir} is a file, not a directory; give another --state-dir")
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            # checkpoints are written as temp files renamed into place: the dir itself must be writable
            probe = state_dir / f".write-probe.{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            probe.unlink()
            self.path = state_dir / "node.lock"
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SwarmError(f"state dir {state_dir} is not writable ({e.strerror or e}); fix its permissions or "
                             "give another --state-dir") from None
        try:
            # A POSIX record lock, not flock(): forked children (DHT, averager) do not hold it,
            # so it is released the moment this process dies, however it dies.
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise StateDirBusy(f"another diloco-node is running with state dir {state_dir}; give each node its own --state-dir")
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


BOOTSTRAP_ATTEMPTS = 2
DHT_START_TIMEOUT_S = 120.0  # p2pd start + bootstrap pings; minutes only on a badly overloaded machine


def start_dht(
    *,
    initial_peers: Sequence[str],
    host: str,
    port: int,
    announce: Sequence[str] = (),
    identity_path: Path | None = None,
    client_mode: bool = False,
    record_validators: Sequence[Any] = (),
    retry_busy_port_s: float = 0.0,
) -> DHT:
    """Start a ``hivemind.DHT`` (a background process with the go-libp2p daemon).

    :param identity_path: private key file; created on first start, so the peer id survives restarts.
    :param retry_busy_port_s: keep retrying a busy port this long (a restart right after a shutdown).
    :raises SwarmError: port busy, bad multiaddr, or p2pd cannot run here; :class:`BootstrapFailed`
        (a SwarmError) when no initial peer answered.
    """
    problem = p2pd_problem()
    if problem is not None:
        raise SwarmError(problem)
    if host_problem(host):
        raise SwarmError(host_problem(host))
    deadline = time.monotonic() + retry_busy_port_s
    while True:
        try:
            check_port_free(host, port)
            break
        except SwarmError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    for a in announce:
        try:
            Multiaddr(a)
        except Exception:
            raise SwarmError(f"--announce: '{a}' {multiaddr_problem(a, Multiaddr) or 'is not a multiaddr'} "
                             "(expected /ip4/PUBLIC_IP/tcp/PORT)")
    for attempt in range(BOOTSTRAP_ATTEMPTS if initial_peers else 1):
        try:
            dht = DHT(
                initial_peers=list(initial_peers),
                start=False,
                host_maddrs=listen_maddrs(host, port),
                announce_maddrs=list(announce) or None,
                identity_path=str(identity_path) if identity_path else None,
                check_if_identity_free=False,  # the state dir lock already guarantees one user
                client_mode=client_mode,
                record_validators=list(record_validators),
                use_relay=False,
                use_auto_relay=False,
                # UPnP / NAT-PMP asks the router for a port mapping: pointless, and traffic beyond this
                # machine, for a node that listens on loopback only (the demo, tests, benchmarks)
                nat_port_map=not is_loopback_host(host),
            )
            try:
                dht.run_in_background(await_ready=True, timeout=DHT_START_TIMEOUT_S)
            except TimeoutError:
                if dht._ready.done():  # the DHT's own error, not our wait
                    raise
                dht.terminate()
                raise SwarmError(f"the DHT process did not start within {DHT_START_TIMEOUT_S:.0f}s; is the machine "
                                 "overloaded? Start the node again") from None
            # hivemind asks the DHT process for these on first use with no time limit: ask now, bounded
            dht._peer_id = dht_run(dht, DHT._get_peer_id, timeout=DHT_CALL_TIMEOUT_S, what="DHT peer id")
            dht._client_mode = dht_run(dht, DHT._get_client_mode, timeout=DHT_CALL_TIMEOUT_S, what="DHT client mode")
            return dht
        except SwarmError:
            raise
        except Exception as e:
            text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            bootstrap_failed = "bootstrap" in text or "failed to connect" in text
            if not bootstrap_failed or attempt + 1 == BOOTSTRAP_ATTEMPTS:
                break
            if _nothing_listens(initial_peers):
                break  # a second try cannot succeed (a busy peer still accepts connections)
            # hivemind pings the initial peers once, with a 3 s limit: a busy peer misses it
            time.sleep(2.0)
            for _ in range(20):  # the failed daemon may still hold our port
                try:
                    check_port_free(host, port)
                    break
                except SwarmError:
                    time.sleep(0.5)
    if bootstrap_failed:
        own = _own_peer_id(identity_path)
        if own is not None and set(peer_ids_of(initial_peers)) == {own}:  # libp2p never dials itself
            raise InitialPeersAreUs(
                f"the --initial-peers are this node's own peer id ({own}, from {identity_path}): another node runs "
                "with this node's identity (a copied --state-dir: give each node its own, or delete identity.key "
                "and record.key in the copy), or these are this node's own addresses; give the address of another node"
            )
        listening = _accepting_connections(initial_peers)
        if listening:  # the address is right: the peer id (or the program there) is not
            raise BootstrapFailed(
                "none of the --initial-peers answered (" + ", ".join(initial_peers) + "), although a program accepts "
                f"connections at {', '.join(listening)}: check the peer id after /p2p/ (copy it in full from that "
                "node's 'to join' line; another --state-dir means another id), or that node may be too busy to answer"
            )
        raise BootstrapFailed(
            "none of the --initial-peers answered (" + ", ".join(initial_peers) + "); check the addresses and "
            "that those nodes are running, or omit --initial-peers to start a new swarm"
        )
    if "address already in use" in text:
        raise SwarmError(f"port {port} is already in use; pick another with --port")
    if identity_path is not None and "cannot parse invalid wire-format data" in text:  # p2pd's protobuf error
        raise SwarmError(f"{identity_path} is not a libp2p private key (corrupt or truncated); move it away to start "
                         "with a new peer id, or restore it from a backup")
    explained = explain_dht_error(text)
    if explained is not None:
        raise SwarmError(explained)
    problem = p2pd_problem()
    if problem is not None or "exec format error" in text.lower():
        raise SwarmError(problem or f"hivemind's libp2p daemon (p2pd) cannot run on this host ({text}); "
                         "see docs/networking.md")
    raise SwarmError(f"could not start the DHT: {text}")


_TCP_MADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/tcp/(\d+)(/|$)")  # host, port of a TCP multiaddr


def _accepting_connections(maddrs: Sequence[str], timeout: float = 1.0) -> list[str]:
    """``host:port`` of the ``/ip4|ip6/…/tcp/PORT`` multiaddrs at which a TCP connect succeeds within
    ``timeout`` s (at most 8 tried, all at once): something listens there. Never raises."""
    def accepts(addr: str) -> str | None:
        match = _TCP_MADDR.match(addr)
        if match is None:
            return None
        host, port = match.group(2), int(match.group(3))
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return f"[{host}]:{port}" if match.group(1) == "ip6" else f"{host}:{port}"
        except (OSError, ValueError, OverflowError):
            return None

    addrs = list(dict.fromkeys(maddrs))[:8]
    if not addrs:
        return []
    with ThreadPoolExecutor(max_workers=len(addrs)) as pool:
        return [hp for hp in pool.map(accepts, addrs) if hp is not None]


def _nothing_listens(maddrs: Sequence[str]) -> bool:
    """True when every one of ``maddrs`` is a TCP multiaddr (at most the 8 that
    :func:`_accepting_connections` tries) and none accepts a connection."""
    addrs = list(dict.fromkeys(maddrs))
    return len(addrs) <= 8 and all(_TCP_MADDR.match(a) for a in addrs) and not _accepting_connections(addrs)


def _own_peer_id(identity_path: Path | None) -> str | None:
    """The peer id of the private key at ``identity_path`` (hivemind's identity file), or None."""
    try:
        return PeerID.from_identity(Path(identity_path).read_bytes()).to_base58() if identity_path else None
    except Exception:
        return None


_CLOCK_SKEW = re.compile(r"within (?P<limit>[\d.]+) seconds.*local: (?P<local>[\d.]+), peer: (?P<peer>[\d.]+)")
_NO_DIAL_BACK = re.compile(r"Peer (?P<peer>\S+) can't access this node")


def explain_dht_error(text: str) -> str | None:
    """A user-facing line for hivemind's bootstrap refusals that mislead as they are, or None.

    - ``local time must be within 3 seconds of others(local: T1, peer: T2)`` (hivemind's
      ``DHTProtocol.call_ping``): the clock offset in seconds, and to sync the clock.
    - ``Peer X can't access this node. Probably, libp2p has failed to bypass the firewall``: the
      peer's ping back reached another node with our peer id (a copied state dir), or none at all.
    """
    m = _CLOCK_SKEW.search(text)
    if m is not None:
        offset = float(m["local"]) - float(m["peer"])
        return (f"this machine's clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} the swarm's "
                f"(peers accept at most {float(m['limit']):g} s); sync the clock with NTP (e.g. `sudo timedatectl "
                "set-ntp true`, or chrony/ntpd) and start again")
    m = _NO_DIAL_BACK.search(text)
    if m is not None:
        return (f"peer {m['peer']} could not reach this node back. Either another node runs with this node's identity "
                "(a copied --state-dir: give each node its own, or delete identity.key and record.key in the copy), "
                "or a firewall blocks inbound connections (then use --client-mode)")
    return None


def visible_maddrs(dht: DHT) -> list[str]:
    """This node's addresses as other machines should paste them (with ``/p2p/<peer id>``).

    :raises ChildUnavailable: the DHT process is gone or did not answer in time (dht/calls.py)."""
    return [str(a) for a in dht_visible_maddrs(dht)]


def _spec_differences(ours: RunSpec, published: Any) -> dict[str, tuple[object, object]]:
    mine = ours.model_dump()
    if not isinstance(published, dict):
        return {"spec": (mine, published)}
    keys = list(mine) + [k for k in published if k not in mine]
    return {k: (mine.get(k), published.get(k)) for k in keys if mine.get(k) != published.get(k)}


class PrivateRunMismatch(SpecMismatch):
    """The run is private and we hold no invitation to it, or one of another organiser; or the run is public
    and we came with an invitation (or as an organiser). One line, without the other fields' differences."""

    def __init__(self, run_id: str, ours: str | None, published: object):
        self.differences = {"organiser": (ours, published)}
        if ours is None:
            line = (f"run '{run_id}' is private: ask its organiser for an invitation (they run "
                    "`diloco-node invite --state-dir DIR`) and join with --invite")
        elif published is None:
            line = (f"run '{run_id}' is a public run: join it without --invite (a private run of your own "
                    "needs another --run-id)")
        else:
            line = (f"this invitation is for another organiser of run '{run_id}' than the one the swarm names: "
                    "ask the run's organiser for an invitation, or choose another --run-id")
        Exception.__init__(self, line)


def ensure_run_spec(dht: DHT, spec: RunSpec, *, joining: bool, attempts: int = 10) -> bool:
    """Publish ``spec`` under ``{run_id}_spec``, or check it against the one already there.

    :param joining: this node bootstrapped from initial peers, so look a few times before
        concluding that the run is new.

    :returns: True when the run already had this spec, False when this peer published it first.
    :raises PrivateRunMismatch: the published spec names another organiser (or none where we name one,
        or the reverse): said alone, as the other fields' differences do not matter until it is settled.
    :raises SpecMismatch: the published spec differs (names the fields).
    :raises ChildUnavailable: the DHT process is gone or did not answer in time (dht/calls.py).
    """
    key = f"{spec.run_id}_spec"
    for _ in range(attempts if joining else 1):
        found = dht_get(dht, key, latest=True)
        if found is not None:
            diffs = _spec_differences(spec, found.value)
            if "organiser" in diffs:
                raise PrivateRunMismatch(spec.run_id, *diffs["organiser"])
            if diffs:
                raise SpecMismatch(spec.run_id, diffs)
            refresh_run_spec(dht, spec)
            return True
        time.sleep(0.3)
    refresh_run_spec(dht, spec)
    return False


def refresh_run_spec(dht: DHT, spec: RunSpec) -> None:
    """Extend the life of the run's spec record; never overwrite a different spec.

    :raises ChildUnavailable: the DHT process is gone or did not answer in time (dht/calls.py)."""
    found = dht_get(dht, f"{spec.run_id}_spec", latest=True)
    if found is not None and _spec_differences(spec, found.value):
        return
    dht_store(dht, f"{spec.run_id}_spec", spec.model_dump(), expiration_time=clock.now() + SPEC_TTL_S)


def published_organiser(dht: DHT, run_id: str) -> str | None:
    """``RunSpec.organiser`` of the spec published for ``run_id`` (None: a public run, no spec, or a
    malformed one): what readers (``status``, the dashboard) check records against. Never raises."""
    try:
        found = dht_get(dht, f"{run_id}_spec", latest=True)
    except Exception:
        return None
    spec = parse_published_spec(getattr(found, "value", None))
    return None if spec is None else spec.organiser
