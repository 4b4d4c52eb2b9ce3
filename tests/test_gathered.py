"""The one parse of a group's gathered bytes (``request.gathered_entries``) and its readers, on what
honest members send and on what a hostile one could: every byte came from another peer."""

from __future__ import annotations

import math

from hivemind.utils.serializer import MSGPackSerializer

from diloco_swarm.averaging.bandwidth import RECEIVE_CAP_KEY, gathered_caps
from diloco_swarm.averaging.grouping import gathered_weight
from diloco_swarm.averaging.request import GatheredEntry, gathered_entries, gathered_weights

dumps, loads = MSGPackSerializer.dumps, MSGPackSerializer.loads


def _entry(meta, bandwidth=100.0, mode=0) -> bytes:
    """A member's gathered bytes as hivemind's averager builds them: (bandwidth, mode, metadata bytes)."""
    return dumps([bandwidth, mode, dumps(meta)])


def test_honest_entries_give_each_members_weight_and_caps_in_the_groups_order():
    gathered = [_entry({"weight": 512, RECEIVE_CAP_KEY: 40.0}), _entry({"weight": 256.5}, bandwidth=8.0)]
    entries = gathered_entries(gathered, loads)
    assert [e.meta["weight"] for e in entries] == [512, 256.5]
    assert gathered_weights(entries) == [512.0, 256.5]
    assert gathered_caps(entries) == ([100.0, 8.0], [40.0, None])


def test_an_entry_that_does_not_decode_is_none_and_costs_only_its_own_member():
    bad = [b"\xc1not msgpack", dumps(7), dumps([1.0, 0]), dumps([1.0, 0, b"\xc1"]), dumps("abc")]
    gathered = [_entry({"weight": 3})] + bad
    entries = gathered_entries(gathered, loads)
    assert isinstance(entries[0], GatheredEntry) and entries[1:] == [None] * len(bad)
    assert gathered_weights(entries) == [3.0] + [None] * len(bad)
    bandwidths, caps = gathered_caps(entries)
    assert bandwidths == [100.0] + [None] * len(bad) and caps == [None] * len(gathered)


def test_metadata_that_is_no_dict_reads_as_empty_and_extra_fields_hide_the_caps():
    entries = gathered_entries([_entry([1, 2, 3]), dumps([5.0, 0, dumps({"weight": 2, RECEIVE_CAP_KEY: 1.0}), "x"])],
                               loads)
    assert entries[0].meta == {} and gathered_weight(entries[0].meta) is None
    assert entries[1].meta["weight"] == 2  # read by the weight check and the group's judgement alike,
    assert gathered_caps(entries) == ([100.0, None], [None, None])  # but not as hivemind's three fields


def test_only_a_finite_non_bool_number_is_a_weight():
    for weight in (True, False, math.nan, math.inf, -math.inf, "512", None, [1], {"w": 1}):
        assert gathered_weight({"weight": weight}) is None, weight
    assert gathered_weight({}) is None and gathered_weight(None) is None and gathered_weight([("weight", 1)]) is None
    assert gathered_weight({"weight": 7}) == 7.0 and isinstance(gathered_weight({"weight": 7}), float)
    assert gathered_weight({"weight": -1.5}) == -1.5  # a sign is the readers' to judge (counted_tokens keeps > 0)
