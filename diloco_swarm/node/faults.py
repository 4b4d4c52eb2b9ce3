"""Fault injection: faulty subclasses of the node and its averager, for tests and benchmarks.

The hidden ``--fault`` and ``--slowdown`` flags of ``diloco-node join`` reach real processes. They
are read once, here, by :func:`node_type`, which picks subclasses that misbehave; the product code
holds no fault branches (as hivemind's ``tests/test_allreduce_fault_tolerance.py`` subclasses its
all-reduce, and torchft's ``EventInjector`` injects failures from outside).

- ``nan``: every int8 part this peer sends carries NaN block scales (a broken peer).
- ``huge``: this peer contributes Δ × 1e6 (a hostile peer).
- ``stall-allreduce``: this peer hangs in the all-reduce after its first part, and touches
  ``state_dir/allreduce-stalled`` so a test knows when.
- ``withhold-digest``: this peer confirms each round's average 10 s late (the others wait in their
  digest cross-check), and touches ``state_dir/digest-withheld`` when it starts withholding.
- ``drop-part``: as a reducer, this peer refuses every other member's part (a hostile leader or
  reducer that drops honest members' contributions).
- ``lonely``: this peer looks for its groups under a key no other peer uses, so it waits in
  matchmaking for the whole averaging window (a test can stop it there at any moment).
- ``claim-ahead``: this peer claims an outer step 1000 ahead of its own everywhere others read it
  (round metadata, state donation, its signed record and donor priority), with its real θ_global:
  a forged "newest state" that would make the others download its model.
- ``disk-full``: every checkpoint write after the first :data:`DISK_FULL_AFTER` fails with ENOSPC
  (a state dir on a disk that fills up).
- ``late-end``: this peer holds back the Δ of the last inner phase of its run (``--max-outer-steps``)
  until another peer's record shows the last outer step (at most :data:`LATE_END_S`), touching
  ``state_dir/late-end`` when it starts: the others finish the run without it (a peer late for the
  last round). ``late-before-end``: the same with the phase before the last (two rounds behind).
- ``--slowdown F``: every inner step takes F times as long (a slower machine).
"""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import torch

from diloco_swarm.node.runner import Node

FAULTS = ("nan", "huge", "stall-allreduce", "withhold-digest", "claim-ahead", "drop-part", "lonely", "disk-full",
          "late-end", "late-before-end")
DISK_FULL_AFTER = 1
HUGE_FACTOR = 1e6
CLAIM_AHEAD_STEPS = 1000
STALL_MARKER_NAME = "allreduce-stalled"
WITHHOLD_MARKER_NAME = "digest-withheld"
WITHHOLD_DIGEST_S = 10.0
LATE_END_MARKER_NAME = "late-end"
LATE_END_S = 60.0


def node_type(fault: str, slowdown: float = 1.0) -> type[Node]:
    """The node class for these fault flags (``Node`` itself when there is no fault).

    :raises ValueError: an unknown fault name.
    """
    if fault not in ("", *FAULTS):
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    bases: list[type] = []
    if slowdown > 1.0:
        bases.append(SlowInnerSteps)
    bases += {"": [], "nan": [NonFiniteScalesNode], "huge": [HugeContributionNode],
              "stall-allreduce": [StallingNode], "claim-ahead": [ClaimAheadNode],
              "withhold-digest": [WithholdingNode],
              "drop-part": [DroppingNode], "lonely": [LonelyNode], "disk-full": [DiskFullNode],
              "late-end": [LateEndNode], "late-before-end": [LateBeforeEndNode]}[fault]
    return type("FaultyNode", (*bases, Node), {}) if bases else Node


class SlowInnerSteps(Node):
    """Each inner step sleeps (slowdown − 1) × its own duration."""

    def _inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.monotonic()
        loss = super()._inner_step(x, y)
        time.sleep((self.cfg.slowdown - 1.0) * (time.monotonic() - t0))
        return loss


class DiskFullNode(Node):
    _writes = 0

    def _store_checkpoint(self, state) -> None:
        if self._writes >= DISK_FULL_AFTER:
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._store_checkpoint(state)
        self._writes += 1


class LateEndNode(Node):
    rounds_before_end = 1  # hold the phase whose round would reach --max-outer-steps − this + 1
    _held = False

    def _hand_off(self, handoff) -> None:
        limit = self.cfg.max_outer_steps
        if not self._held and 0 < limit <= handoff.outer_step + self.rounds_before_end:
            self._held = True
            (self.cfg.state_dir / LATE_END_MARKER_NAME).touch()
            deadline = time.monotonic() + LATE_END_S
            while time.monotonic() < deadline and not self.stop.requested:
                try:
                    if any(p != self.peer_id and r.outer_step >= limit for p, r in self._read_records().items()):
                        break
                except Exception:
                    pass
                self.stop.event.wait(0.5)
        super()._hand_off(handoff)


class LateBeforeEndNode(LateEndNode):
    rounds_before_end = 2


class HugeContributionNode(Node):
    def _contribution(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        return [d * HUGE_FACTOR for d in delta]


class ClaimAheadNode(Node):
    def _round_metadata(self, handoff):
        return {**super()._round_metadata(handoff), "outer_step": handoff.outer_step + CLAIM_AHEAD_STEPS}

    def _state_for_donation(self):
        meta, tensors, seal = super()._state_for_donation()
        return {**meta, "outer_step": meta["outer_step"] + CLAIM_AHEAD_STEPS}, tensors, seal

    def _donor_priority(self) -> float:
        return super()._donor_priority() + CLAIM_AHEAD_STEPS

    def _record_snapshot(self):
        from diloco_swarm.node.statesync import theta_digest

        record = super()._record_snapshot()
        step = record["outer_step"] + CLAIM_AHEAD_STEPS
        marks = [*record.get("theta_marks", []), (step, theta_digest(self.outer.theta))]
        return {**record, "outer_step": step, "theta_marks": marks}


class WithholdingNode(Node):
    def _averager_type(self) -> type:
        return _withholding_averager(self.cfg.state_dir / WITHHOLD_MARKER_NAME)


class DroppingNode(Node):
    def _averager_type(self) -> type:
        return _dropping_averager()


class LonelyNode(Node):
    def _averager_type(self) -> type:
        return _lonely_averager()


class NonFiniteScalesNode(Node):
    def _averager_type(self) -> type:
        return _nonfinite_scales_averager()


class StallingNode(Node):
    def _averager_type(self) -> type:
        return _stalling_averager(self.cfg.state_dir / STALL_MARKER_NAME)


# The averager classes import hivemind: build them on first use, so that importing this module stays light.
def _on_the_wire_as(cls: type, base: type) -> type:
    """Give a faulty averager its base's name: hivemind names every RPC protocol after the servicer
    class (``{prefix}::{cls.__name__}.rpc_...``), and honest peers only speak to that name."""
    cls.__name__ = cls.__qualname__ = base.__name__
    return cls


def _nonfinite_scales_averager() -> type:
    from diloco_swarm.averaging import codec
    from diloco_swarm.averaging.averager import COMPRESSIONS, PseudoGradientAverager

    class NonFiniteScalesCodec(codec.Int8BlockwiseCodec):
        def compress(self, tensor, info, allow_inplace=False):
            message = super().compress(tensor, info, allow_inplace)
            n_blocks = (tensor.numel() + codec.BLOCKSIZE - 1) // codec.BLOCKSIZE
            start = codec._HEADER.size
            buffer = bytearray(message.buffer)
            buffer[start:start + 4 * n_blocks] = np.full(n_blocks, np.nan, dtype="<f4").tobytes()
            message.buffer = bytes(buffer)
            return message

    class NonFiniteScalesAverager(PseudoGradientAverager):
        compressions = {**COMPRESSIONS, "int8": NonFiniteScalesCodec}

    return _on_the_wire_as(NonFiniteScalesAverager, PseudoGradientAverager)


def _stalling_averager(marker: Path) -> type:
    from diloco_swarm.averaging.allreduce import ConsensusAllReduceRunner
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class StallingAllReduceRunner(ConsensusAllReduceRunner):
        async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator:
            first = True
            async for message in super()._generate_input_for_peer(peer_index):
                yield message
                if first:  # hang mid all-reduce, after the first part
                    first = False
                    marker.touch()
                    await asyncio.sleep(3600)

    class StallingAverager(PseudoGradientAverager):
        allreduce_runner_type = StallingAllReduceRunner

    return _on_the_wire_as(StallingAverager, PseudoGradientAverager)


def _dropping_averager() -> type:
    from diloco_swarm.averaging.allreduce import ConsensusAllReduceRunner
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class DroppingAllReduceRunner(ConsensusAllReduceRunner):
        def _check_sender_part(self, *args, **kwargs) -> str | None:
            return "was dropped (fault: drop-part)"

    class DroppingAverager(PseudoGradientAverager):
        allreduce_runner_type = DroppingAllReduceRunner

    return _on_the_wire_as(DroppingAverager, PseudoGradientAverager)


def _lonely_averager() -> type:
    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class LonelyAverager(PseudoGradientAverager):
        def _round_settings(self, step):
            _, target, online, cap = super()._round_settings(step)
            return "1" * 64, target, online, cap  # no honest peer's key: nobody to meet

    return _on_the_wire_as(LonelyAverager, PseudoGradientAverager)


def _withholding_averager(marker: Path) -> type:
    import threading

    from diloco_swarm.averaging.averager import PseudoGradientAverager

    class WithholdingAverager(PseudoGradientAverager):
        def _cross_check(self, stats, result, digest_wait, stop=None, gone=None):
            marker.touch()  # confirm late: the others wait in their cross-check meanwhile
            (stop or threading.Event()).wait(WITHHOLD_DIGEST_S)
            return super()._cross_check(stats, result, digest_wait, stop, gone)

    return _on_the_wire_as(WithholdingAverager, PseudoGradientAverager)
