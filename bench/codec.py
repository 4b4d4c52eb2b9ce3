"""``codec``: quantize + dequantize throughput and relative error of the pseudo-gradient codecs.

Codecs, all on fp32 CPU tensors:

- ``int8 blockwise (ours)``: ``diloco_swarm.averaging.codec.encode`` / ``decode`` (linear map,
  absmax per block, numpy), bytes in and out, with all its checks;
- ``bitsandbytes dynamic (before)``: ``bitsandbytes.functional.quantize_blockwise`` /
  ``dequantize_blockwise`` with its signed dynamic map, on tensors, no checks, no wire bytes: the
  kernels of our codec's version 1 (skipped when bitsandbytes, the ``bench`` extra, is missing);
- ``fp16``: ``tensor.half()`` / ``.float()``;
- ``hivemind Uniform8Bit``: ``hivemind.compression.Uniform8BitQuantization`` through its
  ``CompressionBase`` API (``compress(tensor, CompressionInfo.from_tensor(tensor))`` / ``extract``).
  Its ``extract`` raises ``TypeError`` under numpy 2 in hivemind 1.1.12 (``int()`` of a 1-element
  array, the same bug as ``BlockwiseQuantization``); when it does, the benchmark times a copy of
  that method with the one-line fix and says so.

Throughput = fp32 input bytes (4·n) / seconds, median of the repeats (round trip = encode +
decode of the same tensor, per CPU second); error = RMSE / RMS of the
input, on Gaussian values, on "mixed-scale" values (blocks of 65,536 values whose scales span
1e-5..1e-2, like a flat pseudo-gradient over layers of different magnitudes), and on a real
pseudo-gradient (the ``tiny`` model after 30 AdamW steps).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bench.common import human_count, md_table, median, timed

TARGET_GBPS_CPU = 0.4  # issue 13: round trip per CPU second

SIZES = {
    "smoke": {"values": [100_000], "repeats": 2},
    "quick": {"values": [1_000_000], "repeats": 3},
    "full": {"values": [1_000_000, 10_000_000, 50_000_000], "repeats": 5},
}


def _codecs() -> dict[str, dict[str, Any]]:
    from hivemind.compression import CompressionInfo, Uniform8BitQuantization

    from diloco_swarm.averaging import codec as ours

    hm = Uniform8BitQuantization()
    patched = {"extract_patched": False, "extract_error": ""}

    def hm_extract_fixed(serialized):
        # hivemind 1.1.12 Quantization.extract with int(...) of a 1-element array replaced by .item()
        buf = serialized.buffer
        codebook_size = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=codebook_size, dtype=hm.codebook_dtype)
        quantized = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=hm.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized.size))
        return torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))[quantized]

    probe = torch.randn(1000)
    try:
        hm.extract(hm.compress(probe, CompressionInfo.from_tensor(probe)))
        hm_extract = hm.extract
    except TypeError as e:
        patched = {"extract_patched": True, "extract_error": f"TypeError: {e}"}
        hm_extract = hm_extract_fixed

    codecs = {
        "int8 blockwise (ours)": {
            "encode": lambda t: ours.encode(t),
            "decode": lambda b, n: ours.decode(b, expected_numel=n),
            "size": len,
            "note": f"blocksize {ours.BLOCKSIZE}",
        },
        "fp16": {
            "encode": lambda t: t.half(),
            "decode": lambda h, n: h.float(),
            "size": lambda h: h.numel() * 2,
            "note": "",
        },
        "hivemind Uniform8Bit": {
            "encode": lambda t: hm.compress(t, CompressionInfo.from_tensor(t)),
            "decode": lambda s, n: hm_extract(s),
            "size": lambda s: len(s.buffer),
            "note": "extract patched (numpy 2 TypeError)" if patched["extract_patched"] else "",
            **patched,
        },
    }
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return codecs
    code = bnb.create_dynamic_map(signed=True).float()
    codecs["bitsandbytes dynamic (before)"] = {
        "encode": lambda t: bnb.quantize_blockwise(t, code=code, blocksize=ours.BLOCKSIZE),
        "decode": lambda q, n: bnb.dequantize_blockwise(q[0], absmax=q[1].absmax, code=code, blocksize=ours.BLOCKSIZE),
        "size": lambda q: q[0].numel() + 4 * q[1].absmax.numel(),
        "note": f"blocksize {ours.BLOCKSIZE}, no checks",
    }
    return codecs


def _mixed_scale(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=g)
    block = 65_536
    n_blocks = math.ceil(n / block)
    scales = 10 ** (torch.rand(n_blocks, generator=g) * 3 - 5)  # 1e-5 .. 1e-2
    return (x.view(-1)[: n] * scales.repeat_interleave(block)[:n])


def _pseudo_gradient(steps: int = 30) -> torch.Tensor:
    """A real Δ, flat fp32: the ``tiny`` model after ``steps`` AdamW steps on the default corpus (bench.quality's
    seeded model, optimizer and data), minus where it started."""
    from bench import quality
    from diloco_swarm.data import BatchSampler

    corpus, _ = quality._setup({"max_bytes": 2_000_000, "seq_len": 64, "eval_batch": 8, "eval_batches": 1})
    model = quality._build("tiny")
    start = [p.detach().clone() for p in model.parameters()]
    batches = BatchSampler(corpus.train, 8, 64, seed=quality.SEED, stream_id="codec").batches_for_outer_step(0, steps)
    quality._train_steps(model, quality._inner_opt(model.parameters()), batches, 0, quality._warmup_steps())
    return torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters())])


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x64, y64 = x.double(), y.reshape(x.shape).double()
    return float((x64 - y64).pow(2).mean().sqrt() / x64.pow(2).mean().sqrt())


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    # hivemind's Uniform8Bit calls torch.quantize_per_tensor, which torch 2.13 flags as deprecated
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: CPU seconds then measure the work, whatever else runs on the machine
    try:
        codecs = _codecs()
        delta = _pseudo_gradient()
        g = torch.Generator().manual_seed(0)
        rows = []
        for n in cfg["values"]:
            gauss = torch.randn(n, generator=g).mul_(1e-3)
            mixed = _mixed_scale(n, g)
            for name, c in codecs.items():
                enc: Callable = c["encode"]
                dec: Callable = c["decode"]
                enc(gauss[:1024].clone())  # warm-up (lazy imports, code tables)
                enc_wall, enc_cpu, encoded = timed(lambda: enc(gauss), cfg["repeats"])
                dec_wall, dec_cpu, decoded = timed(lambda: dec(encoded, n), cfg["repeats"])
                err_gauss = _rel_err(gauss, decoded)
                err_mixed = _rel_err(mixed, dec(enc(mixed), n))
                err_delta = _rel_err(delta, dec(enc(delta), delta.numel()))
                gb = 4 * n / 1e9
                row = {
                    "codec": name,
                    "values": n,
                    "note": c["note"],
                    "repeats": cfg["repeats"],
                    "encode_wall_s": enc_wall,
                    "decode_wall_s": dec_wall,
                    "encode_cpu_s": enc_cpu,
                    "decode_cpu_s": dec_cpu,
                    "encode_gbps_cpu": gb / median(enc_cpu),
                    "decode_gbps_cpu": gb / median(dec_cpu),
                    "roundtrip_gbps_cpu": gb / median([a + b for a, b in zip(enc_cpu, dec_cpu)]),
                    "roundtrip_gbps_wall": gb / median([a + b for a, b in zip(enc_wall, dec_wall)]),
                    "bytes_per_value": c["size"](encoded) / n,
                    "rel_err_gaussian": err_gauss,
                    "rel_err_mixed_scale": err_mixed,
                    "rel_err_pseudo_gradient": err_delta,
                }
                rows.append(row)
                del encoded, decoded
    finally:
        torch.set_num_threads(threads_before)
    hm = codecs["hivemind Uniform8Bit"]
    return {"torch_threads": 1, "hivemind_extract_patched": hm["extract_patched"],
            "hivemind_extract_error": hm["extract_error"], "rows": rows}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    rows = result["rows"]
    table = [[r["codec"], human_count(r["values"]), f"{r['roundtrip_gbps_cpu']:.3f}", f"{r['encode_gbps_cpu']:.3f}",
              f"{r['decode_gbps_cpu']:.3f}", f"{r['roundtrip_gbps_wall']:.3f}", f"{r['bytes_per_value']:.4f}",
              f"{r['rel_err_gaussian']:.2e}", f"{r['rel_err_mixed_scale']:.2e}",
              f"{r['rel_err_pseudo_gradient']:.2e}" if "rel_err_pseudo_gradient" in r else "-"] for r in rows]
    md = [
        f"Quantize + dequantize of one fp32 CPU tensor, one torch thread, median of {rows[0]['repeats']} repeats. "
        "Throughput is GB of fp32 input (4 bytes per value) **per CPU second of the process** (`time.process_time`, "
        "all its threads), which stays meaningful on a shared machine; the wall-clock figure is shown too. "
        "Error = RMSE / RMS of the input, on Gaussian values and on mixed-scale values (blocks of 65,536 values "
        "with scales 1e-5..1e-2, like a flat pseudo-gradient over layers of different magnitudes), and on a real "
        "Δ: the `tiny` model's 0.5M values after 30 AdamW steps (bench.quality's seeded model and data).\n",
        md_table(["codec", "values", "round trip GB/CPU-s", "encode GB/CPU-s", "decode GB/CPU-s",
                  "round trip GB/s (wall)", "bytes/value", "rel. error (Gaussian)", "rel. error (mixed scale)", "rel. error (real Δ)"],
                 table),
    ]
    if result.get("hivemind_extract_patched"):
        md.append(f"\nhivemind 1.1.12's `Uniform8BitQuantization.extract` fails under numpy 2 "
                  f"(`{result['hivemind_extract_error']}`), so its decode was timed with a copy of that method "
                  "fixed in one line (`int(arr[0])`); a swarm using hivemind's uniform 8-bit codec would fail "
                  "every round here, like `BlockwiseQuantization` (see DESIGN.md).\n")
    ours = {r["values"]: r for r in rows if r["codec"].startswith("int8")}
    before = {r["values"]: r for r in rows if r["codec"].startswith("bitsandbytes")}
    fp16 = {r["values"]: r for r in rows if r["codec"] == "fp16"}
    hm = {r["values"]: r for r in rows if r["codec"].startswith("hivemind")}
    lines = []
    for n in sorted(ours):
        parts = [f"ours round-trips {ours[n]['roundtrip_gbps_cpu']:.3f} GB per CPU second"]
        parts.append(f"target ≥ {TARGET_GBPS_CPU} GB/CPU-s "
                     f"{'met' if ours[n]['roundtrip_gbps_cpu'] >= TARGET_GBPS_CPU else 'missed'}")
        if n in before:
            parts.append(f"{ours[n]['roundtrip_gbps_cpu'] / before[n]['roundtrip_gbps_cpu']:.2f}× the speed of "
                         f"bitsandbytes' dynamic-map kernels alone, the previous codec's "
                         f"({before[n]['roundtrip_gbps_cpu']:.3f} GB/CPU-s), at "
                         f"{ours[n]['rel_err_gaussian'] / before[n]['rel_err_gaussian']:.2f}× their error on Gaussian "
                         f"values, {ours[n]['rel_err_mixed_scale'] / before[n]['rel_err_mixed_scale']:.2f}× on "
                         f"mixed-scale values and {ours[n]['rel_err_pseudo_gradient'] / before[n]['rel_err_pseudo_gradient']:.2f}× "
                         "on a real Δ")
        if n in fp16:
            parts.append(f"fp16 round trip is {fp16[n]['roundtrip_gbps_cpu'] / ours[n]['roundtrip_gbps_cpu']:.2f}× "
                         f"the speed of ours at {fp16[n]['bytes_per_value'] / ours[n]['bytes_per_value']:.2f}× the "
                         "bytes")
        if n in hm:
            parts.append(f"ours is {ours[n]['roundtrip_gbps_cpu'] / hm[n]['roundtrip_gbps_cpu']:.2f}× the round-trip "
                         f"speed of hivemind Uniform8Bit; hivemind's error is "
                         f"{hm[n]['rel_err_gaussian'] / ours[n]['rel_err_gaussian']:.2f}× ours on Gaussian values and "
                         f"{hm[n]['rel_err_mixed_scale'] / ours[n]['rel_err_mixed_scale']:.2f}× on mixed-scale values")
        lines.append(f"- {human_count(n)} values: " + "; ".join(parts) + ".")
    md.append("\nSide by side (same run, CPU time):\n\n" + "\n".join(lines) + "\n")
    return "\n".join(md)
