"""Sparse int8 codec for pseudo-gradients: the largest entries of each chunk, int8 against the chunk's absmax.

SparseLoCo (Sarfi et al., arXiv 2508.15706) and DeMo (Peng et al., arXiv 2411.19870) send only the top-k
entries of each chunk of Δ and keep the rest as error feedback (``node/feedback.py``). Here the values stay
int8 (the project's contract), linearly quantized against the absmax of their chunk as in ``codec.py``:
a value ``x`` of a chunk whose largest kept magnitude is ``s`` travels as ``round(127 · x / s)``.

Each flat part is cut into chunks of :data:`CHUNK` values from its start; a sender keeps the ``k`` entries
of largest magnitude per chunk (:func:`select`). Entries whose code rounds to 0 and zeros are not sent.

Wire format of one part (``runtime_pb2.Tensor.buffer``), little-endian::

    magic b"SQ8" | version u8 = 1 | chunk u32 | n_values u64 |
    counts u16[n_chunks] | absmax f32[n_chunks] | indices u12[m] (two per 3 bytes) | codes i8[m]

where ``m = Σ counts``; ``indices`` are positions within their chunk, strictly increasing within it.
About 2.5 bytes per sent entry plus 6 bytes per chunk. Every field of a received buffer is checked
(:class:`~diloco_swarm.averaging.codec.CodecError`): an index out of range, a duplicate or unsorted
index, more entries in a chunk than the run allows, a count that disagrees with the payload, a
non-finite or negative scale.

hivemind splits every tensor into parts of ``part_size_bytes / (4 · estimate_compression_ratio)``
values; :meth:`SparseInt8Codec.estimate_compression_ratio` makes that a multiple of :data:`CHUNK`, so a
part's chunks are its tensor's chunks and the node can compute exactly what its parts decode to
(:func:`roundtrip` on a whole tensor equals the parts' round trips laid end to end).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as _hm_serialization
from hivemind.proto import runtime_pb2

from diloco_swarm.averaging.codec import CodecError, declared_shape

CHUNK = 4096  # values per chunk; indices within a chunk take 12 bits
_MAGIC = b"SQ8"
_VERSION = 1
_HEADER = struct.Struct("<3sBIQ")  # magic, version, chunk, n_values
_LEVELS = 127.0
_MIN_SCALE = 1e-30  # a chunk whose absmax is below this sends nothing (127 / absmax would overflow fp32)
PART_VALUES = 1 << 20  # hivemind's part of a sparse all-reduce: 256 chunks (see estimate_compression_ratio); the most a part holds
_SELECT_ROWS = PART_VALUES // CHUNK  # chunks selected at a time: a few MB of temporaries whatever the tensor's size
# the sparse modes of ``--compression``: (entries kept per chunk of CHUNK values: 1% and 2%, rounded; whether a
# reducer cuts its average back to that many). The "-cut" modes are measured (bench wire, bench quality), not offered
SPARSE_MODES: dict[str, tuple[int, bool]] = {"sparse1-int8": (41, False), "sparse2-int8": (82, False),
                                             "sparse1-int8-cut": (41, True), "sparse2-int8-cut": (82, True)}


def _n_chunks(n_values: int) -> int:
    return (n_values + CHUNK - 1) // CHUNK


def _top_per_chunk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions within their chunk, sorted, int64 ``[n_chunks, k']``; the values there, fp32) of the ``k'`` =
    min(k, CHUNK) entries of largest magnitude of each chunk of ``flat`` (fp32 CPU ``[n]``, n ≥ 1; a partial last
    chunk is padded with zeros, which are never kept by the callers). NaN ranks above every number: kept."""
    n_chunks, top = _n_chunks(flat.numel()), min(k, CHUNK)
    values = flat.numpy()
    within = np.empty((n_chunks, top), dtype=np.int64)
    kept = np.empty((n_chunks, top), dtype=np.float32)
    for first in range(0, n_chunks, _SELECT_ROWS):
        last = min(n_chunks, first + _SELECT_ROWS)
        rows = values[first * CHUNK:last * CHUNK]
        if rows.size < (last - first) * CHUNK:
            rows = np.concatenate([rows, np.zeros((last - first) * CHUNK - rows.size, dtype=np.float32)])
        rows = rows.reshape(-1, CHUNK)
        # numpy's introselect costs the same whatever k; torch.topk's CPU kernel slows with k (docs/decisions.md)
        idx = np.sort(np.argpartition(np.abs(rows), CHUNK - top, axis=1)[:, CHUNK - top:], axis=1)
        within[first:last], kept[first:last] = idx, np.take_along_axis(rows, idx, axis=1)
    return torch.from_numpy(within), torch.from_numpy(kept)


def _as_flat(values: torch.Tensor, k: int) -> torch.Tensor:
    """``values`` flattened, fp32 on the CPU. :raises CodecError: a non-float dtype or ``k`` out of 1..CHUNK."""
    if not 1 <= k <= CHUNK:
        raise CodecError(f"entries per chunk must be within 1..{CHUNK}, got {k}")
    if not values.is_floating_point():
        raise CodecError(f"the sparse codec takes float tensors, got {values.dtype}")
    return values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)


def _positions(within: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64 ``[n_chunks, k']``) of positions within their chunk."""
    return within + torch.arange(within.shape[0]).unsqueeze(1) * CHUNK


def _quantize(kept: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each chunk's scale: its absmax, 0 below ``_MIN_SCALE``, fp32 ``[n_chunks]``; the int8 codes of ``kept``)
    for ``kept`` (fp32 ``[n_chunks, k']``, :func:`_top_per_chunk` of ``flat``). :raises CodecError: non-finite."""
    absmax = kept.abs().amax(dim=1)  # the top k of a chunk hold its absmax, and any NaN or ±Inf
    if not bool(torch.isfinite(absmax).all()):
        raise CodecError(f"refusing to encode {int((~torch.isfinite(flat)).sum())} non-finite value(s) "
                         f"out of {flat.numel()}")
    scale = torch.where(absmax > _MIN_SCALE, _LEVELS / absmax.clamp(min=_MIN_SCALE), torch.zeros_like(absmax))
    codes = torch.round(kept * scale.unsqueeze(1)).to(torch.int8)
    return torch.where(absmax > _MIN_SCALE, absmax, torch.zeros_like(absmax)), codes


def select(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` entries of largest magnitude in each chunk of :data:`CHUNK` values.

    :param values: any shape (flattened), float dtype (converted to fp32 on the CPU).
    :param k: entries per chunk, 1..CHUNK.
    :returns: int64 ``[m]``, sorted, positions into ``values.reshape(-1)``; zeros are left out, so
        ``m ≤ k · ceil(n / CHUNK)``. Ties are broken by ``numpy.argpartition``: the same on one machine, maybe
        not between peers (numpy picks a kernel for the CPU), which nothing relies on.
    :raises CodecError: a non-float dtype or ``k`` out of range.
    """
    flat = _as_flat(values, k)
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    within, kept = _top_per_chunk(flat, k)
    return _positions(within)[kept != 0]  # (not "> 0" of a magnitude: a NaN stays, for encode to refuse it)


def sparsify(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sender's selection of ``values`` and what a receiver decodes of it, from one selection.

    :param values: any shape (flattened), float dtype (converted to fp32 on the CPU), finite.
    :param k: entries per chunk, 1..CHUNK.
    :returns: (the positions :func:`select` gives, int64 ``[m]``; ``values`` there, fp32 ``[m]``; what
        :func:`roundtrip` of ``values`` holds there, fp32 ``[m]``, 0 where the code rounds to 0).
    :raises CodecError: non-finite values, a non-float dtype or ``k`` out of range.
    """
    flat = _as_flat(values, k)
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0)
    within, kept = _top_per_chunk(flat, k)
    absmax, codes = _quantize(kept, flat)
    received = codes.to(torch.float32) * (absmax / _LEVELS).unsqueeze(1)  # as decode computes it, in fp32
    nonzero = kept != 0
    return _positions(within)[nonzero], kept[nonzero], received[nonzero]


def _pack12(indices: np.ndarray) -> bytes:
    """Indices < 4096 (uint16 ``[m]``), two per 3 bytes (an odd count is padded with a zero index)."""
    if indices.size % 2:
        indices = np.append(indices, np.uint16(0))
    a, b = indices[0::2].astype(np.uint16), indices[1::2].astype(np.uint16)
    out = np.empty((a.size, 3), dtype=np.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    out[:, 2] = b >> 4
    return out.tobytes()


def _unpack12(raw: np.ndarray, m: int) -> np.ndarray:
    """Inverse of :func:`_pack12` for ``m`` indices (int64 ``[m]``). :raises CodecError: a non-zero pad."""
    triples = raw.reshape(-1, 3).astype(np.int64)
    out = np.empty(triples.shape[0] * 2, dtype=np.int64)
    out[0::2] = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    out[1::2] = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    if out.size > m and out[m] != 0:
        raise CodecError("sparse buffer has a non-zero index padding")
    return out[:m]


def packed_index_bytes(m: int) -> int:
    return (m + 1) // 2 * 3


def encode(values: torch.Tensor, k: int) -> bytes:
    """The top ``k`` entries of each chunk of ``values`` (:func:`select`), int8 against their chunk's absmax.

    :param values: any shape, float dtype (converted to fp32 on the CPU), finite.
    :param k: entries per chunk, 1..CHUNK.
    :returns: the wire format above.
    :raises CodecError: non-finite values, a non-float dtype or ``k`` out of range.
    """
    flat = _as_flat(values, k)
    n = flat.numel()
    header = _HEADER.pack(_MAGIC, _VERSION, CHUNK, n)
    if n == 0:
        return header
    within, kept = _top_per_chunk(flat, k)
    absmax, codes = _quantize(kept, flat)
    sent = codes != 0  # zeros (a padded or sparse chunk) and values that round to 0 are not sent
    counts = sent.sum(dim=1).numpy().astype("<u2")
    return b"".join((header, counts.tobytes(), absmax.numpy().astype("<f4").tobytes(),
                     _pack12(within[sent].numpy().astype(np.uint16)), codes[sent].numpy().tobytes()))


def decode(buffer: bytes, expected_numel: int | None, max_per_chunk: int) -> torch.Tensor:
    """Decode :func:`encode` output into a flat fp32 tensor ``[n_values]`` (zeros where nothing was sent).

    :param buffer: bytes from an untrusted peer.
    :param expected_numel: the value count the caller expects (None: any, up to the part limit).
    :param max_per_chunk: the most entries a chunk may carry (the run's ``k``, or more for an average).
    :raises CodecError: a malformed buffer (see the module docstring), naming what is wrong.
    """
    if len(buffer) < _HEADER.size:
        raise CodecError(f"sparse buffer too short ({len(buffer)} bytes)")
    magic, version, chunk, n = _HEADER.unpack_from(buffer, 0)
    if magic != _MAGIC or version != _VERSION or chunk != CHUNK:
        raise CodecError("sparse buffer has an unknown magic, version or chunk size")
    if n > PART_VALUES:  # (a few bytes per chunk must not decode to gigabytes)
        raise CodecError(f"sparse buffer holds {n} values, more than the {PART_VALUES} a part may hold")
    if expected_numel is not None and n != expected_numel:
        raise CodecError(f"sparse buffer holds {n} values, expected {expected_numel}")
    if n == 0:
        if len(buffer) != _HEADER.size:
            raise CodecError("sparse buffer of 0 values has a payload")
        return torch.zeros(0, dtype=torch.float32)
    n_chunks = _n_chunks(n)
    offset = _HEADER.size
    if len(buffer) < offset + 6 * n_chunks:
        raise CodecError(f"sparse buffer is {len(buffer)} bytes, too short for {n_chunks} chunks")
    counts = np.frombuffer(buffer, dtype="<u2", count=n_chunks, offset=offset).astype(np.int64)
    absmax = np.frombuffer(buffer, dtype="<f4", count=n_chunks, offset=offset + 2 * n_chunks)
    offset += 6 * n_chunks
    chunk_len = np.full(n_chunks, CHUNK, dtype=np.int64)
    chunk_len[-1] = n - (n_chunks - 1) * CHUNK
    if (counts > np.minimum(chunk_len, max_per_chunk)).any():
        worst = int(counts.max())
        raise CodecError(f"sparse buffer sends {worst} entries in a chunk, more than the {max_per_chunk} allowed")
    m = int(counts.sum())
    expected_len = offset + packed_index_bytes(m) + m
    if len(buffer) != expected_len:
        raise CodecError(f"sparse buffer is {len(buffer)} bytes; its counts ({m} entries) need {expected_len}")
    if not np.isfinite(absmax).all() or np.signbit(absmax).any():
        raise CodecError("sparse buffer has non-finite or negative chunk scales")
    within = _unpack12(np.frombuffer(buffer, dtype=np.uint8, count=packed_index_bytes(m), offset=offset), m)
    codes = np.frombuffer(buffer, dtype=np.int8, count=m, offset=offset + packed_index_bytes(m))
    if m and ((codes == 0).any() or (codes == -128).any()):  # encode never sends either: 0 is not an entry
        raise CodecError("sparse buffer has a code of 0 or -128")
    chunk_of = np.repeat(np.arange(n_chunks, dtype=np.int64), counts)
    if (within >= chunk_len[chunk_of]).any():
        raise CodecError("sparse buffer has an index out of range")
    positions = chunk_of * CHUNK + within
    if m > 1 and not (np.diff(positions) > 0).all():
        raise CodecError("sparse buffer has unsorted or duplicate indices")
    out = torch.zeros(n, dtype=torch.float32)
    scale = (absmax / np.float32(_LEVELS)).astype(np.float32)
    out[torch.from_numpy(positions)] = torch.from_numpy(codes.astype(np.float32) * scale[chunk_of])
    return out


def roundtrip(values: torch.Tensor, k: int) -> torch.Tensor:
    """What a receiving peer sees of ``values`` sent with ``k`` entries per chunk, shaped like ``values``:
    ``decode(encode(·))`` of each part of :data:`PART_VALUES` values cut from its start, as hivemind cuts a
    tensor (a part's chunks are its tensor's, so the cut changes nothing but the size a decode allows)."""
    flat = values.detach().reshape(-1)
    parts = [decode(encode(p, k), p.numel(), k) for p in flat.split(PART_VALUES)]
    return (torch.cat(parts) if parts else torch.zeros(0)).reshape(values.shape)


def wire_bytes(n_values: int, n_entries: int) -> int:
    """Size in bytes of a part of ``n_values`` values carrying ``n_entries`` entries."""
    return _HEADER.size + 6 * _n_chunks(n_values) + packed_index_bytes(n_entries) + n_entries


class SparseInt8Codec(CompressionBase):
    """hivemind ``CompressionBase`` adapter for :func:`encode` / :func:`decode`.

    A sender's part keeps ``per_chunk`` entries of each chunk; a reducer's average of ``n`` such parts
    holds up to ``n · per_chunk`` non-zeros per chunk, sent as they are (``resparsify=False``: every member
    applies the mean of the sparse parts, int8 again, as an all-gather would give it) or cut back to the top
    ``per_chunk`` (``resparsify=True``: half the upload, the rest of the average lost). Registered under the
    ``UNIFORM_8BIT`` wire enum (:func:`register_codec`); the all-reduce decodes with the instance of its
    run (:meth:`extract`, :meth:`extract_average`), which knows how many entries a chunk may carry.

    :param per_chunk: entries a sender keeps per chunk of :data:`CHUNK` values, 1..CHUNK.
    :param resparsify: the reducer's average is cut back to ``per_chunk`` entries per chunk.
    """

    compression_type = runtime_pb2.CompressionType.UNIFORM_8BIT

    def __init__(self, per_chunk: int = SPARSE_MODES["sparse1-int8"][0], resparsify: bool = False):
        if not 1 <= per_chunk <= CHUNK:
            raise ValueError(f"per_chunk must be within 1..{CHUNK}, got {per_chunk}")
        self.per_chunk, self.resparsify = per_chunk, resparsify

    def average_per_chunk(self, n_senders: int) -> int:
        """The most entries per chunk of a reducer's average of ``n_senders`` parts."""
        return self.per_chunk if self.resparsify else min(CHUNK, max(1, n_senders) * self.per_chunk)

    def _message(self, tensor: torch.Tensor, k: int) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(buffer=encode(tensor, k), size=tensor.shape, requires_grad=False,
                                  dtype="float32", compression=self.compression_type)

    def _values(self, serialized: runtime_pb2.Tensor, k: int) -> torch.Tensor:
        shape, numel = declared_shape(serialized, "sparse")
        return decode(serialized.buffer, numel, k).reshape(shape)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self._message(tensor, self.per_chunk)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self._values(serialized_tensor, self.per_chunk)

    def compress_average(self, tensor: torch.Tensor, n_senders: int) -> runtime_pb2.Tensor:
        return self._message(tensor, self.average_per_chunk(n_senders))

    def extract_average(self, serialized_tensor: runtime_pb2.Tensor, n_senders: int) -> torch.Tensor:
        return self._values(serialized_tensor, self.average_per_chunk(n_senders))

    def as_received(self, tensor: torch.Tensor) -> torch.Tensor:
        """Our own part as a reducer counts it: what it would decode to had it crossed the wire."""
        return roundtrip(tensor, self.per_chunk)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # not the byte ratio: chosen so hivemind's parts hold PART_VALUES values (a whole number of chunks)
        return DEFAULT_PART_SIZE_BYTES / (4.0 * PART_VALUES)


class _AnySparse(SparseInt8Codec):
    """The decoder hivemind's registry holds for ``UNIFORM_8BIT``: structurally checked, any count per chunk."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self._values(serialized_tensor, CHUNK)


def register_codec() -> None:
    """Install a sparse decoder as hivemind's for ``UNIFORM_8BIT`` (its own uniform codec would misread our
    bytes if anything decoded them through the registry). Idempotent."""
    if not isinstance(_hm_serialization._BASE_COMPRESSION_TYPES.get("UNIFORM_8BIT"), SparseInt8Codec):
        _hm_serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = _AnySparse()


register_codec()
