"""This peer's signed record, kept fresh in the DHT, and the check that no other node publishes it.

The record (records.py) is re-signed and stored every ``interval_s`` (5 s) by a thread of its own,
and expires ``3 * interval_s`` after it was stored; a peer that leaves overwrites it with a
tombstone (``None``), which readers skip, so it disappears at once. Before the first store, the
publisher checks that no other node publishes records of our peer id (a copied state dir:
:func:`identity_in_use`) and refuses to start if one does. Times are the node's own clock
(utils/clock.py), which a step of the machine's clock does not move; the publisher's thread says in
one line when the machine's clock has stepped away from it (:class:`~diloco_swarm.utils.clock.ClockWatch`).

    publisher = PeerRecordPublisher(dht, run_id, record_validators(run_id, state_dir), snapshot)
    publisher.start(); ...; publisher.publish_now(); ...; publisher.stop()
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Callable

from diloco_swarm.dht.calls import ChildGone, dht_store
from diloco_swarm.dht.errors import SwarmError
from diloco_swarm.dht.records import normalize_snapshot, owner_fingerprint, read_peer_entries, records_key
from diloco_swarm.dht.signing import signature_validator
from diloco_swarm.utils import clock

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 10.0  # one DHT store of our record


class IdentityInUse(SwarmError):
    """Another running node publishes records of our peer id (same identity key: a copied state dir)."""


def identity_in_use(dht, run_id: str, peer_id: str, *, wait_s: float, ours_until: float | None = None,
                    organiser: str | None = None) -> bool:
    """Whether another node publishes live records of ``peer_id`` now. Call it before publishing our own.

    A live record of our peer id alone proves nothing (ours, from a node that crashed less than
    ``3 * interval_s`` ago); one whose ``updated`` advances, or a new one, within ``wait_s`` does:
    somebody else is re-signing it. Records no newer than ``ours_until`` (the last ``updated`` this
    state dir's previous process published: :func:`last_published`) are that process's own: then no
    wait at all (a restart right after a crash). Reads the DHT once or twice (bounded calls); any read
    error counts as "no". In a private run (``organiser``) only records whose pass is bound to their
    owner count: a stranger's record that claims our peer id does not keep us from restarting.
    """

    def ours() -> dict[str, float] | None:
        entries = read_peer_entries(dht, run_id, organiser=organiser)
        if entries is None:
            return None
        return {e.owner: e.record.updated for e in entries if e.record is not None and e.record.peer_id == peer_id}

    first = ours()
    if not first or (ours_until is not None and max(first.values()) <= ours_until):
        return False
    time.sleep(wait_s)
    second = ours() or {}
    return any(updated > first.get(owner, -1.0) for owner, updated in second.items())


def last_published(path: Path | None, run_id: str) -> float | None:
    """The ``updated`` of the newest record a publisher with ``updated_path=path`` stored for
    ``run_id`` (unix s), or None (no such file, another run's, or unreadable)."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        updated = doc["updated"] if doc.get("run_id") == run_id else None
        return float(updated) if isinstance(updated, (int, float)) and math.isfinite(updated) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


class PeerRecordPublisher:
    """Keeps this peer's signed record fresh in the DHT.

    :param validators: the list from ``signing.record_validators`` the DHT was started with (its
        RSASignatureValidator's public key is our subkey).
    :param snapshot: returns the record fields (see :class:`PeerRecord`); called from the
        publisher thread, so it must be cheap and thread-safe (reading plain attributes is fine).
        Values are coerced and clamped by :func:`normalize_snapshot`; ``updated`` is always set
        to the time of publication.
    :param organiser: ``RunSpec.organiser`` of a private run (:func:`identity_in_use`).
    """

    def __init__(self, dht, run_id: str, validators: list, snapshot: Callable[[], dict], interval_s: float = 5.0,
                 updated_path: Path | None = None, organiser: str | None = None):
        self.organiser = organiser
        self.updated_path = updated_path  # where each record's `updated` is noted before it is stored
        self.dht = dht
        self.run_id = run_id
        self.key = records_key(run_id)
        self.subkey = signature_validator(validators).local_public_key
        self.snapshot = snapshot
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_expiration = 0.0
        self._last_problem = ""  # logged once until a store succeeds again (not a line every 5 s)
        self._clock = clock.ClockWatch()
        self._outer_step = 0  # of the last record stored (for the clock's line)
        self.published = 0  # successful stores (for tests and logs)

    @property
    def owner(self) -> str:
        return owner_fingerprint(self.subkey)

    def start(self, check_identity: bool = True) -> None:
        """Start publishing every ``interval_s``.

        :param check_identity: first make sure no other node publishes records of our peer id
            (:func:`identity_in_use`); costs ``interval_s + 2`` s only when a live record of our
            peer id is found (a restart right after a crash).
        :raises IdentityInUse: another node with this peer id is online (a copied state dir).
        """
        if self._thread is not None:
            return
        if check_identity:
            peer_id = str(self.snapshot().get("peer_id", ""))
            if peer_id and identity_in_use(self.dht, self.run_id, peer_id, wait_s=self.interval_s + 2.0,
                                           ours_until=last_published(self.updated_path, self.run_id),
                                           organiser=self.organiser):
                raise IdentityInUse(
                    f"another node with this node's identity (peer id {peer_id}) is online in run '{self.run_id}': it "
                    "keeps publishing this peer's record, and this node has not. Was this state dir copied? Give each "
                    "node its own --state-dir (in a copy, delete identity.key and record.key for a new identity)")
        self._thread = threading.Thread(target=self._loop, name="peer-record-publisher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self.publish_now()
            line = self._clock.check(f"at outer step {self._outer_step}")
            if line is not None:
                logger.warning(line)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def publish_now(self) -> bool:
        """Store a fresh record now; errors are logged, never raised. :returns: whether the DHT took it."""
        try:
            with self._lock:
                if self._stopped.is_set():
                    return False
                value = normalize_snapshot({**self.snapshot(), "updated": clock.now()})
                self._outer_step = value["outer_step"]
                self._note_updated(value["updated"])
                ok = self._store(value, clock.now() + 3 * self.interval_s)
                if ok:
                    self._last_problem = ""
                return ok
        except Exception as e:
            problem = str(e) or type(e).__name__
            if self._stopped.is_set() or not self.dht.is_alive():
                # stopped mid-store (a leave: expected), or the node's watchdog reports a dead DHT process
                logger.debug(f"could not publish this peer's record: {problem}")
            elif problem != self._last_problem:
                self._last_problem = problem
                logger.warning(f"could not publish this peer's record: {problem}")
            return False

    def _note_updated(self, updated: float) -> None:
        """Note ``updated`` before the store (a crash between the two leaves the note ahead, never behind):
        a restart of this state dir then knows its own records (:func:`identity_in_use`)."""
        if self.updated_path is None:
            return
        try:
            tmp = self.updated_path.with_name(self.updated_path.name + ".tmp")
            tmp.write_text(json.dumps({"run_id": self.run_id, "updated": updated}), encoding="utf-8")
            os.replace(tmp, self.updated_path)
        except OSError as e:  # the restart then waits interval_s + 2 s to tell its own records apart
            logger.debug(f"could not note the record's time in {self.updated_path}: {e}")

    def _store(self, value: dict | None, expiration: float) -> bool:
        # The DHT keeps the entry with the latest expiration: never go backwards.
        expiration = max(expiration, self._last_expiration + 1e-3)
        # bounded: if the DHT process died (SIGTERM to the process group, OOM), a plain store() waits forever
        ok = dht_store(self.dht, self.key, value, expiration_time=expiration, subkey=self.subkey,
                       timeout=STORE_TIMEOUT_S, stop=self._stopped if value is not None else None)
        if ok:
            self._last_expiration = expiration
            self.published += 1
        else:
            logger.debug(f"the DHT refused our record under {self.key}")
        return ok

    def stop(self, remove: bool = True) -> None:
        """Stop publishing; with ``remove``, replace our record by a tombstone so readers drop us at once."""
        self._stopped.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self.interval_s))
        if remove and not self.dht.is_alive():
            # a signal to our process group ended the DHT too: nobody to tell; the record expires by itself
            logger.debug("the DHT process is gone; our record expires by itself")
            remove = False
        if remove:
            try:
                if not self._lock.acquire(timeout=STORE_TIMEOUT_S + 1):
                    raise TimeoutError("the publisher is stuck in a DHT call")
                try:
                    self._store(None, clock.now() + 3 * self.interval_s)
                finally:
                    self._lock.release()
            except ChildGone:  # the signal to our process group reached the DHT while we stored
                logger.debug("the DHT process ended during the goodbye; our record expires by itself")
            except Exception as e:
                logger.warning(f"could not remove this peer's record: {e}")
