"""The first phase of a peer that has not timed an inner step yet: planned H, then re-planned from
its first timed steps and the swarm's records (Node._replan_first_phase, node/runner.py)."""

import time
from types import SimpleNamespace

from diloco_swarm.node.runner import Node


def peer(swarm_eta=None, swarm_step_s=None, H=100) -> Node:
    """A node with only what DyLU's planning reads (no model, DHT or averager)."""
    p = Node.__new__(Node)
    p.spec, p.swarm_phase_eta, p.swarm_inner_step_s = SimpleNamespace(inner_steps=H), swarm_eta, swarm_step_s
    p.min_inner_steps, p.max_inner_steps, p.stats = H // 4, 2 * H, SimpleNamespace(phase_eta=0.0)
    return p


def test_a_slow_newcomer_aims_at_the_swarms_next_hand_off():
    p = peer(swarm_eta=time.time() + 3.0, swarm_step_s=0.035)
    target = p._replan_first_phase(steps=10, inner_s=1.05)  # 0.105 s per step: 3x slower
    assert 32 <= target <= 40  # 10 done + ~29 until the hand-off 3 s ahead (less if this test ran slowly), not H = 100
    assert abs(p.stats.phase_eta - (time.time() + (target - 10) * 0.105)) < 1.0  # published


def test_without_a_hand_off_ahead_it_scales_h_by_speed_and_never_undoes_steps():
    past = time.time() - 5.0
    assert peer(swarm_eta=past, swarm_step_s=0.035)._replan_first_phase(steps=10, inner_s=1.05) == 33
    assert peer(swarm_step_s=0.035)._replan_first_phase(steps=60, inner_s=6.3) == 60  # past its plan: end now
    assert peer(swarm_step_s=1.0)._replan_first_phase(steps=10, inner_s=1.0) == 200  # faster: capped at 2H
    assert peer()._replan_first_phase(steps=10, inner_s=1.0) == 100  # nothing known: H
    assert peer(swarm_eta=time.time() + 0.5)._replan_first_phase(steps=5, inner_s=0.5) == 25  # ≥ H/4
