"""A 3-peer swarm in a sparse int8 mode (issue 38): real `diloco-node join` processes on 127.0.0.1
send the top 1% of each chunk of their Δ + residual; rounds verify, every member holds one θ_global,
the held-out loss falls, a round moves a small share of dense int8's bytes, the residual is in the
checkpoint, and the outer step took the sparse mode's defaults."""

from __future__ import annotations

import pytest
import torch

from diloco_swarm.cli.app import OUTER_STEP_DEFAULTS
from diloco_swarm.models import build_model
from swarmlib import Swarm, load_checkpoint, verified_digests

pytestmark = [pytest.mark.swarm]


@pytest.mark.timeout(420)
def test_three_peers_in_sparse1_int8_verify_rounds_agree_and_learn(tmp_path):
    with Swarm(tmp_path, "sparse3", extra=["--compression", "sparse1-int8", "--max-outer-steps", "10",
                                           "--wait-for-peers", "3"]) as swarm:
        a = swarm.start("a")
        b = swarm.start("b", initial=a, wait_start=False)
        c = swarm.start("c", initial=a, wait_start=False)
        nodes = (a, b, c)
        for node in nodes:
            assert swarm.wait_exit(node, 360) == 0, node.output()[-3000:]

    params = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    for node in nodes:
        rounds = node.outer_steps()
        ok = [r for r in rounds if r["round_ok"]]
        assert len(ok) >= 4, (node.name, [(r["outer_step"], r["round_ok"], r.get("reason")) for r in rounds])
        for r in ok:
            assert r["compression"] == "sparse1-int8" and r["group_size"] >= 2 and r["digest_confirmed_by"] >= 1
            # dense int8 sends about 2·(n−1)/n·P ≈ 1.3 P bytes per round here; 1% entries, as-is averages: < 0.1 P
            assert 0 < r["bytes_sent"] < 0.1 * params, (r["bytes_sent"], params)
        first_eval = node.events("eval")[0]["eval_loss"]
        assert rounds[-1]["eval_loss"] < first_eval - 0.3, (node.name, first_eval, rounds[-1]["eval_loss"])
        residual = load_checkpoint(node)["feedback"]  # error feedback is part of the peer's state
        assert len(residual) == len(load_checkpoint(node)["outer"]["theta"])
        assert all(torch.isfinite(e).all() for e in residual) and any(float(e.abs().max()) > 0 for e in residual)

    # the outer step's defaults follow --compression, and the join line a node prints leaves them to it
    spec = load_checkpoint(a)["spec"]
    assert (spec["outer_lr"], spec["outer_momentum"]) == OUTER_STEP_DEFAULTS["sparse1-int8"], spec
    join_line = next(line for line in a.output().splitlines() if "to join from" in line)
    assert "--compression sparse1-int8" in join_line and "--outer-lr" not in join_line, join_line

    digests = verified_digests(list(nodes))
    common = [s for s, d in digests.items() if len(d) == 3]
    assert common, digests
    for step in common:
        assert len(set(digests[step].values())) == 1, (step, digests[step])  # bit-identical θ_global
