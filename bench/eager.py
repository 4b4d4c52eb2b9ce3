"""What θ̂ should step on at an overlapped hand-off: held-out loss of the estimate rules, side by side.

Run: ``python -m bench.eager [--quick]``. ``bench quality``'s simulation (k peers in one process,
int8 round trips, the node's ``OuterOptimizer`` and ``OuterSync``), with each round's average applied
at the END of the next phase (the most stale case), for every rule of ``bench.quality.ESTIMATES``:

- ``own``: θ̂ = OuterStep(θ_global, own Δ), the node's rule (node/outer_sync.py);
- ``mix``: own Δ/k plus (1 − 1/k) × the last average for the other members (Kale et al., arXiv 2502.12996);
- ``own/k``: own Δ/k alone;
- ``none``: no eager step, OuterStep(θ_global, 0).

Blocking DiLoCo int8 (``quality``'s variant (c)) runs in the same invocation as the reference.
Writes ``bench/out/eager[.quick].json`` and the ``eager`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench import quality
from bench.common import loadavg, md_table, provenance, provenance_md, upsert_section

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
MAIN_DOC = ROOT / "docs" / "benchmarks.md"


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
    return {"config": cfg, "final_loss": rows}


def section(result: dict, source: Path) -> str:
    size, losses = result["size"], result["final_loss"]
    base = losses["blocking"]
    rows = [[rule, f"{loss:.3f}", f"{100 * (loss / base - 1):+.1f}%"] for rule, loss in losses.items()]
    cfg = result["config"]
    return (f"<!-- bench:eager size={size} -->\n## 4b. What θ̂ steps on at a hand-off (`python -m bench.eager`)\n\n"
            + ("" if size == "full" else "> **Toy size**: run `python -m bench.eager` for the full-size figures.\n\n")
            + f"`bench quality`'s simulation (model `{cfg['preset']}`, k = {cfg['k']}, H = {cfg['H']}, "
            f"{cfg['outer_steps']} outer steps, int8), overlapped, each round's average applied at the end of the next "
            "phase. *own*: θ̂ = OuterStep(θ_global, own Δ), the node's rule; *mix*: own Δ/k plus (1 − 1/k) × the last "
            "average (Kale et al.); *own/k*: own Δ/k; *none*: no eager step. Final held-out loss, equal tokens.\n\n"
            + md_table(["rule", "final held-out loss", "vs blocking"], rows)
            + "\n" + provenance_md(result, source) + "<!-- /bench:eager -->\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.eager", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="quality's quick size instead of full (~15 min)")
    ap.add_argument("--no-doc", action="store_true", help="only write the JSON")
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    prov = provenance("python -m bench.eager" + (" --quick" if args.quick else ""))
    t0 = time.perf_counter()
    result = {"name": "eager", "size": size, **run(size)}
    result.update(elapsed_s=round(time.perf_counter() - t0, 1), loadavg_end=loadavg(), provenance=prov)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / ("eager.json" if size == "full" else f"eager.{size}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"final held-out loss by estimate rule: {result['final_loss']} → {path}")
    if not args.no_doc:
        upsert_section(MAIN_DOC, "eager", size, section(result, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
