"""Workarounds for hivemind 1.1.12 bugs that bite a swarm node. Each can go once hivemind fixes it.

Pending tasks collected by the garbage collector. ``hivemind.DHT.run`` and
``DecentralizedAverager._run_internal`` start each request from the host process with
``asyncio.create_task(...)`` and drop the reference. asyncio keeps only weak references to
tasks, so a task awaiting a future that nothing else references can be collected mid-flight:
the DHT logs ``GeneratorExit`` / "Task was destroyed but it is pending!" and the host's call
(``get_visible_maddrs``, ``get``, ``store``, ``step``...) then waits forever. We saw it on a
loaded 2-core machine about once in five 3-node starts. :func:`keep_task_alive` wraps such a
coroutine method so that its task holds a strong reference to itself while it runs.
"""

from __future__ import annotations

import asyncio
import functools

_live_tasks: set[asyncio.Task] = set()


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


patch_hivemind()
