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

Tracebacks at exit, and other tracebacks of nothing wrong: diloco_swarm/utils/hivemind_logs.py.

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

import torch.multiprocessing
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging import averager as averager_module
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.utils import timed_storage

from diloco_swarm.utils import clock
from diloco_swarm.utils.hivemind_logs import quiet_hivemind_logs, reply_unless_cancelled
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
        DHT._run_coroutine = reply_unless_cancelled(run_coroutine)
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
    quiet_hivemind_logs()
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
