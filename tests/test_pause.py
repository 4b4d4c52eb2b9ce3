"""Pausing without leaving the run (issue 39): the pure decision (node/pause.py), the record's ``paused``
field, who a round leaves out, the status line, and the ``pause`` / ``resume`` / ``--active-hours`` input."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from datetime import datetime
from types import SimpleNamespace

import pytest

from diloco_swarm.dht.records import PeerRecord, normalize_snapshot
from diloco_swarm.node import round_policy as policy
from diloco_swarm.node.pause import CONTROL_FILE, ActiveHours, Paused, PauseWatch, clear_pause, decide, request_pause
from diloco_swarm.node.report import StatusLine
from diloco_swarm.node.stats import NodeStats
from diloco_swarm.node.swarm_view import SwarmView
from test_cli_errors import error_line

NODE = [sys.executable, "-m", "diloco_swarm"]


def at(hh: int, mm: int) -> datetime:
    return datetime(2026, 12, 7, hh, mm)


# ------------------------------------------------------------------------------ the decision
def test_a_window_parses_and_wraps_midnight():
    night = ActiveHours.parse("22:00-07:00")
    assert (night.start, night.end, str(night)) == (22 * 60, 7 * 60, "22:00-07:00")
    assert [night.contains(h * 60) for h in (21, 22, 23, 0, 6, 7, 12)] == [False, True, True, True, True, False, False]
    assert night.contains(6 * 60 + 59) and not night.contains(21 * 60 + 59)
    day = ActiveHours.parse(" 9:30 - 17:05 ")  # one-digit hours and spaces are fine
    assert day.contains(9 * 60 + 30) and day.contains(17 * 60 + 4) and not day.contains(17 * 60 + 5)
    assert not day.contains(0) and not day.contains(9 * 60 + 29)


@pytest.mark.parametrize("text, says", [
    ("25:00-07:00", "hours run 00-23"), ("22:60-07:00", "minutes 00-59"), ("24:00-07:00", "hours run 00-23"),
    ("2200-0700", "expected HH:MM-HH:MM"), ("22:00", "expected HH:MM-HH:MM"), ("", "expected HH:MM-HH:MM"),
    ("22:00-07:00-08:00", "expected HH:MM-HH:MM"), ("-1:00-07:00", "expected HH:MM-HH:MM"),
    ("08:00-08:00", "the window is empty"),
])
def test_a_bad_window_is_refused_with_one_line_naming_the_flag(text, says):
    with pytest.raises(ValueError) as e:
        ActiveHours.parse(text)
    assert str(e.value).startswith(f"--active-hours {text!r}: ") and says in str(e.value), str(e.value)


def test_the_owner_pause_comes_first_then_the_window_and_says_when_it_opens():
    night = ActiveHours.parse("22:00-07:00")
    assert decide(owner_paused=False, hours=None, now=at(12, 0)) is None  # no flag: trains all day
    assert decide(owner_paused=False, hours=night, now=at(23, 30)) is None
    assert decide(owner_paused=False, hours=night, now=at(3, 0)) is None  # after midnight, inside the window
    outside = decide(owner_paused=False, hours=night, now=at(12, 0))
    assert outside == Paused("active_hours", "22:00")
    assert outside.describe() == "paused: outside active hours until 22:00"
    assert decide(owner_paused=True, hours=night, now=at(23, 30)) == Paused("owner")  # inside the window too
    assert decide(owner_paused=True, hours=None, now=at(12, 0)).describe().startswith("paused by its owner")


def test_the_control_file_is_the_owners_word_and_the_watch_reads_it_at_most_once_a_second(tmp_path):
    watch = PauseWatch(tmp_path, None)
    assert watch.now() is None
    assert request_pause(tmp_path) is True and (tmp_path / CONTROL_FILE).exists()
    assert request_pause(tmp_path) is False  # already paused
    assert watch.now() is None  # (read less than a second ago: the training thread asks every inner step)
    watch._checked -= 1.0
    assert watch.now() == Paused("owner")
    assert clear_pause(tmp_path) is True and clear_pause(tmp_path) is False
    watch._checked -= 1.0
    assert watch.now() is None
    assert not [p for p in tmp_path.iterdir()]  # no temporary file left behind


# ------------------------------------------------------------------------------ the record and the round
def _snapshot(**over) -> dict:
    return {**dict(peer_id="12D3KooWPaused", name="p", version="0", device="cpu", precision="fp32", reachability="public",
                   outer_step=4, tokens_per_s=0.0, loss=None, eval_loss=None, tokens_total=0, bytes_sent=0,
                   bytes_received=0, last_round_group_size=0, last_round_s=0.0, last_round_ok=None, failed_rounds=0,
                   goodput=0.5, uptime_s=1.0, updated=time.time()), **over}


def test_the_record_carries_paused_and_records_without_it_still_parse():
    assert PeerRecord.parse_obj(normalize_snapshot(_snapshot(paused="owner"))).paused == "owner"
    assert PeerRecord.parse_obj(normalize_snapshot(_snapshot(paused="active_hours"))).paused == "active_hours"
    training = normalize_snapshot(_snapshot())  # (a snapshot of an older node: no paused)
    assert training["paused"] is None and PeerRecord.parse_obj(training).paused is None
    # hivemind's SchemaValidator stores a record only if parsing it changes nothing: the field is always there
    assert PeerRecord.parse_obj(training).dict() == training
    assert normalize_snapshot(_snapshot(paused="sleeping"))["paused"] is None  # only the two reasons
    with pytest.raises(ValueError):
        PeerRecord.parse_obj({**training, "paused": "sleeping"})


def _rec(step=4, eta=0.0, speed=0.1, paused=None, updated=None):
    return SimpleNamespace(outer_step=step, restarted_below=0, averaging_round=None, phase_eta=eta, inner_step_s=speed,
                           reachability="public", maddrs=[], updated=updated or time.time(), paused=paused)


def test_no_round_plans_with_counts_or_sizes_its_phases_by_a_paused_peer():
    now = time.time()
    records = {"me": _rec(eta=now), "b": _rec(eta=now + 1, speed=0.1), "z": _rec(eta=now + 1000, speed=50.0, paused="owner")}
    active = policy.training(records)
    assert set(active) == {"me", "b"}
    cfg = SimpleNamespace(averaging_window=40.0, matchmaking_time=3.0, group_size=64, max_group_size=64, max_outer_steps=0)
    planned = policy.plan(4, 2.0, {"b": records["b"]}, me="me", now=now, silent_s={}, max_silent_s=10.0,
                          first_round=False, cfg=cfg)
    join = policy.after_plan(planned, active, set(), me="me", overlap=True)
    assert isinstance(join, policy.Join) and join.members == ("b",) and join.online == 2  # majority of 2, not 3
    assert planned.due < now + 10  # not the paused peer's stale hand-off time
    # the paused peer's speed and hand-off time size nobody's phase (DyLU, alignment)
    view = SwarmView(me="me")
    view.note(records)
    assert view.inner_step_s == 0.1 and math.isclose(view.phase_eta, now + 1)
    # a grid's memory of an earlier read drops a peer that has paused since
    view.round_peers({"b": records["b"], "z": _rec()})
    assert set(view.round_peers({"b": records["b"]}, paused=frozenset({"z"}))) == {"b"}


def test_the_status_line_and_the_record_say_paused_and_why():
    stats = NodeStats()
    stats.tokens_per_s, stats.paused = 1234.0, Paused("active_hours", "22:00")
    line = StatusLine.render(stats.status(outer_step=7, inner_steps=10, reachability="public"))
    assert line == "outer 7 | paused: outside active hours until 22:00 | peers 1", line
    record = stats.peer_record()
    assert record["paused"] == "active_hours" and record["tokens_per_s"] == 0.0
    stats.paused = None
    assert stats.peer_record()["paused"] is None and "paused" not in StatusLine.render(
        stats.status(outer_step=7, inner_steps=10, reachability="public"))


def test_another_owners_record_under_a_peers_id_cannot_pause_it():
    """Records are signed by owner keys, and a peer id is what a record says: a hostile owner may publish a
    newer record under a training peer's id saying paused. The peer stays in the rounds (paused only when
    every claim says so); the newest claim's other fields stand, as for any two claims of one id."""
    from diloco_swarm.dht.records import PeerEntry, live_records

    stats = NodeStats()

    def claim(paused, updated):
        stats.paused = Paused(paused) if paused else None
        return PeerRecord.parse_obj(normalize_snapshot({"peer_id": "QmVictim", **stats.peer_record()}, now=updated))

    honest, forged = claim(None, 100.0), claim("owner", 200.0)
    records = live_records([PeerEntry("key-victim", honest, 0.0), PeerEntry("key-hostile", forged, 0.0)])
    assert records["QmVictim"].paused is None and records["QmVictim"].updated == 200.0
    assert set(policy.training(records)) == {"QmVictim"}
    both = live_records([PeerEntry("key-victim", claim("owner", 300.0), 0.0), PeerEntry("key-hostile", forged, 0.0)])
    assert both["QmVictim"].paused == "owner"  # every claim says paused: it is


# ------------------------------------------------------------------------------ the commands
def run(*args, cwd):
    return subprocess.run([*NODE, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_pause_and_resume_refuse_a_missing_state_dir_and_join_a_bad_window(tmp_path):
    for command in ("pause", "resume"):
        out = run(command, "--state-dir", str(tmp_path / "missing"), cwd=tmp_path)
        line = error_line(out.stderr, out.returncode, out.stdout)
        assert f"--state-dir {tmp_path / 'missing'}: no such directory" in line, line
    assert not (tmp_path / "missing").exists()
    for bad in ("25:00-07:00", "7-22"):
        out = run("join", "--state-dir", str(tmp_path / "s"), "--active-hours", bad, cwd=tmp_path)
        assert f"--active-hours '{bad}'" in error_line(out.stderr, out.returncode, out.stdout)
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_pause_says_whether_a_node_runs_and_records_the_pause_either_way(tmp_path):
    from diloco_swarm.dht.swarm import StateDirLock

    state = tmp_path / "state"
    state.mkdir()
    out = run("pause", "--state-dir", str(state), cwd=tmp_path)  # not a node's state dir (a typo's folder): nothing written
    assert "is not a node's state dir (it holds no identity.key)" in error_line(out.stderr, out.returncode, out.stdout)
    assert list(state.iterdir()) == []
    (state / "identity.key").write_bytes(b"a node's key")  # (a node's first start writes it)
    out = run("pause", "--state-dir", str(state), cwd=tmp_path)  # no node: said, exit 1, recorded for the next join
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "no node is running on" in out.stderr and "the next `diloco-node join" in out.stderr and "starts paused" in out.stderr
    assert (state / CONTROL_FILE).exists()
    lock = StateDirLock(state)  # a running node holds this lock
    try:
        out = run("pause", "--state-dir", str(state), cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith("already paused: the node on"), (out.stdout, out.stderr)
        out = run("resume", "--state-dir", str(state), cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith("resumed: the node on"), (out.stdout, out.stderr)
        assert len(out.stdout.strip().splitlines()) == 1 and not (state / CONTROL_FILE).exists()
        out = run("pause", "--state-dir", str(state), cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith("paused: the node on"), (out.stdout, out.stderr)
        assert (state / CONTROL_FILE).exists()
    finally:
        lock.release()
    out = run("resume", "--state-dir", str(state), cwd=tmp_path)
    assert out.returncode == 1 and "the recorded pause is cleared" in out.stderr, out.stderr
    assert not (state / CONTROL_FILE).exists()


def test_status_and_the_dashboard_mark_a_paused_peer():
    from rich.console import Console

    from diloco_swarm.cli.status import render_table
    from diloco_swarm.dashboard.render import _peer_table

    def row(peer_id, paused, state="online"):
        return {**normalize_snapshot(_snapshot(peer_id=peer_id, paused=paused)), "owner": peer_id.lower()[-12:],
                "state": state, "age_s": 1.0}

    rows = [row("12D3KooWAwake", None), row("12D3KooWOwner", "owner"), row("12D3KooWHours", "active_hours"),
            row("12D3KooWGone", "owner", state="gone")]
    console = Console(width=160, record=True)
    console.print(render_table(rows, "run", width=160))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if "12D3KooW" in line}
    assert "paused" not in lines["12D3KooWAwake"] and "paused" not in lines["12D3KooWGone"]
    assert "online, paused" in lines["12D3KooWOwner"] and "(hours)" not in lines["12D3KooWOwner"]
    assert "online, paused (hours)" in lines["12D3KooWHours"]
    html = _peer_table({"peers": rows, "totals": {}, "config": {"stale_after_s": 15, "gone_after_s": 60, "keep_gone_s": 600}}, {})
    assert html.count('<span class="badge paused" title=') == 2 and 'title="outside its active hours"' in html


def test_a_round_reads_the_training_peers_and_a_planned_member_turned_paused_has_moved_on(monkeypatch):
    import diloco_swarm.node.round as round_module
    from test_dylu import make_round

    records = {"me": _rec(), "b": _rec(), "z": _rec(paused="owner")}
    monkeypatch.setattr(round_module, "read_peer_records", lambda dht, run_id, organiser=None: dict(records))
    r = make_round()
    assert set(r._read_records()) == {"me", "b"} and r._paused == {"z"}
    # a forming round stops waiting for z (planned before its record said paused); b at our step may still come
    assert r.moved_on(["b", "z"], round_no=4) == {"z"}
    # nobody else trains: the round is solo even though z still announces its state to joiners
    r.p.averager = SimpleNamespace(donors=lambda: {"z": 4.0})
    records.pop("b")
    handoff = SimpleNamespace(delta=[], standing=4, inner_s=1.0, tokens=1, carried=None)
    outcome = r._average(handoff, control=None)
    assert outcome.alone and outcome.result.reason == "no other peer training (1 paused)", outcome.result


def test_a_paused_peers_step_does_not_hold_back_where_the_swarm_stands_nor_lend_one_peer_its_word():
    """--active-hours overnight: P paused at step 50, A and B trained on to 100, R resumes at 50. P's record
    says where P stopped, not where the swarm is: R must see step 100 as supported and catch up to it. But a
    paused peer still counts in the quorum: a lone trainer's step, however advanced, is one peer's word (a
    hostile H at step 1000 while the honest peers sleep makes nobody jump to it)."""
    from diloco_swarm.node.canonical import gather_evidence

    def entry(peer, step, paused=None):
        record = SimpleNamespace(peer_id=peer, outer_step=step, restarted_below=0, reachability="public",
                                 paused=paused, theta_marks=[])
        return SimpleNamespace(owner=f"key-{peer}", record=record)

    paused_too = gather_evidence([entry("A", 100), entry("B", 100), entry("P", 50, paused="active_hours")],
                                 me="R", my_step=50)
    assert paused_too.supported_step == 100 and paused_too.supported_raw_step == 100
    all_training = gather_evidence([entry("A", 100), entry("B", 100), entry("P", 50)], me="R", my_step=50)
    assert all_training.supported_step == 100
    lone = gather_evidence([entry("H", 1000), entry("P", 50, paused="owner"), entry("Q", 50, paused="owner")],
                           me="R", my_step=50)
    assert lone.supported_step == 50 and lone.supported_raw_step == 50  # our own step, never H's word alone
    alone_online = gather_evidence([entry("A", 100)], me="R", my_step=50)
    assert alone_online.supported_step == 100  # the only record there is: all of them (the quorum's floor)


def test_time_paused_on_purpose_never_counts_against_goodput_even_while_the_pause_goes_on():
    stats = NodeStats()
    stats.started = time.monotonic() - 100.0
    stats.inner_s = 50.0
    stats.paused_since = time.monotonic() - 50.0  # paused for the last 50 s, still paused
    assert stats.goodput() == pytest.approx(1.0, abs=0.01)
    stats.paused_s, stats.paused_since = 50.0, None  # resumed at this moment
    assert stats.goodput() == pytest.approx(1.0, abs=0.01)
