"""`diloco-node demo` and Ctrl+C: the terminal's SIGINT reaches the demo only (each node has its own
process group), the demo asks each node to stop exactly once, and a second Ctrl+C kills them.

The demo runs for real, as a subprocess in its own session, and gets SIGINT the way a terminal sends
it: to its whole process group. Its nodes are stand-ins (tests/fake_node.py) that record the signals
they receive; the real node's SIGINT handling is tested in test_cli_errors.py and test_churn.py.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAKE_NODE = Path(__file__).with_name("fake_node.py")
DEMO = (
    "import sys; import diloco_swarm.cli.demo as demo; "
    f"demo.node_command = lambda *args: [sys.executable, {str(FAKE_NODE)!r}, *args]; "
    "from diloco_swarm.cli import main; sys.argv[0] = 'diloco-node'; main()"
)


def as_from_a_terminal():
    """In the demo's child, before exec: the signal dispositions of a shell's fresh command. A
    process inherits ignored signals and the signal mask across exec, and an earlier test of this
    pytest process may have left SIGINT ignored (hivemind's averager sets SIG_IGN in the process
    that starts it); Python then installs no Ctrl+C handler at all."""
    stop = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    for sig in stop:
        signal.signal(sig, signal.SIG_DFL)


def start_demo(tmp_path, mode):
    log = open(tmp_path / "demo.stderr", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", DEMO, "demo", "--peers", "2", "--port", "0", "--workdir", str(tmp_path / "work")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        env={**os.environ, "FAKE_NODE_MODE": mode}, preexec_fn=as_from_a_terminal,
    )
    log.close()
    return proc


def wait_for(predicate, what, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(f"{what} (demo exit code {proc.poll()})")


def node_dirs(tmp_path):
    return sorted((tmp_path / "work").glob("run-*/peer-*"))


def signals_of(node_dir):
    path = node_dir / "signals"
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def demo(tmp_path):
    procs = []

    def run(mode):
        procs.append(start_demo(tmp_path, mode))
        proc = procs[-1]
        wait_for(lambda: len([d for d in node_dirs(tmp_path) if (d / "pid").exists()]) == 2, "nodes did not start", proc)
        return proc

    yield run
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for d in node_dirs(tmp_path):  # stand-in nodes still running after a failure
        if (d / "pid").exists() and not (d / "exit").exists():
            try:
                os.killpg(int((d / "pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(90)
def test_ctrl_c_stops_each_node_with_exactly_one_sigint(demo, tmp_path):
    proc = demo("graceful")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C does
    assert proc.wait(timeout=60) == 130
    stderr = (tmp_path / "demo.stderr").read_text()
    assert "Traceback" not in stderr, stderr
    assert stderr.count("demo: stopping the nodes") == 1, stderr
    for d in node_dirs(tmp_path):
        assert signals_of(d) == ["SIGINT"], d  # one stop request: no second signal, so the checkpoint is kept
        assert (d / "exit").read_text() == "0"
    # the hint runs as typed: diloco-node when it is on PATH, else this interpreter with -m
    hint = next(line for line in stderr.splitlines() if "watch it with: " in line).split("watch it with: ")[1]
    assert hint.startswith(("diloco-node status --run-id demo-", f"{sys.executable} -m diloco_swarm status --run-id demo-")), hint
    # and so does each node's join hint, which names diloco-node (not on PATH after ./diloco's set-up)
    own = hint.split(" status ")[0]
    joins = [line.split("to join from this machine: ")[1] for line in stderr.splitlines() if "to join from this machine: " in line]
    assert len(joins) == 2 and all(j.startswith(f"{own} join --run-id ") for j in joins), joins


@pytest.mark.timeout(90)
def test_a_second_ctrl_c_kills_the_nodes_and_says_so(demo, tmp_path):
    proc = demo("stubborn")
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: all(signals_of(d) == ["SIGINT"] for d in node_dirs(tmp_path)), "no SIGINT reached the nodes", proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    stderr = (tmp_path / "demo.stderr").read_text()
    assert "Traceback" not in stderr, stderr
    assert sum("Ctrl+C again: killing the nodes" in line for line in stderr.splitlines()) == 1, stderr
    for d in node_dirs(tmp_path):
        assert signals_of(d) == ["SIGINT", "SIGTERM"], d
        assert (d / "exit").read_text() == "130"


def test_demo_accepts_port_0_and_refuses_a_busy_port(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "diloco_swarm", "demo", "--port", str(port),
                              "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == f"error: port {port} on 127.0.0.1 is already in use; pick another with --port (0 = any free port)\n"
    assert not (tmp_path / "work").exists()
    help_text = subprocess.run([sys.executable, "-m", "diloco_swarm", "demo", "--help"], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "0 = any free port" in help_text and "[0<=x<=65535]" in help_text


def _metrics(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_the_summary_says_whether_the_peers_ended_on_one_model(tmp_path):
    # A newcomer's demo under load: peer 2, behind when the others reached the last step, finished
    # alone on its own θ_global while the summary showed nothing amiss.
    from diloco_swarm.cli.demo import summarize

    def peer(i: int, last: str, adopted: str | None = None) -> Path:
        events = [{"event": "outer_step", "outer_step": 1, "round_ok": True, "theta_digest": "a" * 16, "eval_loss": 5.0},
                  {"event": "outer_step", "outer_step": 2, "round_ok": True, "theta_digest": last, "eval_loss": 4.0}]
        if adopted:  # a state adopted after the last outer step is what the peer holds
            events.append({"event": "state_sync", "outer_step": 3, "theta_digest": adopted})
        return _metrics(tmp_path / f"p{i}.jsonl", events)

    _, verdict = summarize([peer(0, "b" * 16), peer(1, "b" * 16), peer(2, "c" * 16, adopted="b" * 16)], [0, 0, 0])
    assert verdict == "demo: all 3 peers hold the same θ_global"
    table, verdict = summarize([peer(0, "b" * 16), peer(1, "b" * 16), peer(2, "c" * 16)], [0, 0, 0])
    assert "2 different θ_global" in verdict and verdict.startswith("demo: warning:")
    assert list(table.columns[2].cells) == ["2", "2", "2"] and list(table.columns[6].cells) == ["bbbbbbbb"] * 2 + ["cccccccc"]
