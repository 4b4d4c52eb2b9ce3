"""``quality``: held-out loss at equal tokens, data-parallel vs DiLoCo (fp32, int8, robust, overlapped, 8-bit inner)
vs none.

The k DiLoCo peers are simulated in one process: each replica's H inner steps (the node's inner optimizer,
warm-up and clipping, its own ``BatchSampler`` stream), then the outer step with the node's ``OuterOptimizer``;
int8 sends every Δ and the mean through the codec round trip. The robust variant combines the Δs part by part
as the node's reducers do (:func:`reduce_parts`: hivemind's parts, ``averaging/robust.py``'s skipped mean) where
the others take the plain mean. The overlapped variants use the node's
``OuterSync``: each round's average lands after a share of the next phase (:func:`run_overlap`). Bytes per peer
are analytic. ``bench.eager``, ``bench.staleness`` and ``bench.codec`` reuse these functions.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import figure, human_bytes, md_table, median, notes_md

LLAMA_ROW_PRESET = "llama-tiny"  # a transformers Llama (models/hf.py) with the byte vocabulary
LLAMA_ROW_VARIANTS = ("data-parallel", "DiLoCo int8")
EIGHT_BIT = "DiLoCo int8, AdamW8bit inner"  # --inner-optimizer adamw8bit (node/inner.py)
ROBUST = "DiLoCo int8, robust"  # the node's reducers' rule (averaging/robust.py: the skipped mean), on honest peers
# the overlapped variants: after which share of the next phase each round is applied
OVERLAP_APPLY_AFTER = {"DiLoCo int8 overlap": 1.0, "DiLoCo int8 overlap, ⅓ late": 1 / 3,
                       "DiLoCo int8 overlap, ⅓ late, streamed": 1 / 3}
VARIANTS = ("data-parallel", "DiLoCo fp32", "DiLoCo int8", "no averaging", ROBUST, *OVERLAP_APPLY_AFTER, EIGHT_BIT)
ESTIMATES = ("own", "fit", "mix", "own/k", "none")  # what θ̂ steps on at a hand-off; the node uses "own"

SIZES = {
    "smoke": {"preset": "tiny", "k": 4, "batch": 2, "seq_len": 32, "H": 2, "outer_steps": 2, "eval_batch": 4,
              "eval_batches": 1, "max_bytes": 200_000, "calib_steps": 2},
    "quick": {"preset": "tiny", "k": 4, "batch": 4, "seq_len": 64, "H": 5, "outer_steps": 3, "eval_batch": 8,
              "eval_batches": 2, "max_bytes": 500_000, "calib_steps": 3},
    "full": {"preset": "tiny", "k": 4, "batch": 8, "seq_len": 128, "H": 30, "outer_steps": 10, "eval_batch": 16,
             "eval_batches": 8, "max_bytes": 8_000_000, "calib_steps": 4},
}
INNER_LR, OUTER_LR, OUTER_MOMENTUM, SEED = 1e-3, 0.7, 0.9, 0
TWO_THREAD_MARGIN = 1.3  # use 2 torch threads only when a step is this much faster with them
try:
    from diloco_swarm.node.runner import WARMUP_INNER_STEPS as WARMUP
except ImportError:  # the node module moved: keep the benchmark runnable
    WARMUP = 50


def setup(cfg):
    from diloco_swarm.data import held_out_batches, load_corpus

    corpus = load_corpus(None, max_bytes=cfg["max_bytes"])
    corpus.check(cfg["seq_len"])
    return corpus, held_out_batches(corpus.held_out, cfg["eval_batch"], cfg["seq_len"], cfg["eval_batches"])


def build(preset: str, seed: int = SEED):
    """A seeded model: a byte-level GPT preset, or a Llama preset with the 256-token byte vocabulary."""
    if preset.startswith("llama-"):
        from diloco_swarm.models.registry import build as build_hf, resolve_model

        return build_hf(resolve_model(preset), seed=seed, vocab_size=256).module
    from diloco_swarm.models import build_model

    return build_model(preset, seed=seed)


def inner_opt(params, name: str = "adamw"):
    from diloco_swarm.node.inner import build_inner_optimizer

    return build_inner_optimizer(name, params, lr=INNER_LR)


def train_steps(model, opt, batches, step0: int, warmup: int = WARMUP) -> int:
    for x, y in batches:
        for g in opt.param_groups:
            g["lr"] = INNER_LR * min(1.0, (step0 + 1) / warmup)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step0 += 1
    return step0


def _int8_roundtrip(tensors):
    """One encode/decode of the flattened tensors (as hivemind flattens them into parts)."""
    from diloco_swarm.averaging import codec

    flat = torch.cat([t.reshape(-1) for t in tensors])
    back = codec.decode(codec.encode(flat), expected_numel=flat.numel())
    return [part.view_as(t) for part, t in zip(torch.split(back, [t.numel() for t in tensors]), tensors)]


def part_values() -> int:
    """Values per all-reduce part: hivemind's ``TensorPartContainer`` split of each tensor for our int8 codec."""
    from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
    from hivemind.compression import CompressionInfo

    from diloco_swarm.averaging.codec import Int8BlockwiseCodec

    ratio = Int8BlockwiseCodec().estimate_compression_ratio(CompressionInfo.from_tensor(torch.zeros(1)))
    return int(DEFAULT_PART_SIZE_BYTES / (4 * ratio))


def reduce_parts(deltas: list[list[torch.Tensor]], weights: list[float], rule: str = "skipped-mean") -> list[torch.Tensor]:
    """What the node's reducers make of the members' Δs (``deltas[member][tensor]``, fp32): each tensor cut
    into hivemind's parts (:func:`part_values`), each part combined by ``averaging.robust.RULES[rule]``."""
    from diloco_swarm.averaging.robust import RULES

    size, w, out = part_values(), torch.tensor(weights, dtype=torch.float64), []
    for tensors in zip(*deltas):
        stack = torch.stack([t.reshape(-1).float() for t in tensors])
        out.append(torch.cat([RULES[rule](part, w) for part in stack.split(size, dim=1)]).view_as(tensors[0]))
    return out


def run_variant(variant: str, cfg: dict[str, Any], threads: int = 1) -> dict[str, Any]:
    """Train one variant; its loss curve ``[[tokens, loss(, min, max over the peers)]]`` and timings."""
    from diloco_swarm.data import BatchSampler, evaluate
    from diloco_swarm.node.outer import OuterOptimizer

    torch.set_num_threads(threads)
    t_start, c_start = time.perf_counter(), time.process_time()
    corpus, eval_set = setup(cfg)
    k, b, T, H, N, seed = cfg["k"], cfg["batch"], cfg["seq_len"], cfg["H"], cfg["outer_steps"], cfg.get("seed", SEED)
    tokens_per_outer, train_s = k * b * T * H, 0.0
    if variant in OVERLAP_APPLY_AFTER:
        curve, train_s = run_overlap(cfg, corpus, eval_set, OVERLAP_APPLY_AFTER[variant], streamed="streamed" in variant)
    elif variant == "data-parallel":  # one optimizer at k× the batch: what k synchronous workers compute
        model = build(cfg["preset"], seed)
        opt, step = inner_opt(model.parameters()), 0
        sampler = BatchSampler(corpus.train, k * b, T, seed=seed, stream_id="data-parallel")
        curve = [[0, evaluate(model, eval_set, "cpu")]]
        for t in range(N):
            t0 = time.perf_counter()
            step = train_steps(model, opt, sampler.batches_for_outer_step(t, H), step)
            train_s += time.perf_counter() - t0
            curve.append([(t + 1) * tokens_per_outer, evaluate(model, eval_set, "cpu")])
    else:
        replicas = [build(cfg["preset"], seed) for _ in range(k)]
        opts = [inner_opt(r.parameters(), "adamw8bit" if variant == EIGHT_BIT else "adamw") for r in replicas]
        samplers = [BatchSampler(corpus.train, b, T, seed=seed, stream_id=f"peer-{i}") for i in range(k)]
        shared, int8 = variant != "no averaging", variant in ("DiLoCo int8", EIGHT_BIT, ROBUST)
        outers = [OuterOptimizer(replicas[i].parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM)
                  for i in range(1 if shared else k)]
        evaluator, steps = build(cfg["preset"], seed), [0] * k

        def eval_all():
            losses = []
            for o in outers:
                o.copy_to(evaluator.parameters())
                losses.append(evaluate(evaluator, eval_set, "cpu"))
            return [sum(losses) / len(losses), min(losses), max(losses)] if len(losses) > 1 else losses

        curve = [[0, *eval_all()]]
        for t in range(N):
            t0 = time.perf_counter()
            deltas = []
            for i, rep in enumerate(replicas):
                steps[i] = train_steps(rep, opts[i], samplers[i].batches_for_outer_step(t, H), steps[i])
                deltas.append(outers[0 if shared else i].pseudo_gradient(rep.parameters()))
            if shared:
                deltas = [_int8_roundtrip(d) for d in deltas] if int8 else deltas
                mean = reduce_parts(deltas, [1.0] * k) if variant == ROBUST else [sum(ds) / k for ds in zip(*deltas)]
                outers[0].step(_int8_roundtrip(mean) if int8 else mean)
                for rep in replicas:
                    outers[0].copy_to(rep.parameters())
            else:  # solo rounds: each peer applies its own Δ
                for i, rep in enumerate(replicas):
                    outers[i].step(deltas[i])
                    outers[i].copy_to(rep.parameters())
            train_s += time.perf_counter() - t0
            curve.append([(t + 1) * tokens_per_outer, *eval_all()])
    return {"variant": variant, "curve": curve, "train_s": train_s, "wall_s": time.perf_counter() - t_start,
            "cpu_s": time.process_time() - c_start, "threads": threads, "warmup_steps": WARMUP}


def fit_scale(delta: list, mean: list) -> float:
    """ρ = ⟨Δ, Δ̄⟩ / ⟨Δ, Δ⟩ clipped to [0, 1] (1 when Δ is zero): the least-squares fit of a round's
    average Δ̄ on a peer's own Δ of it, for the ``fit`` rule."""
    num = sum(float((d * m).sum(dtype=torch.float64)) for d, m in zip(delta, mean))
    den = sum(float((d * d).sum(dtype=torch.float64)) for d in delta)
    return min(1.0, max(0.0, num / den)) if den > 0 else 1.0


def _estimate(rule: str, delta: list, last_mean: list | None, k: int, scale: float = 1.0) -> list:
    """The outer gradient θ̂ = preview(·) takes: our own Δ (the node's rule); ρ × our own Δ (``fit``); Kale et
    al.'s mix of Δ/k with the last average for the other members' share; Δ/k alone; or none (zeros)."""
    if rule == "own" or (rule == "mix" and last_mean is None) or (rule == "fit" and scale == 1.0):
        return delta
    return {"fit": lambda: [d * scale for d in delta],
            "mix": lambda: [d / k + (1 - 1 / k) * m for d, m in zip(delta, last_mean)],
            "own/k": lambda: [d / k for d in delta],
            "none": lambda: [torch.zeros_like(d) for d in delta]}[rule]()


def run_overlap(cfg, corpus, eval_set, apply_after: float = 1.0, estimate: str = "own",
                streamed: bool = False) -> tuple[list, float]:
    """k peers with the node's overlapped outer step, each round applied after ``apply_after`` × H inner steps
    of the next phase (1.0: at its end, the most stale). At a hand-off every peer (its own ``OuterOptimizer`` in
    an ``OuterSync``, all holding the same θ_global) trains on θ̂ (``estimate``, :func:`_estimate`); the round's
    average lands with ``OuterSync.apply``. ``streamed``: tensor j of n of the average reaches θ_local after
    ⌈(j+1)/n × that many⌉ steps (``OuterSync.correct``, the node's preview), evenly over the round.
    :returns: the loss curve of θ_global (a point per applied round, at its tokens) and train seconds.
    """
    from diloco_swarm.data import BatchSampler, evaluate
    from diloco_swarm.node.outer import OuterOptimizer
    from diloco_swarm.node.outer_sync import Estimate, OuterSync

    k, b, T, H, N, seed = cfg["k"], cfg["batch"], cfg["seq_len"], cfg["H"], cfg["outer_steps"], cfg.get("seed", SEED)
    replicas = [build(cfg["preset"], seed) for _ in range(k)]
    params = [list(r.parameters()) for r in replicas]
    opts = [inner_opt(p) for p in params]
    samplers = [BatchSampler(corpus.train, b, T, seed=seed, stream_id=f"peer-{i}") for i in range(k)]
    outers = [OuterOptimizer(p, lr=OUTER_LR, momentum=OUTER_MOMENTUM) for p in params]
    syncs = [OuterSync(o, p, lambda *_: None, overlap=True) for o, p in zip(outers, params)]
    evaluator = build(cfg["preset"], seed)

    def eval_global():
        outers[0].copy_to(evaluator.parameters())
        return evaluate(evaluator, eval_set, "cpu")

    curve, train_s, steps = [[0, eval_global()]], 0.0, [0] * k
    pending = None  # (round index, Δ̄, [θ̂ per peer], [Δ per peer]) of the round in flight
    scales, last_mean = [1.0] * k, None  # each peer's ρ for the "fit" rule; the average applied last
    try:
        for t in range(N + 1):
            t0 = time.perf_counter()
            batches = [list(smp.batches_for_outer_step(t, H)) if t < N else [] for smp in samplers]
            split = round(apply_after * H) if pending is not None else H
            n = len(pending[1]) if pending is not None and streamed else 1
            done = 0
            for j, mark in enumerate([max(1, math.ceil((j + 1) / n * split)) for j in range(n)] if n > 1 else [split]):
                for i, rep in enumerate(replicas):  # the part of the phase before (part of) the round lands
                    steps[i] = train_steps(rep, opts[i], batches[i][done:mark], steps[i])
                done = mark
                if n > 1:
                    for s, est, d in zip(syncs, pending[2], pending[3]):
                        s.correct(j, pending[1][j], est, d[j])
            applied = None
            if pending is not None:  # the previous round ends
                applied, mean, estimates, own = pending
                for s, est in zip(syncs, estimates):
                    s.apply(mean, est)
                scales, pending, last_mean = [fit_scale(d, mean) for d in own], None, mean
            for i, rep in enumerate(replicas):  # the rest of the phase
                steps[i] = train_steps(rep, opts[i], batches[i][split:], steps[i])
            if t < N:  # hand-off: Δ from the (just updated) θ_global, θ_local ← θ̂
                deltas = [_int8_roundtrip(o.pseudo_gradient(p)) for o, p in zip(outers, params)]
                estimates = []
                for o, p, d, rho in zip(outers, params, deltas, scales):
                    est = Estimate(o, _estimate(estimate, d, last_mean, k, rho))
                    with torch.no_grad():
                        for j, q in enumerate(p):
                            q.copy_(est.tensor(j))
                    estimates.append(est)
                pending = (t, _int8_roundtrip([sum(ds) / k for ds in zip(*deltas)]), estimates, deltas)
            train_s += time.perf_counter() - t0
            if applied is not None:
                curve.append([(applied + 1) * k * b * T * H, eval_global()])
    finally:
        for s in syncs:
            s.abandon(timeout=0.0)
    return curve, train_s


def _calibrate(cfg) -> dict[str, float]:
    """Median ms per inner step (per-peer batch) with 1 and 2 torch threads, interleaved."""
    from diloco_swarm.data import BatchSampler

    corpus, _ = setup(cfg)
    sampler = BatchSampler(corpus.train, cfg["batch"], cfg["seq_len"], seed=SEED, stream_id="calibration")
    before, times = torch.get_num_threads(), {1: [], 2: []}
    try:
        for rep in range(2):
            for th in (1, 2):
                torch.set_num_threads(th)
                model = build(cfg["preset"])
                opt = inner_opt(model.parameters())
                batches = list(sampler.batches_for_outer_step(rep, cfg["calib_steps"] + 2))
                train_steps(model, opt, batches[:2], 0, 10)
                for batch in batches[2:]:
                    t0 = time.perf_counter()
                    train_steps(model, opt, [batch], 5, 10)
                    times[th].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {str(th): 1000 * median(v) for th, v in times.items()}


def _finish(results: list[dict[str, Any]], cfg: dict[str, Any]) -> int:
    """Bytes per peer (analytic: a ring of fp32 gradients for data-parallel, the butterfly for DiLoCo) and the
    final loss of every variant; returns the parameter count."""
    from diloco_swarm.averaging import codec
    from diloco_swarm.models import num_parameters

    P = num_parameters(build(cfg["preset"]))
    per_value = {"data-parallel": 4 * cfg["H"], "DiLoCo fp32": 4, "no averaging": 0}
    for r in results:
        r["bytes_per_peer"] = (2 * (cfg["k"] - 1) / cfg["k"] * P * cfg["outer_steps"]
                               * per_value.get(r["variant"], codec.wire_bytes(P) / P))
        r["final_loss"] = r["curve"][-1][1]
    return P


def run(size: str) -> dict[str, Any]:
    cfg = dict(SIZES[size])
    calib = _calibrate(cfg)
    # 2 threads must win clearly: under contention from other jobs a 2-thread step can be 10x slower
    threads = 2 if calib["2"] * TWO_THREAD_MARGIN < calib["1"] else 1
    workers = 2 if size == "full" and threads == 1 and len(os.sched_getaffinity(0)) >= 2 else 1
    t0 = time.perf_counter()
    if workers == 1:
        results = [run_variant(v, cfg, threads) for v in VARIANTS]
    else:  # fresh interpreters (no OpenMP state inherited through fork), the dear variants first
        with mp.get_context("spawn").Pool(workers) as pool:
            results = pool.starmap(run_variant, [(v, cfg, threads) for v in sorted(
                VARIANTS, key=lambda v: ("int8" not in v, v))], chunksize=1)
        results.sort(key=lambda r: VARIANTS.index(r["variant"]))
    wall = time.perf_counter() - t0
    P = _finish(results, cfg)
    llama_cfg = {**cfg, "preset": LLAMA_ROW_PRESET}
    llama = [run_variant(v, llama_cfg, threads) for v in LLAMA_ROW_VARIANTS]
    return {"config": {**cfg, "inner_lr": INNER_LR, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM,
                       "seed": SEED, "params": P, "corpus": "python-stdlib (load_corpus(None, max_bytes))",
                       "total_tokens": cfg["k"] * cfg["batch"] * cfg["seq_len"] * cfg["H"] * cfg["outer_steps"]},
            "calibration_ms_per_step": calib, "threads": threads, "workers": workers, "train_wall_s": wall,
            "variants": results, "llama_row": {"preset": LLAMA_ROW_PRESET, "params": _finish(llama, llama_cfg),
                                               "vocab_size": 256, "variants": llama}}


def _vs(r: dict, base: dict) -> str:
    d = r["final_loss"] - base["final_loss"]
    return f"{r['final_loss']:.4f}, **{d:+.4f} ({100 * d / base['final_loss']:+.2f}%)**"


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, by = result["config"], {r["variant"]: r for r in result["variants"]}
    rows = [[r["variant"], f"{r['curve'][0][1]:.3f}", f"{r['final_loss']:.3f}"
             + (f" (peers {r['curve'][-1][2]:.3f}–{r['curve'][-1][3]:.3f})" if len(r["curve"][-1]) > 2 else ""),
             f"{min(p[1] for p in r['curve']):.3f}", human_bytes(r["bytes_per_peer"]), f"{r['train_s']:.0f}",
             f"{r['cpu_s']:.0f}"] for r in result["variants"]]
    md = [f"Model `{cfg['preset']}` ({cfg['params']:,} parameters), seq_len {cfg['seq_len']}, {cfg['total_tokens']:,} "
          f"training tokens for every variant; k = {cfg['k']} peers × batch {cfg['batch']}, H = {cfg['H']}, "
          f"{cfg['outer_steps']} outer steps; held-out loss on {cfg['eval_batches']}×{cfg['eval_batch']} windows.\n",
          md_table(["variant", "loss at start", "final held-out loss", "best", "bytes sent per peer (whole run)",
                    "train s (wall)", "CPU s"], rows)]
    dp, f32, i8, solo = (by.get(v) for v in VARIANTS[:4])
    if dp and f32 and i8 and solo:
        md.append(f"\nFinal loss differences: int8 − fp32 DiLoCo **{i8['final_loss'] - f32['final_loss']:+.4f}**; "
                  f"fp32 DiLoCo − data-parallel **{f32['final_loss'] - dp['final_loss']:+.4f}**; no averaging − fp32 "
                  f"DiLoCo **{solo['final_loss'] - f32['final_loss']:+.4f}**; int8 DiLoCo sent "
                  f"{dp['bytes_per_peer'] / max(i8['bytes_per_peer'], 1):,.0f}× fewer bytes per peer than "
                  "data-parallel.\n")
    if i8:
        md += [f"\n{v} against DiLoCo int8 ({i8['final_loss']:.4f}): {_vs(by[v], i8)}.\n" for v in VARIANTS[4:] if v in by]
    llama = result.get("llama_row")
    if llama:
        md.append(f"\n`{llama['preset']}` ({llama['params']:,} parameters, byte vocabulary), same corpus, tokens and "
                  "settings:\n\n" + md_table(["variant", "loss at start", "final held-out loss", "bytes sent per peer",
                                              "train s (wall)"],
                                             [[r["variant"], f"{r['curve'][0][1]:.3f}", f"{r['final_loss']:.3f}",
                                               human_bytes(r["bytes_per_peer"]), f"{r['train_s']:.0f}"]
                                              for r in llama["variants"]]))
    cal = result["calibration_ms_per_step"]
    md.append(f"\nOne inner step took {cal['1']:.0f} ms with 1 torch thread and {cal['2']:.0f} ms with 2; the run used "
              f"{result['threads']} thread(s) and {result['workers']} worker process(es), {result['train_wall_s']:.0f} s "
              f"wall and {sum(r['cpu_s'] for r in result['variants']):.0f} CPU seconds for the variants.\n")
    md.append(notes_md(result))
    with figure(docs_dir / "bench-quality.png") as ax:
        styles = {"data-parallel": "ko-", "DiLoCo fp32": "C0s-", "DiLoCo int8": "C1^--", "no averaging": "C3x:",
                  "DiLoCo int8 overlap": "C2v-.", "DiLoCo int8 overlap, ⅓ late": "C4D-.", ROBUST: "C5*--"}
        for r in result["variants"]:
            c, xs = r["curve"], [p[0] / 1e6 for p in r["curve"]]
            line, = ax.plot(xs, [p[1] for p in c], styles.get(r["variant"], "C7.-"), markersize=4, label=r["variant"])
            if len(c[0]) > 2:
                ax.fill_between(xs, [p[2] for p in c], [p[3] for p in c], color=line.get_color(), alpha=0.15, lw=0)
        ax.set(xlabel="training tokens, all peers together (millions)", ylabel="held-out loss (nats/token)",
               title=f"{cfg['preset']} model, k={cfg['k']} peers, H={cfg['H']}: equal tokens")
        lows = [p[1] for r in result["variants"] for p in r["curve"][1:]]  # the start's loss off the scale
        ax.set_ylim(min(lows) - 0.05 * (max(lows) - min(lows) + 1e-9), max(lows) + 0.1 * (max(lows) - min(lows) + 1e-9))
        ax.grid(True, alpha=0.3)
        ax.legend(title="(band: min–max over the peers)", title_fontsize=8, fontsize=9)
    md.append("\n![held-out loss vs tokens](bench-quality.png)\n")
    return "\n".join(md)
