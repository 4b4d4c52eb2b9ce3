"""The contribution ledger (diloco_swarm.dht.ledger): rows, shares, confirmed against claimed, the
record fields it reads and their bounds, and what a node counts and keeps in its checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diloco_swarm.dht.ledger import LAG_ROUNDS, leaderboard, witnessed
from diloco_swarm.dht.records import MAX_PARTNERS, PeerRecord, normalize_snapshot
from diloco_swarm.node.checkpoint import load_checkpoint, save_checkpoint
from diloco_swarm.node.stats import NodeStats


def record(peer_id: str, name: str = "", tokens: int = 0, rounds: int = 0, with_=(), **over) -> dict:
    """A valid record (PeerRecord's dict) of ``peer_id``; ``with_``: (partner, rounds, tokens) triples."""
    base = dict(peer_id=peer_id, name=name, version="0.1.0", device="cpu", precision="fp32", reachability="public",
                outer_step=rounds, tokens_per_s=1.0, loss=2.0, eval_loss=None, tokens_total=tokens, bytes_sent=1,
                bytes_received=1, last_round_group_size=3, last_round_s=0.5, last_round_ok=True, failed_rounds=0,
                goodput=0.5, uptime_s=60.0, updated=1.0, verified_rounds=rounds, verified_tokens=tokens,
                rounds_with=[{"peer_id": p, "rounds": r, "tokens": t} for p, r, t in with_])
    base.update(over)
    return PeerRecord.parse_obj(base).dict()


def three_honest(rounds: int = 5, per_round: int = 100) -> dict[str, dict]:
    """Peers a, b, c that averaged together ``rounds`` times, each ``per_round`` tokens a round."""
    ids = ("QmA", "QmB", "QmC")
    return {p: record(p, p[-1].lower(), tokens=rounds * per_round, rounds=rounds,
                      with_=[(q, rounds, rounds * per_round) for q in ids if q != p]) for p in ids}


def test_honest_peers_are_confirmed_and_share_the_tokens():
    rows = leaderboard(three_honest())
    assert [r["name"] for r in rows] == ["a", "b", "c"]
    for r in rows:
        assert (r["tokens"], r["confirmed_tokens"], r["verified_rounds"], r["confirmed_rounds"]) == (500, 500, 5, 5)
        assert r["witnesses"] == 2 and not r["self_reported"] and r["why"] == ""
        assert r["share"] == pytest.approx(1 / 3) and r["confirmed_share"] == pytest.approx(1 / 3)
        assert r["uptime_s"] == 60.0 and r["first_hand"] is False


def test_claims_beyond_the_witnesses_are_self_reported_and_lag_is_forgiven():
    records = three_honest()
    # c's record ran one round ahead of its partners' (published first): within the lag
    records["QmC"] = record("QmC", "c", tokens=600, rounds=6, with_=[("QmA", 6, 600), ("QmB", 6, 600)])
    # b claims 10x its tokens and 20 more rounds: its partners' records hold 500 + 600 and 5 + 6
    records["QmB"] = record("QmB", "b", tokens=5000, rounds=5 + LAG_ROUNDS + 20, with_=[("QmA", 5, 500), ("QmC", 5, 500)])
    rows = {r["name"]: r for r in leaderboard(records, first_hand={"QmA"})}
    assert not rows["c"]["self_reported"] and rows["c"]["confirmed_rounds"] == 5
    assert rows["b"]["self_reported"] and "5000 tokens in verified rounds" in rows["b"]["why"]
    assert "27 verified rounds" in rows["b"]["why"]
    assert rows["b"]["confirmed_tokens"] == 600 and rows["b"]["confirmed_rounds"] == 6  # c's record: the largest
    assert rows["b"]["share"] == pytest.approx(5000 / 6100)  # claimed tokens: the boast shows in `share`
    assert rows["b"]["confirmed_share"] == pytest.approx(600 / 1600)  # ... not in the confirmed share (a: 500, c: 500)
    assert rows["a"]["first_hand"] and not rows["b"]["first_hand"]
    # the tokens alone (rounds honest) are flagged too: more than LAG_ROUNDS rounds' worth beyond all that a's and
    # c's records hold for b (500 + 600)
    records["QmB"] = record("QmB", "b", tokens=1100 + (LAG_ROUNDS + 1) * 100, rounds=5, with_=[("QmA", 5, 500)])
    assert {r["name"]: r for r in leaderboard(records)}["b"]["self_reported"]
    # ... but not tokens nobody could see: a night of solo rounds while the others were paused
    records["QmB"] = record("QmB", "b", tokens=50_000, rounds=5, verified_tokens=500, with_=[("QmA", 5, 500)])
    b = {r["name"]: r for r in leaderboard(records)}["b"]
    assert not b["self_reported"] and b["tokens"] == 50_000 and b["verified_tokens"] == 500


def test_a_record_is_one_witness_however_often_it_lists_a_peer():
    honest = three_honest()
    entries = [{"peer_id": "QmX", "rounds": 9, "tokens": 900}] * 2
    with pytest.raises(ValueError, match="lists a partner twice"):
        PeerRecord.parse_obj({**honest["QmA"], "rounds_with": entries})
    forged = {**honest["QmA"], "rounds_with": entries * 16}  # (a row from a reader that skipped the schema)
    w = witnessed([forged])["QmX"]
    assert (w.rounds, w.tokens, w.rounds_sum, w.tokens_sum, w.records) == (9, 900, 9, 900, 1)
    assert normalize_snapshot({"peer_id": "QmA", "rounds_with": {"QmX": (9, 900)}})["rounds_with"] == entries[:1]


def test_a_peer_nobody_saw_is_self_reported_and_vouching_for_oneself_counts_for_nothing():
    loner = record("QmL", "", tokens=900, rounds=9, with_=[("QmL", 9, 900)])
    rows = leaderboard({"QmL": loner})
    assert rows[0]["name"] == "QmL" and rows[0]["confirmed_rounds"] == 0 and rows[0]["self_reported"]
    assert rows[0]["share"] == 1.0 and rows[0]["confirmed_share"] is None
    assert witnessed([loner]) == {}
    assert leaderboard({}) == [] and leaderboard([record("QmZ")])[0]["self_reported"] is False  # nothing claimed


def test_the_confirmed_count_is_the_largest_witness_count():
    """Groups smaller than the swarm: each partner saw part of a peer's rounds; the largest is kept."""
    x = record("QmX", "x", tokens=800, rounds=8)
    y = record("QmY", "y", with_=[("QmX", 3, 300)])
    z = record("QmZ", "z", with_=[("QmX", 5, 500)])
    row = {r["name"]: r for r in leaderboard([x, y, z])}["x"]
    assert (row["confirmed_rounds"], row["confirmed_tokens"], row["witnesses"]) == (5, 500, 2)
    # 8 claimed, 5 certain: churn or a grid's groups, not a boast, while the sum (3 + 5) holds the claim
    assert not row["self_reported"]
    x = record("QmX", "x", tokens=1100, rounds=11)  # 11 > 3 + 5 + LAG_ROUNDS: more than anyone saw
    assert {r["name"]: r for r in leaderboard([x, y, z])}["x"]["self_reported"]


def test_the_record_fields_are_bounded_and_old_records_still_parse():
    old = record("QmOld")
    del old["verified_rounds"], old["rounds_with"]
    parsed = PeerRecord.parse_obj(old)
    assert parsed.verified_rounds == 0 and parsed.rounds_with == []
    entries = [{"peer_id": f"Qm{i}", "rounds": 1, "tokens": 1} for i in range(MAX_PARTNERS + 1)]
    bad = [{"rounds_with": entries},  # one partner too many: the DHT's schema refuses the record
           {"rounds_with": [{"peer_id": "<script>", "rounds": 1, "tokens": 1}]},
           {"rounds_with": [{"peer_id": "QmX", "rounds": -1, "tokens": 1}]},
           {"rounds_with": [{"peer_id": "QmX", "rounds": 1.0, "tokens": 1}]},
           {"rounds_with": [{"peer_id": "QmX", "rounds": 1}]},
           {"rounds_with": {"QmX": [1, 1]}},
           {"verified_rounds": 10**19}, {"verified_rounds": 1.0}]
    for over in bad:
        with pytest.raises(ValueError):
            PeerRecord.parse_obj({**old, **over})
    # a snapshot's peer id -> (rounds, tokens), oldest first: bad ids dropped, counts clamped, the newest kept
    raw = {**{f"Qm{i}": (i, 10 * i) for i in range(40)}, "<bad>": (1, 1), "QmNeg": (-4, float("nan"))}
    out = normalize_snapshot({"peer_id": "QmMe", "rounds_with": raw, "verified_rounds": 7.0}, now=1.0)
    assert len(out["rounds_with"]) == MAX_PARTNERS and out["rounds_with"][-1] == {"peer_id": "QmNeg", "rounds": 0, "tokens": 0}
    assert out["rounds_with"][0]["peer_id"] == f"Qm{40 - MAX_PARTNERS + 1}" and out["verified_rounds"] == 7
    assert PeerRecord.parse_obj(out).dict() == out


def test_a_node_counts_verified_rounds_its_partners_and_keeps_them_in_its_checkpoint(tmp_path):
    stats = NodeStats()

    def result(ok: bool, group: list[str], weights: dict[str, float]):
        return SimpleNamespace(ok=ok, group_size=len(group), group_peer_ids=group, gathered={
            p: {"weight": w} for p, w in weights.items()}, bytes_sent=0, bytes_received=0, seconds=0.0, reason="",
            avoided_peers=None)

    stats.count_round(result(True, ["QmMe", "QmA", "QmB"], {"QmA": 100.0, "QmB": float("nan")}), me="QmMe")
    stats.count_round(result(False, ["QmMe", "QmA"], {"QmA": 100.0}), me="QmMe")  # failed: not counted
    stats.count_round(result(True, ["QmMe", "QmA"], {"QmA": 50.0}), me="QmMe")
    assert stats.verified_rounds == 2 and list(stats.rounds_with.items()) == [("QmB", (1, 0)), ("QmA", (2, 150))]
    for i in range(MAX_PARTNERS + 5):
        stats.count_partners(["QmMe", f"QmP{i}"], {}, "QmMe")
    assert len(stats.rounds_with) == MAX_PARTNERS and "QmA" not in stats.rounds_with  # the oldest partners go
    record_fields = normalize_snapshot({"peer_id": "QmMe", **stats.peer_record()}, now=1.0)
    assert record_fields["verified_rounds"] == MAX_PARTNERS + 7 and len(record_fields["rounds_with"]) == MAX_PARTNERS
    stats.leaderboard = leaderboard(three_honest(), first_hand={"QmA"})
    save_checkpoint(tmp_path, {"ledger": stats.ledger_state()})  # weights_only: plain data only
    restored = NodeStats()
    restored.load_ledger(load_checkpoint(tmp_path / "checkpoint.pt")["ledger"])
    assert restored.verified_rounds == stats.verified_rounds and restored.rounds_with == stats.rounds_with
    assert restored.leaderboard == stats.leaderboard
    restored.load_ledger(None)  # a checkpoint from before the ledger: nothing changes
    assert restored.verified_rounds == stats.verified_rounds
    restored.load_ledger({"verified_rounds": "x", "rounds_with": [["QmA", -1, 2], "junk"], "leaderboard": 3})
    assert restored.verified_rounds == stats.verified_rounds and restored.rounds_with == {} and restored.leaderboard == []


def test_a_round_counts_each_members_tokens_as_the_reducers_weigh_them():
    """A member that gathers 10⁶ tokens beside three of about 100 is witnessed at 4× their median
    (``robust.WEIGHT_CAP``), what the group's average gave it; a group of two is weighed as claimed (as the
    reducers do: no rule tells two apart)."""
    from diloco_swarm.averaging.robust import WEIGHT_CAP
    from diloco_swarm.node.stats import counted_tokens

    gathered = {"QmA": {"weight": 100.0}, "QmB": {"weight": 120.0}, "QmC": {"weight": 90.0}, "QmX": {"weight": 1e6}}
    group = ["QmA", "QmB", "QmC", "QmX"]
    assert counted_tokens(group, gathered) == {"QmA": 100, "QmB": 120, "QmC": 90, "QmX": int(WEIGHT_CAP * 100)}
    stats = NodeStats()
    stats.count_partners(group, gathered, "QmA")
    assert stats.rounds_with["QmX"] == (1, 400) and stats.verified_tokens == 100
    assert counted_tokens(["QmA", "QmX"], gathered) == {"QmA": 100, "QmX": 1_000_000}
    bad = {"QmA": {"weight": "x"}, "QmB": {"weight": -5.0}, "QmC": None, "QmX": {"weight": True}}
    assert counted_tokens(group, bad) == {p: 0 for p in group}


def test_in_groups_larger_than_a_record_lists_honest_peers_stay_witnessed():
    """40 honest peers average in one group for 60 rounds, hivemind's order shuffled each round: a record lists
    32 partners, yet every peer is witnessed by most of the others and nobody is flagged self-reported."""
    import random

    ids = [f"QmP{i:02d}" for i in range(40)]
    stats = {p: NodeStats() for p in ids}
    rng = random.Random(7)
    for _ in range(60):
        group = rng.sample(ids, len(ids))
        for p in ids:
            stats[p].count_partners(group, {q: {"weight": 100.0} for q in ids}, p)
    records = {p: record(p, tokens=s.verified_tokens, rounds=s.verified_rounds,
                         with_=[(q, r, t) for q, (r, t) in s.rounds_with.items()]) for p, s in stats.items()}
    rows = leaderboard(records)
    assert all(len(s.rounds_with) == MAX_PARTNERS for s in stats.values())
    assert not [r["peer_id"] for r in rows if r["self_reported"]]
    assert min(r["witnesses"] for r in rows) >= 20 and all(r["confirmed_rounds"] == 60 for r in rows)


def test_the_dhts_schema_validator_refuses_a_record_with_too_many_partners():
    """What every DHT node runs on a stored record (hivemind's SchemaValidator over PeerRecordsSchema):
    a record with the ledger's fields passes, one with a 33rd partner does not."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord

    from diloco_swarm.dht.records import PeerRecordsSchema, records_key

    validator = SchemaValidator(PeerRecordsSchema, allow_extra_keys=True, prefix="ledger")
    dumps = DHTProtocol.serializer.dumps

    def accepted(value: dict) -> bool:
        return validator.validate(DHTRecord(key=DHTID.generate(source=records_key("ledger")).to_bytes(),
                                            subkey=dumps(b"[owner:ssh-rsa AAAAB3Nza]"), value=dumps(value),
                                            expiration_time=0.0))

    good = record("QmMe", with_=[(f"Qm{i}", 1, 10) for i in range(MAX_PARTNERS)])
    assert accepted(good)
    assert not accepted({**good, "rounds_with": good["rounds_with"] + [{"peer_id": "QmMore", "rounds": 1, "tokens": 1}]})
    assert not accepted({**good, "verified_rounds": 3.0})  # a conversion: strict types only


def test_the_held_out_curve_is_kept_for_the_model_card_without_a_metrics_file():
    from diloco_swarm.node.model_card import merged_curve
    from diloco_swarm.node.stats import MAX_EVAL_POINTS

    stats = NodeStats()
    for step in range(3 * MAX_EVAL_POINTS):
        stats.note_eval(step, 10.0 - step / 1000)
    stats.note_eval(7, float("nan"))  # (not a measurement: left out of the curve)
    curve = stats.eval_curve
    assert len(curve) <= MAX_EVAL_POINTS and curve[0] == [0, 10.0] and curve[-1][0] == 3 * MAX_EVAL_POINTS - 1
    assert [p[0] for p in curve] == sorted({p[0] for p in curve})
    restored = NodeStats()
    restored.load_eval_curve(curve)
    assert restored.eval_curve == curve
    restored.load_eval_curve([[1, "x"]])
    assert restored.eval_curve == []
    # the metrics file's values win where both have a step; the checkpoint fills the rest
    assert merged_curve([[0, 5.0], [2, 4.0]], [(2, 3.5), (4, 3.0)]) == [(0, 5.0), (2, 3.5), (4, 3.0)]


def test_a_node_remembers_the_peers_that_left_and_their_evidence():
    """The model card is the exporting node's view: peers that left stay in it, and their records still
    back the rounds of the peers they averaged with (honest churn: partners came and went)."""
    from diloco_swarm.dht.ledger import keep_records

    a = record("QmA", "alice", tokens=9700, rounds=97, with_=[("QmB", 43, 4300), ("QmC", 55, 5500)])
    b = record("QmB", "bob", tokens=4300, rounds=43, with_=[("QmA", 43, 4300)])
    c = record("QmC", "carol", tokens=5500, rounds=55, with_=[("QmA", 55, 5500)], updated=2.0)
    kept = keep_records({}, [a, b, c])
    kept = keep_records(kept, [a])  # bob and carol left: their records are gone from the DHT
    rows = {r["name"]: r for r in leaderboard(kept)}
    assert set(rows) == {"alice", "bob", "carol"}
    assert not rows["alice"]["self_reported"] and rows["alice"]["confirmed_rounds"] == 55  # 43 + 55 hold her 97
    stats = NodeStats()
    stats.ledger_records = kept
    restored = NodeStats()
    restored.load_ledger(stats.ledger_state())
    assert restored.ledger_records == kept
