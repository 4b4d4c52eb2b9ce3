"""``sparse``: the sparse int8 modes (issue 38) against int8 dense at equal tokens, and their codec's speed.

k DiLoCo peers simulated in one process as in :mod:`bench.quality` (the node's inner optimizer, warm-up,
clipping and ``OuterOptimizer``). Every variant combines the members' Δs with the node's reducers' rule
(the skipped mean over hivemind's parts, :func:`bench.quality.reduce_parts`):

* ``int8``: each Δ through the int8 codec round trip, the average through it again (the default mode);
* ``sparseK``: each member sends ``node/feedback.ErrorFeedback``'s selection of Δ + e (the top K% of each
  chunk of 4096 values, int8) and keeps the rest; the reducers' average goes back as it is (every
  non-zero, int8: ``sparseK-int8``) or cut back to the top K% (``-cut``).

Configurations (``full``): H = 30 over 10 outer steps, every variant; H = 30 over 30 and H = 100 over 6, int8 and
``sparse1-int8``; 3 seeds each. The outer learning rate and momentum of ``sparse1-int8`` are swept at H = 30 over
10 outer steps (one seed). The hostile runs (issue 38's robust aggregation on sparse parts): the same k honest
peers and one more sending −8 × what it would send (``bench.hostile``'s ``1 × −8Δ``, the test's
``--fault scale=-8``), its parts combined by the plain mean and by the reducers' skipped mean, at H = 30 over
10 outer steps and each mode's outer step; against the same mode's k honest peers alone (same seeds, so equal
tokens for the honest peers). ``--workers 2`` runs two at once (each one CPU thread). Upload bytes
per parameter per outer step are measured from the codec's output at k = 4 (an all-reduce's share: a
sender sends (k−1)/k of its parts, a reducer returns its average to k − 1 members).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import md_table, mean, median
from bench.hostile import SCENARIOS, hostile_delta

VARIANTS = {"int8": None, "sparse1-int8": ("sparse1-int8", False), "sparse1-int8-cut": ("sparse1-int8", True),
            "sparse2-int8": ("sparse2-int8", False), "sparse2-int8-cut": ("sparse2-int8", True)}
OUTER = (0.7, 0.9)  # DiLoCo's outer learning rate and Nesterov momentum: the node's default
SWEEP = [(0.7, 0.9), (1.0, 0.9), (1.0, 0.7), (2.0, 0.7), (1.0, 0.5), (1.5, 0.5), (2.0, 0.5), (3.0, 0.5), (4.0, 0.5),
         (2.0, 0.3), (3.0, 0.3), (1.5, 0.0), (3.0, 0.0)]  # (lr, momentum) tried for the sparse mode
ATTACK = next(s for s in SCENARIOS if s[0] == "1 × −8Δ")  # (label, 1 hostile peer, "scale", −8.0): one more than k
HOSTILE_RULES = ("mean", "skipped-mean")  # the rule before issue 37, and the reducers' (averaging/robust.py)
SIZES = {
    "smoke": {"preset": "tiny", "k": 4, "batch": 2, "seq_len": 32, "eval_batch": 4, "eval_batches": 1,
              "max_bytes": 200_000, "configs": [(2, 2)], "seeds": [0], "sweep_mode": "sparse1-int8", "sweep": SWEEP[:2],
              "hostile_variants": ("sparse1-int8",)},
    "quick": {"preset": "tiny", "k": 4, "batch": 4, "seq_len": 64, "eval_batch": 8, "eval_batches": 2,
              "max_bytes": 500_000, "configs": [(5, 3)], "seeds": [0], "sweep_mode": "sparse1-int8", "sweep": SWEEP[:2],
              "hostile_variants": ("int8", "sparse1-int8")},
    "full": {"preset": "tiny", "k": 4, "batch": 4, "seq_len": 128, "eval_batch": 16, "eval_batches": 8,
             "max_bytes": 8_000_000, "configs": [(30, 10), (30, 30), (100, 6)], "seeds": [0, 1, 2],
             "long_variants": ("int8", "sparse1-int8"), "sweep_mode": "sparse1-int8", "sweep": SWEEP, "sweep_seeds": [0],
             "hostile_variants": ("int8", "sparse1-int8", "sparse2-int8")},
}


def _attacked(sent: list[list[torch.Tensor]], hostile: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """``sent`` with its last ``hostile`` members' contributions replaced by :data:`ATTACK`'s."""
    _, _, fault, value = ATTACK
    return [hostile_delta(d, fault, value, gen) if i >= len(sent) - hostile else d for i, d in enumerate(sent)]


def _sparse_average(deltas, feedbacks, per_chunk: int, cut: bool, k: int, hostile: int = 0, rule: str = "skipped-mean",
                    gen: torch.Generator | None = None):
    """(the average every member applies, bytes one member uploads for it): the node's sparse round; the last
    ``hostile`` members send :data:`ATTACK` of their selection (and keep their residual as an honest peer)."""
    from bench.quality import reduce_parts
    from diloco_swarm.averaging import sparse
    from diloco_swarm.node.feedback import Feedback

    selections = [fb.select(d) for fb, d in zip(feedbacks, deltas)]
    sent = [[sparse.roundtrip(t, per_chunk) for t in d] for d in _attacked([s.dense for s in selections], hostile, gen)]
    mean = reduce_parts(sent, [1.0] * k, rule)
    out_k = per_chunk if cut else min(sparse.CHUNK, k * per_chunk)
    average = [sparse.roundtrip(m, out_k) for m in mean]
    for fb, d, s in zip(feedbacks, deltas, selections):
        fb.settle(Feedback.COMMIT_SENT, d, s)
    up = (sum(len(sparse.encode(t, per_chunk)) for t in selections[0].dense) * (k - 1) / k
          + sum(len(sparse.encode(m, out_k)) for m in mean) * (k - 1) / k)
    return average, up


def run_variant(variant: str, cfg: dict[str, Any], H: int, N: int, seed: int, lr: float, momentum: float,
                hostile: int = 0, rule: str = "skipped-mean") -> dict[str, Any]:
    """One run of ``cfg['k']`` honest peers and ``hostile`` more sending :data:`ATTACK`, every part combined by
    ``rule``; final held-out loss of θ_global, its curve and the measured upload per parameter per outer step."""
    from bench.quality import _int8_roundtrip, build, inner_opt, reduce_parts, setup, train_steps
    from diloco_swarm.averaging import codec, sparse
    from diloco_swarm.data import BatchSampler, evaluate
    from diloco_swarm.node.feedback import ErrorFeedback
    from diloco_swarm.node.outer import OuterOptimizer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    corpus, eval_set = setup(cfg)
    k, b, T = cfg["k"] + hostile, cfg["batch"], cfg["seq_len"]
    gen = torch.Generator().manual_seed(seed)
    replicas = [build(cfg["preset"], seed) for _ in range(k)]
    opts = [inner_opt(r.parameters()) for r in replicas]
    samplers = [BatchSampler(corpus.train, b, T, seed=seed, stream_id=f"peer-{i}") for i in range(k)]
    outer = OuterOptimizer(replicas[0].parameters(), lr=lr, momentum=momentum)
    P = sum(t.numel() for t in outer.theta)
    mode = VARIANTS[variant]
    per_chunk = sparse.SPARSE_MODES[mode[0]][0] if mode else 0
    feedbacks = [ErrorFeedback([t.shape for t in outer.theta], per_chunk) for _ in range(k)] if mode else []
    evaluator, steps, uploads = build(cfg["preset"], seed), [0] * k, []

    def held_out():
        outer.copy_to(evaluator.parameters())
        return evaluate(evaluator, eval_set, "cpu")

    curve = [held_out()]
    for t in range(N):
        deltas = []
        for i, rep in enumerate(replicas):
            steps[i] = train_steps(rep, opts[i], samplers[i].batches_for_outer_step(t, H), steps[i])
            deltas.append(outer.pseudo_gradient(rep.parameters()))
        if mode:
            average, up = _sparse_average(deltas, feedbacks, per_chunk, mode[1], k, hostile, rule, gen)
        else:
            average = _int8_roundtrip(reduce_parts([_int8_roundtrip(d) for d in _attacked(deltas, hostile, gen)],
                                                   [1.0] * k, rule))
            up = 2 * (k - 1) / k * codec.wire_bytes(P)
        uploads.append(up / P)
        outer.step(average)
        for rep in replicas:
            outer.copy_to(rep.parameters())
        curve.append(held_out())
    return {"variant": variant, "H": H, "outer_steps": N, "seed": seed, "lr": lr, "momentum": momentum,
            "hostile": hostile, "rule": rule, "curve": curve, "final_loss": curve[-1],
            "upload_B_per_param": median(uploads),
            "wall_s": time.perf_counter() - t0}


def codec_speed(n: int = 1 << 24) -> list[dict[str, Any]]:
    """GB of fp32 input per CPU second for selection + quantization (encode) and decoding, per mode."""
    from diloco_swarm.averaging import sparse

    parts = torch.randn(n, generator=torch.Generator().manual_seed(0)).split(sparse.PART_VALUES)  # as hivemind cuts
    rows = []
    for mode, (per_chunk, _) in sparse.SPARSE_MODES.items():
        if mode.endswith("-cut"):
            continue
        for threads in (1, torch.get_num_threads()):
            torch.set_num_threads(threads)
            c0 = time.process_time()
            bufs = [sparse.encode(p, per_chunk) for p in parts]
            c1 = time.process_time()
            for p, buf in zip(parts, bufs):
                sparse.decode(buf, p.numel(), per_chunk)
            c2 = time.process_time()
            rows.append({"mode": mode, "threads": threads, "values": n, "encode_GBps_cpu": 4 * n / (c1 - c0) / 1e9,
                         "decode_GBps_cpu": 4 * n / (c2 - c1) / 1e9, "both_GBps_cpu": 4 * n / (c2 - c0) / 1e9,
                         "bytes_per_value": sum(map(len, bufs)) / n})
    return rows


OPTIONS = {"--workers": {"type": int, "default": 1, "help": "runs in parallel (each one CPU thread)"},
           "--progress": {"type": Path, "default": None, "help": "append each finished run here (JSON lines)"}}


def _job(args) -> dict[str, Any]:
    return run_variant(*args)


def run(size: str, workers: int = 1, progress: Path | None = None) -> dict[str, Any]:
    """The sweep first (``sweep_mode`` at each (lr, momentum), ``sweep_seeds``); then every configuration at the
    default outer step, and the sparse modes again at the sweep's best (lr, momentum); then the hostile runs of
    ``hostile_variants`` (each mode at its outer step: int8 at the default, a sparse mode at the sweep's best)."""
    cfg = SIZES[size]
    codec = codec_speed(1 << 22 if size != "full" else 1 << 24)  # first: nothing else of ours runs yet
    H, N = cfg["configs"][0]
    seeds, long_variants = cfg["seeds"], cfg.get("long_variants", tuple(VARIANTS))
    t0 = time.perf_counter()
    if progress is not None:
        progress.parent.mkdir(parents=True, exist_ok=True)
    with mp.get_context("spawn").Pool(max(1, workers)) as pool:
        def run_jobs(jobs) -> list[dict[str, Any]]:
            out = []
            for r in pool.imap_unordered(_job, [(v, cfg, *rest) for v, *rest in jobs]):
                out.append(r)
                if progress is not None:
                    with open(progress, "a") as f:
                        f.write(json.dumps(r) + "\n")
            return out

        sweep = run_jobs([(cfg["sweep_mode"], H, N, s, lr, m) for s in cfg.get("sweep_seeds", seeds)
                          for lr, m in cfg["sweep"]])
        best = min(cfg["sweep"], key=lambda lm: mean(r["final_loss"] for r in sweep if (r["lr"], r["momentum"]) == lm))
        jobs = [(v, H, N, s, *OUTER) for s in seeds for v in VARIANTS]
        jobs += [(v, H, N, s, *best) for s in seeds for v in VARIANTS] if best != OUTER else []  # int8 too: fair
        jobs += [(v, H_, N_, s, *lm) for H_, N_ in cfg["configs"][1:] for s in seeds for v in long_variants
                 for lm in ([OUTER] if v == "int8" or best == OUTER else [OUTER, best])]
        jobs = [j for j in jobs if not (j[3] in cfg.get("sweep_seeds", seeds) and j[0] == cfg["sweep_mode"]
                                        and j[1:3] == (H, N) and tuple(j[4:]) in cfg["sweep"])]  # already run
        jobs += [(v, H, N, s, *(OUTER if v == "int8" else best), ATTACK[1], rule)
                 for v in cfg["hostile_variants"] for rule in HOSTILE_RULES for s in seeds]
        results = sweep + run_jobs(jobs)
    return {"config": {k: v for k, v in cfg.items()}, "best_outer": list(best), "runs": results,
            "wall_s": time.perf_counter() - t0, "codec": codec}


def _by_outer_step(runs) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r["H"], r["outer_steps"], r["lr"], r["momentum"], r["variant"]), []).append(r)
    return groups


def summarize_hostile(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (mode, rule) of the hostile runs: mean final loss over seeds, and against the same mode's honest peers
    alone at the same H, outer steps, outer step and seeds."""
    alone = _by_outer_step(r for r in result["runs"] if not r.get("hostile"))
    groups: dict[tuple, list] = {}
    for r in result["runs"]:
        if r.get("hostile"):
            groups.setdefault((r["H"], r["outer_steps"], r["lr"], r["momentum"], r["variant"], r["rule"]), []).append(r)
    rows = []
    for (H, N, lr, m, v, rule), runs in groups.items():
        seeds = {r["seed"] for r in runs}
        base = [r["final_loss"] for r in alone.get((H, N, lr, m, v), []) if r["seed"] in seeds]
        loss = mean(r["final_loss"] for r in runs)
        rows.append({"H": H, "outer_steps": N, "lr": lr, "momentum": m, "variant": v, "rule": rule,
                     "hostile": runs[0]["hostile"], "seeds": len(runs), "final_loss": loss,
                     "alone": mean(base) if len(base) == len(seeds) else None,
                     "vs_alone": loss / mean(base) - 1 if len(base) == len(seeds) else None})
    return rows


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (H, outer steps, lr, momentum, variant): mean final loss over seeds, and against int8 at the default outer step."""
    groups = _by_outer_step(r for r in result["runs"] if not r.get("hostile"))
    rows = []
    for (H, N, lr, m, v), runs in groups.items():
        base = groups.get((H, N, *OUTER, "int8"))
        mean = sum(r["final_loss"] for r in runs) / len(runs)
        base_mean = sum(r["final_loss"] for r in base) / len(base) if base else None
        rows.append({"H": H, "outer_steps": N, "lr": lr, "momentum": m, "variant": v, "seeds": len(runs),
                     "final_loss": mean, "vs_int8": (mean / base_mean - 1) if base_mean else None,
                     "upload_B_per_param": median(r["upload_B_per_param"] for r in runs)})
    return rows


def render(result: dict[str, Any], docs_dir: Path) -> str:
    cfg, scale = result["config"], f"{ATTACK[3]:g}".replace("-", "−")
    rows = [[r["H"], r["outer_steps"], f"{r['lr']:g} / {r['momentum']:g}", r["variant"], r["seeds"],
             f"{r['final_loss']:.4f}", "–" if r["vs_int8"] is None else f"{100 * r['vs_int8']:+.2f}%",
             f"{r['upload_B_per_param']:.4f}"] for r in summarize(result)]
    md = [f"Model `{cfg['preset']}`, k = {cfg['k']} peers × batch {cfg['batch']} × seq_len {cfg['seq_len']}; held-out "
          f"loss on {cfg['eval_batches']}×{cfg['eval_batch']} windows, mean over the seeds; \"vs int8\" against int8 "
          f"dense at the default outer step (lr {OUTER[0]}, momentum {OUTER[1]}) of the same H and outer steps.\n",
          md_table(["H", "outer steps", "outer lr / momentum", "mode", "seeds", "final held-out loss", "vs int8",
                    "upload B/param/outer step (k=4)"], rows),
          f"\nHostile: k = {cfg['k']} honest peers and {ATTACK[1]} more sending {scale} × what it would send, every "
          "part combined by the plain mean or by the reducers' skipped mean; \"vs alone\" against the same mode's k "
          "honest peers alone (same H, outer steps, outer step and seeds; target: within 2%):\n",
          md_table(["H", "outer steps", "outer lr / momentum", "mode", "rule", "seeds", "final held-out loss",
                    "alone", "vs alone"],
                   [[r["H"], r["outer_steps"], f"{r['lr']:g} / {r['momentum']:g}", r["variant"], r["rule"], r["seeds"],
                     f"{r['final_loss']:.4f}", "–" if r["alone"] is None else f"{r['alone']:.4f}",
                     "–" if r["vs_alone"] is None else f"{100 * r['vs_alone']:+.2f}%"]
                    for r in summarize_hostile(result)]),
          "\nCodec (averaging/sparse.py), fp32 input per CPU second:\n",
          md_table(["mode", "torch threads", "values", "encode (select + quantize) GB/s", "decode GB/s",
                    "both GB/s", "B per value"],
                   [[c["mode"], c["threads"], f"{c['values']:,}", f"{c['encode_GBps_cpu']:.2f}",
                     f"{c['decode_GBps_cpu']:.2f}", f"{c['both_GBps_cpu']:.2f}", f"{c['bytes_per_value']:.4f}"]
                    for c in result["codec"]]),
          f"\n{len(result['runs'])} runs in {result['wall_s']:.0f} s wall.\n"]
    return "\n".join(md)


if __name__ == "__main__":
    from bench.cli import main

    raise SystemExit(main(name="sparse"))
