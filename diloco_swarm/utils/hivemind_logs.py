"""hivemind 1.1.12's tracebacks of nothing wrong, made one debug line each (hivemind_fixes.py installs
them with its other fixes; each can go once hivemind stops printing it).

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
with tracebacks; :class:`_QuietCancelledReplies` and :func:`reply_unless_cancelled` make it one
debug line. A peer that leaves mid-round drops the streams the others write to it, and hivemind
never collects the writer task's ``ConnectionResetError``: :class:`_QuietLeaverStreams` makes asyncio's
"Task exception was never retrieved" for it one debug line, and :class:`_QuietTornDonations` the
donor's traceback for a state download its own outer step tore (the joiner asks again).
:class:`_QuietDroppedHandlers` does the same for hivemind tasks asyncio collects pending on a closed
connection ("Task was destroyed but it is pending!").
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import sys
import traceback


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


def reply_unless_cancelled(method):
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


class _QuietDroppedHandlers(logging.Filter):
    """Demote what asyncio prints when it collects a hivemind task left pending on a closed connection
    (a peer that joined, left or was dialled for a check): "Task was destroyed but it is pending!" for the
    p2p daemon's stream handler (``ControlClient._handler``) or for ``amap_in_executor``'s feeder task, and
    the "cannot reuse already awaited coroutine" that the handler's connection callback then raises
    ("Unhandled exception in client_connected_cb"). One debug line each: nothing was lost (the round or the
    call that used the connection reports its own outcome). A newcomer saw them on healthy peers."""

    _TASKS = ("ControlClient._handler()", "amap_in_executor.<locals>._put_items()")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = str(record.msg)
        if text.startswith("Task was destroyed but it is pending!") and any(t in text for t in self._TASKS):
            return _demoted(record, "asyncio collected a hivemind task left pending on a closed connection")
        if (text.startswith("Unhandled exception in client_connected_cb") and isinstance(exc, RuntimeError)
                and "cannot reuse already awaited coroutine" in str(exc)):
            return _demoted(record, "a closed connection's handler was collected before its callback ran")
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


# logger -> the filters on it (a filter on a logger sees the records logged to that logger)
FILTERS = {
    "hivemind.dht.dht": (_QuietPipeErrors, _QuietCancelledReplies),
    "hivemind.averaging.averager": (_QuietPipeErrors,),
    "hivemind.averaging.key_manager": (_QuietGroupSizeAdvice,),
    "hivemind.averaging.partition": (_QuietPartialResults,),
    "hivemind.p2p.p2p_daemon": (_QuietTornDonations,),
    "asyncio": (_QuietLeaverStreams, _QuietDroppedHandlers),
}


def quiet_hivemind_logs() -> None:
    """Install the filters and the excepthook (idempotent; before the DHT and averager fork)."""
    for name, kinds in FILTERS.items():
        log = logging.getLogger(name)
        for kind in kinds:
            if not any(isinstance(f, kind) for f in log.filters):
                log.addFilter(kind())
    if not getattr(sys.excepthook, "__quiet_fd_sharer__", False):
        sys.excepthook = _quiet_fd_sharer_errors(sys.excepthook)
