"""The py-libp2p light client (diloco_swarm/light): wire format and record checks against hivemind's own
code, then against a live swarm of real `diloco-node join` processes (one swarm for the whole module):
status and dashboard agree with the hivemind path, forged records are dropped, probe, no p2pd, and a
fresh virtualenv with only the base install.

The light client runs in subprocesses: hivemind and libp2p cannot be imported in one process
(both register ``crypto.pb.KeyType``); wire.py and verify.py import neither, so they are tested here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.procs import process_tree
from diloco_swarm.light import wire
from diloco_swarm.light.verify import schema_ok, signature_ok, strip_signature, verified_dictionary

REPO = Path(__file__).resolve().parents[1]
NODE = [sys.executable, "-m", "diloco_swarm"]


# ------------------------------------------------------------------------------ unit: wire and checks
def test_wire_matches_hivemind():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.proto import dht_pb2
    from hivemind.utils import MSGPackSerializer, get_dht_time

    for key in ("run_peers", b"raw", ("a", 1)):
        assert wire.dht_id(key) == DHTID.generate(source=key).to_bytes()
    record = (b"k" * 20, b"\xc4\x03sub", b"value", 1.5e9)
    assert wire.dumps(record) == MSGPackSerializer.dumps(record)
    # a hivemind dictionary value decodes to (subkey, value bytes, expiration), in order
    d = DictionaryDHTValue()
    d.store(b"[owner:x]", b"v1", get_dht_time() + 60)
    d.store("s2", b"v2", get_dht_time() + 30)
    decoded = wire.loads(MSGPackSerializer.dumps(d))
    assert isinstance(decoded, wire.DictionaryValue)
    assert {s: v for s, v, _ in decoded} == {b"[owner:x]": b"v1", "s2": b"v2"}
    # our private protobuf messages are byte-compatible with hivemind's
    ours = wire.FindRequest(keys=[b"a" * 20, b"b" * 20], peer=wire.NodeInfo(node_id=b"n" * 20)).SerializeToString()
    theirs = dht_pb2.FindRequest(keys=[b"a" * 20, b"b" * 20], peer=dht_pb2.NodeInfo(node_id=b"n" * 20))
    assert ours == theirs.SerializeToString()
    answer = dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=b"x",
                                                              expiration_time=3.0, nearest_peer_ids=[b"p"])])
    parsed = wire.FindResponse.FromString(answer.SerializeToString())
    assert parsed.results[0].type == wire.FOUND_DICTIONARY and parsed.results[0].nearest_peer_ids == [b"p"]


def test_unary_framing():
    call_id, frame = wire.unary_request(b"peer", "DHTProtocol.rpc_ping", b"")
    body, rest = wire.split_frame(frame + b"tail")
    assert rest == b"tail" and wire.split_frame(frame[:-1]) is None
    msg = wire.PersistentConnectionRequest.FromString(body)
    assert msg.callId == call_id and msg.callUnary.proto == "DHTProtocol.rpc_ping" and msg.callUnary.HasField("data")
    ok = wire.PersistentConnectionRequest(callId=call_id)
    ok.unaryResponse.response = b"pong"
    assert wire.unary_response(call_id, ok.SerializeToString()) == b"pong"
    failed = wire.PersistentConnectionRequest(callId=call_id)
    failed.unaryResponse.error = b"boom"
    with pytest.raises(wire.WireError, match="boom"):
        wire.unary_response(call_id, failed.SerializeToString())
    with pytest.raises(wire.WireError):
        wire.unary_response(b"other-call-id-16", ok.SerializeToString())
    with pytest.raises(wire.WireError):
        wire.split_frame(wire.uvarint(wire.MAX_MESSAGE_BYTES + 1))


def test_signature_and_schema_rules_match_hivemind():
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from diloco_swarm.dht.records import OWNER_KEY_REGEX, normalize_snapshot, record_validators, records_key

    assert OWNER_KEY_REGEX == RSASignatureValidator.PUBLIC_KEY_REGEX
    validators = record_validators("r", None)
    signer = validators[0]
    key_id = wire.dht_id(records_key("r"))
    subkey = signer.local_public_key
    value = normalize_snapshot({"peer_id": "PeerA", "name": "a", "outer_step": 3})
    record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + 30)
    signed = signer.sign_value(record)
    good = dataclasses.replace(record, value=signed)
    assert signer.validate(good) and signature_ok(key_id, good.subkey, signed, good.expiration_time)
    assert wire.loads(strip_signature(signed)) == value and schema_ok(subkey, value)

    tampered = signed.replace(MSGPackSerializer.dumps(3), MSGPackSerializer.dumps(4), 1)
    assert tampered != signed
    later = dataclasses.replace(good, expiration_time=good.expiration_time + 1)
    other = RSASignatureValidator(RSAPrivateKey())
    wrong_key = dataclasses.replace(record, value=record.value + b"[signature:"
                                    + RSAPrivateKey().sign(MSGPackSerializer.dumps(dataclasses.astuple(record))) + b"]")
    for bad in (dataclasses.replace(good, value=tampered), later, wrong_key, dataclasses.replace(good, value=record.value)):
        assert not signer.validate(bad) and not other.validate(bad)
        assert not signature_ok(key_id, bad.subkey, bad.value, bad.expiration_time)

    # the schema: no conversions, no unknown fields, bounds, an owner in the subkey
    assert not schema_ok(subkey, {**value, "outer_step": 3.0})
    assert not schema_ok(subkey, {**value, "extra": 1})
    assert not schema_ok(subkey, {**value, "goodput": 2.0})
    assert not schema_ok(b"no owner here", value)
    assert schema_ok(subkey, None)  # a goodbye tombstone
    # one bad subkey drops the whole answer, as hivemind's DHTProtocol._validate_dictionary does
    items = [(subkey, signed, good.expiration_time)]
    assert verified_dictionary(key_id, items, schema=True) == [(subkey, value, good.expiration_time)]
    assert verified_dictionary(key_id, items + [(subkey, tampered, good.expiration_time)], schema=True) is None


def test_light_path_imports_neither_hivemind_nor_torch():
    code = ("import sys, diloco_swarm.cli.app, diloco_swarm.light.reader, diloco_swarm.dashboard.app;"
            "import libp2p;"
            "bad = [m for m in ('hivemind', 'torch', 'bitsandbytes') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)
