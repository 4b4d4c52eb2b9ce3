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
