"""Issue 17: what the broker sends is bounded. A consumer that stops reading
stops receiving (its messages wait in the queue, counted in its depth), and
no frame is larger than the negotiated frame size (a larger message goes in
message.deliver-part frames, joined by the client)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import msgpack
import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.protocol.framing import PROTOCOL_HEADER, FramingError
from qflow.protocol.parts import PartJoiner
from qflow.server.connection import OUTPUT_LIMIT_FRAMES
from qflow.testing import Harness
from tests.conftest import start_qflowd, wait_for

TIMEOUT = 60
KIB = 1024


def pack(*frames) -> bytes:
    return b"".join(msgpack.packb(f) for f in frames)


# -- the in-memory harness: one read at a time ---------------------------------------------------
def _fill(h: Harness, queue: str, n: int, size: int) -> None:
    producer = h.connect().session()
    producer.declare_queue(queue)
    for i in range(n):
        producer.transfer(queue, bytes([i % 256]) * size)
    h.run()


def test_a_consumer_that_does_not_read_leaves_its_messages_in_the_queue():
    """No accept, unlimited credit (the issue's consumer), a peer that reads
    nothing: the broker queues at most its output limit (plus one message)
    for it; the rest stays in the queue and msgDepth counts it. Once the
    peer reads, everything arrives, in order."""
    h = Harness()
    consumer = h.connect()
    cs = consumer.session()
    cs.declare_queue("q")
    cs.subscribe("q", "d")
    consumer.reading = False
    limit = consumer.pump.encoder.limit = 64 * KIB
    _fill(h, "q", 100, 10 * KIB)
    assert consumer.pump.encoder.queued <= limit + 10 * KIB + 64
    held = h.connect().session().query("q")["msgDepth"]
    assert held >= 100 - (limit + 10 * KIB) // (10 * KIB)  # the broker held 0 here, and 1 GB in a buffer
    consumer.reading = True
    h.run()
    assert [d.body[0] for d in cs.deliveries] == [i % 256 for i in range(100)]
    assert h.connect().session().query("q")["msgDepth"] == 0


def test_round_robin_passes_over_a_consumer_with_no_room():
    """Two consumers on one queue, one of them not reading: the other gets
    what the first cannot take, and the dispatch does not spin on it."""
    h = Harness()
    stuck, live = h.connect(), h.connect()
    ss, ls = stuck.session(), live.session()
    ss.declare_queue("q")
    ss.subscribe("q", "a")
    ls.subscribe("q", "b")
    stuck.reading = False
    stuck.pump.encoder.limit = 16 * KIB
    _fill(h, "q", 50, 4 * KIB)
    assert len(ls.deliveries) >= 50 - 5
    assert h.connect().session().query("q")["msgDepth"] == 0
    stuck.reading = True
    h.run()
    assert len(ss.deliveries) + len(ls.deliveries) == 50


def test_a_browser_that_does_not_read_is_bounded_too():
    h = Harness()
    browser = h.connect()
    bs = browser.session()
    bs.declare_queue("q")
    bs.call(P.SUBSCRIBE, "q", "b", P.ACCEPT_NONE, P.ACQUIRE_NOT_ACQUIRED, 0)
    bs.call(P.FLOW, "b", -1, -1)
    browser.reading = False
    limit = browser.pump.encoder.limit = 32 * KIB
    _fill(h, "q", 40, 4 * KIB)
    assert browser.pump.encoder.queued <= limit + 4 * KIB + 64
    browser.reading = True
    h.run()
    assert len(bs.deliveries) == 40


# -- frame size -------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [5000, 100 * KIB, 4096 - 60])
def test_a_message_larger_than_the_frame_size_is_delivered_in_parts(size):
    """A consumer that negotiated 4096-byte frames gets a 100 KB message whole
    (the issue's poison message, which killed its connection on every retry);
    no frame the broker writes is over 4096 bytes."""
    h = Harness()
    consumer = h.connect(max_frame_size=4096)
    cs = consumer.session()
    cs.declare_queue("q")
    cs.subscribe("q", "d")
    frames: list[int] = []
    receive = consumer.protocol.receive_data

    def spying_receive(data: bytes, now: float) -> None:
        receive(data, now)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(data)
        while True:
            before = unpacker.tell()
            try:
                next(unpacker)
            except StopIteration:
                break
            frames.append(unpacker.tell() - before)

    consumer.protocol.receive_data = spying_receive  # type: ignore[method-assign]
    producer = h.connect().session()
    bodies = [b"a" * size, b"small", bytes(range(256)) * (size // 256)]
    for body in bodies:
        producer.transfer("q", body)
    h.run()
    assert [d.body for d in cs.deliveries] == bodies
    assert [d.delivery_id for d in cs.deliveries] == [0, 1, 2]
    assert max(frames) <= 4096


def test_part_joiner_refuses_interleaved_or_malformed_parts():
    j = PartJoiner()
    assert j.add([P.DELIVER_PART, 0, "d", 7, True, b"ab"]) is None
    with pytest.raises(FramingError, match="before the last part"):
        j.add([P.DELIVER_PART, 0, "d", 8, False, b"cd"])
    with pytest.raises(FramingError, match="malformed message.deliver-part"):
        PartJoiner().add([P.DELIVER_PART, 0, "d", 7, "yes", b"ab"])
    with pytest.raises(FramingError, match="over 4 bytes"):
        small = PartJoiner(limit=4)
        small.add([P.DELIVER_PART, 0, "d", 1, True, b"abc"])
        small.add([P.DELIVER_PART, 0, "d", 1, False, b"de"])
    j = PartJoiner()
    j.add([P.DELIVER_PART, 0, "d", 7, True, b"ab"])
    assert j.add([P.DELIVER_PART, 0, "d", 7, False, b"cd"]) == [P.DELIVER_RUN, 0, "d", 7, 1, b"abcd"]


# -- a real qflowd -------------------------------------------------------------------------------------
def _api(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=TIMEOUT) as response:
        return json.load(response)


def _tcp_wmem_max() -> int:
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except OSError:
        return 4 * 1024 * KIB


async def test_qflowd_keeps_a_non_reading_consumers_messages_in_the_queue():
    """The issue's finding, scaled down: a raw consumer (no accept, unlimited
    credit) that never reads its socket. The broker's output to it stays
    under its limit (outputBytes in /api/connections), the undelivered
    messages stay in the queue (msgDepth), and when it reads again every
    message arrives."""
    d = start_qflowd("--no-data-dir")
    raw = socket.socket()
    try:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KIB)
        raw.settimeout(TIMEOUT)
        raw.connect(("127.0.0.1", d.port))
        raw.sendall(PROTOCOL_HEADER + pack([P.OPEN, {"deliver_runs": True}], [P.ATTACH, 0, "raw"],
                                           [P.QUEUE_DECLARE, 0, "q", False, False, False, {}, False],
                                           [P.SUBSCRIBE, 0, "q", "d", P.ACCEPT_NONE, P.ACQUIRE_PRE_ACQUIRED, 0],
                                           [P.FLOW, 0, "d", -1, -1], [P.SYNC, 0]))
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        while not any(f[0] == P.COMPLETED and 3 in _ids(f[2]) for f in _feed(unpacker, raw.recv(65536))):
            pass
        # From here the consumer reads nothing.
        msg = 10 * KIB
        output_limit = OUTPUT_LIMIT_FRAMES * 1024 * KIB
        bound = _tcp_wmem_max() + 4 * raw.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) + output_limit + msg
        n = (bound + 20 * 1024 * KIB) // msg
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            sender = ssn.sender("q", capacity=500)
            for i in range(0, n, 500):
                await sender.send_many([b"m" * msg] * min(500, n - i))
            await sender.sync()
            depth = (await ssn.query_queue("q"))["msgDepth"]
            assert depth * msg >= n * msg - bound, (depth, n)  # the broker: 0, all of it in memory
            conns = _api(d.mgmt_port, "/api/connections")
            stuck = [c for c in conns if c["sessions"] and c["sessions"][0]["consumers"] == ["d"]]
            assert stuck and stuck[0]["outputBytes"] <= output_limit + msg, conns
            # The consumer reads again: every message comes, and the queue empties.
            got = 0
            with trio.fail_after(TIMEOUT):
                while got < n:
                    data = await trio.to_thread.run_sync(raw.recv, 1024 * KIB)
                    assert data, "EOF"
                    got += sum(f[4] for f in _feed(unpacker, data) if f[0] == P.DELIVER_RUN)
            assert got == n
            await wait_for(lambda: _api(d.mgmt_port, "/api/queues/q")["msgDepth"] == 0, TIMEOUT)
    finally:
        raw.close()
        d.stop()


def _feed(unpacker: msgpack.Unpacker, data: bytes) -> list:
    assert data, "EOF"
    unpacker.feed(data)
    return list(unpacker)


def _ids(ranges: list[int]) -> set[int]:
    out: set[int] = set()
    for lo, hi in zip(ranges[::2], ranges[1::2], strict=True):
        out.update(range(lo, hi + 1))
    return out


async def test_qflowd_delivers_a_large_message_to_a_small_frame_client():
    """The poison message of the issue: 100 KB to a consumer that negotiated
    4096-byte frames. It arrives whole, and the connection lives on."""
    d = start_qflowd("--no-data-dir")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as producer, \
                qflow.open_connection("127.0.0.1", d.port, max_frame_size=4096) as consumer:
            ps = await producer.session()
            await ps.declare_queue("big")
            sender = ps.sender("big", capacity=10)
            bodies = [bytes(range(256)) * 400, b"after"]
            for body in bodies:
                await sender.send(body)
            await sender.sync()
            cs = await consumer.session()
            receiver = await cs.receiver("big")
            got = [(await receiver.fetch(timeout=TIMEOUT)).body for _ in bodies]
            assert got == bodies
            assert (await cs.query_queue("big"))["name"] == "big"  # the consumer's connection lives on
    finally:
        d.stop()


@pytest.mark.parametrize("deliver_runs", [True, False], ids=["deliver-run", "deliver"])
def test_both_writers_split_only_what_does_not_fit(deliver_runs):
    """The session output's two writers (message.deliver-run, and plain
    message.deliver for a client that did not ask for runs): an entry too
    large for a 4096-byte frame goes in parts of at most 4096 bytes each,
    whose chunks join to the entry."""
    from qflow.protocol.session_output import SessionOutput

    out = SessionOutput(3, deliver_runs=deliver_runs, max_frame_size=4096)
    write = out.deliveries("dest")
    entries = [bytes([i]) * n for i, n in enumerate((4096, 10_000, 70_000))]
    write(5, entries, sum(map(len, entries)))
    assert out.encoder.queued == sum(map(len, entries))
    data = out.take()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_bin_len=1 << 20)
    unpacker.feed(data)
    joined, sizes, before = PartJoiner(), [], 0
    got = []
    for frame in unpacker:
        sizes.append(unpacker.tell() - before)
        before = unpacker.tell()
        assert frame[:3] == [P.DELIVER_PART, 3, "dest"]
        run = joined.add(frame)
        if run is not None:
            got.append((run[3], run[5]))
    assert max(sizes) <= 4096
    assert got == [(5 + i, e) for i, e in enumerate(entries)]


def test_a_destination_too_long_for_a_frame_is_refused_at_subscribe():
    h = Harness()
    ssn = h.connect().session()
    ssn.declare_queue("q")
    with pytest.raises(AssertionError, match="destination must be at most 255 bytes, got 300"):
        ssn.call(P.SUBSCRIBE, "q", "d" * 300, P.ACCEPT_NONE, P.ACQUIRE_PRE_ACQUIRED, 0)
    ssn.subscribe("q", "d" * 255)


# -- a message too large for the producer's frames ------------------------------------------------------
async def test_a_message_too_large_for_the_frame_size_is_refused_at_its_producer(nursery):
    """A transfer over the negotiated frame size would end the producer's whole
    connection (the broker's 506). The client refuses it first, naming the
    limit; nothing of it is sent and the session carries on: send_many sends
    the bodies before it and none after."""
    from tests.conftest import start_broker

    served = await start_broker(nursery, max_frame_size=8192)
    async with qflow.open_connection("127.0.0.1", served.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("q")
        sender = ssn.sender("q", capacity=10)
        with pytest.raises(qflow.ResourceLimitExceeded) as err:
            await sender.send(b"x" * 10_000)
        assert err.value.code == P.RESOURCE_LIMIT_EXCEEDED
        assert "message too large" in err.value.text and "at most 8192 bytes" in err.value.text
        with pytest.raises(qflow.ResourceLimitExceeded):
            await sender.send_many([b"a", b"b", b"y" * 9000, b"c"])
        await sender.send(b"d")
        fits = 8192 - 64
        await sender.send(b"z" * fits, message_id="m")  # with properties: the general path
        await sender.sync()
        assert sender.incomplete == 0
        receiver = await ssn.receiver("q")
        got = [(await receiver.fetch(timeout=TIMEOUT)).body for _ in range(4)]
        assert got == [b"a", b"b", b"d", b"z" * fits]
        assert (await ssn.query_queue("q"))["msgTotalEnqueues"] == 4


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * KIB


def test_qflowd_stops_taking_commands_whose_replies_its_client_never_reads():
    """Issue 17, control frames: a raw client that never reads sends
    queue.query after queue.query (about 40 MB of replies if all were
    answered). Replies count in the output bound as deliveries do: once the
    connection's output is full the broker takes no more of its commands
    (readingPaused in /api/connections) and reads nothing more from it, so
    its output stays under the limit and the broker's memory does not grow
    by the replies. When the client reads, every reply arrives, in order."""
    frame_size = 64 * KIB
    d = start_qflowd("--no-data-dir", "--max-frame-size", str(frame_size))
    raw = socket.socket()
    sender: list[BaseException] = []
    try:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KIB)
        raw.settimeout(TIMEOUT)
        raw.connect(("127.0.0.1", d.port))
        raw.sendall(PROTOCOL_HEADER + pack([P.OPEN, {"max_frame_size": frame_size}], [P.ATTACH, 0, "raw"],
                                           [P.QUEUE_DECLARE, 0, "q", False, False, False, {}, False], [P.SYNC, 0]))
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        while not any(f[0] == P.COMPLETED and 1 in _ids(f[2]) for f in _feed(unpacker, raw.recv(65536))):
            pass
        before = _rss(d.proc.pid)
        n = 200_000
        query = msgpack.packb([P.QUEUE_QUERY, 0, "q"])

        def flood() -> None:
            try:
                raw.sendall(query * n)
            except BaseException as exc:  # noqa: BLE001 - reported below if it was not the test's close
                sender.append(exc)

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        limit = OUTPUT_LIMIT_FRAMES * frame_size

        def paused() -> dict | None:
            conns = [c for c in _api(d.mgmt_port, "/api/connections") if c["sessions"]]
            return conns[0] if conns and conns[0]["readingPaused"] else None

        deadline = time.monotonic() + TIMEOUT
        while (conn := paused()) is None:
            assert time.monotonic() < deadline, "the broker never stopped reading the flood"
            time.sleep(0.05)
        reply = len(msgpack.packb([P.RESULT, 0, n, _api(d.mgmt_port, "/api/queues/q")]))
        assert limit <= conn["outputBytes"] <= limit + 4 * reply, conn
        assert _rss(d.proc.pid) - before < 20 * 1024 * KIB  # all the replies: 40 MB and more
        # The client reads: every query is answered, in order, and the session carries on.
        ids = []
        raw.settimeout(TIMEOUT)
        while len(ids) < n:
            ids += [f[2] for f in _feed(unpacker, raw.recv(1024 * KIB)) if f[0] == P.RESULT]
        assert ids == list(range(2, n + 2))
        thread.join(TIMEOUT)
        assert not sender, sender
    finally:
        raw.close()
        d.stop()
