"""A receiver with accept="auto" accepts in batches; what it fetched since the
last batch is accepted when the receiver, its session or its connection closes
cleanly, so nothing handled comes back. Leaving a connection's block on an
exception accepts nothing more: the broker puts those messages back. Against
a real qflowd; what the broker did is read from the management API.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import qflow
from qflow.testing import Daemon, start
from tests.shell_walkthrough import blocks

README = Path(__file__).resolve().parent.parent / "README.md"
DEADLINE = 60


@pytest.fixture(scope="module")
def qflowd() -> Iterator[Daemon]:
    d = start()
    yield d
    d.stop()


def stats(d: Daemon, queue: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/api/queues/{queue}", timeout=DEADLINE) as r:
        return json.loads(r.read())


def test_the_readme_client_run_twice_leaves_the_queue_empty(qflowd: Daemon) -> None:
    readme = README.read_text()
    python = next(lines for lang, _, lines in blocks(readme) if lang == "python" and "open_connection" in
                  "\n".join(lines))
    code = "\n".join(python).replace("5672", str(qflowd.port))
    for run in (1, 2):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)
        assert result.returncode == 0 and result.stdout == "b'hello'\n", result.stderr
        q = stats(qflowd, "greetings")
        assert (q["msgDepth"], q["msgTotalDequeues"]) == (0, run)


async def _send(d: Daemon, queue: str, n: int) -> None:
    async with qflow.open_connection("127.0.0.1", d.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue(queue)
        sender = ssn.sender(queue)
        await sender.send_many([b"m%d" % i for i in range(n)])
        await sender.sync()


async def test_a_clean_connection_close_accepts_what_was_fetched(qflowd: Daemon) -> None:
    await _send(qflowd, "conn-close", 5)
    conn = await qflow.connect("127.0.0.1", qflowd.port)
    ssn = await conn.session()
    receiver = await ssn.receiver("conn-close")  # accepts in batches of 500: these 3 are pending
    assert [(await receiver.fetch(timeout=DEADLINE)).body for _ in range(3)] == [b"m0", b"m1", b"m2"]
    await conn.close()
    q = stats(qflowd, "conn-close")
    assert (q["msgDepth"], q["msgTotalDequeues"]) == (2, 3)  # the 2 delivered and not fetched went back


async def test_a_session_close_accepts_what_was_fetched_and_the_connection_carries_on(qflowd: Daemon) -> None:
    await _send(qflowd, "ssn-close", 4)
    async with qflow.open_connection("127.0.0.1", qflowd.port) as conn:
        ssn = await conn.session()
        receiver = await ssn.receiver("ssn-close")
        await receiver.fetch(timeout=DEADLINE)
        await ssn.close()
        with pytest.raises(qflow.ConnectionClosed):
            await ssn.query_queue("ssn-close")
        await ssn.close()  # closing it again does nothing
        q = stats(qflowd, "ssn-close")
        assert (q["msgDepth"], q["msgTotalDequeues"]) == (3, 1)
        other = await conn.session()
        receiver = await other.receiver("ssn-close")
        again = await receiver.fetch(timeout=DEADLINE)
        assert again.body == b"m1" and again.redelivered  # delivered to the closed session, not fetched there
        await receiver.close()
    assert stats(qflowd, "ssn-close")["msgTotalDequeues"] == 2


async def test_leaving_the_block_on_an_exception_accepts_nothing_more(qflowd: Daemon) -> None:
    await _send(qflowd, "failed", 2)
    with pytest.raises(RuntimeError, match="not handled"):
        async with qflow.open_connection("127.0.0.1", qflowd.port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver("failed")
            await receiver.fetch(timeout=DEADLINE)
            raise RuntimeError("the message was not handled")
    q = stats(qflowd, "failed")
    assert (q["msgDepth"], q["msgTotalDequeues"]) == (2, 0)


async def test_explicit_and_none_receivers_are_not_accepted_for(qflowd: Daemon) -> None:
    await _send(qflowd, "explicit", 2)
    async with qflow.open_connection("127.0.0.1", qflowd.port) as conn:
        ssn = await conn.session()
        receiver = await ssn.receiver("explicit", accept="explicit")
        await receiver.fetch(timeout=DEADLINE)
    q = stats(qflowd, "explicit")
    assert (q["msgDepth"], q["msgTotalDequeues"]) == (2, 0)
