"""Metrics (JSON Lines) and the live status line of a node."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN/inf float (in dicts, lists and tuples, at any depth) replaced by ``None``,
    so that it is valid JSON (which has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a metrics file written by :class:`MetricsWriter`, oldest first; only those
    whose ``event`` is ``kind`` if given. A missing file gives ``[]``; a torn or foreign line (a node
    killed mid-write) is skipped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and (kind is None or event.get("event") == kind):
            events.append(event)
    return events


def round_fields(handoff: Any, outcome: Any, preview: Any) -> dict[str, Any]:
    """What one round did, for its ``outer_step`` metrics record (docs/metrics.md): node/outer_sync.py's
    ``Handoff``, ``RoundOutcome`` and ``Preview``; bytes and seconds include the θ-mixing round's."""
    result, mixing = outcome.result, outcome.mixing
    lead = preview.lead_s()
    return {
        "group_size": result.group_size,
        "group": result.group_peer_ids,
        "group_id": result.group_id,
        "loss": handoff.loss,
        "tokens": handoff.tokens,
        "inner_steps": handoff.inner_steps,
        "bytes_sent": result.bytes_sent + (mixing.bytes_sent if mixing else 0),
        "bytes_received": result.bytes_received + (mixing.bytes_received if mixing else 0),
        "averaging_s": round(result.seconds + (mixing.seconds if mixing else 0.0), 4),
        "allreduce_s": round(result.allreduce_s, 4),
        "round_wall_s": round(time.monotonic() - handoff.started, 4),
        "previewed_tensors": preview.moved,
        "preview_lead_s": None if lead is None else round(lead, 3),
        "round_ok": result.ok,
        "reason": result.reason,
        "rejected_peers": result.rejected_peers,
        "digest_confirmed_by": result.agreed_peers,
        "gone_peers": result.gone_peers + (mixing.gone_peers if mixing else []),
        "group_key": outcome.group_key or None,
        "mixed": outcome.mixed is not None,
        "mix_reference_step": outcome.mixed.reference_step if outcome.mixed else None,
        "mix_reason": mixing.reason if mixing and not mixing.ok else None,
    }


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (flushed per line; fields in docs/metrics.md)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file = None
        self._lock = threading.Lock()  # the training thread and the housekeeping thread both write
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            line = json.dumps(finite_or_null({"time": round(time.time(), 3), **record}), allow_nan=False, default=str)
            with self._lock:
                if self._file is not None:
                    self._file.write(line + "\n")
                    self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _inner_progress(step: int, target: int | None, waiting: bool = False) -> str:
    """``inner 12/50``; past the target the phase runs on while the round is in flight (overlap), up
    to DyLU's bound, where training waits for the round."""
    if target is None:
        return f"inner {step}/?"
    if waiting:
        return f"inner {step}/{target}, waiting for the round (the phase is at its longest)"
    return f"inner {step}/{target}" + (", extended while the round runs" if step > target else "")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class StatusLine:
    """One informative line: on a terminal it updates in place (rich ``Live``), else it is printed
    at most every ``every_s`` seconds and at each outer step, so logs stay readable."""

    def __init__(self, console: Console | None = None, every_s: float = 15.0):
        self.console = console or Console(stderr=True, highlight=False)
        self.every_s = every_s
        self._last_print = 0.0
        self._live: Live | None = None
        if self.console.is_terminal:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def log(self, message: str) -> None:
        self.console.print(message, soft_wrap=True, markup=False)

    def update(self, fields: dict[str, Any], force: bool = False) -> None:
        text = self.render(fields)
        if self._live is not None:
            self._live.update(Text(text))
        elif force or time.monotonic() - self._last_print >= self.every_s:
            self._last_print = time.monotonic()
            print(text, file=sys.stderr, flush=True)

    @staticmethod
    def render(f: dict[str, Any]) -> str:
        """One status line from :meth:`NodeStats.status` fields; ``phase_steps`` is this phase's own
        target (DyLU), ``inner_steps`` the run's nominal H; ``paused``: why the node trains no more for now."""
        if f.get("paused"):  # no phase runs: say so, and why, instead of a stale inner step
            return " | ".join([f"outer {f.get('outer_step', 0)}", f["paused"], f"peers {f.get('peers_seen', 1)}"])
        parts = [
            f"outer {f.get('outer_step', 0)}",
            _inner_progress(f.get("inner_step", 0), f.get("phase_steps") or f.get("inner_steps"), bool(f.get("waiting"))),
            f"loss {f['loss']:.3f}" if f.get("loss") is not None else "loss -",
            f"{f.get('tokens_per_s', 0):,.0f} tok/s",
            f"peers {f.get('peers_seen', 1)}" + (" (we are a client)" if f.get("reachability") == "client" else ""),
        ]
        if f.get("last_round"):
            r = f["last_round"]
            if r["round_ok"]:
                state = "ok"
            else:
                state = f"{'failed' if r['group_size'] >= 2 else 'solo'} ({r.get('reason') or 'no group'})"
            parts.append(
                f"last round: group {r['group_size']}, {_fmt_bytes(r['bytes_sent'])} sent, {r['averaging_s']:.1f}s, {state}"
            )
        if f.get("failed_rounds"):
            parts.append(f"failed rounds {f['failed_rounds']}")
        if f.get("goodput") is not None:
            parts.append(f"goodput {100 * f['goodput']:.0f}%")
        return " | ".join(parts)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
