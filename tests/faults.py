"""A ``diloco-node join`` that misbehaves on purpose, for tests, benchmarks and outside testers.

usage (from the repository root; or ``python tests/faults.py join ...`` from anywhere):

    python -m tests.faults join [the flags of diloco-node join] --fault NAME[=VALUE] [--fault ...]

Every ``--fault`` adds one fault (any number; none: an honest node); the other arguments go to
``diloco-node join`` as they are. Faults:

  nan              every int8 part this peer sends carries NaN block scales (a broken peer)
  huge             this peer contributes its Δ × 1e6 (a hostile peer)
  scale=F          this peer contributes F × its Δ to every round, F any finite number (a hostile peer:
                   scale=-8 passes the 10× bound on a part's size and, averaged, pulls the model back
                   8 steps for every one it trains); it applies its rounds as an honest peer does
  direction=F      this peer contributes a random direction (fresh each round) with F times the norm of
                   its Δ, F > 0 (a hostile peer, or a broken one sending noise); applies rounds honestly
  plain-mean       (an alternative, not a fault) as a reducer, this peer takes the plain weighted mean of
                   its slice's parts, as every reducer did before issue 37, instead of the skipped mean
  stall-allreduce  this peer hangs in the all-reduce after its first part, and touches
                   STATE_DIR/allreduce-stalled when it does
  withhold-digest  this peer confirms each round's average 10 s late (the others wait in their digest
                   cross-check), and touches STATE_DIR/digest-withheld when it starts withholding
  claim-ahead      this peer claims an outer step 1000 ahead of its own everywhere others read it (round
                   metadata, state donation, its signed record and donor priority), with its real
                   θ_global: a forged "newest state" that would make the others download its model
  boast            this peer's signed record claims 10x its tokens (plus 10^6; in verified rounds too) and 20 verified rounds more than it
                   had (its rounds and their weights stay honest): the ledger must show it self-reported
  drop-part        as a reducer, this peer refuses every other member's part (a hostile leader or
                   reducer that drops honest members' contributions), and shuns none of them
  lonely           this peer looks for its groups under a key no other peer uses, so it waits in
                   matchmaking for its whole averaging window (stop it there at any moment)
  disk-full        every checkpoint write after the first fails with ENOSPC (a state dir on a full disk)
  late-end         this peer holds back the Δ of the last inner phase of its run (--max-outer-steps)
                   until another peer's record shows the last outer step (at most 60 s), touching
                   STATE_DIR/late-end when it starts: the others finish without it
  late-before-end  the same with the phase before the last (two rounds behind)
  slowdown=F       every inner step takes F times as long, F ≥ 1 (a slower machine)
  dump-rounds      (instrumentation, not a fault) this peer saves what it contributed and what it
                   applied in each round to STATE_DIR/rounds/*.pt (tests/test_nat.py checks them)
  slow-donation=MS this peer sends each 64 KiB part of a state it donates MS milliseconds apart, MS ≥ 1
                   (a donor behind a home uplink: 30 ms is about 17 Mbit/s)
  clock-step=S@T   T seconds after this peer starts training, its machine's clock reads S seconds more
                   (S < 0: back), in its DHT and averager processes too, as NTP steps a laptop's clock
                   after sleep; touches STATE_DIR/clock-stepped then (S ≠ 0, T ≥ 0)
  uninvited        a stranger to a private run, running code that skips the invitation check: its
                   record shows a pass copied from another peer's record, never one for its own peer id
                   (give it --invite with any invitation to the run: it takes only the run's organiser
                   key from it, which anyone can read in the DHT's run spec)
"""

# How: the node and its averager are the product's, subclassed (as hivemind's
# tests/test_allreduce_fault_tolerance.py subclasses its averager and all-reduce runner; torchft's
# EventInjector injects failures from outside); the product holds no fault code and no hook for one.
# main() puts the faulty node class where `diloco-node join` looks its node class up when it starts
# the node (diloco_swarm.node.runner.Node, imported there at call time); a faulty node puts its
# faulty averager class where the node's start-up looks it up (diloco_swarm.averaging.averager.
# PseudoGradientAverager). One node per process, so replacing them there affects nothing else.
# A faulty averager class lives in this script's __main__, which the DHT process cannot unpickle: a node
# with an averager fault gets an inconclusive reachability check (serving as a full peer), so tests that
# check reachability give averager faults only to nodes started with --public.

from __future__ import annotations

import asyncio
import dataclasses
import errno
import math
import multiprocessing.sharedctypes
import random
import sys
import threading
import time
from pathlib import Path
from typing import AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run by path: this checkout's diloco_swarm

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hivemind.p2p import P2PContext  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402

from diloco_swarm.averaging import averager, codec  # noqa: E402
from diloco_swarm.averaging.allreduce import ConsensusAllReduceRunner  # noqa: E402
from diloco_swarm.averaging.conduct import PeerConduct  # noqa: E402
from hivemind.averaging.partition import TensorPartReducer  # noqa: E402
from diloco_swarm.averaging.averager import PseudoGradientAverager  # noqa: E402
from diloco_swarm.averaging.request import RoundRequest  # noqa: E402
from diloco_swarm.dht.records import read_peer_records  # noqa: E402
from diloco_swarm.node import runner  # noqa: E402
from diloco_swarm.node.invitation import OurPass  # noqa: E402
from diloco_swarm.node.runner import Node  # noqa: E402
from diloco_swarm.node.global_state import theta_digest  # noqa: E402

DISK_FULL_AFTER = 1  # checkpoint writes that succeed
HUGE_FACTOR = 1e6
CLAIM_AHEAD_STEPS = 1000
BOAST_TOKENS, BOAST_ROUNDS = 10**6, 20  # a boasting peer claims 10x its tokens plus these, and these more rounds
STALL_MARKER_NAME = "allreduce-stalled"
WITHHOLD_MARKER_NAME = "digest-withheld"
WITHHOLD_DIGEST_S = 10.0
LATE_END_MARKER_NAME = "late-end"
LATE_END_S = 60.0


# --- faulty nodes ---------------------------------------------------------------------------------
class FaultyNode(Node):
    """The base of every faulty node: its averager is the product's with ``averager_faults`` mixed in."""

    averager_faults: tuple[type[PseudoGradientAverager], ...] = ()

    def __init__(self, config, *args, **kwargs):
        if self.averager_faults:  # the node's start-up imports its averager class from there
            averager.PseudoGradientAverager = faulty_averager(self.averager_faults, config.state_dir)
        super().__init__(config, *args, **kwargs)


class SlowInnerSteps(Node):
    """``slowdown=F``: each inner step sleeps (F − 1) × its own duration."""

    slowdown = 1.0

    def _inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.monotonic()
        loss = super()._inner_step(x, y)
        time.sleep((self.slowdown - 1.0) * (time.monotonic() - t0))
        return loss


class DiskFullNode(Node):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        store, writes = self.checkpoints.store, [0]

        def full_after_the_first(state) -> None:
            if writes[0] >= DISK_FULL_AFTER:
                raise OSError(errno.ENOSPC, "No space left on device")
            store(state)
            writes[0] += 1

        self.checkpoints.store = full_after_the_first


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
                    records = read_peer_records(self.dht, self.spec.run_id)
                    if any(p != self.peer_id and r.outer_step >= limit for p, r in records.items()):
                        break
                except Exception:
                    pass
                self.stop.event.wait(0.5)
        super()._hand_off(handoff)


class LateBeforeEndNode(LateEndNode):
    rounds_before_end = 2


class DumpRoundsNode(Node):
    def _after_round(self, handoff, outcome, round_step, during_inner_step, late=False) -> None:
        held = late and outcome.state is None and outcome.mixed is None  # (Δ carried: nothing applied)
        result, folder = outcome.result, self.cfg.state_dir / "rounds"
        folder.mkdir(exist_ok=True)
        torch.save({"outer_step": handoff.outer_step, "peer_id": self.peer_id, "ok": result.ok, "weight": handoff.tokens,
                    "group": result.group_peer_ids, "group_id": result.group_id, "reason": result.reason,
                    "maybe_kept": result.maybe_kept, "late": held,
                    "carried_rounds": handoff.carried.rounds if handoff.carried else 0,
                    "local": [d.detach().clone() for d in handoff.delta],
                    "applied": [] if held else [a.detach().clone() for a in outcome.average]},
                   folder / f"{handoff.outer_step}-{result.group_id[:12] or 'solo'}-{int(time.time() * 1000)}.pt")
        super()._after_round(handoff, outcome, round_step, during_inner_step, late=late)


class ClaimAheadNode(Node):
    def _round_metadata(self, handoff):
        return {**super()._round_metadata(handoff), "outer_step": handoff.outer_step + CLAIM_AHEAD_STEPS}

    def _state_for_donation(self):
        meta, tensors, seal = super()._state_for_donation()
        return {**meta, "outer_step": meta["outer_step"] + CLAIM_AHEAD_STEPS}, tensors, seal

    def _donor_priority(self) -> float:
        return super()._donor_priority() + CLAIM_AHEAD_STEPS

    def _record_snapshot(self):
        record = super()._record_snapshot()
        step = record["outer_step"] + CLAIM_AHEAD_STEPS
        marks = [*record.get("theta_marks", []), (step, theta_digest(self.state.theta))]
        return {**record, "outer_step": step, "theta_marks": marks}


class BoastingNode(Node):
    def _record_snapshot(self):
        record = super()._record_snapshot()
        return {**record, "tokens_total": 10 * record["tokens_total"] + BOAST_TOKENS,
                "verified_tokens": 10 * record["verified_tokens"] + BOAST_TOKENS,
                "verified_rounds": record["verified_rounds"] + BOAST_ROUNDS}


class CopiedPass(OurPass):
    """A stranger's pass: the first one found in another peer's record in the DHT."""

    def __init__(self, node):
        super().__init__(None, node.status.log)
        self.node = node

    def __call__(self, peer_id: str):
        records = {} if self.node.dht is None else read_peer_records(self.node.dht, self.node.spec.run_id)
        return next((r.admission.dict() for p, r in records.items() if p != peer_id and r.admission), None)


class UninvitedNode(Node):
    """``uninvited``: a stranger to a private run. It shows no pass of its own; its record carries one
    copied from another peer's record (whatever it finds in the DHT), under its own peer id."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.our_pass = CopiedPass(self)


# --- a clock that steps (clock-step=S@T) ---------------------------------------------------------
CLOCK_STEP_MARKER_NAME = "clock-stepped"
_WALL_TIME, _WALL_TIME_NS = time.time, time.time_ns  # the machine's clock, as Python reads it
_clock_step_s = 0.0
_clock_step_at = None  # time.monotonic() of the step, in shared memory: the forked DHT and averager step with us


def parse_clock_step(text: str, value: str) -> tuple[float, float]:
    """``S@T`` → (S, T). :raises UsageError: not two finite numbers, S = 0 or T < 0."""
    step, _, after = value.partition("@")
    try:
        s, t = float(step), float(after)
    except ValueError:
        s = t = math.nan
    if not (math.isfinite(s) and math.isfinite(t) and s != 0.0 and t >= 0.0):
        raise UsageError(f"--fault clock-step=S@T needs seconds S ≠ 0 and T ≥ 0 (e.g. clock-step=-30@20); got '{text}'")
    return s, t


def _stepped_time() -> float:
    return _WALL_TIME() + (_clock_step_s if time.monotonic() >= _clock_step_at.value else 0.0)


def _stepped_time_ns() -> int:
    return _WALL_TIME_NS() + (int(_clock_step_s * 1e9) if time.monotonic() >= _clock_step_at.value else 0)


def install_clock_step(step_s: float) -> None:
    """Replace this process's wall clock by one that reads ``step_s`` more once the step is armed
    (:class:`ClockStepNode`): ``time.time``, ``time.time_ns`` and every module's ``get_dht_time`` that is
    still the wall clock (hivemind's is ``time.time`` itself, bound where it is imported). Call it before
    the node forks its DHT and averager processes: they inherit the replacement and the shared moment.
    The libp2p daemon (Go, another program) keeps the real clock; libp2p's handshakes carry no time."""
    global _clock_step_s, _clock_step_at
    _clock_step_s = step_s
    _clock_step_at = multiprocessing.sharedctypes.RawValue("d", math.inf)
    time.time, time.time_ns = _stepped_time, _stepped_time_ns
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("hivemind", "diloco_swarm") and getattr(module, "get_dht_time", None) is _WALL_TIME:
            module.get_dht_time = _stepped_time


class ClockStepNode(Node):
    """``clock-step=S@T``: arms the step (:func:`install_clock_step`) ``clock_step_after_s`` after training starts."""

    clock_step_after_s = 0.0

    def _start(self) -> bool:
        started = super()._start()
        if _clock_step_at is not None:
            _clock_step_at.value = time.monotonic() + self.clock_step_after_s
            marker = threading.Timer(self.clock_step_after_s, (self.cfg.state_dir / CLOCK_STEP_MARKER_NAME).touch)
            marker.daemon = True
            marker.start()
        return started


# --- faulty averagers (``state_dir``: the node's, set by faulty_averager) --------------------------
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
    async def _run_consensus(self, *args, **kwargs) -> None:  # (the round's all-reduce and θ-mixing's)
        if isinstance(kwargs.get("compression"), codec.Int8BlockwiseCodec):
            kwargs["compression"] = NonFiniteScalesCodec()
        await super()._run_consensus(*args, **kwargs)


class HugeContributionAverager(PseudoGradientAverager):
    def average(self, request: RoundRequest):
        return super().average(dataclasses.replace(request, delta=[d * HUGE_FACTOR for d in request.delta]))


class HostileContributionAverager(PseudoGradientAverager):
    """Sends :meth:`hostile_delta` of its Δ to every round. A failed round gives back the Δ it was handed,
    so this peer then applies its own honest Δ and stays on the swarm's lineage (a patient attacker)."""

    factor = 1.0  # F of scale=F or direction=F, set by node_class

    def hostile_delta(self, delta) -> list[torch.Tensor]:
        raise NotImplementedError

    def average(self, request: RoundRequest):
        result, applied = super().average(dataclasses.replace(request, delta=self.hostile_delta(request.delta)))
        if not (result.ok or result.maybe_kept):  # `applied` is what we sent
            applied = [d.detach().to("cpu", torch.float32) for d in request.delta]
        return result, applied


class ScaledContributionAverager(HostileContributionAverager):
    """``scale=F``: F × Δ."""

    def hostile_delta(self, delta) -> list[torch.Tensor]:
        return [d.detach().to("cpu", torch.float32) * self.factor for d in delta]


class RandomDirectionAverager(HostileContributionAverager):
    """``direction=F``: a random direction (Gaussian, fresh each round and peer) at F × ‖Δ‖ (over all tensors)."""

    def hostile_delta(self, delta) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(random.SystemRandom().getrandbits(63))
        noise = [torch.randn(d.shape, generator=gen) for d in delta]
        norm = math.sqrt(sum(float((d.double() ** 2).sum()) for d in delta))
        noise_norm = math.sqrt(sum(float((n.double() ** 2).sum()) for n in noise)) or 1.0
        return [n * (self.factor * norm / noise_norm) for n in noise]


class PlainMeanAllReduceRunner(ConsensusAllReduceRunner):
    reducer_type = TensorPartReducer  # hivemind's streaming weighted sum


class PlainMeanAverager(PseudoGradientAverager):
    async def _run_consensus(self, runner_type, *args, **kwargs) -> None:
        if runner_type is ConsensusAllReduceRunner:  # the round's all-reduce (θ-mixing's is a mean already)
            runner_type = PlainMeanAllReduceRunner
        await super()._run_consensus(runner_type, *args, **kwargs)


class StallingAllReduceRunner(ConsensusAllReduceRunner):
    def __init__(self, *args, marker: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker = marker

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator:
        first = True
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            if first:  # hang mid all-reduce, after the first part
                first = False
                self.marker.touch()
                await asyncio.sleep(3600)


class StallingAverager(PseudoGradientAverager):
    state_dir: Path

    async def _run_consensus(self, runner_type, *args, **kwargs) -> None:
        if runner_type is ConsensusAllReduceRunner:  # the round's all-reduce (θ-mixing's runs honestly)
            runner_type, kwargs["marker"] = StallingAllReduceRunner, self.state_dir / STALL_MARKER_NAME
        await super()._run_consensus(runner_type, *args, **kwargs)


class DroppingAllReduceRunner(ConsensusAllReduceRunner):
    def _check_sender_part(self, *args, **kwargs) -> str | None:
        return "was dropped (fault: drop-part)"


class UnjudgingConduct(PeerConduct):
    def judge(self, stats) -> None:  # a hostile reducer shuns none of the peers it drops: it keeps joining their groups
        pass


class DroppingAverager(PseudoGradientAverager):
    def run(self):  # (the averager process's entry: its conduct lives there)
        self._conduct = UnjudgingConduct()
        super().run()

    async def _run_consensus(self, runner_type, *args, **kwargs) -> None:
        if runner_type is ConsensusAllReduceRunner:  # the round's all-reduce (θ-mixing's runs honestly)
            runner_type = DroppingAllReduceRunner
        await super()._run_consensus(runner_type, *args, **kwargs)


class LonelyAverager(PseudoGradientAverager):
    def _round_settings(self, step):
        _, target, online, cap = super()._round_settings(step)
        return "1" * 64, target, online, cap  # no honest peer's key: nobody to meet


class SlowDonatingAverager(PseudoGradientAverager):
    part_delay_s = 0.0  # set by node_class

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            yield message
            await asyncio.sleep(self.part_delay_s)


class WithholdingAverager(PseudoGradientAverager):
    state_dir: Path

    def _cross_check(self, stats, result, digest_wait, stop=None, gone=None):
        (self.state_dir / WITHHOLD_MARKER_NAME).touch()  # confirm late: the others wait in their cross-check meanwhile
        (stop or threading.Event()).wait(WITHHOLD_DIGEST_S)
        return super()._cross_check(stats, result, digest_wait, stop, gone)


def faulty_averager(faults: tuple[type[PseudoGradientAverager], ...], state_dir: Path) -> type[PseudoGradientAverager]:
    """The product's averager with these faulty subclasses mixed in, under the product's class name:
    hivemind names every RPC protocol after the servicer class (``{prefix}::{cls.__name__}.rpc_...``),
    and honest peers only speak to that name."""
    name = PseudoGradientAverager.__name__
    return type(name, faults, {"__qualname__": name, "state_dir": state_dir})


# --- the entry point ------------------------------------------------------------------------------
NODE_FAULTS: dict[str, type[Node]] = {"claim-ahead": ClaimAheadNode, "boast": BoastingNode, "disk-full": DiskFullNode,
                                      "late-end": LateEndNode,
                                      "late-before-end": LateBeforeEndNode, "slowdown": SlowInnerSteps,
                                      "dump-rounds": DumpRoundsNode, "clock-step": ClockStepNode,
                                      "uninvited": UninvitedNode}
AVERAGER_FAULTS: dict[str, type[PseudoGradientAverager]] = {
    "nan": NonFiniteScalesAverager, "huge": HugeContributionAverager, "scale": ScaledContributionAverager,
    "direction": RandomDirectionAverager, "plain-mean": PlainMeanAverager, "stall-allreduce": StallingAverager,
    "withhold-digest": WithholdingAverager, "drop-part": DroppingAverager, "lonely": LonelyAverager,
    "slow-donation": SlowDonatingAverager}
# the faults that take a value: its name in the help, the values allowed (said in an error), the check
VALUED = {"slowdown": ("F", "a finite number F ≥ 1", lambda x: x >= 1.0),
          "slow-donation": ("MS", "a finite number MS ≥ 1", lambda x: x >= 1.0),
          "scale": ("F", "a finite number F", lambda x: True),
          "direction": ("F", "a finite number F > 0", lambda x: x > 0.0),
          "clock-step": ("S@T", "seconds S ≠ 0 and T ≥ 0", None)}  # clock-step: parse_clock_step
FAULTS = ("nan", "huge", "scale", "direction", "plain-mean", "stall-allreduce", "withhold-digest", "claim-ahead",
          "boast", "drop-part", "lonely", "disk-full", "late-end", "late-before-end", "slowdown", "dump-rounds",
          "slow-donation", "clock-step", "uninvited")  # in the order of the help


class UsageError(ValueError):
    """A bad ``--fault`` (said in one line, exit code 2)."""


def parse_fault(text: str) -> tuple[str, float | tuple[float, float] | None]:
    """``NAME`` or ``NAME=VALUE`` → (name, value or None). :raises UsageError: not a fault, or a bad value."""
    name, has_value, value = text.partition("=")
    if name not in FAULTS:
        names = ", ".join(f"{f}={VALUED[f][0]}" if f in VALUED else f for f in FAULTS)
        raise UsageError(f"--fault must be one of {names}; got '{text}'")
    if name not in VALUED:
        if has_value:
            raise UsageError(f"--fault {name} takes no value; got '{text}'")
        return name, None
    if name == "clock-step":
        return name, parse_clock_step(text, value)
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    label, allowed, check = VALUED[name]
    if not (math.isfinite(number) and check(number)):
        raise UsageError(f"--fault {name}={label} needs {allowed}; got '{text}'")
    return name, number


def split_faults(args: list[str]) -> tuple[dict[str, float | tuple[float, float] | None], list[str]]:
    """Take every ``--fault NAME[=VALUE]`` (or ``--fault=NAME[=VALUE]``) out of ``join``'s arguments.

    :returns: the faults (name → value; the last one of a name wins) and the other arguments, in order.
    :raises UsageError: a bad fault, or ``--fault`` without one.
    """
    faults: dict[str, float | tuple[float, float] | None] = {}
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == "--fault":
            text = next(items, None)
            if text is None:
                raise UsageError("--fault needs a fault: --fault NAME[=VALUE] (python -m tests.faults --help lists them)")
        elif arg.startswith("--fault="):
            text = arg.removeprefix("--fault=")
        else:
            rest.append(arg)
            continue
        name, value = parse_fault(text)
        faults[name] = value
    if "late-end" in faults and "late-before-end" in faults:
        raise UsageError("--fault late-end and --fault late-before-end exclude each other (one phase is held)")
    if "scale" in faults and "direction" in faults:
        raise UsageError("--fault scale and --fault direction exclude each other (one Δ is sent)")
    return faults, rest


def node_class(faults: dict[str, float | tuple[float, float] | None]) -> type[Node]:
    """The product's node with these faults' subclasses mixed in (averager faults in its averager)."""
    nodes = tuple(NODE_FAULTS[name] for name in FAULTS if name in faults and name in NODE_FAULTS)
    averagers = tuple(AVERAGER_FAULTS[name] for name in FAULTS if name in faults and name in AVERAGER_FAULTS)
    attrs = {"averager_faults": averagers, "slowdown": faults.get("slowdown") or 1.0,
             "clock_step_after_s": (faults.get("clock-step") or (0.0, 0.0))[1]}
    SlowDonatingAverager.part_delay_s = (faults.get("slow-donation") or 0.0) / 1000
    HostileContributionAverager.factor = faults.get("scale", faults.get("direction", 1.0))
    return type("FaultyNode", (*nodes, FaultyNode), attrs)


def main(argv: list[str] | None = None) -> None:
    """``join ... --fault NAME[=VALUE] ...``: run ``diloco-node join`` with a faulty node (this process)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    try:
        if args[0] != "join":
            raise UsageError(f"the only command is join (python -m tests.faults join ... --fault NAME); got '{args[0]}'")
        faults, rest = split_faults(args[1:])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if "--help" in rest:
        print(__doc__.strip() + "\n")  # then join's own help
    if "clock-step" in faults:
        install_clock_step(faults["clock-step"][0])  # before the node forks its DHT and averager
    runner.Node = node_class(faults)  # `diloco-node join` imports its node class from there as it starts the node
    from diloco_swarm.cli import main as diloco_node

    sys.argv = ["diloco-node", "join", *rest]
    diloco_node()


if __name__ == "__main__":
    main()
