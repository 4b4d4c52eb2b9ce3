"""Tests for diloco_swarm.node.outer.OuterOptimizer: θ_global and the outer Nesterov step."""

import pytest
import torch
from torch import nn

from diloco_swarm.data import BatchSampler, load_corpus
from diloco_swarm.models import build_model
from diloco_swarm.node.outer import OuterOptimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def batches():
    corpus = load_corpus(None, max_bytes=100_000)
    sampler = BatchSampler(corpus.train, BATCH, SEQ_LEN, seed=0, stream_id="test-peer")
    return list(sampler.batches_for_outer_step(0, 6))


def inner_steps(model, opt, batches):
    model.train()
    for x, y in batches:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def params_of(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def max_abs_diff(xs, ys):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(xs, ys))


# --- DiLoCo with one peer, outer lr 1 and no momentum is plain local training -----------


def test_outer_lr_1_momentum_0_one_peer_equals_local_training(batches):
    model = build_model("tiny", seed=0)
    params = list(model.parameters())
    outer = OuterOptimizer(params, lr=1.0, momentum=0.0)
    start = [p.detach().clone() for p in params]
    assert max_abs_diff(outer.theta, start) == 0.0

    inner_steps(model, adamw(model), batches[:3])
    local = [p.detach().clone() for p in params]
    assert max_abs_diff(local, start) > 1e-4  # training really moved the weights

    delta = outer.pseudo_gradient(params)
    for d, s, l in zip(delta, start, local):
        assert d.dtype == torch.float32 and d.shape == s.shape
        assert torch.equal(d, s - l)  # Δ = θ_global − θ_local

    outer.step(delta)
    assert max_abs_diff(outer.theta, local) <= 1e-7
    outer.copy_to(params)
    for p, t in zip(params, outer.theta):
        assert torch.equal(p.detach(), t)


def test_two_outer_steps_at_lr_1_track_uninterrupted_training(batches):
    """H=3, two outer steps, inner AdamW state kept (as the node does) == 6 plain AdamW steps."""
    plain = build_model("tiny", seed=0)
    inner_steps(plain, adamw(plain), batches)

    model = build_model("tiny", seed=0)
    params = list(model.parameters())
    outer = OuterOptimizer(params, lr=1.0, momentum=0.0)
    opt = adamw(model)
    for h in range(2):
        inner_steps(model, opt, batches[3 * h : 3 * h + 3])
        outer.step(outer.pseudo_gradient(params))
        outer.copy_to(params)
    # θ_global equals θ_local to ~1 ulp after each outer step; AdamW's normalised updates amplify
    # that rounding a little over the next steps, still far below the distance trained.
    trained = max_abs_diff(list(plain.parameters()), list(build_model("tiny", seed=0).parameters()))
    assert trained > 1e-3
    assert max_abs_diff(outer.theta, list(plain.parameters())) <= 1e-5


# --- the outer step is torch's Nesterov SGD ----------------------------------------------


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (0.3, 0.5), (0.7, 0.0)])
def test_outer_step_matches_hand_computed_nesterov(lr, momentum):
    shapes = [(3, 4), (5,), (2, 3, 2)]
    params = params_of(shapes, seed=1)
    outer = OuterOptimizer(params, lr=lr, momentum=momentum)
    theta = [p.detach().double().clone() for p in params]
    buf = [torch.zeros_like(t) for t in theta]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(*s, generator=g) for s in shapes]
        outer.step(grads)
        for i, grad in enumerate(grads):
            grad = grad.double()
            buf[i] = momentum * buf[i] + grad
            update = grad + momentum * buf[i] if momentum > 0 else grad
            theta[i] = theta[i] - lr * update
        for mine, expected in zip(outer.theta, theta):
            assert torch.allclose(mine.double(), expected, rtol=1e-6, atol=1e-6)


def test_step_does_not_keep_a_reference_to_the_gradient():
    params = params_of([(4,)], seed=3)
    outer = OuterOptimizer(params, lr=0.5, momentum=0.9)
    grad = torch.ones(4)
    outer.step([grad])
    grad.fill_(1000.0)  # the caller reuses its buffer
    assert outer.theta[0].grad is None
    assert torch.allclose(outer.theta[0], params[0].detach() - 0.5 * (1 + 0.9) * torch.ones(4))


# --- state_dict / load_state_dict -------------------------------------------------------


def test_state_dict_roundtrip_continues_identically(checkpoint_copy):
    shapes = [(3, 4), (5,)]
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(4)]

    a = OuterOptimizer(params_of(shapes, seed=5), lr=0.7, momentum=0.9)
    for gr in grads[:2]:
        a.step(gr)
    saved = checkpoint_copy(a.state_dict())

    b = OuterOptimizer(params_of(shapes, seed=6), lr=0.7, momentum=0.9)  # other weights, no momentum yet
    b.load_state_dict(saved)
    c = OuterOptimizer(params_of(shapes, seed=6), lr=0.7, momentum=0.9)
    c.load_state_dict({"theta": saved["theta"], "optimizer": c.optimizer.state_dict()})  # θ only, no momentum
    for gr in grads[2:]:
        a.step(gr)
        b.step(gr)
        c.step(gr)
    for x, y in zip(a.theta, b.theta):
        assert torch.equal(x, y)
    assert max_abs_diff(a.theta, c.theta) > 1e-3  # without the momentum the run would diverge: the test can fail


def test_state_dict_holds_the_live_tensors_not_copies():
    """The checkpoint streams θ_global and the momentum from their own memory (no snapshot copy)."""
    params = params_of([(3,)], seed=7)
    outer = OuterOptimizer(params, lr=1.0, momentum=0.9)
    outer.step([torch.ones(3)])
    state = outer.state_dict()
    assert state["theta"][0] is outer.theta[0]
    assert state["optimizer"]["state"][0]["momentum_buffer"] is outer.momentum_buffers()[0]


def test_load_state_dict_refuses_other_shapes_and_changes_nothing(checkpoint_copy):
    outer = OuterOptimizer(params_of([(3, 4), (5,)], seed=8), lr=0.7, momentum=0.9)
    outer.step([torch.ones(3, 4), torch.ones(5)])
    before = checkpoint_copy(outer.state_dict())

    other_shapes = OuterOptimizer(params_of([(4, 3), (5,)], seed=9), lr=0.7, momentum=0.9)
    fewer = OuterOptimizer(params_of([(3, 4)], seed=9), lr=0.7, momentum=0.9)
    bad_momentum = checkpoint_copy(outer.state_dict())
    bad_momentum["optimizer"]["state"][1]["momentum_buffer"] = torch.zeros(6)
    for state in (other_shapes.state_dict(), fewer.state_dict(), bad_momentum):
        with pytest.raises(ValueError, match="shapes"):
            outer.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(outer.theta, before["theta"]))
        momentum = [outer.optimizer.state[t]["momentum_buffer"] for t in outer.theta]
        assert all(torch.equal(x, s["momentum_buffer"]) for x, s in zip(momentum, before["optimizer"]["state"].values()))


def test_a_real_model_refuses_another_presets_state():
    tiny = OuterOptimizer(build_model("tiny", seed=0).parameters())
    with torch.device("meta"):
        from diloco_swarm.models import GPT, PRESETS

        wider = GPT(PRESETS["small"])
    state = {"theta": [torch.empty(p.shape) for p in wider.parameters()], "optimizer": {}}
    with pytest.raises(ValueError, match="shapes"):
        tiny.load_state_dict(state)


def test_step_refuses_a_gradient_of_other_shapes_and_changes_nothing():
    params = params_of([(3, 4), (5,)], seed=10)
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9)
    theta = [t.clone() for t in outer.theta]
    for grads in ([torch.ones(3, 4)], [torch.ones(3, 4), torch.ones(6)], [torch.ones(12), torch.ones(5)],
                  [torch.ones(3, 4), torch.ones(5), torch.ones(1)]):
        with pytest.raises(ValueError):
            outer.step(grads)
    assert all(torch.equal(x, y) for x, y in zip(outer.theta, theta))
    assert all(not m.any() for m in outer.momentum_buffers()) and outer.generation.item() == 0
    with pytest.raises(ValueError):
        outer.pseudo_gradient(params[:1])
