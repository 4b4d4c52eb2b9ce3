"""What θ̂ should step on at an overlapped hand-off: held-out loss of the estimate rules, side by side.

Run: ``python -m bench.eager [--quick]``. ``bench quality``'s simulation (k peers in one process,
int8 round trips, the node's ``OuterOptimizer`` and ``OuterSync``), with each round's average applied
at the END of the next phase (the most stale case), for every rule of ``bench.quality.ESTIMATES``:

- ``own``: θ̂ = OuterStep(θ_global, own Δ), the node's rule (node/outer_sync.py);
- ``fit``: θ̂ = OuterStep(θ_global, ρ·own Δ), ρ the least-squares fit of the peer's last round's
  average on its own Δ of it (``quality.fit_scale``), studied, not adopted;
- ``mix``: own Δ/k plus (1 − 1/k) × the last average for the other members (Kale et al., arXiv 2502.12996);
- ``own/k``: own Δ/k alone;
- ``none``: no eager step, OuterStep(θ_global, 0).

Blocking DiLoCo int8 (``quality``'s variant (c)) runs in the same invocation as the reference.
Then ``own`` and ``fit`` with each round applied after a THIRD of the next phase (a round a third of
a phase long, issue 12's setting) against blocking, for :data:`SEEDS` (model initialisation and data
order): the staleness cost is small next to the spread between seeds, so one seed does not say it.
Writes ``bench/out/eager[.quick].json`` and the ``eager`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from bench import quality
from bench.common import md_table, provenance_md, standalone_main

ROOT = Path(__file__).resolve().parent.parent
SEEDS = (0, 1, 2)


def run(size: str) -> dict:
    cfg = quality.SIZES[size]
    torch.set_num_threads(1)
    rows = {"blocking": quality.run_variant("DiLoCo int8", cfg, 1)["curve"][-1][1]}
    print(f"[eager] blocking: {rows['blocking']:.4f}", file=sys.stderr, flush=True)
    corpus, eval_set = quality._setup(cfg)
    for rule in quality.ESTIMATES:
        curve, _ = quality._run_overlap(cfg, corpus, eval_set, quality._warmup_steps(), 1.0, estimate=rule)
        rows[rule] = curve[-1][1]
        print(f"[eager] {rule}: {rows[rule]:.4f}", file=sys.stderr, flush=True)
    seeds, default = {}, quality.SEED
    for seed in SEEDS:
        with _seed(seed):
            blocking = rows["blocking"] if seed == default else quality.run_variant("DiLoCo int8", cfg, 1)["curve"][-1][1]
            corpus, eval_set = quality._setup(cfg)
            late, _ = quality._run_overlap(cfg, corpus, eval_set, quality._warmup_steps(), 1 / 3, estimate="own")
            corpus, eval_set = quality._setup(cfg)
            fit, _ = quality._run_overlap(cfg, corpus, eval_set, quality._warmup_steps(), 1 / 3, estimate="fit")
        seeds[str(seed)] = {"blocking": blocking, "overlap_third_late": late[-1][1], "fit_third_late": fit[-1][1]}
        print(f"[eager] seed {seed}: {seeds[str(seed)]}", file=sys.stderr, flush=True)
    return {"config": cfg, "final_loss": rows, "third_late_by_seed": seeds}


@contextlib.contextmanager
def _seed(seed: int):
    """``quality``'s runs with another seed (model initialisation and data order)."""
    before, quality.SEED = quality.SEED, seed
    try:
        yield
    finally:
        quality.SEED = before


def section(result: dict, source: Path) -> str:
    size, losses = result["size"], result["final_loss"]
    base = losses["blocking"]
    rows = [[rule, f"{loss:.3f}", f"{100 * (loss / base - 1):+.1f}%"] for rule, loss in losses.items()]
    cfg = result["config"]
    return (f"<!-- bench:eager size={size} -->\n## 4b. What θ̂ steps on at a hand-off (`python -m bench.eager`)\n\n"
            + ("" if size == "full" else "> **Toy size**: run `python -m bench.eager` for the full-size figures.\n\n")
            + f"`bench quality`'s simulation (model `{cfg['preset']}`, k = {cfg['k']}, H = {cfg['H']}, "
            f"{cfg['outer_steps']} outer steps, int8), overlapped, each round's average applied at the end of the next "
            "phase. *own*: θ̂ = OuterStep(θ_global, own Δ), the node's rule; *fit*: θ̂ = OuterStep(θ_global, ρ·own Δ), "
            "ρ the least-squares fit of the peer's last round's average on its own Δ of it, clipped to [0, 1] (studied, "
            "not adopted); *mix*: own Δ/k plus (1 − 1/k) × the last "
            "average (Kale et al.); *own/k*: own Δ/k; *none*: no eager step. Final held-out loss, equal tokens.\n\n"
            + md_table(["rule", "final held-out loss", "vs blocking"], rows)
            + _seeds_md(result.get("third_late_by_seed", {}))
            + "\n" + provenance_md(result, source) + "<!-- /bench:eager -->\n")


def _seeds_md(by_seed: dict) -> str:
    if not by_seed:
        return ""
    gaps = [r["overlap_third_late"] / r["blocking"] - 1 for r in by_seed.values()]
    fit = [r["fit_third_late"] / r["blocking"] - 1 for r in by_seed.values() if "fit_third_late" in r]
    rows = [[seed, f"{r['blocking']:.4f}", f"{r['overlap_third_late']:.4f}", f"{100 * g:+.2f}%",
             f"{r['fit_third_late']:.4f}" if "fit_third_late" in r else "–",
             f"{100 * (r['fit_third_late'] / r['blocking'] - 1):+.2f}%" if "fit_third_late" in r else "–"]
            for (seed, r), g in zip(by_seed.items(), gaps)]
    return ("\nThe node's rule (*own*) and *fit* with each round applied after a third of the next phase (a round a "
            "third of a phase long), against blocking, by seed (model initialisation and data order):\n\n"
            + md_table(["seed", "blocking", "own, ⅓ late", "vs blocking", "fit, ⅓ late", "vs blocking"], rows)
            + f"\nMean over {len(gaps)} seeds: *own* (the node's rule) **{100 * sum(gaps) / len(gaps):+.2f}%**"
            + (f", *fit* {100 * sum(fit) / len(fit):+.2f}%" if fit else "") + " (issue 12's target: within 1%).\n")


def main(argv: list[str] | None = None) -> int:
    return standalone_main("eager", __doc__, run, section, lambda r: f"final held-out loss by estimate rule: {r['final_loss']}",
                           quick_help="quality's quick size instead of full (~15 min)", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
