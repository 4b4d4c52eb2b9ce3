"""Training never waits for the network (overlapped outer steps): real nodes on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch

from diloco_swarm.models import build_model
from swarmlib import Swarm, kill_tree, theta_by_step

pytestmark = [pytest.mark.swarm]

START_S = 180.0


def digest_of_checkpoint(node) -> tuple[int, str]:
    from diloco_swarm.averaging.results import tensors_digest

    state = torch.load(node.state_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    return state["outer_step"], tensors_digest(state["outer"]["theta"])


@pytest.mark.timeout(300)
def test_a_lone_node_never_waits_for_a_group(tmp_path):
    """Today's blocking node idles the whole averaging window (30 s) per outer step when alone. An
    overlapped lone node hands each Δ off and trains the next phase at once: every hand-off comes
    before the previous round's window could have ended."""
    window = 30.0
    with Swarm(tmp_path, "lone", extra=["--max-outer-steps", "4", "--averaging-window", str(window)]) as swarm:
        node = swarm.start("n", timeout=START_S)
        assert swarm.wait_exit(node, 240) == 0, node.output()[-3000:]
        handoffs = node.events("averaging_start")
        rounds = node.outer_steps()
        assert [r["outer_step"] for r in rounds] == [1, 2, 3, 4], rounds
        assert all(r["group_size"] == 1 and r["reason"] == "no other peer online" for r in rounds), rounds
        for before, after in zip(handoffs, handoffs[1:]):
            assert after["time"] < before["time"] + window, (before, after)
        # and each round was applied before the next hand-off: the training thread never waited
        for r, nxt in zip(rounds, handoffs[1:]):
            assert r["time"] <= nxt["time"], (r, nxt)
        assert rounds[-1]["averaging_total_s"] < window / 3, rounds[-1]


@pytest.mark.timeout(420)
def test_two_nodes_overlap_rounds_agree_and_survive_a_crash_mid_round(tmp_path):
    # H = 100: a phase can outlast a round (3 s of matchmaking) before it reaches DyLU's 2H, where it
    # would wait for the round (10 tiny steps take a fraction of a second)
    with Swarm(tmp_path, "overlap2", extra=["--wait-for-peers", "2", "--inner-steps", "100"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, timeout=START_S)
        swarm.wait(lambda: sum(r["round_ok"] for r in a.outer_steps()) >= 3, 180, "3 verified rounds on a", a)

        # A round finishes while the next inner phase runs: it is applied between two inner steps.
        for node in (a, b):
            during = [r for r in node.outer_steps() if r["round_ok"] and (r["applied_at_inner_step"] or 0) >= 1]
            assert during, (node.name, node.outer_steps())
        # The average reaches θ_local tensor by tensor while the round is verified (the preview); θ_global,
        # below, still moves only by the verified average.
        tensors = len(list(build_model("tiny", seed=0).parameters()))
        previewed = [r["previewed_tensors"] for node in (a, b) for r in node.outer_steps()]
        assert all(0 <= n <= tensors for n in previewed), previewed
        assert tensors in previewed, previewed
        # Members of a verified round hold bit-identical θ_global after it.
        held_a, held_b = theta_by_step(a), theta_by_step(b)
        both = [r["outer_step"] for r in a.outer_steps() if r["round_ok"] and r["group_size"] == 2
                and r["outer_step"] in held_b]
        assert both, (a.outer_steps(), b.outer_steps())
        for step in both:
            assert held_a[step] == held_b[step], (step, held_a[step], held_b[step])

        # SIGKILL b (its whole process tree) while a round is in flight.
        n = len(b.events("averaging_start"))
        swarm.wait(lambda: len(b.events("averaging_start")) > n and b.events()[-1]["event"] == "averaging_start",
                   60, "b hands a round off", b, poll=0.05)
        kill_tree(b)
        # Its checkpoint is the state of a round it applied (the last one, or the one before when the
        # kill beat the checkpoint thread's write), never an eager estimate.
        step, digest = digest_of_checkpoint(b)
        held = theta_by_step(b)
        assert step in held and step >= max(held) - 1, (step, sorted(held))
        assert digest == held[step], (digest, step, held)

        # Restarted, b resumes from it and averages with a again.
        ok_before = sum(r["round_ok"] for r in a.outer_steps())
        b = swarm.start("b", initial=a, timeout=START_S)
        assert b.events("start")[-1]["outer_step"] >= step
        # each node writes its own record of the joint round: a's may land after b's
        swarm.wait(lambda: any(r["round_ok"] and r["group_size"] == 2 for r in b.outer_steps()
                               if r["time"] > b.events("start")[-1]["time"])
                   and sum(r["round_ok"] for r in a.outer_steps()) > ok_before,
                   180, "b averages after restart, and a's record of that round", b)


@pytest.mark.timeout(300)
def test_a_failing_checkpoint_write_is_said_and_training_goes_on(tmp_path):
    """A full disk under the state dir (the ``disk-full`` fault: every write after the first fails
    with ENOSPC): the node says so once, keeps training to the end, records each failure, and its
    leave names the outer step the checkpoint on disk holds, which is the one a restart resumes."""
    with Swarm(tmp_path, "diskfull", extra=["--max-outer-steps", "4", "--fault", "disk-full"]) as swarm:
        node = swarm.start("n", timeout=START_S)
        assert swarm.wait_exit(node, 240) == 0, node.output()[-3000:]
    assert [r["outer_step"] for r in node.outer_steps()] == [1, 2, 3, 4]
    failed = node.events("checkpoint_failed")
    assert [(e["outer_step"], e["on_disk_outer_step"]) for e in failed] == [(2, 1), (3, 1), (4, 1)], failed
    assert all(e["reason"] == "No space left on device" for e in failed), failed
    assert digest_of_checkpoint(node)[0] == 1
    out = node.output()
    assert out.count("warning: could not write the checkpoint") == 1, out[-3000:]  # once per reason
    assert "a restart would resume from outer step 1" in out, out[-3000:]
    assert "warning: the checkpoint on disk is outer step 1: writing outer step 4 failed (No space left on device)" in out
