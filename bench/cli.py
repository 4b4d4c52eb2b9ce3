"""``python -m bench [all|NAME|report]`` and ``python -m bench.NAME``: run, save the raw JSON, print the figures,
regenerate the benchmark's section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # before anything imports hivemind

from bench import NAMES, STANDALONE  # noqa: E402
from bench.common import DEFAULT_DOC, DEFAULT_OUT, SIZES, loadavg, provenance, save_result  # noqa: E402

# forking benchmarks first: their peers are forked from this process before any torch thread pool exists
RUN_ORDER = ("wire", "round", "netns", "overlap", "speeds", "scale", "codec", "quality")


def module(name: str):
    return importlib.import_module(f"bench.{'rounds' if name == 'round' else name}")


def _interrupt(signum, frame):  # SIGTERM: clean up the nodes in `finally`, as for Ctrl+C
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None, name: str | None = None) -> int:
    """``python -m bench`` or, with ``name``, ``python -m bench.NAME`` (plus that module's ``OPTIONS``)."""
    p = argparse.ArgumentParser(prog="python -m bench" + (f".{name}" if name else ""),
                                description=(module(name).__doc__ or "").split("\n\n")[0] if name else __doc__)
    if name is None:
        p.add_argument("name", choices=("all", *NAMES, *STANDALONE, "report"),
                       help="a benchmark, 'all' (the first %d) or 'report' (only regenerate the doc)" % len(NAMES))
    p.add_argument("--quick", action="store_true", help="toy sizes (a few minutes for 'all')")
    p.add_argument("--size", choices=SIZES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="raw JSON results (default: bench/out)")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="markdown to regenerate; plots go next to it")
    p.add_argument("--no-doc", action="store_true", help="only write the JSON")
    options = getattr(module(name), "OPTIONS", {}) if name else {}
    for flag, kw in options.items():
        p.add_argument(flag, **kw)
    args = p.parse_args(argv)
    opts = {k: getattr(args, k) for k in (flag.lstrip("-").replace("-", "_") for flag in options)}
    size = args.size or ("quick" if args.quick else "full")
    command = f"{p.prog} {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()
    target = name or args.name
    names = [] if target == "report" else list(RUN_ORDER) if target == "all" else [target]
    signal.signal(signal.SIGTERM, _interrupt)
    failed, ran = [], []
    for n in names:
        print(f"[bench] {n} ({size}) ...", file=sys.stderr, flush=True)
        t0, prov = time.perf_counter(), provenance(command)
        try:
            result = {"name": n, "size": size, **module(n).run(size, **opts)}
            result.update(elapsed_s=round(time.perf_counter() - t0, 1), loadavg_end=loadavg(), provenance=prov)
            path = save_result(args.out_dir, result["name"], size, result)
            print(module(n).render(result, args.out_dir), flush=True)
            print(f"[bench] {n}: {result['elapsed_s']:.0f} s → {path}", file=sys.stderr, flush=True)
            ran += [n] if result["name"] == n else []  # a result of another name (memory --soak) has no section
        except Exception:
            failed.append(n)
            print(f"[bench] {n} FAILED after {time.perf_counter() - t0:.0f} s:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
    if not args.no_doc:
        from bench.report import update_doc

        messages, errors = update_doc(args.doc, args.out_dir, only=None if target in ("all", "report") else ran)
        print("\n".join(f"[bench] {msg}" for msg in messages + [f"wrote {args.doc}"]), file=sys.stderr)
        failed += [f"{n} (report)" for n in errors]
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
