"""A joiner's restarted lineage never replaces its founder's more trained one (issue 37, item 4), on real nodes.

A trains alone; B joins, and A's whole process tree is frozen (SIGSTOP: a laptop put to sleep)
while B downloads its state (slowed, ``slow-donation``, so the freeze lands in it). B's download
fails and it trains on from θ_0 at outer step 0, with a smaller batch than A's (a smaller laptop),
until its outer step is past A's by more than one: the old rule ("newest outer step wins") then had
A, woken, catch up with B's state, dropping A's training for a lineage restarted from the initial
weights. Now B's lineage owes the outer steps it could not download (``restarted_below``), so it
stands behind A's: A keeps its model, and B takes A's lineage at their next round.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from swarmlib import Swarm, process_tree, theta_by_step

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

A_ARGS = ["--batch-size", "16", "--fault", "slow-donation=300"]  # tiny's state: ~64 parts, ~20 s to send
B_ARGS = ["--batch-size", "1"]  # 1/16 of A's tokens per outer step: more steps, less training
A_STEPS = 4  # A's outer steps before B joins: B's debt
AHEAD = 3  # B's outer steps past A's when A wakes (the old rule caught up from 2 on); fewer than A_STEPS


def signal_tree(pid: int, sig: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def last(records: list[dict], after: float = 0.0) -> dict | None:
    """The last record written after ``after`` (unix s), or None."""
    later = [r for r in records if r["time"] > after]
    return later[-1] if later else None


def test_a_woken_founder_keeps_its_lineage_and_the_restarted_joiner_takes_it(tmp_path):
    with Swarm(tmp_path, "lineage") as swarm:
        a = swarm.start("a", *A_ARGS)
        swarm.wait(lambda: any(r["outer_step"] >= A_STEPS for r in a.outer_steps()), 240,
                   f"a made {A_STEPS} outer steps", a)
        b = swarm.start("b", *B_ARGS, initial=a)
        time.sleep(3.0)  # b reads the donors and begins its download (slowed: it lasts ~20 s)
        signal_tree(a.proc.pid, signal.SIGSTOP)
        try:
            before = a.outer_steps()[-1]
            a_step, a_tokens, a_loss = before["outer_step"], before["tokens_total"], before["eval_loss"]
            swarm.wait(lambda: any(r["outer_step"] >= a_step + AHEAD for r in b.outer_steps()), 240,
                       f"b trained alone past a's outer step {a_step}", b)
        finally:
            signal_tree(a.proc.pid, signal.SIGCONT)
        woke = time.time()
        b_at_wake = b.outer_steps()[-1]
        # b leaves its own lineage: its records' debt back to 0, on a θ_global a held at that step
        swarm.wait(lambda: (last(b.outer_steps(), woke) or {}).get("restarted_below") == 0, 180,
                   "b took a's lineage", [a, b])
        taken = last(b.outer_steps(), woke)
        # both evaluated on the one lineage afterwards
        swarm.wait(lambda: [r for r in a.outer_steps() if r["time"] > taken["time"] and r["eval_loss"] is not None]
                   and [r for r in b.outer_steps() if r["time"] > taken["time"] and r["eval_loss"] is not None],
                   120, "both evaluated after b took a's lineage", [a, b])
        swarm.leave()
        a_out, b_out = a.output(), b.output()
    # the case under test is real: b's download failed, b restarted owing a's steps, and at a's wake
    # b was past a's outer step by more than one (the old rule's catch-up) with less training behind it
    assert "could not download the swarm's state" in b_out and "on a new lineage that owes the" in b_out, b_out[-3000:]
    assert b_at_wake["outer_step"] > a_step + 1 and b_at_wake["tokens_total"] < a_tokens, (b_at_wake, before)
    assert b_at_wake["restarted_below"] >= A_STEPS, b_at_wake
    # a never left its lineage: no state adopted, no catch-up
    assert not a.events("state_sync") and "behind the swarm" not in a_out, a_out[-3000:]
    a_thetas, b_thetas = theta_by_step(a), theta_by_step(b)
    assert a_thetas.get(taken["outer_step"]) == b_thetas.get(taken["outer_step"]), (taken, a_thetas, b_thetas)
    # they end on one θ_global, and the survivor's held-out loss is not worse than the founder's before the
    # pause; b, which evaluates on fewer held-out batches (its batch size), finds it better than its own restart
    a_end, b_end = (last([r for r in n.outer_steps() if r["eval_loss"] is not None], taken["time"]) for n in (a, b))
    b_since = {taken["outer_step"]: b_thetas.get(taken["outer_step"]),  # (b's restart held later steps before)
               **theta_by_step([e for e in b.events() if e.get("time", 0) > taken["time"]])}
    common = max(set(a_thetas) & set(b_since))
    assert a_thetas[common] == b_since[common], (common, a_thetas, b_since)
    assert a_end["eval_loss"] <= a_loss, (a_end["eval_loss"], a_loss)
    assert b_end["eval_loss"] < b_at_wake["eval_loss"], (b_end["eval_loss"], b_at_wake["eval_loss"])
