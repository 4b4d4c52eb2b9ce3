"""Signed, schema-checked per-peer records in the DHT (what ``status`` and the dashboard read).

One DHT key per run, ``{run_id}_peers``, holds a dictionary: one subkey per peer. The subkey is
the peer's RSA public key in hivemind's ``[owner:ssh-rsa ...]`` form, so hivemind's
:class:`~hivemind.dht.crypto.RSASignatureValidator` only accepts a value under that subkey when it is
signed by the matching private key: a peer can write its own record and nobody else's. Every
value must also match :class:`PeerRecord` (hivemind's :class:`~hivemind.dht.schema.SchemaValidator`,
strict types, bounded strings and numbers), on every DHT node that stores or returns it, so a
malformed or oversized record never reaches a reader. This is the pattern of hivemind's
collaborative-training examples (``{run_id}_metrics`` with ``LocalMetrics``).

A record expires ``3 * interval_s`` after it was stored; a peer that leaves overwrites its record
with a tombstone (``None``), which readers skip, so it disappears at once.

    validators = record_validators(run_id, state_dir)           # pass to hivemind.DHT(record_validators=...)
    publisher = PeerRecordPublisher(dht, run_id, validators, snapshot)
    publisher.start(); ...; publisher.publish_now(); ...; publisher.stop()
    read_peer_records(dht, run_id)                              # {peer_id: PeerRecord}
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Literal, Optional

import pydantic.v1 as pv1

# hivemind is imported inside the functions that need a DHT: the schema, the bounds and the
# parsing below are shared with the light client (diloco_swarm/light), which runs without hivemind.
if TYPE_CHECKING:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import RecordValidatorBase
    from hivemind.utils.crypto import RSAPrivateKey

from diloco_swarm.dht.lineages import DIGEST_PATTERN, MAX_THETA_MARKS, marks_of
from diloco_swarm.dht.calls import ChildGone, dht_get, dht_store
from diloco_swarm.dht.errors import SwarmError

logger = logging.getLogger(__name__)

RECORDS_FIELD = "peers"  # the DHT key is f"{run_id}_{RECORDS_FIELD}"
KEY_FILE = "record.key"
STORE_TIMEOUT_S = 10.0  # one DHT store of our record
MAX_RECORDS = 1024  # a reader looks at most at this many subkeys

# Bounds: generous for honest peers, small enough that a hostile record cannot hurt a reader.
MAX_NAME = 64
MAX_PEER_ID = 128
MAX_SHORT = 64
MAX_COUNT = 10**18  # fits msgpack's uint64
MAX_RATE = 1e12
MAX_LOSS = 1e6
MAX_SECONDS = 1e10
MAX_GROUP = 10**6
MAX_TIME = 1e11  # unix time, year ~5138
MAX_MADDRS = 8
MAX_MADDR = 256


# An owner subkey holds the owner's public key as ``[owner:<ssh-rsa key>]``: the same pattern as
# hivemind's RSASignatureValidator.PUBLIC_KEY_REGEX (tests/test_light.py checks they agree).
OWNER_KEY_REGEX = re.escape(b"[owner:_key_]").replace(b"_key_", rb"(.+?)")


def records_key(run_id: str) -> str:
    return f"{run_id}_{RECORDS_FIELD}"


class ThetaMark(pv1.BaseModel):
    """The digest of the θ_global this peer held at the end of outer step ``step`` (dht/lineages.py)."""

    step: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    digest: pv1.constr(strict=True, regex=DIGEST_PATTERN)

    class Config:
        extra = pv1.Extra.forbid


class OwnerSubkey(pv1.ConstrainedBytes):
    """Bytes holding ``[owner:<public key>]``; the same check as hivemind's ``schema.BytesWithPublicKey``."""

    _regex = re.compile(b".*" + OWNER_KEY_REGEX + b".*")

    @classmethod
    def __get_validators__(cls):
        yield from super().__get_validators__()
        yield cls._match

    @classmethod
    def _match(cls, value: bytes) -> bytes:
        if cls._regex.match(value) is None:
            raise ValueError("the subkey holds no [owner:...] public key")
        return value


class PeerRecord(pv1.BaseModel):
    """What one peer says about itself. Strict types: hivemind's SchemaValidator allows no conversion."""

    peer_id: pv1.constr(strict=True, min_length=1, max_length=MAX_PEER_ID, regex=r"^[A-Za-z0-9]+$")
    name: pv1.constr(strict=True, max_length=MAX_NAME)
    version: pv1.constr(strict=True, max_length=MAX_SHORT)
    device: pv1.constr(strict=True, max_length=MAX_SHORT)
    precision: pv1.constr(strict=True, max_length=MAX_SHORT)
    reachability: Literal["public", "unverified", "client"]  # see averaging/reachability.py
    outer_step: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    tokens_per_s: pv1.confloat(strict=True, ge=0.0, le=MAX_RATE)
    loss: Optional[pv1.confloat(strict=True, ge=0.0, le=MAX_LOSS)]
    eval_loss: Optional[pv1.confloat(strict=True, ge=0.0, le=MAX_LOSS)]
    tokens_total: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    bytes_sent: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    bytes_received: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    last_round_group_size: pv1.conint(strict=True, ge=0, le=MAX_GROUP)
    last_round_s: pv1.confloat(strict=True, ge=0.0, le=MAX_SECONDS)
    last_round_ok: Optional[pv1.StrictBool]
    failed_rounds: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    goodput: pv1.confloat(strict=True, ge=0.0, le=1.0)
    uptime_s: pv1.confloat(strict=True, ge=0.0, le=MAX_SECONDS)
    updated: pv1.confloat(strict=True, ge=0.0, le=MAX_TIME)
    # where others can dial this peer ([] for a client); restarts dial them (node/known_peers.py)
    maddrs: pv1.conlist(pv1.constr(strict=True, max_length=MAX_MADDR), max_items=MAX_MADDRS) = []
    # seconds per inner step in the last phase (0 = not measured yet): peers size their phases by the
    # swarm's median (DyLU, node/runner.py)
    inner_step_s: pv1.confloat(strict=True, ge=0.0, le=MAX_SECONDS) = 0.0
    # DHT time at which this peer expects to hand off its current inner phase (0 = unknown): a
    # round's leader waits for the peers about to arrive (progress alignment, node/runner.py)
    phase_eta: pv1.confloat(strict=True, ge=0.0, le=MAX_TIME) = 0.0
    # the last few (outer step, θ_global digest) pairs, oldest first: how many lineages the swarm holds
    theta_marks: pv1.conlist(ThetaMark, max_items=MAX_THETA_MARKS) = []
    # the grid round (averaging/grouping.py: round_number) this peer looks for a group in; None when
    # it is in none: peers behind the swarm at its step join that round
    averaging_round: Optional[pv1.conint(strict=True, ge=0, le=MAX_COUNT)] = None

    class Config:
        extra = pv1.Extra.forbid


class PeerRecordsSchema(pv1.BaseModel):
    """The DHT key ``{run_id}_peers``: owner public key -> record (``None`` = the peer said goodbye)."""

    peers: Dict[OwnerSubkey, Optional[PeerRecord]]

    class Config:
        extra = pv1.Extra.forbid


FIELDS: tuple[str, ...] = tuple(PeerRecord.__fields__)
_STR_LIMITS = {"peer_id": MAX_PEER_ID, "name": MAX_NAME, "version": MAX_SHORT, "device": MAX_SHORT,
               "precision": MAX_SHORT}
_INT_LIMITS = {"outer_step": MAX_COUNT, "tokens_total": MAX_COUNT, "bytes_sent": MAX_COUNT,
               "bytes_received": MAX_COUNT, "last_round_group_size": MAX_GROUP, "failed_rounds": MAX_COUNT}
_FLOAT_LIMITS = {"tokens_per_s": MAX_RATE, "last_round_s": MAX_SECONDS, "goodput": 1.0, "uptime_s": MAX_SECONDS,
                 "updated": MAX_TIME, "inner_step_s": MAX_SECONDS, "phase_eta": MAX_TIME}
_OPTIONAL_FLOAT_LIMITS = {"loss": MAX_LOSS, "eval_loss": MAX_LOSS}


# ---------------------------------------------------------------------------------------------- keys
def _load_private_key(path: Path) -> RSAPrivateKey:
    from cryptography.hazmat.primitives import serialization
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(path.read_bytes(), password=None)
    return key


def record_key(state_dir: Path | None) -> RSAPrivateKey:
    """The RSA key that owns this peer's record: ``state_dir/record.key`` (created 0600 on first use).

    ``state_dir=None`` gives a fresh, ephemeral key (for readers such as ``status`` and the dashboard).
    """
    from hivemind.utils.crypto import RSAPrivateKey

    if state_dir is None:
        return RSAPrivateKey()
    path = Path(state_dir) / KEY_FILE
    if path.exists():
        try:
            return _load_private_key(path)
        except Exception as e:  # a corrupt key file: keep it for inspection, make a new identity
            logger.warning(f"record key {path} is unreadable ({e}); moving it to {path}.bad and creating a new one")
            os.replace(path, path.with_name(path.name + ".bad"))
    path.parent.mkdir(parents=True, exist_ok=True)
    key = RSAPrivateKey()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key.to_bytes())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


def record_validators(run_id: str, state_dir: Path | None) -> list[RecordValidatorBase]:
    """Validators for ``hivemind.DHT(record_validators=...)``: signatures, then the record schema.

    Every peer of a run (and every reader) must use them, or the DHT will not strip the signatures.
    """
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator

    return [
        RSASignatureValidator(record_key(state_dir)),
        SchemaValidator(PeerRecordsSchema, allow_extra_keys=True, prefix=run_id),
    ]


def _signature_validator(validators: list) -> RSASignatureValidator:
    from hivemind.dht.crypto import RSASignatureValidator

    for v in validators:
        if isinstance(v, RSASignatureValidator):
            return v
    raise ValueError("record validators lack an RSASignatureValidator; build them with record_validators()")


def owner_fingerprint(owner: bytes | str) -> str:
    """A short, printable id of a record owner's public key (12 hex characters)."""
    raw = owner if isinstance(owner, bytes) else str(owner).encode()
    return hashlib.sha256(raw).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------- records
def normalize_snapshot(snapshot: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """Coerce a node's snapshot to exactly what :class:`PeerRecord` accepts, losing nothing sane.

    Ints/floats are cast and clamped to their bounds, non-finite numbers become 0 (``None`` for the
    losses), strings are truncated, unknown keys are dropped and ``updated`` defaults to now.

    :raises ValueError: the snapshot lacks a usable ``peer_id``.
    """
    out: dict[str, Any] = {}
    for field, limit in _STR_LIMITS.items():
        out[field] = str(snapshot.get(field, "") or "")[:limit]
    reach = snapshot.get("reachability")
    out["reachability"] = reach if reach in ("public", "client") else "unverified"
    for field, limit in _INT_LIMITS.items():
        out[field] = _int(snapshot.get(field), limit)
    for field, limit in _FLOAT_LIMITS.items():
        out[field] = _float(snapshot.get(field), limit)
    for field, limit in _OPTIONAL_FLOAT_LIMITS.items():
        value = snapshot.get(field)
        out[field] = None if value is None or not _finite(value) else _float(value, limit)
    ok = snapshot.get("last_round_ok")
    out["last_round_ok"] = None if ok is None else bool(ok)
    maddrs = snapshot.get("maddrs") or []
    out["maddrs"] = [str(a) for a in maddrs if isinstance(a, str) and len(a) <= MAX_MADDR][:MAX_MADDRS]
    out["theta_marks"] = [{"step": s, "digest": d} for s, d in marks_of(snapshot.get("theta_marks")).items()]
    round_in_flight = snapshot.get("averaging_round")
    out["averaging_round"] = None if round_in_flight is None else _int(round_in_flight, MAX_COUNT)
    if not out["updated"]:
        out["updated"] = float(time.time() if now is None else now)
    PeerRecord.parse_obj(out)  # raises ValueError (pydantic's ValidationError) on a bad peer_id
    return out


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _int(value: Any, limit: int) -> int:
    if not _finite(value):
        return 0
    return int(min(max(int(float(value)), 0), limit))


def _float(value: Any, limit: float) -> float:
    if not _finite(value):
        return 0.0
    return float(min(max(float(value), 0.0), limit))


@dataclass(frozen=True)
class PeerEntry:
    """One subkey of ``{run_id}_peers`` as read: its owner and record (``None`` = goodbye tombstone)."""

    owner: str  # owner_fingerprint() of the subkey
    record: PeerRecord | None
    expiration: float  # DHT time


def peer_entries(run_id: str, items: Iterable[tuple[Any, Any, float]]) -> list[PeerEntry]:
    """Parse ``(subkey, value, expiration)`` triples of the run's records key into entries.

    Shared by both readers (hivemind's DHT here, the light client in diloco_swarm/light), which
    hand over values already verified and stripped of their signatures. At most
    :data:`MAX_RECORDS` items are read; malformed ones are skipped.
    """
    entries: list[PeerEntry] = []
    for i, (subkey, value, expiration) in enumerate(items):
        if i >= MAX_RECORDS:
            logger.warning(f"{records_key(run_id)} has more than {MAX_RECORDS} records; ignoring the rest")
            break
        try:
            record = None if value is None else PeerRecord.parse_obj(value)
            entries.append(PeerEntry(owner_fingerprint(subkey), record, float(expiration)))
        except Exception as e:  # pydantic errors, wrong shapes: never the reader's problem
            logger.debug(f"skipping a malformed peer record: {e!r}")
    return entries


def read_peer_entries(dht, run_id: str, *, latest: bool = True) -> list[PeerEntry] | None:
    """All subkeys of the run's records, tombstones included; invalid entries skipped.

    :returns: None when the DHT could not be asked (shut down, timeout); an empty list when the key is absent.
    """
    try:
        found = dht_get(dht, records_key(run_id), latest=latest)
    except Exception as e:
        logger.debug(f"reading peer records failed: {e!r}")
        return None
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return []
    return peer_entries(run_id, ((subkey, getattr(item, "value", None), getattr(item, "expiration_time", None))
                                 for subkey, item in found.value.items()))


def read_peer_records(dht, run_id: str) -> dict[str, PeerRecord]:
    """Live records of the run, ``{peer_id: PeerRecord}``; tombstones, malformed entries skipped, never raises."""
    return live_records(read_peer_entries(dht, run_id) or [])


def live_records(entries: Iterable[PeerEntry]) -> dict[str, PeerRecord]:
    """``{peer_id: PeerRecord}`` of entries, tombstones skipped.

    ``peer_id`` is what each peer says about itself; when two owners claim the same one, the most
    recently updated record wins.
    """
    out: dict[str, PeerRecord] = {}
    for entry in entries:
        record = entry.record
        if record is None:
            continue
        held = out.get(record.peer_id)
        if held is None or record.updated > held.updated:
            out[record.peer_id] = record
    return out


class IdentityInUse(SwarmError):
    """Another running node publishes records of our peer id (same identity key: a copied state dir)."""


def identity_in_use(dht, run_id: str, peer_id: str, *, wait_s: float, ours_until: float | None = None) -> bool:
    """Whether another node publishes live records of ``peer_id`` now. Call it before publishing our own.

    A live record of our peer id alone proves nothing (ours, from a node that crashed less than
    ``3 * interval_s`` ago); one whose ``updated`` advances, or a new one, within ``wait_s`` does:
    somebody else is re-signing it. Records no newer than ``ours_until`` (the last ``updated`` this
    state dir's previous process published: :func:`last_published`) are that process's own: then no
    wait at all (a restart right after a crash). Reads the DHT once or twice (bounded calls); any read
    error counts as "no".
    """

    def ours() -> dict[str, float] | None:
        entries = read_peer_entries(dht, run_id)
        if entries is None:
            return None
        return {e.owner: e.record.updated for e in entries if e.record is not None and e.record.peer_id == peer_id}

    first = ours()
    if not first or (ours_until is not None and max(first.values()) <= ours_until):
        return False
    time.sleep(wait_s)
    second = ours() or {}
    return any(updated > first.get(owner, -1.0) for owner, updated in second.items())


# ---------------------------------------------------------------------------------------------- publisher
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


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


class PeerRecordPublisher:
    """Keeps this peer's signed record fresh in the DHT.

    :param validators: the list from :func:`record_validators` the DHT was started with (its
        RSASignatureValidator's public key is our subkey).
    :param snapshot: returns the record fields (see :class:`PeerRecord`); called from the
        publisher thread, so it must be cheap and thread-safe (reading plain attributes is fine).
        Values are coerced and clamped by :func:`normalize_snapshot`; ``updated`` is always set
        to the time of publication.
    """

    def __init__(self, dht, run_id: str, validators: list, snapshot: Callable[[], dict], interval_s: float = 5.0,
                 updated_path: Path | None = None):
        self.updated_path = updated_path  # where each record's `updated` is noted before it is stored
        self.dht = dht
        self.run_id = run_id
        self.key = records_key(run_id)
        self.subkey = _signature_validator(validators).local_public_key
        self.snapshot = snapshot
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_expiration = 0.0
        self._last_problem = ""  # logged once until a store succeeds again (not a line every 5 s)
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
                                           ours_until=last_published(self.updated_path, self.run_id)):
                raise IdentityInUse(
                    f"another node with this node's identity (peer id {peer_id}) is online in run '{self.run_id}': it "
                    "keeps publishing this peer's record, and this node has not. Was this state dir copied? Give each "
                    "node its own --state-dir (in a copy, delete identity.key and record.key for a new identity)")
        self._thread = threading.Thread(target=self._loop, name="peer-record-publisher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self.publish_now()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def publish_now(self) -> bool:
        """Store a fresh record now; errors are logged, never raised. :returns: whether the DHT took it."""
        try:
            with self._lock:
                if self._stopped.is_set():
                    return False
                value = normalize_snapshot({**self.snapshot(), "updated": time.time()})
                self._note_updated(value["updated"])
                ok = self._store(value, _dht_time() + 3 * self.interval_s)
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
                    self._store(None, _dht_time() + 3 * self.interval_s)
                finally:
                    self._lock.release()
            except ChildGone:  # the signal to our process group reached the DHT while we stored
                logger.debug("the DHT process ended during the goodbye; our record expires by itself")
            except Exception as e:
                logger.warning(f"could not remove this peer's record: {e}")
