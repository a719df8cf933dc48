"""Queued messages are stored as the encoded tail of the delivery frame that
will carry them (qflow.broker.queue): these tests check that a message comes out as
it went in however its transfer was encoded or split, and that the broker's
bookkeeping of deliveries awaiting accept (consecutive delivery ids in lists)
handles accepts and releases in any order."""

from __future__ import annotations

import msgpack
import pytest
import trio

from qflow import protocol as P
from qflow.broker import BrokerSession
from qflow.protocol.entries import seq_of
from qflow.protocol.framing import PROTOCOL_HEADER, FrameDecoder, FrameEncoder

pytestmark = pytest.mark.native_only  # storage and delivery bookkeeping: the accounting plays no part

PROPS = {"message_id": "m-1", "headers": {"k": [1, "two"]}}
BODY = bytes(range(256)) * 3


async def raw_connection(port: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {"mechanism": "ANONYMOUS"}]))
    return stream


async def fetch_one(ssn, queue: str):
    receiver = await ssn.receiver(queue, accept="none")
    with trio.fail_after(10):
        return await receiver.fetch()


# message.transfer [30, 0, "", "stored", PROPS, BODY], its head encoded in ways msgpack-python never
# writes: the array as array16, the code and channel as wider ints than they need.
TAIL = b"".join(msgpack.packb(x, use_bin_type=True) for x in ("", "stored", PROPS, BODY))
ODD_TRANSFERS = {
    "array16 header": b"\xdc\x00\x06" + msgpack.packb(P.TRANSFER) + b"\x00" + TAIL,
    "code as uint8": b"\x96\xcc\x1e\x00" + TAIL,
    "channel as uint16": b"\x96\x1e\xcd\x00\x00" + TAIL,
    "channel as int64": b"\x96\x1e\xd3" + bytes(8) + TAIL,
}


@pytest.mark.parametrize("how", list(ODD_TRANSFERS))
async def test_transfer_encoded_unusually_is_delivered_intact(running, ssn, how):
    await ssn.declare_queue("stored")
    stream = await raw_connection(running.port)
    await stream.send_all(msgpack.packb([P.ATTACH, 0, "raw"]) + ODD_TRANSFERS[how] + msgpack.packb([P.SYNC, 0]))
    msg = await fetch_one(ssn, "stored")
    assert (msg.exchange, msg.routing_key, msg.properties, msg.body) == ("", "stored", PROPS, BODY)
    assert msg.sequence == 1 and not msg.redelivered
    await stream.aclose()


async def test_transfer_split_across_reads_is_delivered_intact(running, ssn):
    await ssn.declare_queue("stored")
    stream = await raw_connection(running.port)
    frames = msgpack.packb([P.ATTACH, 0, "raw"]) + b"\x96\x1e\x00" + TAIL
    for cut in (len(frames) - len(TAIL) - 2, len(frames) - 500, len(frames) - 3):
        await stream.send_all(frames[:cut])
        await trio.sleep(0.05)  # the broker reads the first part on its own
        await stream.send_all(frames[cut:])
        frames = b"\x96\x1e\x00" + TAIL
    receiver = await ssn.receiver("stored", accept="none")
    with trio.fail_after(10):
        msgs = [await receiver.fetch() for _ in range(3)]
    assert [(m.exchange, m.routing_key, m.properties, m.body) for m in msgs] == [("", "stored", PROPS, BODY)] * 3
    assert [m.sequence for m in msgs] == [1, 2, 3]
    await stream.aclose()


async def test_session_on_a_high_channel_stores_messages_as_sent(running, conn):
    for _ in range(200):  # channel numbers above 127 encode in two bytes
        ssn = await conn.session()
    assert ssn.channel >= 128
    await ssn.declare_queue("high")
    sender = ssn.sender("high")
    await sender.send(BODY, message_id="m-1", headers={"k": [1, "two"]})
    await sender.sync()
    msg = await fetch_one(ssn, "high")
    assert (msg.routing_key, msg.properties, msg.body) == ("high", PROPS, BODY)


# -- deliveries awaiting accept -------------------------------------------------------------------


async def test_accepts_and_releases_in_any_order_keep_the_depth_right(running, ssn):
    await ssn.declare_queue("acks")
    sender = ssn.sender("acks")
    for i in range(10):
        await sender.send(b"m%d" % i)
    await sender.sync()
    # on the same session: a receiver that needs no accept takes delivery ids in between
    other = await ssn.declare_queue("other")
    assert other["created"]
    for i in range(3):
        await ssn.sender("other").send(b"o%d" % i)
    explicit = await ssn.receiver("acks", capacity=4, accept="explicit")
    plain = await ssn.receiver("other", capacity=10, accept="none")
    with trio.fail_after(10):
        got = [await explicit.fetch() for _ in range(4)]
        others = [await plain.fetch() for _ in range(3)]
    assert [m.body for m in got] == [b"m0", b"m1", b"m2", b"m3"] and len(others) == 3
    explicit.accept([got[3], got[1]])  # out of order, leaving holes
    explicit.release([got[2]])
    await ssn.sync()
    stats = await ssn.query_queue("acks")
    assert stats["msgDepth"] == 8  # 10 - 2 accepted; m0 still delivered, m2 back in the queue
    explicit.accept([got[0]])
    await ssn.sync()
    assert (await ssn.query_queue("acks"))["msgDepth"] == 7
    with trio.fail_after(10):
        rest = [await explicit.fetch() for _ in range(7)]
    # m4 and on may have been sent before m2 came back: credit was out
    assert sorted(m.body for m in rest) == [b"m2"] + [b"m%d" % i for i in range(4, 10)]
    assert [m.body for m in rest if m.redelivered] == [b"m2"]
    assert [m.sequence for m in rest if m.body == b"m2"] == [3]
    explicit.accept(rest)
    explicit.accept(rest)  # twice: the second changes nothing
    await ssn.sync()
    assert (await ssn.query_queue("acks"))["msgDepth"] == 0


def test_take_unacked_walks_only_what_is_outstanding() -> None:
    ssn = BrokerSession(0, "s", 0)
    q1, q2 = object(), object()
    ssn.unacked_base = 100
    ssn.unacked[:] = [b"a", None, b"c", b"d"]
    ssn.unacked_queues[:] = [q1, None, q2, q1]
    ssn.unacked_count = 3
    assert ssn.take_unacked(0, 99) == ([], [])
    assert ssn.take_unacked(102, 10**18) == ([q2, q1], [b"c", b"d"])
    assert (ssn.unacked, ssn.unacked_base, ssn.unacked_count) == ([b"a", None, None, None], 100, 1)
    assert ssn.take_unacked(101, 101) == ([], [])
    assert ssn.take_unacked(99, 100) == ([q1], [b"a"])
    assert (ssn.unacked, ssn.unacked_base, ssn.unacked_count) == ([], 104, 0)


# -- the codec pieces ---------------------------------------------------------------------------


def test_frame_tail_follows_frames_across_chunks() -> None:
    d = FrameDecoder()
    head = b"\x96\x1e\x00"
    data = PROTOCOL_HEADER + msgpack.packb([P.HEARTBEAT]) + head + TAIL + head + TAIL
    d.feed(data[:40])
    assert [f[0] for f in d.frames()] == [P.HEARTBEAT]
    d.feed(data[40:-100])
    d.feed(data[-100:])
    tails = []
    for frame in d.frames():
        assert frame[5] == BODY
        tails.append(d.frame_tail(head))
        assert d.frame_tail(b"\x96\x1e\x01") is None  # another channel's head does not match
    assert tails == [TAIL, TAIL]


def test_encoder_keeps_raw_and_packed_frames_in_order() -> None:
    enc = FrameEncoder()
    enc.write([P.HEARTBEAT])
    enc.parts.append(msgpack.packb([P.FLUSH, 1]))
    enc.write([P.SYNC, 2])
    enc.parts.append(msgpack.packb([P.FLUSH, 3]))
    assert len(enc) == 2 + 3 + 3 + 3
    data = enc.take()
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    assert list(unpacker) == [[P.HEARTBEAT], [P.FLUSH, 1], [P.SYNC, 2], [P.FLUSH, 3]]
    assert len(enc) == 0 and enc.take() == b""


def test_entry_head_reads_back() -> None:
    from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, entry_tail, redelivered, seq_and_size

    e = ENTRY_HEAD.pack(REDELIVERED_NO, 0xCF, 2**40 + 5, 0xCF, len(BODY)) + TAIL
    assert seq_and_size(e) == (2**40 + 5, len(BODY)) and seq_of(e) == 2**40 + 5
    assert entry_tail(e) == ("", "stored", PROPS, BODY)
    r = redelivered(e)
    assert r[0] == 0xC3 and r[1:] == e[1:] and redelivered(r) is r
