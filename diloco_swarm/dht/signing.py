"""The key that signs this peer's record, and the DHT validators that check every record.

A record's subkey is its owner's RSA public key, so hivemind's ``RSASignatureValidator`` accepts a
value under it only when the matching private key signed it (records.py). That key is this peer's
record identity: kept in ``state_dir/record.key`` (:func:`record_key`), so a restarted node owns its
old record. The validators (:func:`record_validators`) also hold every value to the record schema.
Node-side only: the light client (diloco_swarm/light) verifies records without hivemind.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from diloco_swarm.dht.records import PeerRecordsSchema
from diloco_swarm.invites import write_private

logger = logging.getLogger(__name__)

KEY_FILE = "record.key"


def _load_private_key(path: Path) -> RSAPrivateKey:
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
    key = RSAPrivateKey()
    write_private(path, key.to_bytes())
    return key


def record_validators(run_id: str, state_dir: Path | None) -> list[RecordValidatorBase]:
    """Validators for ``hivemind.DHT(record_validators=...)``: signatures, then the record schema.

    Every peer of a run (and every reader) must use them, or the DHT will not strip the signatures.
    """
    return [
        RSASignatureValidator(record_key(state_dir)),
        SchemaValidator(PeerRecordsSchema, allow_extra_keys=True, prefix=run_id),
    ]


def signature_validator(validators: list) -> RSASignatureValidator:
    """The ``RSASignatureValidator`` among ``validators`` (its public key is our records' subkey).
    :raises ValueError: there is none."""
    for v in validators:
        if isinstance(v, RSASignatureValidator):
            return v
    raise ValueError("record validators lack an RSASignatureValidator; build them with record_validators()")
