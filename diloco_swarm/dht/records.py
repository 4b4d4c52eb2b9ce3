"""Signed, schema-checked per-peer records in the DHT: the schema, and its reading (what ``status`` and the dashboard read).

One DHT key per run, ``{run_id}_peers``, holds a dictionary: one subkey per peer. The subkey is
the peer's RSA public key in hivemind's ``[owner:ssh-rsa ...]`` form, so hivemind's
:class:`~hivemind.dht.crypto.RSASignatureValidator` only accepts a value under that subkey when it is
signed by the matching private key: a peer can write its own record and nobody else's. Every
value must also match :class:`PeerRecord` (hivemind's :class:`~hivemind.dht.schema.SchemaValidator`,
strict types, bounded strings and numbers), on every DHT node that stores or returns it, so a
malformed or oversized record never reaches a reader. This is the pattern of hivemind's
collaborative-training examples (``{run_id}_metrics`` with ``LocalMetrics``).

This module is the schema and the parsing, shared with the light client (diloco_swarm/light), which
runs without hivemind: it imports no hivemind. The key and the validators are ``signing.py``'s, the
publication of our own record ``publisher.py``'s.

    validators = record_validators(run_id, state_dir)           # signing.py; pass to hivemind.DHT(record_validators=...)
    read_peer_records(dht, run_id)                              # {peer_id: PeerRecord}
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Literal, Optional

import pydantic.v1 as pv1

from diloco_swarm.dht.lineages import DIGEST_PATTERN, MAX_THETA_MARKS, marks_of
from diloco_swarm.dht.calls import dht_get
from diloco_swarm.invites import KEY_B64_LEN, MAX_PEER_ID_CHARS, SIG_B64_LEN, pass_problem
from diloco_swarm.utils import clock

logger = logging.getLogger(__name__)

RECORDS_FIELD = "peers"  # the DHT key is f"{run_id}_{RECORDS_FIELD}"
MAX_RECORDS = 1024  # a reader looks at most at this many subkeys

# Bounds: generous for honest peers, small enough that a hostile record cannot hurt a reader.
MAX_NAME = 64
MAX_PEER_ID = MAX_PEER_ID_CHARS  # (invites.py bounds the passes it checks by it)
MAX_SHORT = 64
MAX_COUNT = 10**18  # fits msgpack's uint64
MAX_RATE = 1e12
MAX_LOSS = 1e6
MAX_SECONDS = 1e10
MAX_GROUP = 10**6
MAX_TIME = 1e11  # unix time, year ~5138
MAX_MADDRS = 8
MAX_MADDR = 256
MAX_AVOIDED = 16  # peers a record names as avoided (the newest kept)
MAX_WHY = 160  # characters of the reason given for each
MAX_PARTNERS = 32  # peers a record lists in rounds_with (the most recent partners kept)


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


PEER_ID_PATTERN = r"^[A-Za-z0-9]+$"
B64_PATTERN = r"^[A-Za-z0-9_-]+$"


class AvoidedPeer(pv1.BaseModel):
    """A peer this peer's averager bans or avoids (averaging/conduct.py), and why: its own word."""

    peer_id: pv1.constr(strict=True, min_length=1, max_length=MAX_PEER_ID, regex=PEER_ID_PATTERN)
    why: pv1.constr(strict=True, max_length=MAX_WHY)

    class Config:
        extra = pv1.Extra.forbid


class RoundsWith(pv1.BaseModel):
    """A partner of this peer's verified rounds (dht/ledger.py): ``rounds`` verified rounds shared with
    ``peer_id`` and the ``tokens`` (the partner's round weight, as it gathered it to the group) in them."""

    peer_id: pv1.constr(strict=True, min_length=1, max_length=MAX_PEER_ID, regex=PEER_ID_PATTERN)
    rounds: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    tokens: pv1.conint(strict=True, ge=0, le=MAX_COUNT)

    class Config:
        extra = pv1.Extra.forbid


class AdmissionPass(pv1.BaseModel):
    """In a private run, the invitation this peer joined with (invites.py): the organiser's ``grant`` over
    the invitation ``key`` and its ``expires`` (unix s), and the invitation key's ``proof`` over our peer
    id. Unpadded urlsafe base64; checked by :func:`~diloco_swarm.invites.pass_problem`."""

    key: pv1.constr(strict=True, min_length=KEY_B64_LEN, max_length=KEY_B64_LEN, regex=B64_PATTERN)
    expires: pv1.conint(strict=True, ge=0, le=MAX_COUNT)
    grant: pv1.constr(strict=True, min_length=SIG_B64_LEN, max_length=SIG_B64_LEN, regex=B64_PATTERN)
    proof: pv1.constr(strict=True, min_length=SIG_B64_LEN, max_length=SIG_B64_LEN, regex=B64_PATTERN)

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
    """What one peer says about itself (and, in ``avoided_peers``, whom it keeps out of its groups). Strict types:
    hivemind's SchemaValidator allows no conversion."""

    peer_id: pv1.constr(strict=True, min_length=1, max_length=MAX_PEER_ID, regex=PEER_ID_PATTERN)
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
    # the peers this peer keeps out of its groups now (banned, or avoided for a while), newest last: as
    # of its last round with a group. Absent in older records
    avoided_peers: pv1.conlist(AvoidedPeer, max_items=MAX_AVOIDED) = []
    # in a private run, the invitation that admits this peer (None in a public run)
    admission: Optional[AdmissionPass] = None
    # the outer steps θ_global's lineage owes for a restart from θ_0 (averaging/mixing.py: standing)
    restarted_below: pv1.conint(strict=True, ge=0, le=MAX_COUNT) = 0
    # the outer step of the θ_global whose held-out loss eval_loss is (None with no eval_loss, and in
    # records of older versions): early in a run it is behind the training loss's θ_local
    eval_outer_step: Optional[pv1.conint(strict=True, ge=0, le=MAX_COUNT)] = None
    # the contribution ledger (dht/ledger.py): this peer's verified rounds since it first joined the run
    # (its own word), and what it witnessed of its most recent partners (the evidence for theirs)
    verified_rounds: pv1.conint(strict=True, ge=0, le=MAX_COUNT) = 0
    # the tokens behind its Δ in those verified rounds (its own weight in them; tokens_total also holds solo
    # rounds' and unsent phases', which nobody else sees)
    verified_tokens: pv1.conint(strict=True, ge=0, le=MAX_COUNT) = 0
    rounds_with: pv1.conlist(RoundsWith, max_items=MAX_PARTNERS) = []
    # why this peer trains no more for now (node/pause.py): its owner paused it, or it is outside its
    # --active-hours; None while it trains (and in older records). No round waits for a paused peer
    paused: Optional[Literal["owner", "active_hours"]] = None

    class Config:
        extra = pv1.Extra.forbid

    @pv1.validator("rounds_with")
    def _one_entry_per_partner(cls, value):
        if len({entry.peer_id for entry in value}) != len(value):
            raise ValueError("rounds_with lists a partner twice")
        return value


class PeerRecordsSchema(pv1.BaseModel):
    """The DHT key ``{run_id}_peers``: owner public key -> record (``None`` = the peer said goodbye)."""

    peers: Dict[OwnerSubkey, Optional[PeerRecord]]

    class Config:
        extra = pv1.Extra.forbid


FIELDS: tuple[str, ...] = tuple(PeerRecord.__fields__)
_STR_LIMITS = {"peer_id": MAX_PEER_ID, "name": MAX_NAME, "version": MAX_SHORT, "device": MAX_SHORT,
               "precision": MAX_SHORT}
_INT_LIMITS = {"outer_step": MAX_COUNT, "restarted_below": MAX_COUNT, "tokens_total": MAX_COUNT,
               "bytes_sent": MAX_COUNT,
               "bytes_received": MAX_COUNT, "last_round_group_size": MAX_GROUP, "failed_rounds": MAX_COUNT,
               "verified_rounds": MAX_COUNT, "verified_tokens": MAX_COUNT}
_FLOAT_LIMITS = {"tokens_per_s": MAX_RATE, "last_round_s": MAX_SECONDS, "goodput": 1.0, "uptime_s": MAX_SECONDS,
                 "updated": MAX_TIME, "inner_step_s": MAX_SECONDS, "phase_eta": MAX_TIME}
_OPTIONAL_FLOAT_LIMITS = {"loss": MAX_LOSS, "eval_loss": MAX_LOSS}


# ---------------------------------------------------------------------------------------------- owners
def owner_fingerprint(owner: bytes | str) -> str:
    """A short, printable id of a record owner's public key (12 hex characters)."""
    return owner_digest(owner)[:12]


def owner_digest(owner: bytes | str) -> str:
    """sha256 hex (64 characters) of a record's owner subkey: what a private run's pass is bound to
    (invites.Invitation.admission_pass)."""
    raw = owner if isinstance(owner, bytes) else str(owner).encode()
    return hashlib.sha256(raw).hexdigest()


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
    out["avoided_peers"] = avoided_of(snapshot.get("avoided_peers"))
    out["rounds_with"] = rounds_with_of(snapshot.get("rounds_with"))
    out["admission"] = snapshot.get("admission")  # invites.Invitation.admission_pass(), or None
    at = snapshot.get("eval_outer_step")
    out["eval_outer_step"] = None if out["eval_loss"] is None or at is None else _int(at, MAX_COUNT)
    paused = snapshot.get("paused")
    out["paused"] = paused if paused in ("owner", "active_hours") else None
    if not out["updated"]:
        out["updated"] = float(clock.now() if now is None else now)
    PeerRecord.parse_obj(out)  # raises ValueError (pydantic's ValidationError) on a bad peer_id
    return out


_PEER_ID = re.compile(PEER_ID_PATTERN)


def avoided_of(raw: Any) -> list[dict[str, str]]:
    """The ``avoided_peers`` of a record from a snapshot's peer id -> why (or the record's own list of
    ``{"peer_id", "why"}``): malformed peer ids dropped, reasons truncated to :data:`MAX_WHY`, the
    newest (last) :data:`MAX_AVOIDED` kept."""
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, (list, tuple)):
        pairs = [(item.get("peer_id"), item.get("why")) for item in raw if isinstance(item, dict)]
    else:
        return []
    out = [{"peer_id": peer, "why": str(why or "")[:MAX_WHY]} for peer, why in pairs
           if isinstance(peer, str) and len(peer) <= MAX_PEER_ID and _PEER_ID.match(peer)]
    return out[-MAX_AVOIDED:]


def rounds_with_of(raw: Any) -> list[dict[str, Any]]:
    """The ``rounds_with`` of a record from a snapshot's peer id -> ``(rounds, tokens)`` (oldest partner
    first), or the record's own list of ``{"peer_id", "rounds", "tokens"}``: malformed peer ids dropped,
    counts clamped to [0, :data:`MAX_COUNT`], the newest (last) :data:`MAX_PARTNERS` kept."""
    if isinstance(raw, dict):
        triples = [(peer, *(value if isinstance(value, (list, tuple)) and len(value) == 2 else (value, 0)))
                   for peer, value in raw.items()]
    elif isinstance(raw, (list, tuple)):
        triples = [(item.get("peer_id"), item.get("rounds"), item.get("tokens")) for item in raw if isinstance(item, dict)]
    else:
        return []
    out = {peer: {"peer_id": peer, "rounds": _int(rounds, MAX_COUNT), "tokens": _int(tokens, MAX_COUNT)}
           for peer, rounds, tokens in triples
           if isinstance(peer, str) and len(peer) <= MAX_PEER_ID and _PEER_ID.match(peer)}  # a partner once: its last
    return list(out.values())[-MAX_PARTNERS:]


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
    # in a private run, why this record's peer is not admitted (its record is then dropped: None)
    refused: str | None = None


def peer_entries(run_id: str, items: Iterable[tuple[Any, Any, float]], *,
                 organiser: str | None = None) -> list[PeerEntry]:
    """Parse ``(subkey, value, expiration)`` triples of the run's records key into entries.

    Shared by both readers (hivemind's DHT here, the light client in diloco_swarm/light), which
    hand over values already verified and stripped of their signatures. At most
    :data:`MAX_RECORDS` items are read; malformed ones are skipped. In a private run (``organiser``:
    ``RunSpec.organiser``) a record whose peer shows no valid invitation (invites.pass_problem) is
    kept only as a refusal: ``record`` None, ``refused`` saying why.
    """
    entries: list[PeerEntry] = []
    for i, (subkey, value, expiration) in enumerate(items):
        if i >= MAX_RECORDS:
            logger.warning(f"{records_key(run_id)} has more than {MAX_RECORDS} records; ignoring the rest")
            break
        try:
            record = None if value is None else PeerRecord.parse_obj(value)
            why = (None if organiser is None or record is None
                   else admission_problem(record, run_id, organiser, owner_digest(subkey)))
            if why is not None:
                entries.append(PeerEntry(owner_fingerprint(subkey), None, float(expiration), refused=why))
                continue
            entries.append(PeerEntry(owner_fingerprint(subkey), record, float(expiration)))
        except Exception as e:  # pydantic errors, wrong shapes: never the reader's problem
            logger.debug(f"skipping a malformed peer record: {e!r}")
    return entries


def admission_problem(record: PeerRecord, run_id: str, organiser: str, owner: str) -> str | None:
    """Why ``record`` (under the subkey whose :func:`owner_digest` is ``owner``) does not admit its peer to
    the private run (``organiser``: our spec's), or None."""
    admission = None if record.admission is None else record.admission.dict()
    why = pass_problem(admission, run_id=run_id, organiser=organiser, peer_id=record.peer_id, owner=owner,
                       now=clock.now())
    return None if why is None else f"peer {record.peer_id}: {why}"


def read_peer_entries(dht, run_id: str, *, latest: bool = True, organiser: str | None = None) -> list[PeerEntry] | None:
    """All subkeys of the run's records, tombstones and refusals (``organiser``: :func:`peer_entries`)
    included; invalid entries skipped.

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
                                 for subkey, item in found.value.items()), organiser=organiser)


def read_peer_records(dht, run_id: str, *, organiser: str | None = None) -> dict[str, PeerRecord]:
    """Live records of the run, ``{peer_id: PeerRecord}``; tombstones, malformed entries and (``organiser``)
    peers without a valid invitation skipped, never raises."""
    return live_records(read_peer_entries(dht, run_id, organiser=organiser) or [])


def live_records(entries: Iterable[PeerEntry]) -> dict[str, PeerRecord]:
    """``{peer_id: PeerRecord}`` of entries, tombstones skipped.

    ``peer_id`` is what each peer says about itself; when two owners claim the same one, the most
    recently updated record wins, but says ``paused`` only if every claim does: another owner's record
    under a peer's id must not take that peer out of every round (``round_policy.training``).
    """
    out: dict[str, PeerRecord] = {}
    awake: set[str] = set()  # peer ids of which some claim trains
    for entry in entries:
        record = entry.record
        if record is None:
            continue
        if record.paused is None:
            awake.add(record.peer_id)
        held = out.get(record.peer_id)
        if held is None or record.updated > held.updated:
            out[record.peer_id] = record
    for peer_id in awake:
        if out[peer_id].paused is not None:
            out[peer_id] = out[peer_id].copy(update={"paused": None})
    return out
