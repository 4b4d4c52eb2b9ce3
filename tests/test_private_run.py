"""A private run keeps strangers out (issue 37, item 3): only invited peers train together.

The organiser starts the run with ``--private`` and invites one volunteer (``diloco-node invite``). Then:
- a stranger without an invitation gets one line and exit 2 at its join;
- a stranger running code that skips that check (``--fault uninvited``, tests/faults.py: its record shows
  a pass copied from the volunteer's record) never meets the invited peers in a group and downloads no
  byte of their state, while they keep averaging with each other;
- ``status --json`` leaves its record out and counts it as refused.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmlib import Swarm

pytestmark = [pytest.mark.swarm]

START_S = 180.0
OUTER_STEPS = 16
INNER_STEPS = "100"  # phases of about 2 s: the run outlasts the stranger's start-up (about 20 s) by far


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_swarm", *args], capture_output=True, text=True,
                          timeout=timeout)


def _status(swarm: Swarm, node) -> dict:
    out = _cli("status", "--light", "--json", "--initial-peers", node.maddr(), "--run-id", swarm.run_id)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(600)
def test_a_private_run_trains_its_invited_peers_and_keeps_strangers_out(tmp_path):
    with Swarm(tmp_path, "private", extra=["--max-outer-steps", str(OUTER_STEPS), "--wait-for-peers", "2",
                                              "--inner-steps", INNER_STEPS]) as swarm:
        organiser = swarm.start("organiser", "--private", timeout=START_S)
        made = _cli("invite", "--state-dir", str(organiser.state_dir), "--expires", "1")
        assert made.returncode == 0, made.stderr
        invitation = tmp_path / "invitation.txt"
        invitation.write_text(made.stdout)

        # no invitation: one line, exit 2, before it trains
        refused = _cli("join", "--run-id", swarm.run_id, *swarm.base, *swarm.extra, "--state-dir", str(tmp_path / "stranger"),
                       "--port", "0", "--initial-peers", organiser.maddr(), timeout=START_S)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "is private" in refused.stderr and "Traceback" not in refused.stderr + refused.stdout, refused.stderr

        volunteer = swarm.start("volunteer", "--invite", str(invitation), initial=organiser, timeout=START_S)
        invited = [organiser, volunteer]
        # a stranger that skips the check: it starts behind them, so it would download their state
        stranger = swarm.start("uninvited", "--invite", str(invitation), "--fault", "uninvited", initial=organiser,
                               timeout=START_S)
        stranger_id = stranger.events("start")[-1]["peer_id"]
        doc = swarm.wait(lambda: (lambda d: d if d["summary"].get("refused") else None)(_status(swarm, organiser)),
                         60, "status counts the stranger's record as refused", invited)
        assert stranger_id not in {p["peer_id"] for p in doc["peers"]}, doc["peers"]
        for node in invited:
            assert swarm.wait_exit(node, 400) == 0, node.output()[-3000:]
        swarm.kill(stranger)

        # the invited peers averaged with each other, never with the stranger
        for node in invited:
            steps = node.outer_steps()
            assert steps[-1]["outer_step"] >= OUTER_STEPS - 1, (node.name, steps)
            assert sum(r["round_ok"] for r in steps) >= OUTER_STEPS // 2, (node.name, steps)
            assert all(r["group_size"] <= 2 for r in steps), (node.name, steps)
            assert steps[-1]["eval_loss"] < steps[0]["eval_loss"], (node.name, steps)
        # the stranger met nobody and downloaded nothing: its outer steps are its own, all solo
        assert not [r for r in stranger.outer_steps() if r["group_size"] >= 2], stranger.outer_steps()
        assert "could not download the swarm's state" in stranger.output(), stranger.output()[-3000:]
