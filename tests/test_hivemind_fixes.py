"""Workarounds for hivemind bugs (diloco_swarm.utils.hivemind_fixes): the log filter that keeps a child
process from printing a traceback when a request from an exiting node cannot be read, paced group
key reads, the partial-round percentage at DEBUG, and the daemon's socket files in one directory per process."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from diloco_swarm.utils import hivemind_fixes  # (importing it installs the fixes)
from diloco_swarm.utils.hivemind_fixes import SOCKET_DIR_PREFIX


def _log_from(func_name: str, logger_name: str, exc: BaseException, caplog) -> list[logging.LogRecord]:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, logging.ERROR, __file__, 1, exc, None,
                               (type(exc), exc, None), func=func_name)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=logger_name):
        logger.handle(record)
    return list(caplog.records)


@pytest.mark.parametrize("name,func", [("hivemind.dht.dht", "_run"), ("hivemind.averaging.averager", "_run_internal")])
def test_a_pipe_reset_in_the_request_loop_becomes_one_debug_line(caplog, name, func):
    records = _log_from(func, name, ConnectionResetError(104, "Connection reset by peer"), caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.DEBUG and records[0].exc_info is None
    assert "is it exiting?" in records[0].getMessage()


def test_other_errors_keep_their_traceback(caplog):
    records = _log_from("_run", "hivemind.dht.dht", RuntimeError("boom"), caplog)  # not a pipe error
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None
    records = _log_from("_store", "hivemind.dht.dht", ConnectionResetError(104, "x"), caplog)  # elsewhere
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None


def test_a_dht_call_answered_after_its_caller_gave_up_is_one_debug_line(caplog):
    # a newcomer's loaded 6-node run: two tracebacks ("Can't set_result to a future that is CANCELLED",
    # then "Task exception was never retrieved") for one bounded call that had timed out
    import asyncio
    from concurrent.futures import InvalidStateError

    from hivemind.dht import DHT

    gave_up = InvalidStateError("Can't set_result to a future that is CANCELLED (123)")
    records = _log_from("_run_coroutine", "hivemind.dht.dht", gave_up, caplog)
    assert len(records) == 1 and records[0].levelno == logging.DEBUG and records[0].exc_info is None
    records = _log_from("_run_coroutine", "hivemind.dht.dht", RuntimeError("boom"), caplog)
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None  # a real failure keeps it

    class Cancelled:
        def set_result(self, value):
            raise InvalidStateError("Can't set_result to a future that is CANCELLED (123)")

        set_exception = set_result

    async def coro(dht, node):
        return 1

    from types import SimpleNamespace

    dht = SimpleNamespace(_node=None)  # (all _run_coroutine reads of its DHT)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="hivemind.dht.dht"):
        assert asyncio.run(DHT._run_coroutine(dht, coro, Cancelled())) is None  # no exception left in the task
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_partial_rounds_rounded_percentage_is_demoted_to_debug(caplog):
    """hivemind's "received 100.0% results" for a round with a few values missing would contradict the
    node's own exact line; it stays visible at DEBUG."""
    import asyncio

    import torch
    from hivemind.averaging.partition import TensorPartContainer

    async def finalize_partial():
        container = TensorPartContainer([torch.zeros(10_000)], peer_fractions=[0.5, 0.5])
        container.failed_size = 3  # what a reducer lost
        container.finalize()

    with caplog.at_level(logging.DEBUG, logger="hivemind.averaging.partition"):
        asyncio.run(finalize_partial())
    records = [r for r in caplog.records if "received" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.DEBUG, "Averaging: received 100.0% results")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hivemind.averaging.partition"):
        asyncio.run(finalize_partial())
    assert not [r for r in caplog.records if "received" in r.getMessage()]


_FD_SHARER_RESET = r"""
import os, socket, struct, sys, time
from multiprocessing import resource_sharer
from multiprocessing.connection import Client
if sys.argv[1] == "fixed":
    import diloco_swarm.utils.hivemind_fixes  # noqa: F401  (installs the hook)
r, w = os.pipe()
resource_sharer.DupFd(r)  # what pickling a pipe's end for a child does: starts the sharer's thread
address = resource_sharer._resource_sharer._address
# a child that dies mid-fetch: it authenticates like a real client, then resets the connection
conn = Client(address, authkey=__import__("multiprocessing").current_process().authkey)
s = socket.socket(fileno=os.dup(conn.fileno()))
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
s.close(); conn.close()
time.sleep(1.0)
print("done", flush=True)
"""


@pytest.mark.parametrize("fixed", [False, True])
def test_a_child_dying_while_it_fetches_a_descriptor_prints_no_traceback(fixed):
    """The node's ``multiprocessing.resource_sharer`` thread hands a pipe's descriptor to the child that
    reads a request; a child killed mid-fetch (SIGTERM to the process group) made it print a
    ConnectionResetError traceback on the user's terminal. The unfixed run shows the test can fail."""
    out = subprocess.run([sys.executable, "-c", _FD_SHARER_RESET, "fixed" if fixed else "plain"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    if fixed:
        assert "Traceback" not in out.stderr, out.stderr
    else:
        assert "Traceback" in out.stderr and "resource_sharer" in out.stderr, out.stderr


def test_group_key_reads_are_paced():
    """hivemind re-reads the group key as soon as the last read returns; ours waits MIN_GROUP_POLL_S."""
    import asyncio
    import time

    from hivemind.averaging.key_manager import GroupKeyManager

    from diloco_swarm.utils.hivemind_fixes import MIN_GROUP_POLL_S

    assert getattr(GroupKeyManager.get_averagers, "__paced__", False)
    calls = []

    class FakeDHT:  # the real get_averagers reads the key through dht.get: count when it does
        async def get(self, *args, **kwargs):
            calls.append(time.monotonic())
            return None

    manager = GroupKeyManager.__new__(GroupKeyManager)
    manager.dht = FakeDHT()

    async def poll():
        for _ in range(4):
            assert await manager.get_averagers("run.0b", only_active=True) == []

    asyncio.run(poll())
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 4 and min(gaps) >= MIN_GROUP_POLL_S - 0.02, gaps



_SOCKET_CHILD = """
import os, sys, time
from diloco_swarm.dht.swarm import start_dht
from diloco_swarm.utils import hivemind_fixes
dht = start_dht(initial_peers=[], host="127.0.0.1", port=0)
print(hivemind_fixes._socket_dir[1], flush=True)
print(sorted(os.listdir(hivemind_fixes._socket_dir[1])), flush=True)
if sys.argv[1] == "hang":
    time.sleep(600)
dht.shutdown()
"""


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="ds-", dir="/tmp"))  # short: a unix socket path is ≤ 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(120)
def test_the_daemons_socket_files_leave_with_the_node(short_tmp):
    """hivemind's unix sockets live in one fresh directory per process: gone after a clean exit, and
    after a SIGKILL at the next start of a diloco process (hivemind left them in /tmp for good); a
    directory whose owner runs is never swept."""
    env = {**os.environ, "TMPDIR": str(short_tmp)}

    def child(mode):
        return subprocess.Popen([sys.executable, "-c", _SOCKET_CHILD, mode], env=env, text=True,
                                stdout=subprocess.PIPE)

    clean = child("exit")
    out, _ = clean.communicate(timeout=90)
    path, listing = out.splitlines()[:2]
    assert clean.returncode == 0 and "hivemind-p2pd-" in listing, out
    assert Path(path).parent == short_tmp and Path(path).name.startswith(f"{SOCKET_DIR_PREFIX}{clean.pid}-")
    assert not Path(path).exists()

    killed, running = child("hang"), child("hang")
    try:
        left = Path(killed.stdout.readline().strip())
        assert "hivemind-p2pd-" in killed.stdout.readline()
        live = Path(running.stdout.readline().strip())
        assert "hivemind-p2pd-" in running.stdout.readline()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert left.is_dir()  # nothing could remove it
        deadline = time.monotonic() + 20  # its DHT process dies with it (PR_SET_PDEATHSIG), freeing the lock
        while not hivemind_fixes._stale(str(left)) and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run([sys.executable, "-c", "import diloco_swarm.dht.swarm"], env=env, check=True, timeout=60)
        assert not left.exists()
        assert live.is_dir() and any(live.glob("hivemind-p2pd-*.sock")), "a running node's directory was swept"
    finally:
        for proc in (killed, running):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
    assert not list(short_tmp.glob("hivemind-*")), "no socket file outside the per-process directories"


SHM_CHILD = r"""
import os, signal, subprocess, sys, time
import torch
import diloco_swarm.dht.swarm  # loads the fixes, which start torch's shared-memory manager
manager = subprocess.run(["pgrep", "-P", str(os.getpid()), "-x", "torch_shm_manag"], capture_output=True,
                         text=True).stdout.split()
assert len(manager) == 1, manager
print("handler", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
os.kill(int(manager[0]), signal.SIGINT)  # what a terminal's Ctrl+C sends to the whole process group
time.sleep(0.5)
torch.empty(1000).share_memory_()  # with the manager dead: RuntimeError (broken pipe), or a wait for good
print("shared after SIGINT", flush=True)
"""


@pytest.mark.timeout(120)
def test_torchs_shared_memory_manager_survives_a_ctrl_c_to_the_group():
    """hivemind makes torch share memory through torch_shm_manager, in the node's process group: a
    Ctrl+C killed it and the node's next shared tensor (a DHT starting) failed or hung for good. The fixes
    start it with the stop signals ignored, and leave the node's own handler as it was."""
    # a shell's background job inherits SIGINT ignored: give the child Python's usual handler to keep
    out = subprocess.run([sys.executable, "-c", SHM_CHILD], capture_output=True, text=True, timeout=90,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "handler True" in out.stdout and "shared after SIGINT" in out.stdout, out.stdout


def _unretrieved_writer_failure(exc: BaseException) -> None:
    """A task named as hivemind's stream writer (``P2P._iterate_protobuf_stream_handler``'s
    ``_write_to_stream``) fails with ``exc`` and is dropped unawaited: asyncio logs it when collected."""
    import asyncio
    import gc

    class P2P:
        async def _iterate_protobuf_stream_handler(self):
            async def _write_to_stream():
                raise exc

            task = asyncio.create_task(_write_to_stream())
            await asyncio.sleep(0.01)
            del task  # the reader ended without awaiting the writer (a peer's connection dropped)

    asyncio.run(P2P()._iterate_protobuf_stream_handler())
    gc.collect()


def test_a_stream_writer_to_a_peer_that_left_is_one_debug_line(caplog):
    """After another peer's clean leave, healthy nodes printed asyncio's "Task exception was never
    retrieved" with a ConnectionResetError traceback from hivemind's stream writer."""
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        _unretrieved_writer_failure(ConnectionResetError("Connection lost"))
    records = [r for r in caplog.records if r.name == "asyncio" and "Using selector" not in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.DEBUG, None)], records
    assert "the peer left" in records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        _unretrieved_writer_failure(RuntimeError("a real bug"))  # anything else keeps its traceback
    assert [r.levelno for r in caplog.records if r.name == "asyncio" and "Using selector" not in r.getMessage()] == [
        logging.ERROR]


def _dropped_pending_handler() -> None:
    """A task named as the p2p daemon's stream handler (``ControlClient._handler``) still waits when its
    loop ends and nothing refers to it: asyncio logs "Task was destroyed but it is pending!" when collected."""
    import asyncio
    import gc

    class ControlClient:
        async def _handler(self):
            await asyncio.get_running_loop().create_future()  # the connection closed: never answered

    async def main():
        asyncio.create_task(ControlClient()._handler())
        await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    gc.collect()


def test_a_hivemind_handler_collected_pending_on_a_closed_connection_is_one_debug_line(caplog):
    """A newcomer saw "Task was destroyed but it is pending!" for hivemind's ``ControlClient._handler`` and then
    "Unhandled exception in client_connected_cb ... cannot reuse already awaited coroutine" on healthy peers."""
    import asyncio

    def shown(records):
        return [(r.levelno, r.exc_info) for r in records if r.name == "asyncio" and "Using selector" not in r.getMessage()]

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        _dropped_pending_handler()
        loop = asyncio.new_event_loop()
        loop.call_exception_handler({"message": "Unhandled exception in client_connected_cb", "transport": None,
                                     "exception": RuntimeError("cannot reuse already awaited coroutine")})
    assert shown(caplog.records) == [(logging.DEBUG, None)] * 2, caplog.records
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):  # anything else keeps its traceback
        loop.call_exception_handler({"message": "Unhandled exception in client_connected_cb", "transport": None,
                                     "exception": RuntimeError("a real bug")})
        loop.close()
    assert [level for level, _ in shown(caplog.records)] == [logging.ERROR]


def test_a_donation_torn_by_the_donors_outer_step_is_one_debug_line(caplog):
    """hivemind's handler logs a failed state stream as a warning with its traceback (p2p_daemon.py:
    "Handler failed with the exception:"); a donation our own outer step tore is routine (the joiner
    tries the next donor), and says so in one line on each side."""
    from diloco_swarm.averaging.donation import TornState
    from diloco_swarm.node.statesync import _download_problem

    log = logging.getLogger("hivemind.p2p.p2p_daemon")
    torn = TornState("this peer's θ_global changed while its state streamed; ask again")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        try:
            raise torn
        except TornState:
            log.warning("Handler failed with the exception:", exc_info=True)
        try:
            raise RuntimeError("a real bug")
        except RuntimeError:
            log.warning("Handler failed with the exception:", exc_info=True)
    assert [(r.levelno, r.exc_info is None) for r in caplog.records] == [(logging.DEBUG, True), (logging.WARNING, False)]
    assert "the joiner asks again" in caplog.records[0].getMessage()
    assert "trying the next donor" in _download_problem(RuntimeError(f"at QmDonor: {torn}"))
