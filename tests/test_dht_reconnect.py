"""A DHT that dropped live peers gets them back (node/redial.py: ReconnectPeers), and a crashed
peer is told from a live one at once (ProbePeers).

Real hivemind DHTs on 127.0.0.1. The fault is the one hivemind applies itself after a call that
timed out under load (``DHTProtocol.update_routing_table(responded=False)`` and the blacklist's
ban), injected here from test code.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from diloco_swarm.dht.calls import dht_run, dht_visible_maddrs
from diloco_swarm.dht.signing import record_validators
from diloco_swarm.dht.swarm import start_dht
from diloco_swarm.node.redial import gone_peers, reconnect_peers


class _DropPeer:
    """What hivemind does to a peer whose call timed out: out of the routing table, banned."""

    def __init__(self, peer: str):
        self.peer = peer

    async def __call__(self, _dht, node) -> None:
        from hivemind.p2p import PeerID

        peer_id = PeerID.from_base58(self.peer)
        node_id = node.protocol.routing_table.get(peer_id=peer_id)
        if node_id is not None:
            del node.protocol.routing_table[node_id]
        node.blacklist.register_failure(peer_id)
        node.blacklist.register_failure(peer_id)  # the second timeout: banned 10 s, then 20, 40...


class _Knows:
    """Whether the DHT has ``peer`` in its routing table and not banned."""

    def __init__(self, peer: str):
        self.peer = peer

    async def __call__(self, _dht, node) -> bool:
        from hivemind.p2p import PeerID

        peer_id = PeerID.from_base58(self.peer)
        return peer_id in node.protocol.routing_table and peer_id not in node.blacklist


@pytest.fixture
def swarm(tmp_path):
    dhts = []
    try:
        for name in "abc":
            initial = [str(a) for a in dht_visible_maddrs(dhts[0])] if dhts else []
            dhts.append(start_dht(initial_peers=initial, host="127.0.0.1", port=0,
                                  identity_path=tmp_path / f"{name}.key",
                                  record_validators=record_validators("reconnect", tmp_path)))
        yield dhts
    finally:
        for dht in dhts:
            with contextlib.suppress(Exception):
                dht.shutdown()


@pytest.mark.timeout(120)
def test_a_dropped_live_peer_is_put_back_and_a_crashed_one_is_told_apart(swarm):
    a, b, c = swarm
    peers = {str(d.peer_id): [str(m) for m in dht_visible_maddrs(d)] for d in (b, c)}
    b_id, c_id = str(b.peer_id), str(c.peer_id)
    assert dht_run(a, _Knows(b_id), timeout=10) and dht_run(a, _Knows(c_id), timeout=10)
    assert reconnect_peers(a, peers) == (0, 0)  # nothing missing: no dial at all

    dht_run(a, _DropPeer(b_id), timeout=10)
    assert not dht_run(a, _Knows(b_id), timeout=10)
    assert gone_peers(a, [b_id]) == set()  # banned, but it answers: alive, and the answer lifts the ban
    assert dht_run(a, _Knows(b_id), timeout=10)
    dht_run(a, _DropPeer(b_id), timeout=10)
    assert reconnect_peers(a, peers) == (1, 1)
    assert dht_run(a, _Knows(b_id), timeout=10), "b answered the ping but is still out of a's routing table"

    assert gone_peers(a, [b_id, c_id, "not-a-peer-id"]) == set()
    c.shutdown()  # gone for good: its ping is refused at once, while b answers
    t0 = time.monotonic()
    assert gone_peers(a, [b_id, c_id]) == {c_id}
    assert time.monotonic() - t0 < 3
    dht_run(a, _DropPeer(c_id), timeout=10)
    t0 = time.monotonic()
    assert reconnect_peers(a, peers) == (1, 0)
    assert time.monotonic() - t0 < 20
    assert dht_run(a, _Knows(b_id), timeout=10)
