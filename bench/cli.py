"""``python -m bench``: run benchmarks, save raw JSON, regenerate docs/benchmarks.md."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # before anything imports hivemind

from bench import NAMES  # noqa: E402
from bench.common import DEFAULT_DOC, DEFAULT_OUT, command_line, loadavg, provenance, save_result  # noqa: E402

# forking benchmarks first: their peers are forked from this process before any torch thread pool exists
RUN_ORDER = ("wire", "round", "netns", "overlap", "speeds", "scale", "codec", "quality")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Benchmarks of diloco-swarm. Each writes raw JSON to bench/out/NAME.json and rewrites its section "
            "of docs/benchmarks.md (plus docs/bench-NAME.png where it has a plot)."
        ),
        epilog=(
            "benchmarks: wire (bytes per outer step: int8/fp16/fp32 vs data-parallel), codec (quantization "
            "throughput and error), round (averaging round time vs loopback TCP ceiling), quality (held-out loss "
            "at equal tokens: data-parallel vs DiLoCo fp32/int8 vs no averaging), netns (compute utilization "
            "behind a 100 Mbit/s link), overlap (tokens/s of 2 peers behind 20 Mbit/s links: overlapped vs blocking "
            "rounds vs alone), speeds (3 peers, one 3x slower: inner steps per round, rounds joined, goodput), "
            "scale (8 peers, whole-swarm rounds vs --target-group-size 4 and 2: rounds, θ_global lineages per outer "
            "step, state-sync vs averaging bytes, held-out loss spread). "
            "'report' only regenerates the markdown from bench/out/."
        ),
    )
    p.add_argument("name", choices=("all", *NAMES, "report"), help="benchmark to run, 'all', or 'report'")
    p.add_argument("--quick", action="store_true", help="toy sizes (a few minutes for 'all')")
    p.add_argument("--size", choices=("smoke", "quick", "full"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="raw JSON results (default: bench/out)")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC,
                   help="markdown to regenerate; PNGs go next to it (default: docs/benchmarks.md)")
    p.add_argument("--no-doc", action="store_true", help="only write the JSON")
    return p


def run_one(name: str, size: str, out_dir: Path, command: str) -> Path:
    module = importlib.import_module(f"bench.{'rounds' if name == 'round' else name}")
    prov = provenance(command)
    t0 = time.perf_counter()
    result = module.run(size)
    elapsed = time.perf_counter() - t0
    result = {"name": name, "size": size, "elapsed_s": round(elapsed, 1), "loadavg_end": loadavg(),
              "provenance": prov, **result}
    return save_result(out_dir, name, size, result)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    command = command_line(argv)
    names = [] if args.name == "report" else list(RUN_ORDER) if args.name == "all" else [args.name]
    failed = []
    for name in names:
        print(f"[bench] {name} ({size}) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            path = run_one(name, size, args.out_dir, command)
            print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s → {path}", file=sys.stderr, flush=True)
        except Exception:
            failed.append(name)
            print(f"[bench] {name} FAILED after {time.perf_counter() - t0:.0f} s:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
    if not args.no_doc:
        from bench.report import update_doc

        only = None if args.name in ("all", "report") else names
        messages, errors = update_doc(args.doc, args.out_dir, only=only)
        for msg in messages:
            print(f"[bench] {msg}", file=sys.stderr)
        failed += [f"{name} (report)" for name in errors]
        print(f"[bench] wrote {args.doc}", file=sys.stderr)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
