"""Reachability: can the other peers of the swarm open a connection to this node?

A home PC behind a router (NAT) can dial out but its router drops inbound connections. hivemind
averaging with such a peer as a full member fails, often silently (docs/networking.md), so a
joining node asks a public peer of the swarm to **dial it back**:

1. The joining node (from its DHT process) calls ``rpc_check_reachability`` on a public peer's
   averager, sending the transport multiaddrs it listens on (``/ip4/A/tcp/P``; at most
   :data:`MAX_ADDRS`).
2. That peer starts a throwaway libp2p host with a **new identity** (``hivemind.P2P.create``, no
   listen address, like hivemind's own ``P2P.is_identity_taken``), so the connection the asking
   node opened cannot be reused, and dials the asking peer id on those addresses within
   :data:`DIAL_TIMEOUT_S`. The libp2p handshake proves that the address reaches *that* peer id,
   so a different program (or the responder itself) on the same port does not count.
3. The answer is ``{"reachable": bool, "conclusive": bool, "reason": str}``; ``conclusive`` is
   false when the responder could not run the check (bad request, asked too often, its own
   daemon failed), and the asking node then asks another peer.

Wire format (protobuf messages reused from hivemind, JSON in the ``metadata`` bytes):
request ``averaging_pb2.DownloadData(metadata=b'{"maddrs": [...]}')``, response
``averaging_pb2.DownloadData(metadata=b'{"reachable": true, "conclusive": true, "reason": ""}')``.
The responder treats every request as untrusted: bounded size, TCP addresses only, no relay
addresses, one check per asking peer per :data:`MIN_INTERVAL_S`, one dial at a time.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.multiaddr import Multiaddr

from diloco_swarm.dht.calls import dht_run

MAX_ADDRS = 8
MAX_ADDR_LEN = 200
MAX_REQUEST_BYTES = 4096
DIAL_TIMEOUT_S = 6.0
REQUEST_TIMEOUT_S = 30.0  # the responder starts a libp2p daemon (~1 s, more on a busy machine)
MIN_INTERVAL_S = 10.0
MAX_RESPONDERS = 3


@dataclass
class Verdict:
    """The outcome of a reachability check.

    ``reachable`` is True (a public peer dialed us back), False (it could not) or None (no
    public peer answered: unknown).
    """

    reachable: bool | None
    responder: str = ""
    reason: str = ""


def transport_addrs(maddrs: Sequence[Any]) -> list[str]:
    """This node's listen addresses without the ``/p2p/<id>`` part, TCP only, deduplicated."""
    out: list[str] = []
    for a in maddrs:
        if "p2p-circuit" in str(a):
            continue  # a relay's address, not ours
        text = str(a).split("/p2p/")[0]
        if "/tcp/" in text and text not in out:
            out.append(text)
    return out[:MAX_ADDRS]


def parse_request(payload: bytes) -> list[Multiaddr]:
    """Validate a dial-back request from an untrusted peer.

    :returns: the multiaddrs to dial (TCP over ip4/ip6/dns, no relay, at most :data:`MAX_ADDRS`).
    :raises ValueError: with a short reason for anything else.
    """
    if len(payload) > MAX_REQUEST_BYTES:
        raise ValueError("request too large")
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("request is not JSON") from None
    addrs = body.get("maddrs") if isinstance(body, dict) else None
    if not isinstance(addrs, list) or not addrs or len(addrs) > MAX_ADDRS:
        raise ValueError(f"expected 1..{MAX_ADDRS} multiaddrs")
    out = []
    for a in addrs:
        if not isinstance(a, str) or len(a) > MAX_ADDR_LEN:
            raise ValueError("a multiaddr is not a short string")
        try:
            m = Multiaddr(a)
        except Exception:
            raise ValueError(f"not a multiaddr: {a[:60]!r}") from None
        protocols = [p.name for p in m.protocols()]
        if protocols[:1] not in (["ip4"], ["ip6"], ["dns"], ["dns4"], ["dns6"]) or protocols[1:] != ["tcp"]:
            raise ValueError(f"only /ip4|ip6|dns/HOST/tcp/PORT addresses are dialed, not {a[:60]!r}")
        out.append(m)
    return out


def encode(body: dict[str, Any]) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=json.dumps(body).encode())


def decode_verdict(message: averaging_pb2.DownloadData) -> tuple[bool | None, str]:
    """Parse a responder's answer (untrusted): (reachable, or None when inconclusive; reason).

    :raises ValueError: malformed answer.
    """
    body = json.loads(bytes(message.metadata[:MAX_REQUEST_BYTES]).decode("utf-8"))
    if not isinstance(body, dict) or not isinstance(body.get("reachable"), bool):
        raise ValueError("malformed reachability answer")
    reason = str(body.get("reason", ""))[:200]
    return (body["reachable"] if body.get("conclusive") is True else None), reason


async def dial_back(peer_id: PeerID, maddrs: Sequence[Multiaddr], timeout: float = DIAL_TIMEOUT_S) -> tuple[bool, str]:
    """Dial ``peer_id`` at ``maddrs`` from a fresh libp2p host (new identity, nothing listening).

    Wraps ``hivemind.P2P.create`` + the daemon's ``connect``; the libp2p security handshake checks
    the peer id. :returns: (reachable, reason when not).
    """
    p2p = await P2P.create(dht_mode="client", no_listen=True, auto_nat=False, nat_port_map=False,
                           use_relay=False, use_auto_relay=False)  # raises when the daemon cannot start
    try:
        await asyncio.wait_for(p2p._client.connect(peer_id, list(maddrs)), timeout=timeout)
        return True, ""
    except asyncio.TimeoutError:
        return False, f"no answer within {timeout:.0f}s"
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return False, text[:160]
    finally:
        await p2p.shutdown()


class Responder:
    """Answers dial-back requests on a public peer (lives in the averager process)."""

    def __init__(self) -> None:
        self._last_check: dict[PeerID, float] = {}
        self._lock: asyncio.Lock | None = None

    async def answer(self, request: averaging_pb2.DownloadData, remote: PeerID) -> averaging_pb2.DownloadData:
        """The ``rpc_check_reachability`` handler's body: dial ``remote`` back at the addresses it asks for."""
        try:
            maddrs = parse_request(bytes(request.metadata))
        except ValueError as e:
            return encode({"reachable": False, "conclusive": False, "reason": f"bad request: {e}"})
        now = time.monotonic()
        if now - self._last_check.get(remote, -1e9) < MIN_INTERVAL_S:
            return encode({"reachable": False, "conclusive": False, "reason": "asked again too soon"})
        self._last_check[remote] = now
        if len(self._last_check) > 4096:  # forget old askers; bounded memory
            self._last_check = {p: t for p, t in self._last_check.items() if now - t < MIN_INTERVAL_S}
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one throwaway daemon at a time
            try:
                ok, reason = await dial_back(remote, maddrs)
            except Exception as e:
                return encode({"reachable": False, "conclusive": False, "reason": f"responder error: {e}"[:200]})
        return encode({"reachable": ok, "conclusive": True, "reason": reason})


def shown_admission(payload: bytes) -> dict | None:
    """The pass a dial-back request shows (``admission``), unchecked; None when absent or unreadable."""
    if len(payload) > MAX_REQUEST_BYTES:
        return None
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    shown = body.get("admission") if isinstance(body, dict) else None
    return shown if isinstance(shown, dict) else None


def refusal(reason: str) -> averaging_pb2.DownloadData:
    """An inconclusive answer to a dial-back request we will not serve: the asker tries another responder."""
    return encode({"reachable": False, "conclusive": False, "reason": reason})


class AskDialBack:
    """DHT coroutine (runs in the DHT process via ``DHT.run_coroutine``): ask up to
    :data:`MAX_RESPONDERS` of ``candidates`` to dial us back; the first definite answer wins.

    ``servicer`` is the class whose ``rpc_check_reachability`` the responders serve (the averager,
    ``PseudoGradientAverager``): its name is part of the handler's name on the wire. It is passed in,
    not imported here, because the averager imports this module (its :class:`Responder`)."""

    def __init__(self, servicer: type[ServicerBase], prefix: str, candidates: Sequence[str], maddrs: Sequence[str],
                 admission: dict | None = None):
        self.servicer, self.prefix, self.candidates, self.maddrs = servicer, prefix, list(candidates), list(maddrs)
        self.admission = admission

    async def __call__(self, _dht, node) -> Verdict:
        try:
            # a private run's joiner shows its pass here: its record is not in the DHT yet
            request = encode({"maddrs": self.maddrs, **({"admission": self.admission} if self.admission else {})})
        except Exception as e:
            return Verdict(None, reason=f"{type(e).__name__}: {e}"[:200])
        order = list(self.candidates)
        random.shuffle(order)
        tried = []
        for peer in order[:MAX_RESPONDERS]:
            try:
                stub = self.servicer.get_stub(node.p2p, PeerID.from_base58(peer), namespace=self.prefix)
                answer = await asyncio.wait_for(stub.rpc_check_reachability(request), timeout=REQUEST_TIMEOUT_S)
                reachable, reason = decode_verdict(answer)
            except Exception as e:
                tried.append(f"{peer[:12]}: {type(e).__name__}")
                continue
            if reachable is not None:
                return Verdict(reachable, responder=peer, reason=reason)
            tried.append(f"{peer[:12]}: {reason}")
        return Verdict(None, reason="; ".join(tried) or "no public peer to ask")


def check_reachability(dht, servicer: type[ServicerBase], prefix: str, candidates: Sequence[str],
                       maddrs: Sequence[str], stop: threading.Event | None = None,
                       admission: dict | None = None) -> Verdict:
    """Ask public peers (peer ids in ``candidates``) of run ``prefix`` to dial ``maddrs`` back through
    the ``rpc_check_reachability`` of their ``servicer`` (the averager class, ``PseudoGradientAverager``).
    ``admission``: in a private run, our record's pass (invites.Invitation.admission_pass), shown with
    the request.

    Blocks at most about ``MAX_RESPONDERS * REQUEST_TIMEOUT_S`` seconds (bounded even if the DHT
    process dies), less when ``stop`` is set. Never raises for network trouble: an inconclusive
    check is ``Verdict(None, ...)``.
    """
    if not candidates or not maddrs:
        return Verdict(None, reason="no public peer to ask" if maddrs else "no TCP listen address")
    try:
        return dht_run(dht, AskDialBack(servicer, prefix, candidates, maddrs, admission),
                       timeout=MAX_RESPONDERS * REQUEST_TIMEOUT_S + 10, what="reachability check", stop=stop)
    except Exception as e:
        return Verdict(None, reason=f"{type(e).__name__}: {e}"[:200])
