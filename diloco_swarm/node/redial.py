"""Dialing known peers again, so that swarms that started apart merge.

A paused run restarted all at once: every node dials the peers it saw before (``peers.json``),
none of them is up yet, so each starts a new swarm of the same run, and they never met again.
A node that started a new swarm although it knew peers therefore keeps dialing them
(:class:`Redialer`, every :data:`REDIAL_EVERY_S`, each dial bounded), until one answers: then
the two DHTs share their routing tables, and matchmaking finds the others' group keys.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

from diloco_swarm.dht.calls import dht_run

logger = logging.getLogger(__name__)

REDIAL_EVERY_S = 20.0
DIAL_TIMEOUT_S = 5.0  # one peer: connect, then ping, each at most this long


class DialPeers:
    """DHT coroutine (runs in the DHT process): connect to and ping each multiaddr, so the DHT adds
    those peers to its routing table (hivemind's ``DHTProtocol.call_ping``). Returns how many answered."""

    def __init__(self, maddrs: Sequence[str], timeout: float = DIAL_TIMEOUT_S):
        self.maddrs, self.timeout = list(maddrs), timeout

    async def __call__(self, _dht, node) -> int:
        import asyncio

        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

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
