"""Who may use our services in a private run: peers whose signed record shows a valid invitation.

Every handler a stranger could call (matchmaking's join, dial-back checks, state download) and every
peer we call (a group's leader, a state donor) is checked here (parts and round outcomes reach only
the members of a group, which all passed matchmaking), against the peer id the
libp2p connection authenticated and the organiser key of our own spec (invites.py). In a public run
(no organiser) everyone is admitted.

A peer is admitted once its record, read from the DHT, carries a pass for its peer id. A joiner's
record may reach the DHT a moment after its first call; a miss therefore reads the records again, at
most every :data:`REFRESH_MIN_S` seconds (a stranger's calls cannot make us flood the DHT) and
within :data:`READ_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable

from hivemind.utils import get_logger

from diloco_swarm.dht.records import PeerEntry, peer_entries, records_key
from diloco_swarm.invites import pass_problem
from diloco_swarm.utils import clock

logger = get_logger(__name__)

REFRESH_MIN_S = 2.0  # between two reads of the records on behalf of unknown peers
READ_TIMEOUT_S = 5.0  # one read of the records
REFUSAL_LOG_EVERY_S = 60.0  # one log line per refused peer and minute


class Admission:
    """(averager process) The admitted peers of a private run, read from the run's records.

    :param read_records: ``await read_records(key)`` returns hivemind's ``DHT.get(key, latest=True)``
        result for the run's records key (or None); the averager passes its DHT's.
    :param run_id: the run.
    :param organiser: ``RunSpec.organiser`` of our own spec; None admits everyone (a public run).
    """

    def __init__(self, read_records: Callable[[str], Awaitable], run_id: str, organiser: str | None):
        self._read = read_records
        self._run_id = run_id
        self._organiser = organiser
        self._admitted: dict[str, float] = {}  # peer id -> its invitation's expiry (unix s)
        self._last_read = float("-inf")  # when the last read of the records ended (time.monotonic)
        self._reading: asyncio.Future | None = None  # the read in flight
        self._logged: dict[str, float] = {}

    @property
    def private(self) -> bool:
        return self._organiser is not None

    async def admits(self, peer: str, *, shown: dict | None = None) -> bool:
        """Whether ``peer`` (base58 peer id) may use our services or serve us; never raises.

        :param shown: a pass the peer showed with its request, with the ``owner`` of the record it is for
            (untrusted; a joiner's record may not be in the DHT yet), checked like a record's.
        """
        if self._organiser is None:
            return True
        if shown is not None and pass_problem(shown, run_id=self._run_id, organiser=self._organiser, peer_id=peer,
                                              owner=shown.get("owner"), now=clock.now()) is None:
            self._admitted[peer] = float(shown["expires"])
        if self._valid(peer):
            return True
        if self._reading is None and time.monotonic() - self._last_read >= REFRESH_MIN_S:
            self._reading = asyncio.ensure_future(self._refresh())
        if self._reading is not None:  # one read at a time, shared: every caller waits READ_TIMEOUT_S at most
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reading), READ_TIMEOUT_S)
        if self._valid(peer):
            return True
        if time.monotonic() - self._logged.get(peer, float("-inf")) >= REFUSAL_LOG_EVERY_S:
            if len(self._logged) > 4096:  # bounded: strangers may come with ever new peer ids
                self._logged.clear()
            self._logged[peer] = time.monotonic()
            logger.info(f"refused peer {peer}: it shows no valid invitation to this private run")
        return False

    def _valid(self, peer: str) -> bool:
        return self._admitted.get(peer, 0.0) > clock.now()

    async def _refresh(self) -> None:
        try:
            found = await asyncio.wait_for(self._read(records_key(self._run_id)), READ_TIMEOUT_S)
        except Exception as e:  # a busy or stopping DHT: we refuse until the next read
            logger.debug(f"reading the records for admission failed: {e!r}")
            return
        finally:
            self._last_read, self._reading = time.monotonic(), None
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return
        entries = peer_entries(self._run_id, ((subkey, getattr(item, "value", None), 0.0)
                                              for subkey, item in value.items()), organiser=self._organiser)
        self._admitted.update(admitted_of(entries))


def admitted_of(entries: list[PeerEntry]) -> dict[str, float]:
    """``{peer id: invitation expiry}`` of the admitted records among ``entries`` (parsed with an organiser)."""
    return {e.record.peer_id: float(e.record.admission.expires) for e in entries
            if e.record is not None and e.record.admission is not None}
