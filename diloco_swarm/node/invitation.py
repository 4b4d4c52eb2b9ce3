"""Our side of a private run (invites.py): the pass our record shows, and a word before our invitation ends."""

from __future__ import annotations

import time
from typing import Any, Callable

from diloco_swarm.invites import Invitation, write_private
from diloco_swarm.node.errors import NodeError
from diloco_swarm.utils import clock

EXPIRY_NOTICE_S = 86400.0  # say so this long before our invitation expires


class OurPass:
    """The pass our invitation gives our libp2p peer id in our record, signed once (None in a public run);
    says in one line when the invitation is a day from its end, and again when it has ended (the other
    peers refuse us from then on). Set :attr:`owner` (``records.owner_digest`` of our record's subkey)
    before the first call."""

    def __init__(self, invitation: Invitation | None, log: Callable[[str], None]):
        self.invitation, self.log = invitation, log
        self.owner: str | None = None
        self._pass: dict[str, Any] | None = None
        self._said: str | None = None

    def shown(self, peer_id: str) -> dict[str, Any] | None:
        """What a request shows before our record is in the DHT (a dial-back check): the pass and its owner."""
        ours = self(peer_id)
        return None if ours is None else {**ours, "owner": self.owner}

    def __call__(self, peer_id: str) -> dict[str, Any] | None:
        if self.invitation is None:
            return None
        if self._pass is None:
            if self.owner is None:
                raise RuntimeError("OurPass.owner is not set: set it once the record key is known")
            self._pass = self.invitation.admission_pass(peer_id, self.owner)
        left = self.invitation.expires_at - clock.now()
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.invitation.expires_at))
        if left <= 0 and self._said != "ended":
            self._said = "ended"
            self.log(f"our invitation to private run '{self.invitation.run_id}' expired at {until}: the other peers "
                     "refuse us from now on; ask its organiser for a new one and restart with --invite NEW_FILE")
        elif 0 < left <= EXPIRY_NOTICE_S and self._said is None:
            self._said = "soon"
            self.log(f"our invitation to private run '{self.invitation.run_id}' expires at {until} (in "
                     f"{left / 3600:.0f} h): ask its organiser for a new one and restart with --invite NEW_FILE")
        return self._pass


def save_private_files(files) -> None:
    """Save ``(path, text)`` pairs (``NodeConfig.private_files``) 0600, atomically.
    :raises NodeError: one cannot be written (one line)."""
    for path, text in files:
        try:
            write_private(path, text)
        except OSError as e:
            raise NodeError(f"cannot write {path}: {e.strerror or e}") from None
