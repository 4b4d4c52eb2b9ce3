"""Shared helpers: provenance of a result, JSON files, figures and their formatting, markdown tables, plots."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "out"
DEFAULT_DOC = REPO / "docs" / "benchmarks.md"

# size levels, smallest first; a result of a lower level never replaces a doc section of a higher one
SIZES = ("smoke", "quick", "full")


def _proc_line(path: str, key: str) -> str | None:
    try:
        return next((line.split(":", 1)[1].strip() for line in Path(path).read_text().splitlines()
                     if line.startswith(key)), None)
    except OSError:
        return None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def provenance(command: str) -> dict[str, Any]:
    """Where a figure came from: command, date, hardware, software versions, machine load."""
    versions = {"python": platform.python_version()}
    for mod in ("torch", "hivemind", "bitsandbytes", "numpy"):
        with contextlib.suppress(PackageNotFoundError):
            versions[mod] = version(mod)
    mem = _proc_line("/proc/meminfo", "MemTotal:")
    return {
        "command": command,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "platform": platform.platform(),
        "cpu_model": _proc_line("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "versions": versions,
        "git": {"commit": _git("rev-parse", "--short", "HEAD") or "?",
                "diloco_swarm_dirty": bool(_git("status", "--porcelain", "--", "diloco_swarm"))},
        "loadavg_start": loadavg(),
    }


def provenance_md(result: dict[str, Any], source: Path | str) -> str:
    """A few lines saying where a section's figures came from."""
    p, size, elapsed = result["provenance"], result.get("size", "?"), result.get("elapsed_s")
    v, git = p["versions"], p.get("git", {})
    dirty = " (diloco_swarm/ had uncommitted edits)" if git.get("diloco_swarm_dirty") else ""
    try:
        source = Path(source).resolve().relative_to(REPO)
    except ValueError:
        pass
    took = f", took {elapsed:.0f} s" if elapsed is not None else ""
    return (f"*Source:* `{p['command']}` → `{source}` (size: **{size}**), {p['date_utc']}{took}.\n"
            f"*Machine:* {p['cpu_model']}, {p['cpus_usable']} usable CPU(s) of {p['cpu_count']}, "
            f"{p['mem_total_gib']} GiB RAM, {p['platform']}; load average at start {p.get('loadavg_start')}, "
            f"at end {result.get('loadavg_end')} (a shared machine: compare figures within one table, not across "
            f"runs).\n*Software:* Python {v['python']}, "
            + ", ".join(f"{k} {v.get(k, '?')}" for k in ("torch", "hivemind", "bitsandbytes", "numpy"))
            + f"; repo commit {git.get('commit', '?')}{dirty}.\n")


def result_path(out_dir: Path, name: str, size: str) -> Path:
    return out_dir / (f"{name}.json" if size == "full" else f"{name}.{size}.json")


def save_result(out_dir: Path, name: str, size: str, result: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(out_dir, name, size)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def load_best_result(out_dir: Path, name: str) -> tuple[dict[str, Any], Path] | None:
    """The result of the largest size present for ``name`` (full > quick > smoke)."""
    for size in reversed(SIZES):
        path = result_path(out_dir, name, size)
        with contextlib.suppress(OSError, json.JSONDecodeError):
            return json.loads(path.read_text()), path
    return None


def median(xs: Iterable) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def mean(xs: Iterable) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def f(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted, or – when it was not measured."""
    return "–" if x is None or x != x else f"{x:{spec}}{suffix}"


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[float], Any]:
    """Run ``fn`` ``repeats`` times: wall seconds, CPU seconds of this process (all its threads: far steadier
    than the wall seconds on a shared machine), and the last return value."""
    walls, cpus, value = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        value = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus, value


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_count(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else f"{n:g}"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def exits_md(peers: Iterable[tuple[str, dict[str, Any]]]) -> str:
    """'What went wrong': each (label, node figures) whose ``exit_code`` is not 0, with its log's last line."""
    lines = [f"- {label} exited {p['exit_code']}: "
             f"`{((p.get('log_tail') or '').strip().splitlines() or ['(no output)'])[-1][:160]}`"
             for label, p in peers if p.get("exit_code") != 0]
    return "\nWhat went wrong in this run:\n\n" + "\n".join(lines) + "\n" if lines else ""


def notes_md(result: dict[str, Any]) -> str:
    """The readings added to a result's JSON after the run (``notes``)."""
    return "".join(f"\n*Note:* {note}\n" for note in result.get("notes", []))


@contextlib.contextmanager
def figure(path: Path, size: tuple[float, float] = (6.4, 4.0), ncols: int = 1, **kw):
    """matplotlib axes (``ncols`` of them) saved to ``path`` on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, **kw)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)
