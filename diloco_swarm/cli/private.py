"""Private runs on the command line: ``join --private`` and ``join --invite``, and ``diloco-node invite``.

The state dir remembers a node's part in a private run, so a restart needs neither flag:

- the organiser's holds ``organiser.key`` (invites.py) and ``private-run.json`` (the run id and the
  organiser's public key). A node started on it is that run's organiser: it admits itself with an
  invitation it makes at each start, and ``diloco-node invite`` reads both files;
- a volunteer's holds ``invitation.txt``, the invitation it joined with (0600, like the key). A new
  ``--invite`` replaces it; an expired one is refused with a line that asks for a new one.

Bad input here is one line and exit 2, like every ``join`` flag, and comes before torch and hivemind
load. The crypto (and its import, ~30 ms) stays in :mod:`diloco_swarm.invites`, loaded when used.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from diloco_swarm.cli.common import err, fail
from diloco_swarm.cli.text import DEFAULT_RUN_ID, printable

if TYPE_CHECKING:
    from diloco_swarm.invites import Invitation

PRIVATE_RUN_FILE = "private-run.json"  # in the organiser's state dir: {"run_id": ..., "organiser": ...}
CHECKPOINT_NAME = "checkpoint.pt"  # = node/checkpoint.py CHECKPOINT_NAME (not imported here: it loads torch)
SELF_INVITATION_DAYS = 365  # the organiser's own invitation, made again at each start
DEFAULT_INVITE_DAYS = 7.0
MAX_INVITE_DAYS = 3650.0
DAY_S = 86400.0


class AccessError(ValueError):
    """``--private`` or ``--invite`` cannot be used as given; the message is one line for the user."""


@dataclass(frozen=True)
class Access:
    """A node's part in its run: ``organiser`` (``RunSpec.organiser``) and ``invitation`` are None in a
    public run. ``run_id``: as given, or the one the state dir or the invitation names."""

    run_id: str
    organiser: str | None = None
    invitation: "Invitation | None" = None
    is_organiser: bool = False
    # (path, text) to save in the state dir once the node holds its lock and has checked its checkpoint
    # (NodeConfig.private_files): a refused start leaves the state dir as it was
    saves: tuple[tuple[Path, str], ...] = ()


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        raise AccessError(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_private_run(state_dir: Path) -> dict[str, str] | None:
    """The organiser's ``private-run.json`` in ``state_dir`` ({"run_id", "organiser"}), or None when absent.

    :raises AccessError: the file is there but unreadable or not ours.
    """
    path = state_dir / PRIVATE_RUN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(_read_text(path, "the private run file"))
        if not (isinstance(data, dict) and isinstance(data.get("run_id"), str)
                and isinstance(data.get("organiser"), str)):
            raise ValueError("not the run id and organiser")
    except ValueError:
        raise AccessError(f"{path} is damaged; write it again: "
                          '{"run_id": "<the run id>", "organiser": "<its organiser key>"}') from None
    return {"run_id": data["run_id"], "organiser": data["organiser"]}


def _invitation_text(value: str, prefix: str) -> str:
    """``--invite``: the text of an existing file, else the value itself (an invitation starts with ``prefix``)."""
    path = Path(value)
    try:
        is_file = len(value) < 4096 and path.is_file()
    except (OSError, ValueError):
        is_file = False
    if not is_file:
        if not value.strip().startswith(prefix):  # a mistyped file name, most likely
            shown = value if len(value) <= 200 else value[:197] + "..."
            raise AccessError(f"--invite {shown!r} is neither a file nor an invitation (which starts with "
                              f"{prefix!r}): ask the run's organiser for one (diloco-node invite)")
        return value
    if path.stat().st_size > 64 * 1024:
        raise AccessError(f"--invite {value}: this file is too large to be an invitation")
    return _read_text(path, "--invite")


def _check_run_id(invitation: "Invitation", run_id: str | None, where: str) -> str:
    if run_id is not None and run_id != invitation.run_id:
        raise AccessError(f"{where} is for run '{printable(invitation.run_id)}', not '{printable(run_id)}': "
                          f"join with --run-id {printable(invitation.run_id)} (or leave --run-id out)")
    return invitation.run_id


def resolve_access(*, run_id: str | None, state_dir: Path, state_dir_given: bool, private: bool,
                   invite: str | None, now: float) -> Access:
    """Decide this node's part in its run from ``--private``, ``--invite`` and the state dir; create the
    organiser key (``--private``, first start) and save the invitation (``--invite``) there.

    :param run_id: ``--run-id``, None when not given.
    :param now: unix seconds (utils/clock.py), for the invitations' expiry.
    :raises AccessError: contradicting flags, an invitation that is damaged, expired or for another
        run, or a state dir that belongs to another part.
    """
    from diloco_swarm import invites  # lazy: cryptography

    key_path = state_dir / invites.ORGANISER_KEY_FILE
    saved_path = state_dir / invites.INVITATION_FILE
    if private and invite is not None:
        raise AccessError("--private starts a private run and --invite joins one: give one of them")
    if private and not state_dir_given:
        raise AccessError("--private needs --state-dir: the run's organiser key is kept there, and "
                          "`diloco-node invite --state-dir DIR` reads it")
    try:
        if invite is not None:
            if key_path.exists():
                raise AccessError(f"state dir {state_dir} holds the organiser key of a private run: its node "
                                  "admits itself, drop --invite (a volunteer needs a state dir of its own)")
            text = _invitation_text(invite, invites.INVITATION_PREFIX)
            invitation = invites.parse_invitation(text, now=now)
            run_id = _check_run_id(invitation, run_id, "this invitation")
            return Access(run_id, invitation.organiser, invitation,  # a restart needs no --invite
                          saves=((saved_path, text.strip() + "\n"),))
        if private or key_path.exists():
            return _organiser_access(invites, state_dir, run_id, private, now)
        if saved_path.exists():
            try:
                invitation = invites.parse_invitation(_read_text(saved_path, "the saved invitation"), now=now)
            except invites.InvitationError as e:
                raise AccessError(f"{saved_path}, the invitation this node joined with, cannot be used: {e}; "
                                  "pass a new one with --invite") from None
            run_id = _check_run_id(invitation, run_id, f"the invitation saved in {saved_path}")
            return Access(run_id, invitation.organiser, invitation)
    except invites.InvitationError as e:
        raise AccessError(str(e)) from None
    except OSError as e:
        raise AccessError(f"state dir {state_dir}: {e.strerror or e}") from None
    return Access(run_id or DEFAULT_RUN_ID)


def _organiser_access(invites: Any, state_dir: Path, run_id: str | None, private: bool, now: float) -> Access:
    """The organiser's node: its key (created at the first ``--private`` start), its run, its own invitation."""
    if (state_dir / invites.INVITATION_FILE).exists():
        raise AccessError(f"state dir {state_dir} is a volunteer's (it holds an invitation): a private run's "
                          "organiser needs a state dir of its own; give another --state-dir")
    run = read_private_run(state_dir)
    if run is not None and run_id not in (None, run["run_id"]):
        if not private or (state_dir / CHECKPOINT_NAME).exists():
            raise AccessError(f"state dir {state_dir} is the organiser's of private run '{printable(run['run_id'])}': "
                              f"restart it with --run-id {printable(run['run_id'])} (or without --run-id), or start "
                              f"run '{printable(run_id)}' with another --state-dir")
        run = None  # --private, and nothing trained here under the old run id (its first start failed): take the new one
    key_path = state_dir / invites.ORGANISER_KEY_FILE
    if run is not None and not key_path.exists():  # a new key would make another run of the same name
        raise AccessError(f"{key_path} is missing: restore the organiser key that private run "
                          f"'{run['run_id']}' was started with")
    if private and not key_path.exists() and (state_dir / CHECKPOINT_NAME).exists():
        raise AccessError(f"state dir {state_dir} holds a checkpoint of a public run: --private starts a new "
                          "run, give it a new --state-dir")
    key = invites.organiser_key(state_dir, create=private)
    organiser = invites.public_key_text(key)
    if run is not None and run["organiser"] != organiser:
        raise AccessError(f"{state_dir / PRIVATE_RUN_FILE} names another organiser key than "
                          f"{key_path}: restore the key this run was started with")
    if run is None and run_id is None:  # a new private run under the shared default id would meet strangers' runs
        raise AccessError("--private starts a new run: name it with --run-id (volunteers' invitations carry it)")
    run_id = run_id or run["run_id"]
    saves = () if run is not None else (
        (state_dir / PRIVATE_RUN_FILE, json.dumps({"run_id": run_id, "organiser": organiser}) + "\n"),)
    invitation = invites.make_invitation(key, run_id, expires_at=now + SELF_INVITATION_DAYS * DAY_S)
    return Access(run_id, organiser, invitation, is_organiser=True, saves=saves)


def _utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix_s))


def invite(
    state_dir: Annotated[Path, typer.Option(help="State dir of the node that started the private run with --private (holds organiser.key).")],
    expires: Annotated[float, typer.Option(help=f"Days the invitation is valid (more than 0, at most {MAX_INVITE_DAYS:g}).")] = DEFAULT_INVITE_DAYS,
) -> None:
    """Print one invitation to the private run started in --state-dir (the run's organiser only).

    Save it to a file and give it to one volunteer, who joins with `diloco-node join --invite FILE`.
    Anyone who holds the text can join until it expires: send it as you would a password.
    """
    # lazy: cryptography
    from diloco_swarm import invites
    from diloco_swarm.utils import clock

    if not (math.isfinite(expires) and 0 < expires <= MAX_INVITE_DAYS):
        raise fail(f"--expires must be more than 0 and at most {MAX_INVITE_DAYS:g} days, got {expires}")
    try:
        key = invites.organiser_key(state_dir, create=False)
        run = read_private_run(state_dir)
        if run is None:
            raise AccessError(f"{state_dir / PRIVATE_RUN_FILE} does not exist: start the run with "
                              f"`diloco-node join --private --state-dir {state_dir}` first")
        if run["organiser"] != invites.public_key_text(key):
            raise AccessError(f"{state_dir / PRIVATE_RUN_FILE} names another organiser key than "
                              f"{state_dir / invites.ORGANISER_KEY_FILE}: restore the key this run was started with")
    except (invites.InvitationError, AccessError) as e:
        raise fail(str(e))
    except OSError as e:
        raise fail(f"state dir {state_dir}: {e.strerror or e}")
    expires_at = clock.now() + expires * DAY_S
    invitation = invites.make_invitation(key, run["run_id"], expires_at=expires_at)
    sys.stdout.write(invitation.text() + "\n")  # plain: no wrapping, so `> invite.txt` holds exactly the text
    sys.stdout.flush()
    run_id = printable(run["run_id"])
    err.print(f"invitation to private run '{run_id}', valid until {_utc(invitation.expires_at)}: save it to a file and "
              f"give it to one volunteer, who joins with `diloco-node join --run-id {run_id} --invite FILE "
              "--initial-peers ...` (anyone holding it can join until then)", soft_wrap=True, markup=False)
