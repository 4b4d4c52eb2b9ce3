"""MetricsWriter: every line of the metrics file is valid JSON, whatever the numbers. StatusLine: what
the status line says about the phase."""

import json
import math

from diloco_swarm.node.report import MetricsWriter, StatusLine


def refuse(constant):
    raise ValueError(f"{constant} is not JSON")


def test_non_finite_floats_are_written_as_null_at_any_depth(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"event": "outer_step", "loss": math.nan, "eval_loss": math.inf, "tokens": 7, "ok": True,
                  "rejected_peers": {"QmPeer": {"norm": -math.inf, "why": "nan"}}, "group": [1.5, math.nan, None],
                  "pair": (math.inf, 2.0)})
    writer.write({"event": "eval", "eval_loss": 3.25})
    writer.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    # strict parsing: Python's json would otherwise accept the non-standard NaN / Infinity tokens
    first, second = (json.loads(line, parse_constant=refuse) for line in lines)
    assert first["loss"] is None and first["eval_loss"] is None
    assert first["rejected_peers"] == {"QmPeer": {"norm": None, "why": "nan"}}
    assert first["group"] == [1.5, None, None]
    assert first["pair"] == [None, 2.0]
    assert first["tokens"] == 7 and first["ok"] is True and isinstance(first["time"], float)
    assert second["eval_loss"] == 3.25


def test_no_file_means_no_output(tmp_path):
    writer = MetricsWriter(None)
    writer.write({"event": "eval", "eval_loss": math.nan})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_the_status_line_shows_the_phase_target_and_an_extended_phase():
    line = StatusLine.render({"outer_step": 3, "inner_step": 12, "phase_steps": 40, "inner_steps": 50, "loss": 2.5})
    assert line.startswith("outer 3 | inner 12/40 | loss 2.500")  # the phase's own (DyLU) target, not H
    extended = StatusLine.render({"outer_step": 3, "inner_step": 131, "phase_steps": 50, "inner_steps": 50})
    assert "inner 131/50, extended while the round runs" in extended
    waiting = StatusLine.render({"outer_step": 3, "inner_step": 100, "phase_steps": 50, "inner_steps": 50, "waiting": True})
    assert "inner 100/50, waiting for the round" in waiting
    assert "inner 0/50 |" in StatusLine.render({"inner_steps": 50})  # before the first phase
