"""Tests for diloco_swarm.spec: RunSpec validation, its hash, and mismatch messages."""

import math

import pytest
from pydantic import ValidationError

from diloco_swarm.spec import PROTOCOL_VERSION, RunSpec, SpecMismatch, parse_published_spec

BASE = dict(
    run_id="my-run_1",
    model="tiny",
    dataset="python-stdlib",
    seq_len=256,
    inner_steps=500,
    inner_lr=1e-3,
    outer_lr=0.7,
    outer_momentum=0.9,
    seed=0,
)
# a different, valid value for every field of the spec
OTHER = dict(
    run_id="other-run",
    protocol_version=PROTOCOL_VERSION + 1,
    model="small",
    dataset="files:3:1000:abcdef12",
    tokenizer="sha256:0123456789abcdef",
    vocab_size=32000,
    seq_len=128,
    inner_steps=50,
    inner_lr=3e-4,
    outer_lr=0.5,
    outer_momentum=0.0,
    compression="fp16",
    seed=1,
    sync_mode="blocking",
    organiser="ed25519:" + "A" * 43,
)


def spec(**changes):
    return RunSpec(**{**BASE, **changes})


def test_every_field_has_a_variant_in_this_test():
    assert set(OTHER) == set(RunSpec.model_fields)


def test_defaults():
    s = spec()
    assert s.protocol_version == PROTOCOL_VERSION and s.compression == "int8" and s.sync_mode == "overlap"


@pytest.mark.parametrize(
    "run_id", ["", "has space", "semi;colon", "slash/x", "dot.x", "-leading-dash", "_leading", "ü", "a" * 65, "a\n"]
)
def test_bad_run_ids_are_refused(run_id):
    with pytest.raises(ValidationError) as info:
        spec(run_id=run_id)
    assert info.value.errors()[0]["loc"] == ("run_id",)


@pytest.mark.parametrize("run_id", ["a", "A1", "run-2024_01", "9lives", "a" * 64])
def test_good_run_ids_are_accepted(run_id):
    assert spec(run_id=run_id).run_id == run_id


@pytest.mark.parametrize(
    "field,value",
    [
        ("inner_lr", -1e-3),
        ("inner_lr", 0.0),
        ("outer_lr", -0.7),
        ("outer_lr", 0.0),
        ("inner_lr", math.inf),
        ("outer_lr", math.nan),
        ("outer_momentum", -0.1),
        ("outer_momentum", 1.0),
        ("outer_momentum", math.nan),
        ("seq_len", 0),
        ("inner_steps", 0),
        ("inner_steps", -5),
        ("seed", -1),
    ],
)
def test_bad_numbers_are_refused(field, value):
    with pytest.raises(ValidationError) as info:
        spec(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)


def test_unknown_fields_are_refused_and_the_spec_is_frozen():
    with pytest.raises(ValidationError):
        spec(batch_size=16)  # a local knob, not part of the spec
    s = spec()
    with pytest.raises(ValidationError):
        s.inner_steps = 7


# --- the hash ---------------------------------------------------------------------------


def test_spec_hash_is_stable():
    h = spec().spec_hash()
    assert h == spec().spec_hash() == RunSpec.model_validate(spec().model_dump()).spec_hash()
    assert len(h) == 16 and int(h, 16) >= 0
    # field order does not matter
    assert RunSpec(**dict(reversed(list(BASE.items())))).spec_hash() == h


def test_spec_hash_is_pinned():
    """Peers of different versions compare this hash: if it changes (a new field, another
    encoding), old and new nodes stop agreeing. Update the value only on purpose."""
    assert spec().spec_hash() == "24acb3db9dc67390"  # protocol 7: issue 39's paused peers and ledger (on purpose)


def test_a_public_run_leaves_the_organiser_out():
    """None (a public run) is not serialized: its hash moves with the protocol version alone."""
    assert "organiser" not in spec().model_dump()
    assert spec(organiser=None).spec_hash() == spec().spec_hash()
    private = spec(organiser=OTHER["organiser"])
    assert private.model_dump()["organiser"] == OTHER["organiser"]
    assert RunSpec.model_validate(private.model_dump()) == private


@pytest.mark.parametrize("organiser", ["", "ed25519:", "ed25519:" + "A" * 42, "ed25519:" + "A" * 44,
                                       "ed25519:" + "A" * 42 + "=", "rsa:" + "A" * 43, "ed25519:" + "A" * 42 + "!",
                                       "ed25519:" + "A" * 43 + "\n"])
def test_malformed_organiser_keys_are_refused(organiser):
    with pytest.raises(ValidationError):
        spec(organiser=organiser)


@pytest.mark.parametrize("field", sorted(OTHER))
def test_spec_hash_changes_with_each_field(field):
    assert spec(**{field: OTHER[field]}).spec_hash() != spec().spec_hash()


def test_spec_hash_distinguishes_close_floats():
    assert spec(inner_lr=1e-3).spec_hash() != spec(inner_lr=1.0000001e-3).spec_hash()


# --- mismatches -------------------------------------------------------------------------


def test_differences_name_exactly_the_differing_fields():
    ours, theirs = spec(), spec(inner_steps=50, seq_len=128)
    assert ours.differences(theirs) == {"seq_len": (256, 128), "inner_steps": (500, 50)}
    assert ours.differences(spec()) == {}


def test_spec_mismatch_message_names_the_fields_and_both_values():
    ours, theirs = spec(), spec(inner_steps=50, outer_lr=0.5)
    error = SpecMismatch("my-run_1", ours.differences(theirs))
    message = str(error)
    assert "'my-run_1'" in message
    assert "inner_steps: ours=500 swarm=50" in message
    assert "outer_lr: ours=0.7 swarm=0.5" in message
    assert "seq_len" not in message and "\n" not in message
    assert "--run-id" in message  # says what to do
    assert error.differences == {"inner_steps": (500, 50), "outer_lr": (0.7, 0.5)}


def test_parse_published_spec_accepts_good_and_refuses_malformed():
    assert parse_published_spec(spec().model_dump()) == spec()
    for raw in (None, "x", [1], {}, {**spec().model_dump(), "seq_len": -1}, {**spec().model_dump(), "extra": 1},
                {**spec().model_dump(), "outer_lr": math.inf}):
        assert parse_published_spec(raw) is None



def test_a_compression_mismatch_says_the_outer_step_follows_it():
    from diloco_swarm.spec import differences_text

    ours, theirs = spec(), spec(compression="sparse1-int8", outer_lr=3.0, outer_momentum=0.3)
    text = differences_text(ours.differences(theirs), "swarm")
    assert "compression: ours='int8' swarm='sparse1-int8'" in text
    assert text.endswith("--outer-lr and --outer-momentum default by --compression")
    assert "default by" not in differences_text(ours.differences(spec(outer_lr=1.0)), "swarm")
