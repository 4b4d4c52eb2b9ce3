"""Int8 blockwise codec for pseudo-gradients, on the hivemind wire.

Wraps ``bitsandbytes.functional.quantize_blockwise`` / ``dequantize_blockwise``
(Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861):
each block of ``BLOCKSIZE`` fp32 values is scaled by its absmax and mapped to the
256-entry dynamic code of ``bitsandbytes.functional.create_dynamic_map()``.

Wire format of one part (``runtime_pb2.Tensor.buffer``), little-endian::

    magic  b"DQ8" | version u8 | blocksize u32 | n_values u64 | absmax f32[n_blocks] | codes u8[n_values]

About 1 byte per value plus 4 bytes per block. The codebook is fixed and never sent, so a
peer cannot smuggle in a hostile one. Every field of an incoming buffer is checked before
use (:class:`CodecError`): another peer's bytes are untrusted.

Why not hivemind's own ``BlockwiseQuantization``: in hivemind 1.1.12 its ``extract`` raises
``TypeError`` under numpy 2 (``int()`` of a 1-element array). hivemind decodes by the wire
enum through ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``, so
:func:`register_codec` installs this codec there for ``BLOCKWISE_8BIT``; it runs when this
module is imported, before any averager process starts (forked children inherit it).
Remove the override once hivemind ships a numpy-2 fix *and* we accept its wire format.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as _hm_serialization
from hivemind.proto import runtime_pb2

BLOCKSIZE = 1024
_MAGIC = b"DQ8"
_VERSION = 1
_HEADER = struct.Struct("<3sBIQ")  # magic, version, blocksize, n_values
MAX_VALUES_PER_PART = 1 << 31  # hivemind splits tensors into parts far below this
_ALLOWED_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


class CodecError(ValueError):
    """A tensor cannot be encoded (non-finite, wrong dtype) or a received buffer is malformed."""


_bnb_lock = threading.Lock()
_bnb = None


def _bnb_functional():
    """Import ``bitsandbytes.functional`` on first use: the import takes ~5 s on a small CPU."""
    global _bnb
    if _bnb is None:
        with _bnb_lock:
            if _bnb is None:
                import bitsandbytes.functional as bnb_functional

                _bnb = bnb_functional
    return _bnb


_code_cache: torch.Tensor | None = None


def _dynamic_code() -> torch.Tensor:
    global _code_cache
    if _code_cache is None:
        _code_cache = _bnb_functional().create_dynamic_map(signed=True).float()
    return _code_cache


def _n_blocks(n_values: int, blocksize: int) -> int:
    return (n_values + blocksize - 1) // blocksize


def encode(values: torch.Tensor, blocksize: int = BLOCKSIZE) -> bytes:
    """Quantize a float tensor to the int8 blockwise wire format.

    :param values: any shape, float dtype (converted to fp32 on the CPU), finite values only.
    :param blocksize: values per absmax scale; one of 64..4096 (powers of two).
    :returns: ``16 + 4 * ceil(n / blocksize) + n`` bytes for ``n = values.numel()``.
    :raises CodecError: non-finite values, a non-float dtype or an unsupported blocksize.
    """
    if blocksize not in _ALLOWED_BLOCKSIZES:
        raise CodecError(f"blocksize must be one of {_ALLOWED_BLOCKSIZES}, got {blocksize}")
    if not values.is_floating_point():
        raise CodecError(f"the int8 codec takes float tensors, got {values.dtype}")
    flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    n_values = flat.numel()
    header = _HEADER.pack(_MAGIC, _VERSION, blocksize, n_values)
    if n_values == 0:
        return header
    _check_finite(flat)
    codes, state = _bnb_functional().quantize_blockwise(flat, code=_dynamic_code(), blocksize=blocksize)
    absmax = state.absmax.to(torch.float32).numpy()
    # join() reads the codes through the buffer protocol: one copy, into the result
    return b"".join((header, absmax.astype("<f4", copy=False).data, codes.numpy().data))


def _check_finite(flat: torch.Tensor) -> None:
    """Raise :class:`CodecError` if ``flat`` holds NaN or ±Inf, in one pass without a mask.

    Non-finite values absorb addition (NaN + x = NaN, Inf + finite = Inf, Inf - Inf = NaN), so a
    finite sum proves every value finite; only a non-finite sum (a NaN/Inf, or finite values whose
    sum overflows fp32) pays for the exact elementwise check. Not the block scales: bitsandbytes'
    CPU absmax skips NaN (``fmax``), so a NaN would pass unseen there.
    """
    if math.isfinite(float(flat.sum())):
        return
    finite = torch.isfinite(flat)
    if not bool(finite.all()):
        raise CodecError(f"refusing to encode {int((~finite).sum())} non-finite value(s) out of {flat.numel()}")


def decode(buffer: bytes, expected_numel: int | None = None) -> torch.Tensor:
    """Decode :func:`encode` output into a flat fp32 tensor of shape ``[n_values]``.

    :param buffer: bytes from an untrusted peer.
    :param expected_numel: if given, the value count the caller expects.
    :raises CodecError: bad magic/version/blocksize, wrong length, non-finite or negative
        scales, or a value count different from ``expected_numel``.
    """
    if len(buffer) < _HEADER.size:
        raise CodecError(f"int8 buffer too short ({len(buffer)} bytes)")
    magic, version, blocksize, n_values = _HEADER.unpack_from(buffer, 0)
    if magic != _MAGIC or version != _VERSION:
        raise CodecError("int8 buffer has an unknown magic or version")
    if blocksize not in _ALLOWED_BLOCKSIZES:
        raise CodecError(f"int8 buffer has an unsupported blocksize {blocksize}")
    if n_values > MAX_VALUES_PER_PART:
        raise CodecError(f"int8 buffer claims {n_values} values, above the limit {MAX_VALUES_PER_PART}")
    if expected_numel is not None and n_values != expected_numel:
        raise CodecError(f"int8 buffer holds {n_values} values, expected {expected_numel}")
    n_blocks = _n_blocks(n_values, blocksize)
    expected_len = _HEADER.size + 4 * n_blocks + n_values
    if len(buffer) != expected_len:
        raise CodecError(f"int8 buffer is {len(buffer)} bytes, expected {expected_len}")
    if n_values == 0:
        return torch.zeros(0, dtype=torch.float32)
    absmax = np.frombuffer(buffer, dtype="<f4", count=n_blocks, offset=_HEADER.size)
    if not np.isfinite(absmax).all() or (absmax < 0).any():
        raise CodecError("int8 buffer has non-finite or negative block scales")
    codes = np.frombuffer(buffer, dtype=np.uint8, count=n_values, offset=_HEADER.size + 4 * n_blocks)
    bnb = _bnb_functional()
    # copy(): frombuffer views are read-only, and bitsandbytes may write through them.
    codes_t = torch.from_numpy(codes.copy())
    absmax_t = torch.from_numpy(absmax.copy())
    return bnb.dequantize_blockwise(codes_t, absmax=absmax_t, code=_dynamic_code(), blocksize=blocksize).float()


def roundtrip(values: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """``decode(encode(values))`` reshaped like ``values``: what a receiving peer would see."""
    return decode(encode(values, blocksize)).reshape(values.shape)


def wire_bytes(n_values: int, blocksize: int = BLOCKSIZE) -> int:
    """Exact size in bytes of :func:`encode` output for ``n_values`` values."""
    return _HEADER.size + 4 * _n_blocks(n_values, blocksize) + n_values


class Int8BlockwiseCodec(CompressionBase):
    """hivemind ``CompressionBase`` adapter for :func:`encode` / :func:`decode`.

    Registered under the ``BLOCKWISE_8BIT`` wire enum (see module docstring). Only fp32
    tensors travel this way; ``extract`` raises :class:`CodecError` on malformed input,
    which hivemind's all-reduce treats as a failed peer.
    """

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(
            buffer=encode(tensor),
            size=tensor.shape,
            requires_grad=False,
            dtype="float32",
            compression=self.compression_type,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype != "float32":
            raise CodecError(f"int8 part declares dtype {serialized_tensor.dtype!r}, expected float32")
        shape = tuple(int(s) for s in serialized_tensor.size)
        if any(s < 0 for s in shape):
            raise CodecError("int8 part declares a negative dimension")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        return decode(serialized_tensor.buffer, expected_numel=numel).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.25 + 1.0 / BLOCKSIZE


def register_codec() -> None:
    """Install :class:`Int8BlockwiseCodec` as hivemind's decoder for ``BLOCKWISE_8BIT``. Idempotent."""
    if not isinstance(_hm_serialization._BASE_COMPRESSION_TYPES.get("BLOCKWISE_8BIT"), Int8BlockwiseCodec):
        _hm_serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = Int8BlockwiseCodec()


register_codec()
