"""A hostile DHT peer for tests/test_light.py: joins a swarm and serves forged records of a run.

    python tests/light_forger.py RUN_ID INITIAL_MADDR

It runs hivemind with no record validators (so nothing stops it), copies one honest record's
signed bytes from the initial peer and keeps in its own storage, under ``{run_id}_peers``:

- that record with its fields changed (name TAMPERED, outer step 999999) and the original signature
  (tampered on the wire);
- a record of a made-up peer (FORGEDPEER) under one owner key, signed by another (wrong key).

It prints its multiaddr, then serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import sys

import msgpack
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

TAMPERED_STEP = 999_999
SIGNATURE = re.compile(rb"\[signature:(.+?)\]")


def forged_entries(key_id: bytes, honest: tuple[bytes, bytes, float]) -> list[tuple[bytes, bytes, float]]:
    """``(subkey bytes, value bytes, expiration)`` of the two forged records."""
    subkey, signed, expiration = honest
    record = msgpack.unpackb(SIGNATURE.sub(b"", signed), raw=False)
    record.update(name="TAMPERED", outer_step=TAMPERED_STEP)
    signature = SIGNATURE.search(signed).group(0)
    tampered = (subkey, MSGPackSerializer.dumps(record) + signature, expiration + 60)

    owner, signer = RSAPrivateKey(), RSAPrivateKey()
    fake_subkey = b"[owner:" + owner.get_public_key().to_bytes() + b"]"
    fake = {**record, "peer_id": "FORGEDPEER", "name": "FORGED", "outer_step": 1, "maddrs": []}
    value = MSGPackSerializer.dumps(fake)
    exp = get_dht_time() + 600
    to_sign = DHTRecord(key_id, MSGPackSerializer.dumps(fake_subkey), value, exp)
    wrong = signer.sign(MSGPackSerializer.dumps(dataclasses.astuple(to_sign)))
    return [tampered, (fake_subkey, value + b"[signature:" + wrong + b"]", exp)]


async def plant(_dht, node, key: str, honest_peer: str) -> int:
    """In the DHT process: copy an honest signed record from ``honest_peer``, store the forged ones locally."""
    key_id = DHTID.generate(source=key)
    for _ in range(60):
        found = await node.protocol.call_find(PeerID.from_base58(honest_peer), [key_id])
        value = found and found[key_id][0]
        if value is not None and len(value.value):
            break
        await asyncio.sleep(0.5)
    else:
        raise RuntimeError("no honest record to copy")
    subkey, (signed, expiration) = next(iter(value.value.items()))
    for sub, forged, exp in forged_entries(key_id.to_bytes(), (subkey, signed, expiration)):
        node.protocol.storage.store_subkey(key_id, sub, forged, exp)
    return len(value.value)


def main() -> None:
    run_id, initial = sys.argv[1], sys.argv[2]
    dht = DHT(initial_peers=[initial], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False,
              use_auto_relay=False)
    try:
        dht.run_coroutine(functools.partial(plant, key=f"{run_id}_peers", honest_peer=initial.rsplit("/p2p/", 1)[1]))
        print(dht.get_visible_maddrs()[0], flush=True)
        sys.stdin.read()
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
