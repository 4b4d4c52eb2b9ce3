"""In-band digest confirmation (averaging/confirm.py): what a member answers, to whom, and when.

The round itself, with real averagers on 127.0.0.1, is tested in tests/test_size_bound.py and
every swarm test (each kept round was confirmed this way); these are the untrusted-input rules.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.proto import averaging_pb2

from diloco_swarm.averaging.confirm import FAILED_MARK, OutcomeBoard, ask_outcomes, valid_outcome

GROUP = "ab" * 32
DIGEST = "0123456789abcdef"


def _ask(group_id: str) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=group_id.encode())


def test_valid_outcomes_are_a_16_hex_digest_or_failed():
    assert valid_outcome(DIGEST) == DIGEST and valid_outcome(FAILED_MARK) == FAILED_MARK
    for bad in ("", "0123456789ABCDEF", DIGEST + "0", DIGEST[:-1], "failed!", None, 7, b"failed"):
        assert valid_outcome(bad) == ""


def test_a_member_gets_our_outcome_once_we_know_it_and_nobody_else_gets_anything():
    async def main():
        board = OutcomeBoard()
        board.expect(GROUP, ["QmA", "QmB"])
        waiting = asyncio.ensure_future(board.answer(_ask(GROUP), "QmB", wait_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # we do not know our outcome yet: the asker waits
        board.settle(GROUP, DIGEST)
        assert (await waiting).metadata == DIGEST.encode()
        assert (await board.answer(_ask(GROUP), "QmC")).metadata == b""  # not a member
        assert (await board.answer(_ask("cd" * 32), "QmB")).metadata == b""  # not one of our rounds
        assert (await board.answer(_ask("x" * 10_000), "QmB")).metadata == b""  # oversized
        board.settle(GROUP, FAILED_MARK)  # the first outcome stands
        assert (await board.answer(_ask(GROUP), "QmA")).metadata == DIGEST.encode()

    asyncio.run(main())


def test_an_outcome_never_settled_is_answered_empty_after_the_wait():
    async def main():
        board = OutcomeBoard()
        board.expect(GROUP, ["QmA", "QmB"])
        assert (await board.answer(_ask(GROUP), "QmB", wait_s=0.05)).metadata == b""

    asyncio.run(main())


def test_only_the_most_recent_rounds_are_kept():
    async def main():
        board = OutcomeBoard(rounds_kept=2)
        for i in range(3):
            board.expect(f"{i:064x}", ["QmA"])
            board.settle(f"{i:064x}", DIGEST)
        assert (await board.answer(_ask(f"{0:064x}"), "QmA", wait_s=0.01)).metadata == b""
        assert (await board.answer(_ask(f"{2:064x}"), "QmA", wait_s=0.01)).metadata == DIGEST.encode()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_asking_keeps_valid_answers_and_drops_errors_garbage_and_silence():
    answers = {"QmOk": DIGEST, "QmFailed": FAILED_MARK, "QmGarbage": "not a digest", "QmLong": DIGEST + "00"}

    async def call(peer, request):
        assert request.metadata == GROUP.encode()
        if peer == "QmClient":
            raise RuntimeError("no handler")  # a client-mode peer serves none
        if peer == "QmSilent":
            await asyncio.sleep(60)
        return averaging_pb2.DownloadData(metadata=answers[peer].encode())

    async def main():
        return await ask_outcomes(call, GROUP, [*answers, "QmClient", "QmSilent"], timeout=0.2)

    assert asyncio.run(main()) == {"QmOk": DIGEST, "QmFailed": FAILED_MARK}
