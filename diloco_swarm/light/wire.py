"""hivemind's wire formats, rebuilt without hivemind: protobuf messages, unary framing, msgpack values, DHT ids.

Sources (hivemind 1.1.12): ``hivemind/proto/p2pd.proto`` and ``dht.proto`` (messages),
``p2p/p2p_daemon_bindings/control.py`` and the daemon's ``persistent_stream.go`` (unary calls),
``utils/serializer.py`` (msgpack ext types), ``dht/routing.py`` (``DHTID``) and ``dht/storage.py``
(``DictionaryDHTValue``).

A unary call to a hivemind peer is one libp2p stream whose protocol id is the handler name
(``DHTProtocol.rpc_find``). The caller writes one uvarint-length-prefixed
``PersistentConnectionRequest{callId, callUnary{peer, proto, data}}`` where ``data`` is the serialized
request message; the callee answers with one ``PersistentConnectionRequest{callId, unaryResponse}``.

The messages live in a private descriptor pool: hivemind and libp2p both register protobuf files in
the default pool (``crypto.pb.KeyType`` clashes), and ours must clash with neither.
Only the fields this client reads or writes are declared; protobuf skips the others.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import msgpack
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # one answer; hivemind's own default bound (persistent_conn_max_msg_size) is 4 MiB

_T = descriptor_pb2.FieldDescriptorProto
_TYPES = {"bytes": _T.TYPE_BYTES, "string": _T.TYPE_STRING, "bool": _T.TYPE_BOOL, "double": _T.TYPE_DOUBLE,
          "enum": _T.TYPE_ENUM}

# (message, [(field, number, type or message name, repeated, oneof index)])
_P2PD = {
    "CallUnaryRequest": [("peer", 1, "bytes"), ("proto", 2, "string"), ("data", 3, "bytes")],
    "CallUnaryResponse": [("response", 1, "bytes", False, 0), ("error", 2, "bytes", False, 0)],
    "PersistentConnectionRequest": [("callId", 1, "bytes"), ("callUnary", 3, ".p2pd.CallUnaryRequest", False, 0),
                                    ("unaryResponse", 4, ".p2pd.CallUnaryResponse", False, 0)],
}
_DHT = {
    "NodeInfo": [("node_id", 1, "bytes")],
    "PingRequest": [("peer", 2, ".dht.NodeInfo"), ("validate", 3, "bool")],
    "PingResponse": [("peer", 2, ".dht.NodeInfo"), ("dht_time", 4, "double"), ("available", 5, "bool")],
    "FindRequest": [("keys", 2, "bytes", True), ("peer", 3, ".dht.NodeInfo")],
    "FindResult": [("type", 1, "enum"), ("value", 2, "bytes"), ("expiration_time", 3, "double"),
                   ("nearest_node_ids", 4, "bytes", True), ("nearest_peer_ids", 5, "bytes", True)],
    "FindResponse": [("results", 2, ".dht.FindResult", True), ("peer", 3, ".dht.NodeInfo")],
}
NOT_FOUND, FOUND_REGULAR, FOUND_DICTIONARY = 0, 1, 2  # dht.proto ResultType


def _file(name: str, package: str, syntax: str, messages: dict) -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax=syntax)
    if package == "dht":
        enum = f.enum_type.add(name="ResultType")
        for i, n in enumerate(("NOT_FOUND", "FOUND_REGULAR", "FOUND_DICTIONARY")):
            enum.value.add(name=n, number=i)
    for msg_name, fields in messages.items():
        msg = f.message_type.add(name=msg_name)
        if any(len(spec) > 4 for spec in fields):
            msg.oneof_decl.add(name="message" if msg_name.startswith("Persistent") else "result")
        for spec in fields:
            fname, number, ftype = spec[:3]
            repeated = len(spec) > 3 and spec[3]
            field = msg.field.add(name=fname, number=number,
                                  label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL)
            if ftype in _TYPES:
                field.type = _TYPES[ftype]
                if ftype == "enum":
                    field.type_name = ".dht.ResultType"
            else:
                field.type, field.type_name = _T.TYPE_MESSAGE, ftype
            if len(spec) > 4:
                field.oneof_index = spec[4]
    return f


_pool = descriptor_pool.DescriptorPool()
# p2pd.proto is proto2 (its callId/peer/proto/data are `required`): proto2 keeps empty bytes on the
# wire once set, so the daemon's required-field check passes for an empty request body.
_pool.Add(_file("diloco_light_p2pd.proto", "p2pd", "proto2", _P2PD))
_pool.Add(_file("diloco_light_dht.proto", "dht", "proto3", _DHT))


def _message(full_name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(full_name))


PersistentConnectionRequest = _message("p2pd.PersistentConnectionRequest")
CallUnaryRequest = _message("p2pd.CallUnaryRequest")
NodeInfo = _message("dht.NodeInfo")
PingRequest = _message("dht.PingRequest")
PingResponse = _message("dht.PingResponse")
FindRequest = _message("dht.FindRequest")
FindResponse = _message("dht.FindResponse")


class WireError(Exception):
    """A peer sent bytes that do not parse as hivemind's protocol, or a frame over the size bound."""


# ---------------------------------------------------------------------------------------------- framing
def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def unary_request(peer_id: bytes, handler: str, payload: bytes) -> tuple[bytes, bytes]:
    """One framed unary call: ``(call_id, frame)``. ``peer_id`` is the callee's id (raw multihash bytes)."""
    call_id = uuid.uuid4().bytes
    msg = PersistentConnectionRequest(callId=call_id, callUnary=CallUnaryRequest(peer=peer_id, proto=handler,
                                                                                data=payload))
    body = msg.SerializeToString()
    return call_id, uvarint(len(body)) + body


def split_frame(buffer: bytes) -> tuple[bytes, bytes] | None:
    """``(message, rest)`` when ``buffer`` holds a whole uvarint-prefixed frame, else None (read more).

    :raises WireError: a malformed or oversized length prefix.
    """
    length = shift = 0
    for i, byte in enumerate(buffer[:10]):
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            if length > MAX_MESSAGE_BYTES:
                raise WireError(f"a frame of {length} bytes is over the {MAX_MESSAGE_BYTES}-byte bound")
            end = i + 1 + length
            return (buffer[i + 1:end], buffer[end:]) if len(buffer) >= end else None
    if len(buffer) >= 10:
        raise WireError("malformed length prefix")
    return None


def unary_response(call_id: bytes, message: bytes) -> bytes:
    """The payload of a unary answer.

    :raises WireError: not a unary answer to ``call_id``, or the handler's error (its text is the peer's).
    """
    try:
        answer = PersistentConnectionRequest.FromString(message)
    except Exception as e:
        raise WireError(f"unparseable unary answer: {e}") from None
    if answer.callId != call_id or not answer.HasField("unaryResponse"):
        raise WireError("the peer's answer is not a unary response to our call")
    result = answer.unaryResponse
    if result.HasField("error"):
        raise WireError("the peer's handler failed: " + result.error.decode(errors="replace")[:200])
    return result.response


# ---------------------------------------------------------------------------------------------- values
TUPLE_EXT = 0x40  # hivemind MSGPackSerializer: a tuple (a plain array would decode as a list)
DICTIONARY_EXT = 0x50  # hivemind DictionaryDHTValue: [maxsize, latest_expiration, [[subkey, value, exp], ...]]


class DictionaryValue(list):
    """A decoded ``DictionaryDHTValue``: a list of ``(subkey, value_bytes, expiration)``, in wire order."""


def _ext_hook(code: int, data: bytes) -> Any:
    if code == TUPLE_EXT:
        return tuple(loads(data))
    if code == DICTIONARY_EXT:
        _maxsize, _latest, items = loads(data)
        return DictionaryValue((item[0], item[1], item[2]) for item in items)
    raise WireError(f"unknown msgpack ext type {code}")  # hivemind leaves these as bytes; nothing of ours uses them


def loads(data: bytes) -> Any:
    """hivemind ``MSGPackSerializer.loads`` for the types a DHT value of ours can hold."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE_EXT, msgpack.packb(list(obj), strict_types=True, use_bin_type=True,
                                                         default=_default))
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def dumps(obj: Any) -> bytes:
    """hivemind ``MSGPackSerializer.dumps`` (strict types, tuples as ext type 0x40)."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)


def dht_id(key: Any) -> bytes:
    """hivemind ``DHTID.generate(key).to_bytes()``: SHA-1 of the msgpack-serialized key (20 bytes)."""
    return hashlib.sha1(key if isinstance(key, bytes) else dumps(key)).digest()


def xor_distance(a: bytes, b: bytes) -> int:
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")
