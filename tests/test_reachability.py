"""The dial-back check's wire parsing (untrusted input) and a real dial on 127.0.0.1.

The NAT behaviour itself is tested end to end in tests/test_nat.py (network namespaces)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P

from diloco_swarm.averaging.reachability import (
    MAX_ADDRS,
    Responder,
    decode_verdict,
    dial_back,
    encode,
    parse_request,
    transport_addrs,
)


def req(body) -> bytes:
    return json.dumps(body).encode()


def test_transport_addrs_strip_peer_id_and_drop_relays():
    addrs = ["/ip4/10.0.0.1/tcp/31337/p2p/QmX", "/ip4/10.0.0.1/tcp/31337/p2p/QmX", "/ip4/1.2.3.4/udp/5/quic",
             "/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit/p2p/QmX"]
    assert transport_addrs(addrs) == ["/ip4/10.0.0.1/tcp/31337"]


@pytest.mark.parametrize(
    "payload, why",
    [
        (b"\xff\xfe", "not JSON"),
        (req([]), "expected"),
        (req({"maddrs": []}), "expected"),
        (req({"maddrs": ["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)}), "expected"),
        (req({"maddrs": [5]}), "short string"),
        (req({"maddrs": ["/ip4/1.2.3.4/tcp/" + "1" * 300]}), "short string"),
        (req({"maddrs": ["hello"]}), "not a multiaddr"),
        (req({"maddrs": ["/ip4/1.2.3.4/udp/1"]}), "only /ip4"),
        (req({"maddrs": ["/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]}), "only /ip4"),
        (b"x" * 5000, "too large"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(payload, why):
    with pytest.raises(ValueError, match=why):
        parse_request(payload)


def test_good_request_and_verdicts():
    assert [str(m) for m in parse_request(req({"maddrs": ["/ip4/10.1.2.3/tcp/4000", "/ip6/::1/tcp/9"]}))] == [
        "/ip4/10.1.2.3/tcp/4000", "/ip6/::1/tcp/9"]
    assert decode_verdict(encode({"reachable": True, "conclusive": True, "reason": ""})) == (True, "")
    assert decode_verdict(encode({"reachable": False, "conclusive": True, "reason": "no"})) == (False, "no")
    assert decode_verdict(encode({"reachable": False, "conclusive": False, "reason": "busy"})) == (None, "busy")
    with pytest.raises(ValueError):
        decode_verdict(encode({"reachable": "yes"}))


@pytest.mark.timeout(120)
def test_dial_back_checks_the_peer_id_on_a_fresh_connection():
    """A listening host is reachable; the same address under another peer id is not (the libp2p
    handshake checks identity); a closed port is not. The responder rate-limits a repeat asker."""

    async def scenario():
        target = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        other = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            addrs = await target.get_visible_maddrs()
            plain = [a.decapsulate(f"/p2p/{target.peer_id}") if "/p2p/" in str(a) else a for a in addrs]
            assert (await dial_back(target.peer_id, plain))[0] is True
            assert (await dial_back(other.peer_id, plain))[0] is False  # somebody else on that address
            responder = Responder()
            request = encode({"maddrs": [str(a) for a in plain]})
            first = decode_verdict(await responder.answer(request, target.peer_id))
            again = decode_verdict(await responder.answer(request, target.peer_id))
            return first, again
        finally:
            await target.shutdown()
            await other.shutdown()

    first, again = asyncio.run(scenario())
    assert first == (True, "")
    assert again[0] is None and "too soon" in again[1]


def test_a_host_without_p2pd_gets_one_clear_line(monkeypatch):
    """hivemind's wheel bundles p2pd for Linux x86-64 only: elsewhere, without a daemon, say so."""
    import platform

    from diloco_swarm.dht import swarm

    assert swarm.p2pd_problem() is None  # this machine runs it
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(swarm.os, "access", lambda *a: False)
    problem = swarm.p2pd_problem()
    assert problem and "Darwin arm64" in problem and "Linux x86-64" in problem and "docs/networking.md" in problem
    with pytest.raises(swarm.SwarmError, match="p2pd"):
        swarm.start_dht(initial_peers=[], host="127.0.0.1", port=0)


@pytest.mark.timeout(120)
def test_initial_peers_of_another_run_are_said_in_one_line_naming_ours(monkeypatch):
    """Issue 39: a joiner that pasted --initial-peers but forgot --run-id bootstrapped through them, found
    no peer of 'diloco-demo' and trained alone, told only that they "did not answer for this run". Two
    real DHTs on 127.0.0.1: the dialled one serves another run's spec; the joiner says in one line that
    they answered but are not in its run, naming it. Joining their run says nothing; nor does a run
    whose spec expired while its peers still serve its state."""
    from hivemind import DHT

    from diloco_swarm.dht.swarm import ensure_run_spec, refresh_run_spec
    from diloco_swarm.node import reachability
    from diloco_swarm.node.reachability import ReachabilityAtStart
    from diloco_swarm.spec import RunSpec

    base = dict(model="tiny", dataset="python-stdlib", seq_len=64, inner_steps=10, inner_lr=1e-3, outer_lr=0.7,
                outer_momentum=0.9, seed=0)
    theirs, ours = RunSpec(run_id="demo-20261206-212500", **base), RunSpec(run_id="diloco-demo", **base)
    dhts = []
    try:
        for initial in ([], None):
            initial = initial if initial is not None else [str(a) for a in dhts[0].get_visible_maddrs()]
            dhts.append(DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            use_relay=False, use_auto_relay=False))
        dialled, joiner = dhts
        refresh_run_spec(dialled, theirs)

        def said(spec) -> list[str]:
            lines = []
            check = ReachabilityAtStart(cfg=SimpleNamespace(initial_peers=[str(a) for a in dialled.get_visible_maddrs()]),
                                        dht=joiner, spec=spec, peer_id=joiner.peer_id.to_base58(), stop=None,
                                        log=lines.append, metrics=None)
            assert check.not_in_run(ensure_run_spec(joiner, spec, joining=True, attempts=3)) is bool(lines)
            return lines

        assert said(theirs) == []
        assert said(ours.model_copy(update={"run_id": "diloco-demo-2"})) == [
            "the --initial-peers answered but are not in run 'diloco-demo-2': check --run-id (a node prints the run "
            "id to join it with: `diloco-node join --run-id RUN ...`); starting run 'diloco-demo-2' as its first peer"]
        monkeypatch.setattr(reachability, "state_donors", lambda dht, run_id: {"QmDonor": 3.0})
        assert said(ours) == []  # its peers serve the run's state: they are in it
    finally:
        for d in dhts:
            d.shutdown()
