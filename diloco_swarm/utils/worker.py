"""A single daemon thread that runs submitted calls in order.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so one call stuck
in a dead child process (the DHT, the averager) would keep the node from exiting. This worker's
thread is a daemon: the process ends when the main thread does, whatever the worker is doing.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class Worker:
    """Runs ``submit``-ted calls one after another on one daemon thread named ``name``."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; its result or exception arrives in the returned future.
        :raises RuntimeError: the worker was closed."""
        if self._closed:
            raise RuntimeError("the worker is closed")
        future: Future = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def close(self) -> None:
        """Run no more calls after the ones queued so far (does not wait for them)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to whoever waits on the future
                future.set_exception(e)
