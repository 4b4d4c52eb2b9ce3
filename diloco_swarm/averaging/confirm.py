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
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from typing import Callable, Iterable

from hivemind.proto import averaging_pb2

FAILED_MARK = "failed"  # the outcome of a member whose view of the round was partial
DIGEST_WAIT_S = 15.0  # how long a member waits for the others' outcomes, and an asked member for its own
ROUNDS_KEPT = 16  # recent rounds whose outcome we answer for
MAX_GROUP_ID_CHARS = 128  # hivemind's group ids are 32 random bytes (64 hex chars)
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
