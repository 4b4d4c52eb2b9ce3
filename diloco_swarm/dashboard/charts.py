"""Text and SVG charts for the dashboard page (:mod:`.render`) and ``status``: formatting of numbers and
durations, the one escape every peer-supplied string goes through (:func:`text`), and line charts over time.
"""

from __future__ import annotations

import html
import math
import re
import time
from typing import Any, Iterable, Sequence

PALETTE_SIZE = 10
_UNSAFE_CHARS = re.compile("[\u0000-\u001f\u007f-\u009f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def text(value: Any, limit: int = 200) -> str:
    """A peer-supplied value, safe to put in HTML text or a quoted attribute."""
    s = _UNSAFE_CHARS.sub("", "" if value is None else str(value))
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return html.escape(s, quote=True)


# ------------------------------------------------------------------------------------------ numbers
def fmt_si(value: Any, digits: int = 3) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "–"
    v = float(value)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.{digits}g}{unit}"
    return f"{v:.{digits}g}" if v != int(v) else f"{int(v)}"


def fmt_float(value: Any, digits: int = 3) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}"


def fmt_held_out(loss: Any, steps: Any) -> str:
    """``held-out 6.194 at outer step 0`` (``steps``: an outer step, or ``[lowest, highest]`` of several
    peers': ``at outer steps 0–2``). The step says which θ_global was measured: early in a run it is
    behind the θ_local of the training loss beside it. Without a step (a record of an older version) the
    loss alone; ``held-out –`` without a loss."""
    if fmt_float(loss) == "–":
        return "held-out –"
    lo, hi = steps if isinstance(steps, (list, tuple)) and len(steps) == 2 else (steps, steps)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in (lo, hi)):
        return f"held-out {fmt_float(loss)}"
    return f"held-out {fmt_float(loss)} at outer step {lo}" if lo == hi else \
        f"held-out {fmt_float(loss)} at outer steps {lo}–{hi}"


def fmt_bytes(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "–"
    v = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(v) < 1024 or unit == "TB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "–"


def fmt_duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "–"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def short_id(peer_id: Any) -> str:
    s = str(peer_id or "")
    return s if len(s) <= 14 else f"{s[:6]}…{s[-6:]}"


# ------------------------------------------------------------------------------------------ charts
def _nice_step(span: float, target: int = 4) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


_TIME_STEPS = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)


def _rel_time(seconds: float) -> str:
    s = int(round(seconds))
    if s == 0:
        return "now"
    if s < 60:
        return f"−{s}s"
    if s < 3600:
        return f"−{s // 60}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"−{h}h" if m == 0 else f"−{h}h{m:02d}"
    return f"−{s // 86400}d"


def tick_labels(values: Sequence[float], unit_fmt=fmt_si) -> list[str]:
    """Labels for axis ticks: ``unit_fmt`` of each, unless two would read the same (a narrow
    range such as 5.275…5.285 formatted with 3 significant digits gives "5.28" five times); then
    fixed-point with the fewest decimals that tell every tick apart."""
    labels = [str(unit_fmt(v)) for v in values]
    if len(set(labels)) == len(labels):
        return labels
    for decimals in range(0, 10):
        fixed = [f"{v:.{decimals}f}" for v in values]
        if len(set(fixed)) == len(fixed):
            return fixed
    return [f"{v:.6g}" for v in values]


GAP_MIN_S = 120.0  # a pause this long (or 5 sampling intervals, if longer) breaks a line


def gap_threshold(times: Sequence[float]) -> float:
    """Seconds between two points of a series above which they are not joined by a line: 5x the
    median sampling interval, at least :data:`GAP_MIN_S`."""
    deltas = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    median = deltas[len(deltas) // 2] if deltas else 0.0
    return max(GAP_MIN_S, 5 * median)


def line_chart(
    series: Sequence[dict[str, Any]],
    *,
    title: str,
    now: float,
    unit_fmt=fmt_si,
    zero_based: bool = False,
    width: int = 480,
    height: int = 230,
) -> str:
    """An SVG line chart over time. ``series``: dicts with ``label``, ``color`` (a palette index or
    ``"total"``), ``points`` ([(t, value or None)]) and optional ``main`` (drawn thicker)."""
    left, right, top, bottom = 48, 12, 10, 24
    pw, ph = width - left - right, height - top - bottom
    pts = [(t, v) for s in series for t, v in s["points"] if v is not None]
    label = text(title)
    head = (f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{label}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{label}</title>')
    if not pts:
        return (head + f'<rect class="plot" x="{left}" y="{top}" width="{pw}" height="{ph}"/>'
                f'<text class="empty" x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle">'
                "waiting for data…</text></svg>")
    t1 = max(now, max(t for t, _ in pts))
    t0 = min(t for t, _ in pts)
    if t1 - t0 < 60:
        t0 = t1 - 60
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    if zero_based:
        lo = min(0.0, lo)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = (lo - pad if not (zero_based and lo == 0) else lo), hi + pad
    step = _nice_step(hi - lo)
    lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step

    def x(t: float) -> float:
        return round(left + (t - t0) / (t1 - t0) * pw, 1)

    def y(v: float) -> float:
        return round(top + ph - (v - lo) / (hi - lo) * ph, 1)

    out = [head, f'<rect class="plot" x="{left}" y="{top}" width="{pw}" height="{ph}"/>']
    ticks = []
    v = lo
    while v <= hi + step / 2:
        ticks.append(v)
        v += step
    for v, tick in zip(ticks, tick_labels(ticks, unit_fmt)):
        yy = y(v)
        out.append(f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{yy}" y2="{yy}"/>'
                   f'<text class="tick" x="{left - 6}" y="{yy + 4}" text-anchor="end">{text(tick)}</text>')
    tstep = next((s for s in _TIME_STEPS if (t1 - t0) / s <= 4), _TIME_STEPS[-1])
    k = 0
    while t1 - k * tstep >= t0 - 1e-6:
        xx = x(t1 - k * tstep)
        anchor = "end" if k == 0 else "middle"
        out.append(f'<line class="grid" x1="{xx}" x2="{xx}" y1="{top}" y2="{top + ph}"/>'
                   f'<text class="tick" x="{xx}" y="{height - 6}" text-anchor="{anchor}">{_rel_time(k * tstep)}</text>')
        k += 1
    for s in series:
        cls = "series total" if s["color"] == "total" else f"series c{int(s['color']) % PALETTE_SIZE}"
        if s.get("main"):
            cls += " main"
        path, pen_down, last = [], False, None
        gap = gap_threshold([t for t, v in s["points"] if v is not None])
        for t, v in s["points"]:
            if v is None or t < t0:
                pen_down = False
                continue
            if last is not None and t - last[0] > gap:
                pen_down = False  # no data in between (the swarm was down): no line across the gap
            path.append(f"{'L' if pen_down else 'M'}{x(t)} {y(v)}")
            pen_down, last = True, (t, v)
        if not path:
            continue
        name = text(s["label"])
        out.append(f'<g class="{cls}"><title>{name}</title><path d="{" ".join(path)}"/>')
        if last is not None:
            out.append(f'<circle cx="{x(last[0])}" cy="{y(last[1])}" r="3"/>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def legend(series: Iterable[dict[str, Any]]) -> str:
    items = []
    for s in series:
        cls = "total" if s["color"] == "total" else f"c{int(s['color']) % PALETTE_SIZE}"
        items.append(f'<li><span class="swatch {cls}"></span>{text(s["label"], 40)}</li>')
    return f'<ul class="legend">{"".join(items)}</ul>' if items else ""
