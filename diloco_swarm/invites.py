"""Private runs: the organiser's key, invitations, and the admission pass a peer shows the others.

A run started with ``--private`` puts its organiser's Ed25519 public key in the run spec
(``RunSpec.organiser``). The organiser signs invitations (``diloco-node invite``); each holds a fresh
**invitation key** (an Ed25519 key pair) and the organiser's **grant** over its public half, the run
id and an expiry. A volunteer's node signs its own libp2p peer id with the invitation key (the
**proof**) and publishes grant and proof in its signed record (:class:`AdmissionPass`, ``admission``).

Every peer checks the pass against the organiser key of *its own* spec (never one read from the
DHT) and the peer id the libp2p connection authenticated: a stranger who copies another peer's pass
out of the DHT cannot use it, because the proof names the other peer's id and only the invitation's
private key could sign its own. An invitation is a bearer secret: whoever holds its text can admit
any number of their own nodes until it expires. This is the delegation of hivemind's
``TokenAuthorizerBase`` (an authority signs a peer's key with an expiry) without an online authority.

This module imports neither torch nor hivemind: the light client and the dashboard check passes too.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ORGANISER_KEY_FILE = "organiser.key"  # in the organiser's state dir, 0600
INVITATION_FILE = "invitation.txt"  # in a volunteer's state dir: restarts need no --invite
INVITATION_PREFIX = "diloco-invite-1."
PUBLIC_KEY_PREFIX = "ed25519:"
KEY_B64_LEN = 43  # unpadded urlsafe base64 of a 32-byte Ed25519 key
SIG_B64_LEN = 86  # ... of a 64-byte signature
OWNER_DIGEST_CHARS = 64  # sha256 hex of a record's owner subkey (records.owner_digest)
MAX_PEER_ID_CHARS = 128  # records.MAX_PEER_ID
MAX_INVITATION_CHARS = 1024
_GRANT_CONTEXT = b"diloco-swarm grant v1\0"
_PROOF_CONTEXT = b"diloco-swarm proof v1\0"


class InvitationError(ValueError):
    """An invitation or organiser key that cannot be used; the message is one line for the user."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str, length: int) -> bytes:
    """Decode unpadded urlsafe base64 of exactly ``length`` bytes. :raises ValueError: anything else."""
    if not isinstance(text, str) or len(text) > 4 * length:
        raise ValueError("not base64 text")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as e:
        raise ValueError("not base64 text") from e
    if len(raw) != length:
        raise ValueError(f"{len(raw)} bytes, expected {length}")
    return raw


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ----------------------------------------------------------------------------------------- organiser
def organiser_key(state_dir: Path, *, create: bool) -> Ed25519PrivateKey:
    """The organiser's private key, ``state_dir/organiser.key`` (raw 32 bytes, created 0600 when ``create``).

    :raises InvitationError: no key there (and not ``create``), or the file is not a key.
    """
    path = Path(state_dir) / ORGANISER_KEY_FILE
    if path.exists():
        raw = path.read_bytes()
        if len(raw) != 32:
            raise InvitationError(f"{path} is not an organiser key (expected 32 bytes, found {len(raw)})")
        return Ed25519PrivateKey.from_private_bytes(raw)
    if not create:
        raise InvitationError(f"{path} does not exist: only the state dir of the node that started the run "
                              "with --private holds the organiser key")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    write_private(path, key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption()))
    return key


def write_private(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` atomically, readable by its owner only (0600).
    :raises OSError: the state dir cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data.encode() if isinstance(data, str) else data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def public_key_text(key: Ed25519PrivateKey) -> str:
    """``ed25519:<43 base64 characters>``: how the run spec names the organiser."""
    return PUBLIC_KEY_PREFIX + _b64(_raw_public(key.public_key()))


def _organiser_public(text: str) -> Ed25519PublicKey:
    if not isinstance(text, str) or not text.startswith(PUBLIC_KEY_PREFIX):
        raise ValueError("not an ed25519: key")
    return Ed25519PublicKey.from_public_bytes(_unb64(text[len(PUBLIC_KEY_PREFIX):], 32))


def organiser_problem(text: str) -> str | None:
    """Why ``text`` is not an organiser public key (``RunSpec.organiser``), or None."""
    try:
        _organiser_public(text)
        return None
    except ValueError as e:
        return f"organiser key {text[:60]!r} is malformed ({e})"


def _grant_message(run_id: str, invite_public: bytes, expires_at: int) -> bytes:
    return _GRANT_CONTEXT + json.dumps([run_id, _b64(invite_public), expires_at], separators=(",", ":")).encode()


def _proof_message(run_id: str, peer_id: str, owner: str) -> bytes:
    return _PROOF_CONTEXT + json.dumps([run_id, peer_id, owner], separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------- invitation
@dataclass(frozen=True)
class Invitation:
    """One invitation to a private run: what ``diloco-node invite`` prints and ``--invite`` reads.

    ``expires_at``: unix seconds. ``invite_key``: the invitation's private key (32 raw bytes), the
    secret part. ``grant``: the organiser's Ed25519 signature over (run id, the invitation's public
    key, ``expires_at``).
    """

    run_id: str
    organiser: str
    expires_at: int
    invite_key: bytes
    grant: bytes

    def text(self) -> str:
        body = {"run": self.run_id, "org": self.organiser, "exp": self.expires_at,
                "key": _b64(self.invite_key), "grant": _b64(self.grant)}
        return INVITATION_PREFIX + _b64(json.dumps(body, separators=(",", ":")).encode())

    def admission_pass(self, peer_id: str, owner: str) -> dict:
        """The ``admission`` field of this peer's record (:class:`AdmissionPass`'s fields): the grant,
        and the invitation key's proof over (run id, ``peer_id``, ``owner``). ``owner``: the sha256 hex
        of the record's subkey (``records.owner_digest``), so that the pass holds only in the record
        its peer signs: another owner's record that claims our peer id and copies our pass is refused."""
        key = Ed25519PrivateKey.from_private_bytes(self.invite_key)
        proof = key.sign(_proof_message(self.run_id, peer_id, owner))
        return {"key": _b64(_raw_public(key.public_key())), "expires": self.expires_at,
                "grant": _b64(self.grant), "proof": _b64(proof)}


def make_invitation(key: Ed25519PrivateKey, run_id: str, expires_at: float) -> Invitation:
    """A new invitation to ``run_id`` signed by the organiser ``key``, valid until ``expires_at`` (unix s)."""
    invite = Ed25519PrivateKey.generate()
    invite_public = _raw_public(invite.public_key())
    expires = int(expires_at)
    return Invitation(run_id=run_id, organiser=public_key_text(key), expires_at=expires,
                      invite_key=invite.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                      serialization.NoEncryption()),
                      grant=key.sign(_grant_message(run_id, invite_public, expires)))


def parse_invitation(text: str, *, now: float) -> Invitation:
    """Read an invitation's text (as printed by ``diloco-node invite``) and check its grant.

    :raises InvitationError: malformed, not signed by the organiser it names, or expired at ``now``.
    """
    text = text.strip()
    if not text.startswith(INVITATION_PREFIX) or len(text) > MAX_INVITATION_CHARS:
        raise InvitationError(f"this is not a diloco-swarm invitation (an invitation starts with {INVITATION_PREFIX!r}; "
                              "ask the run's organiser for one: diloco-node invite)")
    try:
        encoded = text[len(INVITATION_PREFIX):]
        body = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
        invitation = Invitation(run_id=str(body["run"]), organiser=str(body["org"]), expires_at=int(body["exp"]),
                                invite_key=_unb64(body["key"], 32), grant=_unb64(body["grant"], 64))
        organiser = _organiser_public(invitation.organiser)
        invite_public = _raw_public(Ed25519PrivateKey.from_private_bytes(invitation.invite_key).public_key())
        organiser.verify(invitation.grant, _grant_message(invitation.run_id, invite_public, invitation.expires_at))
    except InvalidSignature:
        raise InvitationError("this invitation's signature is wrong (the text was changed or cut): "
                              "copy it again, whole") from None
    except (ValueError, KeyError, TypeError, OverflowError, binascii.Error, json.JSONDecodeError) as e:
        raise InvitationError(f"this invitation is damaged ({type(e).__name__}): copy it again, whole") from None
    if invitation.expires_at <= now:
        raise InvitationError(f"this invitation to run '{invitation.run_id}' has expired: "
                              "ask the run's organiser for a new one")
    return invitation


# -------------------------------------------------------------------------------------------- passes
def pass_problem(admission: dict | None, *, run_id: str, organiser: str, peer_id: str, owner: str,
                 now: float) -> str | None:
    """Why ``admission`` (a record's ``admission`` field, untrusted) does not admit ``peer_id`` to the
    private run ``run_id`` whose organiser key is ``organiser`` (from our own spec) at ``now``, in the
    record of ``owner`` (``Invitation.admission_pass``); None when it does. Never raises."""
    if not isinstance(admission, dict):
        return "it shows no invitation"
    fields = tuple(admission.get(k) for k in ("key", "expires", "grant", "proof"))
    if (not all(isinstance(f, str) for f in (*fields[::2], fields[3], peer_id, owner)) or type(fields[1]) is not int
            or (len(fields[0]), len(fields[2]), len(fields[3])) != (KEY_B64_LEN, SIG_B64_LEN, SIG_B64_LEN)
            or len(peer_id) > MAX_PEER_ID_CHARS or len(owner) != OWNER_DIGEST_CHARS):
        return "its pass is malformed"  # (bounded before the cache below keeps anything)
    why = _signatures_problem(run_id, organiser, peer_id, owner, *fields)
    if why is None and fields[1] <= now:
        return "its invitation has expired"
    return why


@functools.lru_cache(maxsize=4096)  # every reader checks every record every few seconds
def _signatures_problem(run_id: str, organiser: str, peer_id: str, owner: str, key: str, expires: int, grant: str,
                        proof: str) -> str | None:
    try:
        invite_public = _unb64(key, 32)
        _organiser_public(organiser).verify(_unb64(grant, 64), _grant_message(run_id, invite_public, expires))
        Ed25519PublicKey.from_public_bytes(invite_public).verify(_unb64(proof, 64),
                                                                 _proof_message(run_id, peer_id, owner))
    except InvalidSignature:
        return "its invitation is not the organiser's, or not for its peer id and record"
    except (TypeError, ValueError):
        return "its pass is malformed"
    return None
