"""Checkpoint formats across a restart, on a real node: format 1 (before the memory work: the inner
AdamW state too, and ``checkpoint.prev.pt`` beside it) resumes; the next write is format 2, one file of
θ_global and the outer momentum. SIGKILLs in each phase followed by a resume: tests/test_churn.py and
tests/test_overlap.py, which run the same checkpoints."""

from __future__ import annotations

import pytest
import torch

from swarmlib import Swarm, load_checkpoint

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def test_a_format_1_checkpoint_resumes_and_is_replaced_by_format_2(tmp_path):
    with Swarm(tmp_path, "resume-format") as swarm:
        node = swarm.start("n", "--max-outer-steps", "2")
        assert swarm.wait_exit(node, 150) == 0, node.output()[-3000:]
        ckpt = load_checkpoint(node)
        assert ckpt["format_version"] == 2 and "inner_optimizer" not in ckpt and ckpt["outer_step"] == 2
        params = sum(t.numel() for t in ckpt["outer"]["theta"])
        size = (node.state_dir / "checkpoint.pt").stat().st_size
        assert size <= 8 * params + 200_000, f"{size} bytes for {params} parameters"  # θ_global + momentum
        assert sorted(p.name for p in node.state_dir.glob("checkpoint*")) == ["checkpoint.pt"]

        # the same state as format 1 wrote it: inner AdamW state inside, the one before beside it
        opt = torch.optim.AdamW([torch.nn.Parameter(t.clone()) for t in ckpt["outer"]["theta"]], lr=1e-3)
        old = {**ckpt, "format_version": 1, "inner_optimizer": opt.state_dict()}
        torch.save(old, node.state_dir / "checkpoint.pt")
        torch.save({**old, "outer_step": 1}, node.state_dir / "checkpoint.prev.pt")

        node = swarm.start("n", "--max-outer-steps", "4")
        assert swarm.wait_exit(node, 150) == 0, node.output()[-3000:]
        assert "resumed from" in node.output() and node.events("start")[-1]["outer_step"] == 2
        ckpt = load_checkpoint(node)
        assert ckpt["format_version"] == 2 and ckpt["outer_step"] == 4
        assert sorted(p.name for p in node.state_dir.glob("checkpoint*")) == ["checkpoint.pt"]


def test_a_checkpoint_of_a_newer_format_is_refused_with_one_line(tmp_path):
    with Swarm(tmp_path, "resume-newer") as swarm:
        node = swarm.start("n", "--max-outer-steps", "1")
        assert swarm.wait_exit(node, 150) == 0, node.output()[-3000:]
        newer = {**load_checkpoint(node), "format_version": 3}
        torch.save(newer, node.state_dir / "checkpoint.pt")
        before = (node.state_dir / "checkpoint.pt").read_bytes()
        node = swarm.start("n", "--max-outer-steps", "2", wait_start=False)
        assert swarm.wait_exit(node, 120) == 2
        errors = [line for line in node.output().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "newer than this version reads" in errors[0], node.output()[-2000:]
        assert "Traceback" not in node.output()
        assert (node.state_dir / "checkpoint.pt").read_bytes() == before
