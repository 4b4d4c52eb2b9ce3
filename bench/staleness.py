"""How the overlapped round's quality cost grows with the length of a run, blocking beside it.

Run: ``python -m bench.staleness [--quick]``. ``bench quality``'s simulation (k peers in one process,
int8 round trips, the node's ``OuterOptimizer`` and ``OuterSync``) for :data:`OUTER_STEPS` outer
steps, three times longer than ``bench quality``, for each seed of ``bench.eager.SEEDS``: blocking
DiLoCo int8, and the node's overlapped rule (*own*) with each round applied after a third of the next
phase (a round a third of a phase long, issue 12's setting), a sixth and a fifteenth (shorter rounds:
how the cost scales with the share of a phase the eager estimate stands in for the average), and a
third *streamed*: the average reaching θ_local tensor by tensor over the round (the node's preview,
``OuterSync.correct``). The
held-out loss of θ_global after every outer step is compared at equal tokens; no schedule depends on
the run length, so the first 10 outer steps are those of ``bench quality``. Two worker processes
(one torch thread each).
Writes ``bench/out/staleness[.quick].json`` and the ``staleness`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

from bench.common import md_table, provenance_md, standalone_main

OUTER_STEPS = {"smoke": 3, "quick": 9, "full": 30}
LATE = {"own, ⅓ late": 1 / 3, "own, ⅙ late": 1 / 6, "own, 1/15 late": 1 / 15,  # variant -> the phase's share before the round lands
        "own, ⅓ late, streamed": 1 / 3}
STREAMED = {"own, ⅓ late, streamed"}  # the average reaches θ_local tensor by tensor over the round (the node's preview)
VARIANTS = ("blocking", *LATE)


def _train(job: tuple[str, int, dict]) -> list[float]:
    """One run (variant, seed, config): θ_global's held-out loss after every outer step (index 0: at start)."""
    import torch

    from bench import quality

    variant, seed, cfg = job
    torch.set_num_threads(1)
    quality.SEED = seed
    if variant == "blocking":
        curve = quality.run_variant("DiLoCo int8", cfg, 1)["curve"]
    else:
        corpus, eval_set = quality._setup(cfg)
        curve, _ = quality._run_overlap(cfg, corpus, eval_set, quality._warmup_steps(), LATE[variant], estimate="own",
                                        streamed=variant in STREAMED)
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
        print(f"[staleness] seed {seed} {variant}: {curve[-1]:.4f}", file=sys.stderr, flush=True)
    return {"config": cfg, "curves_by_seed": by_seed}


def _checkpoints(n: int) -> list[int]:
    return sorted({max(1, round(n * f)) for f in (1 / 3, 2 / 3, 1.0)})


def section(result: dict, source: Path) -> str:
    size, cfg, by_seed = result["size"], result["config"], result["curves_by_seed"]
    steps = _checkpoints(cfg["outer_steps"])
    late = [v for v in LATE if all(v in c for c in by_seed.values())]  # (a result of an older version: ⅓ only)

    def gap(c: dict, variant: str, n: int) -> float:
        return c[variant][n] / c["blocking"][n] - 1

    rows = [[seed, variant, *(f"{c['blocking'][n]:.4f} / {c[variant][n]:.4f} ({100 * gap(c, variant, n):+.2f}%)"
                              for n in steps)]
            for variant in late for seed, c in by_seed.items()]
    means = "; ".join(f"{variant}: " + ", ".join(
        f"after {n}: **{100 * sum(gap(c, variant, n) for c in by_seed.values()) / len(by_seed):+.2f}%**" for n in steps)
        for variant in late)
    return (f"<!-- bench:staleness size={size} -->\n## 4c. The overlap's quality cost over a longer run "
            "(`python -m bench.staleness`)\n\n"
            + ("" if size == "full" else "> **Toy size**: run `python -m bench.staleness` for the full-size figures.\n\n")
            + f"`bench quality`'s simulation (model `{cfg['preset']}`, k = {cfg['k']}, H = {cfg['H']}, int8) for "
            f"{cfg['outer_steps']} outer steps: blocking DiLoCo against the node's overlapped rule with each round "
            "applied after a third of the next phase (issue 12's setting), a sixth, and a fifteenth (shorter rounds); "
            "*streamed*: a third, with the average reaching θ_local tensor by tensor, evenly over the round, as the "
            "node previews it (`OuterSync.correct`). "
            "Held-out loss of θ_global, blocking / overlapped (overlapped vs blocking), at equal tokens, after the "
            "given outer step:\n\n"
            + md_table(["seed", "overlapped", *(f"after outer step {n}" for n in steps)], rows)
            + f"\nMean over {len(by_seed)} seeds: {means} (issue 12's target: within 1%).\n\n"
            + "".join(f"*Note:* {', '.join(a['variants'])} trained by a second invocation ({a['date_utc']}, commit "
                      f"{a['commit']}, {a['elapsed_s']:.0f} s, this run's config and seeds, `bench.staleness._train`); "
                      "the training is deterministic (a rerun of this run's ⅓-late seed 0 reproduced its first 10 outer steps to every digit), "
                      "so its figures are those one invocation would give.\n\n" for a in result.get("added", []))
            + provenance_md(result, source) + "<!-- /bench:staleness -->\n")


def main(argv: list[str] | None = None) -> int:
    return standalone_main("staleness", __doc__, run, section,
                           lambda r: f"final held-out loss by seed: "
                                     f"{ {s: {v: round(x[-1], 4) for v, x in c.items()} for s, c in r['curves_by_seed'].items()} }",
                           quick_help="quality's quick size, 9 outer steps (~2 min) instead of 30 at full size (~12 min)",
                           argv=argv)


if __name__ == "__main__":
    sys.exit(main())
