"""The model card (``README.md``) of an exported model folder: Hugging Face's convention, YAML front
matter and markdown, written as plain text (``huggingface_hub.ModelCard.load`` reads it).

What it says comes from the node's own files, so ``export`` needs no swarm: the run spec and the
counters of the checkpoint, the held-out loss curve of the node's metrics file (docs/metrics.md:
``eval`` and ``outer_step`` records), and the contributors from the node's last view of the
contribution ledger (dht/ledger.py), kept in its checkpoint (``ledger.leaderboard``).

    text = model_card(spec, ckpt, info, curve=loss_curve(metrics_path, peer_id))
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

CARD_NAME = "README.md"
MAX_CURVE_ROWS = 24  # rows of the loss table: the first and the last outer step always among them
MAX_CONTRIBUTORS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_MARKDOWN = re.compile(r"([\\`*_\[\]|#!~])")  # escaped: a peer-chosen name must not break the table or link away


def loss_curve(path: Path | None, peer_id: str | None) -> list[tuple[int, float]]:
    """(outer step, held-out loss) pairs of a metrics file, by outer step (the last value of a step wins).

    Reads the ``eval`` records (``outer_step``, ``eval_loss``) and the ``outer_step`` records
    (``eval_outer_step``, ``eval_loss``) of ``peer_id`` (every record when None); lines that are not
    JSON, and losses that are not finite numbers, are skipped. A missing or unreadable file gives [].
    """
    curve: dict[int, float] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path is not None else []
    except OSError:
        return []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or (peer_id is not None and doc.get("peer_id") != peer_id):
            continue
        step = doc.get("outer_step") if doc.get("event") == "eval" else (
            doc.get("eval_outer_step") if doc.get("event") == "outer_step" else None)
        loss = doc.get("eval_loss")
        if (isinstance(step, int) and not isinstance(step, bool) and step >= 0 and isinstance(loss, (int, float))
                and not isinstance(loss, bool) and math.isfinite(loss)):
            curve[step] = float(loss)
    return sorted(curve.items())


def merged_curve(kept: Any, read: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The checkpoint's ``eval_curve`` (``[[step, loss], ...]``, NodeStats) and a metrics file's
    :func:`loss_curve`, by outer step (the file's value of a step wins: it holds every measurement)."""
    curve: dict[int, float] = {}
    for point in kept if isinstance(kept, list) else []:
        if (isinstance(point, (list, tuple)) and len(point) == 2 and isinstance(point[0], int) and not isinstance(point[0], bool)
                and isinstance(point[1], float) and math.isfinite(point[1])):
            curve[point[0]] = point[1]
    curve.update(dict(read))
    return sorted(curve.items())


def _thin(curve: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    """At most ``n`` points of ``curve``, evenly spread, its first and last kept."""
    if len(curve) <= n:
        return curve
    picks = sorted({round(i * (len(curve) - 1) / (n - 1)) for i in range(n)})
    return [curve[i] for i in picks]


def _text(value: Any, limit: int = 64) -> str:
    """A string from a peer or the spec, safe in a markdown table cell (and on one line)."""
    text = _CONTROL.sub(" ", str(value))[:limit].strip()
    text = _MARKDOWN.sub(r"\\\1", text.replace("&", "&amp;")).replace("<", "&lt;").replace(">", "&gt;")
    return text or "–"


def _yaml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON scalar is a YAML scalar


def _duration(seconds: Any) -> str:
    s = float(seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) else 0.0
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def contributors(ckpt: dict[str, Any], peer_id: str) -> list[dict[str, Any]]:
    """The leaderboard rows kept in the checkpoint (dht/ledger.py), or, where it holds none (an older
    checkpoint, a node that never read the swarm), this node's own row from its counters."""
    ledger = ckpt.get("ledger") if isinstance(ckpt.get("ledger"), dict) else {}
    rows = [r for r in ledger.get("leaderboard") or [] if isinstance(r, dict)][:MAX_CONTRIBUTORS]
    if rows:
        return rows
    rounds = int(ledger.get("verified_rounds", 0) or 0)
    return [{"name": peer_id[:8], "peer_id": peer_id, "tokens": int(ckpt.get("tokens_total", 0) or 0),
             "verified_rounds": rounds, "confirmed_rounds": 0, "witnesses": 0, "uptime_s": None, "share": 1.0,
             "first_hand": True, "self_reported": False}]


def _rounds_with_us(ckpt: dict[str, Any]) -> dict[str, int]:
    """peer id -> the verified rounds this node shared with it (the checkpoint's ``ledger.rounds_with``)."""
    ledger = ckpt.get("ledger") if isinstance(ckpt.get("ledger"), dict) else {}
    out = {}
    for item in ledger.get("rounds_with") or []:
        if isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], int):
            out[item[0]] = item[1]
    return out


def model_card(spec: Any, ckpt: dict[str, Any], info: dict[str, Any], curve: list[tuple[int, float]]) -> str:
    """The card's text. ``spec``: the run's RunSpec; ``ckpt``: the node's checkpoint; ``info``: what export
    wrote (architecture, outer step, tokens); ``curve``: :func:`loss_curve`."""
    peer_id = str(ckpt.get("peer_id") or "")
    rows = contributors(ckpt, peer_id)
    front = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- diloco",
        "- diloco-swarm",
        "- decentralized-training",
        "diloco_swarm:",
        *(f"  {k}: {_yaml(v)}" for k, v in (
            ("run_id", spec.run_id), ("model", spec.model), ("tokenizer", spec.tokenizer), ("dataset", spec.dataset),
            ("inner_steps", spec.inner_steps), ("inner_lr", spec.inner_lr), ("outer_lr", spec.outer_lr),
            ("outer_momentum", spec.outer_momentum), ("compression", spec.compression), ("seed", spec.seed),
            ("seq_len", spec.seq_len), ("sync_mode", spec.sync_mode), ("spec_hash", spec.spec_hash()),
            ("outer_steps", info["outer_step"]), ("tokens_trained", info["tokens_total"]),
            ("exported_from_peer", peer_id))),
        "---",
    ]
    body = [
        f"# {_text(spec.model)} · run {_text(spec.run_id)}",
        "",
        f"A {info['architecture']} trained with DiLoCo by a volunteer swarm (diloco-swarm): each peer runs H inner AdamW steps on its own data, the "
        "peers average their pseudo-gradients in verified rounds, and an outer Nesterov step moves the shared "
        f"weights. This folder holds θ_global of peer `{_text(peer_id)}` at outer step {info['outer_step']}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(\"PATH_TO_THIS_FOLDER\")",
        "```",
        *(["", f"Tokenizer: {info['note']}."] if info.get("note") else []),
        "",
        "## Run",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {k} | {_text(v, 200)} |" for k, v in (
            ("run id", spec.run_id), ("model", spec.model), ("tokenizer", spec.tokenizer), ("dataset", spec.dataset),
            ("H (inner steps per outer step)", spec.inner_steps), ("inner lr (AdamW)", spec.inner_lr),
            ("outer lr (Nesterov SGD)", spec.outer_lr), ("outer momentum", spec.outer_momentum),
            ("compression", spec.compression), ("seed", spec.seed), ("sequence length", spec.seq_len),
            ("spec hash", spec.spec_hash()))),
        "",
        f"θ_global is at outer step {info['outer_step']}; this peer trained {info['tokens_total']:,} tokens of it, and "
        f"the contributors below (every peer this peer saw in the run) report {sum(int(r.get('tokens') or 0) for r in rows):,} in all.",
        "",
        "## Held-out loss",
        "",
    ]
    if curve:
        body += ["Mean cross-entropy (nats per token; a token is a byte in a byte-level run) of θ_global on the run's held-out split, as this peer measured it.",
                 "", "| outer step | held-out loss |", "|---:|---:|",
                 *(f"| {step} | {loss:.4f} |" for step, loss in _thin(curve, MAX_CURVE_ROWS))]
    else:
        body += ["No held-out loss was measured yet."]
    body += [
        "",
        "## Contributors",
        "",
        "From this peer's last view of the run's contribution ledger. Tokens, rounds and uptime are each "
        "peer's own report; *confirmed* are the rounds other peers' records back (a lower bound: groups "
        "smaller than the swarm under-confirm). **first-hand**: the rounds this peer itself shared with "
        "that peer. **self-reported** marks claims that others' records do not back.",
        "",
        "| contributor | peer id | tokens | share of confirmed tokens | verified rounds (confirmed) | uptime | source |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    ours = _rounds_with_us(ckpt)
    for r in rows:
        share = r.get("confirmed_share") if "confirmed_share" in r else r.get("share")
        peer = r.get("peer_id")
        if peer == peer_id:
            source = "this peer"
        elif peer in ours:  # its figures are its own report; the rounds we shared with it we counted
            source = f"first-hand: {ours[peer]} verified rounds with this peer"
        else:
            source = ("self-reported" if r.get("self_reported")
                      else f"reported, backed by {int(r.get('witnesses') or 0)} peers' records")
        if (peer == peer_id or peer in ours) and r.get("self_reported"):
            source += "; self-reported beyond the rounds others back"
        body.append(f"| {_text(r.get('name'))} | `{_text(r.get('peer_id'), 12)}` | {int(r.get('tokens') or 0):,} | "
                    f"{'–' if share is None else f'{100 * share:.1f}%'} | {int(r.get('verified_rounds') or 0)} "
                    f"({int(r.get('confirmed_rounds') or 0)}) | "
                    f"{'–' if r.get('uptime_s') is None else _duration(r.get('uptime_s'))} | {source} |")
    return "\n".join(front + body) + "\n"
