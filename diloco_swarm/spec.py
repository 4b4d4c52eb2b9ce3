"""RunSpec: everything the peers of one run must agree on, and its hash.

A run is identified by its run id. The first peer of a run publishes its RunSpec in the DHT;
every later peer compares its own spec with it and refuses to train on a mismatch, naming the
fields that differ (:class:`SpecMismatch`). Knobs that do not change the maths shared by the
swarm (batch size, device, ports, timeouts) stay local and are not part of the spec.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

PROTOCOL_VERSION = 7  # 2: sync_mode; records carry inner_step_s. 3: int8 codec version 2 (linear map). 4: records
# carry avoided_peers, reducers take the skipped mean (issue 37). 5: private runs (spec organiser, records' admission).
# 6: a restarted lineage's debt (records', gathered and state metadata's restarted_below), records' eval_outer_step.
# 7: records' paused (a paused peer stays in the swarm; no round waits for it), the ledger's verified_rounds and
# rounds_with; gathered metadata's receive_mbps (a download cap, issue 39)
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
RUN_ID_MAX = 64
# Fields added after the first release, with the value every earlier run implicitly had. A spec
# holding these values serializes without them, so its hash, its DHT record and the checkpoints of
# runs started before the fields existed stay exactly as they were.
LATER_FIELD_DEFAULTS: dict[str, object] = {"tokenizer": "byte", "vocab_size": 256, "organiser": None}
ORGANISER_PATTERN = r"^ed25519:[A-Za-z0-9_-]{43}$"  # invites.public_key_text


def run_id_problem(run_id: str) -> str | None:
    """One line saying why ``run_id`` is not a valid run id, or None."""
    if 1 <= len(run_id) <= RUN_ID_MAX and re.match(RUN_ID_PATTERN, run_id):
        return None
    return (f"--run-id {run_id!r} is not a valid run id: use 1 to {RUN_ID_MAX} letters, digits, '-' or '_', "
            "starting with a letter or digit")


class RunSpec(BaseModel):
    """The agreed parameters of a run (DiLoCo, arXiv 2311.08105, Table 1 defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(min_length=1, max_length=RUN_ID_MAX, pattern=RUN_ID_PATTERN)
    protocol_version: int = PROTOCOL_VERSION
    model: str = Field(description="preset name, or 'hf:config=<sha256/16>[,weights=<sha256/16>]' (models/registry.py)")
    dataset: str = Field(description="data identity: 'python-stdlib', 'files:...' or 'hf:...' (data/)")
    tokenizer: str = Field("byte", description="'byte', or 'sha256:<16 hex>' of the tokenizer's files (data/tokenizer.py)")
    vocab_size: int = Field(256, gt=0, description="rows of the model's embedding (token ids the model accepts)")
    seq_len: int = Field(gt=0)
    inner_steps: int = Field(gt=0, description="H: inner steps per outer step")
    inner_lr: float = Field(gt=0, allow_inf_nan=False)
    outer_lr: float = Field(gt=0, allow_inf_nan=False)
    outer_momentum: float = Field(ge=0, lt=1, allow_inf_nan=False)
    compression: str = "int8"
    seed: int = Field(ge=0)
    # overlap: the next inner phase runs while Δ is averaged (eager updates, arXiv 2502.12996);
    # blocking: training waits for each round (DiLoCo, arXiv 2311.08105). Changes what every member applies.
    sync_mode: Literal["overlap", "blocking"] = "overlap"
    # a private run (invites.py): the organiser's public key, which signs every invitation; None = public
    organiser: str | None = Field(None, pattern=ORGANISER_PATTERN)

    @model_serializer(mode="wrap")
    def _omit_later_fields_at_their_defaults(self, handler):
        data = handler(self)
        for name, default in LATER_FIELD_DEFAULTS.items():
            if data.get(name) == default:
                data.pop(name)
        return data

    def spec_hash(self) -> str:
        """sha256 (16 hex digits) of the canonical JSON of the spec."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: "RunSpec") -> dict[str, tuple[object, object]]:
        """Fields whose values differ: ``{name: (ours, theirs)}``."""
        mine, theirs = dict(self), dict(other)
        return {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}


def differences_text(differences: dict[str, tuple[object, object]], theirs: str) -> str:
    """``name: ours=A {theirs}=B, ...`` of :meth:`RunSpec.differences`; where --compression differs, a note that
    the outer step's defaults follow it (cli/app.py ``OUTER_STEP_DEFAULTS``), so only one flag may be wrong."""
    text = ", ".join(f"{k}: ours={a!r} {theirs}={b!r}" for k, (a, b) in differences.items())
    if "compression" in differences and differences.keys() & {"outer_lr", "outer_momentum"}:
        text += "; --outer-lr and --outer-momentum default by --compression"
    return text


class SpecMismatch(Exception):
    """This peer's spec differs from the one the run published in the DHT."""

    def __init__(self, run_id: str, differences: dict[str, tuple[object, object]]):
        self.differences = differences
        super().__init__(
            f"run '{run_id}' uses a different run spec ({differences_text(differences, 'swarm')}); "
            "pass matching flags, or choose another --run-id to start a new run"
        )


def parse_published_spec(raw: object) -> RunSpec | None:
    """Validate a spec read from the DHT (untrusted bytes); ``None`` if it is malformed."""
    if not isinstance(raw, dict):
        return None
    try:
        return RunSpec.model_validate(raw)
    except ValidationError:
        return None
