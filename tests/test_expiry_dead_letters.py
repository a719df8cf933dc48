"""Message expiry (a message's ``ttl``, a queue's ``x-message-ttl``) and dead
letters (a queue's ``alternate-exchange`` / ``x-dead-letter-exchange``, an
exchange's ``alternate-exchange``), and how both meet flow control. Run through
the in-memory harness with the broker's clock set by the test: no sleeping,
no timing. Every flow rule runs twice: transfers taken in runs (C) and frame
by frame."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.broker import finish
from qflow.protocol.entries import encode_tail, message_size, new_entry
from qflow.store.definitions import CONFIG_NAME, DefinitionStore, frame
from qflow.testing import Daemon, Harness, MemorySession, start
from tests.test_unsupported_arguments import api

T0 = 1_800_000_000_000  # ms since the Unix epoch


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    h = Harness(transfer_runs=request.param)
    h.now = [T0]
    h.broker.clock = lambda: h.now[0]
    return h


def send(h: Harness, ssn: MemorySession, queue: str, n: int, properties: dict | None = None,
         exchange: str = "") -> list[int]:
    ids = [ssn.transfer(queue, b"m%d" % i, exchange, properties) for i in range(n)]
    h.run()
    return ids


def receive(h: Harness, ssn: MemorySession, queue: str) -> list[bytes]:
    """Every message ``queue`` delivers now (accept mode none)."""
    before = len(ssn.deliveries)
    destination = f"r{before}"
    ssn.subscribe(queue, destination)
    ssn.call(P.CANCEL, destination)
    return [d.body for d in ssn.deliveries[before:]]


def expire(h: Harness) -> int:
    """What qflowd's --queue-purge-interval task does."""
    n = finish(h.broker.expire_steps())
    h.run()
    return n


def test_expired_messages_are_dropped_on_the_way_out_and_counted(harness: Harness) -> None:
    """A message whose ttl has passed is never delivered: it leaves the queue
    when it reaches the head, and is counted in discardsTtl."""
    p = harness.connect().session()
    p.declare_queue("q")
    send(harness, p, "q", 2, {"ttl": 1000})
    send(harness, p, "q", 1)
    send(harness, p, "q", 1, {"ttl": 5000})
    harness.now[0] = T0 + 1000
    stats = p.query("q")
    assert stats["msgDepth"] == 4 and stats["discardsTtl"] == 0  # nothing happens before anyone looks
    assert receive(harness, p, "q") == [b"m0", b"m0"]
    stats = p.query("q")
    assert stats["msgDepth"] == 0 and stats["discardsTtl"] == 2 and stats["msgTotalDequeues"] == 4


def test_the_expiry_is_absolute_and_stamped_on_arrival(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"x-message-ttl": 3000})
    send(harness, p, "q", 1, {"ttl": 1000})
    send(harness, p, "q", 1, {"ttl": 9000})  # the queue's is lower: it wins (as RabbitMQ's)
    send(harness, p, "q", 1)
    send(harness, p, "q", 1, {"ttl": 0})  # 0: no ttl of its own, as in Qpid
    harness.now[0] = T0 + 1
    c = harness.connect().session()
    c.subscribe("q", "all", credit=4)
    assert [d.properties["expiration"] for d in c.deliveries] == [T0 + 1000, T0 + 3000, T0 + 3000, T0 + 3000]
    assert c.deliveries[0].properties["ttl"] == 1000


def test_x_message_ttl_is_the_queue_default(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"x-message-ttl": 500})
    send(harness, p, "q", 3)
    harness.now[0] = T0 + 499
    assert expire(harness) == 0
    harness.now[0] = T0 + 500
    assert expire(harness) == 3
    assert p.query("q")["msgDepth"] == 0 and p.query("q")["discardsTtl"] == 3


def test_a_held_producer_is_released_when_the_messages_holding_it_expire(harness: Harness) -> None:
    """An expired message leaves its queue's depth exactly as a dequeue does:
    a producer held by the queue's flow control is released by the expiry."""
    p = harness.connect("producer").session()
    p.declare_queue("q", {"qpid.max_count": 100, "qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
    first = send(harness, p, "q", 5, {"ttl": 1000})
    held = send(harness, p, "q", 1, {"ttl": 1000})
    assert p.query("q")["flowStopped"] and p.incomplete(held) == held and p.held_by == {"q"}
    harness.now[0] = T0 + 1000
    assert expire(harness) == 6
    stats = p.query("q")
    assert not stats["flowStopped"] and stats["msgDepth"] == 0 and stats["discardsTtl"] == 6
    assert not p.incomplete(first + held) and p.held_by == set()


def test_a_consumer_arriving_after_the_expiry_releases_the_producer_too(harness: Harness) -> None:
    p = harness.connect("producer").session()
    p.declare_queue("q", {"qpid.max_count": 100, "qpid.flow_stop_count": 3, "qpid.flow_resume_count": 1})
    held = send(harness, p, "q", 4, {"ttl": 10})[3:]
    assert p.incomplete(held) == held
    harness.now[0] = T0 + 10
    c = harness.connect("consumer").session()
    assert receive(harness, c, "q") == []
    assert not p.incomplete(held) and not p.query("q")["flowStopped"]


def test_a_dead_letter_counts_on_its_new_queue_and_can_stop_its_flow(harness: Harness) -> None:
    """A dead letter arriving on another queue is an enqueue there, outside any
    transfer: it counts in that queue's depth and can stop that queue's flow,
    which then holds that queue's producers (and never the dead letter's)."""
    p = harness.connect("producer").session()
    p.declare_queue("dlq", {"qpid.max_count": 100, "qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    p.call(P.EXCHANGE_BIND, "amq.direct", "dlq", "dead")
    p.declare_queue("q", {"x-dead-letter-exchange": "amq.direct", "x-dead-letter-routing-key": "dead"})
    sent = send(harness, p, "q", 3, {"ttl": 100})
    harness.now[0] = T0 + 100
    assert expire(harness) == 3
    dlq = p.query("dlq")
    assert dlq["msgDepth"] == 3 and dlq["flowStopped"] and dlq["heldTransfers"] == 0
    assert not p.incomplete(sent) and p.held_by == set()
    other = harness.connect("other").session()
    held = send(harness, other, "dlq", 1)
    assert other.incomplete(held) == held and other.held_by == {"dlq"}
    c = harness.connect().session()
    got = c.deliveries
    c.subscribe("dlq", "d", credit=4)
    assert [d.body for d in got] == [b"m0", b"m1", b"m2", b"m0"]
    # Routed with the dead-letter routing key, without the expiry that made it one.
    assert got[0].routing_key == "dead" and got[0].exchange == "amq.direct"
    assert "expiration" not in (got[0].properties or {}) and "ttl" not in (got[0].properties or {})
    assert not other.incomplete(held)
    assert p.query("q")["deadLetters"] == 3 and p.query("q")["discardsTtl"] == 3


def test_a_dead_letter_to_a_full_queue_is_not_taken(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("dlq", {"qpid.max_count": 1})
    p.declare_queue("q", {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    send(harness, p, "q", 2, {"ttl": 1})
    harness.now[0] = T0 + 1
    expire(harness)
    assert p.query("dlq")["msgDepth"] == 1 and p.query("dlq")["discardsOverflow"] == 1


def test_ring_dropped_messages_go_to_the_alternate_exchange(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("dlq")
    p.declare_queue("ring", {"qpid.policy_type": "ring", "qpid.max_count": 2,
                             "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    send(harness, p, "ring", 5)
    assert p.query("ring")["discardsRing"] == 3 and p.query("ring")["deadLetters"] == 3
    assert receive(harness, p, "dlq") == [b"m0", b"m1", b"m2"]
    assert receive(harness, p, "ring") == [b"m3", b"m4"]


def test_dead_letter_is_a_dequeue_that_releases_held_producers(harness: Harness) -> None:
    """Broker.dead_letter (a client's reject): the entries leave the queue as
    an accept would, releasing the producers it held, and go to its alternate."""
    p = harness.connect("producer").session()
    p.declare_queue("dlq")
    p.declare_queue("q", {"qpid.max_count": 100, "qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1,
                          "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    held = send(harness, p, "q", 3)[2:]
    assert p.incomplete(held) == held
    q = harness.broker.queues["q"]
    rejected = [q.entries.popleft() for _ in range(3)]
    harness.broker.dead_letter(q, rejected)
    harness.broker.flush()
    harness.run()
    assert not p.incomplete(held) and not p.query("q")["flowStopped"]
    assert receive(harness, p, "dlq") == [b"m0", b"m1", b"m2"]


def test_an_exchange_alternate_takes_what_it_routes_nowhere(harness: Harness) -> None:
    """Unroutable through an exchange with an alternate: the message goes to the
    alternate (as part of the producer's transfer, so that exchange's queues'
    flow control applies to the producer), not dropped."""
    b = harness.broker
    b.declare_exchange("ae", "fanout")
    b.declare_exchange("orders", "direct", arguments={"alternate-exchange": "ae"})
    p = harness.connect().session()
    p.declare_queue("unrouted", {"qpid.max_count": 10, "qpid.flow_stop_count": 1, "qpid.flow_resume_count": 1})
    p.call(P.EXCHANGE_BIND, "ae", "unrouted", "")
    ids = send(harness, p, "nowhere", 2, exchange="orders")
    assert b.exchanges["orders"].msg_drop == 0 and b.discards_no_route == 0
    assert p.query("unrouted")["msgDepth"] == 2 and p.incomplete(ids) == ids[1:]
    assert receive(harness, p, "unrouted") == [b"m0", b"m1"]
    assert not p.incomplete(ids)


def test_a_browser_never_sees_an_expired_message(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q")
    send(harness, p, "q", 1, {"ttl": 5})
    send(harness, p, "q", 1)
    harness.now[0] = T0 + 5
    c = harness.connect().session()
    c.call(P.SUBSCRIBE, "q", "b", P.ACCEPT_NONE, P.ACQUIRE_NOT_ACQUIRED, 0)
    c.call(P.FLOW, "b", -1, -1)
    assert [d.body for d in c.deliveries] == [b"m0"] and c.deliveries[0].properties is None
    assert p.query("q")["discardsTtl"] == 1


def test_purge_and_available_count_the_expired_first(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q")
    send(harness, p, "q", 2, {"ttl": 5})
    send(harness, p, "q", 1)
    harness.now[0] = T0 + 5
    assert p.call(P.QUEUE_AVAILABLE, "q", 0, -1)["sequences"] == [3, 3]
    send(harness, p, "q", 1, {"ttl": 5})
    harness.now[0] = T0 + 10
    p.call(P.QUEUE_PURGE, "q")
    stats = p.query("q")
    assert stats["discardsTtl"] == 3 and stats["msgDepth"] == 0


def test_a_released_message_that_expired_while_acquired_is_dropped_next(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q")
    send(harness, p, "q", 1, {"ttl": 5})
    c = harness.connect().session()
    c.subscribe("q", "c", credit=1, accept=P.ACCEPT_EXPLICIT)
    assert len(c.deliveries) == 1
    harness.now[0] = T0 + 5
    c.call(P.RELEASE, [c.deliveries[0].delivery_id, c.deliveries[0].delivery_id])
    c.call(P.FLOW, "c", 1, -1)
    assert len(c.deliveries) == 1 and p.query("q")["discardsTtl"] == 1 and p.query("q")["msgDepth"] == 0


def test_recovered_messages_keep_their_expiry() -> None:
    """The expiry is in the stored entry's properties (``expiration``, absolute):
    a message recovered from the journal expires when it would have."""
    h = Harness()
    h.broker.clock = lambda: T0
    p = h.connect().session()
    p.declare_queue("q")
    q = h.broker.queues["q"]
    tails = [encode_tail("", "q", {"ttl": 10, "expiration": T0 - 1, "durable": True}, b"old"),
             encode_tail("", "q", {"durable": True}, b"expiration"),  # the word in a body is not an expiry
             encode_tail("", "q", None, b"kept")]
    q.restore([new_entry(i + 1, message_size(len(t), 4 if i != 1 else 10), t) for i, t in enumerate(tails)])
    h.broker.flush()
    assert receive(h, p, "q") == [b"expiration", b"kept"] and p.query("q")["discardsTtl"] == 1


def test_bad_ttl_arguments_are_refused_naming_them() -> None:
    h = Harness()
    p = h.connect().session()
    for arguments, words in (({"x-message-ttl": 0}, "x-message-ttl=0"),
                             ({"x-message-ttl": "1s"}, "x-message-ttl must be a non-negative integer"),
                             ({"x-dead-letter-exchange": 5}, "x-dead-letter-exchange must be an exchange's name"),
                             ({"x-dead-letter-routing-key": "k"}, "x-dead-letter-routing-key needs"),
                             ({"alternate-exchange": "a", "x-dead-letter-exchange": "b"}, "name different exchanges"),
                             ({"alternate-exchange": ""}, "alternate-exchange must be an exchange's name, not ''")):
        cid = p.command(P.QUEUE_DECLARE, "bad", False, False, False, arguments, False)
        h.run()
        code, text = p.failures[cid]
        assert code == P.INVALID_ARGUMENT and words in text, text
        p = h.connect().session()
    assert "bad" not in h.broker.queues


# -- end to end: qflowd's sweep (--queue-purge-interval) and its durable store ------------------------------------


def _stats(d: Daemon, queue: str) -> dict[str, Any]:
    status, view = api(d, "GET", f"/api/queues/{queue}")
    assert status == 200, view
    return view


async def _wait_for(predicate: Any, what: str) -> None:
    with trio.move_on_after(30):
        while not predicate():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"not within 30 s: {what}")


async def test_qflowd_sweeps_expired_messages_and_releases_the_producer(tmp_path: Path) -> None:
    """A queue nobody reads: its expired messages go at the next sweep, and the
    producer they held is released (its send returns)."""
    d = start("--queue-purge-interval", "0.05", "--data-dir", str(tmp_path / "data"))
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", arguments={"qpid.max_count": 100, "qpid.flow_stop_count": 2,
                                                    "qpid.flow_resume_count": 1})
            snd = ssn.sender("q", capacity=10)
            for i in range(3):
                await snd.send(b"m%d" % i, ttl=300)
            with trio.fail_after(30):
                await snd.sync()  # held by q until the three expire, then released by the sweep
            stats = _stats(d, "q")
            assert stats["msgDepth"] == 0 and stats["discardsTtl"] == 3 and not stats["flowStopped"]
    finally:
        d.stop()


async def test_a_durable_message_keeps_its_expiry_across_a_restart(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    d = start("--data-dir", data, "--queue-purge-interval", "0")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("dq", durable=True)
            snd = ssn.sender("dq", durable=True)
            sent = time.time_ns() // 1_000_000
            await snd.send(b"short", ttl=1)
            await snd.send(b"long", ttl=3_600_000)
            await snd.sync()
            done = time.time_ns() // 1_000_000
    finally:
        d.stop()  # nobody read, no sweep: both were journaled as they were stamped
    d = start("--data-dir", data, "--queue-purge-interval", "0.05")
    try:
        await _wait_for(lambda: _stats(d, "dq")["discardsTtl"] == 1, "the expired message swept after the restart")
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            rcv = await ssn.receiver("dq", browse=True)
            m = await rcv.fetch(timeout=30)
            assert m.body == b"long" and sent + 3_600_000 <= m.properties["expiration"] <= done + 3_600_000
        assert _stats(d, "dq")["msgDepth"] == 1
    finally:
        d.stop()


def test_a_durable_exchange_keeps_its_alternate_across_a_restart(tmp_path: Path) -> None:
    """The durable definitions keep an exchange's arguments; a record written
    before exchanges took arguments (three fields) still recovers."""
    store = DefinitionStore.open(tmp_path)
    broker = Broker()
    store.restore(broker)
    broker.declare_exchange("ae", "fanout", durable=True)
    broker.declare_exchange("orders", "direct", durable=True, arguments={"alternate-exchange": "ae", "x-team": "a"})
    store.close()
    with open(tmp_path / CONFIG_NAME, "ab") as f:  # as an older qflowd wrote it
        f.write(frame(["exchange", "old", "topic"]))
    again = Broker()
    DefinitionStore.open(tmp_path).restore(again)
    assert again.exchanges["orders"].arguments == {"alternate-exchange": "ae", "x-team": "a"}
    assert again.exchanges["orders"].alternate == "ae"
    assert again.exchanges["old"].type == "topic" and again.exchanges["old"].arguments == {}


async def test_a_persistent_dead_letter_on_a_durable_queue_survives_sigkill(tmp_path: Path) -> None:
    """A dead letter is a message whose transfer completed: it must never be lost. On a durable
    queue the store holds it as it holds a transfer (the broker's own), so it is journaled with
    its removal from the first queue, and a kill -9 keeps it where it went."""
    data = str(tmp_path / "data")
    d = start("--data-dir", data, "--queue-purge-interval", "0.05")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("dlq", durable=True)
            await ssn.declare_queue("src", durable=True, arguments={
                "x-message-ttl": 200, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
            snd = ssn.sender("src", durable=True)
            for i in range(5):
                await snd.send(b"d%d" % i)
            await snd.sync()
        await _wait_for(lambda: _stats(d, "dlq")["msgDepth"] == 5, "the five dead letters on dlq")
        await trio.sleep(0.5)  # the store's next commit (group commit: milliseconds)
        d.kill()
    finally:
        d.stop()
    d = start("--data-dir", data, "--queue-purge-interval", "0")
    try:
        assert _stats(d, "src")["msgDepth"] == 0
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            receiver = await (await conn.session()).receiver("dlq")
            got = [(await receiver.fetch(timeout=10)).body for _ in range(5)]
        assert sorted(got) == [b"d%d" % i for i in range(5)]
    finally:
        d.stop()
