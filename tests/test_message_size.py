"""A message's size, by example (docs/protocol.md, "Message size"): the bytes of
its exchange, routing key and properties as the transfer encoded them, plus
its body's length, not its bin header, as qpidd counts a 0-10 message's header
and content since QPID-5199. It is what byteDepth, qpid.max_size, the size
thresholds and byte credit count.

The examples run in the in-memory harness (deterministic, with the broker taking
transfers in runs and frame by frame) and over real sockets against a real
qflowd (``qflow.testing.start``). tests/test_transfer_runs.py checks that a run
and the frame-by-frame path count the same size for any message.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.testing import Daemon, Harness, MemorySession
from tests.conftest import start_qflowd, wait_for

TIMEOUT = 30  # for anything to happen on a slow machine; never a timing assertion


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    return Harness(transfer_runs=request.param)


def byte_depth(ssn: MemorySession, queue: str) -> int:
    return ssn.query(queue)["byteDepth"]


# -- the rule, in the harness ------------------------------------------------------------------------------


def test_the_size_of_a_message_to_orders_is_9_bytes_plus_its_body(harness: Harness):
    """docs/protocol.md's example: to the default exchange ("" is 1 byte) with routing
    key "orders" (0xa6 and 6 letters: 7), no properties (nil: 1) and 100 bytes of
    body, a message's size is 109; with an empty body, 9."""
    p = harness.connect().session()
    p.declare_queue("orders")
    p.transfer("orders", b"x" * 100)
    harness.run()
    assert byte_depth(p, "orders") == 109
    p.transfer("orders", b"")
    harness.run()
    assert byte_depth(p, "orders") == 109 + 9


def test_properties_count_as_encoded(harness: Harness):
    """{"message_id": "1"} is 14 bytes (0x81, 0xaa + "message_id", 0xa1 + "1") where nil was 1."""
    p = harness.connect().session()
    p.declare_queue("orders")
    p.transfer("orders", b"", properties={"message_id": "1"})
    harness.run()
    assert byte_depth(p, "orders") == 1 + 7 + 14


def test_an_exchange_counts_its_name_and_a_fanout_enqueues_the_same_size_everywhere(harness: Harness):
    """Through "fan" (0xa3 + 3 letters: 4) with an empty routing key (1) and nil
    properties (1), 10 bytes of body make a message of 16 on each bound queue."""
    p = harness.connect().session()
    p.call(P.EXCHANGE_DECLARE, "fan", "fanout", False, False)
    for q in ("a", "b"):
        p.declare_queue(q)
        p.call(P.EXCHANGE_BIND, "fan", q, "")
    for _ in range(3):
        p.transfer("", b"0123456789", exchange="fan")
    harness.run()
    assert byte_depth(p, "a") == byte_depth(p, "b") == 3 * 16


def test_empty_messages_fill_a_queue_up_to_its_size_stop(harness: Harness):
    """An empty-bodied message to "q" is 4 bytes ("" 1, "q" 2, nil 1): with a stop
    size of 40, the 11th is held (44 > 40), and a queue of empty messages never
    stays at 0 bytes."""
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.flow_stop_size": 40, "qpid.flow_resume_size": 20})
    free = [p.transfer("q", b"") for _ in range(10)]
    harness.run()
    assert not p.incomplete(free) and byte_depth(p, "q") == 40 and not p.query("q")["flowStopped"]
    held = p.transfer("q", b"")
    harness.run()
    stats = p.query("q")
    assert (stats["msgDepth"], stats["byteDepth"], stats["flowStopped"], stats["heldTransfers"]) == (11, 44, True, 1)
    assert p.incomplete([held]) == [held] and p.held_by == {"q"}


def test_max_size_refuses_an_empty_message_that_does_not_fit(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.max_size": 10, "qpid.flow_stop_size": 0, "qpid.flow_stop_count": 0})
    ok = [p.transfer("q", b"") for _ in range(2)]  # 8 bytes
    refused = p.transfer("q", b"")  # 12 > 10
    harness.run()
    assert not p.incomplete(ok) and refused in p.failures and p.failures[refused][0] == P.RESOURCE_LIMIT_EXCEEDED
    assert "'q' is full" in p.failures[refused][1] and byte_depth(p, "q") == 8


def test_byte_credit_counts_the_message_size(harness: Harness):
    """As qpidd charges a 0-10 consumer's byte credit getRequiredCredit() (header and
    content): a message of 109 bytes to "orders" needs 109 bytes of credit, not 100."""
    p = harness.connect().session()
    p.declare_queue("orders")
    p.transfer("orders", b"x" * 100)
    p.transfer("orders", b"x" * 100)
    harness.run()
    c = harness.connect().session()
    c.call(P.SUBSCRIBE, "orders", "short", P.ACCEPT_NONE, P.ACQUIRE_PRE_ACQUIRED, 0)
    c.call(P.FLOW, "short", -1, 108)
    assert c.deliveries == []
    c.call(P.FLOW, "short", 0, 1)  # 109 in all: one message, not both
    assert [d.body for d in c.deliveries] == [b"x" * 100]
    assert byte_depth(p, "orders") == 109


def test_a_released_message_keeps_its_size(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("orders")
    p.transfer("orders", b"x" * 100, properties={"message_id": "m"})
    harness.run()
    before = p.query("orders")
    c = harness.connect().session()
    c.subscribe("orders", "d", credit=1, accept=P.ACCEPT_EXPLICIT)
    c.call(P.RELEASE, [c.deliveries[0].delivery_id] * 2)
    c.call(P.CANCEL, "d")
    after = p.query("orders")
    assert after["byteDepth"] == before["byteDepth"] == 7 + 1 + 14 + 100
    c.subscribe("orders", "again", accept=P.ACCEPT_NONE)
    assert c.deliveries[-1].redelivered and byte_depth(p, "orders") == 0
    assert p.query("orders")["byteTotalDequeues"] == 122


# -- over real sockets, against a real qflowd ------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[Daemon]:
    """qflowd with a default queue limit of 10000 bytes: 80 % stops at 8000, 70 % resumes at 7000."""
    d = start_qflowd("--default-queue-limit", "10000")
    try:
        yield d
    finally:
        d.stop()


async def consume(receiver: qflow.Receiver, n: int) -> None:
    """Take the next ``n`` messages and accept them; returns once they are dequeued.
    One receiver throughout: one closed would keep a message it had been sent
    and not handed out, acquired (and counted in msgDepth)."""
    for _ in range(n):
        (await receiver.fetch(timeout=TIMEOUT)).accept()
    await receiver.session.sync()


async def test_a_count_stop_alone_keeps_the_default_size_stop_held_at_the_74th(limited):
    """Issue 13: --default-queue-limit 10000 and a queue declared with only
    qpid.flow_stop_count 1000. qpidd's resolution still gives it the size
    thresholds of 80 % / 70 % of 10000 (8000 / 7000), and the count resumes at its
    stop. Each message to "orders" is 1 ("") + 7 ("orders") + 1 (nil) + 100 (the
    body) = 109 bytes: 73 are 7957, not above 8000, and the 74th makes 8066, so it
    is the 74th that is held. (Counting bodies alone, it was the 81st: 8100.) Flow
    resumes below 7000 bytes: at 64 messages (6976), not 65 (7085)."""
    body = b"x" * 100
    async with qflow.open_connection("127.0.0.1", limited.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("orders", arguments={"qpid.flow_stop_count": 1000})
        s = await ssn.query_queue("orders")
        assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopSize"], s["flowResumeSize"]) == \
            (1000, 1000, 8000, 7000)
        sender = ssn.sender("orders", capacity=10)
        with trio.fail_after(TIMEOUT):
            for _ in range(73):
                await sender.send(body)
            await sender.sync()
        s = await ssn.query_queue("orders")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (73, 7957, False)
        await sender.send(body)  # the 74th
        await wait_for(lambda: ssn.held_by)
        s = await ssn.query_queue("orders")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"], s["heldTransfers"]) == (74, 8066, True, 1)
        assert sender.incomplete == 1 and set(ssn.held_by) == {"orders"}

        receiver = await (await conn.session()).receiver("orders", capacity=1, accept="explicit")
        await consume(receiver, 9)  # 65 left: 7085 bytes, not below 7000
        s = await ssn.query_queue("orders")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (65, 7085, True)
        assert sender.incomplete == 1
        await consume(receiver, 1)  # 64: 6976 < 7000, and 64 < 1000
        with trio.fail_after(TIMEOUT):
            await sender.sync()
        s = await ssn.query_queue("orders")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"], s["flowStoppedCount"]) == (64, 6976, False, 1)
        assert not ssn.held_by


async def test_empty_messages_fill_byte_depth_up_to_a_size_stop_and_hold_the_producer(limited):
    """An empty-bodied message to "empties" is 1 ("") + 9 ("empties") + 1 (nil) = 10
    bytes. With a stop size of 100, ten fill the queue to 100 bytes and the 11th
    (110) is held; the resume size of 50 lets it go once fewer than 5 are left."""
    async with qflow.open_connection("127.0.0.1", limited.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("empties", arguments={"qpid.flow_stop_size": 100, "qpid.flow_resume_size": 50})
        sender = ssn.sender("empties", capacity=5)
        with trio.fail_after(TIMEOUT):
            for _ in range(10):
                await sender.send(b"")
            await sender.sync()
        s = await ssn.query_queue("empties")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (10, 100, False)
        await sender.send(b"")
        await wait_for(lambda: ssn.held_by)
        s = await ssn.query_queue("empties")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"], s["heldTransfers"]) == (11, 110, True, 1)
        assert sender.incomplete == 1 and set(ssn.held_by) == {"empties"}

        receiver = await (await conn.session()).receiver("empties", capacity=1, accept="explicit")
        await consume(receiver, 6)  # 5 left: 50 bytes, not below 50
        assert (await ssn.query_queue("empties"))["flowStopped"] is True and sender.incomplete == 1
        await consume(receiver, 1)  # 40 < 50
        with trio.fail_after(TIMEOUT):
            await sender.sync()
        s = await ssn.query_queue("empties")
        assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (4, 40, False)
