"""Pausing without leaving the run (issue 39), on real ``diloco-node join`` processes on 127.0.0.1: a paused
peer trains nothing, stays in the swarm marked paused, no round waits for it, and on resume it trains again
on the swarm's lineage. About 50-80 s on a 2-core machine."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest

from swarmlib import FAST_ARGS, Swarm, cpu_seconds, theta_by_step

pytestmark = [pytest.mark.swarm]

WINDOW_S = float(FAST_ARGS[FAST_ARGS.index("--averaging-window") + 1])  # 40: a round that waited for a peer lasts it
START_S = 180.0
ROUND_S = 90.0  # one round on a loaded 2-core machine, worst case


def _command(swarm: Swarm, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_swarm", *args], capture_output=True, text=True, timeout=120)


def _pause(swarm: Swarm, node, verb: str = "pause") -> str:
    out = _command(swarm, verb, "--state-dir", str(node.state_dir))
    assert out.returncode == 0 and "Traceback" not in out.stderr, (out.stdout, out.stderr)
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    return out.stdout


def _ok_rounds(node, after: float) -> list[dict]:
    return [r for r in node.outer_steps() if r["time"] > after and r["round_ok"]]


def _status_rows(swarm: Swarm, via) -> dict[str, dict]:
    """``diloco-node status --json`` (the light client) through ``via``: peer id -> row."""
    out = _command(swarm, "status", "--light", "--json", "--initial-peers", via.maddr(), "--run-id", swarm.run_id)
    assert out.returncode == 0, out.stderr
    return {row["peer_id"]: row for row in json.loads(out.stdout)["peers"]}


def test_a_paused_peer_stays_known_nobody_waits_for_it_and_it_rejoins_the_lineage(tmp_path):
    """Three tiny peers; c is paused between two inner steps, then again right after a hand-off. While it is
    paused the other two verify rounds of two at their usual cadence, c runs no step (its main process idles)
    and `status --json` shows it `paused`; on resume it verifies rounds again and holds the others' θ_global
    digest at a common outer step. Its round in flight ends before the pause; it leaves cleanly while
    paused; restarted on its paused state dir it starts paused, and after `resume` outside its
    --active-hours it stays paused, saying until when."""
    with Swarm(tmp_path, "pause3", extra=["--wait-for-peers", "3"]) as swarm:
        a = swarm.start("a")
        b = swarm.start("b", initial=a, wait_start=False)
        c = swarm.start("c", initial=a, wait_start=False)
        nodes = (a, b, c)
        swarm.wait(lambda: all(_ok_rounds(n, 0) for n in nodes), START_S, "a verified round on every node", list(nodes))
        c_id = c.events("start")[0]["peer_id"]

        # 1. paused during its inner steps (right after a round was applied)
        n_before = len(c.outer_steps())
        swarm.wait(lambda: len(c.outer_steps()) > n_before, ROUND_S, "c applies a round", c)
        assert _pause(swarm, c).startswith("paused: the node on")
        pause = swarm.wait(lambda: next(iter(c.events("pause")), None), ROUND_S, "c says it paused", c)
        assert pause["why"] == "owner" and pause["until"] is None
        assert "paused by its owner" in c.output()
        # the others go on without it, at their own cadence: rounds of two, verified, none waiting out the window
        swarm.wait(lambda: all(len(_ok_rounds(n, pause["time"] + 1)) >= 3 for n in (a, b)), 3 * ROUND_S,
                   "a and b verify 3 rounds while c is paused", [a, b, c])
        for n in (a, b):
            before = [r["time"] for r in _ok_rounds(n, 0) if r["time"] < pause["time"]]
            usual = statistics.median(y - x for x, y in zip(before, before[1:])) if len(before) > 1 else WINDOW_S / 4
            rounds = _ok_rounds(n, pause["time"] + 1)
            assert all(r["group_size"] == 2 and c_id not in r["group"] for r in rounds), rounds
            assert all(r["round_wall_s"] < WINDOW_S / 2 for r in rounds), [r["round_wall_s"] for r in rounds]
            gaps = [y["time"] - x["time"] for x, y in zip(rounds, rounds[1:])]
            assert max(gaps) < WINDOW_S / 2, gaps  # a round that waited for c would take the whole window
            assert statistics.median(gaps) <= 2 * usual + 2.0, (gaps, usual)  # the usual cadence
        # ... while c trains nothing (housekeeping only) and is known as paused
        assert not [e for e in c.events() if e["time"] > pause["time"] and e["event"] in ("averaging_start", "outer_step")]
        cpu0 = cpu_seconds([c.proc.pid])[c.proc.pid][1]
        time.sleep(5.0)
        cpu = cpu_seconds([c.proc.pid])[c.proc.pid][1] - cpu0
        assert cpu < 0.3 * 5.0, cpu  # an inner phase keeps its thread busy (--threads 1: ~1 CPU s per s)
        print(f"paused: c's main process used {cpu:.2f} CPU s in 5 s; {n.name}'s rounds {usual:.2f} s apart before, "
              f"{statistics.median(gaps):.2f} s while c was paused")
        rows = _status_rows(swarm, a)
        assert rows[c_id]["paused"] == "owner" and rows[c_id]["state"] == "online", rows[c_id]
        assert rows[c_id]["tokens_per_s"] == 0.0
        assert {rows[p]["paused"] for p in rows if p != c_id} == {None}

        # 2. resumed: it catches up and rejoins the lineage, and trains again
        assert _pause(swarm, c, "resume").startswith("resumed: the node on")
        resume = swarm.wait(lambda: next(iter(c.events("resume")), None), 30, "c says it resumed", c)
        assert resume["paused_s"] > 5.0
        swarm.wait(lambda: _ok_rounds(c, resume["time"]), 2 * ROUND_S, "c verifies a round after its resume", c)

        def common_step():
            held = [theta_by_step(n) for n in nodes]
            steps = [s for s in held[2] if s > resume["outer_step"] and all(s in h for h in held)]
            return max(steps) if steps else None

        step = swarm.wait(common_step, 2 * ROUND_S, "a common outer step after the resume", list(nodes))
        digests = {n.name: theta_by_step(n)[step] for n in nodes}
        assert len(set(digests.values())) == 1, (step, digests)

        # 3. paused while its round is in flight: the round ends (applied or abandoned by its rules) first
        n_starts = len(c.events("averaging_start"))
        swarm.wait(lambda: len(c.events("averaging_start")) > n_starts, ROUND_S, "c hands off a round", c)
        _pause(swarm, c)
        second = swarm.wait(lambda: c.events("pause")[1:] and c.events("pause")[1], 2 * ROUND_S, "c pauses again", c)
        handed = c.events("averaging_start")[-1]
        settled = [r for r in c.outer_steps() if r["time"] >= handed["time"]]
        assert settled and settled[0]["time"] <= second["time"], (handed, settled, second)  # its round ended, then the pause
        assert settled[-1]["outer_step"] <= second["outer_step"]
        assert not [e for e in c.events() if e["time"] > second["time"] and e["event"] == "averaging_start"]
        swarm.wait(lambda: all(len(_ok_rounds(n, second["time"] + 1)) >= 2 for n in (a, b)), 2 * ROUND_S,
                   "a and b verify rounds while c is paused again", [a, b, c])
        # a paused node stops on a signal as any other: a clean leave, exit 0
        c.proc.send_signal(signal.SIGINT)
        assert swarm.wait_exit(c, 60) == 0 and c.events("stop")[-1]["graceful"] is True

        # 4. the pause outlives a restart; outside its --active-hours the resumed node stays paused, and says until when
        soon = datetime.now() + timedelta(hours=2)
        hours, opens = f"{soon:%H:%M}-{soon + timedelta(hours=1):%H:%M}", f"{soon:%H:%M}"
        c = swarm.start("c", "--active-hours", hours, initial=a)
        swarm.wait(lambda: len(c.events("pause")) >= 3, START_S, "c starts paused", c)
        assert c.events("pause")[2]["why"] == "owner" and not [e for e in c.outer_steps() if e["time"] > second["time"]]
        _pause(swarm, c, "resume")
        window = swarm.wait(lambda: c.events("pause")[3:] and c.events("pause")[3], 30, "c pauses for its hours", c)
        assert (window["why"], window["until"]) == ("active_hours", opens), window
        swarm.wait(lambda: f"paused: outside active hours until {opens}" in c.output(), 30, "c's status line", c)
        swarm.wait(lambda: _status_rows(swarm, a)[c_id]["paused"] == "active_hours", 60, "its record says why", c)
        assert not c.events("resume")[1:] and not [e for e in c.events("averaging_start") if e["time"] > second["time"]]
        codes = swarm.leave()
        assert codes == {"a": 0, "b": 0, "c": 0}, codes
