"""No single peer decides the swarm's state: a peer that claims a far newer outer step is not followed.

The hostile peer (``--fault claim-ahead``, tests/faults.py) states an outer step 1000 ahead of
its own in its round metadata, its state donations, its signed record and its donor priority,
with its real θ_global: what a forged "newest model" looks like to the others. Honest peers adopt a
state only when other peers' signed records support it (node/statesync.py).
"""

from __future__ import annotations

import pytest

from swarmlib import Swarm

pytestmark = [pytest.mark.swarm]

START_S = 180.0
AHEAD = 1000


def peer_id(node) -> str:
    return node.events("start")[-1]["peer_id"]


@pytest.mark.timeout(600)
def test_a_peer_claiming_a_far_newer_state_is_not_followed(tmp_path):
    with Swarm(tmp_path, "claim", extra=["--wait-for-peers", "3"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, wait_start=False)
        h = swarm.start("h", "--fault", "claim-ahead", initial=a, timeout=START_S)
        swarm.wait(lambda: b.events("start"), START_S, "b starts", b)
        hid = peer_id(h)

        def rounds_with_h(node):
            return [r for r in node.outer_steps() if r["round_ok"] and hid in r["group"]]

        swarm.wait(lambda: len(rounds_with_h(a)) >= 2 and len(rounds_with_h(b)) >= 2, 240,
                   "a and b average with h twice", a)
        # A late joiner: h is the most advanced donor it can see (priority = its claimed step).
        d = swarm.start("d", initial=a, timeout=START_S)
        swarm.wait(lambda: len(d.outer_steps()) >= 2, 240, "d trains two outer steps", d)

        for node in (a, b, d):
            syncs = node.events("state_sync")
            assert not any(s["donor"] == hid for s in syncs), (node.name, syncs)
            steps = [r["outer_step"] for r in node.outer_steps()] + [s["outer_step"] for s in syncs]
            assert max(steps) < AHEAD, (node.name, steps)
        # the joiner got the honest swarm's state, not the claimed one
        joined = d.events("state_sync")
        assert joined and joined[0]["reason"] == "join" and joined[0]["donor"] in (peer_id(a), peer_id(b)), joined
        # h is named: by the members it claimed to be ahead of, or by the joiner that refused its state
        named = [n.name for n in (a, b, d) if hid in n.output() and (
            "claims outer step" in n.output() or "claimed by no other peer" in n.output())]
        assert named, "\n".join(n.output()[-2000:] for n in (a, b, d))


@pytest.mark.timeout(600)
def test_members_stop_joining_a_peer_that_drops_their_parts(tmp_path):
    """A hostile reducer refuses every honest member's part (``--fault drop-part``). The members
    learn it from its refusal of their valid parts, and neither join its groups nor let it join theirs."""
    with Swarm(tmp_path, "dropper", extra=["--wait-for-peers", "3"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, wait_start=False)
        h = swarm.start("h", "--fault", "drop-part", initial=a, timeout=START_S)
        swarm.wait(lambda: b.events("start"), START_S, "b starts", b)
        hid = peer_id(h)

        def avoids(node):
            return f"Avoiding peer {hid}" in node.output()

        swarm.wait(lambda: avoids(a) and avoids(b), 240, "a and b detect h", a)
        t = max(n.events()[-1]["time"] for n in (a, b))

        def honest_rounds_after(node):
            return [r for r in node.outer_steps() if r["time"] > t and r["round_ok"]]

        swarm.wait(lambda: len(honest_rounds_after(a)) >= 2 and len(honest_rounds_after(b)) >= 2, 240,
                   "a and b average together after detecting h", a)
        for node in (a, b):
            # a group that formed before the detection may still finish; later ones never hold h
            later = [r for r in node.outer_steps() if r["time"] > t][1:]
            assert later and all(hid not in r["group"] for r in later), (node.name, later)
            assert all(set(r["group"]) == {peer_id(a), peer_id(b)} for r in honest_rounds_after(node)), node.name
