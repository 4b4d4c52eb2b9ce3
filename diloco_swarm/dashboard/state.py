"""What the dashboard knows about a swarm: peers with a state, swarm totals and a bounded history.

Fed with :func:`diloco_swarm.dht.records.read_peer_entries` polls; owns no I/O besides the JSON
history file. All times are unix wall-clock seconds of *this* machine, so other peers' clocks never
decide whether a peer is online.

Peer states (one row per record owner, i.e. per RSA key, so a peer cannot hide another by
claiming its peer id):

- ``online``: the peer refreshed its record (a later DHT expiration) within ``stale_after_s``;
- ``stale``: silent for longer, up to ``gone_after_s`` (greyed; it may be stuck, or have crashed);
- ``gone``: it said goodbye (a tombstone), or was silent for longer than ``gone_after_s``.
  Gone peers stay listed for ``keep_gone_s``, then are dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from diloco_swarm.dht.ledger import latest_by_peer, leaderboard
from diloco_swarm.dht.lineages import lineage_summary_of_rows
from diloco_swarm.dht.records import FIELDS, PeerEntry, PeerRecord

logger = logging.getLogger(__name__)

HISTORY_FILE = "dashboard-history.json"
HISTORY_VERSION = 1
API_SCHEMA = 1
MAX_SAMPLES = 2000  # per series
MAX_PEERS = 256  # rows kept (and per-peer series); the least recently heard go first
STATES = ("online", "stale", "gone")
MAX_AVOIDED_SHOWN = 32  # peers in totals.avoided (the most reported first): records are untrusted input
MAX_REASONS = 3  # distinct reasons kept per avoided peer

# swarm sample: [t, peers_online, tokens_per_s, mean_loss, newest_outer_step]
# peer sample:  [t, loss, tokens_per_s, outer_step]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


@dataclass
class PeerView:
    owner: str
    record: dict[str, Any] | None  # the last valid record (None only before the first one)
    first_seen: float
    last_heard: float  # when the record was last refreshed (its DHT expiration moved forward)
    last_expiration: float = 0.0
    left: bool = False  # said goodbye
    history: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def state(self, now: float, stale_after_s: float, gone_after_s: float) -> str:
        if self.left or now - self.last_heard > gone_after_s:
            return "gone"
        return "online" if now - self.last_heard <= stale_after_s else "stale"


class SwarmState:
    """Thread-safe; :meth:`update` from the poller, :meth:`snapshot` from the web handlers."""

    def __init__(
        self,
        run_id: str,
        *,
        stale_after_s: float = 20.0,
        gone_after_s: float = 60.0,
        keep_gone_s: float = 900.0,
        sample_s: float = 10.0,
        max_samples: int = MAX_SAMPLES,
        path: Path | None = None,
    ):
        self.run_id = run_id
        self.stale_after_s = stale_after_s
        self.gone_after_s = max(gone_after_s, stale_after_s)
        self.keep_gone_s = keep_gone_s
        self.sample_s = sample_s
        self.max_samples = max_samples
        self.path = path
        self.peers: dict[str, PeerView] = {}
        self.swarm: deque = deque(maxlen=max_samples)
        self.last_poll: float | None = None
        self.last_poll_ok: bool | None = None
        self.polls = 0
        self.refused: list[str] = []  # the last poll's records of a private run's uninvited peers: why each
        self._last_swarm_sample = 0.0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ feeding
    def update(self, entries: Iterable[PeerEntry] | None, now: float | None = None) -> None:
        """One poll's result; ``None`` = the DHT could not be read (states keep ageing)."""
        now = time.time() if now is None else now
        with self._lock:
            self.last_poll, self.polls = now, self.polls + 1
            self.last_poll_ok = entries is not None
            entries = None if entries is None else list(entries)
            if entries is not None:
                self.refused = [e.refused for e in entries if e.refused]
            for entry in entries or ():
                self._see(entry, now)
            self._expire(now)
            self._sample(now)

    def _see(self, entry: PeerEntry, now: float) -> None:
        view = self.peers.get(entry.owner)
        if entry.record is None:  # a goodbye tombstone
            if view is not None and entry.expiration > view.last_expiration and not view.left:
                view.left, view.last_expiration = True, entry.expiration
            return
        record = entry.record.dict()
        if view is None:
            self.peers[entry.owner] = PeerView(entry.owner, record, first_seen=now, last_heard=now,
                                               last_expiration=entry.expiration)
            return
        if entry.expiration > view.last_expiration:  # re-published since the last poll
            view.last_expiration, view.last_heard, view.left = entry.expiration, now, False
            view.record = record

    def _expire(self, now: float) -> None:
        for owner, view in list(self.peers.items()):
            if view.state(now, self.stale_after_s, self.gone_after_s) == "gone":
                if now - max(view.last_heard, view.last_expiration if view.left else 0.0) > self.keep_gone_s:
                    del self.peers[owner]
        if len(self.peers) > MAX_PEERS:
            for owner in sorted(self.peers, key=lambda o: self.peers[o].last_heard)[: len(self.peers) - MAX_PEERS]:
                del self.peers[owner]

    def _sample(self, now: float) -> None:
        """Every ``sample_s``: one point for the swarm, and one for each online peer."""
        if now - self._last_swarm_sample < self.sample_s:
            return
        t = self.totals(now)
        ts = round(now, 3)
        self.swarm.append([ts, t["peers_online"], t["tokens_per_s"], t["mean_loss"], t["newest_outer_step"]])
        self._last_swarm_sample = now
        for view in self.peers.values():
            if view.record is not None and view.state(now, self.stale_after_s, self.gone_after_s) == "online":
                r = view.record
                view.history.append([ts, r.get("loss"), r.get("tokens_per_s"), r.get("outer_step")])

    # ------------------------------------------------------------------ reading
    def peer_rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """Peers as dicts: the record's fields plus owner, state, age_s, first_seen, last_heard."""
        now = time.time() if now is None else now
        order = {s: i for i, s in enumerate(STATES)}
        with self._lock:
            rows = []
            for view in self.peers.values():
                state = view.state(now, self.stale_after_s, self.gone_after_s)
                rows.append({
                    **{k: (view.record or {}).get(k) for k in FIELDS},
                    "owner": view.owner,
                    "state": state,
                    "age_s": round(max(0.0, now - view.last_heard), 1),
                    "first_seen": round(view.first_seen, 3),
                    "last_heard": round(view.last_heard, 3),
                    "left": view.left,
                })
        rows.sort(key=lambda r: (order[r["state"]], -(r["outer_step"] or 0), str(r["name"] or ""), str(r["peer_id"])))
        return rows

    def totals(self, now: float | None = None) -> dict[str, Any]:
        return {**summarize(self.peer_rows(now)), "refused": len(self.refused)}

    def snapshot(self, now: float | None = None, history: bool = True) -> dict[str, Any]:
        """The ``/api/v1/state`` document (see docs/dashboard.md)."""
        now = time.time() if now is None else now
        with self._lock:
            peers = self.peer_rows(now)
            doc: dict[str, Any] = {
                "schema": API_SCHEMA,
                "run_id": self.run_id,
                "generated": round(now, 3),
                "last_poll": self.last_poll,
                "last_poll_ok": self.last_poll_ok,
                "config": {
                    "stale_after_s": self.stale_after_s,
                    "gone_after_s": self.gone_after_s,
                    "keep_gone_s": self.keep_gone_s,
                    "sample_s": self.sample_s,
                    "max_samples": self.max_samples,
                },
                "totals": {**summarize(peers), "refused": len(self.refused)},
                "peers": peers,
                "leaderboard": leaderboard(peers),  # every peer still listed, gone ones too: their work counts
            }
            if history:
                doc["history"] = {
                    "swarm": _columns(self.swarm, ("t", "peers_online", "tokens_per_s", "mean_loss", "outer_step")),
                    "peers": {
                        owner: _columns(v.history, ("t", "loss", "tokens_per_s", "outer_step"))
                        for owner, v in self.peers.items()
                    },
                }
        return doc

    def peer_doc(self, peer_id: str, now: float | None = None) -> dict[str, Any] | None:
        """The ``/api/v1/peer/{peer_id}`` document (docs/dashboard.md), or None when no listed record
        claims ``peer_id``: its record (the most recently updated of those that claim it), its ledger
        row, the peers whose records back its rounds, its θ marks with the peers that hold the same,
        its history, and which of its figures are its own word."""
        now = time.time() if now is None else now
        with self._lock:
            rows = self.peer_rows(now)
            mine = [r for r in latest_by_peer(rows) if r.get("peer_id") == peer_id]
            if not mine:
                return None
            row = mine[0]
            view = self.peers.get(row["owner"])
            history = _columns(view.history if view else (), ("t", "loss", "tokens_per_s", "outer_step"))
        others = [r for r in latest_by_peer(rows) if r.get("peer_id") != peer_id]
        witnesses = [{"peer_id": r["peer_id"], "name": r.get("name") or "", "rounds": e["rounds"], "tokens": e["tokens"]}
                     for r in others for e in r.get("rounds_with") or () if e.get("peer_id") == peer_id]
        held = {}  # (step, digest) -> the other peers whose marks hold it
        for r in others:
            for m in r.get("theta_marks") or ():
                held.setdefault((m["step"], m["digest"]), []).append(r["peer_id"])
        marks = [{**m, "held_by": held.get((m["step"], m["digest"]), [])} for m in row.get("theta_marks") or ()]
        ledger = next((e for e in leaderboard(rows) if e["peer_id"] == peer_id), None)  # (None: beyond its rows)
        return {"schema": API_SCHEMA, "run_id": self.run_id, "generated": round(now, 3), "peer": row,
                "ledger": ledger, "witnessed_by": sorted(witnesses, key=lambda w: -w["rounds"]),
                "rounds_with": row.get("rounds_with") or [], "theta_marks": marks, "history": history,
                # everything a record says is its peer's own word; the ledger's confirmed figures are others'
                "self_reported": sorted(set(FIELDS) - {"peer_id"})}

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Write the history atomically (temp file, fsync, rename); errors are logged."""
        if self.path is None:
            return
        with self._lock:
            doc = {
                "version": HISTORY_VERSION,
                "run_id": self.run_id,
                "saved": time.time(),
                "swarm": list(self.swarm),
                "peers": {
                    owner: {
                        "record": v.record,
                        "first_seen": v.first_seen,
                        "last_heard": v.last_heard,
                        "last_expiration": v.last_expiration,
                        "left": v.left,
                        "history": list(v.history),
                    }
                    for owner, v in self.peers.items()
                },
            }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, allow_nan=False, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except (OSError, ValueError) as e:
            logger.warning(f"could not save the dashboard history to {self.path}: {e}")

    def load(self) -> bool:
        """Restore a saved history; a missing, foreign or corrupt file is ignored (with a warning).

        :returns: whether anything was restored.
        """
        if self.path is None or not self.path.exists():
            return False
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            if doc.get("version") != HISTORY_VERSION:
                raise ValueError(f"unknown version {doc.get('version')!r}")
            if doc.get("run_id") != self.run_id:
                logger.warning(f"{self.path} holds the history of run {doc.get('run_id')!r}, not {self.run_id!r}; "
                               "starting a new history")
                return False
            swarm = [_sample(s, 5) for s in doc.get("swarm", [])][-self.max_samples:]
            peers: dict[str, PeerView] = {}
            for owner, p in list(doc.get("peers", {}).items())[:MAX_PEERS]:
                record = PeerRecord.parse_obj(p["record"]).dict()
                view = PeerView(str(owner)[:64], record, first_seen=float(p["first_seen"]),
                                last_heard=float(p["last_heard"]), last_expiration=float(p["last_expiration"]),
                                left=bool(p["left"]))
                view.history.extend(_sample(s, 4) for s in p.get("history", [])[-MAX_SAMPLES:])
                peers[view.owner] = view
        except Exception as e:
            logger.warning(f"ignoring the unreadable dashboard history {self.path}: {e}")
            return False
        with self._lock:
            self.swarm.extend(swarm)
            self.peers.update(peers)
            self._last_swarm_sample = swarm[-1][0] if swarm else 0.0
        return True


def _sample(raw: Any, n: int) -> list:
    if not isinstance(raw, list) or len(raw) != n or _num(raw[0]) is None:
        raise ValueError(f"bad history sample {str(raw)[:80]}")
    return [raw[0]] + [_num(x) for x in raw[1:]]


def _columns(samples: Iterable[list], names: tuple[str, ...]) -> dict[str, list]:
    cols: dict[str, list] = {n: [] for n in names}
    for s in samples:
        for n, v in zip(names, s):
            cols[n].append(v)
    return cols


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Swarm totals over peer rows (dicts with a ``state`` and the record fields).

    Rates, losses and θ_global lineages count online peers only; the newest outer step counts
    online and stale ones; tokens trained count every listed peer. ``lineages`` and ``split`` are
    :func:`diloco_swarm.dht.lineages.lineage_summary`'s, which ``lineage`` holds whole.
    """
    online = [r for r in rows if r["state"] == "online"]
    live = [r for r in rows if r["state"] in ("online", "stale")]
    losses = [r["loss"] for r in online if _num(r.get("loss")) is not None]
    evals = [r["eval_loss"] for r in online if _num(r.get("eval_loss")) is not None]
    # the outer steps those were measured at (records of older versions carry none)
    eval_steps = [r["eval_outer_step"] for r in online if _num(r.get("eval_loss")) is not None
                  and isinstance(r.get("eval_outer_step"), int)]
    steps = [r["outer_step"] for r in live if _num(r.get("outer_step")) is not None]
    lineage = lineage_summary_of_rows(rows)
    return {
        "peers_online": len(online),
        "peers_stale": sum(r["state"] == "stale" for r in rows),
        "peers_gone": sum(r["state"] == "gone" for r in rows),
        "tokens_per_s": round(sum(r.get("tokens_per_s") or 0.0 for r in online), 3),
        "tokens_total": int(sum(r.get("tokens_total") or 0 for r in rows)),
        "newest_outer_step": max(steps) if steps else None,
        "mean_loss": round(sum(losses) / len(losses), 6) if losses else None,
        "mean_eval_loss": round(sum(evals) / len(evals), 6) if evals else None,
        "eval_outer_steps": [min(eval_steps), max(eval_steps)] if eval_steps else None,
        "failed_rounds": int(sum(r.get("failed_rounds") or 0 for r in live)),
        "direct_peers": sum(r.get("reachability") in ("public", "unverified") for r in online),
        "lineages": lineage["lineages"],
        "split": lineage["split"],
        "lineage": lineage,
        "avoided": avoided_summary(rows),
    }


def avoided_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The peers that online peers say they keep out of their groups (each record's ``avoided_peers``:
    banned, or avoided a while, e.g. for outlier Δs; averaging/conduct.py), the most reported first.

    Each: ``peer_id``; ``name`` (its own record's, None when it publishes none); ``by``: the online
    peers that report it (``{"peer_id", "name"}``); ``of``: the online peers besides it that could
    (every record, old ones without the field too); ``why``: up to :data:`MAX_REASONS` distinct
    reasons given. A peer's word about another, not proof: a dishonest peer can name anyone, so
    who says it is part of the answer. At most :data:`MAX_AVOIDED_SHOWN` peers.
    """
    online = {r["peer_id"]: r for r in rows if r["state"] == "online" and isinstance(r.get("peer_id"), str)}
    names = {r["peer_id"]: r.get("name") or None for r in rows if isinstance(r.get("peer_id"), str)}
    reports: dict[str, dict[str, Any]] = {}
    for reporter, row in online.items():
        for item in row.get("avoided_peers") or ():
            peer = item.get("peer_id") if isinstance(item, dict) else None
            if not isinstance(peer, str) or peer == reporter:
                continue
            entry = reports.setdefault(peer, {"peer_id": peer, "name": names.get(peer), "by": {}, "why": []})
            entry["by"][reporter] = {"peer_id": reporter, "name": names.get(reporter)}
            why = str(item.get("why") or "")
            if why and why not in entry["why"] and len(entry["why"]) < MAX_REASONS:
                entry["why"].append(why)
    out = [{**e, "by": list(e["by"].values()), "of": len(online) - (e["peer_id"] in online)} for e in reports.values()]
    out.sort(key=lambda e: (-len(e["by"]), e["peer_id"]))
    return out[:MAX_AVOIDED_SHOWN]
