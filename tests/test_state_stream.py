"""A state download cut mid-tensor (a donor that left) or filled with garbage gives one clear error."""

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.utils.streaming import split_for_streaming

from diloco_swarm.averaging.averager import _tensor_from_parts


def _parts(t: torch.Tensor, chunk: int = 1024) -> list:
    return list(split_for_streaming(serialize_torch_tensor(t), chunk))


def test_whole_stream_gives_the_tensor_back():
    t = torch.randn(64, 33)
    parts = _parts(t)
    assert len(parts) > 2
    assert torch.equal(_tensor_from_parts(parts), t)


@pytest.mark.parametrize("cut", [1, 3])
def test_stream_cut_mid_tensor_is_one_clear_error(cut):
    parts = _parts(torch.randn(64, 33))
    with pytest.raises(ValueError, match="incomplete or malformed"):
        _tensor_from_parts(parts[:-cut])


def test_garbage_bytes_are_one_clear_error():
    parts = _parts(torch.randn(8, 8))
    parts[0].buffer = b"\xff" * 7
    with pytest.raises(ValueError, match="incomplete or malformed"):
        _tensor_from_parts(parts)


# --- a donation streams the donor's live state (averaging/donation.py) ------------------------------

def _donor(seed: int = 0):
    from diloco_swarm.node.outer import OuterOptimizer

    g = torch.Generator().manual_seed(seed)
    outer = OuterOptimizer([torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((300, 7), (50,), (3, 3))])
    outer.step([torch.randn(t.shape, generator=g) for t in outer.theta])
    return outer


def _tensors_of(messages) -> list[torch.Tensor]:
    tensors, parts = [], []
    for message in messages:
        if message.tensor_part.dtype and parts:
            tensors.append(_tensor_from_parts(parts))
            parts = []
        parts.append(message.tensor_part)
    return tensors + [_tensor_from_parts(parts)]


def test_a_donation_streams_the_live_state_exactly_and_counts_itself():
    import asyncio

    from hivemind.compression import NoCompression

    from diloco_swarm.averaging.donation import StateSeal, stream_state

    outer = _donor()
    live = outer.theta + outer.momentum_buffers()
    assert all(t.is_shared() for t in [*live, outer.generation]), "the averager process maps them: shared memory"
    donations = torch.zeros(1, dtype=torch.int64)
    seal = StateSeal(outer.generation, int(outer.generation.item()))

    async def run():
        messages = []
        async for message in stream_state(b"meta", live, seal, NoCompression(), donations):
            assert donations.item() == 1, "a stream in flight is counted (the node holds its apply back meanwhile)"
            messages.append(message)
        return messages

    messages = asyncio.run(run())
    assert messages[0].metadata == b"meta" and not any(m.metadata for m in messages[1:])
    assert donations.item() == 0
    tensors = _tensors_of(messages)
    assert len(tensors) == len(live)
    assert all(torch.equal(t, l) for t, l in zip(tensors, live))


def test_a_write_while_the_state_streams_ends_the_stream_before_a_torn_tensor_is_sent():
    import asyncio

    from hivemind.compression import NoCompression

    from diloco_swarm.averaging.donation import StateSeal, TornState, stream_state

    outer = _donor(1)
    live = outer.theta + outer.momentum_buffers()
    donations = torch.zeros(1, dtype=torch.int64)
    seal = StateSeal(outer.generation, int(outer.generation.item()))
    before = [t.clone() for t in live]

    async def run():
        sent = []
        stream = stream_state(b"meta", live, seal, NoCompression(), donations)
        with pytest.raises(TornState, match="changed while its state streamed"):
            async for message in stream:
                sent.append(message)
                if len(sent) == 1:  # the first tensor is out: an outer step lands now
                    outer.step([torch.ones_like(t) for t in outer.theta])
        return sent

    sent = asyncio.run(run())
    assert donations.item() == 0
    # what was sent is the state before the step, and nothing of it after
    assert [t.shape for t in _tensors_of(sent)] == [before[0].shape]
    assert torch.equal(_tensors_of(sent)[0], before[0])
    assert not torch.equal(live[0], before[0])


def test_the_outer_state_stays_shared_and_counts_writes_through_steps_loads_and_checkpoints():
    outer = _donor(2)
    generation = int(outer.generation.item())
    buffers = outer.momentum_buffers()
    state = {k: v for k, v in outer.state_dict().items()}
    copy = {"theta": [t.clone() for t in state["theta"]],
            "optimizer": {**state["optimizer"], "state": {i: {"momentum_buffer": s["momentum_buffer"].clone() * 2}
                                                          for i, s in state["optimizer"]["state"].items()}}}
    outer.load_state_dict(copy)
    assert outer.generation.item() > generation
    assert all(a is b for a, b in zip(outer.momentum_buffers(), buffers)), "loaded into our own shared buffers"
    assert all(b.is_shared() for b in outer.momentum_buffers())
    assert torch.equal(outer.momentum_buffers()[0], copy["optimizer"]["state"][0]["momentum_buffer"])
    generation = int(outer.generation.item())
    outer.load_tensor(1, outer.theta[1] + 1, buffers[1])
    assert outer.generation.item() > generation
