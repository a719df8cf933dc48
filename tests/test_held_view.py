"""Which producers are held, and by which queue, against a real qflowd over
loopback (issue 13): "a session appears as held (in /api/connections,
qflow-stat -c and the client's held_by) only while it still has a transfer
held. Once its held transfer is released on its own (its message was consumed
while the flow stayed on), it leaves the view." tests/test_flow_harness.py
runs the same rule deterministically in memory.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator

import pytest
import trio

import qflow
from qflow.testing import Daemon
from tests.conftest import start_qflowd, wait_for

TIMEOUT = 30  # for anything to happen on a slow machine; never a timing assertion


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = start_qflowd("--mgmt-port", "0")
    try:
        yield d
    finally:
        d.stop()


def _get(d: Daemon, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=TIMEOUT) as response:
        return json.load(response)


async def held_by(d: Daemon) -> dict[str, list[str]]:
    """Connection name -> the queues /api/connections says hold its session."""
    connections = await trio.to_thread.run_sync(_get, d, "/api/connections")
    out = {}
    for c in connections:
        for s in c["sessions"]:
            assert s["flowStopped"] == bool(s["heldBy"])
            if c["name"].startswith("producer-"):
                out[c["name"]] = [h["queue"] for h in s["heldBy"]]
    return out


async def stat_held(d: Daemon) -> dict[str, bool]:
    """Connection name -> whether qflow-stat -c shows its session held by "hv"."""
    result = await trio.run_process([sys.executable, "-m", "qflow.cli.qflow_stat", "-b",
                                     f"127.0.0.1:{d.port}", "-c"], capture_stdout=True, capture_stderr=True)
    rows = result.stdout.decode().splitlines()
    return {name: any(name in row and "hv (" in row for row in rows) for name in ("producer-a", "producer-b")}


async def consume(receiver: qflow.Receiver, n: int) -> None:
    """Take the next ``n`` messages and accept them; returns once they are dequeued.
    One receiver throughout: one closed would keep a message it had been sent
    and not handed out, acquired, away from the next."""
    for _ in range(n):
        (await receiver.fetch(timeout=TIMEOUT)).accept()
    await receiver.session.sync()


async def test_a_producer_leaves_the_held_view_once_its_held_message_is_consumed(daemon: Daemon):
    """Stop above 2 messages, resume below 1. Producer A sends 3 (its third is held),
    then B sends 1 (held). Consuming A's three lets A's held transfer go while the
    flow stays on for B's: A leaves every view at once, B stays. Consuming B's
    message resumes the flow, and B leaves too."""
    host, port = "127.0.0.1", daemon.port
    async with qflow.open_connection(host, port, name="producer-a") as ca, \
            qflow.open_connection(host, port, name="producer-b") as cb, \
            qflow.open_connection(host, port, name="consumer") as cc:
        a, b, c = await ca.session(), await cb.session(), await cc.session()
        await a.declare_queue("hv", arguments={"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
        send_a, send_b = a.sender("hv", capacity=5), b.sender("hv", capacity=5)
        for body in (b"a1", b"a2", b"a3"):
            await send_a.send(body)
        await wait_for(lambda: a.held_by)
        await send_b.send(b"b1")
        await wait_for(lambda: b.held_by)
        assert send_a.incomplete == send_b.incomplete == 1
        assert await held_by(daemon) == {"producer-a": ["hv"], "producer-b": ["hv"]}
        assert await stat_held(daemon) == {"producer-a": True, "producer-b": True}

        receiver = await c.receiver("hv", capacity=1, accept="explicit")
        await consume(receiver, 3)  # a1, a2, a3: 1 left, not below 1
        await wait_for(lambda: not a.held_by)  # A's notice: no longer held by "hv"
        with trio.fail_after(TIMEOUT):
            await send_a.sync()
        q = await c.query_queue("hv")
        assert (q["msgDepth"], q["flowStopped"], q["heldTransfers"]) == (1, True, 1)
        assert set(b.held_by) == {"hv"} and send_b.incomplete == 1
        assert await held_by(daemon) == {"producer-a": [], "producer-b": ["hv"]}
        assert await stat_held(daemon) == {"producer-a": False, "producer-b": True}

        await consume(receiver, 1)  # b1: the flow resumes
        with trio.fail_after(TIMEOUT):
            await send_b.sync()
        await wait_for(lambda: not b.held_by)
        assert (await c.query_queue("hv"))["flowStopped"] is False
        assert await held_by(daemon) == {"producer-a": [], "producer-b": []}
        assert await stat_held(daemon) == {"producer-a": False, "producer-b": False}
