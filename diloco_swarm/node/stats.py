"""The counters of one node: the single source of its metrics records, status line and peer record.

Every figure a node reports (docs/metrics.md, the status line, the signed peer record of
docs/dashboard.md) is a field here or derived from one, so the three views never disagree.
"""

from __future__ import annotations

import time
import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_swarm.averaging.grouping import gathered_weight
from diloco_swarm.averaging.robust import capped_weights
from diloco_swarm.dht.lineages import MAX_THETA_MARKS
from diloco_swarm.dht.ledger import keep_records
from diloco_swarm.dht.records import MAX_PARTNERS

MAX_EVAL_POINTS = 512  # of the held-out loss curve kept in the checkpoint (its first and newest always among them)


def counted_tokens(group: list[str], gathered: dict[str, Any]) -> dict[str, int]:
    """Peer id -> the tokens a verified round counted for it: the ``weight`` it gathered (untrusted; 0 where not
    a positive finite number), capped as the reducers cap it (``robust.capped_weights``: at most ``WEIGHT_CAP`` ×
    the median of the group's positive weights), so a claim of more buys no more of the ledger than of the average."""
    claimed = []
    for peer in group:
        weight = gathered_weight(gathered.get(peer))
        claimed.append(weight if weight is not None and weight > 0 else 0.0)
    positive = [w for w in claimed if w > 0]
    cap = float(capped_weights(torch.tensor(positive, dtype=torch.float64)).max()) if positive else 0.0
    return {peer: int(min(w, cap)) for peer, w in zip(group, claimed)}


@dataclass
class NodeStats:
    """Wall seconds by activity (goodput), round counters, bytes and the newest measurements.

    Seconds are wall seconds (``time.monotonic``); tokens are the model's tokens.
    """

    started: float = field(default_factory=time.monotonic)
    inner_s: float = 0.0  # all inner steps
    wasted_inner_s: float = 0.0  # inner steps whose Δ was thrown away (never averaged and not carried, stop)
    averaging_s: float = 0.0  # the training thread waiting for a round (blocking mode: the whole round)
    sync_s: float = 0.0  # waiting for peers and downloading state
    ahead_wait_s: float = 0.0  # grid rounds waiting, before they plan, for the swarm to reach our outer step
    eval_s: float = 0.0  # held-out evaluation on the training thread
    failed_rounds: int = 0  # a group formed, but its round was partial or unconfirmed (no average applied)
    solo_rounds: int = 0  # no group formed
    late_rounds: int = 0  # no verified group while others were online: θ_global kept, Δ carried into the next round
    state_syncs: int = 0
    mixed_rounds: int = 0  # rounds whose members held different θ_global and mixed them (node/mixing.py)
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens_total: int = 0
    inner_steps_total: int = 0
    eval_loss: float | None = None  # held-out loss of θ_global, taken at eval_outer_step
    eval_outer_step: int = 0
    tokens_per_s: float | None = None  # tokens / inner seconds of the last phase
    inner_step_s: float | None = None  # seconds per inner step in the last phase (DyLU)
    phase_eta: float = 0.0  # unix time at which the current phase should end (0 = not training yet)
    averaging_round: int | None = None  # the grid round we look for a group in (grouping.round_number)
    paused: Any = None  # node.pause.Paused while the node trains no more (its record's `paused`), else None
    paused_s: float = 0.0  # wall seconds spent in pauses that ended: not counted against goodput
    paused_since: float | None = None  # time.monotonic() at which the pause going on began (None: none)
    peers_seen: int = 1  # live peers, us included, as the start barrier counts them (the status line's `peers N`)
    last_round: dict[str, Any] | None = None
    avoided_peers: dict[str, str] = field(default_factory=dict)  # peer id -> why our averager shuns it (conduct.py)
    live: dict[str, Any] = field(default_factory=dict)  # the running phase: inner_step, phase_steps, loss, tokens_per_s
    # (outer step, θ digest) our own rounds produced, newest last: the swarm's lineages (dht/lineages.py)
    theta_marks: deque = field(default_factory=lambda: deque(maxlen=MAX_THETA_MARKS))
    # the contribution ledger (dht/ledger.py), kept in the checkpoint: our verified rounds, and per partner
    # of our most recent verified rounds [rounds shared, the tokens it weighed in them], oldest first
    verified_rounds: int = 0
    verified_tokens: int = 0  # our own weight (tokens) in those rounds
    rounds_with: OrderedDict = field(default_factory=OrderedDict)
    leaderboard: list = field(default_factory=list)  # our last view of the run's ledger (housekeeping.py)
    ledger_records: dict = field(default_factory=dict)  # the last record of every peer seen (dht/ledger.keep_records)
    # [outer step, held-out loss of θ_global there] as measured, oldest first, thinned to MAX_EVAL_POINTS:
    # kept in the checkpoint for export's model card (a node need not write a metrics file)
    eval_curve: list = field(default_factory=list)

    def wall_s(self) -> float:
        return time.monotonic() - self.started

    def goodput(self) -> float:
        """Share of wall time spent in inner steps whose Δ was applied (time paused on purpose left out)."""
        since = self.paused_since  # (read once: the training thread ends a pause while the publisher reads)
        total = self.wall_s() - self.paused_s - (time.monotonic() - since if since is not None else 0.0)
        return min(1.0, max(0.0, (self.inner_s - self.wasted_inner_s) / total)) if total > 0 else 0.0

    def count_round(self, result, mixing=None, me: str = "") -> None:
        """Account one applied round (``averaging.results.RoundResult``) and its θ-mixing round, if any;
        ``me``: our peer id (a verified round's other members go into ``rounds_with``)."""
        if result.ok:
            self.count_partners(result.group_peer_ids, result.gathered, me)
        if not result.ok and result.group_size >= 2:
            self.failed_rounds += 1
        elif result.group_size < 2:
            self.solo_rounds += 1
        for part in (result, mixing) if mixing is not None else (result,):
            self.bytes_sent += part.bytes_sent
            self.bytes_received += part.bytes_received
        self.last_round = {"group_size": result.group_size, "bytes_sent": result.bytes_sent,
                           "averaging_s": result.seconds, "round_ok": result.ok, "reason": result.reason}
        if result.avoided_peers is not None:  # (a new dict: the publisher thread may be reading the old one)
            self.avoided_peers = dict(result.avoided_peers)

    def count_partners(self, group: list[str], gathered: dict[str, Any], me: str) -> None:
        """One verified round with ``group`` (peer ids, us included); ``gathered``: peer id -> the metadata
        it gathered to the group, whose ``weight`` is the tokens behind its Δ, capped as the group's reducers
        cap it: at most ``robust.WEIGHT_CAP`` × the group's median (:func:`counted_tokens`)."""
        self.verified_rounds += 1
        counted = counted_tokens(group, gathered)
        partners = OrderedDict(self.rounds_with)  # a new dict: the publisher thread may be reading the old one
        others = [p for p in group if p != me]
        # a group larger than a record lists: a stable choice of our own, so each peer goes on being witnessed
        # by most others (hivemind shuffles the group's order: the oldest-out rule would drop anyone's history)
        listed = set(sorted(others, key=lambda p: hashlib.sha256(f"{me} {p}".encode()).digest())[:MAX_PARTNERS])
        for peer in group:
            tokens = counted[peer]
            if peer == me:
                self.verified_tokens += tokens
                continue
            if peer not in listed:
                continue
            rounds, total = partners.pop(peer, (0, 0))
            partners[peer] = (rounds + 1, total + tokens)  # newest last
        while len(partners) > MAX_PARTNERS:
            partners.popitem(last=False)
        self.rounds_with = partners

    def note_eval(self, outer_step: int, loss: float) -> None:
        """A held-out loss of θ_global at ``outer_step`` (node/evaluation.py): into :attr:`eval_curve`."""
        self.eval_loss, self.eval_outer_step = loss, outer_step
        if not math.isfinite(loss):
            return
        curve = [p for p in self.eval_curve if p[0] != outer_step] + [[int(outer_step), float(loss)]]
        if len(curve) > MAX_EVAL_POINTS:  # every other point, the first and the newest kept
            curve = curve[:-1:2] + curve[-1:]
        self.eval_curve = curve

    def load_eval_curve(self, curve: Any) -> None:
        """Restore :attr:`eval_curve` from a checkpoint (absent or malformed: empty)."""
        ok = isinstance(curve, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], float) for p in curve)
        self.eval_curve = list(curve)[-MAX_EVAL_POINTS:] if ok else []

    def ledger_state(self) -> dict[str, Any]:
        """The checkpoint's ``ledger``: plain lists, dicts and numbers (``torch.load(weights_only=True)``)."""
        return {"verified_rounds": self.verified_rounds, "verified_tokens": self.verified_tokens,
                "rounds_with": [[p, int(r), int(t)] for p, (r, t) in self.rounds_with.items()],
                "leaderboard": [dict(row) for row in self.leaderboard], "records": dict(self.ledger_records)}

    def load_ledger(self, state: Any) -> None:
        """Restore :meth:`ledger_state`. Absent (older checkpoints) or malformed parts are left at their
        start values: the ledger is a report, never a reason to refuse a resume."""
        if not isinstance(state, dict):
            return
        for name in ("verified_rounds", "verified_tokens"):
            count = state.get(name)
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                setattr(self, name, count)
        partners = OrderedDict()
        for item in state.get("rounds_with") if isinstance(state.get("rounds_with"), list) else []:
            if (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str)
                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in item[1:])):
                partners[item[0]] = (item[1], item[2])
        self.rounds_with = partners
        board = state.get("leaderboard")
        self.leaderboard = [row for row in board if isinstance(row, dict)] if isinstance(board, list) else []
        kept = state.get("records")
        self.ledger_records = keep_records({}, [r for r in kept.values() if isinstance(r, dict)]) if isinstance(kept, dict) else {}

    def totals(self) -> dict[str, Any]:
        """The cumulative fields of every ``outer_step`` metrics record."""
        return {
            "tokens_total": self.tokens_total,
            "verified_rounds": self.verified_rounds,
            "failed_rounds": self.failed_rounds,
            "solo_rounds": self.solo_rounds,
            "late_rounds": self.late_rounds,
            "state_syncs": self.state_syncs,
            "mixed_rounds": self.mixed_rounds,
            "inner_s": round(self.inner_s, 3),
            "wasted_inner_s": round(self.wasted_inner_s, 3),
            "averaging_total_s": round(self.averaging_s, 3),
            "sync_s": round(self.sync_s, 3),
            "ahead_wait_s": round(self.ahead_wait_s, 3),
            "eval_s": round(self.eval_s, 3),
            "wall_s": round(self.wall_s(), 3),
            "goodput": round(self.goodput(), 4),
        }

    def status(self, *, outer_step: int, inner_steps: int, reachability: str) -> dict[str, Any]:
        """The fields of :class:`~diloco_swarm.node.report.StatusLine`."""
        return {**self.live, "outer_step": outer_step, "inner_steps": inner_steps, "peers_seen": self.peers_seen,
                "last_round": self.last_round, "failed_rounds": self.failed_rounds, "reachability": reachability,
                "goodput": self.goodput(), "paused": None if (paused := self.paused) is None else paused.describe()}

    def peer_record(self) -> dict[str, Any]:
        """This node's measured fields of its signed peer record (dht/records.py)."""
        last = self.last_round or {}
        paused = self.paused  # read once: the training thread ends a pause while the publisher thread reads this
        return {
            "tokens_per_s": 0.0 if paused is not None else float(self.tokens_per_s or self.live.get("tokens_per_s", 0.0)),
            "loss": self.live.get("loss"),
            "eval_loss": self.eval_loss,
            "eval_outer_step": self.eval_outer_step if self.eval_loss is not None else None,
            "tokens_total": self.tokens_total,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_round_group_size": int(last.get("group_size", 0)),
            "last_round_s": float(last.get("averaging_s", 0.0)),
            "last_round_ok": last.get("round_ok"),
            "failed_rounds": self.failed_rounds,
            "goodput": self.goodput(),
            "uptime_s": self.wall_s(),
            "inner_step_s": float(self.inner_step_s or 0.0),
            "phase_eta": float(self.phase_eta),
            "averaging_round": self.averaging_round,
            "theta_marks": self.theta_marks.copy(),  # copy(): the publisher reads it on its own thread
            "avoided_peers": self.avoided_peers,
            "verified_rounds": self.verified_rounds,
            "verified_tokens": self.verified_tokens,
            "rounds_with": self.rounds_with,  # replaced, never changed in place: safe to read from the publisher
            "paused": paused.why if paused is not None else None,
        }
