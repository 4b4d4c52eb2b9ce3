"""What θ̂ should step on at an overlapped hand-off: the final held-out loss of each estimate rule, blocking beside.

``python -m bench.eager [--quick]``: ``bench quality``'s simulation, each round's average applied at the END of
the next phase, for every rule of ``bench.quality.ESTIMATES`` (``own`` is the node's); then ``own`` and ``fit``
with each round applied after a third of the next phase, against blocking, for each of :data:`SEEDS`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench import quality
from bench.common import md_table

SEEDS = (0, 1, 2)


def _final(cfg: dict, apply_after: float, rule: str) -> float:
    corpus, eval_set = quality.setup(cfg)
    return quality.run_overlap(cfg, corpus, eval_set, apply_after, estimate=rule)[0][-1][1]


def run(size: str) -> dict:
    cfg = quality.SIZES[size]
    torch.set_num_threads(1)
    rows = {"blocking": quality.run_variant("DiLoCo int8", cfg)["curve"][-1][1]}
    for rule in quality.ESTIMATES:
        rows[rule] = _final(cfg, 1.0, rule)
        print(f"[eager] {rule}: {rows[rule]:.4f} (blocking {rows['blocking']:.4f})", file=sys.stderr, flush=True)
    seeds = {}
    for seed in SEEDS:
        c = {**cfg, "seed": seed}
        seeds[str(seed)] = {"blocking": rows["blocking"] if seed == quality.SEED else
                            quality.run_variant("DiLoCo int8", c)["curve"][-1][1],
                            "overlap_third_late": _final(c, 1 / 3, "own"), "fit_third_late": _final(c, 1 / 3, "fit")}
        print(f"[eager] seed {seed}: {seeds[str(seed)]}", file=sys.stderr, flush=True)
    return {"config": cfg, "final_loss": rows, "third_late_by_seed": seeds}


def render(result: dict, docs_dir: Path) -> str:
    cfg, losses, by_seed = result["config"], result["final_loss"], result["third_late_by_seed"]
    own = [r["overlap_third_late"] / r["blocking"] - 1 for r in by_seed.values()]
    fit = [r["fit_third_late"] / r["blocking"] - 1 for r in by_seed.values()]
    return (f"Model `{cfg['preset']}`, k = {cfg['k']}, H = {cfg['H']}, {cfg['outer_steps']} outer steps, int8; each "
            "round applied at the end of the next phase:\n\n"
            + md_table(["rule", "final held-out loss", "vs blocking"],
                       [[rule, f"{loss:.3f}", f"{100 * (loss / losses['blocking'] - 1):+.1f}%"]
                        for rule, loss in losses.items()])
            + "\nEach round applied after a third of the next phase, by seed:\n\n"
            + md_table(["seed", "blocking", "own, ⅓ late", "vs blocking", "fit, ⅓ late", "vs blocking"],
                       [[seed, f"{r['blocking']:.4f}", f"{r['overlap_third_late']:.4f}", f"{100 * a:+.2f}%",
                         f"{r['fit_third_late']:.4f}", f"{100 * b:+.2f}%"]
                        for (seed, r), a, b in zip(by_seed.items(), own, fit)])
            + f"\nMean over {len(own)} seeds: *own* (the node's rule) **{100 * sum(own) / len(own):+.2f}%**, *fit* "
            f"{100 * sum(fit) / len(fit):+.2f}%.\n")


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="eager"))
