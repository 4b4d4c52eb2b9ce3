"""The DiLoCo loop of one node (Douillard et al., arXiv 2311.08105, Algorithm 1).

    for each outer step t:
        H inner AdamW steps on local data          (θ_local)
        Δ = θ_global − θ_local                      (fp32, CPU)
        Δ̄ = token-weighted average of Δ over a group found inside the matchmaking window,
            int8 on the wire, verified; our own Δ when no verified average (a solo round)
        θ_global ← OuterSGD_Nesterov(θ_global, grad=Δ̄);  θ_local ← θ_global
        checkpoint (atomic), metrics, DHT progress record

No global barrier: a peer never waits on another past the averaging window plus the
all-reduce timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diloco_swarm import __version__
from diloco_swarm.data import evaluate
from diloco_swarm.models import num_parameters
from diloco_swarm.node.checkpoint import (CheckpointError, checkpoint_path, load_checkpoint,
                                          remove_stale_temp_files, save_checkpoint)
from diloco_swarm.node.config import NodeConfig
from diloco_swarm.node.outer import OuterOptimizer
from diloco_swarm.node.report import MetricsWriter, StatusLine

WARMUP_INNER_STEPS = 50  # linear inner-LR warm-up over the swarm's first 50 inner steps
MAX_DONOR_TRIES = 4
STATE_CHUNK_TIMEOUT_S = 10.0
REBOOTSTRAP_EVERY_S = 30.0  # a client alone re-dials its --initial-peers this often


class NodeError(Exception):
    """A user-facing problem that stops the node before or during training (exit code 2)."""


class Diverged(NodeError):
    """The local pseudo-gradient became non-finite: inner training diverged."""


def pick_device(name: str) -> torch.device:
    """``auto`` → cuda, else mps, else cpu. :raises NodeError: an explicit device is unavailable."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise NodeError("--device cuda: no CUDA GPU is visible to PyTorch; use --device cpu or auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise NodeError("--device mps: Apple MPS is not available here; use --device cpu or auto")
    return torch.device(name)


@dataclass
class Clock:
    """Wall seconds by activity, for goodput (share of wall time spent in inner steps that were applied)."""

    inner_s: float = 0.0  # all inner steps
    wasted_inner_s: float = 0.0  # inner steps whose Δ was thrown away (state re-sync, stop)
    averaging_s: float = 0.0  # matchmaking + all-reduce + verification
    sync_s: float = 0.0  # waiting for peers and downloading state
    started: float = 0.0

    def goodput(self) -> float:
        total = time.monotonic() - self.started
        return (self.inner_s - self.wasted_inner_s) / total if total > 0 else 0.0


class StopFlag:
    """First SIGINT/SIGTERM asks for a graceful stop; a second one exits at once."""

    def __init__(self, status: StatusLine):
        self.event = threading.Event()
        self.status = status
        self.training = False  # set once set-up is done: before that there is no checkpoint to write

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            for child in mp.active_children():
                with contextlib.suppress(Exception):
                    child.kill()
            os._exit(130)
        self.event.set()
        if self.training:
            self.status.log("stopping: finishing up and writing the checkpoint (press Ctrl+C again to quit at once)")
        else:
            self.status.log("stopping: leaving before training starts (press Ctrl+C again to quit at once)")

    @property
    def requested(self) -> bool:
        return self.event.is_set()


class Node:
    """One DiLoCo peer. Build with a :class:`NodeConfig`, then :meth:`run`."""

    def __init__(self, config: NodeConfig, status: StatusLine | None = None):
        self.cfg = config
        self.spec = config.spec
        self.status = status or StatusLine()
        self.stop = StopFlag(self.status)
        self.clock = Clock()
        self.dht = None
        self.averager = None
        self.lock = None
        self.metrics = MetricsWriter(config.metrics_file)
        self.failed_rounds = 0  # a group formed, but its round was partial/unconfirmed (our Δ applied)
        self.solo_rounds = 0  # no group formed in the window
        self.state_syncs = 0
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self.last_eval_loss: float | None = None
        self.round_tokens_per_s: float | None = None  # tokens / inner seconds of the last outer step
        self.records = None
        self.last_round: dict[str, Any] | None = None
        self.client_mode = config.client_mode  # may switch on at start when we are unreachable
        self.reachability = "client" if config.client_mode else "unverified"  # public | unverified | client
        self._warned_no_public = False
        self.maddrs: list[str] = []  # where others can dial us (empty until the DHT runs)
        self._last_rebootstrap = 0.0
        self._state_lock = threading.Lock()  # θ_global is read by the donation thread

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        from diloco_swarm.averaging.averager import PseudoGradientAverager
        from diloco_swarm.dht.swarm import StateDirLock, ensure_run_spec, start_dht, visible_maddrs

        cfg, spec = self.cfg, self.spec
        self.device = pick_device(cfg.device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.lock = StateDirLock(cfg.state_dir)
        remove_stale_temp_files(cfg.state_dir)  # left by a write that a second Ctrl+C or a crash cut short

        # Everything local that can fail is checked before we touch the network.
        from diloco_swarm.node.assets import build_run_assets  # issue 11: tokenizer, data and model, and their identities

        self.assets = build_run_assets(spec, dataset=cfg.dataset, tokenizer_arg=cfg.tokenizer,
                                       max_bytes=cfg.max_dataset_bytes, log=self.status.log)
        spec = self.spec = self.assets.spec
        checkpoint = load_checkpoint(checkpoint_path(cfg.state_dir))
        if checkpoint is not None and checkpoint.get("spec") != spec.model_dump():
            theirs = checkpoint.get("spec") or {}
            diffs = ", ".join(k for k in spec.model_dump() if spec.model_dump()[k] != theirs.get(k))
            raise NodeError(
                f"state dir {cfg.state_dir} holds a checkpoint of a different run spec (differs in: {diffs}); "
                "use another --state-dir, or the flags of that run"
            )

        self.model = self.assets.model.to(self.device)
        self.assets.save_for_export(cfg.state_dir)
        if spec.seq_len > self.model.config.block_size:
            raise NodeError(
                f"--seq-len {spec.seq_len} exceeds the '{spec.model}' model's context of {self.model.config.block_size}"
            )
        self.params = list(self.model.parameters())
        self.outer = OuterOptimizer(self.params, lr=spec.outer_lr, momentum=spec.outer_momentum)
        self.inner_opt = torch.optim.AdamW(self.params, lr=spec.inner_lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.outer_step = 0
        self.inner_steps_total = 0
        self.tokens_total = 0
        if checkpoint is not None:
            self._restore(checkpoint)
            self.status.log(f"resumed from {checkpoint_path(cfg.state_dir)} at outer step {self.outer_step}")

        from diloco_swarm.averaging import codec

        if spec.compression == "int8":
            codec.encode(torch.zeros(1))  # import bitsandbytes (~5 s) now, not inside our first round
        if cfg.fault == "nan":
            codec.inject_nonfinite_scales(True)
        elif cfg.fault == "stall-allreduce":
            from diloco_swarm.averaging import allreduce

            allreduce.STALL_MARKER = cfg.state_dir / "allreduce-stalled"

        from diloco_swarm.dht.records import PeerRecordPublisher, record_validators

        validators = record_validators(spec.run_id, cfg.state_dir)
        dht_args = dict(host=cfg.host, port=cfg.port, announce=cfg.announce,
                        identity_path=cfg.state_dir / "identity.key", record_validators=validators)
        self.dht = self._start_dht_or_rejoin(dht_args)
        cfg = self.cfg  # its initial peers may now be the known peers we rejoined through
        self.peer_id = self.dht.peer_id.to_base58()
        ensure_run_spec(self.dht, spec, joining=bool(cfg.initial_peers))
        if self._detect_reachability() == "unreachable":
            # Behind NAT: a full peer would break every group it joins. Restart the DHT as a client.
            self.dht.shutdown()
            self.client_mode, self.reachability = True, "client"
            self.dht = start_dht(initial_peers=cfg.initial_peers, client_mode=True, retry_busy_port_s=15.0, **dht_args)
        self.sampler = self.assets.sampler(cfg.batch_size, spec.seq_len, seed=spec.seed, stream_id=self.peer_id)
        self.eval_set = self.assets.held_out_batches(cfg.batch_size, spec.seq_len, cfg.eval_batches)
        self.averager = PseudoGradientAverager(
            [t.clone() for t in self.outer.theta],
            self.dht,
            prefix=spec.run_id,
            compression=spec.compression,
            target_group_size=cfg.target_group_size,
            matchmaking_time=cfg.matchmaking_time,
            allreduce_timeout=cfg.allreduce_timeout,
            max_norm_ratio=cfg.max_norm_ratio,
            client_mode=self.client_mode,
            state_provider=self._state_for_donation,
        )
        if not self.client_mode:
            self.averager.state_sharing_priority = float(self.outer_step)
        addrs = self.maddrs = visible_maddrs(self.dht)
        self.records = PeerRecordPublisher(self.dht, spec.run_id, validators, self._record_snapshot, interval_s=5.0)
        self.records.start()
        self.status.log(
            f"peer {self.peer_id} | run '{spec.run_id}' | model {spec.model} "
            f"({num_parameters(self.model) / 1e6:.2f}M params) on {self.device} | data {self.assets.description}"
        )
        if self.client_mode:  # nobody can dial a client: its addresses are useless to joiners
            self.status.log("others cannot join through this node (it is a client); give them the address of a "
                            "public peer, e.g. the one in your --initial-peers")
        else:
            self.status.log("to join from another machine: diloco-node join --run-id {} {}--initial-peers {}".format(
                spec.run_id, "".join(f"{f} " for f in cfg.join_flags), " ".join(addrs) if addrs else "<this node's multiaddr>"))
        self.metrics.write(
            {
                "event": "start",
                "peer_id": self.peer_id,
                "version": __version__,
                "spec_hash": spec.spec_hash(),
                "maddrs": addrs,
                "device": str(self.device),
                "outer_step": self.outer_step,
            }
        )

    def _start_dht_or_rejoin(self, dht_args: dict[str, Any]):
        """Start the DHT through ``--initial-peers``; without them, through the peers this node saw
        before (``state_dir/peers.json``, node/known_peers.py), so a restarted first node rejoins its
        swarm instead of starting a second one. If none of those answers, start a new swarm. If no
        ``--initial-peers`` answer, try the known peers before giving up.

        :raises SwarmError: as :func:`~diloco_swarm.dht.swarm.start_dht`; BootstrapFailed when neither
            the ``--initial-peers`` nor the known peers answered.
        """
        from diloco_swarm.dht.swarm import BootstrapFailed, peer_ids_of, start_dht
        from diloco_swarm.node.known_peers import known_peers_path, load_known_peers, remember_peers

        cfg, run_id = self.cfg, self.spec.run_id
        known = [a for a in load_known_peers(cfg.state_dir, run_id, warn=self.status.log) if a not in cfg.initial_peers]
        n = len(peer_ids_of(known))
        saw = f"the {n} peer{'s' if n != 1 else ''} of run '{run_id}' this node saw before ({known_peers_path(cfg.state_dir)})"
        them = "them" if n != 1 else "it"
        if cfg.initial_peers:
            try:
                dht = start_dht(initial_peers=cfg.initial_peers, client_mode=self.client_mode, **dht_args)
            except BootstrapFailed as err:
                # the swarm may have moved on (a restart from shell history): try where we last saw it
                if not known or self.stop.requested:
                    raise
                self.status.log(f"none of the --initial-peers answered; dialing {saw}")
                try:
                    dht = start_dht(initial_peers=known, client_mode=self.client_mode, retry_busy_port_s=15.0,
                                    **dht_args)
                except BootstrapFailed:
                    raise err from None
                self.status.log(f"rejoined the swarm through {them}")
                self.cfg = replace(cfg, initial_peers=known)
                return dht
            by_peer: dict[str, list[str]] = {}
            for addr in cfg.initial_peers:  # they answered: worth remembering
                for peer in peer_ids_of([addr]):
                    by_peer.setdefault(peer, []).append(addr)
            remember_peers(cfg.state_dir, run_id, by_peer, me=dht.peer_id.to_base58())
            return dht
        if not known:
            return start_dht(initial_peers=[], client_mode=self.client_mode, **dht_args)
        self.status.log(f"no --initial-peers: dialing {saw}")
        try:
            dht = start_dht(initial_peers=known, client_mode=self.client_mode, **dht_args)
        except BootstrapFailed:
            if self.stop.requested:
                raise
            self.status.log(f"{'none of them answered' if n != 1 else 'it did not answer'}; starting a new swarm of run '{run_id}' "
                            "(to join a running one, restart with --initial-peers)")
            return start_dht(initial_peers=[], client_mode=self.client_mode, retry_busy_port_s=15.0, **dht_args)
        self.status.log(f"rejoined the swarm through {them}")
        self.cfg = replace(cfg, initial_peers=known)
        return dht

    def _remember_peers(self, records: dict[str, Any]) -> None:
        """Save the addresses of the full peers in ``records`` for a later restart (node/known_peers.py)."""
        from diloco_swarm.node.known_peers import remember_peers

        seen = {p: r.maddrs for p, r in records.items() if r.reachability != "client" and r.maddrs}
        if seen:
            remember_peers(self.cfg.state_dir, self.spec.run_id, seen, me=self.peer_id)

    def _detect_reachability(self) -> str:
        """Ask a public peer to dial us back (averaging/reachability.py) unless --client-mode or
        --public decided it. :returns: "reachable", "unreachable" or "unknown"; sets ``reachability``."""
        from diloco_swarm.averaging.averager import state_donors
        from diloco_swarm.averaging.reachability import check_reachability, transport_addrs
        from diloco_swarm.dht.swarm import peer_ids_of

        cfg = self.cfg
        if self.stop.requested:
            return "unknown"
        if self.client_mode:
            self.status.log("client mode (--client-mode): this node dials out only; it averages through public "
                            "peers but reduces no parts and donates no state")
            return "unknown"
        if cfg.public:
            self.status.log("--public: reachability not checked; other peers must be able to dial "
                            + (", ".join(cfg.announce) if cfg.announce else f"port {cfg.port or '(random)'}"))
            return "unknown"
        if not cfg.initial_peers:
            return "unknown"  # the first peer: whoever joins through it proves it reachable
        maddrs = transport_addrs(self.dht.get_visible_maddrs(latest=True))
        candidates = [p for p in state_donors(self.dht, self.spec.run_id) if p != self.peer_id]
        candidates += [p for p in peer_ids_of(cfg.initial_peers) if p not in candidates and p != self.peer_id]
        verdict = check_reachability(self.dht, self.spec.run_id, candidates, maddrs)
        self.metrics.write({"event": "reachability", "peer_id": self.peer_id, "reachable": verdict.reachable,
                            "responder": verdict.responder, "reason": verdict.reason, "maddrs": maddrs})
        if verdict.reachable is True:
            self.reachability = "public"
            self.status.log(f"reachable: peer {verdict.responder} dialed us back; serving as a full peer")
            return "reachable"
        if verdict.reachable is None:
            self.status.log(f"could not check reachability ({verdict.reason}); serving as a full peer. Behind a home "
                            "router without port forwarding? Restart with --client-mode")
            return "unknown"
        port = cfg.port or "PORT"
        self.status.log(
            f"unreachable: peer {verdict.responder} could not dial us back ({verdict.reason}); running as a client "
            f"(trains and averages, but reduces no parts and donates no state). To serve as a full peer, forward TCP "
            f"port {port} on your router and restart with --port {port} --announce /ip4/YOUR_PUBLIC_IP/tcp/{port} "
            "(docs/networking.md); or run as is"
        )
        return "unreachable"

    def _restore(self, ckpt: dict[str, Any]) -> None:
        try:
            self.outer.load_state_dict(ckpt["outer"])
            self.inner_opt.load_state_dict(ckpt["inner_optimizer"])
            self.outer_step = int(ckpt["outer_step"])
            self.inner_steps_total = int(ckpt["inner_steps_total"])
            self.tokens_total = int(ckpt["tokens_total"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {checkpoint_path(self.cfg.state_dir)} does not fit this model ({e}); "
                "move it away to start fresh"
            ) from None
        inner_state = [v for state in self.inner_opt.state.values() for v in state.values()
                       if torch.is_tensor(v) and v.is_floating_point()]
        if not all(torch.isfinite(t).all() for t in self.outer.theta + self.outer.momentum_buffers() + inner_state):
            raise CheckpointError(
                f"checkpoint {checkpoint_path(self.cfg.state_dir)} holds non-finite values; move it away to start "
                f"fresh, or restore {self.cfg.state_dir / 'checkpoint.prev.pt'}"
            )
        self.outer.copy_to(self.params)

    def _record_snapshot(self) -> dict[str, Any]:
        """This peer's public record (dht/records.py), read by `status` and the dashboard."""
        f = getattr(self, "_status_fields", {})
        last = self.last_round or {}
        if self.device.type == "cuda":
            device, precision = torch.cuda.get_device_name(self.device), "bf16-autocast"
        else:
            device, precision = str(self.device), "fp32"
        return {
            "peer_id": self.peer_id,
            "name": self.cfg.name,
            "version": __version__,
            "device": device,
            "precision": precision,
            "reachability": self.reachability,
            "outer_step": self.outer_step,
            "tokens_per_s": float(self.round_tokens_per_s or f.get("tokens_per_s", 0.0)),
            "loss": f.get("loss"),
            "eval_loss": self.last_eval_loss,
            "tokens_total": self.tokens_total,
            "bytes_sent": self.bytes_sent_total,
            "bytes_received": self.bytes_received_total,
            "last_round_group_size": int(last.get("group_size", 0)),
            "last_round_s": float(last.get("averaging_s", 0.0)),
            "last_round_ok": last.get("round_ok"),
            "failed_rounds": self.failed_rounds,
            "goodput": min(1.0, max(0.0, self.clock.goodput())),
            "uptime_s": time.monotonic() - self.clock.started,
            "maddrs": [] if self.client_mode else self.maddrs,  # a client cannot be dialed
        }

    # ------------------------------------------------------------------ state transfer
    def _state_for_donation(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(metadata, θ_global tensors + outer momentum tensors), a consistent snapshot."""
        with self._state_lock:
            theta = [t.clone() for t in self.outer.theta]
            momentum = self.outer.momentum_buffers()
            step = self.outer_step
        meta = {"outer_step": step, "spec_hash": self.spec.spec_hash(), "theta_digest": _theta_digest(theta),
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
        if _theta_digest(tensors[:n]) != meta.get("theta_digest"):
            return "θ_global does not match its digest"
        return None

    def _sync_state(self, *, min_step: int, reason: str, candidates: list[str] | None = None,
                    attempts: int = 1) -> bool:
        """Download θ_global, outer momentum and outer step from a live peer.

        Donors: ``candidates`` if given, else the most advanced peers that share state (a random
        one first, so no single donor is choked), then the others. Each payload is checked
        against the run spec before use; a failed or bad donor is skipped.
        :returns: True when a state was adopted.
        """
        max_bytes = 2 * sum(t.numel() for t in self.outer.theta) * 4 + (1 << 20)
        t0 = time.monotonic()
        for attempt in range(attempts):
            if self.stop.requested:
                return False
            if candidates is not None:
                order = [p for p in candidates if p != self.peer_id]
                random.shuffle(order)
            else:
                donors = {p: s for p, s in self.averager.donors().items() if s >= min_step}
                if not donors:
                    return False
                best = max(donors.values())
                top = [p for p, s in donors.items() if s == best]
                rest = sorted((p for p in donors if donors[p] != best), key=lambda p: -donors[p])
                random.shuffle(top)
                order = top + rest
            for peer in order[:MAX_DONOR_TRIES]:
                try:
                    meta, tensors, received = self.averager.download_state(
                        peer, timeout=STATE_CHUNK_TIMEOUT_S, max_bytes=max_bytes
                    )
                except Exception as e:
                    self.status.log(f"state download from {peer} failed: {e}")
                    continue
                problem = self._check_state(meta, tensors, min_step)
                if problem is not None:
                    if "older than" not in problem:
                        self.status.log(f"refused the state of {peer}: {problem}")
                    continue
                n = len(self.outer.theta)
                with self._state_lock:
                    before = self.outer_step
                    self.outer.load_theta_and_momentum(tensors[:n], tensors[n:])
                    self.outer.copy_to(self.params)
                    self.outer_step = meta["outer_step"]
                self._checkpoint()
                self.state_syncs += 1
                seconds = time.monotonic() - t0
                self.clock.sync_s += seconds
                self.metrics.write({"event": "state_sync", "peer_id": self.peer_id, "donor": peer,
                                    "reason": reason, "from_outer_step": before, "outer_step": self.outer_step,
                                    "bytes": received, "seconds": round(seconds, 3),
                                    "theta_digest": meta["theta_digest"]})
                self.status.log(f"state sync ({reason}): outer step {before} -> {self.outer_step} from {peer} "
                                f"({received / 1e6:.1f} MB in {seconds:.1f}s)")
                return True
            if attempt + 1 < attempts:
                time.sleep(0.5)
        return False

    def _wait_for_peers(self) -> None:
        """Optional start barrier (``--wait-for-peers N``): wait until N peers, us included, are up."""
        want = self.cfg.wait_for_peers
        if want <= 1:
            return
        deadline = time.monotonic() + self.cfg.wait_for_peers_timeout
        self.status.log(f"waiting for {want} peers (at most {self.cfg.wait_for_peers_timeout:.0f}s)")
        from diloco_swarm.dht.records import read_peer_records

        while not self.stop.requested:
            # clients are not state donors, but every peer publishes a record
            seen = max(1 + len(self.averager.donors()), len(read_peer_records(self.dht, self.spec.run_id)))
            if seen >= want:
                return
            if time.monotonic() > deadline:
                self.status.log(f"only {seen} of {want} peers showed up; starting anyway")
                return
            time.sleep(0.5)

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
            with contextlib.suppress(Exception):
                self.dht.run_coroutine(_rebootstrap(self.cfg.initial_peers))
            time.sleep(1.0)
            donors = self.averager.donors()
        if not donors:
            self.status.log(f"warning: this node sees no other peer of run '{self.spec.run_id}' yet; check "
                            "--run-id and --initial-peers. Training alone until peers appear; starting from "
                            + ("our checkpoint" if self.outer_step else "the initial weights"))
            return
        newest = int(max(donors.values()))
        if newest > self.outer_step and not self._sync_state(min_step=newest, reason="join", attempts=3):
            self.status.log(f"could not download the swarm's state (outer step {newest}); "
                            f"continuing from outer step {self.outer_step}")

    def _reconcile(self, gathered: dict[str, Any], mine: tuple[int, str]) -> None:
        """After a round: if the group's members started it from different θ_global, the
        members not holding the canonical one (among states a member can donate: newest outer
        step, then most members, then digest order) re-sync from one that does; and a peer more than one outer step behind
        the swarm's newest re-syncs too (lagging peer)."""
        entries: dict[str, tuple[int, str]] = {}
        for peer, meta in gathered.items():
            if isinstance(meta, dict) and isinstance(meta.get("outer_step"), int) and isinstance(
                meta.get("theta_digest"), str
            ):
                entries[peer] = (meta["outer_step"], meta["theta_digest"])
        entries[self.peer_id] = mine
        donors = self.averager.donors()
        if len(set(entries.values())) > 1:
            # Only a state some member can donate may win: a client that trained alone for a while
            # has the newest outer step, but nobody can download it (and it is one peer's history).
            donatable = {e for p, e in entries.items() if p in donors or (p == self.peer_id and not self.client_mode)}
            votes = Counter(e for e in entries.values() if e in donatable or not donatable)
            canonical = max(votes, key=lambda e: (e[0], votes[e], e[1]))
            if mine != canonical:
                holders = [p for p, e in entries.items() if e == canonical]
                self._sync_state(min_step=canonical[0] + 1, reason="diverged", candidates=holders, attempts=6)
                return
        if donors and max(donors.values()) > self.outer_step + 1:
            self._sync_state(min_step=int(max(donors.values())), reason="lagging")

    def _checkpoint(self) -> None:
        save_checkpoint(
            self.cfg.state_dir,
            {
                "spec": self.spec.model_dump(),
                "spec_hash": self.spec.spec_hash(),
                "peer_id": self.peer_id,
                "outer_step": self.outer_step,
                "inner_steps_total": self.inner_steps_total,
                "tokens_total": self.tokens_total,
                "outer": self.outer.state_dict(),
                "inner_optimizer": self.inner_opt.state_dict(),
            },
        )

    # ------------------------------------------------------------------ training
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _inner_steps(self) -> tuple[float | None, int]:
        """H inner steps; returns (mean training loss, tokens). Stops early when asked to."""
        spec, cfg = self.spec, self.cfg
        self.model.train()
        losses, tokens = [], 0
        t_last = time.monotonic()
        tokens_window = 0
        for i, (x, y) in enumerate(self.sampler.batches_for_outer_step(self.outer_step, spec.inner_steps)):
            if self.stop.requested:
                return None, tokens
            t0 = time.monotonic()
            # Warm up by the swarm's progress (outer step × H), not this peer's own count: a joiner
            # synced to step t must not take tiny steps, or its own Δ-based norm bounds (allreduce.py)
            # would reject every honest peer's part in its first round.
            lr_scale = min(1.0, (self.outer_step * spec.inner_steps + i + 1) / WARMUP_INNER_STEPS)
            for group in self.inner_opt.param_groups:
                group["lr"] = spec.inner_lr * lr_scale
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                _, loss = self.model(x, y)
            self.inner_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.inner_opt.step()
            self.inner_steps_total += 1
            losses.append(loss.item())
            tokens += x.numel()
            tokens_window += x.numel()
            self.clock.inner_s += time.monotonic() - t0
            now = time.monotonic()
            if now - t_last >= 1.0 or i + 1 == spec.inner_steps:
                self._status(inner_step=i + 1, loss=sum(losses[-20:]) / len(losses[-20:]),
                             tokens_per_s=tokens_window / max(now - t_last, 1e-9))
                t_last, tokens_window = now, 0
        return (sum(losses) / len(losses) if losses else None), tokens

    def _status(self, force: bool = False, **fields) -> None:
        self._status_fields = {**getattr(self, "_status_fields", {}), **fields}
        self.status.update(
            {
                **self._status_fields,
                "outer_step": self.outer_step,
                "inner_steps": self.spec.inner_steps,
                "peers_seen": getattr(self, "peers_seen", 1),
                "last_round": self.last_round,
                "failed_rounds": self.failed_rounds,
                "reachability": self.reachability,
                "goodput": self.clock.goodput(),
            },
            force=force,
        )

    def _dump_round(self, local, applied, tokens: int, result) -> None:
        """Test-only (hidden ``--debug-dump-rounds``): what we contributed and what we applied."""
        self.cfg.debug_dump_rounds.mkdir(parents=True, exist_ok=True)
        torch.save({"outer_step": self.outer_step, "peer_id": self.peer_id, "ok": result.ok, "weight": tokens,
                    "group": result.group_peer_ids, "group_id": result.group_id, "reason": result.reason,
                    "local": [d.detach().cpu().clone() for d in local], "applied": [a.detach().cpu().clone() for a in applied]},
                   self.cfg.debug_dump_rounds / f"{self.outer_step}-{self.peer_id}-{result.group_id[:12] or 'solo'}.pt")

    def _public_peer_online(self) -> bool:
        """Whether a group can form for us: always for a full peer; a client needs a public peer."""
        from diloco_swarm.dht.records import read_peer_records

        if not self.client_mode or self.averager.donors():
            return True
        records = read_peer_records(self.dht, self.spec.run_id)
        if any(p != self.peer_id and r.reachability != "client" for p, r in records.items()):
            return True
        now = time.monotonic()
        if self.cfg.initial_peers and now - self._last_rebootstrap > REBOOTSTRAP_EVERY_S:
            # the public peers may be back (restarted at the same address): dial them again
            self._last_rebootstrap = now
            with contextlib.suppress(Exception):
                self.dht.run_coroutine(_rebootstrap(self.cfg.initial_peers))
            return bool(self.averager.donors())
        return False

    def _average(self, delta: list[torch.Tensor], tokens: int, theta_digest: str):
        from diloco_swarm.averaging.averager import RoundResult

        if not self._public_peer_online():
            # Clients cannot form a group among themselves (nobody accepts connections): skip
            # matchmaking instead of waiting out the window. One warning per run.
            if not self._warned_no_public:
                self._warned_no_public = True
                self.status.log("warning: no public peer in the swarm, only clients (which cannot reach each "
                                "other); training solo until a public peer joins. A peer that can accept "
                                "connections (port forwarded, or a server) lets the swarm average again")
            return RoundResult(ok=False, group_size=1, reason="no public peer: every peer is a client"), [
                d.detach().to("cpu", torch.float32).clone() for d in delta]
        metadata = {"outer_step": self.outer_step, "tokens": tokens, "spec_hash": self.spec.spec_hash(),
                    "theta_digest": theta_digest}
        if self.cfg.fault == "huge":
            delta = [d * 1e6 for d in delta]
        return self.averager.average(
            delta,
            weight=max(tokens, 1),
            metadata=metadata,
            timeout=self.cfg.averaging_window,
            stop=self.stop.event,
        )

    def run(self) -> None:
        """Set up, train until ``max_outer_steps`` or a stop signal, then leave cleanly.

        :raises NodeError, CheckpointError, SwarmError, SpecMismatch, DatasetError: user-facing problems.
        """
        from diloco_swarm.dht.records import read_peer_records
        from diloco_swarm.dht.swarm import SwarmError, refresh_run_spec

        self.stop.install()
        self.clock.started = time.monotonic()
        try:
            try:
                self._setup()
            except SwarmError:
                if self.stop.requested:  # Ctrl+C while starting: leave quietly, nothing was trained
                    self.status.log("stopped during start-up")
                    return
                raise
            self.stop.training = True
            self._wait_for_peers()
            self._join_sync()
            initial_eval = evaluate(self.model, self.eval_set, self.device)
            self.metrics.write({"event": "eval", "peer_id": self.peer_id, "outer_step": self.outer_step,
                                "eval_loss": initial_eval})
            self.status.log(f"held-out loss at outer step {self.outer_step}: {initial_eval:.4f}")
            self.last_eval_loss = initial_eval
            if 0 < self.cfg.max_outer_steps <= self.outer_step:
                self.status.log(f"outer step {self.outer_step} has reached --max-outer-steps {self.cfg.max_outer_steps}; "
                                "nothing to train (the limit is the swarm's absolute outer step)")
            while not self.stop.requested and (
                self.cfg.max_outer_steps <= 0 or self.outer_step < self.cfg.max_outer_steps
            ):
                inner_before = self.clock.inner_s
                loss, tokens = self._inner_steps()
                round_inner_s = self.clock.inner_s - inner_before
                if round_inner_s > 0 and tokens:
                    self.round_tokens_per_s = tokens / round_inner_s
                if self.stop.requested:
                    self.clock.wasted_inner_s += round_inner_s
                    break  # abandon the partial inner steps; θ_global is in the last checkpoint
                delta = self.outer.pseudo_gradient(self.params)
                if not all(torch.isfinite(d).all() for d in delta):
                    raise Diverged(
                        f"training diverged at outer step {self.outer_step}: the pseudo-gradient has non-finite "
                        f"values; the last good checkpoint is kept. If it happens again after a restart, the run's "
                        f"--inner-lr is too high for this model: start a new run (another --run-id) with a lower one"
                    )
                t0 = time.monotonic()
                self.metrics.write({"event": "averaging_start", "peer_id": self.peer_id, "outer_step": self.outer_step})
                self._status(force=False, phase="averaging")
                mine = (self.outer_step, _theta_digest(self.outer.theta))
                result, avg = self._average(delta, tokens, mine[1])
                self.clock.averaging_s += time.monotonic() - t0
                if self.cfg.debug_dump_rounds is not None:
                    self._dump_round(delta, avg, tokens, result)
                if not result.ok and result.group_size >= 2:
                    self.failed_rounds += 1  # a group formed but the round was partial or unconfirmed
                elif result.group_size < 2:
                    self.solo_rounds += 1
                with self._state_lock:
                    self.outer.step(avg)
                    self.outer.copy_to(self.params)
                    self.outer_step += 1
                round_step, round_digest = self.outer_step, _theta_digest(self.outer.theta)
                self.tokens_total += tokens
                self._checkpoint()
                if not self.client_mode:
                    self.averager.state_sharing_priority = float(self.outer_step)
                if result.gathered and not self.stop.requested:
                    syncs_before = self.state_syncs
                    self._reconcile(result.gathered, mine)
                    if self.state_syncs != syncs_before:
                        self.clock.wasted_inner_s += round_inner_s  # our Δ was replaced by the swarm's state
                eval_loss = self.last_eval_loss = evaluate(self.model, self.eval_set, self.device)
                self.bytes_sent_total += result.bytes_sent
                self.bytes_received_total += result.bytes_received
                self.last_round = {
                    "group_size": result.group_size,
                    "bytes_sent": result.bytes_sent,
                    "averaging_s": result.seconds,
                    "round_ok": result.ok,
                    "reason": result.reason,
                }
                record = {
                    "event": "outer_step",
                    "outer_step": round_step,
                    "synced_to": self.outer_step if self.outer_step != round_step else None,
                    "peer_id": self.peer_id,
                    "group_size": result.group_size,
                    "group": result.group_peer_ids,
                    "loss": loss,
                    "eval_loss": eval_loss,
                    "tokens": tokens,
                    "tokens_total": self.tokens_total,
                    "bytes_sent": result.bytes_sent,
                    "bytes_received": result.bytes_received,
                    "averaging_s": round(result.seconds, 4),
                    "compression": self.spec.compression,
                    "round_ok": result.ok,
                    "reason": result.reason,
                    "rejected_peers": result.rejected_peers,
                    "digest_confirmed_by": result.agreed_peers,
                    "failed_rounds": self.failed_rounds,
                    "solo_rounds": self.solo_rounds,
                    "reachability": self.reachability,
                    "state_syncs": self.state_syncs,
                    "theta_digest": round_digest,
                    "inner_s": round(self.clock.inner_s, 3),
                    "wasted_inner_s": round(self.clock.wasted_inner_s, 3),
                    "averaging_total_s": round(self.clock.averaging_s, 3),
                    "sync_s": round(self.clock.sync_s, 3),
                    "wall_s": round(time.monotonic() - self.clock.started, 3),
                    "goodput": round(self.clock.goodput(), 4),
                }
                self.metrics.write(record)
                self.records.publish_now()
                with contextlib.suppress(Exception):
                    refresh_run_spec(self.dht, self.spec)
                    records = read_peer_records(self.dht, self.spec.run_id)
                    self.peers_seen = max(1, len(records))
                    self._remember_peers(records)
                self._status(force=True)
                if result.rejected_peers:
                    for peer, why in result.rejected_peers.items():
                        self.status.log(f"outer step {self.outer_step}: peer {peer} was refused: {why}")
            self.metrics.write({"event": "stop", "peer_id": self.peer_id, "outer_step": self.outer_step,
                                "graceful": True, "goodput": round(self.clock.goodput(), 4)})
            if self.averager is not None and not self.client_mode:
                with contextlib.suppress(Exception):
                    self.averager.allow_state_sharing = False  # publishes "no longer a donor"
            if self.records is not None:
                self.records.stop(remove=True)  # goodbye: our record disappears at once
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self.status.close()
        if self.records is not None:
            self.records.stop(remove=False)
        for part in (self.averager, self.dht):
            if part is not None and part.is_alive():  # a SIGTERM to our process group may have ended it
                with contextlib.suppress(Exception):
                    part.shutdown()
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()


class _rebootstrap:
    """DHT coroutine (runs in the DHT process): ping the initial peers again to refill the routing table."""

    def __init__(self, initial_peers: list[str]):
        self.initial_peers = list(initial_peers)

    async def __call__(self, _dht, node) -> None:
        import asyncio

        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        for addr in self.initial_peers:
            try:
                maddr = Multiaddr(addr)
                peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
                await asyncio.wait_for(node.p2p._client.connect(peer_id, [maddr.decapsulate(f"/p2p/{peer_id}")]), 5)
                await asyncio.wait_for(node.protocol.call_ping(peer_id), 5)
            except Exception:
                continue  # that peer is still away; try the others


def _theta_digest(theta: list[torch.Tensor]) -> str:
    from diloco_swarm.averaging.averager import tensors_digest

    return tensors_digest(theta)
