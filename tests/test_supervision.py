"""Bounded calls into the DHT process and the watchdog of a node's parts, on a real hivemind DHT.

Each test starts one ``hivemind.DHT`` on 127.0.0.1 (a forked process plus its p2pd daemon, about
a second), then kills a part of it the way the OOM killer or a signal to the process group would.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from diloco_swarm.dht.calls import ChildUnavailable, dht_get, dht_run, dht_store
from diloco_swarm.dht.publisher import PeerRecordPublisher
from diloco_swarm.dht.signing import record_validators
from diloco_swarm.dht.swarm import explain_dht_error, start_dht
from diloco_swarm.node.redial import dial_peers
from diloco_swarm.node.watchdog import Watchdog, children_of, node_parts


def dht_pids(dht) -> list[int]:
    """Pids of the DHT process and its p2pd."""
    return [dht.pid] + [pid for pid, name in children_of(dht.pid) if name == "p2pd"]


def isolated(test):
    """Run ``test(dht, tmp_path)`` in a fresh interpreter (pytest on this one test) with its own DHT.

    A SIGKILLed hivemind child can die holding hivemind's cross-process MPFuture lock, and then no
    later DHT of the same parent process starts (a node never starts one after that: it exits); and
    forking a pytest process whose earlier tests left hivemind threads running is unsafe. So each test
    that kills a part runs in its own process; a failure comes back with its output.
    """

    def wrapper(tmp_path, request, *args, **kwargs):
        if os.environ.get("DILOCO_ISOLATED_TEST") == request.node.nodeid:
            node = start_dht(initial_peers=[], host="127.0.0.1", port=0, identity_path=tmp_path / "identity.key",
                             record_validators=record_validators("supervised", tmp_path))
            try:
                test(node, tmp_path, *args, **kwargs)
            finally:
                for pid in dht_pids(node):
                    if pid != node.pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                if node.is_alive():
                    node.kill()
            return
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                             cwd=request.config.rootpath, capture_output=True, text=True, timeout=140,
                             env={**os.environ, "DILOCO_ISOLATED_TEST": request.node.nodeid})
        if run.returncode != 0:
            pytest.fail(run.stdout[-4000:] + run.stderr[-2000:], pytrace=False)

    wrapper.__name__ = test.__name__
    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter("tmp_path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + list(inspect.signature(test).parameters.values())[2:])
    return wrapper


def _p2pd(dht) -> int:
    return next(pid for pid, name in children_of(dht.pid) if name == "p2pd")


@pytest.mark.timeout(150)
@isolated
def test_calls_fail_within_a_second_once_the_dht_process_is_gone(dht, tmp_path):
    from hivemind.utils import get_dht_time

    assert dht_store(dht, "k", "v", expiration_time=get_dht_time() + 60)
    assert dht_get(dht, "k").value == "v"
    validators = record_validators("supervised", tmp_path)
    publisher = PeerRecordPublisher(dht, "supervised", validators, lambda: {"peer_id": "QmSupervised"})
    assert publisher.publish_now()

    os.kill(dht.pid, signal.SIGKILL)  # what a SIGTERM to the node's process group, or the OOM killer, does
    dht.join(10)
    for call in (lambda: dht_get(dht, "k"), lambda: dht_store(dht, "k", "w", expiration_time=get_dht_time() + 60),
                 lambda: dht_run(dht, _Sleep(), timeout=30)):
        t0 = time.monotonic()
        with pytest.raises(ChildUnavailable, match="DHT process is gone"):
            call()
        assert time.monotonic() - t0 < 2.0
    assert dial_peers(dht, ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"]) == 0

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("diloco_swarm.dht.publisher").addHandler(handler)
    for _ in range(4):  # the publisher thread would do this every 5 s
        assert not publisher.publish_now()
    assert not lines, lines  # a dead DHT process is the watchdog's to report (node/watchdog.py), in one line
    t0 = time.monotonic()
    publisher.stop(remove=True)  # nothing to remove from a dead DHT: returns at once, quietly
    assert time.monotonic() - t0 < 2.0


class _Sleep:
    async def __call__(self, _dht, _node):
        import asyncio

        await asyncio.sleep(3600)


@pytest.mark.timeout(150)
@isolated
def test_a_publisher_problem_is_logged_once_not_every_5s(dht, tmp_path):
    snapshot = {"peer_id": ""}  # unusable: every publication fails the same way
    publisher = PeerRecordPublisher(dht, "supervised", record_validators("supervised", tmp_path), lambda: snapshot)
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("diloco_swarm.dht.publisher").addHandler(handler)
    for _ in range(4):
        assert not publisher.publish_now()
    assert len(lines) == 1 and "could not publish" in lines[0], lines
    snapshot["peer_id"] = "QmFine"
    assert publisher.publish_now()
    snapshot["peer_id"] = ""
    assert not publisher.publish_now()  # the same problem again after a success: reported again
    assert len(lines) == 2, lines


@pytest.mark.timeout(150)
@isolated
def test_a_hung_call_is_bounded_and_stop_ends_it_early(dht, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ChildUnavailable, match="no answer within 1s"):
        dht_run(dht, _Sleep(), timeout=1.0)
    assert 0.9 < time.monotonic() - t0 < 5.0
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(ChildUnavailable, match="stopping"):
        dht_run(dht, _Sleep(), timeout=30.0, stop=stop)
    assert time.monotonic() - t0 < 3.0
    assert dht_get(dht, "nothing-here") is None  # the DHT still answers


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", ["p2pd", "dht"])
@isolated
def test_watchdog_reports_a_lost_part_once(dht, tmp_path, victim):
    parts = node_parts(dht, None)
    assert any("p2pd" in name for name in parts) and any("DHT process" in name for name in parts)
    owners = dht_pids(dht)
    calls: list[str] = []
    watchdog = Watchdog(parts, calls.append, poll_s=0.2).start()
    time.sleep(0.6)
    assert not calls and watchdog.check() is None

    pid = _p2pd(dht) if victim == "p2pd" else dht.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while not calls and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert calls, "the watchdog did not notice"
    assert time.monotonic() - t0 < 5.0  # poll 0.2 s + 1 s grace, on a loaded machine
    expected = "the libp2p daemon p2pd" if victim == "p2pd" else "the DHT process"
    assert calls[0].startswith(f"{expected} (pid {pid})"), calls
    time.sleep(0.5)
    assert len(calls) == 1 and watchdog.lost == calls[0]

    # the node then ends its parts (a killed part's sockets go with the node's socket directory:
    # tests/test_hivemind_fixes.py)
    watchdog.stop()
    for p in owners:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    dht.join(10)


def test_misleading_bootstrap_refusals_are_explained():
    skew = explain_dht_error("ValidationError: local time must be within 3 seconds  of others(local: 1764480000.25000, "
                             "peer: 1764480007.75000)")
    assert "7.5 s behind" in skew and "NTP" in skew and "3 s" in skew
    ahead = explain_dht_error("local time must be within 3 seconds  of others(local: 1764480010.0, peer: 1764480000.0)")
    assert "10.0 s ahead of" in ahead
    clash = explain_dht_error("Peer QmAbc can't access this node. Probably, libp2p has failed to bypass the firewall")
    assert "QmAbc" in clash and "identity" in clash and "--state-dir" in clash and "--client-mode" in clash
    assert explain_dht_error("something else") is None
