"""qflow.server.auth_guard in units, on trio's autojump clock (no real waiting)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from qflow.protocol import sasl
from qflow.server.admission import Throttle
from qflow.server.auth_guard import AuthGuard

pytestmark = pytest.mark.native_only


async def test_an_address_that_keeps_failing_gets_one_turn_per_most_seconds(autojump_clock):
    guard = AuthGuard(base=0.05, most=2.0, forget_after=60.0)
    start = trio.current_time()
    await guard.wait_turn("10.0.0.1")  # no failures: at once
    assert trio.current_time() == start
    for _ in range(8):
        guard.failed("10.0.0.1", "10.0.0.1:1", "alice", "wrong password")
    turns = []
    async with trio.open_nursery() as nursery:  # ten connections at once from that address
        for _ in range(10):
            async def one() -> None:
                await guard.wait_turn("10.0.0.1")
                turns.append(trio.current_time() - start)
            nursery.start_soon(one)
    assert turns == pytest.approx([2.0 * i for i in range(10)])
    began = trio.current_time()
    await guard.wait_turn("10.0.0.2")  # another address: at once
    assert trio.current_time() == began


async def test_failures_are_forgotten_after_a_quiet_spell(autojump_clock):
    guard = AuthGuard(base=1.0, most=8.0, forget_after=60.0)
    guard.failed("10.0.0.1", "10.0.0.1:1", "alice", "wrong password")
    await trio.sleep(61)
    t = trio.current_time()
    await guard.wait_turn("10.0.0.1")
    await guard.wait_turn("10.0.0.1")
    assert trio.current_time() == t


async def test_failures_are_logged_once_per_address_per_interval_with_a_count(autojump_clock, caplog):
    guard = AuthGuard(throttle=Throttle(10.0, trio.current_time))
    with caplog.at_level(logging.WARNING, logger="qflow.server"):
        for i in range(100):
            guard.failed("10.0.0.1", f"10.0.0.1:{i}", "alice", "wrong password")
        guard.failed("10.0.0.2", "10.0.0.2:1", "bob", "unknown user")
        await trio.sleep(10)
        guard.failed("10.0.0.1", "10.0.0.1:200", "alice", "wrong password")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[2].endswith("(99 more since the last such line)")
    assert guard.failed_total == 102


async def test_passwords_are_checked_in_a_worker_thread():
    guard = AuthGuard()
    verifier = sasl.make_verifier("right", 4096)
    assert await guard.check_password(verifier, "right")
    assert not await guard.check_password(verifier, "wrong")
