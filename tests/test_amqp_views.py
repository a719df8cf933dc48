"""AMQP 1.0 connections "seen like any connection": their sessions and links
in /api/connections (with ``heldBy`` naming the queue that holds a sender),
in qflow-stat -c and -u with a protocol column, in the metrics (connections
per protocol), and an "opened" line in the connection log. Real qflowd, proton's BlockingConnection as the client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from proton import ConnectionException, Message
from proton.reactor import Container
from proton.utils import BlockingConnection

import qflow
from qflow.testing import Daemon, start

pytestmark = pytest.mark.native_only  # the protocol is the same whichever accounting; once is enough

BIN = Path(sys.executable).parent
DEADLINE = 30.0  # seconds for anything to happen on a slow machine; never a timing assertion


@pytest.fixture
def qflowd(tmp_path: Any) -> Iterator[Daemon]:
    d = start("--amqp-credit-window", "20", log=str(tmp_path / "qflowd.log"))
    try:
        yield d
    finally:
        d.stop()


def api(d: Daemon, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


def stat(d: Daemon, *args: str) -> list[list[str]]:
    out = subprocess.run([str(BIN / "qflow-stat"), "-b", f"127.0.0.1:{d.port}", *args], capture_output=True,
                         text=True, timeout=DEADLINE, check=True).stdout
    return [line.split() for line in out.splitlines()]


def declare(d: Daemon, name: str, **arguments: int) -> None:
    async def main() -> None:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            await (await conn.session()).declare_queue(name, arguments=arguments or None)
    trio.run(main)


def release(d: Daemon, name: str, count: int) -> None:
    async def main() -> None:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            receiver = await (await conn.session()).receiver(name, capacity=10)
            for _ in range(count):
                await receiver.fetch(timeout=DEADLINE)
    trio.run(main)


def wait_for(what: str, check: Any) -> Any:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"{what} within {DEADLINE} s")


def test_a_held_1_0_sender_and_a_1_0_receiver_are_seen(qflowd: Daemon) -> None:
    declare(qflowd, "held", **{"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
    declare(qflowd, "watched")
    container = Container()
    container.container_id = "amqp-watched"  # the connection's name in the views
    conn = BlockingConnection(qflowd.address, timeout=DEADLINE, container=container)
    stop = threading.Event()

    def produce() -> None:  # blocks on the 6th settlement: held
        sender = conn.create_sender("held")
        for i in range(6):
            if stop.is_set():
                return
            sender.send(Message(body=f"m{i}"))

    thread = threading.Thread(target=produce, daemon=True)
    try:
        receiver = conn.create_receiver("watched")
        thread.start()

        def held_session() -> Any:
            for c in api(qflowd, "/api/connections"):
                if c["name"] == "amqp-watched":
                    for s in c["sessions"]:
                        if s["heldBy"]:
                            return c, s
            return None

        c, s = wait_for("the 1.0 sender held in /api/connections", held_session)
        assert c["protocol"] == "amqp1.0" and c["user"] == "anonymous"
        assert [h["queue"] for h in s["heldBy"]] == ["held"] and s["flowStopped"] and s["heldTransfers"] >= 1
        assert len(c["sessions"]) == 2  # the sending link's, and the receiving links' session
        assert [sub["protocol"] for sub in api(qflowd, "/api/subscriptions") if sub["queue"] == "watched"] == \
            ["amqp1.0"]

        with urllib.request.urlopen(f"http://127.0.0.1:{qflowd.mgmt_port}/metrics", timeout=DEADLINE) as response:
            metrics = response.read().decode()
        by_protocol = {s.labels["protocol"]: s.value for f in text_string_to_metric_families(metrics)
                       for s in f.samples if s.name == "qflow_protocol_connections"}
        assert by_protocol["amqp1.0"] == 1 and by_protocol["qflow"] == 0, by_protocol
        assert api(qflowd, "/api/broker")["totals"]["connectionsByProtocol"]["amqp1.0"] == 1

        rows = stat(qflowd, "-c")
        assert rows[1][:5] == ["connection", "name", "user", "protocol", "connected"]
        ours = [r for r in rows if "amqp-watched" in r]
        assert ours and all(r[3] == "amqp1.0" for r in ours) and any("held" in r[-2:] for r in ours), rows
        qflow_rows = [r for r in rows[3:] if r[3] == "qflow"]  # qflow-stat's own connection, none other
        assert all("amqp-watched" not in r for r in qflow_rows)

        rows = stat(qflowd, "-u")
        assert rows[1][4] == "protocol"
        (sub,) = [r for r in rows[3:] if len(r) > 1 and r[1] == "watched"]
        assert sub[3] == "amqp-watched" and sub[4] == "amqp1.0"
        del receiver
    finally:
        stop.set()
        release(qflowd, "held", 6)  # the producer finishes before its connection closes (proton is not thread-safe)
        thread.join(timeout=DEADLINE)
        conn.close()
    assert "opened: name 'amqp-watched', user 'anonymous' (AMQP 1.0)" in qflowd.log()


def test_an_operator_closes_a_1_0_connection(qflowd: Daemon) -> None:
    """DELETE /api/connections/PEER: the client is told amqp:connection:forced with the reason."""
    declare(qflowd, "q")
    container = Container()
    container.container_id = "amqp-closed"
    conn = BlockingConnection(qflowd.address, timeout=DEADLINE, container=container)
    try:
        receiver = conn.create_receiver("q")
        (peer,) = [c["peer"] for c in api(qflowd, "/api/connections") if c["name"] == "amqp-closed"]
        request = urllib.request.Request(f"http://127.0.0.1:{qflowd.mgmt_port}/api/connections/{quote(peer, safe='')}",
                                         method="DELETE", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            assert json.loads(response.read()) == {"connection": peer, "closed": True}
        with pytest.raises(ConnectionException, match="amqp:connection:forced.*closed by an operator"):
            receiver.receive(timeout=DEADLINE)
    finally:
        try:
            conn.close()
        except ConnectionException:
            pass
    wait_for("the 1.0 connection gone", lambda: all(c["name"] != "amqp-closed"
                                                     for c in api(qflowd, "/api/connections")))
    assert "closed: name 'amqp-closed', user 'anonymous' (AMQP 1.0): closed by an operator" in qflowd.log()
