"""End to end over loopback with the client library: routing, queues, limits,
redelivery, producer capacity and completion order, statistics, heartbeats.

Every test runs against an in-process broker (``running``) on a free port and
bounds itself with ``trio.fail_after``; nothing here asserts on timing.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
import trio

from qflow import protocol as P
from qflow.client import (
    ConnectionClosed,
    NotFound,
    PreconditionFailed,
    ReceivedMessage,
    Receiver,
    ResourceLimitExceeded,
    ResourceLocked,
    Session,
)
from qflow.protocol.framing import PROTOCOL_HEADER

TIMEOUT = 30  # generous: a slow, noisy machine must still pass
# Limits without producer flow control: both stop thresholds 0, the manual's per-queue switch. (One stop
# key at 0 was enough under qflow's old rule; qpidd pre-fills the other unit's stop from the limit.)
NO_FLOW = {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0}


# -- helpers -------------------------------------------------------------------
async def depth(ssn: Session, queue: str) -> int:
    return (await ssn.query_queue(queue))["msgDepth"]


async def wait_until(cond: Callable[[], bool]) -> None:
    """Poll ``cond``; the caller's fail_after bounds the wait."""
    while not cond():
        await trio.sleep(0.01)


async def fetch_n(receiver: Receiver, n: int) -> list[ReceivedMessage]:
    return [await receiver.fetch() for _ in range(n)]


async def drain(ssn: Session, queue: str) -> list[bytes]:
    """Every message on ``queue`` (depth taken first), dequeued; checks the queue ends empty."""
    n = await depth(ssn, queue)
    receiver = await ssn.receiver(queue, accept="none", capacity=max(n, 1))
    bodies = [m.body for m in await fetch_n(receiver, n)]
    await receiver.close()
    await ssn.sync()
    assert await depth(ssn, queue) == 0
    return bodies


async def send_all(ssn: Session, address: str, bodies: list[bytes], **kwargs) -> None:
    sender = ssn.sender(address, capacity=1000)
    for body in bodies:
        await sender.send(body, **kwargs)
    await sender.sync()
    sender.close()


# -- default exchange, round robin, credit -------------------------------------
async def test_send_receive_default_exchange(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("plain")
        sender = ssn.sender("plain", capacity=10)
        for i in range(20):
            await sender.send(f"m{i}")
        await sender.sync()
        assert sender.incomplete == 0
        receiver = await ssn.receiver("plain", capacity=7)
        got = await fetch_n(receiver, 20)
        assert [m.body for m in got] == [f"m{i}".encode() for i in range(20)]
        assert all(m.exchange == "" and m.routing_key == "plain" and not m.redelivered for m in got)
        await receiver.close()
        await ssn.sync()
        assert await depth(ssn, "plain") == 0


async def test_round_robin_across_sessions_and_consumers_respects_credit(running):
    with trio.fail_after(TIMEOUT):
        conns = [await running.connect() for _ in range(3)]
        try:
            ssns = [await c.session() for c in conns]
            await ssns[0].declare_queue("rr")
            # Subscribed first, credit 1, never fetches: the broker may give it one message only.
            stingy = await ssns[0].receiver("rr", capacity=1, accept="explicit")
            fast = [await ssns[1].receiver("rr", capacity=100),
                    await ssns[2].receiver("rr", capacity=100),
                    await ssns[2].receiver("rr", capacity=100)]
            for s in ssns:
                await s.sync()  # every subscription and its credit is in place
            assert (await ssns[0].query_queue("rr"))["consumerCount"] == 4
            bodies = [b"%03d" % i for i in range(40)]
            await send_all(ssns[1], "rr", bodies)

            assert stingy.available() <= 1
            await wait_until(lambda: sum(r.available() for r in fast) + stingy.available() == 40)
            for s in ssns:
                await s.sync()
            assert stingy.available() == 1
            per_consumer = [[m.body for m in await fetch_n(r, r.available())] for r in fast]
            counts = [len(b) for b in per_consumer]
            assert sum(counts) == 39
            assert max(counts) - min(counts) <= 1, counts  # round robin among those with credit
            for got in per_consumer:
                assert got == sorted(got)  # FIFO per consumer
            stingy_msg = await stingy.fetch()
            assert sorted([b for got in per_consumer for b in got] + [stingy_msg.body]) == bodies
            for r in fast:
                await r.close()
            for s in ssns:
                await s.sync()
            assert await depth(ssns[0], "rr") == 1  # only the stingy consumer's unaccepted message
            stingy_msg.accept()
            await ssns[0].sync()
            assert await depth(ssns[0], "rr") == 0
        finally:
            for c in reversed(conns):  # each connection's nursery nests in the previous one's
                await c.close()


# -- exchanges -----------------------------------------------------------------
async def test_amq_direct_bind_unbind(ssn):
    with trio.fail_after(TIMEOUT):
        for q in ("d1", "d2"):
            await ssn.declare_queue(q)
        await ssn.bind("amq.direct", "d1", "k1")
        await ssn.bind("amq.direct", "d2", "k1")
        await ssn.bind("amq.direct", "d2", "k2")
        assert (await ssn.query_queue("d2"))["bindingCount"] == 3  # with the default exchange's
        await send_all(ssn, "amq.direct/k1", [b"one"])
        await send_all(ssn, "amq.direct/k2", [b"two"])
        await send_all(ssn, "amq.direct/d1", [b"not-a-binding"])  # amq.direct knows no queue-name keys
        assert await drain(ssn, "d1") == [b"one"]
        assert await drain(ssn, "d2") == [b"one", b"two"]
        await ssn.unbind("amq.direct", "d2", "k1")
        assert (await ssn.query_queue("d2"))["bindingCount"] == 2
        await send_all(ssn, "amq.direct/k1", [b"three"])
        assert await drain(ssn, "d1") == [b"three"]
        assert await drain(ssn, "d2") == []


async def test_amq_fanout(ssn):
    with trio.fail_after(TIMEOUT):
        for q in ("f1", "f2", "f3"):
            await ssn.declare_queue(q)
        await ssn.bind("amq.fanout", "f1")
        await ssn.bind("amq.fanout", "f2", "whatever")
        await send_all(ssn, "amq.fanout/any.key", [b"a", b"b"])
        assert await drain(ssn, "f1") == [b"a", b"b"]
        assert await drain(ssn, "f2") == [b"a", b"b"]
        assert await drain(ssn, "f3") == []
        await ssn.unbind("amq.fanout", "f1")
        await send_all(ssn, "amq.fanout/x", [b"c"])
        assert await drain(ssn, "f1") == []
        assert await drain(ssn, "f2") == [b"c"]


TOPIC_BINDINGS = {"t.star": "a.*", "t.hash": "a.#", "t.all": "#", "t.mid": "*.b.#", "t.exact": "a.b"}
TOPIC_ROUTES = {
    "a": {"t.hash", "t.all"},
    "a.b": {"t.star", "t.hash", "t.all", "t.mid", "t.exact"},
    "a.b.c": {"t.hash", "t.all", "t.mid"},
    "x.b": {"t.all", "t.mid"},
    "x.y": {"t.all"},
    "b": {"t.all"},
}


async def check_topic(ssn: Session, exchange: str) -> None:
    for q, key in TOPIC_BINDINGS.items():
        await ssn.declare_queue(q)
        await ssn.bind(exchange, q, key)
    for key in TOPIC_ROUTES:
        await send_all(ssn, f"{exchange}/{key}", [key.encode()])
    for q in TOPIC_BINDINGS:
        expected = [key.encode() for key, queues in TOPIC_ROUTES.items() if q in queues]
        assert await drain(ssn, q) == expected, q
    await ssn.unbind(exchange, "t.hash", "a.#")
    await send_all(ssn, f"{exchange}/a.b.c", [b"after-unbind"])
    assert await drain(ssn, "t.hash") == []
    assert await drain(ssn, "t.mid") == [b"after-unbind"]


async def test_amq_topic_star_and_hash(ssn):
    with trio.fail_after(TIMEOUT):
        await check_topic(ssn, "amq.topic")


@pytest.mark.parametrize("type_", ["direct", "fanout", "topic"])
async def test_custom_exchange(ssn, type_):
    with trio.fail_after(TIMEOUT):
        name = f"custom.{type_}"
        assert (await ssn.declare_exchange(name, type_))["created"] is True
        assert (await ssn.declare_exchange(name, type_))["created"] is False
        if type_ == "topic":
            await check_topic(ssn, name)
            return
        await ssn.declare_queue("c1")
        await ssn.declare_queue("c2")
        await ssn.bind(name, "c1", "k")
        await ssn.bind(name, "c2", "other")
        await send_all(ssn, f"{name}/k", [b"m"])
        if type_ == "direct":
            assert await drain(ssn, "c1") == [b"m"]
            assert await drain(ssn, "c2") == []
        else:
            assert await drain(ssn, "c1") == [b"m"]
            assert await drain(ssn, "c2") == [b"m"]
        await ssn.unbind(name, "c1", "k")
        await send_all(ssn, f"{name}/k", [b"n"])
        assert await drain(ssn, "c1") == []
        assert await drain(ssn, "c2") == ([] if type_ == "direct" else [b"n"])


async def test_transfer_landing_on_no_queue_completes(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("bystander")
        await ssn.declare_exchange("empty.fanout", "fanout")
        # A held transfer on the same session must not delay the unroutable ones.
        await ssn.declare_queue("stopped", arguments={"qpid.flow_stop_count": 1})
        held = ssn.sender("stopped", capacity=10)
        for i in range(3):
            await held.send(b"%d" % i)
        await wait_until(lambda: held.incomplete == 2)
        for address in ("amq.direct/nobody", "amq.topic/no.one", "empty.fanout/x", "no-such-queue"):
            sender = ssn.sender(address, capacity=5)
            for _ in range(5):
                await sender.send(b"lost")
            await sender.sync()
            assert sender.incomplete == 0
        assert held.incomplete == 2
        assert await depth(ssn, "bystander") == 0
        assert await depth(ssn, "stopped") == 3


async def test_message_properties_round_trip(ssn):
    with trio.fail_after(TIMEOUT):
        for q in ("props1", "props2"):
            await ssn.declare_queue(q)
            await ssn.bind("amq.fanout", q)
        headers = {"int": -7, "str": "é", "list": [1, "two"], "map": {"k": True}, "float": 1.5, "none": None,
                   "bin": b"\x00\xff"}
        sender = ssn.sender("amq.fanout/rk", capacity=5)
        await sender.send(b"body", message_id="mid-1", correlation_id="cid-9",
                          content_type="application/x-test", durable=True, headers=headers)
        await sender.send(b"bare")
        await sender.sync()
        for q in ("props1", "props2"):
            receiver = await ssn.receiver(q)
            m = await receiver.fetch()
            assert (m.body, m.exchange, m.routing_key) == (b"body", "amq.fanout", "rk")
            assert m.message_id == "mid-1"
            assert m.correlation_id == "cid-9"
            assert m.content_type == "application/x-test"
            assert m.durable is True
            assert m.headers == headers
            bare = await receiver.fetch()
            assert bare.body == b"bare"
            assert (bare.message_id, bare.correlation_id, bare.content_type, bare.durable, bare.headers) == (
                None, None, None, False, {})


# -- limits and policies --------------------------------------------------------
async def test_max_count_reject(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("lim", arguments={"qpid.max_count": 3, **NO_FLOW})
        sender = ssn.sender("lim", capacity=10)
        for i in range(3):
            await sender.send(b"%d" % i)
        await sender.sync()
        await sender.send(b"overflow")
        with pytest.raises(ResourceLimitExceeded) as err:
            await sender.sync()
        assert "'lim'" in err.value.text
        assert err.value.code == P.RESOURCE_LIMIT_EXCEEDED
        stats = await ssn.query_queue("lim")
        assert stats["msgDepth"] == 3
        assert stats["msgTotalEnqueues"] == 3
        assert stats["discardsOverflow"] == 1
        assert stats["policyType"] == "reject"
        # The session carries on.
        await ssn.declare_queue("after-reject")
        await send_all(ssn, "after-reject", [b"fine"])
        assert await drain(ssn, "after-reject") == [b"fine"]
        assert await drain(ssn, "lim") == [b"0", b"1", b"2"]
        # Room again: the same sender works.
        await sender.send(b"3")
        await sender.sync()
        assert await drain(ssn, "lim") == [b"3"]


async def test_max_size_reject(ssn):
    """qpid.max_size counts message sizes: to "lim.size" on the default exchange
    with no properties, 11 bytes ("" 1, "lim.size" 9, nil 1) plus the body."""
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("lim.size", arguments={"qpid.max_size": 100, **NO_FLOW})
        sender = ssn.sender("lim.size", capacity=10)
        await sender.send(b"x" * 60)  # 71 bytes
        await sender.sync()
        await sender.send(b"y" * 19)  # 30 more: 101 > 100
        with pytest.raises(ResourceLimitExceeded) as err:
            await sender.sync()
        assert "'lim.size'" in err.value.text
        stats = await ssn.query_queue("lim.size")
        assert (stats["msgDepth"], stats["byteDepth"], stats["discardsOverflow"]) == (1, 71, 1)
        await sender.send(b"z" * 18)  # 29 more: exactly at the limit
        await sender.sync()
        assert (await ssn.query_queue("lim.size"))["byteDepth"] == 100
        assert await drain(ssn, "lim.size") == [b"x" * 60, b"z" * 18]


async def test_reject_on_fanout_enqueues_nowhere(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_exchange("fan.ex", "fanout")
        await ssn.declare_queue("fan.free")
        await ssn.declare_queue("fan.full", arguments={"qpid.max_count": 1, **NO_FLOW})
        await ssn.bind("fan.ex", "fan.free")  # bound first: routed to before the full one
        await ssn.bind("fan.ex", "fan.full")
        await send_all(ssn, "fan.full", [b"filler"])
        sender = ssn.sender("fan.ex/k", capacity=5)
        await sender.send(b"both-or-none")
        with pytest.raises(ResourceLimitExceeded) as err:
            await sender.sync()
        assert "'fan.full'" in err.value.text
        free, full = await ssn.query_queue("fan.free"), await ssn.query_queue("fan.full")
        assert (free["msgDepth"], free["msgTotalEnqueues"]) == (0, 0)
        assert (full["msgDepth"], full["msgTotalEnqueues"], full["discardsOverflow"]) == (1, 1, 1)
        assert await drain(ssn, "fan.full") == [b"filler"]
        await sender.send(b"now-fits")
        await sender.sync()
        assert await drain(ssn, "fan.free") == [b"now-fits"]
        assert await drain(ssn, "fan.full") == [b"now-fits"]


async def test_ring_drops_oldest(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("ring", arguments={"qpid.max_count": 3, "qpid.policy_type": "ring"})
        sender = ssn.sender("ring", capacity=10)
        for i in range(5):
            await sender.send(b"%d" % i)
        await sender.sync()  # no refusal
        stats = await ssn.query_queue("ring")
        assert (stats["msgDepth"], stats["discardsRing"], stats["discardsOverflow"]) == (3, 2, 0)
        assert stats["msgTotalEnqueues"] == 5
        assert await drain(ssn, "ring") == [b"2", b"3", b"4"]


async def test_ring_strict(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("strict", arguments={"qpid.max_count": 2, "qpid.policy_type": "ring-strict"})
        sender = ssn.sender("strict", capacity=10)
        for i in range(3):
            await sender.send(b"%d" % i)
        await sender.sync()  # nothing acquired: the oldest is dropped, as ring
        stats = await ssn.query_queue("strict")
        assert (stats["msgDepth"], stats["discardsRing"]) == (2, 1)

        # Acquire the oldest (delivered, not accepted): it cannot be dropped, so the queue refuses.
        receiver = await ssn.receiver("strict", capacity=1, accept="explicit")
        await wait_until(lambda: receiver.available() == 1)
        await sender.send(b"3")
        with pytest.raises(ResourceLimitExceeded) as err:
            await sender.sync()
        assert "'strict'" in err.value.text
        stats = await ssn.query_queue("strict")
        assert (stats["msgDepth"], stats["discardsRing"], stats["discardsOverflow"]) == (2, 1, 1)
        assert stats["msgTotalEnqueues"] == 3
        # The session carries on; once accepted, there is room again.
        m = await receiver.fetch()
        assert m.body == b"1"
        m.accept()
        await ssn.sync()
        assert await depth(ssn, "strict") == 1
        await sender.send(b"4")
        await sender.sync()
        m = await receiver.fetch()
        assert m.body == b"2"
        m.accept()
        assert (await receiver.fetch()).body == b"4"


# -- redelivery -------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "drop"])
async def test_unaccepted_go_back_redelivered_in_order_when_connection_ends(running, ssn, how):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("redeliver")
        bodies = [b"m%d" % i for i in range(8)]
        await send_all(ssn, "redeliver", bodies)
        other = await running.connect()
        try:
            ossn = await other.session()
            receiver = await ossn.receiver("redeliver", capacity=5, accept="explicit")
            first = await fetch_n(receiver, 2)
            receiver.accept(first)
            await ossn.sync()
            # Window 5, 2 fetched (credit given back): m2..m6 delivered, unaccepted; m7 still queued.
            await wait_until(lambda: receiver.available() == 5)
            assert (await ssn.query_queue("redeliver"))["msgDepth"] == 6
        finally:
            if how == "drop":
                await other.stream.aclose()  # dead, no connection.close
            await other.close()
        while (await ssn.query_queue("redeliver"))["consumerCount"]:  # the broker has seen it go
            await trio.sleep(0.01)
        assert await depth(ssn, "redeliver") == 6
        receiver = await ssn.receiver("redeliver", accept="explicit")
        got = await fetch_n(receiver, 6)
        assert [m.body for m in got] == bodies[2:]
        assert [m.redelivered for m in got] == [True] * 5 + [False]
        receiver.accept(got)
        await ssn.sync()
        assert await depth(ssn, "redeliver") == 0


async def test_release_puts_back_redelivered(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("rel")
        await send_all(ssn, "rel", [b"a", b"b", b"c"])
        receiver = await ssn.receiver("rel", capacity=10, accept="explicit")
        a, b, c = await fetch_n(receiver, 3)
        assert not (a.redelivered or b.redelivered or c.redelivered)
        receiver.release([b, a])
        again = await fetch_n(receiver, 2)
        assert [(m.body, m.redelivered) for m in again] == [(b"a", True), (b"b", True)]
        assert await depth(ssn, "rel") == 3
        receiver.accept([c, *again])
        await ssn.sync()
        stats = await ssn.query_queue("rel")
        assert (stats["msgDepth"], stats["msgTotalDequeues"]) == (0, 3)


# -- producer capacity and completion order ----------------------------------------
async def test_sender_capacity_bounds_depth(ssn):
    stop, capacity = 5, 3
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("cap", arguments={"qpid.flow_stop_count": stop})
        sender = ssn.sender("cap", capacity=capacity, flow_notify=3600)
        seen = []
        sent = 0

        async def produce():
            nonlocal sent
            for i in range(stop + capacity + 10):
                await sender.send(b"%d" % i)
                sent += 1
                seen.append(sender.incomplete)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            await wait_until(lambda: sent == stop + capacity)
            stats = await ssn.query_queue("cap")
            while stats["msgDepth"] < stop + capacity:
                await trio.sleep(0.01)
                stats = await ssn.query_queue("cap")
            # Blocked: nothing more can reach the queue while the held transfers stay incomplete.
            await trio.sleep(0.3)
            stats = await ssn.query_queue("cap")
            assert sent == stop + capacity
            assert stats["msgDepth"] == stop + capacity
            assert stats["flowStopped"] is True
            assert stats["heldTransfers"] == capacity
            assert sender.incomplete == capacity
            nursery.cancel_scope.cancel()
        assert max(seen) <= capacity
        assert sender.max_incomplete <= capacity
        assert sender.max_incomplete == capacity


async def test_completion_out_of_order_across_queues(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("held.a", arguments={"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
        await ssn.declare_queue("free.b")
        to_a = ssn.sender("held.a", capacity=10)
        to_b = ssn.sender("free.b", capacity=10)
        for i in range(5):
            await to_a.send(b"a%d" % i)
        for i in range(5):
            await to_b.send(b"b%d" % i)
        await to_b.sync()  # completes although earlier transfers on the session are held
        assert to_b.incomplete == 0
        stats = await ssn.query_queue("held.a")
        assert stats["heldTransfers"] == 3
        assert stats["flowStopped"] is True
        assert to_a.incomplete == 3
        assert "held.a" in ssn.held_by
        # Draining A to below the resume threshold completes the held ones.
        assert len(await drain(ssn, "held.a")) == 5
        await to_a.sync()
        assert to_a.incomplete == 0
        assert (await ssn.query_queue("held.a"))["heldTransfers"] == 0


async def test_session_sync_waits_for_held_transfers(running, ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("syncq", arguments={"qpid.flow_stop_count": 1})
        sender = ssn.sender("syncq", capacity=5)
        for i in range(3):
            await sender.send(b"%d" % i)
        with trio.move_on_after(0.5) as scope:
            await ssn.sync()
        assert scope.cancelled_caught, "session.sync returned while transfers were held"
        assert sender.incomplete == 2
        done = trio.Event()

        async def sync_then_flag():
            await ssn.sync()
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_then_flag)
            await trio.sleep(0.1)
            assert not done.is_set()
            other = await running.connect()
            try:
                assert (await (await other.session()).purge_queue("syncq"))["messages"] == 3
            finally:
                await other.close()
            await done.wait()
        assert sender.incomplete == 0


# -- queue commands and statistics ---------------------------------------------------
async def test_queue_statistics_purge_and_delete(ssn):
    with trio.fail_after(TIMEOUT):
        created = await ssn.declare_queue("stats")
        assert created == {"queue": "stats", "created": True}
        assert (await ssn.declare_queue("stats"))["created"] is False
        stats = await ssn.query_queue("stats")
        assert [stats[k] for k in ("msgDepth", "byteDepth", "consumerCount", "bindingCount")] == [0, 0, 0, 1]
        # Each message's size is 8 bytes ("" 1, "stats" 6, nil 1) plus its body: 18, 28, 38.
        await send_all(ssn, "stats", [b"x" * 10, b"y" * 20, b"z" * 30])
        await ssn.bind("amq.direct", "stats", "s")
        receiver = await ssn.receiver("stats", accept="none", capacity=1)
        assert (await receiver.fetch()).body == b"x" * 10
        await ssn.sync()
        stats = await ssn.query_queue("stats")
        expected = {"msgDepth": 2, "byteDepth": 66, "msgTotalEnqueues": 3, "msgTotalDequeues": 1,
                    "byteTotalEnqueues": 84, "byteTotalDequeues": 18, "consumerCount": 1, "bindingCount": 2}
        # Credit 1 given back on fetch: the next one may be delivered (dequeued) by now.
        if stats["msgDepth"] == 1:
            expected.update(msgDepth=1, byteDepth=38, msgTotalDequeues=2, byteTotalDequeues=46)
        assert {k: stats[k] for k in expected} == expected

        with pytest.raises(PreconditionFailed):
            await ssn.delete_queue("stats", if_unused=True)
        with pytest.raises(PreconditionFailed):
            await ssn.delete_queue("stats", if_empty=True)
        await receiver.close()
        await ssn.sync()
        stats = await ssn.query_queue("stats")
        assert stats["consumerCount"] == 0
        left = stats["msgDepth"]
        assert left >= 1
        with pytest.raises(PreconditionFailed):
            await ssn.delete_queue("stats", if_empty=True)
        assert (await ssn.purge_queue("stats"))["messages"] == left
        stats = await ssn.query_queue("stats")
        assert (stats["msgDepth"], stats["byteDepth"], stats["msgTotalDequeues"]) == (0, 0, 3)
        assert (stats["byteTotalEnqueues"], stats["byteTotalDequeues"]) == (84, 84)
        await send_all(ssn, "stats", [b"last"])
        with pytest.raises(PreconditionFailed):
            await ssn.delete_queue("stats", if_empty=True, if_unused=True)
        assert await ssn.delete_queue("stats", if_unused=True) == {"messages": 1}
        with pytest.raises(NotFound):
            await ssn.query_queue("stats")
        # The default-exchange binding went with it.
        sender = ssn.sender("stats", capacity=1)
        await sender.send(b"nowhere")
        await sender.sync()
        await ssn.declare_queue("stats")
        assert await depth(ssn, "stats") == 0


async def test_exclusive_queue_refused_to_other_sessions(running, conn, ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("mine", exclusive=True)
        await send_all(ssn, "mine", [b"m"])
        sibling = await conn.session()  # same connection, another session
        other = await running.connect()
        try:
            for s in (sibling, await other.session()):
                with pytest.raises(ResourceLocked):
                    await s.declare_queue("mine")
                with pytest.raises(ResourceLocked):
                    await s.receiver("mine")
                await s.declare_queue("not-mine")  # the session carries on
        finally:
            await other.close()
        receiver = await ssn.receiver("mine")
        assert (await receiver.fetch()).body == b"m"


async def test_auto_delete_queue_goes_with_its_last_consumer(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("auto", auto_delete=True)
        r1 = await ssn.receiver("auto")
        r2 = await ssn.receiver("auto")
        await r1.close()
        assert (await ssn.query_queue("auto"))["consumerCount"] == 1
        await r2.close()
        with pytest.raises(NotFound):
            await ssn.query_queue("auto")


async def test_explicit_accept_keeps_depth_until_accepted(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("explicit")
        await send_all(ssn, "explicit", [b"a", b"b"])
        receiver = await ssn.receiver("explicit", accept="explicit")
        a, b = await fetch_n(receiver, 2)
        await ssn.sync()
        stats = await ssn.query_queue("explicit")
        assert (stats["msgDepth"], stats["msgTotalDequeues"]) == (2, 0)
        a.accept()
        await ssn.sync()
        assert await depth(ssn, "explicit") == 1
        b.accept()
        await ssn.sync()
        stats = await ssn.query_queue("explicit")
        assert (stats["msgDepth"], stats["msgTotalDequeues"]) == (0, 2)


async def test_accept_mode_none_dequeues_at_delivery(ssn):
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("none")
        await send_all(ssn, "none", [b"a", b"b"])
        receiver = await ssn.receiver("none", accept="none", capacity=10)
        await wait_until(lambda: receiver.available() == 2)
        stats = await ssn.query_queue("none")  # delivered, never fetched nor accepted
        assert (stats["msgDepth"], stats["msgTotalDequeues"]) == (0, 2)


# -- heartbeats ---------------------------------------------------------------------
async def test_heartbeat_keeps_idle_connection_alive(running):
    with trio.fail_after(TIMEOUT):
        c = await running.connect(heartbeat=1)
        try:
            s = await c.session()
            await s.declare_queue("idle")
            await trio.sleep(3)
            assert c.error is None
            await send_all(s, "idle", [b"still here"])
            assert await drain(s, "idle") == [b"still here"]
        finally:
            await c.close()


async def test_heartbeat_detects_dead_peer_and_releases_its_deliveries(running, ssn):
    """A raw peer asks for heartbeat=1 and then falls silent: the broker drops it
    and puts its unaccepted delivery back, marked redelivered."""
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("hb")
        await send_all(ssn, "hb", [b"taken"])
        stream = await trio.open_tcp_stream(running.host, running.port)
        try:
            frames = [[P.OPEN, {"heartbeat": 1}], [P.ATTACH, 0, "silent"],
                      [P.SUBSCRIBE, 0, "hb", "d", P.ACCEPT_EXPLICIT, P.ACQUIRE_PRE_ACQUIRED],
                      [P.FLOW, 0, "d", 1, -1]]
            await stream.send_all(PROTOCOL_HEADER + b"".join(msgpack.packb(f) for f in frames))
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            seen = []
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                unpacker.feed(data)
                seen.extend(unpacker)
            codes = [f[0] for f in seen]
            assert P.DELIVER in codes
            assert seen[-1][:2] == [P.CLOSE, P.CONNECTION_FORCED], seen[-1]
        finally:
            await stream.aclose()
        while (await ssn.query_queue("hb"))["consumerCount"]:
            await trio.sleep(0.01)
        receiver = await ssn.receiver("hb")
        m = await receiver.fetch()
        assert (m.body, m.redelivered) == (b"taken", True)


async def test_auto_accept_goes_out_every_ack_frequency_fetches(ssn):
    """accept="auto" with ack_frequency 3: fetched messages are accepted (and
    leave the queue) three at a time; closing accepts the rest fetched, and
    what was delivered but not fetched goes back."""
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("acks")
        await send_all(ssn, "acks", [b"%d" % i for i in range(10)])
        receiver = await ssn.receiver("acks", capacity=10, ack_frequency=3)
        got = await fetch_n(receiver, 7)
        await ssn.sync()
        assert await depth(ssn, "acks") == 10 - 6  # accepted at the 3rd and 6th fetch
        got += await fetch_n(receiver, 1)
        await ssn.sync()
        assert await depth(ssn, "acks") == 4  # the 8th is not due yet
        await receiver.close()
        await ssn.sync()
        assert await depth(ssn, "acks") == 2  # the 7th and 8th accepted at close; 2 never fetched
        assert [m.body for m in got] == [b"%d" % i for i in range(8)]


async def test_credit_goes_back_every_half_capacity(ssn):
    """A receiver of capacity 10 has at most 10 messages delivered and not yet
    fetched: its credit comes back 5 at a time, at every 5th fetch."""
    with trio.fail_after(TIMEOUT):
        await ssn.declare_queue("credit")
        await send_all(ssn, "credit", [b"%d" % i for i in range(30)])
        receiver = await ssn.receiver("credit", capacity=10)
        await wait_until(lambda: receiver.available() == 10)
        await fetch_n(receiver, 4)
        await trio.sleep(0.1)  # no credit went back: nothing more arrives
        assert receiver.available() == 6
        await fetch_n(receiver, 1)
        await wait_until(lambda: receiver.available() == 10)
        assert [m.body for m in await fetch_n(receiver, 10)] == [b"%d" % i for i in range(5, 15)]


@pytest.mark.parametrize("waiting", ["send", "sync", "fetch"])
async def test_a_waiting_call_ends_when_the_broker_goes(running, waiting):
    """A send waiting for capacity, a sync waiting for held transfers, and a
    fetch waiting for a message without a timeout each raise ConnectionClosed
    when the broker drops the connection, rather than wait on."""
    with trio.fail_after(TIMEOUT):
        conn = await running.connect()
        try:
            ssn = await conn.session()
            await ssn.declare_queue("gone", arguments={"qpid.flow_stop_count": 1})
            await ssn.declare_queue("empty")
            sender = ssn.sender("gone", capacity=2, flow_notify=3600)
            receiver = await ssn.receiver("empty")
            for i in range(3):
                await sender.send(b"%d" % i)  # the first completes, the others are held
            await wait_until(lambda: sender.incomplete == 2)
            call = {"send": lambda: sender.send(b"more"), "sync": sender.sync, "fetch": receiver.fetch}[waiting]
            failed: list[BaseException] = []

            async def wait_in_call() -> None:
                try:
                    await call()
                except ConnectionClosed as exc:
                    failed.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_in_call)
                await trio.sleep(0.2)
                assert not failed  # still waiting
                for server_side in list(running.server.connections):
                    await server_side.stream.aclose()
            assert len(failed) == 1 and "closed by the broker" in str(failed[0]), failed
        finally:
            await conn.close()
