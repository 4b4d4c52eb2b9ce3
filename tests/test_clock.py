"""The node's own clock (diloco_swarm.utils.clock): a step of the machine's clock after start moves no
time another peer reads, and is said in one line; a peer's record from the future is said too.
The swarm case (two real peers, one clock stepped back 30 s mid-run): tests/test_clock_step.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import faults
from diloco_swarm.dht.records import normalize_snapshot
from diloco_swarm.node.swarm_view import SwarmView
from diloco_swarm.utils import clock, hivemind_fixes  # noqa: F401  (points hivemind at the node's clock)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def stepped(monkeypatch):
    """``stepped(s)``: from now on the machine's clock (``time.time``) reads ``s`` seconds more."""
    wall = time.time

    def step(s: float) -> None:
        monkeypatch.setattr(time, "time", lambda: wall() + s)

    return step


def test_the_nodes_clock_is_the_machines_at_start_and_ignores_its_steps(stepped):
    assert abs(clock.now() - time.time()) < 1.0  # this test process has not been running for days
    before = clock.now()
    stepped(-30.0)
    after = clock.now()
    assert 0.0 <= after - before < 1.0
    assert abs(clock.machine_offset() + 30.0) < 1.0
    record = normalize_snapshot({"peer_id": "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"})
    assert abs(record["updated"] - after) < 1.0  # a record's time is the node's clock, not the stepped one


def test_every_reference_to_hiveminds_dht_time_is_the_nodes_clock():
    """hivemind binds ``get_dht_time = time.time`` in each module that imports it; every one of them
    (DHT expirations, matchmaking's times, the bootstrap ping's check) and ours must read the node's clock."""
    import diloco_swarm.node.runner  # noqa: F401  (every module a node loads)

    bound = {name: module.get_dht_time for name, module in list(sys.modules.items())
             if name.partition(".")[0] in ("hivemind", "diloco_swarm") and hasattr(module, "get_dht_time")}
    assert "hivemind.dht.node" in bound and "hivemind.averaging.matchmaking" in bound
    assert {name for name, f in bound.items() if f is not clock.now} == set()


def test_a_step_of_the_machines_clock_is_said_once_and_again_only_when_it_moves_that_much(stepped):
    watch = clock.ClockWatch()
    assert watch.check("at outer step 6") is None
    stepped(-30.0)
    line = watch.check("at outer step 7")
    assert line is not None and "clock jumped back 30.0 s at outer step 7" in line and "\n" not in line, line
    assert watch.check("at outer step 8") is None
    stepped(-31.0)  # moved less than the tolerance: nothing new to say
    assert watch.check() is None
    stepped(-40.0)
    assert "jumped back 40.0 s" in watch.check()
    stepped(0.2)  # NTP fixed it: said once
    assert "agrees with this node's own again" in watch.check()
    assert watch.check() is None
    stepped(8.0)
    assert "jumped ahead 8.0 s" in watch.check()


def _record(updated: float) -> SimpleNamespace:
    return SimpleNamespace(updated=updated, maddrs=[], reachability="public", inner_step_s=0.1, phase_eta=0.0)


def test_a_fresh_record_from_the_future_is_said_once(caplog):
    """A record just re-signed never looks newer than our clock unless the two clocks disagree: its
    owner then takes our records as expired (issue 37). Said once, not at every read."""
    view = SwarmView(me="me")
    with caplog.at_level(logging.WARNING, logger="diloco_swarm.node.swarm_view"):
        view.note({"me": _record(clock.now() + 60), "b": _record(clock.now() - 2.0)})  # ours is never compared
        assert not caplog.records
        view.note({"b": _record(clock.now() + 30.0)})
        view.note({"b": _record(clock.now() + 30.0)})  # re-signed, still 30 s ahead: nothing new
        frozen = _record(clock.now() + 40.0)
        view.note({"b": frozen})
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "peer b's record carries a time 30" in lines[0] and "40" in lines[1], lines
        view.note({"b": frozen})  # unchanged: not a fresh record, whatever its time
        view.note({"b": _record(clock.now() - 1.0)})  # the clocks agree again
        view.note({"b": _record(clock.now() + 30.0)})
        assert len(caplog.records) == 3


def _faulty(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_the_clock_step_fault_steps_the_machines_clock_of_the_process_and_its_forked_children():
    """tests/faults.py's ``clock-step``: time.time and any get_dht_time still bound to it read S more
    once armed, in forked children too (the DHT and averager processes); the node's clock does not."""
    out = _faulty("""
import os, time
import faults
from diloco_swarm.utils import clock
from hivemind.utils import timed_storage
faults.install_clock_step(-30.0)
assert abs(time.time() - clock.now()) < 1
faults._clock_step_at.value = time.monotonic() + 0.5  # what ClockStepNode does when training starts
pid = os.fork()
if pid == 0:
    time.sleep(1.0)
    os._exit(0 if abs(time.time() - clock.now() + 30) < 1 and timed_storage.get_dht_time is clock.now else 1)
time.sleep(1.0)
assert abs(time.time() - clock.now() + 30) < 1, time.time() - clock.now()
assert abs(time.time_ns() / 1e9 - clock.now() + 30) < 1
assert os.waitpid(pid, 0)[1] == 0
print("ok")
""".replace("import faults", "import sys; sys.path.insert(0, 'tests'); import faults"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("value, said", [("-30@20", None), ("30@0", None), ("0@20", "S ≠ 0"), ("-30", "S ≠ 0"),
                                         ("-30@-1", "T ≥ 0"), ("x@1", "S ≠ 0"), ("inf@1", "S ≠ 0")])
def test_the_clock_step_fault_takes_seconds_at_seconds(value, said):
    if said is None:
        step, after = (float(v) for v in value.split("@"))
        assert faults.parse_fault(f"clock-step={value}") == ("clock-step", (step, after))
    else:
        with pytest.raises(faults.UsageError, match=said):
            faults.parse_fault(f"clock-step={value}")
