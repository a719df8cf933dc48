"""qflow-send --send-rate with --timestamp yes: each message's ts is taken
after the pacing's wait, as qpid-send's is, so the latency qflow-receive
computes from it is the message's own and not the time it waited for its
slot. Checked by the order of the calls, not by timing."""

from __future__ import annotations

import pytest
import trio
from qflow.cli import qflow_send

import qflow
from tests.conftest import Daemon


async def test_ts_taken_after_the_pacing_wait(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    async with qflow.open_connection("127.0.0.1", daemon.port) as conn:
        await (await conn.session()).declare_queue("stamped")
    events: list[str] = []
    pace = qflow_send.pace

    async def pace_logged(previous: float, interval: float) -> float:
        events.append("pace")
        return await pace(previous, interval)

    ns = qflow_send.time.time_ns

    def stamp() -> int:
        events.append("stamp")
        return ns()

    monkeypatch.setattr(qflow_send, "pace", pace_logged)
    monkeypatch.setattr(qflow_send.time, "time_ns", stamp)
    args, url, options = qflow_send.client_setup(qflow_send.build_parser(), [
        "-b", f"127.0.0.1:{daemon.port}", "-a", "stamped", "--messages", "3", "--content-size", "8",
        "--send-rate", "1000", "--timestamp", "yes"])
    sent, _, _ = await trio.to_thread.run_sync(lambda: trio.run(qflow_send.send, args, url, options))
    assert sent == 3
    assert events == ["pace", "stamp"] * 3
