"""Int8 blockwise codec for pseudo-gradients, on the hivemind wire.

Blockwise absmax quantization with a linear map (the int8 scheme of Dettmers et al.,
"LLM.int8()", arXiv 2208.07339, applied per block as in "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861): each block of ``BLOCKSIZE`` fp32 values ``x`` is sent as its
absmax ``s`` and the codes ``round(127 · x / s)`` in [-127, 127]; a receiver decodes ``code · s / 127``.
The round-trip error of one value is at most ``s / 254``.

Wire format of one part (``runtime_pb2.Tensor.buffer``), little-endian::

    magic  b"DQ8" | version u8 = 2 | blocksize u32 | n_values u64 | absmax f32[n_blocks] | codes i8[n_values]

About 1 byte per value plus 4 bytes per block. The map is fixed and never sent, so a peer cannot
smuggle in a hostile codebook. Every field of an incoming buffer is checked before use
(:class:`CodecError`): another peer's bytes are untrusted. A code of -128 (never produced by
:func:`encode`) decodes to ``-128/127 · s``, still bounded by its block's scale.

Version 1 mapped codes through bitsandbytes' dynamic code (``quantize_blockwise``); its CPU kernels
were slower than these numpy passes, at a larger error on pseudo-gradients (docs/benchmarks.md
section 2; why we changed, docs/decisions.md). Finiteness needs no pass of its own: a NaN or
±Inf makes its block's absmax non-finite.

Why not hivemind's own ``BlockwiseQuantization``: in hivemind 1.1.12 its ``extract`` raises
``TypeError`` under numpy 2 (``int()`` of a 1-element array). hivemind decodes by the wire
enum through ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``, so
:func:`register_codec` installs this codec there for ``BLOCKWISE_8BIT``; it runs when this
module is imported, before any averager process starts (forked children inherit it).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as _hm_serialization
from hivemind.proto import runtime_pb2

BLOCKSIZE = 1024
_MAGIC = b"DQ8"
_VERSION = 2  # 2: linear map in numpy; 1 (bitsandbytes' dynamic code) is refused
_HEADER = struct.Struct("<3sBIQ")  # magic, version, blocksize, n_values
MAX_VALUES_PER_PART = 1 << 31  # hivemind splits tensors into parts far below this
_ALLOWED_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
_LEVELS = np.float32(127.0)
_MIN_SCALE = np.float32(1e-30)  # a block whose absmax is below this is sent as zeros (127 / absmax would overflow fp32)


class CodecError(ValueError):
    """A tensor cannot be encoded (non-finite, wrong dtype) or a received buffer is malformed."""


def _n_blocks(n_values: int, blocksize: int) -> int:
    return (n_values + blocksize - 1) // blocksize


def _blocks(flat: np.ndarray, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole blocks as ``[n_whole, blocksize]``, the partial tail block as ``[1, rest]`` or ``[0, 0]``): views."""
    whole = flat.size // blocksize * blocksize
    return flat[:whole].reshape(-1, blocksize), flat[whole:].reshape(1, -1) if whole < flat.size else flat[:0].reshape(0, 0)


def _quantize(blocks: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Write the int8 codes of ``blocks`` (fp32 ``[k, b]``) into ``codes`` (int8 ``[k, b]``); return the
    absmax per block (fp32 ``[k]``), NaN or Inf when the block holds a non-finite value."""
    if blocks.size == 0:
        return np.zeros(blocks.shape[0], dtype=np.float32)
    absmax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))  # max/min propagate NaN; -(-Inf) = Inf
    if not np.isfinite(absmax).all():
        return absmax
    inv = np.divide(_LEVELS, absmax, out=np.zeros_like(absmax), where=absmax > _MIN_SCALE)
    scaled = np.multiply(blocks, inv[:, None])
    np.rint(scaled, out=scaled)  # |scaled| ≤ 127 by construction
    codes[...] = scaled  # fp32 -> int8: exact for integral values in range
    return absmax


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
    flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous().numpy()
    n_values = flat.size
    header = _HEADER.pack(_MAGIC, _VERSION, blocksize, n_values)
    if n_values == 0:
        return header
    n_blocks = _n_blocks(n_values, blocksize)
    out = bytearray(_HEADER.size + 4 * n_blocks + n_values)
    out[:_HEADER.size] = header
    absmax = np.frombuffer(out, dtype="<f4", count=n_blocks, offset=_HEADER.size)
    codes = np.frombuffer(out, dtype=np.int8, count=n_values, offset=_HEADER.size + 4 * n_blocks)
    whole, tail = _blocks(flat, blocksize)
    whole_codes, tail_codes = _blocks(codes, blocksize)
    absmax[:whole.shape[0]] = _quantize(whole, whole_codes)
    absmax[whole.shape[0]:] = _quantize(tail, tail_codes)
    if not np.isfinite(absmax).all():
        bad = int((~np.isfinite(flat)).sum())
        raise CodecError(f"refusing to encode {bad} non-finite value(s) out of {n_values}")
    return bytes(out)


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
    codes = np.frombuffer(buffer, dtype=np.int8, count=n_values, offset=_HEADER.size + 4 * n_blocks)
    scale = (absmax / _LEVELS).astype(np.float32, copy=False)
    out = np.empty(n_values, dtype=np.float32)
    (whole_codes, tail_codes), (whole_out, tail_out) = _blocks(codes, blocksize), _blocks(out, blocksize)
    np.multiply(whole_codes, scale[:whole_codes.shape[0], None], out=whole_out)
    np.multiply(tail_codes, scale[whole_codes.shape[0]:, None], out=tail_out)
    return torch.from_numpy(out)


def roundtrip(values: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """``decode(encode(values))`` reshaped like ``values``: what a receiving peer would see."""
    return decode(encode(values, blocksize)).reshape(values.shape)


def wire_bytes(n_values: int, blocksize: int = BLOCKSIZE) -> int:
    """Exact size in bytes of :func:`encode` output for ``n_values`` values."""
    return _HEADER.size + 4 * _n_blocks(n_values, blocksize) + n_values


def declared_shape(serialized: runtime_pb2.Tensor, codec: str) -> tuple[tuple[int, ...], int]:
    """(shape, value count) a received part declares. :raises CodecError: not float32, or a negative dimension."""
    if serialized.dtype != "float32":
        raise CodecError(f"{codec} part declares dtype {serialized.dtype!r}, expected float32")
    shape = tuple(int(s) for s in serialized.size)
    if any(s < 0 for s in shape):
        raise CodecError(f"{codec} part declares a negative dimension")
    numel = 1
    for s in shape:  # (Python ints: a product past int64 is just large, refused by the decoder)
        numel *= s
    return shape, numel


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
        shape, numel = declared_shape(serialized_tensor, "int8")
        return decode(serialized_tensor.buffer, expected_numel=numel).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.25 + 1.0 / BLOCKSIZE


def register_codec() -> None:
    """Install :class:`Int8BlockwiseCodec` as hivemind's decoder for ``BLOCKWISE_8BIT``. Idempotent."""
    if not isinstance(_hm_serialization._BASE_COMPRESSION_TYPES.get("BLOCKWISE_8BIT"), Int8BlockwiseCodec):
        _hm_serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = Int8BlockwiseCodec()


register_codec()
