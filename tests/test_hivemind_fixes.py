"""The log filter that keeps hivemind's child processes from printing a traceback when a request
from an exiting node cannot be read (diloco_swarm.utils.hivemind_fixes)."""

import logging

import pytest

import diloco_swarm.utils.hivemind_fixes  # noqa: F401  (installs the filters)


def _log_from(func_name: str, logger_name: str, exc: BaseException, caplog) -> list[logging.LogRecord]:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, logging.ERROR, __file__, 1, exc, None,
                               (type(exc), exc, None), func=func_name)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=logger_name):
        logger.handle(record)
    return list(caplog.records)


@pytest.mark.parametrize("name,func", [("hivemind.dht.dht", "_run"), ("hivemind.averaging.averager", "_run_internal")])
def test_a_pipe_reset_in_the_request_loop_becomes_one_debug_line(caplog, name, func):
    records = _log_from(func, name, ConnectionResetError(104, "Connection reset by peer"), caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.DEBUG and records[0].exc_info is None
    assert "is it exiting?" in records[0].getMessage()


def test_other_errors_keep_their_traceback(caplog):
    records = _log_from("_run", "hivemind.dht.dht", RuntimeError("boom"), caplog)  # not a pipe error
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None
    records = _log_from("_store", "hivemind.dht.dht", ConnectionResetError(104, "x"), caplog)  # elsewhere
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None


def test_group_key_reads_are_paced():
    """hivemind re-reads the group key as soon as the last read returns; ours waits MIN_GROUP_POLL_S."""
    import asyncio
    import time

    from hivemind.averaging.key_manager import GroupKeyManager

    from diloco_swarm.utils.hivemind_fixes import MIN_GROUP_POLL_S

    assert getattr(GroupKeyManager.get_averagers, "__paced__", False)
    calls = []

    class FakeDHT:  # the real get_averagers reads the key through dht.get: count when it does
        async def get(self, *args, **kwargs):
            calls.append(time.monotonic())
            return None

    manager = GroupKeyManager.__new__(GroupKeyManager)
    manager.dht = FakeDHT()

    async def poll():
        for _ in range(4):
            assert await manager.get_averagers("run.0b", only_active=True) == []

    asyncio.run(poll())
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 4 and min(gaps) >= MIN_GROUP_POLL_S - 0.02, gaps
