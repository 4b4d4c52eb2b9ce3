"""How the overlapped round's quality cost grows with the length of a run, blocking beside it.

``python -m bench.staleness [--quick]``: ``bench quality``'s simulation for :data:`OUTER_STEPS` outer steps and
each seed of ``bench.eager.SEEDS``: blocking int8 DiLoCo, and the node's rule with each round applied after a
third, a sixth and a fifteenth of the next phase, and a third *streamed* (the node's preview). Two worker
processes, one torch thread each.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

from bench.common import md_table

OUTER_STEPS = {"smoke": 3, "quick": 9, "full": 30}
LATE = {"own, ⅓ late": 1 / 3, "own, ⅙ late": 1 / 6, "own, 1/15 late": 1 / 15,  # the phase's share before it lands
        "own, ⅓ late, streamed": 1 / 3}
VARIANTS = ("blocking", *LATE)


def _train(job: tuple[str, int, dict]) -> list[float]:
    """One run (variant, seed, config): θ_global's held-out loss after every outer step (index 0: at start)."""
    import torch

    from bench import quality

    variant, seed, cfg = job
    torch.set_num_threads(1)
    cfg = {**cfg, "seed": seed}
    if variant == "blocking":
        curve = quality.run_variant("DiLoCo int8", cfg)["curve"]
    else:
        corpus, eval_set = quality.setup(cfg)
        curve, _ = quality.run_overlap(cfg, corpus, eval_set, LATE[variant], streamed="streamed" in variant)
    return [point[1] for point in curve]


def run(size: str) -> dict:
    from bench import quality
    from bench.eager import SEEDS

    cfg = dict(quality.SIZES[size], outer_steps=OUTER_STEPS[size])
    jobs = [(variant, seed, cfg) for seed in SEEDS for variant in VARIANTS]
    with mp.get_context("spawn").Pool(2) as pool:
        curves = pool.map(_train, jobs, chunksize=1)
        pool.close()  # let the workers exit on their own: a terminated one leaks hivemind's semaphores (a warning)
        pool.join()
    by_seed: dict[str, dict[str, list[float]]] = {}
    for (variant, seed, _), curve in zip(jobs, curves):
        by_seed.setdefault(str(seed), {})[variant] = curve
    return {"config": cfg, "curves_by_seed": by_seed}


def render(result: dict, docs_dir: Path) -> str:
    cfg, by_seed = result["config"], result["curves_by_seed"]
    steps = sorted({max(1, round(cfg["outer_steps"] * x)) for x in (1 / 3, 2 / 3, 1.0)})
    late = [v for v in LATE if all(v in c for c in by_seed.values())]

    def gap(c: dict, variant: str, n: int) -> float:
        return c[variant][n] / c["blocking"][n] - 1

    rows = [[seed, variant, *(f"{c['blocking'][n]:.4f} / {c[variant][n]:.4f} ({100 * gap(c, variant, n):+.2f}%)"
                              for n in steps)] for variant in late for seed, c in by_seed.items()]
    means = "; ".join(f"{variant}: " + ", ".join(
        f"after {n}: **{100 * sum(gap(c, variant, n) for c in by_seed.values()) / len(by_seed):+.2f}%**" for n in steps)
        for variant in late)
    return (f"Model `{cfg['preset']}`, k = {cfg['k']}, H = {cfg['H']}, int8, {cfg['outer_steps']} outer steps. "
            "Held-out loss of θ_global, blocking / overlapped (overlapped vs blocking):\n\n"
            + md_table(["seed", "overlapped", *(f"after outer step {n}" for n in steps)], rows)
            + f"\nMean over {len(by_seed)} seeds: {means}.\n"
            + "".join(f"\n*Note:* {', '.join(a['variants'])} trained by a second invocation ({a['date_utc']}, commit "
                      f"{a['commit']}, {a['elapsed_s']:.0f} s, this run's config and seeds); the training is "
                      "deterministic, so its figures are those one invocation would give.\n"
                      for a in result.get("added", [])))


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="staleness"))
