"""`diloco-node join` with bad input: one clear `error:` line on stderr, exit code 2, no traceback,
nothing saved lost. Every case runs the real command (`python -m diloco_swarm`) as a subprocess.

The single-shot cases start together (module fixture) so their ~5 s imports overlap; each test
then checks its own process.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

NODE = [sys.executable, "-m", "diloco_swarm", "join"]
SMALL = ["--max-dataset-bytes", "100000", "--threads", "1", "--seq-len", "32", "--batch-size", "2"]
BOGUS_PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK"
# fp32 on the wire: the codec is not under test here
FAST = ["--compression", "fp32"]
CORRUPT_BYTES = b"PK\x03\x04 this was a checkpoint until the disk hiccuped" * 20


def error_line(proc_stderr: str, returncode: int, stdout: str = "") -> str:
    """Check the contract and return the one `error:` line."""
    assert returncode == 2, f"exit code {returncode}; stderr:\n{proc_stderr}"
    assert "Traceback" not in proc_stderr + stdout, proc_stderr
    lines = [line for line in proc_stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got:\n{proc_stderr}"
    # hivemind may log a warning of its own; nothing else may reach the user
    others = [line for line in lines if line not in errors and "WARN" not in line]
    assert not others, f"unexpected stderr lines:\n{proc_stderr}"
    return errors[0]


# --- single-shot cases, started in parallel ---------------------------------------------


def _cases(root, busy_port):
    """name -> (extra args, fragments the error line must contain)."""
    (root / "empty-folder").mkdir()
    (root / "a-file").write_text("not a directory")
    corrupt_dir = root / "state-corrupt"
    corrupt_dir.mkdir()
    (corrupt_dir / "checkpoint.pt").write_bytes(CORRUPT_BYTES)
    bad_identity = root / "state-bad-identity"
    bad_identity.mkdir()
    (bad_identity / "identity.key").write_bytes(b"garbage\n")
    return {
        "peers-garbage": (["--initial-peers", "garbage"], ["--initial-peers", "'garbage'", "not a multiaddr"]),
        "peers-no-p2p": (["--initial-peers", "/ip4/127.0.0.1/tcp/1"], ["'/ip4/127.0.0.1/tcp/1'", "/p2p/"]),
        "peers-unreachable": (["--initial-peers", BOGUS_PEER], ["none of the --initial-peers answered", BOGUS_PEER]),
        # a program listens at the address, but no peer with that id answers there: say so (a mistyped id)
        "peers-wrong-id": (["--initial-peers", BOGUS_PEER.replace("/tcp/1/", f"/tcp/{busy_port}/")],
                           ["none of the --initial-peers answered", f"connections at 127.0.0.1:{busy_port}",
                            "peer id after /p2p/"]),
        "dataset-missing": (["--dataset", str(root / "no-such-dir")], [str(root / "no-such-dir"), "does not exist"]),
        "dataset-empty": (["--dataset", str(root / "empty-folder")], [str(root / "empty-folder"), "no files"]),
        "port-busy": (["--host", "127.0.0.1", "--port", str(busy_port)], [f"port {busy_port}", "already in use"]),
        "host-not-an-ip": (["--host", "999.1.1.1"], ["--host", "'999.1.1.1'", "not an IP address"]),
        "host-not-local": (["--host", "192.0.2.1"], ["cannot listen on 192.0.2.1"]),  # TEST-NET-1: nobody's
        "checkpoint-corrupt": (
            ["--state-dir", str(corrupt_dir)],
            [str(corrupt_dir / "checkpoint.pt"), "corrupt", "start fresh"],
        ),
        "identity-corrupt": (["--state-dir", str(bad_identity)],
                             [str(bad_identity / "identity.key"), "not a libp2p private key", "move it away"]),
        "state-dir-under-a-file": (["--state-dir", str(root / "a-file" / "state")],
                                   [str(root / "a-file" / "state"), "is not writable", "--state-dir"]),
        # the kernel refuses new files in /proc even to root: a state dir that exists but is read-only
        "state-dir-read-only": (["--state-dir", "/proc/self"], ["state dir /proc/self is not writable"]),
        "model-unknown": (["--model", "huge"], ["--model", "huge", "tiny"]),
        "inner-steps-0": (["--inner-steps", "0"], ["--inner-steps", "1"]),
        "run-id-bad": (["--run-id", "bad id!"], ["--run-id", "'bad id!'", "letters, digits"]),
        # [brackets] in user input must reach the user verbatim, not be eaten as rich markup
        "run-id-brackets": (["--run-id", "run[b]x[/]"], ["'run[b]x[/]'"]),
        "inner-lr-negative": (["--inner-lr", "-0.1"], ["--inner-lr"]),
        "option-unknown": (["--inner-step", "5"], ["--inner-step"]),
        # terabytes of batches: numpy's allocation error, said in one line with the flags to lower
        "batch-size-beyond-memory": (["--batch-size", "100000000000"],
                                     ["Unable to allocate", "lower --batch-size (100000000000)"]),
    }


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-errors")
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = _cases(root, busy.getsockname()[1])
    procs = {}
    try:
        for name, (args, _) in cases.items():
            state_args = [] if "--state-dir" in args else ["--state-dir", str(root / f"state-{name}")]
            procs[name] = subprocess.Popen(
                [*NODE, *SMALL, *FAST, *state_args, *args],
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        results = {}

        def result(name):
            if name not in results:
                try:
                    out, err = procs[name].communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(procs[name].pid, signal.SIGKILL)
                    out, err = procs[name].communicate()
                    pytest.fail(f"{name}: diloco-node did not exit within 120 s; stderr:\n{err}")
                results[name] = (procs[name].returncode, out, err)
            return results[name]

        yield root, cases, result
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        busy.close()


CASE_NAMES = [
    "peers-garbage",
    "peers-no-p2p",
    "peers-unreachable",
    "dataset-missing",
    "dataset-empty",
    "port-busy",
    "host-not-an-ip",
    "host-not-local",
    "checkpoint-corrupt",
    "identity-corrupt",
    "state-dir-under-a-file",
    "state-dir-read-only",
    "model-unknown",
    "inner-steps-0",
    "run-id-bad",
    "run-id-brackets",
    "inner-lr-negative",
    "option-unknown",
    "peers-wrong-id",
    "batch-size-beyond-memory",
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_gives_one_clear_line_and_exit_2(error_runs, name):
    root, cases, result = error_runs
    returncode, out, err = result(name)
    line = error_line(err, returncode, out)
    for fragment in cases[name][1]:
        assert fragment in line, f"{fragment!r} missing from: {line}"
    assert len(line) < 400


@pytest.mark.timeout(150)
def test_corrupt_checkpoint_is_left_untouched(error_runs):
    root, _, result = error_runs
    result("checkpoint-corrupt")
    state_dir = root / "state-corrupt"
    assert (state_dir / "checkpoint.pt").read_bytes() == CORRUPT_BYTES
    assert not (state_dir / "checkpoint.prev.pt").exists()
    assert not [p for p in os.listdir(state_dir) if p.endswith(".tmp")]


def test_every_case_is_tested(tmp_path):
    assert sorted(_cases(tmp_path, 1)) == sorted(CASE_NAMES)


# --- a second node with another run spec, and a graceful stop ------------------------------


def _start_node(tmp_path, name, run_id, *extra):
    metrics = tmp_path / f"{name}.jsonl"
    log = open(tmp_path / f"{name}.stderr", "w")
    proc = subprocess.Popen(
        [*NODE, "--host", "127.0.0.1", "--port", "0", "--run-id", run_id, *SMALL,
         "--state-dir", str(tmp_path / f"state-{name}"), "--metrics-file", str(metrics), *extra],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    log.close()
    return proc, metrics


def _wait_for_start(proc, metrics, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the first node exited early with {proc.returncode}")
        if metrics.exists():
            first = metrics.read_text().split("\n", 1)[0]
            if first.endswith("}"):
                record = json.loads(first)
                assert record["event"] == "start" and record["maddrs"]
                return record
        time.sleep(0.2)
    pytest.fail(f"the first node wrote no start record within {timeout} s")


@pytest.fixture(scope="module")
def first_node(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("first-node")
    run_id = f"spec-{uuid.uuid4().hex[:8]}"
    proc, metrics = _start_node(tmp_path, "a", run_id, "--inner-steps", "5", *FAST)
    try:
        yield proc, _wait_for_start(proc, metrics), run_id, tmp_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_joining_with_another_run_spec_names_the_differing_fields(first_node, tmp_path):
    _, start, run_id, _ = first_node
    proc = subprocess.run(
        [*NODE, "--max-dataset-bytes", "100000", "--threads", "1", "--seq-len", "48", "--batch-size", "2",
         "--inner-steps", "7",
         "--host", "127.0.0.1", "--port", "0", "--run-id", run_id,
         "--initial-peers", start["maddrs"][0], "--state-dir", str(tmp_path / "state-b"), *FAST],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    line = error_line(proc.stderr, proc.returncode, proc.stdout)
    assert f"'{run_id}'" in line
    assert "inner_steps: ours=7 swarm=5" in line
    assert "seq_len: ours=48 swarm=32" in line
    assert "inner_lr" not in line and "model" not in line  # only the fields that differ
    assert "--run-id" in line  # what to do next
    assert not (tmp_path / "state-b" / "checkpoint.pt").exists()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_the_printed_join_line_joins_the_run(first_node, tmp_path):
    """The node's "to join from ..." line carries the run-spec flags that differ from
    the defaults: pasted as printed (plus local flags), it joins instead of failing the spec check."""
    import shlex

    _, start, run_id, first_dir = first_node
    # it listens on 127.0.0.1 only, so the line says "from this machine"
    line = next(x for x in (first_dir / "a.stderr").read_text().splitlines() if "to join from this machine:" in x)
    command = shlex.split(line.split("to join from this machine:", 1)[1])
    assert command[:2] == ["diloco-node", "join"] and run_id in command, command
    assert {"--inner-steps", "--seq-len", "--compression"} <= set(command), command  # first_node's non-defaults
    assert "--batch-size" not in command and "--threads" not in command  # local flags stay out
    metrics = tmp_path / "joiner.jsonl"
    proc = subprocess.Popen([*NODE, *command[2:], "--host", "127.0.0.1", "--port", "0", "--threads", "1",
                             "--max-dataset-bytes", "100000", "--batch-size", "2",
                             "--state-dir", str(tmp_path / "state-j"), "--metrics-file", str(metrics)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and '"event": "start"' not in (
                metrics.read_text() if metrics.exists() else ""):
            time.sleep(0.3)
        assert proc.poll() is None, f"the joiner exited with {proc.returncode}: {proc.stderr.read()[-2000:]}"
        assert '"event": "start"' in metrics.read_text()  # past the run-spec check
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_a_wrong_run_id_is_not_reported_as_nat(first_node, tmp_path):
    """Joining a live peer with another --run-id: the peers answered but are not in our run. The node
    says so in one line naming its run, and warns that it sees no peer of its run, instead of blaming
    a home router."""
    _, start, run_id, _ = first_node
    other = f"{run_id}-typo"
    metrics = tmp_path / "wrong-run.jsonl"
    proc = subprocess.Popen([*NODE, *SMALL, "--host", "127.0.0.1", "--port", "0", "--run-id", other,
                             "--initial-peers", start["maddrs"][0], "--state-dir", str(tmp_path / "state-w"),
                             "--metrics-file", str(metrics), *FAST],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and '"event": "eval"' not in (
                metrics.read_text() if metrics.exists() else ""):
            time.sleep(0.3)
        assert proc.poll() is None, f"the node exited with {proc.returncode}"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert f"the --initial-peers answered but are not in run '{other}': check --run-id" in err, err[-2000:]
    assert f"sees no other peer of run '{other}'" in err, err[-2000:]
    assert "--client-mode" not in err and "home router" not in err, err[-2000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    assert [r["reachable"] for r in records if r.get("event") == "reachability"] == [None]


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_sigint_stops_a_running_node_cleanly_within_15_s(first_node):
    proc, _, _, tmp_path = first_node
    proc.send_signal(signal.SIGINT)
    try:
        returncode = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the node, its DHT/averager processes, p2pd
        proc.wait(timeout=30)
        pytest.fail("the node ignored SIGINT for 15 s")
    assert returncode == 0
    stderr = (tmp_path / "a.stderr").read_text()
    assert "Traceback" not in stderr, stderr
    events = [json.loads(line)["event"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert events[-1] == "stop"
