"""Real ``PseudoGradientAverager``s over 127.0.0.1, each on a DHT of its own, for the tests that run rounds
without whole nodes."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.dht.swarm import start_dht, visible_maddrs

T = TypeVar("T")


@contextlib.contextmanager
def averagers(prefix: str, target_group_size: int, clients: tuple[bool, ...], shapes: Sequence[tuple[int, ...]],
              types: tuple[type, ...] = (), **kwargs) -> Iterator[list[PseudoGradientAverager]]:
    """One DHT and averager per entry of ``clients`` (True: a client), bootstrapped from the first, of the class
    in ``types`` at its index (default ``PseudoGradientAverager``), averaging zeros of ``shapes`` (``kwargs``: the
    averagers' other arguments); all shut down at the end."""
    dhts = [start_dht(initial_peers=[], host="127.0.0.1", port=0)]
    dhts += [start_dht(initial_peers=visible_maddrs(dhts[0]), host="127.0.0.1", port=0, client_mode=client)
             for client in clients[1:]]
    out: list[PseudoGradientAverager] = []
    try:
        for i, (dht, client) in enumerate(zip(dhts, clients)):
            cls = types[i] if i < len(types) else PseudoGradientAverager
            out.append(cls([torch.zeros(s) for s in shapes], dht, prefix=prefix, target_group_size=target_group_size,
                           matchmaking_time=2.0, client_mode=client, **kwargs))
        yield out
    finally:
        for averager in out:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def in_threads(fn: Callable[[int], T], n: int, timeout: float = 120.0) -> list[T]:
    """``fn(0)``, ..., ``fn(n - 1)`` at once, each in a thread of its own (the members of one round), and their
    results in that order; fails the test when one has not returned after ``timeout`` s (``fn`` never returns None)."""
    out: list = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert all(o is not None for o in out), f"a call did not return within {timeout:g} s"
    return out
