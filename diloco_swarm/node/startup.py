"""Start-up and leave of a node: local checks, the model and θ_global, the DHT (or rejoining through
the peers it saw), the reachability check, the averager and the peer record; at the end, the last
round, the checkpoint write and the goodbye.

A mixin of :class:`diloco_swarm.node.runner.Node`. Everything local that can fail is checked
before the network is touched.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from diloco_swarm import __version__
from diloco_swarm.averaging import averager as averager_module
from diloco_swarm.averaging.confirm import DIGEST_WAIT_S
from diloco_swarm.averaging.sparse import SPARSE_MODES
from diloco_swarm.dht.calls import ChildUnavailable
from diloco_swarm.dht.publisher import PeerRecordPublisher
from diloco_swarm.dht.records import live_records, owner_digest, read_peer_entries
from diloco_swarm.dht.signing import record_validators, signature_validator
from diloco_swarm.dht.swarm import (BootstrapFailed, InitialPeersAreUs, StateDirLock, SwarmError, ensure_run_spec,
                                    peer_ids_of, start_dht, visible_maddrs)
from diloco_swarm.invites import ORGANISER_KEY_FILE
from diloco_swarm.models import num_parameters
from diloco_swarm.node.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, remove_stale_temp_files
from diloco_swarm.node.config import IDENTITY_FILE
from diloco_swarm.node.dylu import PhasePlanner
from diloco_swarm.node.invitation import save_private_files
from diloco_swarm.node.errors import NodeError
from diloco_swarm.node.feedback import ErrorFeedback
from diloco_swarm.node.global_state import GlobalState, theta_digest
from diloco_swarm.node.assets import build_run_assets
from diloco_swarm.node.inner import build_inner_optimizer
from diloco_swarm.node.known_peers import known_peers_path, load_known_peers, previous_port, remember_peers, save_port
from diloco_swarm.node.mixing import ThetaMixer
from diloco_swarm.node.outer import OuterOptimizer
from diloco_swarm.node.outer_sync import OuterSync
from diloco_swarm.node import round_policy as policy
from diloco_swarm.node.reachability import ReachabilityAtStart, is_loopback
from diloco_swarm.node.redial import gone_peers
from diloco_swarm.node.round import Round, RoundParts
from diloco_swarm.node.statesync import StateSync
from diloco_swarm.spec import differences_text

ROUND_MARGIN_S = 30.0  # past the round's own time bounds, a phase gives the round up
WAIT_READ_EVERY_S = 1.0  # the start barrier reads the records (and pings the peers) this often


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), i.e. the interpreter and the imports
    before the node's own start-up; None where /proc is not there."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return None


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


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The inner steps' precision: bf16 autocast on CUDA, fp32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def device_and_precision(device: torch.device) -> tuple[str, str]:
    """What our record says we train on: the device's name, and its :func:`autocast` precision."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device), "bf16-autocast"
    return str(device), "fp32"


def _organiser_mismatch(state_dir: Path, run_id: object, theirs: object, ours: str | None) -> str:
    """The line for a checkpoint of a public run started as a private one, or the reverse, or of another
    organiser's run (``theirs``, ``ours``: the specs' organiser keys)."""
    if theirs is None:
        return (f"state dir {state_dir} holds a checkpoint of the public run '{run_id}': a private run needs a "
                "state dir of its own; give another --state-dir")
    if ours is None:
        return (f"state dir {state_dir} holds a checkpoint of the private run '{run_id}': join it with --invite "
                "(its organiser: with the state dir that holds organiser.key), or give another --state-dir")
    return (f"state dir {state_dir} holds a checkpoint of run '{run_id}' of another organiser than this "
            "invitation's; give another --state-dir")


class Startup:
    """Set-up of a :class:`~diloco_swarm.node.runner.Node` (``_setup``) and its helpers."""

    def _start(self) -> bool:
        """Set-up, the optional start barrier, join sync and the first evaluation.
        :returns: False when a stop came during start-up (nothing was trained)."""
        try:
            self._setup()
        except (SwarmError, ChildUnavailable):
            if self.stop.requested:  # Ctrl+C while starting: leave quietly, nothing was trained
                self.status.log("stopped during start-up")
                return False
            raise
        if self.stop.requested:  # a stop during the (long) set-up: nothing trained, nothing to save
            self.status.log("stopped during start-up")
            return False
        self.supervisor.start(self.dht, self.averager, self._redial_known)
        self.stop.training = True
        self._wait_for_peers()
        self.state_sync.join()
        if self.stop.requested:
            return True  # the loop does not start; the leave writes the stop event
        self._evaluate_now()
        if self._reached_max_outer_steps():
            self.status.log(f"outer step {self.outer_step} has reached --max-outer-steps {self.cfg.max_outer_steps}; "
                            "nothing to train (the limit is the swarm's absolute outer step)")
        return True

    def _leave(self) -> None:
        """Graceful leave: apply a round that has ended, drop one still running, finish the checkpoint
        write, say goodbye."""
        if self.supervisor.lost is None and self.sync is not None and self.sync.done():
            with contextlib.suppress(Exception):  # as during training; the stop line did not call it dropped
                self._apply_round()
        pending_inner_s = self.sync.pending_inner_s() + (self._carried.inner_s if self._carried else 0.0)
        self.sync.abandon(timeout=5.0)
        self.stats.wasted_inner_s += pending_inner_s
        self.housekeeping.close()
        self.checkpoints.close(wait=True)  # the queued checkpoint write still runs
        if self.stop.checkpoint_problem:
            self.status.log(f"warning: {self.stop.checkpoint_problem}")
        self.metrics.write({"event": "stop", "peer_id": self.peer_id, "outer_step": self.outer_step,
                            "graceful": self.supervisor.lost is None, "reason": self.supervisor.lost,
                            "goodput": round(self.stats.goodput(), 4)})
        if self.averager is not None and not self.client_mode and self.supervisor.lost is None:
            with contextlib.suppress(Exception):
                self.averager.allow_state_sharing = False  # publishes "no longer a donor"
        if self.records is not None:
            self.records.stop(remove=self.supervisor.lost is None)  # goodbye: our record disappears at once
        if self.supervisor.lost is None:
            kept = "" if self.stop.checkpoint_problem or not self.stop.has_checkpoint else "; its checkpoint is kept"
            self.status.log(f"stopped at outer step {self.outer_step}{kept}")

    def _shutdown(self) -> None:
        """Close every part, whatever state the node is in (after a leave, or an error)."""
        self.supervisor.close()  # the parts now end on purpose
        self.status.close()
        if self.sync is not None:
            self.sync.abandon(timeout=0.0)  # after an error: the averaging thread must not outlive us
        self.housekeeping.close()
        self.checkpoints.close()
        if self.records is not None:
            self.records.stop(remove=False)
        for part in (self.averager, self.dht):
            if part is not None and part.is_alive():  # a SIGTERM to our process group may have ended it
                with contextlib.suppress(Exception):
                    part.shutdown()
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()

    def _setup(self) -> None:
        cfg, spec = self.cfg, self.spec
        phases = {"imports": process_age_s()}  # seconds per start-up phase, in the start record
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name] = round(now - mark, 3)
            mark = now

        self.device = pick_device(cfg.device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.lock = StateDirLock(cfg.state_dir)
        remove_stale_temp_files(cfg.state_dir)  # left by a write that a second Ctrl+C or a crash cut short

        # Everything local that can fail is checked before we touch the network.
        self.assets = build_run_assets(spec, dataset=cfg.dataset, tokenizer_arg=cfg.tokenizer,
                                       max_bytes=cfg.max_dataset_bytes, log=self.status.log)
        spec = self.spec = self.assets.spec
        checkpoint = load_checkpoint(checkpoint_path(cfg.state_dir))
        if checkpoint is not None and checkpoint.get("spec") != spec.model_dump():
            theirs = checkpoint.get("spec") or {}
            if theirs.get("organiser") != spec.organiser:  # public vs private, or another organiser's run
                raise NodeError(_organiser_mismatch(cfg.state_dir, theirs.get("run_id"), theirs.get("organiser"),
                                                    spec.organiser))
            ours = spec.model_dump()
            diffs = differences_text({k: (v, theirs.get(k)) for k, v in ours.items() if v != theirs.get(k)}, "checkpoint")
            raise NodeError(
                f"state dir {cfg.state_dir} holds a checkpoint of a different run spec ({diffs}); "
                "use another --state-dir, or the flags of that run"
            )

        save_private_files(cfg.private_files)  # our invitation, the organiser's run: now that the state dir is ours
        # the checkpoint is read again once the child processes run: a mapping of the file made now would be
        # inherited by them for their lifetime, keeping the file's blocks on disk after it is replaced
        resuming, checkpoint = checkpoint is not None, None
        model_shape = self.assets.model  # on the meta device: shapes only, no memory
        self.assets.save_for_export(cfg.state_dir)
        phase("assets")
        if spec.seq_len > model_shape.config.block_size:
            raise NodeError(
                f"--seq-len {spec.seq_len} exceeds the '{spec.model}' model's context of {model_shape.config.block_size}"
            )
        self.phases = PhasePlanner(spec.inner_steps)  # DyLU: inner steps per phase

        validators = record_validators(spec.run_id, cfg.state_dir)
        self.our_pass.owner = owner_digest(signature_validator(validators).local_public_key)
        # --port 0: our last run's port when it is free, so the addresses other peers keep for us stay valid
        dht_args = dict(host=cfg.host, port=cfg.port or previous_port(cfg.state_dir, cfg.host), announce=cfg.announce,
                        identity_path=cfg.state_dir / IDENTITY_FILE, record_validators=validators)
        self.dht = self._start_dht_or_rejoin(dht_args)
        cfg = self.cfg  # its initial peers may now be the known peers we rejoined through
        self.peer_id = self.dht.peer_id.to_base58()
        phase("dht")
        run_found = ensure_run_spec(self.dht, spec, joining=bool(cfg.initial_peers))
        phase("run_spec")
        check = ReachabilityAtStart(cfg=cfg, dht=self.dht, spec=spec, peer_id=self.peer_id, stop=self.stop,
                                    log=self.status.log, metrics=self.metrics)
        # (the averager class is looked up at call time: tests/faults.py may put a faulty one there)
        reachable = check.detect(client_mode=self.client_mode, averager_type=averager_module.PseudoGradientAverager,
                                 admission=self.our_pass.shown(self.peer_id), not_in_run=check.not_in_run(run_found))
        if reachable == "reachable":
            self.reachability = "public"
        phase("reachability")
        if reachable == "unreachable":
            # Behind NAT: a full peer would break every group it joins. Restart the DHT as a client.
            self.dht.shutdown()
            self.client_mode, self.reachability = True, "client"
            self.dht = start_dht(initial_peers=cfg.initial_peers, client_mode=True, retry_busy_port_s=15.0, **dht_args)
        self.sampler = self.assets.sampler(cfg.batch_size, spec.seq_len, seed=spec.seed, stream_id=self.peer_id)
        eval_set = self.assets.held_out_batches(cfg.batch_size, spec.seq_len, cfg.eval_batches)
        # forked before any model-sized buffer exists (the DHT above too): a child shares none of the
        # model's pages, which training would otherwise copy into the child's memory one by one.
        # The class is looked up at call time: tests/faults.py may put a faulty one there
        self.averager = averager_module.PseudoGradientAverager(
            [torch.zeros(p.shape, dtype=torch.float32) for p in model_shape.parameters()],
            self.dht,
            prefix=spec.run_id,
            compression=spec.compression,
            target_group_size=cfg.group_size,
            max_group_size=cfg.max_group_size,
            matchmaking_time=cfg.matchmaking_time,
            allreduce_timeout=cfg.allreduce_timeout,
            max_norm_ratio=cfg.max_norm_ratio,
            client_mode=self.client_mode,
            state_provider=self._state_for_donation,
            organiser=spec.organiser,
            max_upload_mbps=cfg.max_upload_mbps,
            max_download_mbps=cfg.max_download_mbps,
        )
        # a round ends by itself within: a wait for the swarm to reach our step and the averaging window
        # (each at most --averaging-window: Round._wait_for_swarm, then matchmaking), the all-reduce (as long
        # as a group with a capped member may take: averaging/bandwidth.py), the digest confirmation
        self.round_deadline_s = (2 * cfg.averaging_window + self.averager.allreduce_ceiling_s + DIGEST_WAIT_S
                                 + ROUND_MARGIN_S)
        phase("averager")
        checkpoint = load_checkpoint(checkpoint_path(cfg.state_dir)) if resuming else None
        self._build_training_state(checkpoint)
        self.evaluate.start(self.model, eval_set, self.device)
        if not self.client_mode:
            self.averager.state_sharing_priority = self._donor_priority()
        phase("training_state")
        addrs = self.maddrs = visible_maddrs(self.dht)
        save_port(cfg.state_dir, addrs)  # (a client has none: nobody dials it)
        self.records = PeerRecordPublisher(self.dht, spec.run_id, validators, self._record_snapshot, interval_s=5.0,
                                           updated_path=cfg.state_dir / "record.updated", organiser=spec.organiser)
        self.records.start()
        self.swarm.me = self.peer_id
        self.housekeeping.start(spec, self.dht, self.records, self._remember_peers, me=self.peer_id)
        self.state_sync = StateSync(
            self.state, sync=self.sync, params=self.params, averager=self.averager, dht=self.dht, spec=spec, cfg=cfg,
            peer_id=self.peer_id, client_mode=self.client_mode, stats=self.stats, metrics=self.metrics,
            records=self.records, swarm=self.swarm, checkpoints=self.checkpoints, evaluate_now=self._evaluate_now,
            stop=self.stop, log=self.status.log, feedback=self.feedback)
        self.mixer = ThetaMixer(self.state, averager=self.averager, peer_id=self.peer_id, stats=self.stats,
                                supported_step=lambda: self.state_sync.evidence().supported_step, log=self.status.log)
        self.round = Round(RoundParts(
            cfg=cfg, run_id=spec.run_id, organiser=spec.organiser, peer_id=self.peer_id, averager=self.averager, dht=self.dht,
            records=self.records, stats=self.stats, log=self.status.log, housekeeping=self.housekeeping, swarm=self.swarm, history=self.history,
            history_floor=self._history_floor, stop=self.stop.event, overlap=self.sync.overlap,
            client_mode=self.client_mode, metadata=self._round_metadata, catch_up=self.state_sync.catch_up,
            reconcile=self.state_sync.reconcile, mix=self.mixer.mix, feedback=self.feedback))
        phase("record")
        if self.stop.requested:  # a stop came while we started: no banner, no start record (Node._start says so)
            return
        self.status.log(
            f"peer {self.peer_id} | run '{spec.run_id}' | model {spec.model} "
            f"({num_parameters(self.model) / 1e6:.2f}M params) on {self.device} | data {self.assets.description}"
        )
        if resuming:  # said once the DHT took our identity (a copied state dir fails before)
            self.status.log(f"resumed from {checkpoint_path(cfg.state_dir)} at outer step {self.outer_step}")
        if self.client_mode:  # nobody can dial a client: its addresses are useless to joiners
            self.status.log("others cannot join through this node (it is a client); give them the address of a "
                            "public peer, e.g. the one in your --initial-peers")
        else:
            peers = " ".join(f"--initial-peers {a}" for a in addrs) or "--initial-peers <this node's multiaddr>"
            # a node listening on loopback only (--host 127.0.0.1, the demo) is reachable from this machine alone
            where = "this machine" if addrs and all(is_loopback(a) for a in addrs) else "another machine"
            invite = "--invite INVITATION_FILE " if spec.organiser else ""
            self.status.log("to join from {}: diloco-node join --run-id {} {}{}{}".format(  # one flag per address: pastes as is
                where, spec.run_id, invite, "".join(f"{f} " for f in cfg.join_flags), peers))
        if spec.organiser and (cfg.state_dir / ORGANISER_KEY_FILE).exists():
            self.status.log(f"private run: only invited peers take part; make one invitation per volunteer with "
                            f"`diloco-node invite --state-dir {cfg.state_dir} > INVITATION_FILE`")
        self.metrics.write(
            {
                "event": "start",
                "peer_id": self.peer_id,
                "version": __version__,
                "spec_hash": spec.spec_hash(),
                "maddrs": addrs,
                "device": str(self.device),
                "outer_step": self.outer_step,
                "startup_s": phases,
            }
        )

    def _build_training_state(self, checkpoint: dict[str, Any] | None) -> None:
        """The model's weights on its device, θ_global and the outer optimizer, the inner optimizer,
        and the checkpoint restored into them (memory budget: docs/architecture.md)."""
        spec, cfg = self.spec, self.cfg
        self.model = self.assets.build_model().to(self.device)
        self.params = list(self.model.parameters())
        outer = OuterOptimizer(self.params, lr=spec.outer_lr, momentum=spec.outer_momentum)
        if cfg.target_group_size:  # a grid run: θ_0, before any checkpoint, is every member's last-resort mixing reference
            self.history.anchor_on((0, theta_digest(outer.theta)), outer.theta)
        self.state = GlobalState(outer, lock=self._state_lock, history=self.history, marks=self.stats.theta_marks,
                                 averager=self.averager, log=self.status.log)
        self.sync = OuterSync(outer, self.params, lambda handoff, control: self.round.run(handoff, control),
                              overlap=spec.sync_mode == "overlap", stop=self.stop.event)
        self.inner_opt = build_inner_optimizer(cfg.inner_optimizer, self.params, lr=spec.inner_lr)
        sparse = SPARSE_MODES.get(spec.compression)  # the error feedback of a sparse mode (node/feedback.py)
        self.feedback = ErrorFeedback([t.shape for t in outer.theta], sparse[0]) if sparse else None
        if checkpoint is not None:
            self._restore(checkpoint)
            self.checkpoints.on_disk = self.outer_step
            self.stop.has_checkpoint = True
            self.state.mark()  # the state we hold: with another holder's record, evidence for a joiner

    def _start_dht_or_rejoin(self, dht_args: dict[str, Any]):
        """Start the DHT through ``--initial-peers``; without them, through the peers this node saw
        before (``state_dir/peers.json``, node/known_peers.py), so a restarted first node rejoins its
        swarm instead of starting a second one. If none of those answers, start a new swarm. If no
        ``--initial-peers`` answer, try the known peers before giving up.

        :raises SwarmError: as :func:`~diloco_swarm.dht.swarm.start_dht`; BootstrapFailed when neither
            the ``--initial-peers`` nor the known peers answered.
        """
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
                if not known or self.stop.requested or isinstance(err, InitialPeersAreUs):
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
            self._redial_known = known  # they may be restarting too: keep dialing them (node/redial.py)
            return start_dht(initial_peers=[], client_mode=self.client_mode, retry_busy_port_s=15.0, **dht_args)
        self.status.log(f"rejoined the swarm through {them}")
        self.cfg = replace(cfg, initial_peers=known)
        return dht

    def _remember_peers(self, records: dict[str, Any]) -> None:
        """Save the addresses of the full peers in ``records`` for a later restart (node/known_peers.py)."""
        seen = {p: r.maddrs for p, r in records.items() if r.reachability != "client" and r.maddrs}
        if seen:
            remember_peers(self.cfg.state_dir, self.spec.run_id, seen, me=self.peer_id)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        try:
            self.state.outer.load_state_dict(ckpt["outer"])  # (format 1's inner optimizer state is not used)
            self.state.step = int(ckpt["outer_step"])
            self.state.restarted_below = int(ckpt.get("restarted_below", 0))  # (absent before protocol 6)
            self.stats.inner_steps_total = int(ckpt["inner_steps_total"])
            self.stats.tokens_total = int(ckpt["tokens_total"])
            self.stats.load_ledger(ckpt.get("ledger"))  # (absent before the ledger: counts start at 0)
            self.stats.load_eval_curve(ckpt.get("eval_curve"))
            if self.feedback is not None and "feedback" in ckpt:  # (a checkpoint of a dense mode has none: e = 0)
                self.feedback.load(ckpt["feedback"])
            counters = {"outer_step": self.outer_step, "restarted_below": self.state.restarted_below,
                        "inner_steps_total": self.stats.inner_steps_total, "tokens_total": self.stats.tokens_total}
            negative = [f"{name} = {value}" for name, value in counters.items() if value < 0]
            if negative:
                raise ValueError(f"a negative counter: {', '.join(negative)}")
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {checkpoint_path(self.cfg.state_dir)} does not fit this model ({e}); "
                "move it away to start fresh"
            ) from None
        if not all(torch.isfinite(t).all() for t in self.state.theta + self.state.outer.momentum_buffers()):
            raise CheckpointError(
                f"checkpoint {checkpoint_path(self.cfg.state_dir)} holds non-finite values; move it away to start "
                "fresh (a peer of the run then serves its state)"
            )
        self.state.outer.copy_to(self.params)

    def _wait_for_peers(self) -> None:
        """Optional start barrier (``--wait-for-peers N``): wait, at most ``wait_for_peers_timeout``
        seconds, until N peers, us included, are live (:meth:`_live_peers`) and not paused. A line each
        time the count changes."""
        want = self.cfg.wait_for_peers
        if want <= 1:
            return
        deadline = time.monotonic() + self.cfg.wait_for_peers_timeout
        self.status.log(f"waiting for {want} peers (at most {self.cfg.wait_for_peers_timeout:.0f}s)")
        said, live = None, 1
        while not self.stop.requested:
            entries = read_peer_entries(self.dht, self.spec.run_id, organiser=self.spec.organiser)
            if entries is not None:  # (None: the DHT did not answer this read; the count stands)
                records = live_records(entries)
                training = policy.training(records)  # a paused peer would not train with us: not counted
                counted = self._live_peers(training)
                live, uncounted = 1 + len(counted), len(set(training) - counted - {self.peer_id})
                paused = len(set(records) - set(training) - {self.peer_id})
                self.stats.peers_seen = live  # the status line's count is this one from its first line on
                if (live, uncounted, paused) != said:
                    said = (live, uncounted, paused)
                    dead = (f"; not counted: {uncounted} whose record is silent or whose process is gone"
                            if uncounted else "") + (f"; {paused} paused" if paused else "")
                    self.status.log(f"{live} of {want} peers live (us included){dead}")
                if live >= want:
                    return
            if time.monotonic() > deadline:
                self.status.log(f"only {live} of {want} peers showed up; starting anyway")
                return
            self.stop.event.wait(WAIT_READ_EVERY_S)

    def _live_peers(self, records: dict[str, Any]) -> set[str]:
        """The other peers of ``records`` (peer id -> record, one read) that are live: their record
        changed within :data:`~diloco_swarm.node.round_policy.SILENT_RECORDS` re-signing periods as we
        read it (``SwarmView``), and, unless they are clients (they serve no DHT calls), a ping now did
        not fail (``redial.gone_peers``; a probe that could not run finds nobody gone). A SIGKILLed
        peer's record stays fresh in the DHT for up to 3 re-signing periods, but its ping fails; a ping
        that only hangs is no death (a slow peer on a loaded machine): a peer whose process is stuck for
        good falls silent instead."""
        self.swarm.note(records)
        fresh = self.swarm.live(records, policy.SILENT_RECORDS * self.records.interval_s) - {self.peer_id}
        askable = [p for p in fresh if records[p].reachability != "client"]
        return fresh - gone_peers(self.dht, askable, stop=self.stop.event, banned_is_gone=False)
