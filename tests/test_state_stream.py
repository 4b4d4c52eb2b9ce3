"""A state download cut mid-tensor (a donor that left) or filled with garbage gives one clear error."""

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.utils.streaming import split_for_streaming

from diloco_swarm.averaging.state_sharing import tensor_from_parts


def _parts(t: torch.Tensor, chunk: int = 1024) -> list:
    return list(split_for_streaming(serialize_torch_tensor(t), chunk))


def test_whole_stream_gives_the_tensor_back():
    t = torch.randn(64, 33)
    parts = _parts(t)
    assert len(parts) > 2
    assert torch.equal(tensor_from_parts(parts), t)


@pytest.mark.parametrize("cut", [1, 3])
def test_stream_cut_mid_tensor_is_one_clear_error(cut):
    parts = _parts(torch.randn(64, 33))
    with pytest.raises(ValueError, match="incomplete or malformed"):
        tensor_from_parts(parts[:-cut])


def test_garbage_bytes_are_one_clear_error():
    parts = _parts(torch.randn(8, 8))
    parts[0].buffer = b"\xff" * 7
    with pytest.raises(ValueError, match="incomplete or malformed"):
        tensor_from_parts(parts)


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
            tensors.append(tensor_from_parts(parts))
            parts = []
        parts.append(message.tensor_part)
    return tensors + [tensor_from_parts(parts)]


def _sealed(outer):
    from diloco_swarm.averaging.donation import StateSeal

    return outer.theta + outer.momentum_buffers(), StateSeal(outer.generation, int(outer.generation.item()))


def test_a_donation_streams_the_live_state_exactly_and_counts_itself():
    import asyncio

    from hivemind.compression import NoCompression

    from diloco_swarm.averaging.donation import Donations

    outer, donations = _donor(), Donations()
    live, seal = _sealed(outer)
    assert all(t.is_shared() for t in [*live, outer.generation]), "the averager process maps them: shared memory"

    async def run():
        messages = []
        async for message in donations.stream(b"meta", live, seal, NoCompression()):
            assert donations.streaming(), "a stream in flight is counted (the node holds its apply back meanwhile)"
            messages.append(message)
        return messages

    messages = asyncio.run(run())
    assert messages[0].metadata == b"meta" and not any(m.metadata for m in messages[1:])
    assert not donations.streaming()
    tensors = _tensors_of(messages)
    assert len(tensors) == len(live)
    assert all(torch.equal(t, l) for t, l in zip(tensors, live))
    assert donations.freeze(int(outer.generation.item()), timeout=0.1), "nothing streams: no copy to wait for"


def test_an_outer_step_while_the_state_streams_goes_on_from_a_frozen_copy():
    """A home uplink sends a state for longer than a phase lasts: the donor's next outer step must not
    cut the stream, nor tear what it sends."""
    import asyncio

    from hivemind.compression import NoCompression

    from diloco_swarm.averaging.donation import Donations

    outer, donations = _donor(1), Donations()
    live, seal = _sealed(outer)
    before = [t.clone() for t in live]

    async def run():
        messages = []
        async for message in donations.stream(b"meta", live, seal, NoCompression()):
            messages.append(message)
            if len(messages) == 1:  # the first tensor is out: the donor's outer step comes now
                assert await asyncio.to_thread(donations.freeze, seal.at, 5.0)
                outer.step([torch.ones_like(t) for t in outer.theta])
        return messages

    tensors = _tensors_of(asyncio.run(run()))
    assert not torch.equal(live[0], before[0]), "the outer step was applied meanwhile"
    assert len(tensors) == len(before) and all(torch.equal(t, b) for t, b in zip(tensors, before)), \
        "the joiner got the state of one outer step, the one its stream began with"
    assert not donations._frozen, "the copy lives only while its streams do"


def test_a_write_without_a_frozen_copy_ends_the_stream_before_a_torn_tensor_is_sent():
    import asyncio

    from hivemind.compression import NoCompression

    from diloco_swarm.averaging.donation import Donations, TornState

    outer, donations = _donor(2), Donations()
    live, seal = _sealed(outer)
    before = [t.clone() for t in live]

    async def run():
        sent = []
        with pytest.raises(TornState, match="changed while its state streamed"):
            async for message in donations.stream(b"meta", live, seal, NoCompression()):
                sent.append(message)
                if len(sent) == 1:  # a write that did not wait for the averager's copy
                    outer.step([torch.ones_like(t) for t in outer.theta])
        return sent

    sent = asyncio.run(run())
    assert not donations.streaming()
    assert [t.shape for t in _tensors_of(sent)] == [before[0].shape]
    assert torch.equal(_tensors_of(sent)[0], before[0])


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


def _stream_in_child(donations, live, seal, first_out, written, results) -> None:
    import asyncio

    from hivemind.compression import NoCompression

    async def run():
        messages = []
        async for message in donations.stream(b"meta", live, seal, NoCompression()):
            messages.append(message)
            if len(messages) == 1:
                first_out.set()
                await asyncio.to_thread(written.wait, 30)  # our loop keeps answering freeze requests meanwhile
        return messages

    results.put([t.clone().share_memory_() for t in _tensors_of(asyncio.run(run()))])


def test_the_freeze_works_across_processes_as_between_the_node_and_its_averager():
    import multiprocessing as mp

    from diloco_swarm.averaging.donation import Donations

    ctx = mp.get_context("fork")  # as hivemind forks the averager process
    outer, donations = _donor(3), Donations()
    live, seal = _sealed(outer)
    before = [t.clone() for t in live]
    first_out, written, results = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_stream_in_child, args=(donations, live, seal, first_out, written, results))
    child.start()
    try:
        assert first_out.wait(30), "the stream did not start"
        assert donations.streaming()
        assert donations.freeze(seal.at, timeout=10.0), "the averager's copy did not come"
        outer.step([torch.ones_like(t) for t in outer.theta])
        written.set()
        tensors = results.get(timeout=30)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert not torch.equal(outer.theta[0], before[0])
