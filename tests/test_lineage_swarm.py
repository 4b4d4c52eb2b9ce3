"""A joiner's scratch lineage never replaces its founder's more trained one (issue 37, item 4), on real nodes.

A trains alone; B joins, and A's whole process tree is frozen (SIGSTOP: a laptop put to sleep)
while B downloads its state (slowed, ``slow-donation``, so the freeze lands in it). B's download
fails and it trains on from θ_0 at outer step 0, with a smaller batch than A's (a smaller laptop),
until its outer step is past A's by more than one: the old rule ("newest outer step wins") then had
A, woken, catch up with B's state, dropping A's training for a lineage restarted from the initial
weights. Now A refuses it (B's lineage carries less training), says so, and B takes A's state at
their next round.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from swarmlib import Swarm, process_tree, theta_by_step

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

A_ARGS = ["--batch-size", "16", "--fault", "slow-donation=300"]  # tiny's state: ~64 parts, ~20 s to send
B_ARGS = ["--batch-size", "1"]  # 1/16 of A's tokens per outer step: more steps, less training
AHEAD = 3  # B's outer steps past A's when A wakes: the old rule caught up from 2 on


def signal_tree(pid: int, sig: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def last(records: list[dict], before: float | None = None) -> dict:
    """The last record (of those written before ``before``, unix s)."""
    return [r for r in records if before is None or r["time"] < before][-1]


def test_a_woken_founder_keeps_its_lineage_and_the_joiner_with_less_training_takes_it(tmp_path):
    with Swarm(tmp_path, "lineage") as swarm:
        a = swarm.start("a", *A_ARGS)
        swarm.wait(lambda: any(r["outer_step"] >= 2 for r in a.outer_steps()), 150, "a made 2 outer steps", a)
        b = swarm.start("b", *B_ARGS, initial=a)
        time.sleep(3.0)  # b reads the donors and begins its download (slowed: it lasts ~20 s)
        signal_tree(a.proc.pid, signal.SIGSTOP)
        paused = time.time()
        try:
            before = last(a.outer_steps())
            # (a and b never adopt a state before the wake: their lineages hold their own tokens alone)
            a_step, a_tokens, a_loss = before["outer_step"], before["tokens_total"], before["eval_loss"]
            swarm.wait(lambda: any(r["outer_step"] >= a_step + AHEAD for r in b.outer_steps()), 200,
                       f"b trained alone past a's outer step {a_step}", b)
        finally:
            signal_tree(a.proc.pid, signal.SIGCONT)
        woke = time.time()
        b_at_wake = last(b.outer_steps())
        a_id, b_id = a.events("start")[0]["peer_id"], b.events("start")[0]["peer_id"]
        # a's first round after the wake judges b's newer state: it adopted it (the old rule) or refused it
        swarm.wait(lambda: a.events("state_sync") or "not adopting peer" in a.output(), 120, "a judged b's state", a)
        assert not a.events("state_sync"), f"a adopted b's scratch lineage:\n{a.output()[-3000:]}"
        swarm.wait(lambda: [s for s in b.events("state_sync") if s["donor"] == a_id], 150, "b took a's state", [a, b])
        sync = [s for s in b.events("state_sync") if s["donor"] == a_id][0]
        # both on a's lineage: wait for an evaluation of it on each after the sync
        swarm.wait(lambda: [r for r in a.outer_steps() if r["time"] > sync["time"] and r["eval_loss"] is not None]
                   and [r for r in b.outer_steps() if r["time"] > sync["time"] and r["eval_loss"] is not None],
                   120, "both evaluated after the sync", [a, b])
        swarm.leave()
        a_out, b_out = a.output(), b.output()
    # the case under test is real: b's download failed, and at a's wake b was past a's outer step by
    # more than one (the old rule's catch-up) with less training behind it
    assert "could not download the swarm's state" in b_out or "sees no other peer" in b_out, b_out[-3000:]
    assert not [s for s in b.events("state_sync") if s["time"] < woke], b_out[-3000:]
    assert b_at_wake["outer_step"] > a_step + 1 and b_at_wake["tokens_total"] < a_tokens, (b_at_wake, before)
    # a refused b's state, said so, and never adopted another state
    assert f"not adopting peer {b_id}'s state at outer step" in a_out, a_out[-3000:]
    assert "behind the swarm" not in a_out and not a.events("state_sync"), a_out[-3000:]
    # b, with less training behind it, took a's lineage: the state a held at that outer step
    assert theta_by_step(a).get(sync["outer_step"]) == sync["theta_digest"], (sync, theta_by_step(a))
    assert sync["lineage_tokens"] > a_tokens
    # the survivor's held-out loss is not worse than the founder's before the pause
    for node in (a, b):
        after = last([r for r in node.outer_steps() if r["time"] > sync["time"] and r["eval_loss"] is not None])
        assert after["eval_loss"] <= a_loss, (node.name, after["eval_loss"], a_loss, paused)
