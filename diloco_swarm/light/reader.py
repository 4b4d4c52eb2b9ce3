"""Blocking entry points of the light client for ``status``, ``dashboard`` and ``probe``.

Each call runs its own trio loop and host (a fresh identity), and returns within its budget.
Records come back as :class:`~diloco_swarm.dht.records.PeerEntry`, parsed by the same code as the
hivemind path (:func:`~diloco_swarm.dht.records.peer_entries`), so both feed the same aggregation.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from diloco_swarm.dht.records import PeerEntry, peer_entries, records_key
from diloco_swarm.light.client import CALL_TIMEOUT_S, LightClient, LightError, open_client, parse_peer_maddr
from diloco_swarm.spec import parse_published_spec

logger = logging.getLogger(__name__)

READ_BUDGET_S = 15.0  # one whole read: dials, walk


def spec_key(run_id: str) -> str:
    return f"{run_id}_spec"  # written by diloco_swarm.dht.swarm.ensure_run_spec


@dataclass
class SwarmView:
    """One light read of a run."""

    entries: list[PeerEntry]
    spec: dict | None  # the run spec as published (unsigned: any peer can write it), or None
    answered: list[str] = field(default_factory=list)  # peer ids that answered our DHT calls
    unreachable: list[str] = field(default_factory=list)


async def _dial_initial(client: LightClient, maddrs: list[str]) -> list:
    """Connect to every initial peer at once; :returns: the IDs that answered."""
    peers = []
    for text in maddrs:
        peer_id, addrs = parse_peer_maddr(text)
        client.learn(peer_id, addrs)
        if peer_id not in peers:
            peers.append(peer_id)
    up = []

    async def dial(p) -> None:
        try:
            await client.connect(p)
            up.append(p)
        except LightError as e:
            logger.debug(str(e))

    async with trio.open_nursery() as nursery:
        for p in peers:
            nursery.start_soon(dial, p)
    return [p for p in peers if p in up]


async def _read(initial_peers: list[str], run_id: str, budget_s: float, call_timeout_s: float) -> SwarmView:
    start = time.monotonic()
    async with open_client(call_timeout_s) as client:
        up = await _dial_initial(client, initial_peers)
        if not up:
            raise LightError("none of the --initial-peers answered (" + ", ".join(initial_peers) + "); check the "
                             "addresses and that those nodes are running")
        rkey, skey = records_key(run_id), spec_key(run_id)

        def learn_addresses(key: str, found) -> None:
            if key == rkey:  # verified records: their maddrs make more peers dialable
                for value, _exp in found.items.values():
                    if isinstance(value, dict):
                        client.learn_maddrs(value.get("maddrs") or [])

        remaining = max(1.0, budget_s - (time.monotonic() - start))
        found = await client.get({rkey: True, skey: False}, up, budget_s=remaining, on_value=learn_addresses)
    records = found[rkey]
    spec = found[skey].value if isinstance(found[skey].value, dict) else None
    published = parse_published_spec(spec)  # a private run: records without a valid invitation refused
    entries = peer_entries(run_id, ((subkey, value, exp) for subkey, (value, exp) in records.items.items()),
                           organiser=None if published is None else published.organiser)
    return SwarmView(entries, spec, sorted(records.asked), sorted(records.failed))


def _run(async_fn, *args):
    """``trio.run``, with a LightError raised inside libp2p's nurseries unwrapped from its exception groups."""
    try:
        return trio.run(async_fn, *args)
    except BaseExceptionGroup as group:
        match, _rest = group.split(LightError)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        if match is not None:
            raise match from None
        raise


def read_swarm(initial_peers: list[str], run_id: str, *, budget_s: float = READ_BUDGET_S,
               call_timeout_s: float = CALL_TIMEOUT_S) -> SwarmView:
    """Read the run's verified records and spec through the light client (blocking, at most ~``budget_s``).

    :raises LightError: a bad multiaddr, or none of ``initial_peers`` answered.
    """
    return _run(_read, list(initial_peers), run_id, budget_s, call_timeout_s)


def entries_reader(initial_peers: list[str], run_id: str, *, budget_s: float = READ_BUDGET_S):
    """A ``() -> list[PeerEntry] | None`` for ``status`` and the dashboard's poller (None: could not read)."""

    said: list[str] = []  # the last problem logged: a poller says each once, not at every poll

    def warn(message: str) -> None:
        (logger.debug if said and said[-1] == message else logger.warning)(message)
        said[:] = [message]

    def read() -> list[PeerEntry] | None:
        try:
            entries = read_swarm(initial_peers, run_id, budget_s=budget_s).entries
        except LightError as e:
            warn(f"light client: {e}")
            return None
        except Exception as e:  # never let a poller thread die on a peer's bytes
            warn(f"light client read failed: {e!r}")
            return None
        said.clear()
        return entries

    return read


# ---------------------------------------------------------------------------------------------- probe
@dataclass
class ProbeResult:
    peer_id: str
    reachable: bool
    error: str | None = None
    connect_s: float | None = None
    rtt_s: float | None = None  # DHTProtocol.rpc_ping round trip
    protocols: list[str] = field(default_factory=list)
    dht_node: bool = False  # it answers hivemind's DHT calls
    run_ids: list[str] = field(default_factory=list)
    outer_step: int | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in self.__dict__.items()}


def run_ids_from_protocols(protocols: list[str]) -> list[str]:
    """Run ids a node serves: hivemind names its averager handlers ``{prefix}::{Class}.{method}``, and our
    prefix is the run id (client-mode nodes register no handler, so they show none)."""
    out = []
    for p in protocols:
        if "::" in p and p.endswith(".rpc_join_group"):
            run = p.split("::", 1)[0]
            if run and run not in out:
                out.append(run)
    return out


async def _probe(maddr: str, run_id: str | None, timeout_s: float) -> ProbeResult:
    peer_id, addrs = parse_peer_maddr(maddr)
    result = ProbeResult(peer_id.to_base58(), reachable=False)
    deadline = trio.current_time() + timeout_s
    async with open_client(call_timeout_s=timeout_s) as client:
        client.learn(peer_id, addrs)
        try:
            result.connect_s = await client.connect(peer_id)
        except LightError as e:
            result.error = str(e)
            return result
        result.reachable = True
        left = lambda: max(0.5, deadline - trio.current_time())  # noqa: E731
        result.protocols = await client.protocols(peer_id, wait_s=min(2.0, left()))
        client.call_timeout_s = left()
        try:
            result.rtt_s, node_id, _ = await client.ping(peer_id)
            result.dht_node = node_id is not None
        except LightError as e:
            result.error = str(e)
        result.run_ids = [run_id] if run_id else run_ids_from_protocols(result.protocols)
        for run in result.run_ids:
            client.call_timeout_s = left()
            try:
                found = await client.get({records_key(run): True}, [peer_id], budget_s=left())
            except Exception as e:  # a peer's garbage must not end the probe
                logger.debug(f"probe: reading {run} failed: {e!r}")
                continue
            entries = peer_entries(run, ((s, v, e) for s, (v, e) in found[records_key(run)].items.items()))
            mine = [e.record for e in entries if e.record is not None and e.record.peer_id == result.peer_id]
            if mine:
                newest = max(mine, key=lambda r: r.updated)
                result.outer_step, result.name = newest.outer_step, newest.name
                result.run_ids = [run]
                break
    return result


def probe(maddr: str, *, run_id: str | None = None, timeout_s: float = CALL_TIMEOUT_S) -> ProbeResult:
    """Dial one peer and describe it (blocking; at most about ``2 * timeout_s``).

    :raises LightError: ``maddr`` is not a peer multiaddr (bad input, not an unreachable peer).
    """
    return _run(_probe, maddr, run_id, timeout_s)
