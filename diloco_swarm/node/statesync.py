"""State sync: a peer's θ_global, outer momentum and outer step, downloaded and adopted.

- **Join sync**: a late joiner adopts the state of the most advanced peer (`_join_sync`).
- **Reconcile**: after a round, the members that started it from a θ_global other than the
  canonical one download the canonical state, and a peer more than one outer step behind the
  swarm downloads the newest (`_reconcile`, on the averaging thread; the training thread adopts it).
- **Donation**: this peer serves a consistent snapshot of its state (`_state_for_donation`).

A mixin of :class:`diloco_swarm.node.runner.Node`: it uses the node's θ_global (``outer``),
averager, run spec, lock and reports. Every payload comes from an untrusted peer and is checked
against the run spec before anything changes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from diloco_swarm.node.redial import dial_peers

MAX_DONOR_TRIES = 4
STATE_CHUNK_TIMEOUT_S = 10.0
EVIDENCE_QUORUM = 2  # distinct signing keys whose records must claim a state before a peer adopts it
EVIDENCE_RETRY_S = 0.5  # a fresh round's output may take a moment to reach its members' records


def evidenced_states(entries, me: str) -> dict[tuple[int, str], set[str]]:
    """The states (outer step, θ digest) that other peers' signed records support.

    A state counts when at least :data:`EVIDENCE_QUORUM` distinct record owners (signing keys) claim
    it among the θ marks of their own rounds, or all of them when fewer are online. One peer's word,
    however advanced, never makes a state canonical: the owner keys sign the records, so a single
    hostile peer cannot speak for others (docs/architecture.md, threat model).

    :param entries: ``dht.records.read_peer_entries`` output (verified, signed records).
    :param me: our peer id: our own record is no evidence for us.
    :returns: ``{(outer_step, digest): {peer id of a claimant, ...}}`` of the supported states.
    """
    from diloco_swarm.dht.lineages import marks_of

    claims: dict[tuple[int, str], dict[str, str]] = {}  # state -> {owner: the peer id its record names}
    owners = set()
    for entry in entries or []:
        record = entry.record
        if record is None or record.peer_id == me:
            continue
        owners.add(entry.owner)
        for step, digest in marks_of([(m.step, m.digest) for m in record.theta_marks]).items():
            claims.setdefault((step, digest), {})[entry.owner] = record.peer_id
    quorum = min(EVIDENCE_QUORUM, max(1, len(owners)))
    return {state: set(who.values()) for state, who in claims.items() if len(who) >= quorum}


@dataclass
class DownloadedState:
    """A peer's checked state (θ_global + outer momentum tensors, fp32 CPU) and where it came from."""

    donor: str
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    received: int  # bytes
    seconds: float
    reason: str  # join | diverged | lagging


class StateSync:
    """Join sync, reconcile and state donation of a :class:`~diloco_swarm.node.runner.Node`."""

    def _state_for_donation(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(metadata, θ_global tensors + outer momentum tensors), a consistent snapshot."""
        with self._state_lock:
            theta = [t.clone() for t in self.outer.theta]
            momentum = self.outer.momentum_buffers()
            step = self.outer_step
        meta = {"outer_step": step, "spec_hash": self.spec.spec_hash(), "theta_digest": theta_digest(theta),
                "peer_id": self.peer_id}
        return meta, theta + momentum

    def _check_state(self, meta: Any, tensors: list[torch.Tensor], min_step: int) -> str | None:
        """Why a downloaded state is unusable, or None. The donor is untrusted."""
        n = len(self.outer.theta)
        if not isinstance(meta, dict):
            return "no metadata"
        if meta.get("spec_hash") != self.spec.spec_hash():
            return "it belongs to another run spec"
        step = meta.get("outer_step")
        if not isinstance(step, int) or step < min_step:
            return f"its outer step {step!r} is older than {min_step}"
        if len(tensors) != 2 * n:
            return f"{len(tensors)} tensors instead of {2 * n}"
        for t, ref in zip(tensors, self.outer.theta + self.outer.theta):
            if t.shape != ref.shape or t.dtype != torch.float32:
                return "tensor shapes or dtypes differ from this model"
            if not torch.isfinite(t).all():
                return "non-finite values"
        if theta_digest(tensors[:n]) != meta.get("theta_digest"):
            return "θ_global does not match its digest"
        return None

    def _join_sync(self) -> None:
        """Late joiner: adopt the state of the most advanced peer if it is ahead of ours."""
        if not self.cfg.initial_peers:
            return
        deadline = time.monotonic() + 5.0
        donors: dict[str, float] = {}
        while not donors and time.monotonic() < deadline and not self.stop.requested:
            donors = self.averager.donors()
            if not donors:
                time.sleep(0.5)
        if not donors:
            # Bootstrap check (guards against DHT splits, hivemind #624): we were given initial
            # peers but see nobody of this run. Re-bootstrap once, then warn in one line.
            dial_peers(self.dht, self.cfg.initial_peers)
            time.sleep(1.0)
            donors = self.averager.donors()
        if not donors:
            self.status.log(f"warning: this node sees no other peer of run '{self.spec.run_id}' yet; check "
                            "--run-id and --initial-peers. Training alone until peers appear; starting from "
                            + ("our checkpoint" if self.outer_step else "the initial weights"))
            return
        evidence = self._evidence()
        newest = max((step for step, _ in evidence), default=0)
        if newest > self.outer_step and not self._sync_state(min_step=newest, reason="join", attempts=3,
                                                             candidates=self._holders(evidence, newest)):
            self.status.log(f"could not download the swarm's state (outer step {newest}); "
                            f"continuing from outer step {self.outer_step}")

    def _evidence(self) -> dict[tuple[int, str], set[str]]:
        """:func:`evidenced_states` from a fresh read of the swarm's signed records."""
        from diloco_swarm.dht.records import read_peer_entries

        return evidenced_states(read_peer_entries(self.dht, self.spec.run_id), self.peer_id)



    def _reconcile(self, gathered: dict[str, Any], mine: tuple[int, str]) -> "DownloadedState | None":
        """After a round: if the group's members started it from different θ_global, the
        members not holding the canonical one (among states a member can donate: newest outer
        step, then most members, then digest order) download it from one that does; and a peer more
        than one outer step behind the swarm's newest downloads too (lagging peer).
        :returns: the state to adopt instead of applying the round, or None."""
        entries: dict[str, tuple[int, str]] = {}
        for peer, meta in gathered.items():
            if isinstance(meta, dict) and isinstance(meta.get("outer_step"), int) and isinstance(
                meta.get("theta_digest"), str
            ):
                entries[peer] = (meta["outer_step"], meta["theta_digest"])
        entries[self.peer_id] = mine
        evidence = self._evidence()
        newest = max((step for step, _ in evidence), default=0)
        if len(set(entries.values())) == 1:
            if newest > mine[0] + 1:  # the swarm is ahead of this whole group
                return self._download_state(min_step=newest, reason="lagging", candidates=self._holders(evidence, newest))
            return None
        donors = self.averager.donors()
        for peer, entry in entries.items():
            if entry[0] > mine[0] and entry not in evidence and peer != self.peer_id:
                self._warn_unsupported(peer, entry[0])
        # Only a state that other peers' signed records support (or our own) may win, and only one
        # some member can donate: a client that trained alone has the newest outer step, but nobody
        # can download it (and it is one peer's history).
        donatable = {e for p, e in entries.items()
                     if (p in donors and e in evidence) or (p == self.peer_id and not self.client_mode)}
        votes = Counter(e for e in entries.values() if e in donatable or not donatable)
        canonical = max(votes, key=lambda e: (e[0], votes[e], e[1]))
        if mine != canonical:
            holders = [p for p, e in entries.items() if e == canonical]
            return self._download_state(min_step=canonical[0] + 1, reason="diverged", candidates=holders,
                                        attempts=6)
        if newest > mine[0] + 1:
            return self._download_state(min_step=newest, reason="lagging", candidates=self._holders(evidence, newest))
        return None

    @staticmethod
    def _holders(evidence: dict[tuple[int, str], set[str]], min_step: int) -> list[str]:
        """Peer ids whose records claim a supported state at ``min_step`` or later: the donors to ask."""
        return sorted({p for (step, _), peers in evidence.items() if step >= min_step for p in peers})

    def _warn_unsupported(self, peer: str, step: int) -> None:
        """Name, once per peer, a peer that claims a state no other peer's signed record supports."""
        warned = self.__dict__.setdefault("_unsupported_claims", set())
        if peer not in warned:
            warned.add(peer)
            self.status.log(f"warning: peer {peer} claims outer step {step}, which no other peer's signed record "
                            "supports; not following it")

    def _download_state(self, *, min_step: int, reason: str, candidates: list[str] | None = None,
                        attempts: int = 1) -> "DownloadedState | None":
        """Download θ_global, outer momentum and outer step from a live peer (any thread; adopts nothing).

        Donors: ``candidates`` if given, else the most advanced peers that share state (a random
        one first, so no single donor is choked), then the others. Each payload is checked
        against the run spec before use; a failed or bad donor is skipped.
        :returns: the checked state, or None when no donor gave a usable one.
        """
        max_bytes = 2 * sum(t.numel() for t in self.outer.theta) * 4 + (1 << 20)
        t0 = time.monotonic()
        for attempt in range(attempts):
            if self.stop.requested:
                return None
            evidence = self._evidence()
            if candidates is not None:
                order = [p for p in candidates if p != self.peer_id]
                random.shuffle(order)
            else:
                donors = {p: s for p, s in self.averager.donors().items() if s >= min_step}
                if not donors:
                    return None
                best = max(donors.values())
                top = [p for p, s in donors.items() if s == best]
                rest = sorted((p for p in donors if donors[p] != best), key=lambda p: -donors[p])
                random.shuffle(top)
                order = top + rest
            for peer in order[:MAX_DONOR_TRIES]:
                try:
                    meta, tensors, received = self.averager.download_state(
                        peer, timeout=STATE_CHUNK_TIMEOUT_S, max_bytes=max_bytes, stop=self.stop.event
                    )
                except Exception as e:
                    self.status.log(f"state download from {peer} failed: {e}")
                    continue
                problem = self._check_state(meta, tensors, min_step)
                if problem is None and (meta["outer_step"], meta["theta_digest"]) not in evidence:
                    evidence = self._evidence()  # the records of a fresh round may just be arriving
                    if (meta["outer_step"], meta["theta_digest"]) not in evidence:
                        problem = (f"its state (outer step {meta['outer_step']}) is claimed by no other peer's "
                                   "signed record")
                if problem is not None:
                    if "older than" not in problem:
                        self.status.log(f"refused the state of {peer}: {problem}")
                    continue
                return DownloadedState(donor=peer, meta=meta, tensors=tensors, received=received,
                                       seconds=time.monotonic() - t0, reason=reason)
            if attempt + 1 < attempts:
                time.sleep(EVIDENCE_RETRY_S)
        return None

    def _adopt_state(self, state: "DownloadedState") -> None:
        """θ_global, outer momentum and outer step ← a downloaded state; θ_local ← θ_global."""
        n = len(self.outer.theta)
        with self._state_lock:
            before = self.outer_step
            self.outer.load_theta_and_momentum(state.tensors[:n], state.tensors[n:])
            self.outer.copy_to(self.params)
            self.outer_step = state.meta["outer_step"]
        self.stats.theta_marks.append((self.outer_step, state.meta["theta_digest"]))
        self.stats.state_syncs += 1
        self.stats.sync_s += state.seconds
        self.metrics.write({"event": "state_sync", "peer_id": self.peer_id, "donor": state.donor,
                            "reason": state.reason, "from_outer_step": before, "outer_step": self.outer_step,
                            "bytes": state.received, "seconds": round(state.seconds, 3),
                            "theta_digest": state.meta["theta_digest"]})
        self.status.log(f"state sync ({state.reason}): outer step {before} -> {self.outer_step} from {state.donor} "
                        f"({state.received / 1e6:.1f} MB in {state.seconds:.1f}s)")

    def _sync_state(self, *, min_step: int, reason: str, candidates: list[str] | None = None,
                    attempts: int = 1) -> bool:
        """Download a live peer's state and adopt it now (before training: join sync).
        :returns: True when a state was adopted."""
        state = self._download_state(min_step=min_step, reason=reason, candidates=candidates, attempts=attempts)
        if state is None:
            return False
        self._adopt_state(state)
        self._checkpoint()
        return True


def theta_digest(theta: list[torch.Tensor]) -> str:
    """sha256 (16 hex digits) of θ_global's fp32 bytes (``averaging.averager.tensors_digest``)."""
    from diloco_swarm.averaging.averager import tensors_digest

    return tensors_digest(theta)
