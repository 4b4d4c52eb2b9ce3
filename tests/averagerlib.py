"""Real ``PseudoGradientAverager``s over 127.0.0.1, each on a DHT of its own, for the tests that run rounds
without whole nodes."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.dht.swarm import start_dht, visible_maddrs


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
