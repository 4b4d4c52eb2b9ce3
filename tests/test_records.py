"""Signed, schema-checked per-peer records (diloco_swarm.dht: records, signing, publisher) on real DHTs on 127.0.0.1."""

from __future__ import annotations

import json
import os
import stat
import time
from types import SimpleNamespace

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco_swarm.dht.publisher import PeerRecordPublisher, identity_in_use, last_published
from diloco_swarm.dht.records import (
    MAX_AVOIDED,
    MAX_WHY,
    PeerRecord,
    normalize_snapshot,
    owner_fingerprint,
    read_peer_entries,
    read_peer_records,
    records_key,
)
from diloco_swarm.dht.signing import record_key, record_validators

RUN = "rec-test"


def snapshot(peer_id: str = "12D3KooWTestPeer", **over) -> dict:
    base = dict(
        peer_id=peer_id, name="alice", version="0.1.0", device="cpu", precision="fp32", reachability="public",
        outer_step=3, tokens_per_s=123.5, loss=2.5, eval_loss=2.6, tokens_total=1000, bytes_sent=10,
        bytes_received=20, last_round_group_size=2, last_round_s=0.5, last_round_ok=True, failed_rounds=0,
        goodput=0.9, uptime_s=12.0, updated=time.time(),
        theta_marks=[{"step": 2, "digest": "00ff00ff00ff00ff"}, {"step": 3, "digest": "0123456789abcdef"}],
    )
    base.update(over)
    return base


def start(validators, initial_peers=()) -> DHT:
    return DHT(start=True, initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
               record_validators=validators, use_relay=False, use_auto_relay=False)


def addrs(dht: DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def wait_for(cond, timeout: float = 10.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


# ------------------------------------------------------------------ unit: schema, normalization, keys
def test_schema_is_strict_and_bounded():
    PeerRecord.parse_obj(snapshot())
    bad = [
        {"outer_step": 3.0},  # float for int
        {"tokens_per_s": 5},  # int for float (SchemaValidator forbids conversions)
        {"outer_step": -1},
        {"goodput": 1.5},
        {"name": "x" * 65},
        {"reachability": "relay"},
        {"peer_id": "<script>"},
        {"loss": float("nan")},
        {"last_round_ok": 1},
        {"maddrs": ["/ip4/1.2.3.4/tcp/1/p2p/" + "x" * 300]},  # one address too long
        {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 9},  # too many addresses
        {"maddrs": [1]},
        {"maddrs": "/ip4/1.2.3.4/tcp/1"},  # a string, not a list
        {"theta_marks": [{"step": i, "digest": "ab" * 8} for i in range(9)]},  # more than 8 marks
        {"theta_marks": [{"step": 1, "digest": "<not hex>"}]},
        {"theta_marks": [{"step": 1.0, "digest": "ab" * 8}]},
        {"theta_marks": [{"step": 1, "digest": "ab" * 8, "extra": 1}]},
        {"theta_marks": [[1, "ab" * 8]]},  # a pair, not a mark: the DHT would see a type conversion
        {"avoided_peers": [{"peer_id": "Qm" + str(i), "why": "x"} for i in range(MAX_AVOIDED + 1)]},
        {"avoided_peers": [{"peer_id": "<script>", "why": "x"}]},
        {"avoided_peers": [{"peer_id": "QmX", "why": "x" * (MAX_WHY + 1)}]},
        {"avoided_peers": [{"peer_id": "QmX"}]},
        {"avoided_peers": {"QmX": "a dict, not a list"}},
    ]
    for over in bad:
        with pytest.raises(ValueError):
            PeerRecord.parse_obj(snapshot(**over))
    with pytest.raises(ValueError):
        PeerRecord.parse_obj({**snapshot(), "extra": 1})


def test_normalize_snapshot_coerces_clamps_and_drops():
    raw = snapshot(outer_step=4.0, tokens_per_s=7, loss=float("nan"), eval_loss=None, goodput=1.7,
                   bytes_sent=-5, name="n" * 200, last_round_ok=None, updated=None, junk="dropped",
                   tokens_total=float("inf"))
    out = normalize_snapshot(raw, now=1234.5)
    assert out["outer_step"] == 4 and isinstance(out["outer_step"], int)
    assert out["tokens_per_s"] == 7.0 and isinstance(out["tokens_per_s"], float)
    assert out["loss"] is None and out["eval_loss"] is None
    assert out["goodput"] == 1.0 and out["bytes_sent"] == 0 and out["tokens_total"] == 0
    assert len(out["name"]) == 64 and "junk" not in out and out["updated"] == 1234.5
    assert out["maddrs"] == []  # a snapshot without addresses (a client)
    many = normalize_snapshot(snapshot(maddrs=["/ip4/1.2.3.4/tcp/1"] * 20 + ["x" * 300]), now=1.0)["maddrs"]
    assert many == ["/ip4/1.2.3.4/tcp/1"] * 8
    # marks: pairs or dicts, bad ones dropped, the newest 8 steps kept in order
    raw_marks = [(i, f"{i:016x}") for i in range(12)] + [(99, "NOT HEX"), ("7", "ab" * 8), [5, "cd" * 8]]
    marks = normalize_snapshot(snapshot(theta_marks=raw_marks), now=1.0)["theta_marks"]
    assert [m["step"] for m in marks] == list(range(4, 12)) and marks[1] == {"step": 5, "digest": "cd" * 8}
    assert normalize_snapshot(snapshot(theta_marks="junk"), now=1.0)["theta_marks"] == []
    # exactly what the DHT's SchemaValidator accepts: parsing changes nothing
    assert PeerRecord.parse_obj(out).dict() == out
    # every field of the record is kept (a field the schema has and this drops makes the DHT refuse every record)
    assert set(out) == set(PeerRecord.__fields__)
    assert normalize_snapshot(snapshot(inner_step_s=0.25), now=1.0)["inner_step_s"] == 0.25
    # paused (node/pause.py): always sent, None while training; only the two reasons pass
    assert out["paused"] is None
    assert [normalize_snapshot(snapshot(paused=v), now=1.0)["paused"]
            for v in ("owner", "active_hours", "asleep", 1)] == ["owner", "active_hours", None, None]
    # the grid round in flight: None when in none, an int clamped to [0, MAX_COUNT] otherwise
    assert out["averaging_round"] is None
    assert [normalize_snapshot(snapshot(averaging_round=v), now=1.0)["averaging_round"]
            for v in (7, -3, float("nan"), "9")] == [7, 0, 0, 9]


def test_avoided_peers_are_bounded_and_old_records_still_validate():
    """A node's peer id -> why (stats.NodeStats.avoided_peers) becomes the record's list, bounded; a record
    from before the field (no ``avoided_peers``) still validates, with none."""
    old = snapshot()
    assert "avoided_peers" not in old and PeerRecord.parse_obj(old).avoided_peers == []
    assert normalize_snapshot(old, now=1.0)["avoided_peers"] == []
    many = {f"Qm{i}": f"its Δ was an outlier in 3 rounds in a row ({i})" for i in range(40)}
    out = normalize_snapshot(snapshot(avoided_peers={**many, "<bad id>": "x", "QmLong": "w" * 999}), now=1.0)
    kept = out["avoided_peers"]
    assert len(kept) == MAX_AVOIDED and kept[-1] == {"peer_id": "QmLong", "why": "w" * MAX_WHY}
    assert kept[0]["peer_id"] == f"Qm{40 - MAX_AVOIDED + 1}"  # the newest kept, in order
    assert PeerRecord.parse_obj(out).dict() == out
    # a record's own list (a reader re-normalizing) goes through unchanged; junk gives none
    assert normalize_snapshot(snapshot(avoided_peers=kept), now=1.0)["avoided_peers"] == kept
    assert normalize_snapshot(snapshot(avoided_peers="junk"), now=1.0)["avoided_peers"] == []


def test_record_key_persists_with_0600(tmp_path):
    k1 = record_key(tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / "record.key").st_mode)
    assert mode == 0o600
    k2 = record_key(tmp_path)
    assert k1.get_public_key().to_bytes() == k2.get_public_key().to_bytes()
    assert record_key(None).get_public_key().to_bytes() != k1.get_public_key().to_bytes()
    v1, v2 = record_validators(RUN, tmp_path)[0], record_validators(RUN, tmp_path)[0]
    assert v1.local_public_key == v2.local_public_key  # the record owner survives restarts


def fake_dht(get):
    """A stand-in for a DHT whose ``get`` answers at once (bounded calls ask for a future; dht/calls.py)."""
    from concurrent.futures import Future

    def get_future(key, latest=True, return_future=False):
        future = Future()
        try:
            future.set_result(get(key, latest=latest))
        except Exception as e:
            future.set_exception(e)
        return future

    return SimpleNamespace(get=get_future, is_alive=lambda: True)


def test_reader_survives_garbage_from_the_dht():
    class Item(SimpleNamespace):
        pass

    garbage = {
        b"a": Item(value={"peer_id": 5}, expiration_time=1.0),
        b"b": Item(value="not a dict", expiration_time=1.0),
        b"c": object(),  # no .value at all
        b"d": Item(value=snapshot(peer_id="Good"), expiration_time=2.0),
        b"e": Item(value=None, expiration_time=3.0),  # a tombstone
    }
    dht = fake_dht(lambda key, latest=True: SimpleNamespace(value=garbage, expiration_time=9.0))
    assert list(read_peer_records(dht, RUN)) == ["Good"]
    assert [e.record is None for e in read_peer_entries(dht, RUN)] == [False, True]
    for found in (None, SimpleNamespace(value=b"raw", expiration_time=1.0)):
        assert read_peer_records(fake_dht(lambda key, latest=True, f=found: f), RUN) == {}

    def broken(key, latest=True):
        raise RuntimeError("dht is down")

    assert read_peer_records(fake_dht(broken), RUN) == {}
    assert read_peer_entries(fake_dht(broken), RUN) is None
    gone = SimpleNamespace(get=broken, is_alive=lambda: False)  # the DHT process died
    assert read_peer_entries(gone, RUN) is None


# ------------------------------------------------------------------ real DHTs on 127.0.0.1
@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A (record owner, with a persisted key), B (a reader and would-be forger), C (no schema validator)."""
    va = record_validators(RUN, tmp_path_factory.mktemp("a"))
    vb = record_validators(RUN, None)
    dhts = []
    try:
        a = start(va)
        dhts.append(a)
        b = start(vb, addrs(a))
        dhts.append(b)
        # C runs without the schema validator: it would store anything locally and send it on.
        vc = [v for v in record_validators(RUN, None) if type(v).__name__ == "RSASignatureValidator"]
        c = start(vc, addrs(a))
        dhts.append(c)
        yield SimpleNamespace(a=a, b=b, c=c, va=va, vb=vb, vc=vc)
    finally:
        for d in dhts:
            d.shutdown()


@pytest.mark.timeout(90)
def test_publish_read_round_trip_and_remove(swarm):
    peer_a = swarm.a.peer_id.to_base58()
    snap = snapshot(peer_a, outer_step=1)
    pub = PeerRecordPublisher(swarm.a, RUN, swarm.va, lambda: snap, interval_s=2.0)  # records live 3 × 2 s
    try:
        pub.start()
        got = wait_for(lambda: read_peer_records(swarm.b, RUN).get(peer_a))
        assert got is not None and got.name == "alice" and got.outer_step == 1 and got.loss == 2.5
        assert [(m.step, m.digest) for m in got.theta_marks] == [(2, "00ff00ff00ff00ff"), (3, "0123456789abcdef")]
        # the thread keeps it fresh; publish_now pushes a change at once
        snap["outer_step"] = 2
        assert pub.publish_now() is True
        assert read_peer_records(swarm.b, RUN)[peer_a].outer_step == 2
        time.sleep(6.5)  # longer than the 6 s expiration: only the refresh thread keeps it alive
        assert peer_a in read_peer_records(swarm.b, RUN)
        assert pub.published >= 3
    finally:
        pub.stop(remove=True)
    assert peer_a not in read_peer_records(swarm.b, RUN)
    assert peer_a not in read_peer_records(swarm.a, RUN)
    entries = read_peer_entries(swarm.b, RUN)
    assert [e.record for e in entries if e.owner == pub.owner] == [None]  # the goodbye tombstone
    assert pub.publish_now() is False  # stopped: never resurrects the record


@pytest.mark.timeout(90)
def test_a_restart_knows_its_own_live_record_and_does_not_wait(swarm, tmp_path):
    """A node restarted right after a crash finds its old record still live: the state dir's note of
    the last record it published says it is its own, so start() does not wait to watch it; a record
    newer than the note (a copy of the state dir publishing elsewhere) is watched as before."""
    peer_a = swarm.a.peer_id.to_base58()
    note = tmp_path / "record.updated"
    crashed = PeerRecordPublisher(swarm.a, RUN, swarm.va, lambda: snapshot(peer_a), interval_s=2.0, updated_path=note)
    crashed.start()
    wait_for(lambda: read_peer_records(swarm.b, RUN).get(peer_a))
    crashed.stop(remove=False)  # what a crash leaves: the record lives on for its TTL
    assert last_published(note, RUN) == read_peer_records(swarm.b, RUN)[peer_a].updated
    assert last_published(note, "another-run") is None and last_published(tmp_path / "none", RUN) is None
    restarted = PeerRecordPublisher(swarm.a, RUN, swarm.va, lambda: snapshot(peer_a), interval_s=2.0, updated_path=note)
    t0 = time.monotonic()
    try:
        restarted.start()
        assert time.monotonic() - t0 < 2.0  # no interval_s + 2 s wait
    finally:
        restarted.stop(remove=False)
    stale = tmp_path / "stale.updated"
    stale.write_text(json.dumps({"run_id": RUN, "updated": last_published(note, RUN) - 60}))
    t0 = time.monotonic()
    assert not identity_in_use(swarm.b, RUN, peer_a, wait_s=2.5, ours_until=last_published(stale, RUN))
    assert time.monotonic() - t0 >= 2.5  # not provably ours: watched (nobody re-signs it, so not in use)


@pytest.mark.timeout(90)
def test_signed_record_cannot_be_overwritten_by_another_peer(swarm):
    peer_a = swarm.a.peer_id.to_base58()
    pub = PeerRecordPublisher(swarm.a, RUN, swarm.va, lambda: snapshot(peer_a, name="alice"), interval_s=30.0)
    try:
        assert pub.publish_now()
        owner_key = swarm.va[0].local_public_key
        forged = normalize_snapshot(snapshot(peer_a, name="mallory", outer_step=999))
        far = get_dht_time() + 600  # a later expiration would win, if the store were accepted
        # B's validator cannot sign for A's key: the value goes out unsigned and is refused everywhere.
        assert swarm.b.store(records_key(RUN), forged, expiration_time=far, subkey=owner_key) is False
        # C even tries from a node without the schema validator.
        assert swarm.c.store(records_key(RUN), forged, expiration_time=far, subkey=owner_key) is False
        for reader in (swarm.a, swarm.b):
            rec = read_peer_records(reader, RUN)[peer_a]
            assert rec.name == "alice" and rec.outer_step == 3
    finally:
        pub.stop(remove=True)


@pytest.mark.timeout(90)
def test_malformed_records_are_rejected_and_never_crash_readers(swarm):
    expiration = get_dht_time() + 30
    own_b = swarm.vb[0].local_public_key
    key = records_key(RUN)
    # Wrong types under B's own (validly signed) subkey, a plain value instead of the dictionary:
    # honest nodes refuse them (C, without the schema validator, may keep them: readers must cope).
    bad_values = [({**snapshot("PeerB"), "outer_step": "many"}, own_b), ({**snapshot("PeerB"), "tokens_per_s": 5}, own_b),
                  ({**snapshot("PeerB"), "name": "x" * 1000}, own_b),
                  ({**snapshot("PeerB"), "maddrs": ["/ip4/10.0.0.1/tcp/1"] * 1000}, own_b),
                  ({**snapshot("PeerB"), "theta_marks": [{"step": 1, "digest": "ab" * 8}] * 1000}, own_b), (123, None)]
    for value, subkey in bad_values:
        swarm.b.store(key, value, expiration_time=expiration, subkey=subkey)
    for reader in (swarm.a, swarm.b):
        assert not [e for e in read_peer_entries(reader, RUN) if e.owner == owner_fingerprint(own_b)]
    # C's own storage takes a bad record under C's key; every reader still ignores it
    own_c = swarm.vc[0].local_public_key
    swarm.c.store(key, {"peer_id": ["x"], "name": 7}, expiration_time=expiration, subkey=own_c)
    good = PeerRecordPublisher(swarm.b, RUN, swarm.vb, lambda: snapshot("PeerB"), interval_s=30.0)
    try:
        assert good.publish_now()
        for reader in (swarm.a, swarm.b, swarm.c):
            recs = read_peer_records(reader, RUN)
            assert "PeerB" in recs
            assert all(isinstance(r, PeerRecord) for r in recs.values())
    finally:
        good.stop(remove=True)
