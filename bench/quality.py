"""``quality``: held-out loss at equal tokens, data-parallel vs DiLoCo (fp32, int8) vs no averaging.

Same model preset, corpus, initial weights, inner optimizer (AdamW, the node's betas, weight decay,
warm-up and gradient clipping) and total token count for all four:

(a) ``data-parallel``: one AdamW at k× the per-peer batch (what k synchronous workers would compute);
(b) ``DiLoCo fp32``: k peers, H inner steps each, the mean of their Δ = θ_global − θ_local,
    ``node.outer.OuterOptimizer`` (Nesterov SGD) on θ_global, every peer restarts from θ_global;
(c) ``DiLoCo int8``: as (b), but every Δ goes through the int8 codec round trip before the mean,
    and the mean goes through it once more (the reducer sends the encoded average back);
(d) ``no averaging``: k peers that never communicate, each applying its own Δ (solo rounds);
(e) ``DiLoCo int8 overlap``: as (c), with the node's overlapped rule (node/outer_sync.py, eager
    updates, arXiv 2502.12996): at each hand-off a peer jumps to ``OuterOptimizer.preview`` of its own
    Δ and trains on; the round's average is applied with ``OuterSync.apply`` at the END of the next
    phase (the most stale a round can be: the conservative case). The last round is applied after
    the last phase, so every variant ends with the same tokens in θ_global;
(f) ``DiLoCo int8 overlap, ⅓ late``: as (e), but each round is applied after the first third of the
    next phase (a round that takes a third of a phase: the design point of ``bench overlap``).

The k DiLoCo peers are **simulated inside one process**: their H inner steps run one replica
after the other, then the outer step. Each replica draws batches from its own
``BatchSampler(stream_id=f"peer-{i}")`` exactly as a node does. (c) is slightly pessimistic:
in the real all-reduce each reducer keeps its own slice of the input exact.

Loss = ``diloco_swarm.data.evaluate`` on ``held_out_batches`` of the corpus's held-out split, after
every outer step (for (a): every H steps); for (d) the mean over the k peers' θ.
Bytes per peer are analytic: ring all-reduce 2·(k−1)/k·4·P per step for (a); the butterfly
2·(k−1)/k·P values per outer step at 4 bytes (fp32) or ``codec.wire_bytes`` (int8) for (b), (c).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import human_bytes, md_table

# A second model, same corpus, tokens and settings: a transformers Llama (models/hf.py) with a byte vocabulary.
LLAMA_ROW_PRESET = "llama-tiny"
LLAMA_ROW_VARIANTS = ("data-parallel", "DiLoCo int8")
VARIANTS = ("data-parallel", "DiLoCo fp32", "DiLoCo int8", "no averaging", "DiLoCo int8 overlap",
            "DiLoCo int8 overlap, ⅓ late", "DiLoCo int8 overlap, ⅓ late, streamed", "DiLoCo int8, AdamW8bit inner")
EIGHT_BIT = "DiLoCo int8, AdamW8bit inner"  # --inner-optimizer adamw8bit (node/inner.py): the moments in 8 bits
# the overlapped variants: after which share of the next phase each round is applied
OVERLAP_APPLY_AFTER = {"DiLoCo int8 overlap": 1.0, "DiLoCo int8 overlap, ⅓ late": 1 / 3,
                       "DiLoCo int8 overlap, ⅓ late, streamed": 1 / 3}

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


def _warmup_steps() -> int:
    try:
        from diloco_swarm.node.runner import WARMUP_INNER_STEPS

        return int(WARMUP_INNER_STEPS)
    except Exception:  # the node module moved: keep the benchmark runnable, say so in the result
        return 50


def _setup(cfg):
    from diloco_swarm.data import held_out_batches, load_corpus

    corpus = load_corpus(None, max_bytes=cfg["max_bytes"])
    corpus.check(cfg["seq_len"])
    eval_set = held_out_batches(corpus.held_out, cfg["eval_batch"], cfg["seq_len"], cfg["eval_batches"])
    return corpus, eval_set


def _build(preset: str):
    """A seeded model: a byte-level GPT preset, or a Llama preset with the 256-token byte vocabulary."""
    if preset.startswith("llama-"):
        from diloco_swarm.models.registry import build, resolve_model

        return build(resolve_model(preset), seed=SEED, vocab_size=256).module
    from diloco_swarm.models import build_model

    return build_model(preset, seed=SEED)


def _inner_opt(params, name: str = "adamw"):
    from diloco_swarm.node.inner import build_inner_optimizer

    return build_inner_optimizer(name, params, lr=INNER_LR)


def _train_steps(model, opt, batches, step0: int, warmup: int) -> int:
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


def run_variant(variant: str, cfg: dict[str, Any], threads: int) -> dict[str, Any]:
    """Train one variant; returns its loss curve ``[(tokens, loss[, min, max])]`` and timings."""
    from diloco_swarm.data import BatchSampler, evaluate
    from diloco_swarm.node.outer import OuterOptimizer

    torch.set_num_threads(threads)
    t_start, c_start = time.perf_counter(), time.process_time()
    corpus, eval_set = _setup(cfg)
    k, b, T, H, N = cfg["k"], cfg["batch"], cfg["seq_len"], cfg["H"], cfg["outer_steps"]
    warmup = _warmup_steps()
    tokens_per_outer = k * b * T * H
    curve = []
    train_s = 0.0
    if variant == "data-parallel":
        model = _build(cfg["preset"])
        opt = _inner_opt(model.parameters())
        sampler = BatchSampler(corpus.train, k * b, T, seed=SEED, stream_id="data-parallel")
        curve.append([0, evaluate(model, eval_set, "cpu")])
        step = 0
        for t in range(N):
            t0 = time.perf_counter()
            step = _train_steps(model, opt, sampler.batches_for_outer_step(t, H), step, warmup)
            train_s += time.perf_counter() - t0
            curve.append([(t + 1) * tokens_per_outer, evaluate(model, eval_set, "cpu")])
    elif variant in OVERLAP_APPLY_AFTER:
        curve, train_s = _run_overlap(cfg, corpus, eval_set, warmup, OVERLAP_APPLY_AFTER[variant],
                                      streamed=variant.endswith("streamed"))
    else:
        from diloco_swarm.averaging import codec

        replicas = [_build(cfg["preset"]) for _ in range(k)]
        opts = [_inner_opt(r.parameters(), "adamw8bit" if variant == EIGHT_BIT else "adamw") for r in replicas]
        samplers = [BatchSampler(corpus.train, b, T, seed=SEED, stream_id=f"peer-{i}") for i in range(k)]
        shared = variant != "no averaging"
        outers = [OuterOptimizer(replicas[i].parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM)
                  for i in range(1 if shared else k)]
        evaluator = _build(cfg["preset"])
        steps = [0] * k

        def eval_all():
            losses = []
            for o in outers:
                o.copy_to(evaluator.parameters())
                losses.append(evaluate(evaluator, eval_set, "cpu"))
            return [sum(losses) / len(losses), min(losses), max(losses)] if len(losses) > 1 else [losses[0]]

        curve.append([0, *eval_all()])
        for t in range(N):
            t0 = time.perf_counter()
            deltas = []
            for i, rep in enumerate(replicas):
                steps[i] = _train_steps(rep, opts[i], samplers[i].batches_for_outer_step(t, H), steps[i], warmup)
                deltas.append(outers[0 if shared else i].pseudo_gradient(rep.parameters()))
            if shared:
                if variant in ("DiLoCo int8", EIGHT_BIT):
                    deltas = [_int8_roundtrip(d, codec) for d in deltas]
                mean = [sum(ds) / k for ds in zip(*deltas)]
                if variant in ("DiLoCo int8", EIGHT_BIT):
                    mean = _int8_roundtrip(mean, codec)
                outers[0].step(mean)
                for rep in replicas:
                    outers[0].copy_to(rep.parameters())
            else:
                for i, rep in enumerate(replicas):
                    outers[i].step(deltas[i])
                    outers[i].copy_to(rep.parameters())
            train_s += time.perf_counter() - t0
            curve.append([(t + 1) * tokens_per_outer, *eval_all()])
    return {"variant": variant, "curve": curve, "train_s": train_s, "wall_s": time.perf_counter() - t_start,
            "cpu_s": time.process_time() - c_start,
            "threads": threads, "warmup_steps": warmup}


ESTIMATES = ("own", "fit", "mix", "own/k", "none")  # what θ̂ steps on at a hand-off; the node uses "own"


def fit_scale(delta: list, mean: list) -> float:
    """ρ = ⟨Δ, Δ̄⟩ / ⟨Δ, Δ⟩ clipped to [0, 1] (1 when Δ is zero): the least-squares fit of a round's
    average Δ̄ on a peer's own Δ of it, for the ``fit`` rule."""
    num = sum(float((d * m).sum(dtype=torch.float64)) for d, m in zip(delta, mean))
    den = sum(float((d * d).sum(dtype=torch.float64)) for d in delta)
    return min(1.0, max(0.0, num / den)) if den > 0 else 1.0


def _estimate(rule: str, delta: list, last_mean: list | None, k: int, scale: float = 1.0) -> list:
    """The outer gradient θ̂ = preview(·) takes: our own Δ (the node's rule); ρ × our own Δ, ρ
    (``scale``) fitted on the peer's last round (:func:`fit_scale`); Kale et al.'s mix of Δ/k
    with the last average for the other members' share; Δ/k alone; or none (zeros)."""
    if rule == "fit":
        return delta if scale == 1.0 else [d * scale for d in delta]
    if rule == "own" or (rule == "mix" and last_mean is None):
        return delta
    if rule == "mix":
        return [d / k + (1 - 1 / k) * m for d, m in zip(delta, last_mean)]
    if rule == "own/k":
        return [d / k for d in delta]
    if rule == "none":
        return [torch.zeros_like(d) for d in delta]
    raise ValueError(f"unknown estimate rule {rule!r}; choose one of {', '.join(ESTIMATES)}")


def _run_overlap(cfg, corpus, eval_set, warmup: int, apply_after: float = 1.0,
                 estimate: str = "own", streamed: bool = False) -> tuple[list, float]:
    """(e), (f): k peers with the node's overlapped outer step, each round applied after
    ``apply_after`` × H inner steps of the next phase (1.0: at its end, the most stale).
    ``estimate`` picks what θ̂ steps on (:func:`_estimate`; bench/eager.py compares them).
    ``streamed``: the average's tensors reach θ_local as they arrive (``OuterSync.correct``, the
    node's preview), tensor j of n after ⌈(j+1)/n × that many⌉ steps: evenly over the round.

    Every peer has its own ``OuterOptimizer`` (all hold the same θ_global, as the members of a
    verified round do) wrapped in an ``OuterSync``: the hand-off is ``preview`` + θ_local ← θ̂, the
    application ``OuterSync.apply(Δ̄, θ̂)`` (θ_global step, θ_local += θ_global_new − θ̂).
    :returns: the loss curve of θ_global (a point per applied round, at that round's tokens) and train seconds.
    """
    from diloco_swarm.averaging import codec
    from diloco_swarm.data import BatchSampler, evaluate
    from diloco_swarm.models import build_model
    from diloco_swarm.node.outer import OuterOptimizer
    from diloco_swarm.node.outer_sync import Estimate, OuterSync

    k, b, T, H, N = cfg["k"], cfg["batch"], cfg["seq_len"], cfg["H"], cfg["outer_steps"]
    tokens_per_outer = k * b * T * H
    replicas = [build_model(cfg["preset"], seed=SEED) for _ in range(k)]
    params = [list(r.parameters()) for r in replicas]
    opts = [_inner_opt(p) for p in params]
    samplers = [BatchSampler(corpus.train, b, T, seed=SEED, stream_id=f"peer-{i}") for i in range(k)]
    outers = [OuterOptimizer(p, lr=OUTER_LR, momentum=OUTER_MOMENTUM) for p in params]
    syncs = [OuterSync(o, p, lambda *_: None, overlap=True) for o, p in zip(outers, params)]
    evaluator = build_model(cfg["preset"], seed=SEED)

    def eval_global():
        outers[0].copy_to(evaluator.parameters())
        return evaluate(evaluator, eval_set, "cpu")

    curve, train_s, steps = [[0, eval_global()]], 0.0, [0] * k
    pending = None  # (round index, Δ̄, [θ̂ per peer], [Δ per peer]) of the round in flight
    scales = [1.0] * k  # each peer's ρ for the "fit" rule
    last_mean = None  # the average applied last
    try:
        for t in range(N + 1):
            t0 = time.perf_counter()
            batches = [list(smp.batches_for_outer_step(t, H)) if t < N else [] for smp in samplers]
            split = round(apply_after * H) if pending is not None else H
            arrivals = [split]  # inner steps of the phase after which each tensor of the average arrived
            if pending is not None and streamed:
                n = len(pending[1])
                arrivals = [max(1, math.ceil((j + 1) / n * split)) for j in range(n)]
            done = 0
            for j, mark in enumerate(arrivals):  # the part of the phase before the previous round ends
                for i, rep in enumerate(replicas):
                    steps[i] = _train_steps(rep, opts[i], batches[i][done:mark], steps[i], warmup)
                done = mark
                if pending is not None and streamed:
                    _, mean, estimates, own = pending
                    for s, est, d in zip(syncs, estimates, own):
                        s.correct(j, mean[j], est, d[j])
            applied = None
            if pending is not None:  # the previous round ends
                applied, mean, estimates, own = pending
                for s, est in zip(syncs, estimates):
                    s.apply(mean, est)
                scales = [fit_scale(d, mean) for d in own]
                pending, last_mean = None, mean
            for i, rep in enumerate(replicas):  # the rest of the phase
                steps[i] = _train_steps(rep, opts[i], batches[i][split:], steps[i], warmup)
            if t < N:  # hand-off: Δ from the (just updated) θ_global, θ_local ← θ̂
                deltas = [_int8_roundtrip(o.pseudo_gradient(p), codec) for o, p in zip(outers, params)]
                estimates = []
                for o, p, d, rho in zip(outers, params, deltas, scales):
                    est = Estimate(o, _estimate(estimate, d, last_mean, k, rho))
                    with torch.no_grad():
                        for j, q in enumerate(p):
                            q.copy_(est.tensor(j))
                    estimates.append(est)
                mean = _int8_roundtrip([sum(ds) / k for ds in zip(*deltas)], codec)
                pending = (t, mean, estimates, deltas)
            train_s += time.perf_counter() - t0
            if applied is not None:
                curve.append([(applied + 1) * tokens_per_outer, eval_global()])
    finally:
        for s in syncs:
            s.abandon(timeout=0.0)
    return curve, train_s


def _int8_roundtrip(tensors, codec):
    """One encode/decode of the flattened tensors (as hivemind flattens them into parts)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    back = codec.decode(codec.encode(flat), expected_numel=flat.numel())
    out, i = [], 0
    for t in tensors:
        out.append(back[i : i + t.numel()].view_as(t))
        i += t.numel()
    return out


def _calibrate(cfg) -> dict[str, float]:
    """Median ms per inner step (per-peer batch) with 1 and 2 torch threads, interleaved."""
    from diloco_swarm.data import BatchSampler

    corpus, _ = _setup(cfg)
    sampler = BatchSampler(corpus.train, cfg["batch"], cfg["seq_len"], seed=SEED, stream_id="calibration")
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for rep in range(2):
            for th in (1, 2):
                torch.set_num_threads(th)
                model = _build(cfg["preset"])
                opt = _inner_opt(model.parameters())
                batches = list(sampler.batches_for_outer_step(rep, cfg["calib_steps"] + 2))
                _train_steps(model, opt, batches[:2], 0, 10)
                for x, y in batches[2:]:
                    t0 = time.perf_counter()
                    _train_steps(model, opt, [(x, y)], 5, 10)
                    times[th].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    from bench.common import median

    return {str(th): 1000 * median(v) for th, v in times.items()}


def _bytes_per_peer(cfg, P: int) -> dict[str, float]:
    from diloco_swarm.averaging import codec

    k, H, N = cfg["k"], cfg["H"], cfg["outer_steps"]
    f = 2 * (k - 1) / k
    return {
        "data-parallel": f * 4 * P * H * N,
        "DiLoCo fp32": f * 4 * P * N,
        "DiLoCo int8": f * P * (codec.wire_bytes(P) / P) * N,
        "no averaging": 0.0,
        "DiLoCo int8 overlap": f * P * (codec.wire_bytes(P) / P) * N,
        "DiLoCo int8 overlap, ⅓ late": f * P * (codec.wire_bytes(P) / P) * N,
        "DiLoCo int8 overlap, ⅓ late, streamed": f * P * (codec.wire_bytes(P) / P) * N,
        EIGHT_BIT: f * P * (codec.wire_bytes(P) / P) * N,
    }


def run(size: str) -> dict[str, Any]:
    import os

    from diloco_swarm.models import num_parameters

    cfg = dict(SIZES[size])
    calib = _calibrate(cfg)
    # 2 threads must win clearly: under contention from other jobs a 2-thread step can be 10x slower
    threads = 2 if calib["2"] * TWO_THREAD_MARGIN < calib["1"] else 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = 2 if (size == "full" and threads == 1 and cpus >= 2) else 1
    t0 = time.perf_counter()
    if workers == 1:
        results = [run_variant(v, cfg, threads) for v in VARIANTS]
    else:
        ctx = mp.get_context("spawn")  # fresh interpreters: no OpenMP state inherited through fork
        with ctx.Pool(workers) as pool:
            # the dear ones first, so the two workers end about together
            order = ["DiLoCo int8", "DiLoCo int8 overlap", "DiLoCo int8 overlap, ⅓ late",
                     "DiLoCo int8 overlap, ⅓ late, streamed", EIGHT_BIT, "DiLoCo fp32", "no averaging", "data-parallel"]
            results = pool.starmap(run_variant, [(v, cfg, threads) for v in order], chunksize=1)
        results.sort(key=lambda r: VARIANTS.index(r["variant"]))
    wall = time.perf_counter() - t0
    P = num_parameters(_build(cfg["preset"]))
    bytes_pp = _bytes_per_peer(cfg, P)
    for r in results:
        r["bytes_per_peer"] = bytes_pp[r["variant"]]
        r["final_loss"] = r["curve"][-1][1]
    llama_cfg = {**cfg, "preset": LLAMA_ROW_PRESET}
    llama = [run_variant(v, llama_cfg, threads) for v in LLAMA_ROW_VARIANTS]
    P_llama = num_parameters(_build(LLAMA_ROW_PRESET))
    llama_bytes = _bytes_per_peer(llama_cfg, P_llama)
    for r in llama:
        r["bytes_per_peer"] = llama_bytes[r["variant"]]
        r["final_loss"] = r["curve"][-1][1]
    return {"config": {**cfg, "inner_lr": INNER_LR, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM,
                       "seed": SEED, "params": P, "corpus": "python-stdlib (load_corpus(None, max_bytes))",
                       "total_tokens": cfg["k"] * cfg["batch"] * cfg["seq_len"] * cfg["H"] * cfg["outer_steps"]},
            "calibration_ms_per_step": calib, "threads": threads, "workers": workers, "train_wall_s": wall,
            "variants": results,
            "llama_row": {"preset": LLAMA_ROW_PRESET, "params": P_llama, "vocab_size": 256, "variants": llama}}


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg = result["config"]
    rows, by = [], {r["variant"]: r for r in result["variants"]}
    for r in result["variants"]:
        c = r["curve"]
        best = min(p[1] for p in c)
        extra = f" (peers {c[-1][2]:.3f}–{c[-1][3]:.3f})" if len(c[-1]) > 2 else ""
        rows.append([r["variant"], f"{c[0][1]:.3f}", f"{r['final_loss']:.3f}{extra}", f"{best:.3f}",
                     human_bytes(r["bytes_per_peer"]), f"{r['train_s']:.0f}",
                     f"{r['cpu_s']:.0f}" if r.get("cpu_s") is not None else "–"])
    k = cfg["k"]
    md = [
        f"Model `{cfg['preset']}` ({cfg['params']:,} parameters), corpus {cfg['corpus']}, seq_len {cfg['seq_len']}, "
        f"{cfg['total_tokens']:,} training tokens for every variant; k = {k} peers × batch {cfg['batch']} "
        f"(data-parallel: batch {k * cfg['batch']}), H = {cfg['H']}, {cfg['outer_steps']} outer steps; inner AdamW "
        f"lr {cfg['inner_lr']:g} (the node's warm-up, clipping and weight decay), outer Nesterov SGD lr "
        f"{cfg['outer_lr']:g} momentum {cfg['outer_momentum']:g}. Held-out loss in nats/token on "
        f"{cfg['eval_batches']}×{cfg['eval_batch']} fixed windows. **The {k} DiLoCo peers are simulated in one "
        "process** (replicas trained one after the other, then the outer step with `node.outer.OuterOptimizer`); "
        "for int8 every Δ and the mean go through the codec round trip. Bytes per peer are the analytic "
        "all-reduce figures for the whole run (ring for data-parallel, the butterfly for DiLoCo; `wire` "
        "measures the latter).\n",
        md_table(["variant", "loss at start", "final held-out loss", "best", "bytes sent per peer (whole run)",
                  "train s (wall)", "CPU s"], rows),
    ]
    dp, f32, i8, solo, i8o, i8o3, i8s, i8_8bit = (by.get(v) for v in VARIANTS)
    if dp and f32 and i8 and solo:
        md.append(
            f"\nFinal loss differences (same run): int8 − fp32 DiLoCo = **{i8['final_loss'] - f32['final_loss']:+.4f}**; "
            f"DiLoCo fp32 − data-parallel = **{f32['final_loss'] - dp['final_loss']:+.4f}**; "
            f"no averaging − DiLoCo fp32 = **{solo['final_loss'] - f32['final_loss']:+.4f}**. "
            f"DiLoCo int8 sent {dp['bytes_per_peer'] / max(i8['bytes_per_peer'], 1):,.0f}× fewer bytes per peer than "
            f"data-parallel.\n")
    llama = result.get("llama_row")
    if llama:
        lrows = [[f"{llama['preset']}: {r['variant']}", f"{r['curve'][0][1]:.3f}", f"{r['final_loss']:.3f}",
                  human_bytes(r["bytes_per_peer"]), f"{r['train_s']:.0f}"] for r in llama["variants"]]
        md.append(f"\n`{llama['preset']}` row: a `transformers` `LlamaForCausalLM` ({llama['params']:,} parameters, "
                  f"byte vocabulary of {llama['vocab_size']}, models/hf.py) on the same corpus, tokens and settings:\n")
        md.append(md_table(["model: variant", "loss at start", "final held-out loss", "bytes sent per peer (whole run)",
                            "train s (wall)"], lrows))
        lby = {r["variant"]: r for r in llama["variants"]}
        if "data-parallel" in lby and "DiLoCo int8" in lby:
            md.append(f"\n{llama['preset']}: DiLoCo int8 − data-parallel = "
                      f"**{lby['DiLoCo int8']['final_loss'] - lby['data-parallel']['final_loss']:+.4f}** at equal tokens.\n")
    if i8 and i8o:
        d = i8o["final_loss"] - i8["final_loss"]
        md.append(
            f"\nOverlapped vs blocking rounds (int8, k = {k}, each round applied one full phase late, the most stale "
            f"the node allows): final held-out loss {i8o['final_loss']:.4f} vs {i8['final_loss']:.4f}, "
            f"**{d:+.4f} ({100 * d / i8['final_loss']:+.2f}%)** (target: within 1%)"
            + (f"; applied after a third of the next phase (a round a third of a phase long): "
               f"{i8o3['final_loss']:.4f}, **{i8o3['final_loss'] - i8['final_loss']:+.4f} "
               f"({100 * (i8o3['final_loss'] - i8['final_loss']) / i8['final_loss']:+.2f}%)**" if i8o3 else "")
            + (f"; the same with the average reaching θ_local tensor by tensor as it arrives (the node's preview, "
               f"evenly over the round): {i8s['final_loss']:.4f}, **{i8s['final_loss'] - i8['final_loss']:+.4f} "
               f"({100 * (i8s['final_loss'] - i8['final_loss']) / i8['final_loss']:+.2f}%)**" if i8s else "")
            + ".\n")
    if i8 and i8_8bit:
        d = i8_8bit["final_loss"] - i8["final_loss"]
        md.append(f"\nThe inner optimizer in 8 bits (`--inner-optimizer adamw8bit`: bitsandbytes' AdamW8bit, its "
                  f"moments in uint8, 2 B/param instead of 8), int8 DiLoCo as above: final held-out loss "
                  f"{i8_8bit['final_loss']:.4f} vs {i8['final_loss']:.4f} with AdamW, **{d:+.4f} "
                  f"({100 * d / i8['final_loss']:+.2f}%)** at equal tokens.\n")
    cal = result["calibration_ms_per_step"]
    md.append(f"\nThreads: one inner step (batch {cfg['batch']}) took {cal['1']:.0f} ms with "
              f"`torch.set_num_threads(1)` and {cal['2']:.0f} ms with 2 (median, interleaved; 2 threads are used only "
              f"when {TWO_THREAD_MARGIN:g}× faster, since 2-thread steps slow down badly when other jobs "
              f"load the CPUs); the run used "
              f"{result['threads']} thread(s) per process and {result['workers']} worker process(es), "
              f"{result['train_wall_s']:.0f} s wall for the {len(result['variants'])} variants"
              + (f", which used {sum(r['cpu_s'] for r in result['variants']):.0f} CPU seconds in all (the wall time "
                 f"depends on what else runs on the machine; see the load average below)"
                 if all(r.get("cpu_s") is not None for r in result["variants"]) else "") + ".\n")
    for note in result.get("notes", []):  # e.g. a variant added to a result by a later invocation
        md.append(f"\n*Note:* {note}\n")
    png = _plot(result, docs_dir)
    md.append(f"\n![held-out loss vs tokens]({png})\n")
    return "\n".join(md)


def _plot(result, docs_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = {"data-parallel": ("k", "-", "o"), "DiLoCo fp32": ("tab:blue", "-", "s"),
              "DiLoCo int8": ("tab:orange", "--", "^"), "no averaging": ("tab:red", ":", "x"),
              "DiLoCo int8 overlap": ("tab:green", "-.", "v"),
              "DiLoCo int8 overlap, ⅓ late": ("tab:purple", "-.", "D")}
    for r in result["variants"]:
        c = r["curve"]
        xs = [p[0] / 1e6 for p in c]
        color, ls, marker = styles.get(r["variant"], ("gray", "-", "."))
        ax.plot(xs, [p[1] for p in c], color=color, linestyle=ls, marker=marker, markersize=4, label=r["variant"])
        if len(c[0]) > 2:
            ax.fill_between(xs, [p[2] for p in c], [p[3] for p in c], color=color, alpha=0.15, linewidth=0)
    cfg = result["config"]
    ax.set_xlabel("training tokens, all peers together (millions)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"{cfg['preset']} model, k={cfg['k']} peers, H={cfg['H']}: equal tokens", fontsize=10)
    lows = [p[1] for r in result["variants"] for p in r["curve"][1:]]
    if lows:
        lo, hi = min(lows), max(lows)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.grid(True, alpha=0.3)
    ax.legend(title="(band: min–max over the peers)", title_fontsize=8, fontsize=9)
    fig.tight_layout()
    name = "bench-quality.png"
    fig.savefig(docs_dir / name, dpi=80)
    plt.close(fig)
    return name
