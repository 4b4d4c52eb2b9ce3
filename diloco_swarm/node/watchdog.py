"""Supervision of a node's parts: the DHT process, the averager process and the libp2p daemon.

A node is four processes: the main one, hivemind's DHT and averager processes (forked), and the
DHT's go-libp2p daemon ``p2pd``. When one of them dies under a running node (the OOM killer, a
crashed daemon, a stray ``kill``), the node cannot average any more; without supervision it trained
alone forever, printing hivemind tracebacks. :class:`Watchdog` polls each part every second and
calls ``on_lost`` once, from its own thread, with one line that names the part. The node then ends
with exit code :data:`EXIT_PART_LOST` (docs/operations.md), keeping its last checkpoint.

The Unix sockets a killed part leaves behind are removed with the node's socket directory
(``utils/hivemind_fixes.py``).

Linux only (reads ``/proc``); elsewhere the probes of the child processes still work and ``p2pd``
is not watched.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Mapping

from diloco_swarm.node.redial import Redialer

logger = logging.getLogger(__name__)

EXIT_PART_LOST = 3  # the exit code of a node that lost its DHT, averager or p2pd (the checkpoint is kept)
POLL_S = 1.0
GRACE_S = 1.0  # between noticing a lost part and reporting it

Probe = Callable[[], "str | None"]  # None while the part is fine, else what happened to it


class PartLost(Exception):
    """A part of this node (DHT process, averager process, p2pd) died; the node stopped (exit 3)."""

    exit_code = EXIT_PART_LOST


def process_probe(proc) -> Probe:
    """Probe of a ``multiprocessing.Process`` child (``hivemind.DHT``, the averager)."""

    def probe() -> str | None:
        try:
            if proc.is_alive():
                return None
        except Exception:  # not started, or closed
            return "is gone"
        code = proc.exitcode
        if code is not None and code < 0:
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    return probe


def pid_probe(pid: int) -> Probe:
    """Probe of any process by pid (a zombie counts as gone). Linux ``/proc``."""

    def probe() -> str | None:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "is gone"
        return "is gone" if state in ("Z", "X") else None

    return probe


def children_of(pid: int) -> list[tuple[int, str]]:
    """Live children of ``pid``: ``[(pid, command name)]`` (Linux ``/proc``; [] elsewhere)."""
    out = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        head, _, tail = stat.rpartition(")")
        fields = tail.split()
        if len(fields) > 1 and fields[1] == str(pid) and fields[0] not in ("Z", "X"):
            out.append((int(entry.name), head.split("(", 1)[-1]))
    return out


def node_parts(dht, averager) -> dict[str, Probe]:
    """The parts of a running node to watch: ``{"the DHT process (pid N)": probe, ...}``."""
    parts: dict[str, Probe] = {}
    if dht is not None:
        parts[f"the DHT process (pid {dht.pid})"] = process_probe(dht)
        for pid, name in children_of(dht.pid):
            if name == "p2pd":
                parts[f"the libp2p daemon p2pd (pid {pid})"] = pid_probe(pid)
    if averager is not None:
        parts[f"the averager process (pid {averager.pid})"] = process_probe(averager)
    return parts


def end_processes(*procs) -> None:
    """SIGTERM each live ``multiprocessing.Process`` in ``procs`` (their p2pd dies with the DHT process)."""
    for proc in procs:
        try:
            if proc is not None and proc.is_alive():
                proc.terminate()
        except Exception:
            pass


class Watchdog:
    """Calls ``on_lost(what)`` once, within about ``poll_s``, when a part of ``parts`` is gone.

    :param parts: ``{name: probe}``, e.g. from :func:`node_parts`; a probe returns None while the
        part is fine, else a short description ("was killed by signal 9").
    :param on_lost: called from the watchdog's thread with one line, e.g. "the DHT process (pid 12)
        was killed by signal 9"; it must be quick and thread-safe (set an event).
    """

    def __init__(self, parts: Mapping[str, Probe], on_lost: Callable[[str], None], *,
                 poll_s: float = POLL_S):
        self.parts = dict(parts)
        self.on_lost = on_lost
        self.poll_s = poll_s
        self.lost: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def check(self) -> str | None:
        """One look at every part: the first problem as one line, or None."""
        for name, probe in self.parts.items():
            try:
                problem = probe()
            except Exception as e:  # a probe must never kill the watchdog
                problem = f"could not be checked ({type(e).__name__})"
            if problem is not None:
                return f"{name} {problem}"
        return None

    def _loop(self) -> None:
        while not self._stopped.wait(self.poll_s):
            problem = self.check()
            if problem is not None:
                # a signal to the node's whole process group ends a part a moment before the node's
                # own handler runs: give that handler time to mark the stop as asked for
                if self._stopped.wait(GRACE_S):
                    return
                self.lost = problem
                try:
                    self.on_lost(problem)
                except Exception as e:
                    logger.warning(f"watchdog callback failed: {e!r}")
                return

    def stop(self) -> None:
        """Stop watching (before the node shuts its parts down on purpose)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1)


class Supervisor:
    """Ends the node when one of its parts dies (a :class:`Watchdog` over the DHT, averager and p2pd
    processes), and re-dials the peers a restarted node knew while they may be restarting too
    (node/redial.py). ``stop``: the node's StopFlag; ``lost``: why a part died (the node then stops
    with :class:`PartLost`, exit 3), None while all is well."""

    def __init__(self, stop, log: Callable[[str], None]):
        self.stop, self.log = stop, log
        self.lost: str | None = None
        self._watchdog: Watchdog | None = None
        self._parts: tuple = ()

    def start(self, dht, averager, redial_known: list[str]) -> None:
        self._parts = (averager, dht)
        self._watchdog = Watchdog(node_parts(dht, averager), self._part_lost).start()
        if redial_known:
            Redialer(dht, redial_known, self.stop.event, on_merged=lambda n: self.log(
                f"found {n} of the peers this node saw before; the two swarms merge")).start()

    def _part_lost(self, what: str) -> None:
        """Watchdog callback (its thread): stop the node; the others' calls fail at once (ends them)."""
        if self.stop.requested:
            return  # a signal to our process group ended that part too: a normal stop
        self.lost = what
        self.stop.event.set()
        end_processes(*self._parts)  # useless without each other; every call now fails at once

    def close(self) -> None:
        """Stop watching: the node now ends its parts on purpose."""
        if self._watchdog is not None:
            self._watchdog.stop()
