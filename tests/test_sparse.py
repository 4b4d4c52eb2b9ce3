"""The sparse int8 modes (issue 38): the codec, its checks on untrusted parts, error feedback, the
round policy's feedback decisions, and real averagers over 127.0.0.1 in a sparse mode."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
import torch

from diloco_swarm.averaging import sparse
from diloco_swarm.averaging.codec import CodecError
from diloco_swarm.averaging.sparse import CHUNK, SparseInt8Codec, decode, encode, roundtrip, select, sparsify
from diloco_swarm.node.feedback import ErrorFeedback, Feedback

K = sparse.SPARSE_MODES["sparse1-int8"][0]


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# --- selection and the codec ---------------------------------------------------------------------
def test_select_keeps_the_k_largest_magnitudes_of_each_chunk_including_a_partial_last_one():
    x = gaussian(2 * CHUNK + 100, seed=1)
    where = select(x, K)
    assert where.numel() == 2 * K + K and bool((where[1:] > where[:-1]).all())
    for start, end in ((0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, x.numel())):
        chunk = x[start:end].abs()
        mine = where[(where >= start) & (where < end)] - start
        assert set(mine.tolist()) == set(torch.topk(chunk, K).indices.tolist())
    assert select(torch.zeros(CHUNK), K).numel() == 0  # zeros are never sent


def test_roundtrip_error_is_within_half_a_step_of_each_chunks_scale_and_nothing_else_is_sent():
    x = gaussian(3 * CHUNK + 17, seed=2)
    y = roundtrip(x, K)
    where = select(x, K)
    outside = torch.ones(x.numel(), dtype=torch.bool)
    outside[where] = False
    assert bool((y[outside] == 0).all())
    for c in range(4):
        in_chunk = where[(where >= c * CHUNK) & (where < (c + 1) * CHUNK)]
        scale = float(x[in_chunk].abs().max())
        assert float((y[in_chunk] - x[in_chunk]).abs().max()) <= scale / 254 * (1 + 1e-6)


def test_wire_size_is_about_two_and_a_half_bytes_per_entry():
    n = 64 * CHUNK
    buf = encode(gaussian(n, seed=3), K)
    sent = int((decode(buf, n, K) != 0).sum())
    assert len(buf) == sparse.wire_bytes(n, sent)
    assert len(buf) / n < 0.03  # 1% of the values at ~2.5 B each plus 6 B per chunk, against ~1.004 for dense int8


def test_a_tensor_selected_once_encodes_to_the_same_bytes_as_its_source():
    # the node hands the all-reduce its selection; the wire must carry what the node computed it sends
    x = gaussian(5 * CHUNK, seed=4)
    chosen = torch.zeros_like(x)
    where = select(x, K)
    chosen[where] = x[where]
    assert encode(chosen, K) == encode(x, K)


def test_sparsify_selects_once_what_select_gives_and_what_the_wire_decodes_to_there():
    # the error feedback subtracts what a receiver decodes: bit for bit, across parts and a partial chunk
    x = gaussian(sparse.PART_VALUES + 2 * CHUNK + 9, seed=7)
    x[CHUNK + 1] = 1e3  # a spike: the chunk's other kept values' codes round to 0
    x[2 * CHUNK:3 * CHUNK] *= 1e-32  # an absmax below the codec's smallest scale: nothing sent
    x[5 * CHUNK:6 * CHUNK] = 0.0  # nothing to send
    positions, values, received = sparsify(x, K)
    assert torch.equal(positions, select(x, K)) and torch.equal(values, x[positions])
    assert torch.equal(received, roundtrip(x, K)[positions])
    assert all(t.numel() == 0 for t in sparsify(torch.zeros(0), K))


@pytest.mark.parametrize("codec", [encode, sparsify])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [[7], [2 * CHUNK + 3], list(range(CHUNK, CHUNK + 3 * K))])  # a later, a partial, a
def test_non_finite_values_are_refused(codec, bad, where):  # chunk with more of them than it keeps: each ranks first
    x = gaussian(2 * CHUNK + 5)
    x[where] = bad
    with pytest.raises(CodecError, match="non-finite"):
        codec(x, K)


def test_a_selection_takes_the_largest_magnitudes_of_each_chunk_blocks_apart():
    x = gaussian(3 * sparse.PART_VALUES + CHUNK // 2, seed=6)  # selected PART_VALUES at a time, a partial chunk last
    rows = torch.cat([x, x.new_zeros(CHUNK // 2)]).view(-1, CHUNK)
    top = torch.topk(rows.abs(), K, dim=1).indices.sort(dim=1).values + torch.arange(rows.shape[0]).unsqueeze(1) * CHUNK
    assert torch.equal(select(x, K), top[top < x.numel()])
    with pytest.raises(CodecError, match="entries per chunk"):
        select(x, 0)


def test_parts_hold_whole_chunks_so_a_tensors_roundtrip_is_its_parts_laid_end_to_end():
    from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
    from hivemind.compression import CompressionInfo
    codec = SparseInt8Codec(K)
    x = gaussian(sparse.PART_VALUES + 3 * CHUNK + 5, seed=5)
    part_values = int(DEFAULT_PART_SIZE_BYTES / (4 * codec.estimate_compression_ratio(CompressionInfo.from_tensor(x))))
    assert part_values == sparse.PART_VALUES and part_values % CHUNK == 0
    parts = torch.cat([roundtrip(p, K) for p in x.split(part_values)])
    assert torch.equal(parts, roundtrip(x, K))


# --- malformed parts (bytes from an untrusted peer) ----------------------------------------------
def _fields(buf: bytes):
    _, _, _, n = sparse._HEADER.unpack_from(buf)
    c = (n + CHUNK - 1) // CHUNK
    counts = np.frombuffer(buf, "<u2", c, sparse._HEADER.size).astype(np.int64)
    m = int(counts.sum())
    idx_at = sparse._HEADER.size + 6 * c
    within = sparse._unpack12(np.frombuffer(buf, np.uint8, sparse.packed_index_bytes(m), idx_at), m)
    return n, c, counts, m, idx_at, within


def _with_indices(buf: bytes, within: np.ndarray) -> bytes:
    n, c, counts, m, idx_at, _ = _fields(buf)
    return buf[:idx_at] + sparse._pack12(within.astype(np.uint16)) + buf[idx_at + sparse.packed_index_bytes(m):]


def malformed(kind: str, buf: bytes) -> bytes:
    """``buf`` (a valid part) broken in one way: the checks of issue 38's list."""
    n, c, counts, m, idx_at, within = _fields(buf)
    if kind == "out-of-range":  # the last chunk is partial: an index past its end
        w = within.copy()
        w[-1] = (n - (c - 1) * CHUNK) + 3
        return _with_indices(buf, w)
    if kind == "duplicate":
        w = within.copy()
        w[1] = w[0]
        return _with_indices(buf, w)
    if kind == "unsorted":
        w = within.copy()
        w[0], w[1] = w[1], w[0]
        return _with_indices(buf, w)
    if kind == "too-many":  # a chunk claims more entries than the run's k (payload grown to match)
        bad = bytearray(buf)
        struct.pack_into("<H", bad, sparse._HEADER.size, int(counts[0]) + K)
        extra = K
        w = np.concatenate([within[:counts[0]], np.arange(CHUNK - extra, CHUNK), within[counts[0]:]])
        w[:counts[0] + extra].sort()
        codes = np.frombuffer(buf, np.int8, m, idx_at + sparse.packed_index_bytes(m))
        codes = np.concatenate([codes[:counts[0]], np.ones(extra, np.int8), codes[counts[0]:]])
        return bytes(bad[:idx_at]) + sparse._pack12(w.astype(np.uint16)) + codes.tobytes()
    if kind == "count-disagrees":  # a count one lower than the payload carries
        bad = bytearray(buf)
        struct.pack_into("<H", bad, sparse._HEADER.size, int(counts[0]) - 1)
        return bytes(bad)
    if kind == "bad-scale":
        bad = bytearray(buf)
        struct.pack_into("<f", bad, sparse._HEADER.size + 2 * c, float("nan"))
        return bytes(bad)
    raise ValueError(kind)


KINDS = ("out-of-range", "duplicate", "unsorted", "too-many", "count-disagrees", "bad-scale")
REASONS = {"out-of-range": "out of range", "duplicate": "unsorted or duplicate", "unsorted": "unsorted or duplicate",
           "too-many": "more than the", "count-disagrees": "need", "bad-scale": "scales"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_malformed_part_is_refused_with_what_is_wrong(kind):
    x = gaussian(2 * CHUNK + 300, seed=6)
    buf = encode(x, K)
    decode(buf, x.numel(), K)  # the valid one passes
    with pytest.raises(CodecError, match=REASONS[kind]):
        decode(malformed(kind, buf), x.numel(), K)


def test_truncated_or_foreign_buffers_and_a_wrong_count_are_refused():
    x = gaussian(CHUNK + 5, seed=7)
    buf = encode(x, K)
    for cut in (0, 5, sparse._HEADER.size, len(buf) - 1):
        with pytest.raises(CodecError):
            decode(buf[:cut], x.numel(), K)
    with pytest.raises(CodecError, match="magic"):
        decode(b"XQ8" + buf[3:], x.numel(), K)
    with pytest.raises(CodecError, match="expected"):
        decode(buf, x.numel() + 1, K)


def test_a_few_bytes_cannot_claim_a_huge_part_codes_encode_never_sends_are_refused_and_so_is_minus_zero():
    n = 2 * sparse.PART_VALUES  # all counts 0: 6 bytes per chunk would decode to 8 MB
    empty = sparse._HEADER.pack(sparse._MAGIC, sparse._VERSION, CHUNK, n) + bytes(6 * (n // CHUNK))
    with pytest.raises(CodecError, match="a part may hold"):
        decode(empty, None, K)
    x = gaussian(CHUNK, seed=8)
    buf = bytearray(encode(x, K))
    codes_at = len(buf) - int(np.frombuffer(bytes(buf), "<u2", 1, sparse._HEADER.size)[0])
    for code in (0, -128):
        bad = bytearray(buf)
        bad[codes_at] = code & 0xFF
        with pytest.raises(CodecError, match="code of 0 or -128"):
            decode(bytes(bad), CHUNK, K)
    bad = bytearray(buf)
    struct.pack_into("<f", bad, sparse._HEADER.size + 2, -0.0)
    with pytest.raises(CodecError, match="negative"):
        decode(bytes(bad), CHUNK, K)


def test_a_state_download_refuses_a_tensor_in_any_codec_but_fp32_before_decoding_it():
    from hivemind.utils.streaming import split_for_streaming

    from diloco_swarm.averaging.state_sharing import tensor_from_parts

    message = SparseInt8Codec(K).compress(gaussian(CHUNK), None)
    with pytest.raises(ValueError, match="incomplete or malformed"):
        tensor_from_parts(list(split_for_streaming(message, 1024)))


def test_an_average_may_hold_each_senders_entries_only_when_sent_as_is():
    parts = [roundtrip(gaussian(CHUNK, seed=s), K) for s in range(4)]
    mean = torch.stack(parts).mean(0)
    as_is, cut = SparseInt8Codec(K), SparseInt8Codec(K, resparsify=True)
    from hivemind.compression import CompressionInfo
    msg = as_is.compress_average(mean, 4)
    assert torch.equal(as_is.extract_average(msg, 4), roundtrip(mean, 4 * K))
    with pytest.raises(CodecError, match="more than the"):
        as_is.extract(msg)  # a sender's part may not carry that many
    assert int((cut.extract_average(cut.compress_average(mean, 4), 4) != 0).sum()) <= K
    assert as_is.compress(mean, CompressionInfo.from_tensor(mean)).compression == sparse.SparseInt8Codec.compression_type


# --- error feedback ------------------------------------------------------------------------------
def test_error_feedback_loses_nothing_what_was_sent_plus_the_residual_is_the_sum_of_the_deltas():
    shapes = [torch.Size([3 * CHUNK + 11]), torch.Size([64, 40])]
    ef = ErrorFeedback(shapes, K)
    total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sent_total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for r in range(6):
        delta = [gaussian(s.numel(), seed=10 + r).reshape(s) * (1 + r) for s in shapes]
        selection = ef.select(delta)
        for t, d in zip(total, delta):
            t += d.double()
        for st, where, s, dense in zip(sent_total, selection.positions, selection.sent, selection.dense):
            st.view(-1)[where] += s.double()
            # the all-reduce's input decodes on the wire to exactly what the feedback subtracts
            assert torch.equal(roundtrip(dense, K).reshape(-1)[where], s)
        ef.settle(Feedback.COMMIT_SENT, delta, selection)
    for t, st, e in zip(total, sent_total, ef.residual):
        assert torch.allclose(st + e.double(), t, atol=1e-4, rtol=0), float((st + e.double() - t).abs().max())
        assert float(e.abs().max()) > 0  # something is always owed


def test_a_late_round_keeps_the_residual_a_dropped_delta_resets_it_and_an_own_apply_subtracts_exact_values():
    shapes = [torch.Size([2 * CHUNK])]
    ef = ErrorFeedback(shapes, K)
    delta = [gaussian(2 * CHUNK, seed=20)]
    first = ef.select(delta)
    ef.settle(Feedback.COMMIT_SENT, delta, first)
    before = ef.residual[0].clone()
    selection = ef.select(delta)
    ef.settle(Feedback.KEEP, delta, selection)
    assert torch.equal(ef.residual[0], before)
    ef.settle(Feedback.COMMIT_OWN, delta, selection)  # the selection applied as it is: no quantization error left
    assert bool((ef.residual[0].view(-1)[selection.positions[0]] == 0).all())
    ef.settle(Feedback.RESET, delta, None)
    assert float(ef.residual[0].abs().max()) == 0.0


def test_a_checkpoints_residual_must_fit_the_model():
    ef = ErrorFeedback([torch.Size([10])], K)
    ef.load([torch.ones(10)])
    assert float(ef.residual[0].sum()) == 10.0
    for bad in ([torch.ones(11)], [], [torch.full((10,), float("inf"))]):
        with pytest.raises(ValueError):
            ef.load(bad)


# --- the round policy's decision -----------------------------------------------------------------
def test_feedback_action_follows_what_the_outer_step_did_with_the_round():
    from types import SimpleNamespace as NS

    from diloco_swarm.node import round_policy as policy

    sel = object()
    ok, failed, maybe = NS(ok=True, maybe_kept=False), NS(ok=False, maybe_kept=False), NS(ok=False, maybe_kept=True)
    act = policy.feedback_action
    assert act(policy.Apply(), NS(result=ok, selection=sel)) is Feedback.COMMIT_SENT
    assert act(policy.Apply(), NS(result=maybe, selection=sel)) is Feedback.COMMIT_SENT
    assert act(policy.Apply(), NS(result=failed, selection=sel)) is Feedback.COMMIT_OWN  # applied alone
    assert act(policy.Apply(), NS(result=failed, selection=None)) is Feedback.KEEP  # a solo round: Δ alone
    assert act(policy.Hold(), NS(result=failed, selection=sel)) is Feedback.KEEP
    assert act(policy.AdoptState(carry=True, wasted=False), NS(result=failed, selection=sel)) is Feedback.KEEP
    assert act(policy.AdoptState(carry=False, wasted=True), NS(result=failed, selection=None)) is Feedback.RESET
    assert act(policy.AdoptState(carry=False, wasted=False), NS(result=ok, selection=sel)) is Feedback.COMMIT_SENT
    assert act(policy.AdoptMixed(), NS(result=ok, selection=sel)) is Feedback.COMMIT_SENT
    # a round we may have kept, then a state that includes it: what we sent is in it (settle counts Δ wasted)
    assert act(policy.AdoptState(carry=False, wasted=True),
               NS(result=maybe, selection=sel, state=NS(includes_round=True))) is Feedback.COMMIT_SENT
    assert act(policy.AdoptState(carry=False, wasted=True),
               NS(result=maybe, selection=sel, state=NS(includes_round=False))) is Feedback.RESET


# --- real averagers over 127.0.0.1 ---------------------------------------------------------------
SHAPES = [(96, 128), (128,), (64, 64)]


def _deltas(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [1e-2 * torch.randn(s, generator=g) for s in SHAPES]


class MalformedSparseCodec(SparseInt8Codec):
    kind = "duplicate"

    def compress(self, tensor, info, allow_inplace=False):
        message = super().compress(tensor, info, allow_inplace)
        message.buffer = malformed(self.kind, message.buffer)
        return message


def _averagers(prefix: str, n: int, compression: str, bad: str | None = None):
    """``n`` averagers in ``compression`` (averagerlib); with ``bad``, the last sends parts malformed that way."""
    from averagerlib import averagers
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class SendsMalformedParts(PseudoGradientAverager):
        async def _run_consensus(self, *args, **kwargs) -> None:
            if isinstance(kwargs.get("compression"), SparseInt8Codec):
                codec = MalformedSparseCodec(kwargs["compression"].per_chunk)
                codec.kind = bad
                kwargs["compression"] = codec
            await super()._run_consensus(*args, **kwargs)

    SendsMalformedParts.__name__ = SendsMalformedParts.__qualname__ = PseudoGradientAverager.__name__
    types = (PseudoGradientAverager,) * (n - 1) + (SendsMalformedParts if bad else PseudoGradientAverager,)
    return averagers(prefix, n, (False,) * n, SHAPES, types, compression=compression)


def _round(averagers, inputs) -> list:
    from diloco_swarm.averaging.request import RoundRequest

    results: list = [None] * len(averagers)

    def run(i: int) -> None:
        results[i] = averagers[i].average(RoundRequest(delta=inputs[i], weight=100.0, metadata={}, timeout=30.0,
                                                       group_size=len(averagers)))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90.0)
    return results


@pytest.mark.timeout(180)
def test_three_averagers_in_a_sparse_mode_apply_one_verified_average_of_what_each_sent():
    feedbacks = [ErrorFeedback([torch.Size(s) for s in SHAPES], K) for _ in range(3)]
    deltas = [_deltas(i) for i in range(3)]
    selections = [f.select(d) for f, d in zip(feedbacks, deltas)]
    with _averagers("sparse3", 3, "sparse1-int8") as averagers:
        results = _round(averagers, [s.dense for s in selections])
    for result, _ in results:
        assert result is not None and result.ok, result
    averages = [[t.clone() for t in avg] for _, avg in results]
    for other in averages[1:]:
        assert all(torch.equal(a, b) for a, b in zip(averages[0], other))  # bit-identical on every member
    for i, avg in enumerate(averages[0]):  # the mean of what each sent, then int8 again on the way back
        sent = torch.zeros(3, avg.numel())
        for j, s in enumerate(selections):
            sent[j][s.positions[i]] = s.sent[i]
        mean = sent.mean(0)
        assert float((avg.reshape(-1) - mean).abs().max()) <= float(mean.abs().max()) / 254 + 1e-9
    p = sum(int(torch.Size(s).numel()) for s in SHAPES)
    assert all(r.bytes_sent < 0.15 * p for r, _ in results), [r.bytes_sent for r, _ in results]  # dense int8: ~1.3 P


@pytest.mark.timeout(180)
def test_a_member_sending_minus_8_times_its_selection_is_left_out_named_and_the_rest_agree():
    # the robust reducers (averaging/robust.py) on sparse parts: honest Δs share a direction, as trained ones do
    shapes = [torch.Size(s) for s in SHAPES]
    common = _deltas(100)
    deltas = [[c + 0.3 * d for c, d in zip(common, _deltas(i))] for i in range(4)]
    selections = [ErrorFeedback(shapes, K).select(d) for d in deltas]
    inputs = [s.dense for s in selections[:3]] + [[-8.0 * t for t in selections[3].dense]]
    with _averagers("sparse-hostile", 4, "sparse1-int8") as averagers:
        hostile = averagers[-1].peer_id.to_base58()
        results = _round(averagers, inputs)
    assert all(r is not None and r.ok for r, _ in results), [r for r, _ in results]
    assert len({r.digest for r, _ in results}) == 1
    named = [r for r, _ in results[:3] if hostile in r.outlier_peers]
    assert named, [r.outlier_peers for r, _ in results]  # the reducers that hold its parts leave them out
    for i, avg in enumerate(results[0][1]):  # the honest members' mean of what they sent, int8 again
        sent = torch.zeros(3, avg.numel())
        for j in range(3):
            sent[j][selections[j].positions[i]] = selections[j].sent[i]
        mean = sent.mean(0)
        assert float((avg.reshape(-1) - mean).abs().max()) <= float(mean.abs().max()) / 254 + 1e-9


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["duplicate", "too-many"])
def test_a_member_sending_malformed_sparse_parts_is_refused_and_named(kind):
    feedbacks = [ErrorFeedback([torch.Size(s) for s in SHAPES], K) for _ in range(3)]
    inputs = [f.select(_deltas(i)).dense for i, f in enumerate(feedbacks)]
    with _averagers(f"sparse-bad-{kind}", 3, "sparse1-int8", bad=kind) as averagers:
        bad_peer = averagers[-1].peer_id.to_base58()
        results = _round(averagers, inputs)
    named = [r.rejected_peers.get(bad_peer, "") for r, _ in results[:2]]
    assert any("malformed" in why for why in named), [r for r, _ in results]
    for result, _ in results[:2]:
        assert not result.ok  # a round missing a member's part is partial: nobody keeps it (as in the dense mode)
