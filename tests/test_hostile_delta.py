"""A hostile volunteer cannot steer the model (issue 37): every reducer leaves its Δ out, names it, and avoids it.

4 honest peers and one that sends −8 × its Δ to every round (``--fault scale=-8``, tests/faults.py: mostly
inside the 10× bound on a part's size; a part over it fails that round) against the same 4 honest peers alone (the same peer
ids, so the same data; not the same inner steps: DyLU sizes each phase to the machine's load). With the
plain weighted mean the same attack cost +21.5% of held-out loss (issue 37: 5 peers, 10 outer steps of
H = 20); the reducers' skipped mean (averaging/robust.py) must keep the honest peers within 2%. An outlier
in ``AVOID_AFTER_OUTLIER_ROUNDS`` rounds in a row is then avoided (averaging/conduct.py): each honest peer
says so in its log and its signed record, which ``status --json`` reads; no honest peer is avoided.

The same holds in a sparse mode (issue 38): the reducers judge the decoded sparse parts, name the hostile peer
and avoid it, and the honest peers' loss falls. Its loss is not compared with the honest run's: a sparse
mode's loss depends on the phase length, which DyLU sizes to the machine's load, and five processes on two
cores give the attacked run longer phases, so runs this short differ by up to 10% whatever the attack
(docs/decisions.md, *Sparse int8*). The ratio at equal tokens and seeds, where the plain mean diverges, is
the benchmark's (docs/benchmarks.md, section 11).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_swarm.averaging.conduct import AVOID_AFTER_OUTLIER_ROUNDS
from diloco_swarm.node.config import IDENTITY_FILE
from swarmlib import Swarm

pytestmark = [pytest.mark.swarm]

OUTER_STEPS = 6
# the honest peers' held-out loss against the honest peers alone: issue 37's 2%; none in a sparse mode (docstring)
TOLERANCE = {"int8": 0.02, "sparse1-int8": None}
LOSS_FALLS = 0.3  # nats/token from the first held-out loss to the last, every honest peer of every run
START_S = 180.0
assert OUTER_STEPS >= AVOID_AFTER_OUTLIER_ROUNDS + 2  # rounds left to see the avoidance published


def _status(swarm: Swarm, node) -> dict:
    """``diloco-node status --json`` (the light client: no DHT daemon to start) through ``node``."""
    out = subprocess.run([sys.executable, "-m", "diloco_swarm", "status", "--light", "--json", "--initial-peers",
                          node.maddr(), "--run-id", swarm.run_id], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _watch_avoidance(swarm: Swarm, honest: list, hostile: list) -> dict:
    """Wait until every honest peer avoids the hostile one (its log line) and publishes it in its record;
    :returns: the ``status --json`` document that shows the hostile peer avoided by every honest peer."""
    hostile_id = swarm.wait(lambda: next((e["peer_id"] for e in hostile[0].events("start")), None), START_S,
                            "the hostile peer starts", hostile)
    swarm.wait(lambda: all(f"Avoiding peer {hostile_id}" in n.output() for n in honest), 300,
               "every honest peer avoids the hostile one", honest)

    def avoided_by_all():
        doc = _status(swarm, honest[0])
        entry = next((e for e in doc["summary"]["avoided"] if e["peer_id"] == hostile_id), None)
        return doc if entry is not None and len(entry["by"]) == len(honest) else None

    return swarm.wait(avoided_by_all, 60, "status lists the hostile peer avoided by every honest peer", honest)


def _train(root: Path, honest: int, hostile: int, compression: str,
           peers_of: Path | None = None) -> tuple[list[float], list[str], list[str], list[str], dict | None]:
    """``honest`` + ``hostile`` peers to ``OUTER_STEPS`` in ``compression``: the honest peers' final held-out
    losses, their logs, the honest and the hostile peers' ids, and (with a hostile peer) the ``status --json``
    document that shows it avoided. The honest peers take the identity keys of ``peers_of``'s (a finished run's
    root): their peer ids, and with them the order in which each reads the data."""
    n = honest + hostile
    for i in range(honest if peers_of is not None else 0):
        (root / f"h{i}").mkdir(parents=True)
        shutil.copy(peers_of / f"h{i}" / IDENTITY_FILE, root / f"h{i}" / IDENTITY_FILE)
    with Swarm(root, f"hostile-delta-{hostile}", extra=["--max-outer-steps", str(OUTER_STEPS), "--wait-for-peers",
                                                       str(n), "--compression", compression]) as swarm:
        first = swarm.start("h0", timeout=START_S)
        nodes = [first] + [swarm.start(f"h{i}", initial=first, wait_start=False) for i in range(1, honest)]
        bad = [swarm.start(f"x{i}", "--fault", "scale=-8", initial=first, wait_start=False) for i in range(hostile)]
        status = _watch_avoidance(swarm, nodes, bad) if bad else None
        for node in nodes + bad:
            assert swarm.wait_exit(node, 300) == 0, node.output()[-3000:]
        losses = []
        for node in nodes:
            steps = node.outer_steps()
            assert steps and steps[-1]["outer_step"] >= OUTER_STEPS - 1, (node.name, steps)
            assert sum(r["round_ok"] for r in steps) >= OUTER_STEPS // 2, (node.name, steps)
            assert steps[-1]["eval_loss"] < node.events("eval")[0]["eval_loss"] - LOSS_FALLS, (node.name, steps)
            losses.append(steps[-1]["eval_loss"])
        ids = [[node.events("start")[-1]["peer_id"] for node in group] for group in (nodes, bad)]
        return losses, [node.output() for node in nodes], ids[0], ids[1], status


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compression", list(TOLERANCE))
def test_a_peer_sending_minus_8_times_its_delta_is_left_out_named_and_avoided(tmp_path, compression):
    alone, alone_logs, _, _, _ = _train(tmp_path / "honest", 4, 0, compression)
    attacked, logs, honest_ids, (hostile_id,), status = _train(tmp_path / "attacked", 4, 1, compression,
                                                               peers_of=tmp_path / "honest")
    baseline, tolerance = sum(alone) / len(alone), TOLERANCE[compression]
    for loss in attacked if tolerance is not None else ():
        assert loss <= baseline * (1 + tolerance), (attacked, alone)
    # every honest peer reduces a slice holding the hostile peer's parts, and names it there
    named = [log for log in logs if f"peer {hostile_id} sent an outlier Δ" in log]
    assert len(named) == len(logs), [log[-1500:] for log in logs]
    # ... avoids it after AVOID_AFTER_OUTLIER_ROUNDS such rounds, and says so in its record (status --json);
    # honest peers avoid no one else, and nobody avoids anyone in the honest swarm
    (entry,) = [e for e in status["summary"]["avoided"] if e["peer_id"] == hostile_id]
    assert {b["peer_id"] for b in entry["by"]} == set(honest_ids), entry
    assert any(f"outlier in {AVOID_AFTER_OUTLIER_ROUNDS} rounds in a row" in why for why in entry["why"]), entry
    slandered = [e for e in status["summary"]["avoided"]
                 if e["peer_id"] in honest_ids and any(b["peer_id"] in honest_ids for b in e["by"])]
    assert not slandered, slandered
    assert not [log for log in alone_logs if "Avoiding peer" in log]
