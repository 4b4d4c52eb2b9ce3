"""Who a private run admits (rule 58): the averager's :class:`Admission` and the readers' refusals.

Real Ed25519 invitations and passes (invites.py) over records as the DHT hands them back; the swarm
side (services refusing a stranger between real nodes) is tests/test_private_run.py.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from diloco_swarm.averaging import admission as admission_module
from diloco_swarm.averaging.admission import Admission
from diloco_swarm.cli.status import collect_rows
from diloco_swarm.dashboard.state import SwarmState
from diloco_swarm.dht.records import normalize_snapshot, owner_digest, peer_entries, records_key
from diloco_swarm.invites import make_invitation, organiser_key, public_key_text

RUN = "private-run"
OWNER = b"[owner:ssh-rsa AAAA%d]"


def owned(i: int) -> str:
    """The owner digest a pass in the record under subkey ``OWNER % i`` is bound to."""
    return owner_digest(OWNER % i)


@pytest.fixture
def organiser(tmp_path):
    key = organiser_key(tmp_path, create=True)
    return key, public_key_text(key)


def record(peer_id: str, admission=None) -> dict:
    snap = dict(peer_id=peer_id, name=peer_id[:6], version="0.1", device="cpu", precision="fp32",
                reachability="public", outer_step=1, tokens_per_s=1.0, loss=2.0, tokens_total=10, goodput=0.5,
                uptime_s=1.0, admission=admission)
    return normalize_snapshot(snap)


def dht_value(*records: dict) -> SimpleNamespace:
    """What hivemind's ``DHT.get(records_key, latest=True)`` gives back: subkey -> item."""
    return SimpleNamespace(value={OWNER % i: SimpleNamespace(value=r, expiration_time=time.time() + 15)
                                  for i, r in enumerate(records)})


class Reads:
    """The averager's read of the records key, counted; ``now`` holds what the DHT has."""

    def __init__(self, *records: dict):
        self.now, self.count = dht_value(*records), 0

    async def __call__(self, key: str):
        assert key == records_key(RUN)
        self.count += 1
        return self.now


def test_a_public_run_admits_everyone_without_reading_anything():
    reads = Reads()
    gate = Admission(reads, RUN, None)
    assert asyncio.run(gate.admits("QmAnyone")) and reads.count == 0


def test_only_a_peer_whose_record_shows_a_pass_for_its_own_id_is_admitted(organiser, monkeypatch):
    key, org = organiser
    invitation = make_invitation(key, RUN, time.time() + 3600)
    volunteer_pass = invitation.admission_pass("QmVolunteer", owned(0))
    reads = Reads(record("QmVolunteer", volunteer_pass),
                  record("QmStranger", volunteer_pass),  # copied out of the volunteer's record
                  record("QmNobody"))
    gate = Admission(reads, RUN, org)

    async def check():
        assert await gate.admits("QmVolunteer")
        assert not await gate.admits("QmStranger")
        assert not await gate.admits("QmNobody")
        assert reads.count == 1  # the misses within REFRESH_MIN_S read nothing again: a stranger cannot flood the DHT
        # a joiner's record appears later: admitted at the next read allowed
        monkeypatch.setattr(admission_module, "REFRESH_MIN_S", 0.0)
        reads.now = dht_value(record("QmVolunteer", volunteer_pass),
                              record("QmJoiner", invitation.admission_pass("QmJoiner", owned(1))))
        assert await gate.admits("QmJoiner") and reads.count == 2
        assert await gate.admits("QmVolunteer") and reads.count == 2  # known: no read

    asyncio.run(check())


def test_a_pass_shown_with_a_request_admits_only_its_own_peer_id_and_only_until_it_expires(organiser, tmp_path):
    key, org = organiser
    gate = Admission(Reads(), RUN, org)
    fresh = make_invitation(key, RUN, time.time() + 3600)
    expired = make_invitation(key, RUN, time.time() - 1)
    other_run = make_invitation(key, "another-run", time.time() + 3600)
    stranger_key = organiser_key(tmp_path / "stranger", create=True)
    forged = make_invitation(stranger_key, RUN, time.time() + 3600)

    def shown(invitation, peer):  # what OurPass.shown sends with a dial-back request
        return {**invitation.admission_pass(peer, owned(0)), "owner": owned(0)}

    async def check():
        assert not await gate.admits("QmB", shown=shown(fresh, "QmA"))  # another peer's pass
        assert not await gate.admits("QmC", shown=shown(expired, "QmC"))
        assert not await gate.admits("QmD", shown=shown(other_run, "QmD"))
        assert not await gate.admits("QmE", shown=shown(forged, "QmE"))  # not the organiser's grant
        assert not await gate.admits("QmF", shown={"key": 5, "expires": "soon"})  # garbage never raises
        assert not await gate.admits("QmA", shown={**shown(fresh, "QmA"), "owner": owned(1)})  # another owner's
        assert await gate.admits("QmA", shown=shown(fresh, "QmA"))
        assert await gate.admits("QmA")  # remembered until it expires

    asyncio.run(check())


def test_a_dht_that_fails_or_hangs_refuses_in_bounded_time(organiser, monkeypatch):
    _, org = organiser
    monkeypatch.setattr(admission_module, "READ_TIMEOUT_S", 0.2)

    async def hang(key):
        await asyncio.sleep(60)

    async def broken(key):
        raise RuntimeError("DHT gone")

    async def check():
        for read in (hang, broken):
            started = time.monotonic()
            assert not await Admission(read, RUN, org).admits("QmX")
            assert time.monotonic() - started < 2.0

    asyncio.run(check())


def test_readers_drop_the_records_of_uninvited_peers_and_count_them(organiser):
    key, org = organiser
    invitation = make_invitation(key, RUN, time.time() + 3600)
    volunteer_pass = invitation.admission_pass("QmVolunteer", owned(0))
    impostor = record("QmVolunteer", volunteer_pass)
    impostor["outer_step"], impostor["updated"] = 999, impostor["updated"] + 1  # newer: it would win the peer id
    items = [(OWNER % 0, record("QmVolunteer", volunteer_pass), 9.0),
             (OWNER % 1, record("QmStranger", volunteer_pass), 9.0),  # the pass, copied under its own peer id
             (OWNER % 2, impostor, 9.0),  # ... and in a record of its own that claims the volunteer's peer id
             (OWNER % 3, None, 9.0)]  # a goodbye tombstone stays one
    entries = peer_entries(RUN, items, organiser=org)
    assert [(e.record.peer_id, e.record.outer_step) for e in entries if e.record] == [("QmVolunteer", 1)]
    refused = [e.refused for e in entries if e.refused]
    assert len(refused) == 2 and all("not for its peer id and record" in why for why in refused), refused
    assert [e.record.peer_id for e in peer_entries(RUN, items) if e.record] == ["QmVolunteer", "QmStranger",
                                                                                "QmVolunteer"]

    rows, why = collect_rows(lambda: entries, attempts=1)  # status
    assert [(r["peer_id"], r["outer_step"]) for r in rows] == [("QmVolunteer", 1)] and len(why) == 2
    state = SwarmState(RUN)  # the dashboard
    state.update(entries)
    doc = state.snapshot()
    assert doc["totals"]["refused"] == 2 and [p["peer_id"] for p in doc["peers"]] == ["QmVolunteer"]
    from diloco_swarm.dashboard.render import render_page
    assert 'id="total-refused"' in render_page(doc)
