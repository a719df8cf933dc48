"""Sender.send_many and Receiver.fetch_many: the per-message calls' semantics
(capacity, refusals, credit, auto-accept), one call for many messages."""

from __future__ import annotations

import pytest
import trio

import qflow
from tests.test_flow import stats, wait_for


async def test_send_many_keeps_the_capacity_c1_50_c2_15_overshoot_at_most_65(running, nursery):
    """The manual's example with batch sends: stop at 100, C1 capacity 50 and
    C2 capacity 15 each call send_many with more than they may send: the
    queue receives 165 messages, and then nothing while both are held."""
    c1, c2 = await running.connect(name="C1"), await running.connect(name="C2")
    s1, s2 = await c1.session(), await c2.session()
    await s1.declare_queue("q", arguments={"qpid.flow_stop_count": 100})
    send1, send2 = s1.sender("q", capacity=50), s2.sender("q", capacity=15)
    sent: dict[str, int] = {}

    async def push(name: str, sender: qflow.Sender) -> None:
        sent[name] = await sender.send_many(b"%s-%d" % (name.encode(), i) for i in range(1000))

    nursery.start_soon(push, "C1", send1)
    await wait_for(lambda: send1.incomplete >= 50)
    nursery.start_soon(push, "C2", send2)
    await wait_for(lambda: send2.incomplete >= 15)
    await trio.sleep(0.2)  # nothing more arrives while both are blocked
    s = await stats(s1, "q")
    assert (s["msgDepth"], s["flowStopped"], s["heldTransfers"]) == (165, True, 65)
    assert (send1.max_incomplete, send2.max_incomplete) == (50, 15)
    assert not sent  # both calls are still waiting for room
    # Drain everything: both calls finish, every message arrives once, each sender's in order.
    rssn = await (await running.connect()).session()
    receiver = await rssn.receiver("q")
    got: list[bytes] = []
    with trio.fail_after(30):
        while len(got) < 2000:
            got += [m.body for m in await receiver.fetch_many()]
        await wait_for(lambda: len(sent) == 2)
    assert sent == {"C1": 1000, "C2": 1000}
    for name in ("C1", "C2"):
        assert [b for b in got if b.startswith(name.encode())] == [b"%s-%d" % (name.encode(), i) for i in range(1000)]


async def test_send_many_sets_the_same_properties_on_every_message(running, ssn):
    await ssn.declare_queue("q")
    sender = ssn.sender("q", capacity=4)
    n = await sender.send_many(["a", b"b", bytearray(b"c")] * 3, message_id="m", content_type="text/plain",
                               durable=True, headers={"k": 1})
    assert n == 9
    await sender.sync()
    receiver = await ssn.receiver("q")
    msgs = []
    with trio.fail_after(10):
        while len(msgs) < 9:
            msgs += await receiver.fetch_many()
    assert [m.body for m in msgs] == [b"a", b"b", b"c"] * 3
    assert {(m.message_id, m.content_type, m.durable, m.headers["k"]) for m in msgs} == {("m", "text/plain", True, 1)}
    assert [m.sequence for m in msgs] == list(range(1, 10))


async def test_send_many_of_nothing_sends_nothing(ssn):
    await ssn.declare_queue("q")
    sender = ssn.sender("q")
    assert await sender.send_many([]) == 0
    await sender.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 0


async def test_send_many_into_a_full_queue_raises_the_refusal(ssn):
    """Reject policy: the queue takes 5 of 10; the refusals surface at sync,
    and the next send_many raises before it sends anything."""
    await ssn.declare_queue("q", arguments={"qpid.max_count": 5, "qpid.flow_stop_count": 0})
    sender = ssn.sender("q", capacity=100)
    assert await sender.send_many([b"x"] * 10) == 10
    with pytest.raises(qflow.ResourceLimitExceeded, match="is full"):
        await sender.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 5
    with pytest.raises(qflow.ResourceLimitExceeded):
        await sender.send_many([b"late"])
    assert (await stats(ssn, "q"))["msgDepth"] == 5


async def test_send_many_with_a_rate_is_paced(ssn):
    await ssn.declare_queue("q")
    sender = ssn.sender("q", rate=200)
    t0 = trio.current_time()
    assert await sender.send_many([b"x"] * 11) == 11
    assert trio.current_time() - t0 >= 10 / 200 * 0.9  # ten intervals between eleven sends
    await sender.sync()


async def test_fetch_many_returns_what_arrived_up_to_the_limit(ssn):
    await ssn.declare_queue("q")
    sender = ssn.sender("q")
    await sender.send_many(b"%d" % i for i in range(10))
    await sender.sync()
    receiver = await ssn.receiver("q", capacity=100)
    await wait_for(lambda: receiver.available() == 10)
    first = await receiver.fetch_many(4)
    rest = await receiver.fetch_many()
    assert [m.body for m in first + rest] == [b"%d" % i for i in range(10)]
    assert (len(first), len(rest)) == (4, 6)
    with pytest.raises(qflow.Empty):
        await receiver.fetch_many(timeout=0.05)
    with pytest.raises(ValueError, match="limit"):
        await receiver.fetch_many(0)
    await receiver.close()
    await ssn.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 0  # auto-accepted


async def test_fetch_many_auto_accepts_when_receivers_share_a_session(running, ssn):
    """Two receivers on one session: their delivery ids interleave, so neither
    gets a consecutive run; everything fetched is still accepted, once."""
    await ssn.declare_queue("a")
    await ssn.declare_queue("b")
    for q in ("a", "b"):
        await ssn.sender(q).send_many([q.encode()] * 50)
    await ssn.sync()
    rssn = await (await running.connect()).session()
    ra = await rssn.receiver("a", capacity=7)
    rb = await rssn.receiver("b", capacity=7)
    counts = {"a": 0, "b": 0}
    with trio.fail_after(20):
        while counts["a"] < 50 or counts["b"] < 50:
            for name, r in (("a", ra), ("b", rb)):
                if counts[name] < 50:
                    counts[name] += len(await r.fetch_many(5))
    await ra.close()
    await rb.close()
    await rssn.sync()
    for q in ("a", "b"):
        s = await stats(ssn, q)
        assert (s["msgDepth"], s["msgTotalDequeues"]) == (0, 50)  # a delivery counts in the depth until accepted


async def test_fetch_many_in_explicit_mode_leaves_the_accept_to_the_caller(ssn):
    await ssn.declare_queue("q")
    await ssn.sender("q").send_many([b"m"] * 6)
    receiver = await ssn.receiver("q", accept="explicit")
    msgs = []
    with trio.fail_after(10):
        while len(msgs) < 6:
            msgs += await receiver.fetch_many()
    await ssn.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 6  # delivered, not accepted
    receiver.accept(msgs)
    await ssn.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 0


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 70000])
def test_a_plain_transfer_is_encoded_as_the_packer_encodes_it(size):
    """Senders write transfers without properties from cached bytes; the broker
    and its run scanner see exactly what msgpack's Packer would have written."""
    import types

    import msgpack

    from qflow.client.sender import Sender
    from qflow.protocol.encodings import bin_header
    from qflow.protocol.framing import FrameEncoder
    session = types.SimpleNamespace(channel=3, commands=None, conn=types.SimpleNamespace(encoder=FrameEncoder()))
    sender = Sender(session, "amq.direct", "key", 10, None, 5.0, None)
    body = b"b" * size
    assert sender._head + bin_header(size) + body == msgpack.packb([30, 3, "amq.direct", "key", None, body])


async def test_a_senders_exchange_and_routing_key_can_be_changed(running):
    """They are the sender's address for its next sends, as before they were cached."""
    async with await running.connect() as conn:
        ssn = await conn.session()
        for q in ("first", "second", "third"):
            await ssn.declare_queue(q)
        await ssn.bind("amq.direct", "third", "k3")
        sender = ssn.sender("first")
        await sender.send(b"1")
        sender.routing_key = "second"
        await sender.send(b"2")
        await sender.send_many([b"3", b"4"])
        sender.exchange, sender.routing_key = "amq.direct", "k3"
        await sender.send(b"5")
        await sender.sync()
        depths = [(await ssn.query_queue(q))["msgDepth"] for q in ("first", "second", "third")]
        assert depths == [1, 3, 1]
        receiver = await ssn.receiver("third")
        m = await receiver.fetch(timeout=5)
        assert (m.body, m.exchange, m.routing_key) == (b"5", "amq.direct", "k3")
