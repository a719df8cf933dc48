"""AMQP 1.0 on qflowd's own port, end to end: real qflowd processes, and
python-qpid-proton as the standard client (its BlockingConnection, and a
Container sender that sends whenever it has credit).

Producer flow control holds every standard sender with both of 1.0's levers:
"A link whose target queue is flow-stopped ... gets no more credit", and "an
unsettled transfer is settled only when its completion is released, exactly
as a qflow transfer completes today" (docs/amqp.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from proton import Delivery, Message
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection, LinkDetached, SendException

import qflow
from qflow.testing import Daemon, start

pytestmark = pytest.mark.native_only  # the protocol is the same whichever accounting; once is enough


@pytest.fixture
def qflowd(tmp_path: Any) -> Iterator[Daemon]:
    d = start("--amqp-credit-window", "50", log=str(tmp_path / "qflowd.log"))
    try:
        yield d
    finally:
        d.stop()


def declare(d: Daemon, name: str, **arguments: int) -> None:
    async def main() -> None:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue(name, arguments=arguments or None)
    trio.run(main)


def stats(d: Daemon, name: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            return await ssn.query_queue(name)
    return trio.run(main)


def drain_with_qflow(d: Daemon, name: str, count: int) -> list[Any]:
    """Fetch ``count`` messages with qflow's own client (accepting them)."""
    async def main() -> list[Any]:
        got = []
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver(name, capacity=100)
            for _ in range(count):
                got.append(await receiver.fetch(timeout=20))
        return got
    return trio.run(main)


def test_a_message_goes_through_and_comes_back_intact(qflowd: Daemon) -> None:
    declare(qflowd, "q")
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        sender = conn.create_sender("q")
        sent = Message(body="hello", subject="s", properties={"n": 7}, durable=True, id="id-1",
                       content_type="text/plain")
        sender.send(sent)
        receiver = conn.create_receiver("q")
        got = receiver.receive(timeout=10)
        receiver.accept()
        assert (got.body, got.subject, got.properties, got.durable, got.id, got.content_type) == \
            ("hello", "s", {"n": 7}, True, "id-1", "text/plain")
    finally:
        conn.close()
    s = stats(qflowd, "q")
    assert (s["msgDepth"], s["msgTotalEnqueues"], s["msgTotalDequeues"]) == (0, 1, 1)


def test_an_unknown_address_is_refused_with_not_found(qflowd: Daemon) -> None:
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        with pytest.raises(LinkDetached, match="amqp:not-found"):
            conn.create_sender("nowhere")
    finally:
        conn.close()


def test_a_blocking_sender_is_held_by_a_stopped_queue_and_released(qflowd: Daemon) -> None:
    """"The Broker enforces flow control by delaying the completion of the
    Message.Transfer command that causes a message to be delivered to a queue
    with active flow control": a 1.0 transfer's settlement waits with it, and a
    sender that waits for each settlement (proton's BlockingSender) stops."""
    declare(qflowd, "q", **{"qpid.flow_stop_count": 10, "qpid.flow_resume_count": 5})
    sent = []

    def produce() -> None:
        conn = BlockingConnection(qflowd.address, timeout=60)
        try:
            sender = conn.create_sender("q")
            for i in range(30):
                sender.send(Message(body=f"m{i}"))
                sent.append(i)
        finally:
            conn.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while len(sent) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # it would go on if it were not held
    held_at = len(sent)
    s = stats(qflowd, "q")
    assert held_at <= 11 and s["flowStopped"] and s["msgDepth"] <= 11, (held_at, s)
    got = drain_with_qflow(qflowd, "q", 30)  # draining below resume releases it
    thread.join(timeout=30)
    assert not thread.is_alive() and sent == list(range(30))
    assert [m.body for m in got] == [f"m{i}".encode() for i in range(30)]  # nothing lost, in order


class CreditSender(MessagingHandler):
    """proton's simple_send: sends whenever it has credit, never waiting for settlement."""

    def __init__(self, url: str, address: str, total: int) -> None:
        super().__init__()
        self.url, self.address, self.total = url, address, total
        self.sent = self.settled = 0
        self.container: Container | None = None

    def on_start(self, event: Any) -> None:
        self.container = event.container
        conn = event.container.connect(self.url)
        event.container.create_sender(conn, self.address)

    def on_sendable(self, event: Any) -> None:
        while event.sender.credit and self.sent < self.total:
            event.sender.send(Message(body=f"c{self.sent}"))
            self.sent += 1

    def on_accepted(self, event: Any) -> None:
        self.settled += 1
        if self.settled == self.total:
            event.connection.close()


def test_a_credit_driven_sender_is_held_by_credit(qflowd: Daemon) -> None:
    """A sender that sends whenever it has credit (proton's Container, as in
    simple_send.py) is held too: a link whose transfers a stopped queue holds
    gets no more credit, so the depth stays within the stop plus the credit window."""
    declare(qflowd, "q", **{"qpid.flow_stop_count": 100, "qpid.flow_resume_count": 50})
    handler = CreditSender(qflowd.address, "q", 2000)
    container = Container(handler)
    thread = threading.Thread(target=container.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while handler.sent < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)
    s = stats(qflowd, "q")
    # The worst case: the stop, plus the link's credit window (50), plus the one credit of its attach.
    assert s["flowStopped"] and handler.sent <= 100 + 50 + 1 and s["msgDepth"] <= 151, (handler.sent, s)
    got = drain_with_qflow(qflowd, "q", 2000)
    thread.join(timeout=60)
    assert handler.settled == 2000
    assert [m.body for m in got] == [f"c{i}".encode() for i in range(2000)]


def test_qflow_messages_reach_a_1_0_receiver_mapped(qflowd: Daemon) -> None:
    declare(qflowd, "q")

    async def produce() -> None:
        async with qflow.open_connection("127.0.0.1", qflowd.port) as conn:
            sender = (await conn.session()).sender("q")
            await sender.send(b"body", message_id="m1", headers={"h": 1}, content_type="text/plain", durable=True)
            await sender.sync()

    trio.run(produce)
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        receiver = conn.create_receiver("q")
        got = receiver.receive(timeout=10)
        receiver.accept()
    finally:
        conn.close()
    assert (got.body, got.id, got.properties, got.content_type, got.durable) == \
        (b"body", "m1", {"h": 1}, "text/plain", True)


def test_1_0_messages_reach_a_qflow_consumer_mapped(qflowd: Daemon) -> None:
    declare(qflowd, "q")
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        conn.create_sender("q").send(Message(body=b"raw", id="x", properties={"k": "v"}))
    finally:
        conn.close()
    (got,) = drain_with_qflow(qflowd, "q", 1)
    assert got.body == b"raw" and got.message_id == "x" and got.headers == {"k": "v"}


class Outcomes(MessagingHandler):
    """Receives the one message again and again: released, then modified with
    delivery-failed, then rejected; records each delivery's delivery-count."""

    def __init__(self, url: str) -> None:
        super().__init__(auto_accept=False)
        self.url = url
        self.counts: list[int] = []

    def on_start(self, event: Any) -> None:
        event.container.create_receiver(event.container.connect(self.url), "q")

    def on_message(self, event: Any) -> None:
        self.counts.append(event.message.delivery_count)
        delivery = event.delivery
        if len(self.counts) == 1:
            delivery.update(Delivery.RELEASED)
        elif len(self.counts) == 2:
            delivery.local.failed = True
            delivery.update(Delivery.MODIFIED)
        else:
            delivery.update(Delivery.REJECTED)
        delivery.settle()
        if len(self.counts) == 3:
            event.connection.close()


def test_each_outcome(qflowd: Daemon) -> None:
    """accepted dequeues; released puts the message back; modified with
    delivery-failed puts it back with its delivery-count + 1; rejected drops it."""
    declare(qflowd, "q")
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        conn.create_sender("q").send(Message(body="m"))
    finally:
        conn.close()
    handler = Outcomes(qflowd.address)
    Container(handler).run()
    # Released: back, marked redelivered (delivery-count 1, as qpidd counts a return); modified with
    # delivery-failed: one more; rejected: gone (dequeued, not returned).
    assert handler.counts == [0, 1, 2]
    s = stats(qflowd, "q")
    assert (s["msgDepth"], s["msgTotalDequeues"]) == (0, 1)
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        conn.create_sender("q").send(Message(body="n"))
        receiver = conn.create_receiver("q")
        assert receiver.receive(timeout=10).body == "n"
        receiver.accept()
    finally:
        conn.close()
    s = stats(qflowd, "q")
    assert (s["msgDepth"], s["msgTotalDequeues"]) == (0, 2)


def test_a_dynamic_receiver_gets_a_queue_of_its_own(qflowd: Daemon) -> None:
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        receiver = conn.create_receiver(None, dynamic=True)
        address = receiver.remote_source.address
        assert address and address.startswith("amqp.dynamic.")
        conn.create_sender(address).send(Message(body="reply"))
        assert receiver.receive(timeout=10).body == "reply"
        receiver.accept()
        receiver.close()
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async def names() -> list[str]:
            async with qflow.open_connection("127.0.0.1", qflowd.port) as c:
                return await (await c.session()).list_queues()
        if address not in trio.run(names):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the dynamic queue {address} outlived its link")


def test_a_full_reject_queue_answers_rejected_with_resource_limit_exceeded(qflowd: Daemon) -> None:
    declare(qflowd, "q", **{"qpid.max_count": 2, "qpid.flow_stop_count": 0})
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        sender = conn.create_sender("q")
        sender.send(Message(body="1"))
        sender.send(Message(body="2"))
        with pytest.raises(SendException) as refused:
            sender.send(Message(body="3"))
        assert "REJECTED" in str(refused.value.state) or refused.value.state is not None
    finally:
        conn.close()
    assert stats(qflowd, "q")["msgDepth"] == 2


def test_a_persistent_1_0_message_survives_sigkill(tmp_path: Any) -> None:
    """A settled transfer of a durable message to a durable queue is on disk: kill -9 keeps it."""
    data = tmp_path / "data"
    d = start("--data-dir", str(data), log=str(tmp_path / "1.log"))
    try:
        async def declare_durable() -> None:
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                await (await conn.session()).declare_queue("dq", durable=True)
        trio.run(declare_durable)
        conn = BlockingConnection(d.address, timeout=20)
        sender = conn.create_sender("dq")
        for i in range(20):
            sender.send(Message(body=f"p{i}", durable=True))  # returns once settled: on disk
        d.kill()
    finally:
        d.stop()
    d = start("--data-dir", str(data), log=str(tmp_path / "2.log"))
    try:
        conn = BlockingConnection(d.address, timeout=20)
        try:
            receiver = conn.create_receiver("dq")
            got = []
            for _ in range(20):
                got.append(receiver.receive(timeout=10).body)
                receiver.accept()
        finally:
            conn.close()
        assert got == [f"p{i}" for i in range(20)]
    finally:
        d.stop()


def test_sasl_plain_against_the_users_file(tmp_path: Any) -> None:
    from qflow.auth.users_file import SaslDb
    from qflow.protocol.sasl import make_verifier

    path = tmp_path / "users.json"
    db = SaslDb.open(str(path), missing_ok=True)
    db.users["alice"] = make_verifier("secret")
    db.save()
    d = start("--sasl-db", str(path), log=str(tmp_path / "qflowd.log"))
    try:
        declare_as = BlockingConnection(d.address, timeout=20, user="alice", password="secret",
                                        allowed_mechs="PLAIN")
        declare_as.close()
        with pytest.raises(Exception):  # noqa: B017 - proton raises its own ConnectionException types
            BlockingConnection(d.address, timeout=20, user="alice", password="wrong", allowed_mechs="PLAIN")
        assert "authentication failed for user 'alice' (wrong password)" in d.log()
    finally:
        d.stop()


def test_transactions_and_filters_are_refused_by_name(qflowd: Daemon) -> None:
    declare(qflowd, "q")

    class Filtered(MessagingHandler):
        def __init__(self) -> None:
            super().__init__()
            self.error = None

        def on_start(self, event: Any) -> None:
            conn = event.container.connect(qflowd.address)
            from proton.reactor import Selector
            event.container.create_receiver(conn, "q", options=Selector("a = 1"))

        def on_link_error(self, event: Any) -> None:
            self.error = event.link.remote_condition
            event.connection.close()

        def on_link_opened(self, event: Any) -> None:
            pass

    handler = Filtered()
    Container(handler).run()
    assert handler.error is not None and handler.error.name == "amqp:not-implemented"
    assert "filter" in handler.error.description


def test_garbage_after_the_amqp_header_closes_with_a_reason(qflowd: Daemon) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", qflowd.port), timeout=10) as s:
        s.sendall(b"AMQP\x00\x01\x00\x00" + b"\x00\x00\x00\x10\x02\x00\x00\x00garbage!")
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"AMQP\x00\x01\x00\x00")
    assert b"amqp:" in data  # a close frame with its condition




def test_the_readme_proton_sender_is_held_and_released(qflowd: Daemon) -> None:
    """The README's proton example, run as it is: held after the stop, released by a drain."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "BlockingConnection" in block]
    declare(qflowd, "amqp-demo", **{"qpid.flow_stop_count": 10, "qpid.flow_resume_count": 5})
    proc = subprocess.Popen([sys.executable, "-c", code.replace("5672", str(qflowd.port))], stdout=subprocess.PIPE,
                            text=True)
    try:
        lines = []
        while len(lines) < 10:
            lines.append(proc.stdout.readline().strip())
        time.sleep(1)
        assert proc.poll() is None and stats(qflowd, "amqp-demo")["flowStopped"]  # held
        got = drain_with_qflow(qflowd, "amqp-demo", 20)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and (lines + out.split("\n"))[19] == "sent 19"
        assert [m.body for m in got] == [f"m{i}".encode() for i in range(20)]
    finally:
        proc.kill()


def test_a_browser_sees_every_message_and_takes_none(qflowd: Daemon) -> None:
    """distribution-mode copy: the messages are read, and stay."""
    from proton.reactor import Copy

    declare(qflowd, "q")
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        sender = conn.create_sender("q")
        for i in range(3):
            sender.send(Message(body=f"b{i}"))
        browser = conn.create_receiver("q", options=Copy())
        seen = [browser.receive(timeout=10).body for _ in range(3)]
        browser.accept()
    finally:
        conn.close()
    assert seen == ["b0", "b1", "b2"]
    s = stats(qflowd, "q")
    assert (s["msgDepth"], s["msgTotalDequeues"]) == (3, 0)


class Drainer(MessagingHandler):
    """Asks for 10 with drain on a queue of 3: gets the 3, then the drained flow."""

    def __init__(self, url: str) -> None:
        super().__init__(prefetch=0)
        self.url = url
        self.got: list[str] = []
        self.drained = False

    def on_start(self, event: Any) -> None:
        self.connection = event.container.connect(self.url)
        self.receiver = event.container.create_receiver(self.connection, "q")
        self.receiver.drain(10)
        self.timer = event.container.schedule(20, self)  # no drained flow in 20 s: give up (the test then fails)

    def on_timer_task(self, event: Any) -> None:
        self.connection.close()

    def on_message(self, event: Any) -> None:
        self.got.append(event.message.body)

    def on_link_flow(self, event: Any) -> None:
        # The broker's flow after the drain: the credit left (7) used up, none outstanding.
        if event.link.is_receiver and event.link.credit == 0 and len(self.got) == 3:
            self.drained = True
            self.timer.cancel()
            event.connection.close()


def test_drain_gets_what_there_is_then_the_credit_back(qflowd: Daemon) -> None:
    declare(qflowd, "q")
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        sender = conn.create_sender("q")
        for i in range(3):
            sender.send(Message(body=f"d{i}"))
    finally:
        conn.close()
    handler = Drainer(qflowd.address)
    Container(handler).run()
    assert handler.got == ["d0", "d1", "d2"] and handler.drained


def test_a_rejected_message_goes_to_its_queues_alternate_exchange(qflowd: Daemon) -> None:
    """rejected is a dead letter: it goes where the queue's dead letters go (x-dead-letter-exchange)."""
    declare(qflowd, "dlq")

    async def declare_source() -> None:
        async with qflow.open_connection("127.0.0.1", qflowd.port) as conn:
            await (await conn.session()).declare_queue(
                "q", arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    trio.run(declare_source)
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        conn.create_sender("q").send(Message(body="bad"))
        receiver = conn.create_receiver("q")
        assert receiver.receive(timeout=10).body == "bad"
        receiver.reject()
        dead = conn.create_receiver("dlq")
        assert dead.receive(timeout=10).body == "bad"
        dead.accept()
    finally:
        conn.close()
    assert stats(qflowd, "q")["deadLetters"] == 1
