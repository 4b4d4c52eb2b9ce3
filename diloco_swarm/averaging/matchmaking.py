"""Our rules on top of hivemind's matchmaking, one round at a time.

hivemind's ``Matchmaking`` keeps one group key, target size and quorum for the averager's life and
rotates the key itself. A round here brings its own (``average()`` gathers them: the planned group's
bits and size, the online peers, the plan's cap; :func:`round_settings`), sets them before the round
looks for a group (:func:`configure_round`), skips the leaders this peer avoids, and lowers the
target of a group still forming when planned members turn out gone (:class:`LateMembers`,
:func:`lower_target`): hivemind's leader otherwise begins only when its followers fill
``target_group_size`` or at its declared expiration time. :func:`await_group` is the caller's wait
for a round's group, and :func:`cancel_step` its way out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
import time
from typing import Any, Awaitable, Callable

from hivemind.averaging.control import AveragingStage
from hivemind.utils import MPFuture, get_logger

from diloco_swarm.averaging.grouping import grid_group_quorum, is_count
from diloco_swarm.averaging.request import RoundRequest
from diloco_swarm.utils import clock

logger = get_logger(__name__)

LATE_MEMBER_PROBE_EVERY_S = 0.5  # how often a group still forming past its members' due time asks which are gone
STILL_LOOKING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)


def round_settings(data_for_gather: bytes, serializer, *, default_target: int,
                   max_group_size: int) -> tuple[str, int, int | None, int]:
    """(group bits, target group size, online peers, the plan's cap) that ``average()`` gathered for a
    round (``RoundRequest.gather``, in hivemind's ``StepControl.data_for_gather``, read with the
    averager's ``serializer``): the defaults (no bits: the run's one key; ``default_target``) where
    they are missing or malformed. ``max_group_size``: the most peers a round may ask for."""
    try:
        _, _, user_data = serializer.loads(data_for_gather)
        data = serializer.loads(user_data)
    except Exception:
        data = {}
    data = data if isinstance(data, dict) else {}
    bits, target, online = data.get("group_bits"), data.get("group_size"), data.get("online_peers")
    cap = data.get("group_cap")
    if not (isinstance(bits, str) and len(bits) <= 64 and set(bits) <= {"0", "1"}):
        bits = ""
    # a planned group may hold one more than the cap (grouping.plan_round: nobody averages alone)
    if not is_count(target, 2, max_group_size + 1):
        target = default_target
    if not is_count(online):
        online = None
    if not is_count(cap, 2, max_group_size):
        cap = default_target
    return bits, target, online, cap


def configure_round(matchmaking, *, bits: str, target: int, quorum: int, avoids: Callable[[str], bool],
                    admits: Callable[[str], Awaitable[bool]]) -> None:
    """(averager process) Set hivemind's ``Matchmaking`` for the next round: its group ``bits``, target
    size and quorum (``min_group_size``); and, once, make it skip the leaders that ``avoids(peer id)``
    or that ``await admits(peer id)`` refuses (a private run's strangers), and keep the group bits we
    set instead of rotating them itself."""
    matchmaking.group_key_manager.group_bits = bits
    # hivemind's leader begins once its followers fill the target, whatever the quorum: a group
    # planned smaller than the quorum (late peers) waits for some of them
    matchmaking.target_group_size = max(target, quorum)
    matchmaking.min_group_size = quorum
    if getattr(matchmaking, "_skips_avoided_leaders", False):
        return
    request_join_group = matchmaking._request_join_group

    async def _request_join_group(leader):
        if avoids(leader.to_base58()) or not await admits(leader.to_base58()):
            return None  # hivemind's matchmaking then tries the next potential leader
        return await request_join_group(leader)

    async def keep_our_key(group_info):  # hivemind would rotate group bits itself; we set them per round
        return None

    matchmaking._request_join_group = _request_join_group
    matchmaking.group_key_manager.update_key_on_group_assembled = keep_our_key
    matchmaking._skips_avoided_leaders = True


async def lower_target(matchmaking, target: int) -> None:
    """(averager process) Lower the forming group's target size to ``target`` (≥ 2; planned members
    found gone). hivemind's leader begins when its followers fill ``target_group_size``
    (``Matchmaking.rpc_join_group``) or at the declared expiration time; lowering the target when no
    more followers will come begins it now, with at least ``min_group_size`` (the quorum)."""
    if matchmaking is None or not matchmaking.is_looking_for_group:
        return  # the group formed meanwhile (or the round ended): nothing to shorten
    async with matchmaking.lock_request_join_group:
        matchmaking.target_group_size = max(2, min(matchmaking.target_group_size or target, target))
        if matchmaking.group_key_manager.group_bits:  # a grid group: a majority of the members still coming
            matchmaking.min_group_size = min(matchmaking.min_group_size, grid_group_quorum(target))
        size = len(matchmaking.current_followers) + 1
        if (matchmaking.current_followers and matchmaking.current_leader is None
                and matchmaking.is_looking_for_group and not matchmaking.assembled_group.done()
                and size >= max(matchmaking.target_group_size, matchmaking.min_group_size)):
            logger.debug(f"beginning with {size} peers: the others planned for this round are gone")
            await matchmaking.leader_assemble_group()


class LateMembers:
    """The planned members of a forming group (``request.members``) that have not made it by their due
    time (``request.members_due``): which are gone or moved on (asked through ``request.gone`` and
    ``request.moved_on`` at most every :data:`LATE_MEMBER_PROBE_EVERY_S`), and the group's size without
    them (``size``, this peer included; at first ``request.group_size``, or ``default_size`` without
    one). With no ``gone`` or no due time it never asks."""

    def __init__(self, request: RoundRequest, *, default_size: int):
        self.members, self.gone, self.moved_on = list(request.members), request.gone, request.moved_on
        self.size = request.group_size or default_size
        self.lost: set[str] = set()
        self.moved: set[str] = set()  # of ``lost``: those that finished the round without us
        due = request.members_due
        self._next = due if due is not None else math.inf  # (unix s) the first ask

    def drop_gone(self) -> bool:
        """Ask once it is time; :returns: whether members were found gone or moved on since the last ask."""
        if self.gone is None or clock.now() < self._next:
            return False
        left = [p for p in self.members if p not in self.lost]
        found = self.gone(left) & set(left) if left else set()
        rest = [p for p in left if p not in found]
        moved = self.moved_on(rest) & set(rest) if rest and self.moved_on is not None else set()
        self._next = clock.now() + LATE_MEMBER_PROBE_EVERY_S
        if not found and not moved:
            return False
        self.lost |= found | moved
        self.moved |= moved
        self.size -= len(found) + len(moved)
        return True


def await_group(control, *, deadline: float, alive: Callable[[], bool], late: LateMembers,
                lower_target: Callable[[int], None], stop: threading.Event | None = None,
                give_up: threading.Event | None = None) -> tuple[Any, str | None]:
    """(caller's process) Wait for hivemind's step ``control`` (a ``StepControl``) to end.

    :param deadline: ``time.monotonic()`` past which the averager process counts as not answering.
    :param alive: whether the averager process is alive.
    :param late: the planned members not there yet; when some are found gone while the group still
        forms, ``lower_target(size)`` takes them off its target size.
    :param stop: when set, the round is abandoned; ``give_up``: when set while still looking for a group.
    :returns: ``(the step's result, None)``; or ``(None, why)`` after cancelling the step.
    :raises Exception: what the step raised (no group in the window, a failed all-reduce).
    """
    while True:
        try:
            return control.result(timeout=0.25), None
        except TimeoutError:
            if stop is not None and stop.is_set():
                cancel_step(control)
                return None, "stopping"
            if give_up is not None and give_up.is_set() and control.stage in STILL_LOOKING:
                cancel_step(control)
                return None, "no group before the next inner phase ended"
            dead = not alive()
            if dead or time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    cancel_step(control)
                return None, "the averager process is gone" if dead else "the averager did not answer"
            if control.stage in STILL_LOOKING and late.drop_gone():
                if late.size < 2:  # nobody planned is left to average with: do not wait out the window
                    cancel_step(control)
                    return None, ("the other planned members averaged without us (we were late)" if late.moved
                                  else "the other planned members are gone")
                lower_target(late.size)


def cancel_step(control) -> None:
    """``StepControl.cancel()`` in an order without hivemind's race (1.1.12): its ``cancel`` wakes the
    averager process (the ``_cancel`` future) before it marks the step cancelled, so the averager could
    read the step as live, go on with the group it then found and run its all-reduce after the node had
    left the round: a member that never confirms, and whose Δ it carries on while the others apply it
    (seen in a NAT test's dumps; 1 in ~15 give-ups in a 3-averager reproduction). The shared state first."""
    MPFuture.cancel(control)
    if control._trigger is not None:
        control._trigger.cancel()
    if control._cancel is not None and not control._cancel.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            control._cancel.set_result(None)
