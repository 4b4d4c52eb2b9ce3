"""The checks a hivemind node applies to the run's records, without hivemind.

A hivemind DHT of ours validates every value it stores or receives with two validators
(:func:`diloco_swarm.dht.records.record_validators`), highest priority first:

1. ``RSASignatureValidator`` (``hivemind/dht/crypto.py``): when the key or the subkey holds
   ``[owner:<ssh-rsa public key>]``, the value must hold exactly one ``[signature:<base64>]``, an
   RSA-PSS (MGF1-SHA256, maximal salt) SHA-256 signature by that key of
   ``msgpack((key_id, subkey_bytes, value_without_signature, expiration))`` (a tuple, ext type 0x40).
2. ``SchemaValidator`` (``hivemind/dht/schema.py``) with :class:`PeerRecordsSchema`: the value under
   ``{run_id}_peers`` must parse, with no type conversion, as ``{owner subkey: PeerRecord or None}``.

A dictionary answer from a peer is dropped whole when any of its subkeys fails, as hivemind's
``DHTProtocol._validate_dictionary`` does.
"""

from __future__ import annotations

import base64
import logging
import re
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from diloco_swarm.dht.records import OWNER_KEY_REGEX, PeerRecordsSchema
from diloco_swarm.light.wire import dumps, loads

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(OWNER_KEY_REGEX)
_SIGNATURE_RE = re.compile(re.escape(b"[signature:_value_]").replace(b"_value_", rb"(.+?)"))
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def strip_signature(value: bytes) -> bytes:
    return _SIGNATURE_RE.sub(b"", value)


def signature_ok(key_id: bytes, subkey: bytes, value: bytes, expiration: float) -> bool:
    """hivemind ``RSASignatureValidator.validate`` for one record (``subkey`` serialized, ``value`` signed)."""
    owners = _OWNER_RE.findall(key_id) + _OWNER_RE.findall(subkey)
    if not owners:
        return True  # not a protected record
    if len(set(owners)) > 1:
        return False
    try:
        public_key = serialization.load_ssh_public_key(owners[0])
    except Exception:
        return False
    if not isinstance(public_key, rsa.RSAPublicKey):
        return False
    signatures = _SIGNATURE_RE.findall(value)
    if len(signatures) != 1:
        return False
    signed = dumps((key_id, subkey, strip_signature(value), expiration))
    try:
        public_key.verify(base64.b64decode(signatures[0]), signed, _PSS, hashes.SHA256())
    except (ValueError, InvalidSignature):
        return False
    return True


def schema_ok(subkey: Any, value: Any) -> bool:
    """hivemind ``SchemaValidator.validate`` of one subkey of ``{run_id}_peers``: parses with no conversion."""
    try:
        parsed = PeerRecordsSchema.parse_obj({"peers": {subkey: value}}).dict(by_alias=True)["peers"]
    except Exception:
        return False
    return parsed == {subkey: value}


def verified_dictionary(key_id: bytes, items: list[tuple[Any, bytes, float]], *, schema: bool) -> list | None:
    """Check every subkey of one peer's dictionary answer; strip the signatures.

    :param items: ``(subkey, signed value bytes, expiration)`` as decoded from the wire.
    :param schema: also apply the records schema (the ``{run_id}_peers`` key).
    :returns: ``[(subkey, value, expiration)]`` with decoded values, or None when any subkey fails
        (the whole answer is dropped, as hivemind does).
    """
    out = []
    for subkey, value_bytes, expiration in items:
        try:
            if not isinstance(value_bytes, bytes) or isinstance(expiration, bool) \
                    or not isinstance(expiration, (int, float)):
                return None
            if not signature_ok(key_id, dumps(subkey), value_bytes, expiration):
                logger.debug("dropping a dictionary answer: a bad signature")
                return None
            value = loads(strip_signature(value_bytes))
        except Exception as e:
            logger.debug(f"dropping a dictionary answer: {e!r}")
            return None
        if schema and not schema_ok(subkey, value):
            logger.debug("dropping a dictionary answer: a record off the schema")
            return None
        out.append((subkey, value, expiration))
    return out


def verified_value(key_id: bytes, value_bytes: bytes, expiration: float) -> tuple[bool, Any]:
    """A regular (non-dictionary) value: ``(ok, decoded value)``; subkey = msgpack(None), as hivemind's."""
    try:
        if not signature_ok(key_id, dumps(None), value_bytes, expiration):
            return False, None
        return True, loads(strip_signature(value_bytes))
    except Exception:
        return False, None
