"""Memory of a node: peak PSS of its whole process tree, bytes per parameter, state dir, start-up.

Run: ``python -m bench.memory [--quick] [--base REV]``. For each model, two real ``diloco-node join``
processes on 127.0.0.1 (CPU, one thread each) average for a few outer steps with checkpoints; the
second starts once the first has trained a while, so it downloads the first's state at its join.
Every second, the PSS of every process of each node's tree (the node, its forked DHT and averager
processes, ``p2pd``) is read from /proc (``bench.procs.pss_bytes``: a page shared by N processes counts
1/N in each, so the tree's sum is what the node holds of the machine). Reported per node: the peak
of that sum, in bytes and per parameter, its part beyond the model's own training state on the CPU
(16 B/param: fp32 weights, grads and AdamW's two moments), the peak of each role, the state dir's
size and the start-up seconds of the start record.

``--base REV`` runs the same nodes from a git worktree of ``REV`` (default: the commit before the
memory work, :data:`BASE`) in the same invocation, side by side. A model too large for two nodes of
the base code on this machine (``llama-150m``: about 20 GB each) runs one node there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_OUT, REPO, human_bytes, loadavg, md_table, provenance, provenance_md, result_path, upsert_section
from bench.nodes import NodeSpec, run_nodes

BASE = "d6bcc85"  # main before issue 35 (memory)
TRAINING_STATE_B = 16  # fp32 weights, grads, AdamW exp_avg and exp_avg_sq, per parameter
# model -> (join flags, outer steps, nodes of the base code); the joiner starts after the first's outer step 1
MODELS: dict[str, tuple[list[str], int, int]] = {
    "tiny": (["--model", "tiny", "--inner-steps", "40", "--batch-size", "4", "--seq-len", "64"], 8, 2),
    "small": (["--model", "small", "--inner-steps", "12", "--batch-size", "2", "--seq-len", "64"], 8, 2),
    "llama-tiny": (["--model", "llama-tiny", "--tokenizer", "byte", "--inner-steps", "12", "--batch-size", "2",
                    "--seq-len", "64"], 8, 2),
    "llama-150m": (["--model", "llama-150m", "--tokenizer", "byte", "--inner-steps", "2", "--batch-size", "1",
                    "--seq-len", "64"], 4, 1),
}
SIZES = {"smoke": ["tiny"], "quick": ["tiny", "small", "llama-tiny"], "full": list(MODELS)}
COMMON = ["--device", "cpu", "--threads", "1", "--max-dataset-bytes", "400000", "--averaging-window", "20",
          "--matchmaking-time", "2"]
TIMEOUT_S = 1800.0


def _params(log: Path) -> int | None:
    """The parameter count the node printed at start ("(201.88M params)")."""
    m = re.search(r"\(([\d.]+)M params\)", log.read_text(errors="replace"))
    return round(float(m[1]) * 1e6) if m else None


def _dir_bytes(path: Path) -> dict[str, int]:
    files = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()} if path.is_dir() else {}
    return {"total": sum(files.values()), **{k: v for k, v in files.items() if k.startswith("checkpoint")}}


ROLES = ("main", "DHT", "averager", "p2pd", "shm manager")


def _role(pid: int, comm: str, root: int, sample: dict[int, tuple[str, int]]) -> str:
    """main, p2pd, torch's shm manager, or the forked python children in the order they started: the
    DHT, then the averager (a client-mode restart's second DHT would come third)."""
    if pid == root:
        return "main"
    if comm.startswith("p2pd"):
        return "p2pd"
    if comm.startswith("torch_shm"):
        return "shm manager"
    forked = sorted(p for p, (c, _) in sample.items() if p != root and not c.startswith(("p2pd", "torch_shm")))
    return ("DHT", "averager")[forked.index(pid)] if forked.index(pid) < 2 else f"child-{forked.index(pid) + 1}"


def _node_figures(run, state_dir: Path) -> dict[str, Any]:
    params = _params(run.log)
    peak_total, peak_roles = 0, {}
    root = run.proc.pid
    for _, sample in run.pss_samples:
        total = sum(b for _, b in sample.values())
        peak_total = max(peak_total, total)
        for pid, (comm, b) in sample.items():
            role = _role(pid, comm, root, sample)
            peak_roles[role] = max(peak_roles.get(role, 0), b)
    starts = run.records("start")
    startup = starts[0].get("startup_s") if starts else None
    steps = run.records("outer_step")
    out = {"exit_code": run.exit_code, "params": params, "peak_pss": peak_total, "peak_pss_by_role": peak_roles,
           "state_dir": _dir_bytes(state_dir), "startup_s": startup,
           "startup_total_s": round(sum(v for v in (startup or {}).values() if v), 1) if startup else None,
           "outer_steps": len(steps), "rounds_ok": sum(1 for e in steps if e.get("round_ok")),
           "state_syncs": len(run.records("state_sync")), "samples": len(run.pss_samples)}
    if params:
        out["peak_b_per_param"] = round(peak_total / params, 1)
        out["beyond_training_state_b_per_param"] = round(peak_total / params - TRAINING_STATE_B, 1)
        out["state_dir_b_per_param"] = round(out["state_dir"]["total"] / params, 1)
    if run.exit_code != 0:
        out["log_tail"] = run.log.read_text(errors="replace")[-1500:]
    return out


def measure(model: str, code: Path, nodes: int, workdir: Path) -> list[dict[str, Any]]:
    flags, outer_steps, _ = MODELS[model]
    run_id = f"mem-{model}-{workdir.name}"
    args = [*flags, *COMMON, "--max-outer-steps", str(outer_steps)]
    specs = [NodeSpec(name=f"n{i}", run_id=run_id, args=args, join_after_step=1 if i else 0) for i in range(nodes)]
    runs = run_nodes(specs, workdir, TIMEOUT_S, cwd=code, sample_memory=True, log_tag=f"{model}: ")
    return [_node_figures(r, workdir / f"state-{r.spec.name}") for r in runs]


SOAK_ARGS = ["--model", "tiny", "--inner-steps", "5", "--batch-size", "4", "--seq-len", "64", "--eval-budget", "0.02"]
SOAK_WARMUP_ROUNDS = 100


def _slope_per_100(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of (round, bytes), in bytes per 100 rounds."""
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / var if var else None


def soak(rounds: int, workdir: Path) -> list[dict[str, Any]]:
    """Two tiny nodes averaging ``rounds`` outer steps: each tree's PSS at every round, and its growth
    per 100 rounds after :data:`SOAK_WARMUP_ROUNDS` (a least-squares line through all of them)."""
    run_id = f"mem-soak-{workdir.name}"
    args = [*SOAK_ARGS, *COMMON, "--max-outer-steps", str(rounds)]
    specs = [NodeSpec(name=f"s{i}", run_id=run_id, args=args) for i in range(2)]
    runs = run_nodes(specs, workdir, 6 * 3600.0, sample_memory=True, log_tag="soak: ")
    out = []
    for r in runs:
        totals = [(t, sum(b for _, b in sample.values())) for t, sample in r.pss_samples]
        at_round = []
        for e in r.records("outer_step"):
            if totals:
                at_round.append((e["outer_step"], min(totals, key=lambda s: abs(s[0] - e["time"]))[1]))
        after = [(x, y) for x, y in at_round if x >= SOAK_WARMUP_ROUNDS]
        slope = _slope_per_100(after)
        out.append({"exit_code": r.exit_code, "rounds": len(at_round),
                    "rounds_ok": sum(1 for e in r.records("outer_step") if e.get("round_ok")),
                    "pss_at_warmup": after[0][1] if after else None, "pss_at_end": at_round[-1][1] if at_round else None,
                    "peak_pss": max((y for _, y in totals), default=0),
                    "growth_per_100_rounds": round(slope) if slope is not None else None,
                    "pss_every_50_rounds": [[x, y] for x, y in at_round if x % 50 == 0]})
    return out


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    return where


def run(size: str, base: str | None = BASE, base_nodes: int | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {"models": {}, "base": base}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tmp = Path(tmp)
        base_code = _worktree(base, tmp / "base") if base else None
        try:
            for model in SIZES[size]:
                entry = results["models"][model] = {}
                for variant, code, nodes in (("now", REPO, 2), ("base", base_code, base_nodes or MODELS[model][2])):
                    if code is None:
                        continue
                    print(f"[memory] {model} ({variant}, {nodes} node(s)) ...", file=sys.stderr, flush=True)
                    entry[variant] = measure(model, code, nodes, tmp / f"{model}-{variant}")
                    print(f"[memory] {model} {variant}: " + ", ".join(
                        f"{human_bytes(n['peak_pss'])} ({n.get('peak_b_per_param')} B/param), state dir "
                        f"{human_bytes(n['state_dir']['total'])}" for n in entry[variant]), file=sys.stderr, flush=True)
        finally:
            if base_code is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_code)],
                               capture_output=True)
    return results


def _row(model: str, variant: str, n: dict[str, Any]) -> list[Any]:
    roles = n["peak_pss_by_role"]
    return [model, variant, f"{(n['params'] or 0) / 1e6:.2f}M", human_bytes(n["peak_pss"]),
            n.get("peak_b_per_param"), n.get("beyond_training_state_b_per_param"),
            " / ".join(human_bytes(roles[r]) if r in roles else "–" for r in ROLES),
            human_bytes(n["state_dir"]["total"]), n.get("state_dir_b_per_param"), n.get("startup_total_s"),
            f"{n['rounds_ok']}/{n['outer_steps']}", n["state_syncs"], n["exit_code"]]


def section(result: dict[str, Any], source: Path) -> str:
    rows = []
    for model, entry in result["models"].items():
        for variant in ("now", "base"):
            for i, n in enumerate(entry.get(variant, [])):
                rows.append(_row(model, f"{variant} n{i}", n))
    return (f"<!-- bench:memory size={result['size']} -->\n## 9. Memory of a node (`python -m bench.memory`)\n\n"
            + ("" if result["size"] == "full" else "> **Toy size**: run `python -m bench.memory` for the full-size figures.\n\n")
            + "Two nodes per model on 127.0.0.1 (CPU, one thread each), averaging for a few outer steps with "
            "checkpoints; the second joins late and downloads the first's state. *now*: this checkout; *base*: "
            f"`{result.get('base')}`" + (", the code before the memory work" if result.get("base") == BASE else "")
            + ", run side by side in the same invocation (its node count is in the table: one node for llama-150m "
            f"at `{BASE}`, which two would not fit on this 24 GB machine). Peak PSS of each "
            "node's whole process tree (the node, its DHT and averager processes, p2pd), per parameter, and beyond "
            f"the model's own training state on the CPU ({TRAINING_STATE_B} B/param: weights, grads, AdamW's two "
            "moments; process overheads included, so small models show large figures). By process: each one's own peak "
            "(they need not peak together; shared pages count half in each of two sharers).\n\n"
            + md_table(["model", "code, node", "params", "peak PSS", "B/param", "beyond 16 B", "peak by process ("
                        + " / ".join(ROLES) + ")", "state dir", "B/param", "start-up s", "rounds ok", "downloads",
                        "exit"], rows)
            + "\n" + provenance_md(result, source) + "<!-- /bench:memory -->\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny, small and llama-tiny only (a few minutes)")
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--base", default=BASE, help=f"git revision to compare with (default {BASE}); '' for none")
    ap.add_argument("--base-nodes", type=int, default=None, metavar="N",
                    help="nodes of the base code per model (default: 2, 1 for llama-150m, whose base nodes need ~20 GB each)")
    ap.add_argument("--models", default=None, help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--soak", type=int, default=0, metavar="ROUNDS",
                    help="instead: two tiny nodes averaging ROUNDS outer steps (H = 5), PSS growth per 100 rounds")
    ap.add_argument("--no-doc", action="store_true", help="only write the JSON")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="raw JSON results (default: bench/out)")
    args = ap.parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    if args.soak:
        with tempfile.TemporaryDirectory(prefix="bench-memory-soak-") as tmp:
            nodes = soak(args.soak, Path(tmp))
        result = {"name": "memory-soak", "rounds": args.soak, "warmup_rounds": SOAK_WARMUP_ROUNDS, "nodes": nodes,
                  "loadavg_end": loadavg(), "provenance": provenance(f"python -m bench.memory --soak {args.soak}")}
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / "memory-soak.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps([{k: n[k] for k in ("rounds", "pss_at_warmup", "pss_at_end", "growth_per_100_rounds")}
                          for n in nodes]))
        print(f"→ {path}")
        return 0
    if args.models:
        SIZES[size] = [m for m in args.models.split(",") if m in MODELS]
    prov = provenance(" ".join(["python -m bench.memory", *(sys.argv[1:] if argv is None else argv)]))
    t0 = time.perf_counter()
    result = {"name": "memory", "size": size, **run(size, args.base or None, args.base_nodes)}
    result.update(elapsed_s=round(time.perf_counter() - t0, 1), loadavg_end=loadavg(), provenance=prov)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(args.out_dir, "memory", size)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({m: {v: [(n.get("peak_b_per_param"), n.get("state_dir_b_per_param")) for n in ns]
                          for v, ns in e.items()} for m, e in result["models"].items()}))
    print(f"→ {path}")
    if not args.no_doc and not args.models:
        upsert_section(REPO / "docs" / "benchmarks.md", "memory", size, section(result, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
