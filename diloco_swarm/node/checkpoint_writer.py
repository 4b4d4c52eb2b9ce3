"""Writing the node's checkpoint on its own thread, from the live tensors (node/checkpoint.py holds
the format). A failed write costs only this peer's restart point, never the swarm's training."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Callable

from diloco_swarm.node.checkpoint import save_checkpoint
from diloco_swarm.utils.worker import Worker

CHECKPOINT_WRITE_TIMEOUT_S = 30.0  # a graceful leave waits this long for the last checkpoint write


class CheckpointWriter:
    """Writes what ``state()`` returns (θ_global, the momentum and the counters, live tensors) to
    ``state_dir``, in order, on the ``checkpoint`` thread, never queued behind a slow DHT call.

    ``lock``: the node's state lock, held while ``torch.save`` streams the live tensors, so no outer
    step changes them meanwhile (no snapshot copy: the memory budget). ``stop``: the node's
    :class:`~diloco_swarm.node.signals.StopFlag`, which says at a stop whether a checkpoint is kept.
    """

    def __init__(self, state_dir: Path, *, state: Callable[[], dict[str, Any]], lock: threading.Lock,
                 metrics: Any, log: Callable[[str], None], stop: Any):
        self.state_dir, self.state, self.lock = state_dir, state, lock
        self.metrics, self.log, self.stop = metrics, log, stop
        self.on_disk: int | None = None  # outer step of the newest checkpoint written (None: none yet)
        self._failure: str | None = None  # why the last write failed (said once per reason)
        self._last = None  # future of the newest write
        self._worker = Worker("checkpoint")

    def store(self, state: dict[str, Any]) -> None:
        """:raises OSError: the write failed (node/checkpoint.py: save_checkpoint)."""
        save_checkpoint(self.state_dir, state)

    def write_now(self) -> None:
        """Write the state as it is now (any thread); a round finished meanwhile waits to be applied
        for as long as the disk takes."""
        self.stop.has_checkpoint = True
        with self.lock:
            self._write(self.state())

    def write_in_background(self) -> None:
        """Write the state on the checkpoint thread."""
        self.stop.has_checkpoint = True
        self._last = self._worker.submit(self.write_now)

    def _write(self, state: dict[str, Any]) -> None:
        """A failed write (a full disk, a read-only remount) is said once per reason, in the metrics
        and at the stop, and the node trains on; the previous checkpoint stays on disk."""
        try:
            self.store(state)
        except OSError as e:
            reason, on_disk = e.strerror or str(e), self.on_disk
            held = f"the checkpoint on disk is outer step {on_disk}" if on_disk is not None else "no checkpoint is on disk yet"
            self.stop.checkpoint_problem = f"{held}: writing outer step {state['outer_step']} failed ({reason})"
            self.metrics.write({"event": "checkpoint_failed", "peer_id": state["peer_id"],
                                "outer_step": state["outer_step"], "reason": reason, "on_disk_outer_step": on_disk})
            if reason != self._failure:
                self.log(f"warning: could not write the checkpoint of outer step {state['outer_step']} in "
                         f"{self.state_dir} ({reason}); training goes on, but a restart would resume from "
                         f"{'the start' if on_disk is None else f'outer step {on_disk}'}. Free some space "
                         "there (or make it writable again); the next outer step tries again")
            self._failure = reason
            return
        if self._failure is not None:
            self.log(f"the checkpoint is written again (outer step {state['outer_step']})")
        self._failure, self.stop.checkpoint_problem = None, None
        self.on_disk = state["outer_step"]

    def close(self, wait: bool = False) -> None:
        """Stop the thread after the queued write; ``wait``: up to :data:`CHECKPOINT_WRITE_TIMEOUT_S`
        for it (a graceful leave)."""
        self._worker.close()
        if wait and self._last is not None:
            with contextlib.suppress(Exception):
                self._last.result(timeout=CHECKPOINT_WRITE_TIMEOUT_S)
