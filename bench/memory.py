"""Memory of a node: peak PSS of its whole process tree, bytes per parameter, state dir, start-up.

``python -m bench.memory [--quick] [--base REV] [--models A,B] [--base-nodes N] [--soak ROUNDS]``. For each model,
two real nodes on 127.0.0.1 (CPU, one thread each) average for a few outer steps with checkpoints; the second
joins after the first's outer step 1, so it downloads the first's state. The PSS of every process of each tree
is sampled every second. ``--base REV`` runs the same nodes from a git worktree of REV side by side.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, human_bytes, md_table
from bench.nodes import NodeRun, NodeSpec, run_nodes

BASE = "d6bcc85"  # main before issue 35 (memory)
TRAINING_STATE_B = 16  # fp32 weights, grads, AdamW exp_avg and exp_avg_sq, per parameter
# model -> (join flags, outer steps, nodes of the base code); the joiner starts after the first's outer step 1
MODELS: dict[str, tuple[list[str], int, int]] = {
    # (tiny's H: on an idle Xeon core 40 inner steps took 0.4 s, so the first node reached its last outer step
    # before the joiner, started at its outer step 1, had dialed it: 200 keep it alive for the joiner)
    "tiny": (["--model", "tiny", "--inner-steps", "200", "--batch-size", "4", "--seq-len", "64"], 8, 2),
    "small": (["--model", "small", "--inner-steps", "12", "--batch-size", "2", "--seq-len", "64"], 8, 2),
    "llama-tiny": (["--model", "llama-tiny", "--tokenizer", "byte", "--inner-steps", "12", "--batch-size", "2",
                    "--seq-len", "64"], 8, 2),
    "llama-150m": (["--model", "llama-150m", "--tokenizer", "byte", "--inner-steps", "2", "--batch-size", "1",
                    "--seq-len", "64"], 4, 1),
}
SIZES = {"smoke": ["tiny"], "quick": ["tiny", "small", "llama-tiny"], "full": list(MODELS)}
COMMON = ["--device", "cpu", "--threads", "1", "--max-dataset-bytes", "400000", "--averaging-window", "20",
          "--matchmaking-time", "2"]
SOAK_ARGS = ["--model", "tiny", "--inner-steps", "5", "--batch-size", "4", "--seq-len", "64", "--eval-budget", "0.02"]
SOAK_WARMUP_ROUNDS = 100
ROLES = ("main", "DHT", "averager", "p2pd", "shm manager")
OPTIONS = {  # python -m bench.memory's own
    "--base": {"default": BASE, "help": f"git revision to compare with (default {BASE}); '' for none"},
    "--base-nodes": {"type": int, "default": None, "metavar": "N",
                     "help": "nodes of the base code per model (default: 2, 1 for llama-150m: ~20 GB each)"},
    "--models": {"default": None, "help": "comma-separated subset of " + ", ".join(MODELS)},
    "--soak": {"type": int, "default": 0, "metavar": "ROUNDS",
               "help": "instead: two tiny nodes averaging ROUNDS outer steps (H = 5), PSS growth per 100 rounds"},
}


def _role(pid: int, comm: str, root: int, sample: dict[int, tuple[str, int]]) -> str:
    """main, p2pd, torch's shm manager, or the forked python children in the order they started: the DHT, then
    the averager (a client-mode restart's second DHT would come third)."""
    if pid == root or comm.startswith(("p2pd", "torch_shm")):
        return "main" if pid == root else "p2pd" if comm.startswith("p2pd") else "shm manager"
    i = sorted(p for p, (c, _) in sample.items() if p != root and not c.startswith(("p2pd", "torch_shm"))).index(pid)
    return ("DHT", "averager")[i] if i < 2 else f"child-{i + 1}"


def _node_figures(run: NodeRun) -> dict[str, Any]:
    m = re.search(r"\(([\d.]+)M params\)", run.node.output())  # the node prints "(201.88M params)" at start
    params = round(float(m[1]) * 1e6) if m else None
    peak_total, peak_roles = 0, {}
    for _, sample in run.pss:
        peak_total = max(peak_total, sum(b for _, b in sample.values()))
        for pid, (comm, b) in sample.items():
            role = _role(pid, comm, run.node.proc.pid, sample)
            peak_roles[role] = max(peak_roles.get(role, 0), b)
    files = {f.name: f.stat().st_size for f in run.node.state_dir.glob("*") if f.is_file()}
    startup = (run.records("start") or [{}])[0].get("startup_s")
    steps = run.records("outer_step")
    out = {"exit_code": run.exit_code, "params": params, "peak_pss": peak_total, "peak_pss_by_role": peak_roles,
           "state_dir": {"total": sum(files.values()), **{k: v for k, v in files.items() if k.startswith("checkpoint")}},
           "startup_s": startup, "startup_total_s": round(sum(v for v in startup.values() if v), 1) if startup else None,
           "outer_steps": len(steps), "rounds_ok": sum(1 for e in steps if e.get("round_ok")),
           "state_syncs": len(run.records("state_sync")), "samples": len(run.pss), "log_tail": run.log_tail(1500)}
    if params:
        out.update(peak_b_per_param=round(peak_total / params, 1),
                   beyond_training_state_b_per_param=round(peak_total / params - TRAINING_STATE_B, 1),
                   state_dir_b_per_param=round(out["state_dir"]["total"] / params, 1))
    return out


def _slope_per_100(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of (round, bytes), in bytes per 100 rounds."""
    if len(points) < 3:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / var if var else None


def _soak(rounds: int, workdir: Path) -> list[dict[str, Any]]:
    """Two tiny nodes averaging ``rounds`` outer steps: each tree's PSS at every round, and its growth per 100
    rounds after :data:`SOAK_WARMUP_ROUNDS` (a least-squares line through all of them)."""
    args = [*SOAK_ARGS, *COMMON, "--max-outer-steps", str(rounds)]
    runs = run_nodes([NodeSpec(f"s{i}", f"mem-soak-{workdir.name}", args) for i in range(2)], workdir, 6 * 3600.0,
                     sample_memory=True)
    out = []
    for r in runs:
        totals = [(t, sum(b for _, b in sample.values())) for t, sample in r.pss]
        at_round = [(e["outer_step"], min(totals, key=lambda s: abs(s[0] - e["time"]))[1])
                    for e in r.records("outer_step") if totals]
        after = [(x, y) for x, y in at_round if x >= SOAK_WARMUP_ROUNDS]
        slope = _slope_per_100(after)
        out.append({"exit_code": r.exit_code, "rounds": len(at_round),
                    "rounds_ok": sum(1 for e in r.records("outer_step") if e.get("round_ok")),
                    "pss_at_warmup": after[0][1] if after else None, "pss_at_end": at_round[-1][1] if at_round else None,
                    "peak_pss": max((y for _, y in totals), default=0),
                    "growth_per_100_rounds": round(slope) if slope is not None else None,
                    "pss_every_50_rounds": [[x, y] for x, y in at_round if x % 50 == 0]})
    return out


def run(size: str, base: str | None = BASE, base_nodes: int | None = None, models: str | None = None,
        soak: int = 0) -> dict[str, Any]:
    """A run of some ``models`` only is saved as ``memory-models``: it replaces neither memory.json nor section 9."""
    if soak:
        with tempfile.TemporaryDirectory(prefix="bench-memory-soak-") as tmp:
            return {"name": "memory-soak", "rounds": soak, "warmup_rounds": SOAK_WARMUP_ROUNDS,
                    "nodes": _soak(soak, Path(tmp))}
    results: dict[str, Any] = {"models": {}, "base": base or None, **({"name": "memory-models"} if models else {})}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tmp = Path(tmp)
        if base:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tmp / "base"), base],
                           check=True, capture_output=True)
        try:
            for model in models.split(",") if models else SIZES[size]:
                flags, outer_steps, n_base = MODELS[model]
                entry = results["models"][model] = {}
                variants = [("now", REPO, 2)] + ([("base", tmp / "base", base_nodes or n_base)] if base else [])
                for variant, code, nodes in variants:
                    specs = [NodeSpec(f"n{i}", f"mem-{model}-{variant}", [*flags, *COMMON, "--max-outer-steps",
                                      str(outer_steps)], join_after_step=1 if i else 0) for i in range(nodes)]
                    runs = run_nodes(specs, tmp / f"{model}-{variant}", 1800.0, cwd=code, sample_memory=True)
                    entry[variant] = [_node_figures(r) for r in runs]
                    print(f"[memory] {model} {variant}: " + ", ".join(
                        f"{human_bytes(n['peak_pss'])} ({n.get('peak_b_per_param')} B/param), state dir "
                        f"{human_bytes(n['state_dir']['total'])}" for n in entry[variant]), file=sys.stderr, flush=True)
        finally:
            if base:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "base")],
                               capture_output=True)
    return results


def render(result: dict[str, Any], docs_dir: Path) -> str:
    if "nodes" in result:  # --soak
        return md_table(["node", "rounds", "PSS at round 100", "PSS at the end", "peak", "growth per 100 rounds"],
                        [[i, n["rounds"], human_bytes(n["pss_at_warmup"] or 0), human_bytes(n["pss_at_end"] or 0),
                          human_bytes(n["peak_pss"]), human_bytes(n["growth_per_100_rounds"] or 0)]
                         for i, n in enumerate(result["nodes"])])
    rows = []
    for model, entry in result["models"].items():
        for variant in ("now", "base"):
            for i, n in enumerate(entry.get(variant, [])):
                roles = n["peak_pss_by_role"]
                rows.append([model, f"{variant} n{i}", f"{(n['params'] or 0) / 1e6:.2f}M", human_bytes(n["peak_pss"]),
                             n.get("peak_b_per_param"), n.get("beyond_training_state_b_per_param"),
                             " / ".join(human_bytes(roles[r]) if r in roles else "–" for r in ROLES),
                             human_bytes(n["state_dir"]["total"]), n.get("state_dir_b_per_param"),
                             n.get("startup_total_s"), f"{n['rounds_ok']}/{n['outer_steps']}", n["state_syncs"],
                             n["exit_code"]])
    return (f"*now*: this checkout; *base*: `{result.get('base')}`.\n\n"
            + md_table(["model", "code, node", "params", "peak PSS", "B/param", f"beyond {TRAINING_STATE_B} B",
                        "peak by process (" + " / ".join(ROLES) + ")", "state dir", "B/param", "start-up s", "rounds ok",
                        "downloads", "exit"], rows))


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(name="memory"))
