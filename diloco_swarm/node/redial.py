"""Dialing known peers again, so that swarms that started apart merge, and a DHT keeps the swarm.

A paused run restarted all at once: every node dials the peers it saw before (``peers.json``),
none of them is up yet, so each starts a new swarm of the same run, and they never met again.
A node that started a new swarm although it knew peers therefore keeps dialing them
(:class:`Redialer`, every :data:`REDIAL_EVERY_S`, each dial bounded), until one answers: then
the two DHTs share their routing tables, and matchmaking finds the others' group keys.

A running node can lose live peers too: hivemind's DHT drops a peer from its routing table after
one call to it that timed out (``DHTProtocol.update_routing_table(responded=False)``, a 3 s limit)
and bans it from its searches with an exponential back-off (``DHTNode.blacklist``); it has no bucket
refresh to find it again. On a loaded machine four nodes of an 8-peer swarm stopped reading the
other four's records after a slow averaging window, most likely that way, and planned their rounds
among themselves: two lineages for the rest of the run (``bench scale``, groups of 4). :class:`ReconnectPeers` pings the peers
whose records we read recently and that are missing from the routing table or banned, which puts
them back (``Housekeeping.upkeep``, node/housekeeping.py, at most every :data:`REDIAL_EVERY_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Callable, Sequence

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from diloco_swarm.dht.calls import dht_run

logger = logging.getLogger(__name__)

REDIAL_EVERY_S = 20.0
DIAL_TIMEOUT_S = 5.0  # one peer: connect, then ping, each at most this long
PROBE_TIMEOUT_S = 1.0  # a ping that fails within this long means the peer is gone (a live one's answers or hangs)
RECONNECT_MAX_DIALS = 8  # peers one ReconnectPeers pass dials (the others wait for the next pass)


class DialPeers:
    """DHT coroutine (runs in the DHT process): connect to and ping each multiaddr, so the DHT adds
    those peers to its routing table (hivemind's ``DHTProtocol.call_ping``). Returns how many answered."""

    def __init__(self, maddrs: Sequence[str], timeout: float = DIAL_TIMEOUT_S):
        self.maddrs, self.timeout = list(maddrs), timeout

    async def __call__(self, _dht, node) -> int:
        answered: set[str] = set()
        for addr in self.maddrs:
            try:
                maddr = Multiaddr(addr)
                peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
                if str(peer_id) in answered:
                    continue
                await asyncio.wait_for(node.p2p._client.connect(peer_id, [maddr.decapsulate(f"/p2p/{peer_id}")]),
                                       self.timeout)
                if await asyncio.wait_for(node.protocol.call_ping(peer_id), self.timeout) is not None:
                    answered.add(str(peer_id))
            except Exception:
                continue  # that peer is still away; try the others
        return len(answered)


class ReconnectPeers:
    """DHT coroutine: ping each of ``peers`` (``{peer id: multiaddrs}``) that is missing from the
    routing table or banned by the blacklist; a peer that answers is back in both (hivemind's
    ``call_ping`` adds it; we lift the ban), at most ``max_dials`` of them. Returns ``(missing, answered)``."""

    def __init__(self, peers: dict[str, Sequence[str]], timeout: float = DIAL_TIMEOUT_S,
                 max_dials: int = RECONNECT_MAX_DIALS):
        self.peers, self.timeout, self.max_dials = {p: list(a) for p, a in peers.items()}, timeout, max_dials

    async def __call__(self, _dht, node) -> tuple[int, int]:
        missing = answered = 0
        for peer, maddrs in self.peers.items():
            try:
                peer_id = PeerID.from_base58(peer)
                if peer_id == node.peer_id or (peer_id in node.protocol.routing_table and peer_id not in node.blacklist):
                    continue
                missing += 1
                if missing > self.max_dials:
                    continue
                for addr in maddrs[:2]:  # the p2p daemon may have dropped the connection too
                    maddr = Multiaddr(addr)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(node.p2p._client.connect(
                            peer_id, [maddr.decapsulate(f"/p2p/{peer_id}") if "/p2p/" in addr else maddr]),
                            self.timeout)
                        break
                # ping even when no connect worked: a version that skipped this ping for a peer killed
                # mid-round made survivors wait out hivemind's 20 s reducer timeout in 2 of 2 bench.churn
                # runs (0 of 3 with it); why is not established (docs/decisions.md)
                if await asyncio.wait_for(node.protocol.call_ping(peer_id), self.timeout) is not None:
                    node.blacklist.register_success(peer_id)
                    answered += 1
            except Exception:
                continue  # gone for good, or a malformed address from its record: try the others
        return missing, answered


class ProbePeers:
    """DHT coroutine: which of ``peers`` (peer ids) are gone: their ping failed within ``timeout`` s
    (refused: the process is gone; no route), or it still runs then and the DHT's blacklist already
    bans them (a call to them failed lately; only when ``banned_is_gone``). A ping that answers lifts
    a ban; one still running after ``timeout`` says nothing of a peer not banned (a slow peer): it is
    not reported, unless ``only_answers_count`` (then only a peer that answers is not gone)."""

    def __init__(self, peers: Sequence[str], timeout: float, banned_is_gone: bool = True,
                 only_answers_count: bool = False):
        self.peers, self.timeout, self.banned_is_gone = list(peers), timeout, banned_is_gone
        self.only_answers_count = only_answers_count

    async def __call__(self, _dht, node) -> list[str]:
        async def gone(peer: str) -> bool:
            try:
                peer_id = PeerID.from_base58(peer)
            except Exception:
                return False
            banned = peer_id in node.blacklist
            try:
                answered = await asyncio.wait_for(node.protocol.call_ping(peer_id), self.timeout) is not None
            except asyncio.TimeoutError:
                return self.only_answers_count or (banned and self.banned_is_gone)
            if answered and banned:
                node.blacklist.register_success(peer_id)
            return not answered

        answers = await asyncio.gather(*(gone(p) for p in self.peers))
        return [p for p, g in zip(self.peers, answers) if g]


def gone_peers(dht, peers: Sequence[str], timeout: float = PROBE_TIMEOUT_S,
               stop: threading.Event | None = None, banned_is_gone: bool = True,
               only_answers_count: bool = False) -> set[str]:
    """The ``peers`` whose process is gone (:class:`ProbePeers`), all probed at once; bounded by
    ``timeout`` + 2 s; never raises. :returns: their peer ids (empty on any trouble)."""
    if not peers:
        return set()
    try:
        return set(dht_run(dht, ProbePeers(peers, timeout, banned_is_gone, only_answers_count), timeout=timeout + 2.0,
                           what="probing the round's peers", stop=stop))
    except Exception as e:
        logger.debug(f"probing {len(peers)} peers failed: {e}")
        return set()


def reconnect_peers(dht, peers: dict[str, Sequence[str]], stop: threading.Event | None = None) -> tuple[int, int]:
    """Put ``peers`` back into the DHT's routing table (:class:`ReconnectPeers`); bounded in time; never
    raises. :returns: ``(missing, answered)``: peers that were missing or banned, and those of them that
    answered ((0, 0) on any trouble)."""
    if not peers:
        return 0, 0
    try:
        timeout = 3 * DIAL_TIMEOUT_S * min(len(peers), RECONNECT_MAX_DIALS) + 5  # 2 connects and a ping each
        missing, answered = dht_run(dht, ReconnectPeers(peers), timeout=timeout,
                                    what="reconnecting to the swarm's peers", stop=stop)
        return int(missing), int(answered)
    except Exception as e:
        logger.debug(f"reconnecting to {len(peers)} peers failed: {e}")
        return 0, 0


def dial_peers(dht, maddrs: Sequence[str], stop: threading.Event | None = None) -> int:
    """Dial ``maddrs`` from the DHT process; bounded in time; never raises.

    :returns: the number of peers that answered (0 on any trouble).
    """
    if not maddrs:
        return 0
    try:
        return int(dht_run(dht, DialPeers(maddrs), timeout=2 * DIAL_TIMEOUT_S * len(maddrs) + 5,
                           what="dialing known peers", stop=stop))
    except Exception as e:
        logger.debug(f"dialing {len(maddrs)} peers failed: {e}")
        return 0


class Redialer:
    """A background thread that dials ``maddrs`` every ``every_s`` until one peer answers.

    :param on_merged: called once (from the thread) with the number of peers that answered.
    :param stop: the node's stop event; the thread ends when it is set.
    """

    def __init__(self, dht, maddrs: Sequence[str], stop: threading.Event, *,
                 on_merged: Callable[[int], None] | None = None, every_s: float = REDIAL_EVERY_S):
        self.dht, self.maddrs, self.stop, self.on_merged, self.every_s = dht, list(maddrs), stop, on_merged, every_s
        self.answered = 0
        self._thread = threading.Thread(target=self._loop, name="redial-known-peers", daemon=True)

    def start(self) -> "Redialer":
        if self.maddrs:
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                if not self.dht.is_alive():
                    return
            except Exception:
                return
            self.answered = dial_peers(self.dht, self.maddrs, stop=self.stop)
            if self.answered:
                if self.on_merged is not None:
                    self.on_merged(self.answered)
                return
