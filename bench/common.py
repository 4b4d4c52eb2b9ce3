"""Shared helpers: provenance of a result, JSON files, medians, formatting."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "out"
DEFAULT_DOC = REPO / "docs" / "benchmarks.md"

# size levels, smallest first; a result of a lower level never replaces a doc section of a higher one
SIZES = ("smoke", "quick", "full")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("torch", "hivemind", "bitsandbytes", "numpy"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:
            out[mod] = "?"
    return out


def _git() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "diloco_swarm"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": commit or "?", "diloco_swarm_dirty": bool(dirty)}
    except Exception:
        return {"commit": "?", "diloco_swarm_dirty": None}


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def provenance(command: str) -> dict[str, Any]:
    """Where a figure came from: command, date, hardware, software versions, machine load."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "command": command,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "mem_total_gib": _mem_total_gib(),
        "versions": _versions(),
        "git": _git(),
        "loadavg_start": loadavg(),
    }


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "python -m bench " + " ".join(shlex.quote(a) for a in argv)


def result_path(out_dir: Path, name: str, size: str) -> Path:
    return out_dir / (f"{name}.json" if size == "full" else f"{name}.{size}.json")


def save_result(out_dir: Path, name: str, size: str, result: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(out_dir, name, size)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
    return path


def load_best_result(out_dir: Path, name: str) -> tuple[dict[str, Any], Path] | None:
    """The result of the largest size present for ``name`` (full > quick > smoke)."""
    for size in reversed(SIZES):
        path = result_path(out_dir, name, size)
        if path.exists():
            try:
                return json.loads(path.read_text()), path
            except json.JSONDecodeError:
                continue
    return None


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[float], Any]:
    """Run ``fn`` ``repeats`` times: wall seconds (perf_counter), CPU seconds of this process
    (process_time: all its threads), and the last return value. On a shared machine the CPU
    seconds of single-process work are far steadier than the wall seconds."""
    walls, cpus, value = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        value = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus, value


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.3g}M"
    if n >= 1e3:
        return f"{n / 1e3:.3g}k"
    return f"{n:g}"


def provenance_md(result: dict[str, Any], source: Path | str) -> str:
    """A few lines saying where a section's figures came from."""
    p = result["provenance"]
    v = p["versions"]
    size = result.get("size", "?")
    git = p.get("git", {})
    dirty = " (diloco_swarm/ had uncommitted edits)" if git.get("diloco_swarm_dirty") else ""
    elapsed = result.get("elapsed_s")
    lines = [
        f"*Source:* `{p['command']}` → `{_rel(source)}` (size: **{size}**), {p['date_utc']}, "
        f"took {elapsed:.0f} s." if elapsed is not None else f"*Source:* `{p['command']}` → `{_rel(source)}`",
        f"*Machine:* {p['cpu_model']}, {p['cpus_usable']} usable CPU(s) of {p['cpu_count']}, "
        f"{p['mem_total_gib']} GiB RAM, {p['platform']}; load average at start {p.get('loadavg_start')}, "
        f"at end {result.get('loadavg_end')} (a shared machine: compare figures within one table, not across runs).",
        f"*Software:* Python {v['python']}, torch {v['torch']}, hivemind {v['hivemind']}, "
        f"bitsandbytes {v['bitsandbytes']}, numpy {v['numpy']}; repo commit {git.get('commit', '?')}{dirty}.",
    ]
    return "\n".join(lines) + "\n"


def _rel(path: Path | str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out) + "\n"


def upsert_section(doc: Path, name: str, size: str, section: str) -> None:
    """Put ``section`` (``<!-- bench:NAME size=SIZE -->`` … ``<!-- /bench:NAME -->``) into ``doc`` in
    place of NAME's section, or at its end; a full-size section is never replaced by a smaller run."""
    text = doc.read_text() if doc.exists() else ""
    m = re.search(rf"<!-- bench:{name} size=(\w+) -->\n.*?<!-- /bench:{name} -->\n", text, re.S)
    if m and m[1] == "full" and size != "full":
        print(f"kept the full-size {name} section of {doc}", file=sys.stderr)
        return
    doc.write_text(text[:m.start()] + section + text[m.end():] if m else text.rstrip("\n") + "\n\n" + section)


def standalone_main(name: str, doc: str, run: Callable[[str], dict[str, Any]],
                    section: Callable[[dict[str, Any], Path], str], summary: Callable[[dict[str, Any]], str],
                    quick_help: str, argv: list[str] | None = None) -> int:
    """``python -m bench.NAME [--quick] [--no-doc] [--out-dir DIR]``, for the benchmarks run outside
    ``python -m bench``: ``run(size)``, its JSON with provenance in ``DIR/NAME[.quick].json``, one
    line of ``summary(result)``, and its section of docs/benchmarks.md (:func:`upsert_section`).

    :param doc: the module's docstring; its first line is the ``--help`` description.
    """
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--no-doc", action="store_true", help="only write the JSON")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="raw JSON results (default: bench/out)")
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    prov = provenance(f"python -m bench.{name}" + (" --quick" if args.quick else ""))
    t0 = time.perf_counter()
    result = {"name": name, "size": size, **run(size)}
    result.update(elapsed_s=round(time.perf_counter() - t0, 1), loadavg_end=loadavg(), provenance=prov)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(args.out_dir, name, size)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{summary(result)} → {path}")
    if not args.no_doc:
        upsert_section(DEFAULT_DOC, name, size, section(result, path))
    return 0
