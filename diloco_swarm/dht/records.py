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
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Literal, Optional

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

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


def records_key(run_id: str) -> str:
    return f"{run_id}_{RECORDS_FIELD}"


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

    class Config:
        extra = pv1.Extra.forbid


class PeerRecordsSchema(pv1.BaseModel):
    """The DHT key ``{run_id}_peers``: owner public key -> record (``None`` = the peer said goodbye)."""

    peers: Dict[BytesWithPublicKey, Optional[PeerRecord]]

    class Config:
        extra = pv1.Extra.forbid


FIELDS: tuple[str, ...] = tuple(PeerRecord.__fields__)
_STR_LIMITS = {"peer_id": MAX_PEER_ID, "name": MAX_NAME, "version": MAX_SHORT, "device": MAX_SHORT,
               "precision": MAX_SHORT}
_INT_LIMITS = {"outer_step": MAX_COUNT, "tokens_total": MAX_COUNT, "bytes_sent": MAX_COUNT,
               "bytes_received": MAX_COUNT, "last_round_group_size": MAX_GROUP, "failed_rounds": MAX_COUNT}
_FLOAT_LIMITS = {"tokens_per_s": MAX_RATE, "last_round_s": MAX_SECONDS, "goodput": 1.0, "uptime_s": MAX_SECONDS,
                 "updated": MAX_TIME, "inner_step_s": MAX_SECONDS}
_OPTIONAL_FLOAT_LIMITS = {"loss": MAX_LOSS, "eval_loss": MAX_LOSS}


# ---------------------------------------------------------------------------------------------- keys
def _load_private_key(path: Path) -> RSAPrivateKey:
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(path.read_bytes(), password=None)
    return key


def record_key(state_dir: Path | None) -> RSAPrivateKey:
    """The RSA key that owns this peer's record: ``state_dir/record.key`` (created 0600 on first use).

    ``state_dir=None`` gives a fresh, ephemeral key (for readers such as ``status`` and the dashboard).
    """
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
    return [
        RSASignatureValidator(record_key(state_dir)),
        SchemaValidator(PeerRecordsSchema, allow_extra_keys=True, prefix=run_id),
    ]


def _signature_validator(validators: list) -> RSASignatureValidator:
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


def read_peer_entries(dht, run_id: str, *, latest: bool = True) -> list[PeerEntry] | None:
    """All subkeys of the run's records, tombstones included; invalid entries skipped.

    :returns: None when the DHT could not be asked (shut down, timeout); an empty list when the key is absent.
    """
    try:
        found = dht.get(records_key(run_id), latest=latest)
    except Exception as e:
        logger.debug(f"reading peer records failed: {e!r}")
        return None
    entries: list[PeerEntry] = []
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return entries
    for i, (subkey, item) in enumerate(found.value.items()):
        if i >= MAX_RECORDS:
            logger.warning(f"{records_key(run_id)} has more than {MAX_RECORDS} records; ignoring the rest")
            break
        try:
            value = item.value
            expiration = float(item.expiration_time)
            record = None if value is None else PeerRecord.parse_obj(value)
        except Exception as e:  # pydantic errors, wrong shapes: never the reader's problem
            logger.debug(f"skipping a malformed peer record: {e!r}")
            continue
        entries.append(PeerEntry(owner_fingerprint(subkey), record, expiration))
    return entries


def read_peer_records(dht, run_id: str) -> dict[str, PeerRecord]:
    """Live records of the run, ``{peer_id: PeerRecord}``; tombstones, malformed entries skipped, never raises.

    ``peer_id`` is what each peer says about itself; when two owners claim the same one, the most
    recently updated record wins.
    """
    out: dict[str, PeerRecord] = {}
    for entry in read_peer_entries(dht, run_id) or []:
        record = entry.record
        if record is None:
            continue
        held = out.get(record.peer_id)
        if held is None or record.updated > held.updated:
            out[record.peer_id] = record
    return out


# ---------------------------------------------------------------------------------------------- publisher
class PeerRecordPublisher:
    """Keeps this peer's signed record fresh in the DHT.

    :param validators: the list from :func:`record_validators` the DHT was started with (its
        RSASignatureValidator's public key is our subkey).
    :param snapshot: returns the record fields (see :class:`PeerRecord`); called from the
        publisher thread, so it must be cheap and thread-safe (reading plain attributes is fine).
        Values are coerced and clamped by :func:`normalize_snapshot`; ``updated`` is always set
        to the time of publication.
    """

    def __init__(self, dht, run_id: str, validators: list, snapshot: Callable[[], dict], interval_s: float = 5.0):
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
        self.published = 0  # successful stores (for tests and logs)

    @property
    def owner(self) -> str:
        return owner_fingerprint(self.subkey)

    def start(self) -> None:
        if self._thread is not None:
            return
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
                return self._store(value, get_dht_time() + 3 * self.interval_s)
        except Exception as e:
            logger.warning(f"could not publish this peer's record: {e!r}")
            return False

    def _store(self, value: dict | None, expiration: float) -> bool:
        # The DHT keeps the entry with the latest expiration: never go backwards.
        expiration = max(expiration, self._last_expiration + 1e-3)
        if not self.dht.is_alive():
            raise RuntimeError("the DHT process is gone")
        # bounded: if the DHT process died (SIGTERM to the process group, OOM), a plain store() waits forever
        future = self.dht.store(self.key, value, expiration_time=expiration, subkey=self.subkey, return_future=True)
        ok = bool(future.result(timeout=STORE_TIMEOUT_S))
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
        if remove:
            try:
                if not self._lock.acquire(timeout=STORE_TIMEOUT_S + 1):
                    raise TimeoutError("the publisher is stuck in a DHT call")
                try:
                    self._store(None, get_dht_time() + 3 * self.interval_s)
                finally:
                    self._lock.release()
            except Exception as e:
                logger.warning(f"could not remove this peer's record: {e!r}")
