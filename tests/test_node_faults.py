"""Cases from public bug reports of similar systems (issue 14), on real nodes on 127.0.0.1:

- a part of one node dies (its DHT process, its averager process, its p2pd): that node ends within
  30 s with one line and exit code 3, its checkpoint intact; the others keep verified rounds;
- a copied state dir runs twice (same identity): the second one to start refuses, exit 2;
- a paused run restarted all at once (no --initial-peers, fixed ports): the nodes average together again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from swarmlib import NodeProc, process_tree
from test_churn import NO_START_BARRIER, ROUND_S, START_S, ChurnSwarm, last_maddr, load_checkpoint, peer_id, records_after

pytestmark = [pytest.mark.swarm]

LOST_S = 30.0  # issue 14: a node that lost a part ends (or recovers) within this


def error_lines(node: NodeProc) -> list[str]:
    return [line for line in node.output().splitlines() if line.startswith("error:")]


def parts_of(node: NodeProc) -> dict[str, int]:
    """pids of the node's DHT process, averager process and p2pd (forked children keep the node's cmdline)."""
    main = node.proc.pid
    out: dict[str, int] = {}
    for pid in process_tree(main)[1:]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        name, ppid = stat.split("(", 1)[1].rsplit(")", 1)[0], int(stat.rsplit(")", 1)[1].split()[1])
        if name == "p2pd" and b"identity.key" in cmd:  # the DHT's daemon (a dial-back check's has no identity)
            out["p2pd"], out["dht"] = pid, ppid
    for pid in process_tree(main)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == main and b"diloco_swarm" in cmd and pid != out.get("dht"):
            out["averager"] = pid
    return out


@pytest.mark.timeout(1200)
def test_a_node_that_loses_a_part_ends_with_one_line_and_the_others_keep_averaging(tmp_path):
    with ChurnSwarm(tmp_path, "lostpart", extra=["--wait-for-peers", "3"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, wait_start=False)
        v = swarm.start("v", initial=a, wait_start=False)
        everyone = (a, b, v)
        swarm.wait_alive(lambda: all(any(r["round_ok"] for r in n.outer_steps()) for n in everyone),
                         START_S + 2 * ROUND_S, "a first successful round", everyone)
        for part in ("dht", "averager", "p2pd"):
            if not v.alive():
                swarm.start("v", "--initial-peers", last_maddr(a), *NO_START_BARRIER, timeout=START_S)
                n = len(v.outer_steps())
                swarm.wait_alive(lambda: len(v.outer_steps()) > n, 2 * ROUND_S, "v makes an outer step", everyone)
            pids = parts_of(v)
            assert set(pids) == {"dht", "averager", "p2pd"}, pids
            n_errors = len(error_lines(v))
            t_kill = time.time()
            os.kill(pids[part], signal.SIGKILL)
            code = swarm.wait_exit(v, LOST_S)
            seconds = time.time() - t_kill
            new_errors = error_lines(v)[n_errors:]
            print(f"SIGKILL of v's {part} (pid {pids[part]}): exit {code} in {seconds:.1f}s: {new_errors}")
            assert code == 3, (part, v.output()[-3000:])
            assert len(new_errors) == 1 and str(pids[part]) in new_errors[0], (part, new_errors)
            assert "checkpoint is kept" in new_errors[0]
            stop = v.events("stop")[-1]
            assert stop["graceful"] is False and str(pids[part]) in stop["reason"], stop
            assert load_checkpoint(v)["outer_step"] == stop["outer_step"]
            deadline = time.monotonic() + 10  # none of its processes outlives it
            while len(process_tree(v.proc.pid)) > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [p for p in pids.values() if Path(f"/proc/{p}").exists()
                        and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"], pids
            # the others keep verified rounds
            swarm.wait_alive(lambda: all(any(r["round_ok"] for r in records_after(n, t_kill)) for n in (a, b)),
                             2 * ROUND_S, f"a and b average after v lost its {part}", (a, b))
        swarm.leave_all()


@pytest.mark.timeout(900)
def test_a_copied_state_dir_refuses_to_run_twice(tmp_path):
    with ChurnSwarm(tmp_path, "copied", extra=["--wait-for-peers", "2"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, timeout=START_S)
        swarm.wait_alive(lambda: b.outer_steps(), START_S + 2 * ROUND_S, "b trains", (a, b))
        code, _ = swarm.leave(b)
        assert code == 0
        shutil.copytree(b.state_dir, tmp_path / "copy")
        (tmp_path / "copy" / "metrics.jsonl").unlink()
        swarm.start("b", "--initial-peers", last_maddr(a), *NO_START_BARRIER, timeout=START_S)
        time.sleep(6)  # b publishes its record at least once
        copy = swarm.start("copy", "--initial-peers", last_maddr(a), *NO_START_BARRIER, wait_start=False)
        t0 = time.monotonic()
        code = swarm.wait_exit(copy, START_S)
        print(f"the copy: exit {code} in {time.monotonic() - t0:.1f}s: {error_lines(copy)}")
        assert code == 2, copy.output()[-3000:]
        lines = error_lines(copy)
        assert len(lines) == 1 and "identity" in lines[0] and "state dir" in lines[0].replace("--state-dir", "state dir"), lines
        assert "Traceback" not in copy.output()
        assert "resumed from" not in copy.output()  # (it said so before its refusal)
        assert not copy.events("outer_step")  # refused before training
        # pointed at the original itself: libp2p will not dial its own peer id, so no peer answers at all;
        # said at once, not after rejoining through the peers it saw before (peers.json: a, then the line above)
        copy = swarm.start("copy", "--initial-peers", last_maddr(b), *NO_START_BARRIER, wait_start=False)
        assert swarm.wait_exit(copy, START_S) == 2, copy.output()[-3000:]
        lines = error_lines(copy)[1:]
        assert len(lines) == 1 and "own peer id" in lines[0] and "copied --state-dir" in lines[0], lines
        assert b.alive() and a.alive()
        swarm.leave_all()


def listen_port(node) -> int:
    return int(node.events("start")[-1]["maddrs"][0].split("/tcp/")[1].split("/")[0])


@pytest.mark.timeout(900)
def test_a_paused_run_restarted_all_at_once_meets_again(tmp_path):
    """Both nodes of a run stop, then restart at once with the default --port 0 and no --initial-peers:
    each listens on its last port again, so the addresses in the other's peers.json still work."""
    with ChurnSwarm(tmp_path, "paused", extra=["--wait-for-peers", "2"]) as swarm:
        a = swarm.start("a", timeout=START_S)
        b = swarm.start("b", initial=a, timeout=START_S)
        ports = {n.name: listen_port(n) for n in (a, b)}
        known = lambda n, other: (n.state_dir / "peers.json").exists() and peer_id(other) in json.loads(  # noqa: E731
            (n.state_dir / "peers.json").read_text())["peers"]
        swarm.wait_alive(lambda: known(a, b) and known(b, a) and all(
            any(r["round_ok"] and r["outer_step"] >= 2 for r in n.outer_steps()) for n in (a, b)),
            START_S + 3 * ROUND_S, "a and b average to outer step 2 and remember each other", (a, b))
        swarm.leave_all()
        time.sleep(2)

        t_restart = time.time()
        for name in ("a", "b"):  # both at once, neither with --initial-peers
            swarm.start(name, *NO_START_BARRIER, wait_start=False)
        for node in (a, b):
            swarm.wait_alive(lambda: len(node.events("start")) >= 2, START_S, f"{node.name} restarts", (a, b))
            assert listen_port(node) == ports[node.name], (node.name, node.events("start")[-1]["maddrs"])
        together = lambda n, other: [r for r in records_after(n, t_restart)  # noqa: E731
                                     if r["round_ok"] and peer_id(other) in r["group"]]
        swarm.wait_alive(lambda: together(a, b) and together(b, a), 4 * ROUND_S,
                         "a and b average together again", (a, b))
        for node in (a, b):
            path = ("re-dialed" if "the two swarms merge" in node.output() else
                    "new swarm" if "starting a new swarm" in node.output() else "rejoined at start")
            print(f"{node.name}: {path}; first joint round {together(node, a if node is b else b)[0]['time'] - t_restart:.0f}s "
                  "after the restart")
        swarm.leave_all()
