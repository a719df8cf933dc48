"""Sender.send_many(message_ids=...): each message its own id, sent (and taken
by the broker) as one run of transfers (native/transfers.h), as the Spark
writer sends its deterministic ids. The same messages, sizes, accounting,
flow control and durability as one send per message."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.protocol import encodings as enc
from tests.test_flow import stats, wait_for
from tests.test_store_config import qflowd
from tests.test_store_messages import browse, restarted

pack = msgpack.Packer(use_bin_type=True).pack


@pytest.mark.parametrize("rest", [None, {"durable": True}, {"message_id": "ignored", "content_type": "t",
                                                            "headers": {"h": [1]}}])
@pytest.mark.parametrize("mid", ["", "w-0-1", "x" * 31, "x" * 32, "é" * 200, "y" * 70_000])
def test_the_head_around_an_id_is_the_packers(rest, mid):
    before, after = enc.transfer_prefix_around_id(3, "amq.direct", "key", rest)
    encoded = mid.encode()
    frame = before + enc.str_header(len(encoded)) + encoded + after + enc.bin_header(5) + b"hello"
    props = {"message_id": mid, **{k: v for k, v in (rest or {}).items() if k != "message_id"}}
    assert frame == pack([P.TRANSFER, 3, "amq.direct", "key", props, b"hello"])


async def _all(receiver: qflow.Receiver, n: int) -> list[qflow.ReceivedMessage]:
    got: list[qflow.ReceivedMessage] = []
    with trio.fail_after(30):
        while len(got) < n:
            got += await receiver.fetch_many()
    return got


async def test_send_many_with_message_ids_gives_each_message_its_own(running, ssn):
    await ssn.declare_queue("ids-a")
    await ssn.declare_queue("one-a")
    ids = [f"batch-7-{i}" for i in range(500)] + ["ü-not-ascii", "z" * 300]  # the last two end the broker's run
    bodies = [b"%d" % i for i in range(len(ids))]
    sender = ssn.sender("ids-a", capacity=64)
    assert await sender.send_many(bodies, message_ids=ids, content_type="text/plain") == len(ids)
    await sender.sync()
    assert sender.max_incomplete <= 64
    single = ssn.sender("one-a", capacity=64)
    for body, mid in zip(bodies, ids, strict=True):
        await single.send(body, message_id=mid, content_type="text/plain")
    await single.sync()
    # The same messages, and the same accounting (bytes and counts), as one send per message
    # (the queue names, which are the routing keys, have the same length: a message's size counts them).
    a, b = await stats(ssn, "ids-a"), await stats(ssn, "one-a")
    assert (a["msgDepth"], a["byteDepth"]) == (b["msgDepth"], b["byteDepth"]) == (len(ids), b["byteDepth"])
    got = await _all(await ssn.receiver("ids-a"), len(ids))
    assert [(m.body, m.message_id, m.content_type) for m in got] == \
        [(body, mid, "text/plain") for body, mid in zip(bodies, ids, strict=True)]


async def test_a_paced_sender_sends_each_message_with_its_id(running, ssn):
    """A sender with a rate sends one message at a time (send_many's pacing rule), each with its id."""
    await ssn.declare_queue("paced")
    sender = ssn.sender("paced", capacity=5, rate=10_000)
    assert await sender.send_many((b"%d" % i for i in range(6)), message_ids=[f"p-{i}" for i in range(6)]) == 6
    await sender.sync()
    got = await _all(await ssn.receiver("paced"), 6)
    assert [(m.body, m.message_id) for m in got] == [(b"%d" % i, f"p-{i}") for i in range(6)]


@pytest.mark.parametrize("rate", [None, 10_000])
async def test_send_many_with_message_ids_and_a_timestamp_stamps_each_message(running, ssn, rate):
    """The Spark writer's batch: an id each, one timestamp (and headers) for
    all; each message keeps its own id and carries the shared ones, run or paced."""
    await ssn.declare_queue("stamped")
    stamp = 1_764_000_000_123
    sender = ssn.sender("stamped", capacity=50, rate=rate)
    ids = [f"q-3-0-{i}" for i in range(120)]
    assert await sender.send_many([b"r%d" % i for i in range(120)], message_ids=ids, timestamp=stamp,
                                  headers={"src": "orders"}) == 120
    await sender.sync()
    got = await _all(await ssn.receiver("stamped"), 120)
    assert [(m.body, m.message_id, m.timestamp, m.headers) for m in got] == \
        [(b"r%d" % i, ids[i], stamp, {"src": "orders"}) for i in range(120)]


@pytest.mark.parametrize("kwargs, error", [
    ({"message_ids": ["a"]}, "3 bodies but 1 message ids; nothing sent"),
    ({"message_ids": ["a", None, "c"]}, "message_ids[1] is NoneType, not str; nothing sent"),
    ({"message_ids": ["a", "b", "c"], "message_id": "m"}, "give message_id (one for all) or message_ids"),
])
async def test_send_many_refuses_ids_that_do_not_fit_and_sends_nothing(running, ssn, kwargs, error):
    await ssn.declare_queue("q")
    sender = ssn.sender("q", capacity=10)
    with pytest.raises(ValueError) as info:
        await sender.send_many([b"1", b"2", b"3"], **kwargs)
    assert error in str(info.value)
    await sender.send_many([b"after"], message_ids=["ok"])  # the sender is unharmed
    await sender.sync()
    assert (await stats(ssn, "q"))["msgDepth"] == 1


async def test_flow_control_holds_a_sender_of_ids_stop_100_capacity_50(running, ssn):
    """The manual's rule with an id per message: above the stop threshold of
    100 the queue holds the transfers' completion, so a sender of capacity 50
    stops with 150 on the queue, 50 of them held, until it is drained."""
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 100, "qpid.flow_resume_count": 50})
    sender = ssn.sender("q", capacity=50)
    ids = [f"w-{i}" for i in range(1000)]
    sent: list[int] = []

    async def push() -> None:
        sent.append(await sender.send_many([b"x" * 64] * len(ids), message_ids=ids))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(push)
        await wait_for(lambda: sender.incomplete >= 50)
        await wait_for(lambda: list(ssn.held_by) == ["q"])
        s = await stats(ssn, "q")
        assert (s["msgDepth"], s["flowStopped"], s["heldTransfers"]) == (150, True, 50)
        assert not sent
        got = await _all(await (await (await running.connect()).session()).receiver("q"), len(ids))
    assert sent == [1000] and sender.max_incomplete == 50
    assert [m.message_id for m in got] == ids


async def test_persistent_messages_sent_with_ids_survive_a_sigkill(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    d = qflowd(data_dir)
    ids = [f"job-1-0-{i}" for i in range(3000)]
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("durable-ids", durable=True)
            sender = ssn.sender("durable-ids", capacity=500, durable=True)
            await sender.send_many([b"%d" % i for i in range(len(ids))], message_ids=ids)
            await sender.sync()  # complete: on disk
            before = await ssn.query_queue("durable-ids")
    finally:
        d.kill()
    async with restarted(data_dir) as ssn:
        after = await ssn.query_queue("durable-ids")
        assert (after["msgDepth"], after["byteDepth"]) == (len(ids), before["byteDepth"])
        got = await browse(ssn, "durable-ids")
        assert [(m.body, m.message_id, m.durable) for m in got] == \
            [(b"%d" % i, mid, True) for i, mid in enumerate(ids)]


async def test_a_message_with_an_id_too_large_for_the_frame_is_refused_and_those_before_it_sent(nursery):
    """As send_many without ids: a transfer over the negotiated frame size
    would end the connection, so the client refuses it, naming the limit;
    the messages before it are sent, it and those after it are not, and the
    session carries on. A body that fits only with a short id fits with it."""
    from tests.conftest import start_broker

    served = await start_broker(nursery, max_frame_size=8192)
    async with qflow.open_connection("127.0.0.1", served.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("q")
        sender = ssn.sender("q", capacity=10)
        with pytest.raises(qflow.ResourceLimitExceeded) as err:
            await sender.send_many([b"a", b"b", b"y" * 9000, b"c"], message_ids=["1", "2", "3", "4"])
        assert "message too large" in err.value.text and "at most 8192 bytes" in err.value.text
        near = b"z" * (8192 - 40)
        await sender.send_many([near, b"d"], message_ids=["5", "6"])  # over the surely-fits bound, but fits
        with pytest.raises(qflow.ResourceLimitExceeded):
            await sender.send_many([near], message_ids=["x" * 200])  # the id makes it too large
        await sender.sync()
        assert sender.incomplete == 0
        got = await _all(await ssn.receiver("q"), 4)
        assert [(m.body, m.message_id) for m in got] == [(b"a", "1"), (b"b", "2"), (near, "5"), (b"d", "6")]
        assert (await ssn.query_queue("q"))["msgTotalEnqueues"] == 4
