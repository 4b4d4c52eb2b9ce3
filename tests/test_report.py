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


def test_the_status_lines_peer_count_is_the_live_count_of_the_start_barrier_from_its_first_line(monkeypatch):
    """Issue 39: after ``--wait-for-peers 3`` said 3 live peers, the first status line said ``peers 1``
    (the default until the first DHT upkeep), and the upkeep then counted every record in the DHT, a
    crashed peer's too. Both count live peers now: the barrier's count from the first line, then the
    upkeep's (records changed within 2 re-signing periods, as the barrier counts them)."""
    import threading
    import time
    from types import SimpleNamespace

    from diloco_swarm.dht.records import PeerEntry, PeerRecord
    from diloco_swarm.node import housekeeping, startup
    from diloco_swarm.node.housekeeping import Housekeeping
    from diloco_swarm.node.runner import Node
    from diloco_swarm.node.stats import NodeStats
    from diloco_swarm.node.swarm_view import SwarmView

    def record(peer_id):
        return PeerRecord.parse_obj(dict(
            peer_id=peer_id, name="", version="0", device="cpu", precision="fp32", reachability="public", outer_step=0,
            tokens_per_s=0.0, loss=None, eval_loss=None, tokens_total=0, bytes_sent=0, bytes_received=0,
            last_round_group_size=0, last_round_s=0.0, last_round_ok=None, failed_rounds=0, goodput=0.0, uptime_s=1.0,
            updated=time.time()))

    records = {p: record(p) for p in ("me", "A", "B", "C")}
    monkeypatch.setattr(startup, "read_peer_entries", lambda *a, **k: [PeerEntry(p, r, 0.0) for p, r in records.items()])
    monkeypatch.setattr(startup, "gone_peers", lambda dht, peers, **k: {"C"} & set(peers))  # C crashed: its ping fails
    node, lines = Node.__new__(Node), []
    node.cfg = SimpleNamespace(wait_for_peers=3, wait_for_peers_timeout=30.0)
    node.status, node.stop = SimpleNamespace(log=lines.append), SimpleNamespace(requested=False, event=threading.Event())
    node.dht, node.spec, node.peer_id = None, SimpleNamespace(run_id="r", organiser=None), "me"
    node.records, node.swarm, node.stats = SimpleNamespace(interval_s=5.0), SwarmView("me"), NodeStats()
    node._wait_for_peers()
    assert lines[-1].startswith("3 of 3 peers live (us included)")
    status = node.stats.status(outer_step=0, inner_steps=50, reachability="public")
    assert "| peers 3 |" in StatusLine.render(status)  # the first line after the barrier

    # the upkeep: C's record, unchanged for a minute, outlives the crashed C in the DHT
    node.swarm.heard["C"] = (records["C"].updated, time.monotonic() - 60.0)
    monkeypatch.setattr(housekeeping, "read_peer_records", lambda *a, **k: dict(records))
    monkeypatch.setattr(housekeeping, "refresh_run_spec", lambda *a: None)
    keeper = Housekeeping(stats=node.stats, swarm=node.swarm, log=lines.append, stop=threading.Event())
    keeper.start(node.spec, None, SimpleNamespace(interval_s=5.0, publish_now=lambda: True), lambda records: None)
    keeper._last_reconnect = time.monotonic()  # (no routing table to mend here)
    try:
        keeper.upkeep()
    finally:
        keeper.close()
    assert node.stats.peers_seen == 3
