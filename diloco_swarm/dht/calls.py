"""Time-bounded calls from the main process into its hivemind child processes (DHT, averager).

A plain ``hivemind.DHT.get`` sends a request down a pipe and waits for the child's answer with no
time limit: if the DHT process died (a SIGTERM to the node's process group, the OOM killer, a
crashed ``p2pd``), the caller waits forever. Every call from the main process goes through
:func:`bounded` instead: hivemind's ``return_future=True`` and ``MPFuture.result(timeout=...)``,
with a liveness check first, so a dead child fails at once and a stuck one within the bound.

    value = dht_get(dht, key, latest=True)                  # raises ChildUnavailable
    dht_store(dht, key, value, expiration_time=t, subkey=s)  # -> bool
    dht_run(dht, coroutine, timeout=30)                     # DHT.run_coroutine, bounded
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from functools import partial
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DHT_CALL_TIMEOUT_S = 10.0  # one DHT get/store: a few network round trips, or a busy 2-core machine
POLL_S = 0.25  # how often a long wait looks at its stop event


class ChildUnavailable(RuntimeError):
    """A hivemind child process (DHT or averager) is gone, or did not answer within the time bound."""


class ChildGone(ChildUnavailable):
    """The child process is not alive (it died, or was never started)."""


def bounded(child: Any, what: str, start: Callable[[], Any], timeout: float,
            stop: threading.Event | None = None) -> Any:
    """Run ``start()`` (which returns a hivemind ``MPFuture``) and wait for its result at most ``timeout`` s.

    :param child: the ``multiprocessing.Process`` (``hivemind.DHT``, an averager) that answers the call.
    :param what: names the call in the error, e.g. ``"DHT get of 'run_spec'"``.
    :param stop: when set while waiting, give up at once (raises ChildUnavailable "stopping").
    :raises ChildGone: the child is not alive, or died while we waited.
    :raises ChildUnavailable: it did not answer within ``timeout``, or ``stop`` was set. Errors the
        call itself raised in the child propagate as they are.
    """
    if not _alive(child):
        raise ChildGone(f"{what}: the {_name(child)} process is gone")
    try:
        future = start()
    except (BrokenPipeError, ConnectionError, EOFError, OSError) as e:
        raise ChildGone(f"{what}: the {_name(child)} process is gone ({type(e).__name__})") from None
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except (TimeoutError, concurrent.futures.TimeoutError):
            pass
        if not _alive(child):
            _cancel(future)
            raise ChildGone(f"{what}: the {_name(child)} process died while we waited")
        if stop is not None and stop.is_set():
            reason = "stopping"
        elif time.monotonic() >= deadline:
            reason = f"no answer within {timeout:g}s"
        else:
            continue
        _cancel(future)
        raise ChildUnavailable(f"{what}: {reason}")


def dht_get(dht, key: str, *, latest: bool = True, timeout: float = DHT_CALL_TIMEOUT_S,
            stop: threading.Event | None = None):
    """``hivemind.DHT.get(key, latest)``, bounded. :raises ChildUnavailable: see :func:`bounded`."""
    return bounded(dht, f"DHT get of {key!r}", partial(dht.get, key, latest=latest, return_future=True),
                   timeout, stop)


def dht_store(dht, key: str, value: Any, *, expiration_time: float, subkey: Any = None,
              timeout: float = DHT_CALL_TIMEOUT_S, stop: threading.Event | None = None) -> bool:
    """``hivemind.DHT.store(...)``, bounded. :returns: whether the DHT accepted the value.
    :raises ChildUnavailable: see :func:`bounded`."""
    return bool(bounded(dht, f"DHT store of {key!r}",
                        partial(dht.store, key, value, expiration_time=expiration_time, subkey=subkey,
                                return_future=True), timeout, stop))


def dht_run(dht, coroutine: Callable, *, timeout: float, what: str = "DHT call",
            stop: threading.Event | None = None) -> Any:
    """``hivemind.DHT.run_coroutine(coroutine)``, bounded (the coroutine is cancelled on timeout).
    :raises ChildUnavailable: see :func:`bounded`."""
    return bounded(dht, what, partial(dht.run_coroutine, coroutine, return_future=True), timeout, stop)


def dht_visible_maddrs(dht, *, timeout: float = DHT_CALL_TIMEOUT_S) -> list:
    """``hivemind.DHT.get_visible_maddrs(latest=True)``, bounded. :raises ChildUnavailable."""
    from hivemind import DHT  # the light client and the dashboard import this module without hivemind

    return dht_run(dht, partial(DHT._get_visible_maddrs, latest=True), timeout=timeout,
                   what="DHT visible addresses")


def _alive(child: Any) -> bool:
    try:
        return bool(child.is_alive())
    except Exception:  # not started, or asked from a process that is not its parent
        return False


def _name(child: Any) -> str:
    return "DHT" if type(child).__name__ == "DHT" else "averager"


def _cancel(future: Any) -> None:
    try:
        future.cancel()
    except Exception:
        pass
