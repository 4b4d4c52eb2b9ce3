"""In-band digest confirmation: the members of a round tell each other what they will apply.

After a round each member keeps the average only when every other member holds the same one
(``averager.py``: unanimity, because only a reducer that lost a part knows the round was partial).
Each member's *outcome* of a round is the 16-hex digest of the average it would apply, or
:data:`FAILED_MARK`. Reading the outcomes through the DHT costs a store and reads repeated until
all have arrived (about a third of a 1M-value round on 127.0.0.1, docs/benchmarks.md section 3).
So a member asks each other member directly, over the averager's own libp2p connections
(``rpc_round_outcome``), and the asked member answers as soon as it knows its outcome. The libp2p
handshake authenticates the answering peer id, which the DHT copy (a plain subkey) does not.

A member that cannot be asked still publishes its outcome to the DHT, and the asking member reads
the DHT for it: a client-mode peer serves no handlers, and a peer behind NAT cannot be dialed.

Wire (hivemind's protobufs reused, as ``reachability.py`` does): request
``averaging_pb2.DownloadData(metadata=<group id, hex, ascii>)``; response
``DownloadData(metadata=<digest | "failed" | "">)``, ``""`` meaning "not known here": not one of our
recent rounds, the asker is not a member of it, or we did not know our outcome within
:data:`DIGEST_WAIT_S`. A request is untrusted: bounded in size, answered only to members.

Two sides: :class:`OutcomeBoard` and :func:`ask_outcomes` run in the averager process (they answer
and ask over its connections); :class:`Confirmation` runs in the caller's process, publishes our
outcome and waits for the others' (through the averager process, then the DHT).
:class:`ConfirmedRounds` joins them to the averager: its handler, its control-pipe calls, and the
checks a finished round's average must pass before it is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger

from diloco_swarm.averaging.allreduce import RoundStats
from diloco_swarm.averaging.results import GoneProbe, RoundResult, check_round, short_reason, tensors_digest
from diloco_swarm.dht.calls import ChildUnavailable, dht_get, dht_store
from diloco_swarm.utils.hivemind_fixes import keep_task_alive

logger = get_logger(__name__)

FAILED_MARK = "failed"  # the outcome of a member whose view of the round was partial
DIGEST_WAIT_S = 15.0  # how long a member waits for the others' outcomes, and an asked member for its own
ROUNDS_KEPT = 16  # recent rounds whose outcome we answer for
MAX_GROUP_ID_CHARS = 128  # hivemind's group ids are 32 random bytes (64 hex chars)
INBAND_GRACE_S = 1.0  # members' in-band answers usually arrive within this; the DHT copies are read after it
GONE_PROBE_EVERY_S = 2.0  # how often a cross-check asks whether its silent members are gone (each ask: a DHT ping)
OUTCOME_TTL_S = 120.0  # how long the DHT keeps a published outcome
_OUTCOME = re.compile(r"(?:[0-9a-f]{16}|failed)")


def valid_outcome(value: object) -> str:
    """``value`` if it is an outcome (a 16-hex digest or :data:`FAILED_MARK`), else ``""``."""
    return value if isinstance(value, str) and _OUTCOME.fullmatch(value) else ""


class _Round:
    def __init__(self, members: frozenset[str]):
        self.members = members
        self.outcome = ""
        self.known = asyncio.Event()


class OutcomeBoard:
    """Our outcomes of the recent rounds, in the averager process (used from its event loop only)."""

    def __init__(self, rounds_kept: int = ROUNDS_KEPT):
        self._rounds: OrderedDict[str, _Round] = OrderedDict()
        self._rounds_kept = rounds_kept

    def expect(self, group_id: str, members: Iterable[str]) -> None:
        """A round began (its all-reduce starts): its members may ask for our outcome from now on."""
        self._rounds[group_id] = _Round(frozenset(members))
        while len(self._rounds) > self._rounds_kept:
            self._rounds.popitem(last=False)

    def settle(self, group_id: str, outcome: str) -> None:
        """Our outcome of the round ``group_id`` (a digest or :data:`FAILED_MARK`); answers waiting askers."""
        entry = self._rounds.get(group_id)
        if entry is not None and not entry.known.is_set():
            entry.outcome = valid_outcome(outcome)
            entry.known.set()

    async def answer(self, request: averaging_pb2.DownloadData, asker: str,
                     wait_s: float = DIGEST_WAIT_S) -> averaging_pb2.DownloadData:
        """The ``rpc_round_outcome`` handler's body: our outcome, once known, for a member of the round."""
        group_id = request.metadata[:MAX_GROUP_ID_CHARS + 1].decode("ascii", "replace")
        entry = self._rounds.get(group_id) if len(group_id) <= MAX_GROUP_ID_CHARS else None
        if entry is None or asker not in entry.members:
            return averaging_pb2.DownloadData(metadata=b"")
        try:
            await asyncio.wait_for(entry.known.wait(), timeout=wait_s)
        except asyncio.TimeoutError:
            return averaging_pb2.DownloadData(metadata=b"")
        return averaging_pb2.DownloadData(metadata=entry.outcome.encode("ascii"))


async def ask_outcomes(call: Callable[[str, averaging_pb2.DownloadData], object], group_id: str,
                       peers: Iterable[str], timeout: float) -> dict[str, str]:
    """Ask each of ``peers`` for its outcome of round ``group_id``, all at once.

    :param call: ``call(peer, request)`` returns the awaitable answer of that peer's ``rpc_round_outcome``.
    :param timeout: seconds to wait for each answer.
    :returns: ``{peer: outcome}`` for the peers that answered with one; a peer that could not be asked,
        did not know its outcome or answered garbage is left out (the caller reads the DHT for it).
    """
    request = averaging_pb2.DownloadData(metadata=group_id.encode("ascii"))

    async def ask(peer: str) -> tuple[str, str]:
        try:
            raw = (await asyncio.wait_for(call(peer, request), timeout=timeout)).metadata
            return peer, valid_outcome(raw.decode("ascii", "replace")) if len(raw) <= 16 else ""
        except Exception:  # no handler (a client), not dialable (NAT), gone: the DHT copy stands in
            return peer, ""

    answers = await asyncio.gather(*(ask(p) for p in peers))
    return {peer: outcome for peer, outcome in answers if outcome}


class Confirmation:
    """Our side of a round's confirmation, in the caller's process: say our outcome, hear the others'.

    :param dht: the running ``hivemind.DHT``: the copies of the outcomes for members that cannot be
        asked in-band (clients, peers behind NAT) live there.
    :param prefix: the run's matchmaking key; a round's outcomes live under ``{prefix}_round_{group id}``.
    :param peer_id: this peer's id (base58): our subkey there.
    :param command: ``command(method, **kwargs)`` calls ``method`` in the averager process (its
        ``_settle_outcome`` and ``_ask_outcomes``); raises ``OSError`` or ``EOFError`` when that process is gone.
    """

    def __init__(self, dht, prefix: str, peer_id: str, command: Callable[..., None]):
        self.dht, self.prefix, self.peer_id, self.command = dht, prefix, peer_id, command

    def _key(self, stats: RoundStats) -> str:
        return f"{self.prefix}_round_{stats.group_id}"

    def publish(self, stats: RoundStats, outcome: str) -> None:
        """Say our outcome of the round (its digest, or "failed"): in-band to the members that ask us
        (:class:`OutcomeBoard`), and in the DHT for those that cannot (a client dials out only). The DHT
        store runs on a helper thread: a member that asked us in-band does not wait for it."""
        with contextlib.suppress(BrokenPipeError, ConnectionError, EOFError, OSError):  # process gone: the DHT copy stands
            self.command("_settle_outcome", group_id=stats.group_id, outcome=outcome)
        threading.Thread(target=self._store, args=(stats, outcome), name="round-outcome", daemon=True).start()

    def _store(self, stats: RoundStats, outcome: str) -> None:
        try:
            dht_store(self.dht, self._key(stats), outcome, subkey=self.peer_id,
                      expiration_time=get_dht_time() + OUTCOME_TTL_S)
        except Exception as e:  # the members that need this copy then report us silent
            logger.debug(f"could not publish the round outcome: {short_reason(e)}")

    def _ask(self, stats: RoundStats, others: set[str], timeout: float) -> MPFuture | None:
        """Start asking the other members for their outcomes in-band; None if the averager process is gone."""
        future = MPFuture()
        try:
            self.command("_ask_outcomes", group_id=stats.group_id, peers=sorted(others), timeout=timeout, future=future)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            return None
        return future

    def _read(self, stats: RoundStats, others: set[str], timeout: float,
              stop: threading.Event | None) -> dict[str, str]:
        """The members' outcomes published in the DHT (the copies of those we could not ask).
        :raises ChildUnavailable: the DHT did not answer, or ``stop`` was set."""
        found = dht_get(self.dht, self._key(stats), latest=True, timeout=timeout, stop=stop)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {p: o for p, o in ((str(k), valid_outcome(v.value)) for k, v in found.value.items()) if p in others and o}

    def cross_check(self, stats: RoundStats, result: RoundResult, digest_wait: float,
                    stop: threading.Event | None = None, gone: GoneProbe | None = None) -> str | None:
        """Every member says the digest of the average it would apply, or "failed"; the round
        counts only when all of them match ours (``result.digest``: no member keeps a different
        value). Members are asked in-band first; after :data:`INBAND_GRACE_S`, the DHT copies stand
        in for those not heard from (clients, peers we cannot dial). A set ``stop`` abandons the
        round at once (returns "stopping").

        A member still silent then is asked whether it is there (``gone``, every
        :data:`GONE_PROBE_EVERY_S`): one whose process is gone (it crashed after the all-reduce) can
        keep no other value, so it is no longer waited for (``result.gone_peers``). Our view of the
        all-reduce was complete, so it had sent all its parts. Without this the others waited out
        the whole digest wait and then dropped the round (``bench.churn``: two survivors, 15 s each).

        :param digest_wait: seconds to wait for every other member's outcome.
        :returns: why the round cannot be kept, or None when every member confirmed our digest. Fills
            ``result.agreed_peers``, ``gone_peers`` and ``maybe_kept``.
        """
        others = set(stats.group_peer_ids) - {self.peer_id}
        self.publish(stats, result.digest)
        result.maybe_kept = True  # every way out but a contradiction leaves open that a member kept the round
        started = time.monotonic()
        deadline = started + digest_wait
        asking = self._ask(stats, others, digest_wait)
        outcomes: dict[str, str] = {}
        next_probe = started + INBAND_GRACE_S
        while True:
            if asking is not None and asking.done():
                with contextlib.suppress(Exception):  # the averager failed to ask: the DHT copies stand in
                    outcomes = {**asking.result(), **outcomes}
                asking = None
            problem = _judge(outcomes, others, result.digest)
            result.agreed_peers = sum(1 for p in others if outcomes.get(p) == result.digest)
            if problem is not None:
                result.maybe_kept = False  # a member said "failed" or another digest: nobody can keep it
                return problem
            if result.agreed_peers == len(others):
                return None
            if stop is not None and stop.is_set():
                return "stopping"
            now = time.monotonic()
            if now > deadline:
                silent = sorted(others - set(outcomes))
                return f"members did not confirm the average within {digest_wait:.0f}s: " + ", ".join(silent)
            if gone is not None and now >= next_probe:
                next_probe = now + GONE_PROBE_EVERY_S
                left = gone(sorted(others - set(outcomes))) & others
                if left:
                    others -= left
                    result.gone_peers = sorted({*result.gone_peers, *left})
                    continue  # judged again at once: the members still there may all have confirmed
            if asking is None or now - started > INBAND_GRACE_S:
                try:
                    outcomes = {**self._read(stats, others, max(1.0, deadline - now), stop), **outcomes}
                except ChildUnavailable as e:
                    return "stopping" if stop is not None and stop.is_set() else f"could not read the round digests ({e})"
                pause = 0.2
            else:  # the in-band answers wake us as soon as they are in
                pause = max(0.0, min(0.25, INBAND_GRACE_S - (now - started)))
            if asking is not None:
                with contextlib.suppress(Exception):
                    asking.result(timeout=pause)
            elif stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)


def _judge(outcomes: dict[str, str], others: set[str], digest: str) -> str | None:
    """Why the round cannot be kept given the ``outcomes`` heard so far (peer id -> digest or
    FAILED_MARK), or None while no member contradicts our average's ``digest``."""
    failed = sorted(p for p in others if outcomes.get(p) == FAILED_MARK)
    if failed:
        return "members saw a partial round: " + ", ".join(failed)
    mismatched = sorted(p for p in others if p in outcomes and outcomes[p] != digest)
    if mismatched:
        return "members hold a different average: " + ", ".join(mismatched)
    return None


class ConfirmedRounds:
    """The averager's part of the confirmation: a mixin of ``averager.PseudoGradientAverager``, since
    hivemind looks ``rpc_round_outcome`` up on the averager and calls ``_settle_outcome`` and
    ``_ask_outcomes`` through its control pipe. Needs the averager's ``_command``, ``get_stub``,
    ``_p2p``, ``prefix`` and ``max_norm_ratio``. Call :meth:`_init_confirmation` before the averager
    process starts."""

    def _init_confirmation(self, dht, prefix: str) -> None:
        self._outcomes = OutcomeBoard()  # our outcomes of recent rounds, asked by their members (averager process)
        self._confirmation = Confirmation(dht, prefix, dht.peer_id.to_base58(), self._command)  # caller's process

    # --- runs in the averager process -------------------------------------------------
    async def rpc_round_outcome(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """A member of one of our recent rounds asks what we apply (:meth:`OutcomeBoard.answer`)."""
        return await self._outcomes.answer(request, context.remote_id.to_base58())

    async def _settle_outcome(self, group_id: str, outcome: str) -> None:
        self._outcomes.settle(group_id, outcome)

    @keep_task_alive
    async def _ask_outcomes(self, group_id: str, peers: list[str], timeout: float, future: MPFuture):
        """Ask the other members of a round for their outcomes (:func:`ask_outcomes`), over our own connections."""
        async def call(peer: str, request: averaging_pb2.DownloadData):
            return await self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix).rpc_round_outcome(request)

        try:
            future.set_result(await ask_outcomes(call, group_id, peers, timeout))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(short_reason(e)))

    # --- runs in the caller's process -------------------------------------------------
    def _verify(self, stats: RoundStats, local: list[torch.Tensor], averaged: list[torch.Tensor], result: RoundResult,
                *, weight: float, digest_wait: float, stop: threading.Event | None,
                gone: GoneProbe | None) -> str | None:
        """Why the average of a finished all-reduce (``averaged``; our input ``local``) must not be kept,
        or None: ``results.check_round`` against ``result.gathered``, then every member's confirmation of
        its digest (:meth:`_cross_check`). A round that fails our own checks is published as failed, so
        that no member keeps a partial average."""
        problem = check_round(stats, local, averaged, weight=weight, gathered=result.gathered,
                              max_norm_ratio=self.max_norm_ratio)
        if problem is None:
            result.digest = tensors_digest(averaged)
            return self._cross_check(stats, result, digest_wait, stop, gone)
        if len(stats.group_peer_ids) >= 2:
            self._confirmation.publish(stats, FAILED_MARK)
        return problem

    def _cross_check(self, stats: RoundStats, result: RoundResult, digest_wait: float,
                     stop: threading.Event | None = None, gone: GoneProbe | None = None) -> str | None:
        """Whether every member confirms ``result.digest`` (:meth:`Confirmation.cross_check`)."""
        return self._confirmation.cross_check(stats, result, digest_wait, stop, gone)
