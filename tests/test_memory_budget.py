"""The memory budget (docs/architecture.md, *Memory budget*) on real nodes: the tensors a node holds.

Two ``small`` nodes on 127.0.0.1 average for a few outer steps; the second joins late and downloads
the first's state. Each runs ``tests/census_node.py`` (the product's node, subclassed), which counts
the distinct storages of every tensor in its process after every applied round, while a checkpoint
is written and when it serves a donation (its live state, no snapshot). A model-sized copy added
anywhere in the node (4 B per parameter), or one kept after its use (a served state, hivemind's trap
in utils/hivemind_fixes.py), fails here. The peak PSS of whole process trees is ``python -m bench.memory``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swarmlib import Swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

CENSUS = str(Path(__file__).resolve().parent / "census_node.py")
ARGS = ["--model", "small", "--inner-steps", "4", "--batch-size", "2", "--max-outer-steps", "6", "--eval-budget", "1"]
SLACK_B = 1.0  # per parameter: data batches, codec tables and the like (`small`: 11 MB)
# bytes per parameter, from the budget table: weights 4 + AdamW's moments 8 + θ_global 4 + outer momentum 4
# + the averager's shared buffer 4 + the hand-off's Δ 4 ...
SETTLED_B = 28
# ... at any moment: + grads 4 (backward to step, seen from the checkpoint thread); a donation adds nothing
PEAK_B = SETTLED_B + 4


def test_a_node_holds_its_budget_after_rounds_checkpoints_and_a_donation(tmp_path):
    census = {name: tmp_path / f"census-{name}.jsonl" for name in ("a", "b")}
    with Swarm(tmp_path, "memory-budget") as swarm:
        os.environ["CENSUS_FILE"] = str(census["a"])
        try:
            a = swarm.start("a", *ARGS, entry=[CENSUS])
            swarm.wait(lambda: any(e["outer_step"] >= 1 for e in a.outer_steps()), 150, "a averaged no round", a)
            os.environ["CENSUS_FILE"] = str(census["b"])
            b = swarm.start("b", *ARGS, initial=a, entry=[CENSUS])
        finally:
            os.environ.pop("CENSUS_FILE", None)
        assert swarm.wait_exit(a, 200) == 0, a.output()[-3000:]
        assert swarm.wait_exit(b, 200) == 0, b.output()[-3000:]
        assert b.events("state_sync"), "b downloaded no state: the donation was not measured"
        assert any(e.get("round_ok") for node in (a, b) for e in node.outer_steps()), \
            "no verified round: the averaging was not measured"
    downloads = [json.loads(line) for line in census["b"].read_text().splitlines() if '"download"' in line]
    assert downloads, "b recorded no download"
    for line in downloads:  # the averaged buffers (4 B/param), not the state it passed on (8 more)
        assert line["averager_shm_bytes"] / line["params"] <= 4 + SLACK_B, \
            f"b's averager process still maps {line['averager_shm_bytes'] / line['params']:.1f} B/param after the download"
    for name, f in census.items():
        lines = [json.loads(line) for line in f.read_text().splitlines() if '"download"' not in line]
        assert {"round", "checkpoint"} <= {line["at"] for line in lines}, f"{name}: census points {lines}"
        for line in lines:
            per_param = line["bytes"] / line["params"]
            assert per_param <= PEAK_B + SLACK_B, \
                f"{name}, {line['at']} at outer step {line['outer_step']}: {per_param:.1f} B/param held, peak budget {PEAK_B}"
        settled = lines[-1]["bytes"] / lines[-1]["params"]  # after the last round: no donation, no step running
        assert settled <= SETTLED_B + SLACK_B, f"{name} ends holding {settled:.1f} B/param, budget {SETTLED_B}"
    assert any(json.loads(line)["at"] == "donation" for line in census["a"].read_text().splitlines())
