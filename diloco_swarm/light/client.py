"""A py-libp2p host that reads a hivemind DHT as a client: no Go daemon, no listening socket.

It dials peers over TCP + Noise + Yamux with a fresh Ed25519 identity, calls hivemind's
``DHTProtocol.rpc_ping`` and ``DHTProtocol.rpc_find`` handlers (see :mod:`diloco_swarm.light.wire`),
and walks the DHT like hivemind's ``traverse_dht`` (``hivemind/dht/traverse.py``, a Kademlia beam
search, arXiv-free: Maymounkov & Mazières 2002): ask the peers nearest to the key, learn nearer
ones from their answers, stop when the ``beam_size`` nearest known peers have all been asked.

hivemind answers carry peer ids, not addresses. A peer is dialable when its address is known: from
the initial multiaddrs, from the ``maddrs`` of a verified record of ours, or from a go-libp2p
Kademlia ``FIND_NODE`` asked of the peer that named it (hivemind's ``p2pd`` serves ``/ipfs/kad/1.0.0``).

Every network call is bounded: ``call_timeout_s`` per dial or call, ``budget_s`` per walk.
Runs under trio (``trio.run``); one client per ``async with open_client()``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import multiaddr
import trio

from diloco_swarm.light import wire
from diloco_swarm.light.verify import verified_dictionary, verified_value
from diloco_swarm.utils import clock
from diloco_swarm.utils.net import multiaddr_problem

# "lazy": libp2p (~0.6 s) loads in the functions that use it: it cannot share a process with hivemind
# (both register crypto.pb.KeyType), and tests import this module next to hivemind (tests/test_light.py).

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0  # one dial, or one call on an open connection
BEAM_SIZE = 20  # hivemind's DHT bucket_size default
MAX_QUERIES = 64  # peers asked in one walk at most
KAD_PROTOCOL = "/ipfs/kad/1.0.0"  # hivemind's p2pd serves go-libp2p's Kademlia: FIND_NODE gives addresses
PING_HANDLER = "DHTProtocol.rpc_ping"
FIND_HANDLER = "DHTProtocol.rpc_find"


class LightError(Exception):
    """A user-facing problem of the light client (bad address, peer unreachable)."""


@dataclass
class Found:
    """What a walk found for one key: a regular value, or dictionary items, with the peers that held it."""

    value: Any = None
    expiration: float | None = None
    items: dict[Any, tuple[Any, float]] = field(default_factory=dict)  # subkey -> (value, expiration)
    holders: set[str] = field(default_factory=set)  # base58 peer ids whose answer held a valid value
    asked: set[str] = field(default_factory=set)  # peers that answered
    failed: set[str] = field(default_factory=set)  # peers we could not reach or that sent garbage


def parse_peer_maddr(text: str):
    """``(peer id, multiaddr without /p2p)`` of ``/ip4/HOST/tcp/PORT/p2p/PEER_ID``.

    :raises LightError: not a multiaddr (naming the part that is wrong), or no ``/p2p/`` part.
    """
    from libp2p.peer.peerinfo import info_from_p2p_addr  # lazy

    try:
        addr = multiaddr.Multiaddr(text)
    except Exception:  # say which part is wrong: a mistyped peer id is not a mistyped address
        problem = multiaddr_problem(text, multiaddr.Multiaddr) or "is not a multiaddr"
        raise LightError(f"'{text}' {problem} (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)") from None
    try:
        info = info_from_p2p_addr(addr)
    except Exception:  # it does not end in /p2p/PEER_ID
        raise LightError(f"'{text}' lacks the /p2p/PEER_ID part; copy the full address a node prints") from None
    addrs = [r for a in info.addrs if str(a) and "tcp" in (p.name for p in a.protocols()) for r in _resolved(a, text)]
    if not addrs:  # the light client dials TCP only
        raise LightError(f"'{text}' has no TCP address before /p2p/ (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)")
    return info.peer_id, addrs


_DNS_FAMILIES = {"dns": socket.AF_UNSPEC, "dns4": socket.AF_INET, "dns6": socket.AF_INET6}


def _resolved(addr, text: str) -> list:
    """``addr`` with a ``/dns``, ``/dns4`` or ``/dns6`` host replaced by its IP addresses (the system
    resolver, as go-libp2p's daemon does for hivemind); other addresses as they are.

    :raises LightError: the name does not resolve.
    """
    parts = str(addr).split("/")  # ["", "dns4", HOST, "tcp", PORT, ...]
    if len(parts) < 3 or parts[1] not in _DNS_FAMILIES:
        return [addr]
    try:
        infos = socket.getaddrinfo(parts[2], None, _DNS_FAMILIES[parts[1]], socket.SOCK_STREAM)
    except OSError as e:
        raise LightError(f"'{text}': cannot resolve {parts[2]} ({e.strerror or e})") from None
    ips = dict.fromkeys(("ip4" if family == socket.AF_INET else "ip6", sockaddr[0])
                        for family, _, _, _, sockaddr in infos if family in (socket.AF_INET, socket.AF_INET6))
    return [multiaddr.Multiaddr("/".join(["", proto, ip, *parts[3:]])) for proto, ip in ips]


class LightClient:
    """Dial, call and walk; created by :func:`open_client`."""

    def __init__(self, host, call_timeout_s: float):
        self.host = host
        self.call_timeout_s = call_timeout_s
        self.node_ids: dict[str, bytes] = {}  # peer id (base58) -> DHT node id, from their answers

    # -------------------------------------------------------------- peers
    def learn(self, peer_id, addrs) -> None:
        """Remember addresses of a peer (``peer_id`` a libp2p ID, ``addrs`` multiaddrs without /p2p)."""
        good = []
        for a in addrs:
            try:
                good.append(a if isinstance(a, multiaddr.Multiaddr) else multiaddr.Multiaddr(str(a)))
            except Exception:
                continue
        if good:
            self.host.get_peerstore().add_addrs(peer_id, good, 600)

    def learn_maddrs(self, maddrs) -> None:
        """Remember ``/…/p2p/PEER`` strings (a record's ``maddrs``); bad ones are skipped."""
        for text in maddrs:
            try:
                peer_id, addrs = parse_peer_maddr(text)
            except LightError:
                continue
            self.learn(peer_id, addrs)

    def dialable(self, peer_id) -> bool:
        try:
            return bool(self.host.get_peerstore().addrs(peer_id))
        except Exception:
            return False

    async def connect(self, peer_id) -> float:
        """Dial ``peer_id`` at its known addresses. :returns: seconds taken. :raises LightError: unreachable."""
        from libp2p.peer.peerinfo import PeerInfo  # lazy

        start = time.perf_counter()
        with trio.move_on_after(self.call_timeout_s) as scope:
            addrs = self.host.get_peerstore().addrs(peer_id)
            try:
                await self.host.connect(PeerInfo(peer_id, addrs))
            except Exception as e:
                where = ", ".join(str(a) for a in addrs)
                reason = _reason(e)
                detail = "" if "unable to connect" in reason else f" ({reason})"
                raise LightError(f"could not connect to {peer_id} at {where}{detail}") from None
        if scope.cancelled_caught:
            raise LightError(f"no answer from {peer_id} within {self.call_timeout_s:g} s")
        return time.perf_counter() - start

    async def protocols(self, peer_id, wait_s: float | None = None) -> list[str]:
        """The protocols ``peer_id`` announced through identify (empty if identify did not finish in time)."""
        deadline = trio.current_time() + (self.call_timeout_s if wait_s is None else wait_s)
        while True:
            try:
                found = list(self.host.get_peerstore().get_protocols(peer_id))
            except Exception:
                found = []
            if found or trio.current_time() > deadline:
                return sorted(set(found))
            await trio.sleep(0.02)

    async def resolve(self, peer_id, via) -> bool:
        """Ask connected peer ``via`` for ``peer_id``'s addresses (Kademlia FIND_NODE). :returns: whether we learned any."""
        # lazy
        from libp2p.kad_dht.pb.kademlia_pb2 import Message
        from libp2p.peer.id import ID

        request = Message(type=Message.MessageType.FIND_NODE, key=peer_id.to_bytes()).SerializeToString()
        with trio.move_on_after(self.call_timeout_s):
            stream = None
            try:
                stream = await self.host.new_stream(via, [KAD_PROTOCOL])
                await stream.write(wire.uvarint(len(request)) + request)
                buffer = b""
                while (parsed := wire.split_frame(buffer)) is None:
                    chunk = await stream.read(65536)
                    if not chunk:
                        return False
                    buffer += chunk
                answer = Message.FromString(parsed[0])
                for peer in answer.closerPeers[:64]:
                    try:
                        other = ID(peer.id)
                        self.learn(other, [multiaddr.Multiaddr(a) for a in peer.addrs[:16]])
                    except Exception:
                        continue
            except Exception as e:
                logger.debug(f"FIND_NODE {peer_id} via {via}: {_reason(e)}")
            finally:
                if stream is not None:
                    with trio.move_on_after(1.0):
                        try:
                            await stream.close()
                        except Exception:
                            pass
        return self.dialable(peer_id)

    # -------------------------------------------------------------- calls
    async def call(self, peer_id, handler: str, request) -> bytes:
        """One unary call of hivemind handler ``handler``; returns the serialized answer.

        :raises LightError: unreachable, timed out, or the peer answered with an error or garbage.
        """
        call_id, frame = wire.unary_request(peer_id.to_bytes(), handler, request.SerializeToString())
        with trio.move_on_after(self.call_timeout_s) as scope:
            stream = None
            try:
                stream = await self.host.new_stream(peer_id, [handler])
                await stream.write(frame)
                buffer = b""
                # No close_write before the answer: the daemon reads a half-closed stream as a cancelled call.
                while (parsed := wire.split_frame(buffer)) is None:
                    chunk = await stream.read(65536)
                    if not chunk:
                        raise LightError(f"{peer_id} closed the stream before answering {handler}")
                    buffer += chunk
                return wire.unary_response(call_id, parsed[0])
            except LightError:
                raise
            except wire.WireError as e:
                raise LightError(f"{peer_id}: {e}") from None
            except Exception as e:
                raise LightError(f"{handler} on {peer_id} failed: {_reason(e)}") from None
            finally:
                if stream is not None:
                    with trio.move_on_after(1.0):
                        try:
                            await stream.close()
                        except Exception:
                            pass
        assert scope.cancelled_caught
        raise LightError(f"{peer_id} did not answer {handler} within {self.call_timeout_s:g} s")

    async def ping(self, peer_id) -> tuple[float, bytes | None, float | None]:
        """``DHTProtocol.rpc_ping``: ``(round trip s, the peer's DHT node id, its DHT time)``."""
        start = time.perf_counter()
        raw = await self.call(peer_id, PING_HANDLER, wire.PingRequest(peer=wire.NodeInfo()))
        rtt = time.perf_counter() - start
        try:
            answer = wire.PingResponse.FromString(raw)
        except Exception:
            raise LightError(f"{peer_id} sent an unparseable ping answer") from None
        node_id = answer.peer.node_id or None
        if node_id is not None:
            self.node_ids[peer_id.to_base58()] = node_id
        return rtt, node_id, answer.dht_time or None

    async def find(self, peer_id, key_ids: list[bytes]):
        """``DHTProtocol.rpc_find`` for ``key_ids``: a list of FindResult, aligned with the keys."""
        # An empty NodeInfo: the peer does not add us to its routing table (hivemind's client mode).
        raw = await self.call(peer_id, FIND_HANDLER, wire.FindRequest(keys=key_ids, peer=wire.NodeInfo()))
        try:
            answer = wire.FindResponse.FromString(raw)
        except Exception:
            raise LightError(f"{peer_id} sent an unparseable find answer") from None
        if len(answer.results) != len(key_ids):
            raise LightError(f"{peer_id} answered {len(answer.results)} results for {len(key_ids)} keys")
        if answer.peer.node_id:
            self.node_ids[peer_id.to_base58()] = answer.peer.node_id
        return list(answer.results)

    # -------------------------------------------------------------- walk
    async def get(self, keys: dict[str, bool], start_peers: list, *, budget_s: float = 10.0,
                  beam_size: int = BEAM_SIZE, on_value=None) -> dict[str, Found]:
        """Find the latest value of each key, like hivemind's ``DHT.get(key, latest=True)``.

        :param keys: raw key -> whether it holds the run's records (then the records schema applies).
        :param start_peers: libp2p IDs to ask first (their addresses must be known).
        :param on_value: ``callback(key, Found)`` after each merged answer (e.g. to learn addresses
            from records, so that their peers become dialable).
        :returns: raw key -> :class:`Found`; dictionary items merged across peers (the latest
            expiration of each subkey wins) and expired ones dropped, as hivemind does.
        """
        from libp2p.peer.id import ID  # lazy

        ids = {key: wire.dht_id(key) for key in keys}
        found = {key: Found() for key in keys}
        asked: set[str] = set()
        candidates: dict[str, Any] = {}  # base58 -> ID, peers we heard of
        named_by: dict[str, Any] = {}  # base58 -> the ID of the peer whose answer named it
        for p in start_peers:
            candidates[p.to_base58()] = p
        first = [p.to_base58() for p in start_peers]

        def distance(b58: str) -> int:
            node = self.node_ids.get(b58)
            if node is None:
                return -1  # initial peers first
            return min(wire.xor_distance(node, key_id) for key_id in ids.values())

        def next_batch() -> list[str]:
            known = sorted((b for b in candidates if b in self.node_ids or b in first), key=distance)
            beam = known[:beam_size] + [b for b in first if b not in known[:beam_size]]
            return [b for b in beam if b not in asked][:max(1, beam_size)]

        async def ask(b58: str) -> None:
            peer = candidates[b58]
            try:
                if not self.dialable(peer) and not (b58 in named_by and await self.resolve(peer, named_by[b58])):
                    raise LightError(f"no known address for {b58}")
                await self.connect(peer)
                results = await self.find(peer, list(ids.values()))
            except LightError as e:
                logger.debug(f"light walk: {e}")
                for f in found.values():
                    f.failed.add(b58)
                return
            for (key, is_records), res in zip(keys.items(), results):
                f = found[key]
                f.asked.add(b58)
                self._merge(f, ids[key], res, is_records, b58)
                for node_id, raw_peer in zip(res.nearest_node_ids, res.nearest_peer_ids):
                    try:
                        other = ID(raw_peer)
                        other_b58 = other.to_base58()
                    except Exception:
                        continue
                    if len(node_id) <= 20 and other_b58 not in candidates and len(candidates) < 4 * MAX_QUERIES:
                        candidates[other_b58] = other
                        named_by[other_b58] = peer
                        self.node_ids.setdefault(other_b58, node_id)
                if on_value is not None:
                    on_value(key, f)

        with trio.move_on_after(budget_s):
            while len(asked) < MAX_QUERIES:
                batch = next_batch()
                if not batch:
                    break
                asked.update(batch)
                async with trio.open_nursery() as nursery:
                    for b58 in batch:
                        nursery.start_soon(ask, b58)
        now = clock.now()  # (a dashboard runs for days: a step of this machine's clock must not drop the records)
        for f in found.values():
            f.items = {k: v for k, v in f.items.items() if v[1] >= now}
        return found

    @staticmethod
    def _merge(f: Found, key_id: bytes, res, is_records: bool, source: str) -> None:
        expiration = res.expiration_time
        if res.type == wire.FOUND_DICTIONARY:
            try:
                decoded = wire.loads(res.value)
            except Exception:
                return
            if not isinstance(decoded, wire.DictionaryValue):
                return
            items = verified_dictionary(key_id, list(decoded), schema=is_records)
            if items is None:
                return
            for subkey, value, exp in items:
                held = f.items.get(_hashable(subkey))
                if held is None or held[1] < exp:
                    f.items[_hashable(subkey)] = (value, exp)
            f.holders.add(source)
        elif res.type == wire.FOUND_REGULAR and not is_records:  # a regular value under the records key never validates
            ok, value = verified_value(key_id, res.value, expiration)
            if ok and (f.expiration is None or expiration > f.expiration) and expiration >= clock.now():
                f.value, f.expiration = value, expiration
                f.holders.add(source)


def _hashable(subkey: Any) -> Any:
    return tuple(subkey) if isinstance(subkey, list) else subkey


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:200] if text else type(e).__name__


@asynccontextmanager
async def open_client(call_timeout_s: float = CALL_TIMEOUT_S) -> AsyncIterator[LightClient]:
    """A started host with a fresh identity, Noise security and Yamux, listening nowhere."""
    # lazy
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    if not os.environ.get("LIBP2P_DEBUG"):  # libp2p logs every failed dial as an error: ours say it in one line
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX")
    async with host.run(listen_addrs=[]):
        try:
            yield LightClient(host, call_timeout_s)
        finally:
            with trio.move_on_after(2.0):
                try:
                    await host.close()
                except Exception:
                    pass

