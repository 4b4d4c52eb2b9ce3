"""Workarounds for hivemind 1.1.12 bugs that bite a swarm node. Each can go once hivemind fixes it.

Pending tasks collected by the garbage collector. ``hivemind.DHT.run`` and
``DecentralizedAverager._run_internal`` start each request from the host process with
``asyncio.create_task(...)`` and drop the reference. asyncio keeps only weak references to
tasks, so a task awaiting a future that nothing else references can be collected mid-flight:
the DHT logs ``GeneratorExit`` / "Task was destroyed but it is pending!" and the host's call
(``get_visible_maddrs``, ``get``, ``store``, ``step``...) then waits forever. We saw it on a
loaded 2-core machine about once in five 3-node starts. :func:`keep_task_alive` wraps such a
coroutine method so that its task holds a strong reference to itself while it runs.

Orphans. The DHT and averager processes outlive a SIGKILLed parent; :func:`die_with_parent` makes
them follow it, SIGINT ignored (the node stops them), SIGTERM ending them.

The libp2p daemon. hivemind starts ``p2pd`` in the node's process group, so a terminal's Ctrl+C
killed it under the node, which then could not say goodbye and printed tracebacks.
:func:`_spawn_p2pd_apart` starts it in its own process group, dying with the process that started it.

Tracebacks at exit. A request from the node to its DHT or averager process carries the node's end
of a pipe (hivemind's ``MPFuture``), fetched from the node when the child reads the request. A
request still queued while the node exits cannot be read any more: the child's loop logs
``ConnectionResetError`` with a full traceback on the user's terminal, though nothing is wrong.
:class:`_QuietPipeErrors` turns exactly those into one debug line. The node's side of the same
fetch is Python's ``multiprocessing.resource_sharer`` thread, which hands the pipe's descriptor
over: a child killed mid-fetch (SIGTERM to the process group) made it print a
``ConnectionResetError`` traceback through ``sys.excepthook``; :func:`_quiet_fd_sharer_errors`
makes that one debug line too. A DHT call answered after its bounded caller gave up (dht/calls.py
cancels the cross-process future) made the DHT process log ``InvalidStateError ... CANCELLED`` twice
with tracebacks; :class:`_QuietCancelledReplies` and :func:`_reply_unless_cancelled` make it one
debug line. A peer that leaves mid-round drops the streams the others write to it, and hivemind
never collects the writer task's ``ConnectionResetError``: :class:`_QuietLeaverStreams` makes asyncio's
"Task exception was never retrieved" for it one debug line, and :class:`_QuietTornDonations` the
donor's traceback for a state download its own outer step tore (the joiner asks again).

Busy matchmaking. While a peer looks for a group and no leader is in sight (a lone peer, or the
first to arrive), hivemind's ``PotentialLeaders`` re-reads the group key from the DHT as soon as
the previous read returns: about 235 reads a second, which kept the averager and DHT processes at
~50% of a core each (one lone node: 104% of a core in all, for the whole averaging window).
:func:`_paced_get_averagers` spaces the reads of one key manager by :data:`MIN_GROUP_POLL_S`; a
leader that appears is seen at most that much later.

Torch's shared-memory manager. hivemind makes torch share memory by file name
(``set_sharing_strategy("file_system")`` in ``hivemind/utils/mpfuture.py``); torch then starts
``torch_shm_manager`` at the first shared tensor (a ``DHT``'s first ``MPFuture``), in the node's
process group. A terminal's Ctrl+C at that moment killed the manager, and the node's next shared
allocation failed ("Broken pipe") or, caught mid-request, waited on its socket for good in C code,
where no signal handler runs: a node that only SIGKILL could stop (a newcomer's run, Ctrl+C 4.5 s
into start-up). :func:`_start_shm_manager_sheltered` starts it while the stop signals are ignored,
which it keeps across ``exec``; it still exits with its last client.

Socket files. hivemind's libp2p daemon and each client of it listen on unix sockets named
``/tmp/hivemind-p2pd-*.sock`` and ``/tmp/hivemind-p2pclient-*.sock``; they are removed only when the
daemon is still running at shutdown, so every killed node, failed bootstrap or crashed child left
them behind. :func:`_own_socket_dir` puts them in one fresh directory per process,
``/tmp/diloco-p2p-<pid>-<random>``, removed at exit; a killed process's directory is removed by the
next process that loads these fixes once no running process holds its lock.

A served state kept alive. ``DecentralizedAverager`` answers a state download through
``_background_thread_fetch_current_state``, a thread of the host process whose loop keeps the last
state it served (the snapshot of θ_global and the momentum, 8 B/param) in its local variables while
it waits for the next request, i.e. for good: after its first donation a node held one more copy of
its state than its memory budget (tests/test_memory_budget.py). :func:`_serve_states` handles each
request in a call of its own, so nothing of a served state outlives the transfer.

A downloaded state kept alive. The averager process runs each request of the host in a loop whose
local variables keep the last request, its ``MPFuture`` included, until the next one arrives; and an
``MPFuture`` resolved outside the process that made it keeps its result there too. A joiner's
averager process thus held the state it had just downloaded (8 B/param, in shared memory) through
the node's whole first phase, until the node's first round (``python -m bench.memory``: 1.74 GB for
llama-150m, the joiner's peak). :func:`send_result` resolves such a future and drops its copy.

A clock that steps. hivemind's ``get_dht_time`` is the machine's clock, checked against the peers'
only at the bootstrap ping; :func:`_use_node_clock` points each module's reference to it at the
node's own clock, which never steps (utils/clock.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import fcntl
import functools
import logging
import atexit
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback

import torch.multiprocessing
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging import averager as averager_module
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.utils import timed_storage

from diloco_swarm.utils import clock
from diloco_swarm.utils.signals import STOP_SIGNALS

_live_tasks: set[asyncio.Task] = set()
# between two DHT reads of the group key by one averager; DILOCO_GROUP_POLL_S=0 restores hivemind's
# unpaced polling (bench/idle.py measures both)
def _poll_interval(default: float = 0.25) -> float:
    try:
        return max(0.0, float(os.environ.get("DILOCO_GROUP_POLL_S", default)))
    except ValueError:
        return default


MIN_GROUP_POLL_S = _poll_interval()


def keep_task_alive(method):
    """Decorate an ``async def`` that hivemind starts with a dropped ``create_task`` reference."""

    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        task = asyncio.current_task()
        if task is not None:
            _live_tasks.add(task)
        try:
            return await method(*args, **kwargs)
        finally:
            if task is not None:
                _live_tasks.discard(task)

    wrapper.__keeps_task_alive__ = True
    return wrapper


def die_with_parent() -> None:
    """In a forked child: get SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``).

    hivemind's DHT and averager processes ignore SIGINT/SIGTERM; without this, a SIGKILLed
    node (``kill -9``, the OOM killer) leaves them running as orphans that keep advertising a
    dead peer. No-op elsewhere.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _run_dying_with_parent(run):
    @functools.wraps(run)
    def wrapper(self, *args, **kwargs):
        die_with_parent()
        # The fork inherited the node's Ctrl+C handler (node/signals.py: StopFlag), which would swallow the
        # SIGTERM of hivemind's own "terminate it the hard way" and print a second "stopping" line.
        # The node stops its children itself; SIGTERM must end one.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the node stops us itself, cleanly
        return run(self, *args, **kwargs)

    wrapper.__dies_with_parent__ = True
    return wrapper


_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before any fork
    except (OSError, AttributeError):
        _prctl = None


def _p2pd_preexec() -> None:
    os.setpgid(0, 0)  # the terminal's Ctrl+C goes to the node's group, not to its daemon
    if _prctl is not None:
        _prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: no orphaned daemon after kill -9


def _spawn_p2pd_apart(create_subprocess_exec):
    @functools.wraps(create_subprocess_exec)
    async def wrapper(program, *args, **kwargs):
        if os.path.basename(str(program)) == "p2pd" and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _p2pd_preexec
        return await create_subprocess_exec(program, *args, **kwargs)

    wrapper.__spawns_p2pd_apart__ = True
    return wrapper


def _demoted(record: logging.LogRecord, message: str) -> bool:
    """``record`` made one debug line saying ``message`` (no traceback); whether the logger still shows it."""
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    record.msg, record.args, record.exc_info, record.exc_text = message, None, None, None
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class _QuietPipeErrors(logging.Filter):
    """Drop the traceback of a request that could not be read from the node's pipe (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.funcName in ("_run", "_run_internal") and isinstance(exc, (ConnectionError, EOFError)):
            return _demoted(record, f"a request from the parent process could not be read ({exc!r}); is it exiting?")
        return True


def _cancelled_reply(exc: BaseException | None) -> bool:
    """Whether ``exc`` is hivemind's refusal to answer a call whose caller gave up on it: our bounded
    DHT calls (dht/calls.py) cancel the cross-process future when their time is up, and the DHT process
    then cannot set the late result (``InvalidStateError: ... future that is CANCELLED``)."""
    return isinstance(exc, concurrent.futures.InvalidStateError) and "CANCELLED" in str(exc)


class _QuietCancelledReplies(logging.Filter):
    """Demote hivemind's traceback for a DHT call answered after its caller gave up (see
    :func:`_cancelled_reply`; a newcomer saw it in the first minute of a loaded 6-node run) to one
    debug line: the caller already reported its timeout."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.funcName == "_run_coroutine" and _cancelled_reply(exc):
            return _demoted(record, "a DHT call finished after its caller had given up on it (a bounded call timed out)")
        return True


def _reply_unless_cancelled(method):
    """Wrap ``DHT._run_coroutine``: its second attempt to answer (``set_exception``) raises the same
    refusal, which asyncio then printed as "Task exception was never retrieved"."""

    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except concurrent.futures.InvalidStateError as e:
            if not _cancelled_reply(e):
                raise

    wrapper.__replies_unless_cancelled__ = True
    return wrapper


class _QuietLeaverStreams(logging.Filter):
    """Demote asyncio's "Task exception was never retrieved" for hivemind's writer of a stream to a peer
    that left (``P2P._iterate_protobuf_stream_handler``'s ``_write_to_stream`` task, awaited only at a
    clean end of stream: a ``ConnectionResetError`` when the peer's connection dropped mid-round is
    never collected) to one debug line: the round's own line says which peer was lost. A newcomer saw
    the traceback on healthy nodes after 3 of 14 clean leaves of another peer."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = str(record.msg)
        if (text.startswith("Task exception was never retrieved") and isinstance(exc, ConnectionError)
                and "_iterate_protobuf_stream_handler.<locals>._write_to_stream" in text):
            return _demoted(record, f"a stream to a peer ended mid-write ({exc!r}): the peer left")
        return True


class _QuietTornDonations(logging.Filter):
    """Demote hivemind's "Handler failed with the exception:" traceback for a state donation our own outer
    step tore (averaging/donation.py's ``TornState``: the joiner is told, and asks again) to one debug
    line; a newcomer's demo printed it as a 16-line warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if str(record.msg).startswith("Handler failed with the exception") and type(exc).__name__ == "TornState":
            return _demoted(record, f"a state donation was torn by our outer step ({exc}); the joiner asks again")
        return True


class _QuietPartialResults(logging.Filter):
    """Demote the partition's "Averaging: received 99.9% results" to DEBUG: rounded, it can read
    "100.0%" for a partial round, and the node's own round line gives the exact count of values
    missing (averaging/averager.py: "partial round: N of M values missing")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName == "finalize" and str(record.msg).startswith("Averaging: received"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _QuietGroupSizeAdvice(logging.Filter):
    """Drop hivemind's "It is recommended to set target_group_size to a power of 2": the advice is for
    hivemind's own group-bit splitting, and our grid sets each group's bits itself
    (averaging/grouping.py), so any --target-group-size forms its groups (a newcomer read the line
    as a problem with 3)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("It is recommended to set target_group_size")


def _quiet_fd_sharer_errors(excepthook):
    """``sys.excepthook``, but a connection error raised in ``multiprocessing/resource_sharer.py``
    (a child that died while fetching a pipe's descriptor from this process) is one debug line."""

    @functools.wraps(excepthook)
    def hook(exc_type, exc, tb):
        frames = traceback.extract_tb(tb) if tb is not None else []
        if issubclass(exc_type, (ConnectionError, EOFError)) and any(
            f.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames
        ):
            logging.getLogger(__name__).debug(f"a child process left while fetching a descriptor: {exc!r}")
            return
        excepthook(exc_type, exc, tb)

    hook.__quiet_fd_sharer__ = True
    return hook


def _paced_get_averagers(get_averagers):
    """``GroupKeyManager.get_averagers``, at most once per :data:`MIN_GROUP_POLL_S` per key manager."""

    @functools.wraps(get_averagers)
    async def wrapper(self, *args, **kwargs):
        wait = getattr(self, "_last_group_poll", float("-inf")) + MIN_GROUP_POLL_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_group_poll = time.monotonic()
        return await get_averagers(self, *args, **kwargs)

    wrapper.__paced__ = True
    return wrapper


SOCKET_DIR_PREFIX = "diloco-p2p-"  # + the owner's pid, "-", a random suffix (tempfile.mkdtemp)
SOCKET_DIR_LOCK = ".owner.lock"  # flock-ed by the owner (and its forked children) while they run
MAX_SOCKET_PATH = 100  # bytes; sun_path holds 108 on Linux
STALE_UNLOCKED_S = 600.0  # a directory with no lock file yet is only removed this long after its creation


def _stale(path: str) -> bool:
    """Whether no running process holds ``path``'s lock: its owner and the owner's forked children
    hold it while they run, whatever PID namespace they are in (a pid check would not see that)."""
    try:
        fd = os.open(os.path.join(path, SOCKET_DIR_LOCK), os.O_RDONLY)
    except FileNotFoundError:  # an owner between mkdtemp and its lock, or not ours to judge
        try:
            return time.time() - os.lstat(path).st_mtime > STALE_UNLOCKED_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _sweep_socket_dirs(root: str) -> None:
    """Remove our uid's socket directories that no running process holds (killed: no atexit ran)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(SOCKET_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _stale(path):
            shutil.rmtree(path, ignore_errors=True)


_socket_dir: tuple[int, str, int] | None = None  # (owner pid, path, lock fd) once made


def _own_socket_dir() -> str | None:
    """This process's directory for hivemind's unix sockets, or None when it cannot be made or its
    paths would be too long for a unix socket (hivemind's default /tmp names then).

    ``tempfile.mkdtemp``: a fresh name, created 0700 by us alone, so nobody can prepare it in
    advance or share it (every container's node may be pid 1). Removed at exit."""
    global _socket_dir
    root = tempfile.gettempdir()
    if len(os.path.join(root, f"{SOCKET_DIR_PREFIX}{os.getpid()}-XXXXXXXX/hivemind-p2pclient-XXXXXXXXXXX.sock")) > MAX_SOCKET_PATH:
        return None
    _sweep_socket_dirs(root)
    try:
        path = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-", dir=root)
        # lock a file under another name, then rename it into place: a sweep by a process starting at the
        # same moment never finds the lock file free and removes our new directory (seen in CI)
        fresh = os.path.join(path, SOCKET_DIR_LOCK + ".new")
        fd = os.open(fresh, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # forked children share it (same open file); p2pd (exec) does not
        os.rename(fresh, os.path.join(path, SOCKET_DIR_LOCK))
    except OSError:
        return None
    _socket_dir = (os.getpid(), path, fd)
    atexit.register(remove_socket_dir)
    return path


def remove_socket_dir() -> None:
    """Remove this process's socket directory (idempotent). Call it before ``os._exit``, which skips
    atexit. Forked children (DHT, averager) inherit the directory; only the process that made it removes it."""
    if _socket_dir is not None and _socket_dir[0] == os.getpid():
        shutil.rmtree(_socket_dir[1], ignore_errors=True)


def _start_shm_manager_sheltered() -> None:
    """Start torch's shared-memory manager now, immune to the stop signals (see the module docstring).
    Only from the main thread (signal dispositions can be changed there only) and only for the
    "file_system" sharing strategy (the only one that uses the manager); a no-op once it runs."""
    if threading.current_thread() is not threading.main_thread():
        return
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        torch.empty(1).share_memory_()  # torch spawns the manager here, once per process; it inherits SIG_IGN
    except Exception as e:  # no shared memory here: hivemind will say so where it needs it
        logging.getLogger(__name__).debug(f"could not start torch's shared-memory manager early: {e!r}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def send_result(future, result) -> None:
    """``future.set_result(result)`` from the process that serves the request (the averager's), then
    drop the future's own reference to ``result`` there (module docstring): the caller's copy is the
    only one left. hivemind's ``MPFuture`` keeps its result in ``_result``; where that changes, this
    only keeps the reference."""
    future.set_result(result)
    if hasattr(future, "_result"):
        future._result = None


def _serve_one_state(serializer, future, get_current_state_ref) -> bool:
    """One state request, as hivemind serves it; every reference to the state ends with this call.
    :returns: False when the averager is gone (the thread ends)."""
    try:
        get_current_state = get_current_state_ref()
        if get_current_state is None:
            return False
        state = tuple(get_current_state())
        assert 0 < len(state) <= 3
        metadata, tensors, infos = state + (None,) * (3 - len(state))
        future.set_result((serializer.dumps(metadata),
                           tuple(t.cpu().detach().requires_grad_(t.requires_grad) for t in tensors), infos))
    except BaseException as e:
        future.set_exception(e)
        logging.getLogger("hivemind.averaging.averager").warning(e)
    return True


def _serve_states(serializer, pipe, get_current_state_ref) -> None:
    """``hivemind.averaging.averager._background_thread_fetch_current_state``, without keeping the last
    served state alive between requests (module docstring)."""
    while True:
        try:
            trigger, future = pipe.recv()
        except BaseException as e:
            logging.getLogger("hivemind.averaging.averager").debug(f"Averager background thread finished: {e!r}")
            break
        if trigger == "_SHUTDOWN":
            break
        assert trigger == "_TRIGGER_GET_CURRENT_STATE"
        if not _serve_one_state(serializer, future, get_current_state_ref):
            break
        del future


def _use_node_clock() -> None:
    """Point ``get_dht_time`` at :func:`clock.now` in hivemind's modules and in ours loaded so far
    (``from hivemind.utils import get_dht_time`` binds it at import; later imports get this one)."""
    wall = timed_storage.get_dht_time
    if wall is clock.now:
        return
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("hivemind", "diloco_swarm") and getattr(module, "get_dht_time", None) is wall:
            module.get_dht_time = clock.now


def patch_hivemind() -> None:
    """Apply the fixes to hivemind's classes (idempotent; must run before DHTs/averagers fork)."""
    _use_node_clock()
    run_coroutine = DHT.__dict__.get("_run_coroutine")
    if run_coroutine is not None and not getattr(run_coroutine, "__keeps_task_alive__", False) and not getattr(
        run_coroutine, "__replies_unless_cancelled__", False
    ):
        DHT._run_coroutine = _reply_unless_cancelled(run_coroutine)
    for cls, names in (
        (DHT, ("_run_coroutine", "_get", "_store")),
        (DecentralizedAverager, ("_step", "_load_state_from_peers", "_get_group_bits", "_set_group_bits",
                                 "_trigger_declare_load_state")),
    ):
        for name in names:
            method = cls.__dict__.get(name)
            if method is not None and asyncio.iscoroutinefunction(method) and not getattr(
                method, "__keeps_task_alive__", False
            ):
                setattr(cls, name, keep_task_alive(method))
        run = cls.__dict__.get("run")
        if run is not None and not getattr(run, "__dies_with_parent__", False):
            setattr(cls, "run", _run_dying_with_parent(run))
    averager_module._background_thread_fetch_current_state = _serve_states  # (read when an averager is built)
    if not getattr(GroupKeyManager.get_averagers, "__paced__", False):
        GroupKeyManager.get_averagers = _paced_get_averagers(GroupKeyManager.get_averagers)
    for name in ("hivemind.dht.dht", "hivemind.averaging.averager"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _QuietPipeErrors) for f in log.filters):
            log.addFilter(_QuietPipeErrors())
    dht_log = logging.getLogger("hivemind.dht.dht")
    if not any(isinstance(f, _QuietCancelledReplies) for f in dht_log.filters):
        dht_log.addFilter(_QuietCancelledReplies())
    if not getattr(sys.excepthook, "__quiet_fd_sharer__", False):
        sys.excepthook = _quiet_fd_sharer_errors(sys.excepthook)
    key_log = logging.getLogger("hivemind.averaging.key_manager")
    if not any(isinstance(f, _QuietGroupSizeAdvice) for f in key_log.filters):
        key_log.addFilter(_QuietGroupSizeAdvice())
    p2p_log = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(f, _QuietTornDonations) for f in p2p_log.filters):
        p2p_log.addFilter(_QuietTornDonations())
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietLeaverStreams) for f in asyncio_log.filters):
        asyncio_log.addFilter(_QuietLeaverStreams())
    partition_log = logging.getLogger("hivemind.averaging.partition")
    if not any(isinstance(f, _QuietPartialResults) for f in partition_log.filters):
        partition_log.addFilter(_QuietPartialResults())
    if not getattr(P2P, "__own_socket_dir__", False):
        socket_dir = _own_socket_dir()
        if socket_dir is not None:
            P2P._UNIX_SOCKET_PREFIX = f"/unix{socket_dir}/hivemind-"
        P2P.__own_socket_dir__ = True
    # hivemind.p2p.p2p_daemon calls asyncio.subprocess.create_subprocess_exec; only p2pd is affected
    if not getattr(asyncio.subprocess.create_subprocess_exec, "__spawns_p2pd_apart__", False):
        asyncio.subprocess.create_subprocess_exec = _spawn_p2pd_apart(asyncio.subprocess.create_subprocess_exec)
    _start_shm_manager_sheltered()


patch_hivemind()
