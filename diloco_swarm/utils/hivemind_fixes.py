"""Workarounds for hivemind 1.1.12 bugs that bite a swarm node. Each can go once hivemind fixes it.

Pending tasks collected by the garbage collector. ``hivemind.DHT.run`` and
``DecentralizedAverager._run_internal`` start each request from the host process with
``asyncio.create_task(...)`` and drop the reference. asyncio keeps only weak references to
tasks, so a task awaiting a future that nothing else references can be collected mid-flight:
the DHT logs ``GeneratorExit`` / "Task was destroyed but it is pending!" and the host's call
(``get_visible_maddrs``, ``get``, ``store``, ``step``...) then waits forever. We saw it on a
loaded 2-core machine about once in five 3-node starts. :func:`keep_task_alive` wraps such a
coroutine method so that its task holds a strong reference to itself while it runs.

Orphans. The DHT and averager processes outlive a SIGKILLed parent; :func:`die_with_parent`
makes them follow it. They also drop the node's inherited Ctrl+C handler: SIGINT is ignored
(the node stops them), SIGTERM ends them.

The libp2p daemon. hivemind starts ``p2pd`` in the node's process group, so a terminal's Ctrl+C
killed it under the node, which then could not say goodbye and printed tracebacks.
:func:`_spawn_p2pd_apart` starts it in its own process group, dying with the process that started it.

Tracebacks at exit. A request from the node to its DHT or averager process carries the node's end
of a pipe (hivemind's ``MPFuture``), fetched from the node when the child reads the request. A
request still queued while the node exits cannot be read any more: the child's loop logs
``ConnectionResetError`` with a full traceback on the user's terminal, though nothing is wrong.
:class:`_QuietPipeErrors` turns exactly those into one debug line.

Busy matchmaking. While a peer looks for a group and no leader is in sight (a lone peer, or the
first to arrive), hivemind's ``PotentialLeaders`` re-reads the group key from the DHT as soon as
the previous read returns: about 235 reads a second, which kept the averager and DHT processes at
~50% of a core each (one lone node: 104% of a core in all, for the whole averaging window).
:func:`_paced_get_averagers` spaces the reads of one key manager by :data:`MIN_GROUP_POLL_S`; a
leader that appears is seen at most that much later.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import signal
import sys
import time

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
        # The fork inherited the node's Ctrl+C handler (runner.StopFlag), which would swallow the
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


class _QuietPipeErrors(logging.Filter):
    """Drop the traceback of a request that could not be read from the node's pipe (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.funcName in ("_run", "_run_internal") and isinstance(exc, (ConnectionError, EOFError)):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg, record.args, record.exc_info, record.exc_text = (
                f"a request from the parent process could not be read ({exc!r}); is it exiting?", None, None, None)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


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


def patch_hivemind() -> None:
    """Apply the fixes to hivemind's classes (idempotent; must run before DHTs/averagers fork)."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.dht import DHT

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
    from hivemind.averaging.key_manager import GroupKeyManager

    if not getattr(GroupKeyManager.get_averagers, "__paced__", False):
        GroupKeyManager.get_averagers = _paced_get_averagers(GroupKeyManager.get_averagers)
    for name in ("hivemind.dht.dht", "hivemind.averaging.averager"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _QuietPipeErrors) for f in log.filters):
            log.addFilter(_QuietPipeErrors())
    # hivemind.p2p.p2p_daemon calls asyncio.subprocess.create_subprocess_exec; only p2pd is affected
    if not getattr(asyncio.subprocess.create_subprocess_exec, "__spawns_p2pd_apart__", False):
        asyncio.subprocess.create_subprocess_exec = _spawn_p2pd_apart(asyncio.subprocess.create_subprocess_exec)


patch_hivemind()
