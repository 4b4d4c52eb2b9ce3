"""``codec``: quantize + dequantize throughput and relative error of the pseudo-gradient codecs, fp32 CPU tensors.

Ours (``averaging/codec.py``, bytes in and out with its checks), fp16, hivemind's ``Uniform8BitQuantization``
(its ``extract`` fails under numpy 2 in hivemind 1.1.12; then a copy fixed in one line is timed) and
bitsandbytes' dynamic blockwise kernels (the codec before ours; skipped without the ``bench`` extra).
Throughput per CPU second, median of the repeats; error = RMSE / RMS on Gaussian, mixed-scale and real Δ values.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import human_count, md_table, median, timed

SIZES = {
    "smoke": {"values": [100_000], "repeats": 2},
    "quick": {"values": [1_000_000], "repeats": 3},
    "full": {"values": [1_000_000, 10_000_000, 50_000_000], "repeats": 5},
}


def _codecs() -> tuple[dict[str, tuple], str]:
    """{name: (encode(t), decode(encoded, n), size(encoded))}, and hivemind's extract error when it was patched."""
    from hivemind.compression import CompressionInfo, Uniform8BitQuantization

    from diloco_swarm.averaging import codec as ours

    hm = Uniform8BitQuantization()

    def hm_extract_fixed(serialized):  # hivemind 1.1.12's Quantization.extract with int(1-element array) fixed
        buf = serialized.buffer
        codebook_size = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=codebook_size, dtype=hm.codebook_dtype)
        quantized = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=hm.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized.size))
        return torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))[quantized]

    probe, hm_extract, patched = torch.randn(1000), hm.extract, ""
    try:
        hm.extract(hm.compress(probe, CompressionInfo.from_tensor(probe)))
    except TypeError as e:
        hm_extract, patched = hm_extract_fixed, f"TypeError: {e}"
    codecs = {
        "int8 blockwise (ours)": (ours.encode, lambda b, n: ours.decode(b, expected_numel=n), len),
        "fp16": (lambda t: t.half(), lambda h, n: h.float(), lambda h: h.numel() * 2),
        "hivemind Uniform8Bit": (lambda t: hm.compress(t, CompressionInfo.from_tensor(t)), lambda s, n: hm_extract(s),
                                 lambda s: len(s.buffer)),
    }
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return codecs, patched
    code, bs = bnb.create_dynamic_map(signed=True).float(), ours.BLOCKSIZE
    codecs["bitsandbytes dynamic (before)"] = (
        lambda t: bnb.quantize_blockwise(t, code=code, blocksize=bs),
        lambda q, n: bnb.dequantize_blockwise(q[0], absmax=q[1].absmax, code=code, blocksize=bs),
        lambda q: q[0].numel() + 4 * q[1].absmax.numel())
    return codecs, patched


def _mixed_scale(n: int, g: torch.Generator) -> torch.Tensor:
    """Blocks of 65,536 Gaussian values with scales 1e-5..1e-2: a flat Δ over layers of different magnitudes."""
    scales = 10 ** (torch.rand(math.ceil(n / 65_536), generator=g) * 3 - 5)
    return torch.randn(n, generator=g) * scales.repeat_interleave(65_536)[:n]


def _pseudo_gradient(steps: int = 30) -> torch.Tensor:
    """A real Δ, flat fp32: the ``tiny`` model after ``steps`` AdamW steps (bench.quality's model and data)."""
    from bench import quality
    from diloco_swarm.data import BatchSampler

    corpus, _ = quality.setup({"max_bytes": 2_000_000, "seq_len": 64, "eval_batch": 8, "eval_batches": 1})
    model = quality.build("tiny")
    start = [p.detach().clone() for p in model.parameters()]
    batches = BatchSampler(corpus.train, 8, 64, seed=quality.SEED, stream_id="codec").batches_for_outer_step(0, steps)
    quality.train_steps(model, quality.inner_opt(model.parameters()), batches, 0)
    return torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters())])


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x64, y64 = x.double(), y.reshape(x.shape).double()
    return float((x64 - y64).pow(2).mean().sqrt() / x64.pow(2).mean().sqrt())


def run(size: str) -> dict[str, Any]:
    cfg = SIZES[size]
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")  # hivemind's Uniform8Bit, torch 2.13
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: CPU seconds then measure the work, whatever else runs on the machine
    try:
        codecs, patched = _codecs()
        delta = _pseudo_gradient()
        g = torch.Generator().manual_seed(0)
        rows = []
        for n in cfg["values"]:
            gauss, mixed = torch.randn(n, generator=g).mul_(1e-3), _mixed_scale(n, g)
            for name, (enc, dec, nbytes) in codecs.items():
                enc(gauss[:1024].clone())  # warm-up (lazy imports, code tables)
                enc_wall, enc_cpu, encoded = timed(lambda: enc(gauss), cfg["repeats"])
                dec_wall, dec_cpu, decoded = timed(lambda: dec(encoded, n), cfg["repeats"])
                gb = 4 * n / 1e9
                rows.append({
                    "codec": name, "values": n, "repeats": cfg["repeats"], "encode_wall_s": enc_wall,
                    "decode_wall_s": dec_wall, "encode_cpu_s": enc_cpu, "decode_cpu_s": dec_cpu,
                    "encode_gbps_cpu": gb / median(enc_cpu), "decode_gbps_cpu": gb / median(dec_cpu),
                    "roundtrip_gbps_cpu": gb / median([a + b for a, b in zip(enc_cpu, dec_cpu)]),
                    "roundtrip_gbps_wall": gb / median([a + b for a, b in zip(enc_wall, dec_wall)]),
                    "bytes_per_value": nbytes(encoded) / n, "rel_err_gaussian": _rel_err(gauss, decoded),
                    "rel_err_mixed_scale": _rel_err(mixed, dec(enc(mixed), n)),
                    "rel_err_pseudo_gradient": _rel_err(delta, dec(enc(delta), delta.numel())),
                })
                del encoded, decoded
    finally:
        torch.set_num_threads(threads_before)
    return {"torch_threads": 1, "hivemind_extract_error": patched, "rows": rows}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    rows = result["rows"]
    table = [[r["codec"], human_count(r["values"]), *(f"{r[k]:.3f}" for k in (
        "roundtrip_gbps_cpu", "encode_gbps_cpu", "decode_gbps_cpu", "roundtrip_gbps_wall")), f"{r['bytes_per_value']:.4f}",
        *(f"{r[k]:.2e}" if k in r else "–"
          for k in ("rel_err_gaussian", "rel_err_mixed_scale", "rel_err_pseudo_gradient"))]
        for r in rows]
    md = [f"One torch thread, median of {rows[0]['repeats']} repeats.\n",
          md_table(["codec", "values", "round trip GB/CPU-s", "encode GB/CPU-s", "decode GB/CPU-s",
                    "round trip GB/s (wall)", "bytes/value", "rel. error (Gaussian)", "rel. error (mixed scale)",
                    "rel. error (real Δ)"], table)]
    if result.get("hivemind_extract_error"):
        md.append(f"\nhivemind's `Uniform8BitQuantization.extract` failed here (`{result['hivemind_extract_error']}`): "
                  "its decode was timed with a copy of that method fixed in one line.\n")
    by = {(r["codec"].split()[0], r["values"]): r for r in rows}
    lines = []
    for n in sorted(v for k, v in by if k == "int8"):
        ours = by[("int8", n)]
        others = [f"{ours['roundtrip_gbps_cpu'] / o['roundtrip_gbps_cpu']:.2f}× the round-trip speed of {o['codec']} "
                  f"at {ours['rel_err_gaussian'] / o['rel_err_gaussian']:.2f}× its error on Gaussian values and "
                  f"{ours['rel_err_mixed_scale'] / o['rel_err_mixed_scale']:.2f}× on mixed-scale values"
                  for o in (by.get((k, n)) for k in ("bitsandbytes", "fp16", "hivemind")) if o]
        lines.append(f"- {human_count(n)} values: ours round-trips {ours['roundtrip_gbps_cpu']:.3f} GB per CPU second; "
                     + "; ".join(others) + ".")
    md.append("\nSide by side (same run, CPU time):\n\n" + "\n".join(lines) + "\n" if lines else "")
    return "\n".join(md)
