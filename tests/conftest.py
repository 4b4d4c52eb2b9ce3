"""Shared fixtures. Keep this file small: put a fixture here only when several test files use it."""

import io

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Train tiny models with one torch thread: on a small shared CPU, torch's spinning
    intra-op threads make these tests several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def checkpoint_copy():
    """A function that copies a state dict as a checkpoint round trip does: torch.save, then
    torch.load(weights_only=True). The copy shares no tensor with the original (an optimizer's
    state_dict hands out its live tensors)."""

    def copy(state):
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    return copy
