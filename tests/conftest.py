"""Shared fixtures. Keep this file small: put a fixture here only when several test files use it."""

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
