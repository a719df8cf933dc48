"""AMQP 1.0 with rhea, the JavaScript client, against real qflowd processes.

rhea is installed by make test's setup (the Makefile's ``$(RHEA)``: a pinned
rhea in the venv's node directory); the scripts it runs are tests/rhea/*.js.
A rhea sender puts whatever it sends in its session's window of unsettled
deliveries (2048) and sends from there while its link has credit, so
qflowd's credit is what holds it:
"A link whose target queue is flow-stopped ... gets no more credit", and the
depth stays within the documented worst case, the stop plus the link's
credit window plus the one credit of its attach (qflow/server/amqp_pump.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import qflow
from qflow.testing import Daemon, start

pytestmark = pytest.mark.native_only  # the protocol is the same whichever accounting; once is enough

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "rhea"
NODE_MODULES = ROOT / ".venv" / "node" / "node_modules"
CREDIT_WINDOW = 50


class Rhea:
    """A rhea script running under node, its JSON lines collected as they come."""

    def __init__(self, script: str, *args: Any) -> None:
        if not (NODE_MODULES / "rhea").is_dir():
            raise RuntimeError(f"rhea is not installed in {NODE_MODULES}: run make test's setup "
                               "(make .venv/node/node_modules/rhea/package.json)")
        env = dict(os.environ, NODE_PATH=str(NODE_MODULES))
        self.proc = subprocess.Popen(["node", str(SCRIPTS / script), *map(str, args)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}  # each key's latest value
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            self.lines.append(record)
            self.last.update(record)

    def wait_for(self, key: str, value: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.last.get(key, -1) < value and "error" not in self.last and time.monotonic() < deadline:
            time.sleep(0.02)

    def finish(self, timeout: float = 60) -> int:
        """Its exit code, once it ends (killed after ``timeout`` seconds)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=10)
        return code

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


@pytest.fixture
def qflowd(tmp_path: Any) -> Iterator[Daemon]:
    d = start("--amqp-credit-window", str(CREDIT_WINDOW), log=str(tmp_path / "qflowd.log"))
    try:
        yield d
    finally:
        d.stop()


def declare(d: Daemon, name: str, **arguments: int) -> None:
    async def main() -> None:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            await (await conn.session()).declare_queue(name, arguments=arguments or None)
    trio.run(main)


def stats(d: Daemon, name: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            return await (await conn.session()).query_queue(name)
    return trio.run(main)


def fetch_with_qflow(d: Daemon, name: str, count: int) -> list[Any]:
    async def main() -> list[Any]:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            receiver = await (await conn.session()).receiver(name, capacity=100)
            return [await receiver.fetch(timeout=20) for _ in range(count)]
    return trio.run(main)


def send_with_qflow(d: Daemon, name: str, bodies: list[bytes]) -> None:
    async def main() -> None:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            sender = (await conn.session()).sender(name)
            for body in bodies:
                await sender.send(body)
            await sender.sync()
    trio.run(main)


def test_a_rhea_sender_is_held_by_a_stopped_queue_and_released(qflowd: Daemon) -> None:
    declare(qflowd, "q", **{"qpid.flow_stop_count": 100, "qpid.flow_resume_count": 50})
    total = 2000
    rhea = Rhea("send.js", qflowd.port, "q", total)
    try:
        rhea.wait_for("accepted", 100)
        time.sleep(1)  # it would go on if qflowd's credit did not hold it
        s = stats(qflowd, "q")
        worst = 100 + CREDIT_WINDOW + 1
        # rhea takes all 2000 at once (its send only queues them, up to its session's 2048 unsettled);
        # what reaches the queue is what credit lets through.
        assert rhea.last["sent"] == total and rhea.last["accepted"] == 100, rhea.last
        assert s["flowStopped"] and 100 < s["msgTotalEnqueues"] <= worst and s["msgDepth"] <= worst, s
        time.sleep(0.5)
        assert stats(qflowd, "q")["msgTotalEnqueues"] == s["msgTotalEnqueues"]  # held, not slowed
        got = fetch_with_qflow(qflowd, "q", total)  # draining below the resume releases it
        assert rhea.finish() == 0, (rhea.last, rhea.stderr())
    finally:
        rhea.proc.kill()
    assert rhea.last["done"] == total
    assert [m.body for m in got] == [f"r{i}".encode() for i in range(total)]  # nothing lost, in order
    assert [m.message_id for m in got[:3]] == ["id-0", "id-1", "id-2"]
    assert stats(qflowd, "q")["msgDepth"] == 0


def test_a_rhea_receiver_ends_deliveries_with_each_outcome(qflowd: Daemon) -> None:
    """released puts the message back; modified with delivery-failed puts it
    back with its delivery-count + 1; rejected drops it; accepted dequeues."""
    declare(qflowd, "q")
    send_with_qflow(qflowd, "q", [b"one", b"two"])
    rhea = Rhea("outcomes.js", qflowd.port, "q", "release,modified,reject,accept")
    assert rhea.finish() == 0, (rhea.lines, rhea.stderr())
    got = [(line["body"], line["delivery_count"], line["outcome"]) for line in rhea.lines]
    one, two = {"data": "one"}, {"data": "two"}  # a qflow body reaches a 1.0 receiver as a data section
    assert got == [(one, 0, "release"), (one, 1, "modified"), (one, 2, "reject"), (two, 0, "accept")]
    s = stats(qflowd, "q")
    assert (s["msgDepth"], s["msgTotalDequeues"]) == (0, 2)


def test_rhea_authenticates_with_sasl_plain(tmp_path: Any) -> None:
    from qflow.auth.users_file import SaslDb
    from qflow.protocol.sasl import make_verifier

    path = tmp_path / "users.json"
    db = SaslDb.open(str(path), missing_ok=True)
    db.users["alice"] = make_verifier("secret")
    db.save()
    d = start("--sasl-db", str(path), log=str(tmp_path / "qflowd.log"))
    try:
        async def main() -> None:
            async with qflow.open_connection("127.0.0.1", d.port, username="alice", password="secret") as conn:
                await (await conn.session()).declare_queue("q")
        trio.run(main)
        rhea = Rhea("send.js", d.port, "q", 3, "alice", "secret")
        assert rhea.finish() == 0, (rhea.lines, rhea.stderr())
        assert rhea.last["done"] == 3
        refused = Rhea("send.js", d.port, "q", 3, "alice", "wrong")
        assert refused.finish() == 1
        assert "error" in refused.last, refused.lines
        assert "authentication failed for user 'alice' (wrong password)" in d.log()
    finally:
        d.stop()
