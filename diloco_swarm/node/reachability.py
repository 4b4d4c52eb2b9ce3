"""The node's reachability at start: whether other peers can dial it, and one line that says what the
answer means for the volunteer (a full peer, a client behind NAT, or --initial-peers of another run).
The dial-back itself is averaging/reachability.py; the node acts on the verdict (node/startup.py)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Callable

from diloco_swarm.averaging.reachability import check_reachability, transport_addrs
from diloco_swarm.averaging.state_sharing import state_donors
from diloco_swarm.dht.records import read_peer_records
from diloco_swarm.dht.swarm import peer_ids_of, visible_maddrs


def is_loopback(maddr: str) -> bool:
    """Whether a multiaddr's host is a loopback address (/ip4/127.x or /ip6/::1)."""
    parts = maddr.split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def not_in_run_line(run_id: str) -> str:
    """The line for --initial-peers that answered (our DHT bootstrapped through them) while the DHT holds
    neither the run spec nor a state donor of run ``run_id``: they are in another run, most often a
    --run-id missing or mistyped. Their run cannot be named: run ids are DHT keys, hashed, and a peer
    serves no list of the runs it is in."""
    return (f"the --initial-peers answered but are not in run '{run_id}': check --run-id (a node prints the run id "
            f"to join it with: `diloco-node join --run-id RUN ...`); starting run '{run_id}' as its first peer")


@dataclass
class ReachabilityAtStart:
    """The start-up check of one node (``cfg``: its NodeConfig; ``stop``: its StopFlag; ``log``: one
    line to the user; ``metrics``: its MetricsWriter, which gets a ``reachability`` event)."""

    cfg: Any
    dht: Any
    spec: Any
    peer_id: str
    stop: Any
    log: Callable[[str], None]
    metrics: Any

    def not_in_run(self, run_found: bool) -> bool:
        """One line (:func:`not_in_run_line`) when our DHT bootstrapped through --initial-peers but
        found neither our run's spec (``run_found``: ``ensure_run_spec``'s answer) nor a state donor of
        it: the peers are in another run. :returns: whether it said so.
        :raises ChildUnavailable: the DHT process is gone or did not answer in time."""
        if not self.cfg.initial_peers or run_found:
            return False
        if any(p != self.peer_id for p in state_donors(self.dht, self.spec.run_id)):
            return False  # (a swarm restarted after its spec expired: its peers serve its state again)
        self.log(not_in_run_line(self.spec.run_id))
        return True

    def detect(self, *, client_mode: bool, averager_type: type, admission: Any, not_in_run: bool = False) -> str:
        """Ask a public peer to dial us back (averaging/reachability.py, with ``averager_type``'s
        handler and our private-run pass ``admission``) unless --client-mode or --public decided it.
        ``not_in_run``: the --initial-peers answered but are in no run of ours (:meth:`not_in_run`
        said so). :returns: "reachable", "unreachable" or "unknown"."""
        cfg = self.cfg
        if self.stop.requested:
            return "unknown"
        if client_mode:
            self.log("client mode (--client-mode): this node dials out only; it averages through public "
                            "peers but reduces no parts and donates no state")
            return "unknown"
        if cfg.public:
            ports = sorted({int(m.split("/tcp/")[1].split("/")[0]) for m in visible_maddrs(self.dht) if "/tcp/" in m})
            where = (", ".join(cfg.announce) if cfg.announce else f"port {cfg.port}" if cfg.port else
                     f"port {', '.join(map(str, ports)) or '(random)'}, chosen at random: pass --port to keep one "
                     "across restarts (a router's forward and other peers' --initial-peers need a fixed one)")
            self.log("--public: reachability not checked; other peers must be able to dial " + where)
            return "unknown"
        if not cfg.initial_peers:
            return "unknown"  # the first peer: whoever joins through it proves it reachable
        maddrs = transport_addrs(visible_maddrs(self.dht))
        of_this_run = [p for p in state_donors(self.dht, self.spec.run_id) if p != self.peer_id]
        candidates = of_this_run + [p for p in peer_ids_of(cfg.initial_peers) if p not in of_this_run and p != self.peer_id]
        if self.spec.organiser is not None:  # a private run: only invited peers judge whether we are reachable
            invited = read_peer_records(self.dht, self.spec.run_id, organiser=self.spec.organiser)
            of_this_run, candidates = [p for p in of_this_run if p in invited], [p for p in candidates if p in invited]
        verdict = check_reachability(self.dht, averager_type, self.spec.run_id, candidates, maddrs,
                                     stop=self.stop.event, admission=admission)
        self.metrics.write({"event": "reachability", "peer_id": self.peer_id, "reachable": verdict.reachable,
                            "responder": verdict.responder, "reason": verdict.reason, "maddrs": maddrs})
        if verdict.reachable is True:
            self.log(f"reachable: peer {verdict.responder} dialed us back; serving as a full peer")
            return "reachable"
        if verdict.reachable is None and not of_this_run:
            # the --initial-peers serve no handler of this run: likely another --run-id, not NAT
            if not not_in_run:  # (else said already, in the one line that names the run)
                self.log(f"could not check reachability: no peer of run '{self.spec.run_id}' is known yet and "
                                f"the --initial-peers did not answer for this run ({verdict.reason}); serving as a full "
                                "peer")
            return "unknown"
        if verdict.reachable is None:
            # on loopback only (the demo, tests) there is no router to be behind: no hint
            hint = "" if maddrs and all(is_loopback(a) for a in maddrs) else (
                ". Behind a home router without port forwarding? Restart with --client-mode")
            self.log(f"could not check reachability ({verdict.reason}); serving as a full peer{hint}")
            return "unknown"
        port = cfg.port or "PORT"
        self.log(
            f"unreachable: peer {verdict.responder} could not dial us back ({verdict.reason}); running as a client "
            f"(trains and averages, but reduces no parts and donates no state). To serve as a full peer, forward TCP "
            f"port {port} on your router and restart with --port {port} --announce /ip4/YOUR_PUBLIC_IP/tcp/{port} "
            "(docs/networking.md); or run as is"
        )
        return "unreachable"
