"""The first phase of a peer that has not timed an inner step yet: planned H, then re-planned from
its first timed steps and the swarm's records (Node._replan_first_phase, node/runner.py)."""

import time
from types import SimpleNamespace

from diloco_swarm.node.runner import Node


def peer(swarm_eta=None, swarm_step_s=None, H=100):
    return SimpleNamespace(spec=SimpleNamespace(inner_steps=H), swarm_phase_eta=swarm_eta,
                           swarm_inner_step_s=swarm_step_s, min_inner_steps=H // 4, max_inner_steps=2 * H,
                           stats=SimpleNamespace(phase_eta=0.0))


def test_a_slow_newcomer_aims_at_the_swarms_next_hand_off():
    p = peer(swarm_eta=time.time() + 3.0, swarm_step_s=0.035)
    target = Node._replan_first_phase(p, steps=10, inner_s=1.05)  # 0.105 s per step: 3x slower
    assert 35 <= target <= 40  # 10 done + ~29 until the hand-off 3 s ahead, not H = 100
    assert abs(p.stats.phase_eta - (time.time() + (target - 10) * 0.105)) < 0.5  # published


def test_without_a_hand_off_ahead_it_scales_h_by_speed_and_never_undoes_steps():
    past = time.time() - 5.0
    assert Node._replan_first_phase(peer(swarm_eta=past, swarm_step_s=0.035), steps=10, inner_s=1.05) == 33
    assert Node._replan_first_phase(peer(swarm_step_s=0.035), steps=60, inner_s=6.3) == 60  # past its plan: end now
    assert Node._replan_first_phase(peer(swarm_step_s=1.0), steps=10, inner_s=1.0) == 200  # faster: capped at 2H
    assert Node._replan_first_phase(peer(), steps=10, inner_s=1.0) == 100  # nothing known: H
    assert Node._replan_first_phase(peer(swarm_eta=time.time() + 0.5), steps=5, inner_s=0.5) == 25  # ≥ H/4
