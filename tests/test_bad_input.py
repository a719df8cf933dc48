"""Bad input, with raw trio sockets and msgpack, against a real ``qflowd``.

Every case checks that the offending connection (or only the offending
command) gets a clear error, and then, through a separate client connected
before the bad input arrived, that the broker carries on and that the
messages enqueued before are all still there. One ``qflowd`` process serves
the whole module, so the bad cases also pile up on the same broker.

The last tests run ``qflowd`` itself: its ready line, SIGTERM/SIGINT, bad options.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.protocol.framing import PROTOCOL_HEADER

TIMEOUT = 30  # generous: a slow, noisy machine must still pass
KEPT = 5  # messages the healthy client enqueues before each bad case
_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


# -- the daemon -----------------------------------------------------------------------
def qflowd_command() -> list[str]:
    script = Path(sys.executable).with_name("qflowd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "qflow.cli.qflowd"]


class Daemon:
    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.stderr_path = stderr_path

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def read_first_line(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """The process's first stdout line; kills it if none comes within ``timeout``."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        reader.join(5)
        pytest.fail(f"no line from qflowd within {timeout} s")
    return box[0]


READY = re.compile(r"qflowd ready port=(\d+) mgmt-port=(\d+)\n\Z")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Daemon]:
    stderr_path = tmp_path_factory.mktemp("qflowd") / "stderr.log"
    data_dir = tmp_path_factory.mktemp("qflowd-data")  # never the default ~/.qflowd: suites may run side by side
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([*qflowd_command(), "--port", "0", "--log-level", "warning", "--data-dir", str(data_dir)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = read_first_line(proc)
    match = READY.match(line)
    assert match, f"bad ready line {line!r}: {stderr_path.read_text()}"
    d = Daemon(proc, int(match.group(1)), stderr_path)
    try:
        yield d
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Healthy:
    """A client connected before the bad input, with KEPT messages on its queue."""

    def __init__(self, daemon: Daemon, conn: qflow.client.Connection, ssn: qflow.Session, queue: str) -> None:
        self.daemon = daemon
        self.conn = conn
        self.ssn = ssn
        self.queue = queue
        self.checked = False

    async def depth(self, queue: str) -> int:
        return (await self.ssn.query_queue(queue))["msgDepth"]

    async def check(self) -> None:
        """The broker serves on: this session works, the kept messages are all there and fetchable."""
        with trio.fail_after(TIMEOUT):
            assert self.daemon.proc.poll() is None, "qflowd died"
            assert self.conn.error is None
            stats = await self.ssn.query_queue(self.queue)
            assert (stats["msgDepth"], stats["msgTotalEnqueues"]) == (KEPT, KEPT)
            fresh = unique("fresh")
            await self.ssn.declare_queue(fresh)
            sender = self.ssn.sender(fresh, capacity=2)
            await sender.send(b"ping")
            await sender.sync()
            receiver = await self.ssn.receiver(fresh, accept="none")
            assert (await receiver.fetch()).body == b"ping"
            await receiver.close()
            receiver = await self.ssn.receiver(self.queue, accept="none", capacity=KEPT)
            bodies = [(await receiver.fetch()).body for _ in range(KEPT)]
            assert bodies == [b"kept-%d" % i for i in range(KEPT)]
            await receiver.close()
            await self.ssn.sync()
            assert await self.depth(self.queue) == 0
        self.checked = True


@pytest.fixture
async def healthy(daemon: Daemon):
    conn = await qflow.connect("127.0.0.1", daemon.port)
    try:
        ssn = await conn.session()
        queue = unique("kept")
        await ssn.declare_queue(queue)
        sender = ssn.sender(queue, capacity=KEPT)
        for i in range(KEPT):
            await sender.send(b"kept-%d" % i)
        await sender.sync()
        h = Healthy(daemon, conn, ssn, queue)
        yield h
        assert h.checked, "the test did not check the broker after its bad input"
    finally:
        await conn.close()


# -- a raw connection --------------------------------------------------------------------
def pack(*frames: Any) -> bytes:
    return b"".join(msgpack.packb(f, use_bin_type=True) for f in frames)


class Raw:
    """A raw socket speaking (or not) the qflow protocol."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.pending: deque[list] = deque()
        self.seen: list[list] = []
        self.next_command = 0
        self.open_ok: dict = {}

    @classmethod
    async def connect(cls, port: int) -> Raw:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    @classmethod
    async def attached(cls, port: int, **open_options: Any) -> Raw:
        """Header, open and attach channel 0, answered."""
        raw = await cls.connect(port)
        await raw.send(PROTOCOL_HEADER + pack([P.OPEN, open_options], [P.ATTACH, 0, "raw"]))
        open_ok = await raw.until(P.OPEN_OK)
        raw.open_ok = open_ok[1]
        await raw.until(P.ATTACHED)
        return raw

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def command(self, *frame: Any) -> int:
        """Send one command on channel 0; returns its implicit command id."""
        await self.send(pack(list(frame)))
        cid = self.next_command
        self.next_command += 1
        return cid

    async def _read(self) -> bool:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset by the peer: as good as EOF here
            data = b""
        if not data:
            return False
        self.unpacker.feed(data)
        self.pending.extend(self.unpacker)
        return True

    async def until(self, code: int) -> list:
        """The next frame with ``code``; the others are kept in ``seen``."""
        while True:
            while self.pending:
                frame = self.pending.popleft()
                self.seen.append(frame)
                if frame[0] == code:
                    return frame
                assert frame[0] != P.CLOSE, f"connection closed while waiting for frame {code}: {frame}"
            assert await self._read(), f"EOF while waiting for frame {code}; seen {self.seen}"

    async def closed(self) -> list:
        """Read to EOF; the frames received, the last one must be connection.close."""
        while await self._read():
            pass
        frames = list(self.pending)
        self.pending.clear()
        self.seen.extend(frames)
        assert frames and frames[-1][0] == P.CLOSE, f"no connection.close before EOF: {self.seen}"
        return frames[-1]

    async def aclose(self) -> None:
        await self.stream.aclose()


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return data
        if not chunk:
            return data
        data += chunk


def close_after_header(data: bytes) -> list:
    """The broker's answer to a bad header: its own header, then connection.close."""
    assert data.startswith(PROTOCOL_HEADER), data[:40]
    data = data[len(PROTOCOL_HEADER):]
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    frames = list(unpacker)
    assert frames and frames[-1][0] == P.CLOSE, frames
    return frames[-1]


# -- before a protocol header ---------------------------------------------------------------
async def test_random_bytes_instead_of_header(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        junk = bytes(random.Random(1234).randrange(256) for _ in range(64))
        assert not junk.startswith(PROTOCOL_HEADER[:1])
        stream = await trio.open_tcp_stream("127.0.0.1", daemon.port)
        await stream.send_all(junk)
        close = close_after_header(await read_to_eof(stream))
        await stream.aclose()
        assert close[1] == 501
        assert "protocol header" in close[2]
    await healthy.check()


async def test_wrong_protocol_header(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", daemon.port)
        await stream.send_all(b"AMQP\x00\x00\x09\x01")  # AMQP 0-9-1: qflowd speaks 1.0
        answer = await read_to_eof(stream)
        await stream.aclose()
        assert answer == b"AMQP\x00\x01\x00\x00"  # the AMQP version it speaks, then the connection is over
    await healthy.check()


# -- malformed frames after a valid header and open ----------------------------------------
HUGE_HEADERS = {
    "bin32": b"\xc6\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "array32": b"\xdd\xff\xff\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
}


@pytest.mark.parametrize("kind", list(HUGE_HEADERS))
async def test_header_claiming_four_gigabytes(daemon, healthy, kind):
    rss_before = daemon.rss_kib()
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        # Inside a transfer frame, as a body, a routing key, properties... or as a frame itself.
        if kind in ("bin32", "str32"):
            data = b"\x96" + pack(P.TRANSFER, 0, "", healthy.queue, None) + HUGE_HEADERS[kind] + b"\x00" * 16
        else:
            data = HUGE_HEADERS[kind] + pack(P.HEARTBEAT) * 4
        await raw.send(data)
        close = await raw.closed()
        await raw.aclose()
        assert close[1] == 506, close
        assert "maximum frame size" in close[2]
    await healthy.check()
    assert daemon.rss_kib() - rss_before < 32 * 1024


@pytest.mark.parametrize("data, what", [
    (b"\xc1", "never-used msgpack byte 0xc1"),
    (b"\x93\x1f\x00\xc1", "0xc1 inside an array"),
    (msgpack.packb({"code": 31}), "a map"),
    (msgpack.packb(42), "an int"),
    (msgpack.packb("hello"), "a string"),
    (msgpack.packb([]), "an empty array"),
    (msgpack.packb(["31", 0]), "an array with a string code"),
    (msgpack.packb([True, 0]), "an array with a bool code"),
    (msgpack.packb([1.5, 0]), "an array with a float code"),
])
async def test_frame_that_is_not_a_qflow_frame(daemon, healthy, data, what):
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        await raw.send(data)
        close = await raw.closed()
        await raw.aclose()
        assert close[1] == 501, (what, close)
        assert close[2]
    await healthy.check()


async def expect_command_invalid(daemon, healthy, frame, fragment) -> None:
    """Send ``frame`` on an attached connection: it is closed with 503 naming ``fragment``."""
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        await raw.send(pack(frame))
        close = await raw.closed()
        await raw.aclose()
        assert close[1] == P.COMMAND_INVALID, close
        assert fragment in close[2]
    await healthy.check()


@pytest.mark.parametrize("frame, fragment", [
    ([25], "unknown frame code 25"),
    ([9, 0], "unknown frame code 9"),
    ([-1], "unknown frame code -1"),
    ([P.OPEN, {}], "connection.open"),
    ([P.ATTACH, 0, "again"], "already attached"),
    ([P.ATTACH, "zero", "x"], "session.attach"),
])
async def test_bad_control_frame(daemon, healthy, frame, fragment):
    await expect_command_invalid(daemon, healthy, frame, fragment)


@pytest.mark.parametrize("frame, fragment", [
    ([P.QUEUE_DECLARE, 7, "q", False, False, False, {}, False], "channel 7"),
    ([P.TRANSFER, 7, "", "q", None, b"x"], "channel 7"),
    ([P.QUEUE_QUERY], "channel None"),
    ([P.QUEUE_DECLARE, [1], "q", False, False, False, {}, False], "queue.declare"),
    ([P.TRANSFER, {"a": 1}, "", "q", None, b"x"], "message.transfer"),
    ([P.FLUSH, 7], "session.flush"),
    ([P.FLUSH, []], "session.flush"),
    ([P.DETACH, 7], "session.detach"),
    ([P.DETACH, [0]], "session.detach"),
])
async def test_command_on_unattached_channel(daemon, healthy, frame, fragment):
    await expect_command_invalid(daemon, healthy, frame, fragment)


@pytest.mark.parametrize("options, fragment", [
    ({"heartbeat": math.nan}, "heartbeat"),
    ({"heartbeat": -1}, "heartbeat"),
    ({"max_frame_size": 100}, "max_frame_size"),
    ({"max_frame_size": "big"}, "max_frame_size"),
    ({"mechanism": "KERBEROS"}, "mechanism"),
    ({"deliver_runs": 1}, "deliver_runs"),
])
async def test_bad_connection_open(daemon, healthy, options, fragment):
    with trio.fail_after(TIMEOUT):
        raw = await Raw.connect(daemon.port)
        await raw.send(PROTOCOL_HEADER + pack([P.OPEN, options]))
        close = await raw.closed()
        await raw.aclose()
        assert close[1] in (P.COMMAND_INVALID, P.NOT_ALLOWED), close
        assert fragment in close[2]
    await healthy.check()


async def test_frame_before_open(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        raw = await Raw.connect(daemon.port)
        await raw.send(PROTOCOL_HEADER + pack([P.ATTACH, 0, "early"]))
        close = await raw.closed()
        await raw.aclose()
        assert close[1] == P.COMMAND_INVALID
        assert "connection.open" in close[2]
    await healthy.check()


# -- commands that fail alone ------------------------------------------------------------------
async def expect_exception(raw: Raw, cid: int) -> list:
    exc = await raw.until(P.EXCEPTION)
    assert exc[1:3] == [0, cid], exc
    return exc


async def expect_session_usable(raw: Raw) -> None:
    """The next command on the same session works."""
    queue = unique("after")
    cid = await raw.command(P.QUEUE_DECLARE, 0, queue, False, False, False, {}, False)
    result = await raw.until(P.RESULT)
    assert result[2] == cid and result[3] == {"queue": queue, "created": True}, result


async def test_unknown_command_code(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        for code in (99, 1000, 2**40):
            cid = await raw.command(code, 0, "whatever", 1)
            exc = await expect_exception(raw, cid)
            assert exc[3] == P.NOT_IMPLEMENTED
            assert str(code) in exc[4]
            await expect_session_usable(raw)
        await raw.aclose()
    await healthy.check()


@pytest.mark.parametrize("frame, command, field", [
    ([P.QUEUE_DECLARE, 0, "q"], "queue.declare", "durable"),
    ([P.QUEUE_DECLARE, 0, "q", "yes", False, False, {}, False], "queue.declare", "durable"),
    ([P.QUEUE_DECLARE, 0, 5, False, False, False, {}, False], "queue.declare", "queue"),
    ([P.QUEUE_DECLARE, 0, "q", False, False, False, [], False], "queue.declare", "arguments"),
    ([P.QUEUE_DECLARE, 0, "q", False, False, False, {}, False, "extra"], "queue.declare", "passive"),
    ([P.TRANSFER, 0, "", "{queue}"], "message.transfer", "body"),
    ([P.TRANSFER, 0, "", "{queue}", None, "text, not bin"], "message.transfer", "body"),
    ([P.TRANSFER, 0, "", 5, None, b"x"], "message.transfer", "routing_key"),
    ([P.TRANSFER, 0, None, "{queue}", None, b"x"], "message.transfer", "exchange"),
    ([P.TRANSFER, 0, "", "{queue}", {"durable": "yes"}, b"x"], "message.transfer", "durable"),
    ([P.TRANSFER, 0, "", "{queue}", {"priority": 10}, b"x"], "message.transfer", "priority"),
    ([P.TRANSFER, 0, "", "{queue}", [1], b"x"], "message.transfer", "properties"),
    ([P.SUBSCRIBE, 0, "{queue}", "d", "explicit", 0], "message.subscribe", "accept_mode"),
    ([P.FLOW, 0, "d", "many", -1], "message.flow", "messages"),
    ([P.EXCHANGE_BIND, 0, "amq.direct", "{queue}"], "exchange.bind", "binding_key"),
    ([P.ACCEPT, 0, {"1": 2}], "message.accept", "transfers"),
    ([P.QUEUE_QUERY, 0, None], "queue.query", "queue"),
])
async def test_command_with_missing_or_mistyped_field(daemon, healthy, frame, command, field):
    with trio.fail_after(TIMEOUT):
        target = unique("target")
        await healthy.ssn.declare_queue(target)
        frame = [target if f == "{queue}" else f for f in frame]
        raw = await Raw.attached(daemon.port)
        cid = await raw.command(*frame)
        exc = await expect_exception(raw, cid)
        assert exc[3] == P.INVALID_ARGUMENT, exc
        assert command in exc[4] and field in exc[4], exc[4]
        await expect_session_usable(raw)
        await raw.aclose()
        stats = await healthy.ssn.query_queue(target)
        assert (stats["msgDepth"], stats["msgTotalEnqueues"], stats["consumerCount"]) == (0, 0, 0)
    await healthy.check()


@pytest.mark.parametrize("code", [P.ACCEPT, P.RELEASE])
async def test_accept_or_release_of_a_huge_range(daemon, healthy, code):
    """Ids nobody was given: nothing to do, and above all no loop over them."""
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        cid = await raw.command(code, 0, [0, 2**62, 2**62 + 2, 2**63 - 1])
        while True:
            completed = await raw.until(P.COMPLETED)
            if completed[2][0] <= cid <= completed[2][1]:
                break
        assert not [f for f in raw.seen if f[0] == P.EXCEPTION]
        await expect_session_usable(raw)
        await raw.aclose()
    await healthy.check()


@pytest.mark.parametrize("code", [P.ACCEPT, P.RELEASE])
async def test_accept_or_release_of_more_ranges_than_the_limit(daemon, healthy, code):
    """Issue 17: one accept frame of 80,000 ranges held the broker for a second.
    At most 10,000 ranges per command: one more is refused, naming the limit,
    and the session carries on."""
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        ranges = [x for i in range(10_001) for x in (2 * (10_001 - i), 2 * (10_001 - i))]  # descending
        cid = await raw.command(code, 0, ranges)
        exc = await expect_exception(raw, cid)
        assert exc[3] == P.RESOURCE_LIMIT_EXCEEDED
        assert "10001 ranges" in exc[4] and "limit of 10000" in exc[4], exc[4]
        await expect_session_usable(raw)
        cid = await raw.command(code, 0, ranges[2:])  # the limit itself is fine
        while True:
            completed = await raw.until(P.COMPLETED)
            if any(a <= cid <= b for a, b in zip(completed[2][::2], completed[2][1::2], strict=True)):
                break
        await raw.aclose()
    await healthy.check()


async def test_more_waiting_syncs_than_the_limit(daemon, healthy):
    """Issue 17: 400k execution.sync queued behind one held transfer. At most
    1000 syncs of a session wait at a time: the next is refused, naming the
    limit; those waiting complete once the held transfer does."""
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port)
        queue = unique("stopped")
        await raw.command(P.QUEUE_DECLARE, 0, queue, False, False, False,
                          {"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 0}, False)
        await raw.until(P.RESULT)
        await raw.command(P.TRANSFER, 0, "", queue, None, b"first")
        held = await raw.command(P.TRANSFER, 0, "", queue, None, b"held")
        first_sync = raw.next_command
        await raw.send(pack(*([P.SYNC, 0] for _ in range(1001))))
        raw.next_command += 1001
        exc = await expect_exception(raw, first_sync + 1000)
        assert exc[3] == P.RESOURCE_LIMIT_EXCEEDED and "the limit is 1000" in exc[4], exc[4]
        purge = await raw.command(P.QUEUE_PURGE, 0, queue)
        result = await raw.until(P.RESULT)
        assert result[2] == purge and result[3] == {"messages": 2}
        while True:
            done = RangeSetForTest()
            for frame in raw.seen:
                if frame[0] == P.COMPLETED:
                    done.add(frame)
            if done.covers(held, first_sync + 999):
                break
            await raw.until(P.COMPLETED)
        await expect_session_usable(raw)
        await raw.aclose()
    await healthy.check()


class RangeSetForTest:
    """The command ids a raw session has seen completed."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def add(self, frame: list) -> None:
        wire = frame[2]
        self.ranges += zip(wire[::2], wire[1::2], strict=True)

    def covers(self, first: int, last: int) -> bool:
        return all(any(a <= i <= b for a, b in self.ranges) for i in range(first, last + 1))


async def test_transfer_to_missing_exchange(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        async with await qflow.connect("127.0.0.1", daemon.port) as conn:
            ssn = await conn.session()
            sender = ssn.sender("no.such.exchange/key", capacity=3)
            await sender.send(b"lost")
            with pytest.raises(qflow.NotFound) as err:
                await sender.sync()
            assert "'no.such.exchange'" in err.value.text
            queue = unique("after-missing-exchange")
            await ssn.declare_queue(queue)
            ok = ssn.sender(queue)
            await ok.send(b"fine")
            await ok.sync()
            assert (await ssn.query_queue(queue))["msgDepth"] == 1
    await healthy.check()


async def test_subscribe_to_missing_queue(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        async with await qflow.connect("127.0.0.1", daemon.port) as conn:
            ssn = await conn.session()
            with pytest.raises(qflow.NotFound) as err:
                await ssn.receiver("no.such.queue")
            assert "'no.such.queue'" in err.value.text
            receiver = await ssn.receiver(healthy.queue, accept="explicit", capacity=1)
            m = await receiver.fetch()
            assert m.body == b"kept-0"
            receiver.release([m])  # back where it was, for the check
            await receiver.close()
            await ssn.sync()
    await healthy.check()


# -- frames bigger than negotiated ------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["body", "pipelined", "small-parts"])
async def test_frame_bigger_than_negotiated_max_frame_size(daemon, healthy, shape):
    with trio.fail_after(TIMEOUT):
        too_big = [P.TRANSFER, 0, "", healthy.queue, None, b"x" * 8192]
        if shape == "small-parts":  # no single item exceeds the limit, the frame does
            headers = {f"h{i}": "v" * 2000 for i in range(4)}
            too_big = [P.TRANSFER, 0, "", healthy.queue, {"headers": headers}, b"x"]
        if shape == "pipelined":  # open, attach and the big frame in one write
            raw = await Raw.connect(daemon.port)
            opening = pack([P.OPEN, {"max_frame_size": 4096}], [P.ATTACH, 0, "p"])
            await raw.send(PROTOCOL_HEADER + opening + pack(too_big))
        else:
            raw = await Raw.attached(daemon.port, max_frame_size=4096)
            assert raw.open_ok["max_frame_size"] == 4096
            await raw.send(pack(too_big))
        close = await raw.closed()
        await raw.aclose()
        assert close[1] == 506, close
        assert "4096" in close[2]
        if shape == "pipelined":
            assert [f[0] for f in raw.seen] == [P.OPEN_OK, P.ATTACHED, P.CLOSE]
    await healthy.check()


async def test_frame_within_negotiated_max_frame_size_is_fine(daemon, healthy):
    with trio.fail_after(TIMEOUT):
        raw = await Raw.attached(daemon.port, max_frame_size=4096)
        queue = unique("small")
        await raw.command(P.QUEUE_DECLARE, 0, queue, False, False, False, {}, False)
        await raw.until(P.RESULT)
        await raw.command(P.TRANSFER, 0, "", queue, None, b"x" * 3000)
        await raw.command(P.SYNC, 0)
        while True:
            completed = await raw.until(P.COMPLETED)
            if completed[2][-1] >= 2:
                break
        await raw.aclose()
        # The message's size: exchange, routing key and nil properties as encoded, and the body.
        size = len(msgpack.packb("") + msgpack.packb(queue) + msgpack.packb(None)) + 3000
        assert (await healthy.ssn.query_queue(queue))["byteDepth"] == size
    await healthy.check()


# -- the qflowd process ----------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_qflowd_ready_line_and_clean_exit(signum, tmp_path):
    proc = subprocess.Popen([*qflowd_command(), "--port", "0", "--data-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = read_first_line(proc)
        match = READY.match(line)
        assert match, repr(line)
        port, mgmt_port = int(match.group(1)), int(match.group(2))
        assert 0 < port < 65536 and 0 < mgmt_port < 65536 and port != mgmt_port
        # Listening: a client opens a connection and a session, and stays connected through the signal.
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as client:
            client.sendall(PROTOCOL_HEADER + pack([P.OPEN, {}], [P.ATTACH, 0, "s"]))
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            frames: list = []
            while len(frames) < 2:
                data = client.recv(65536)
                assert data, frames
                unpacker.feed(data)
                frames.extend(unpacker)
            assert [f[0] for f in frames] == [P.OPEN_OK, P.ATTACHED]
            proc.send_signal(signum)
            out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert out == "", "more than one line on stdout"
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args", [
    ["--port", "99999"],
    ["--default-flow-stop-threshold", "150"],
    ["--default-flow-stop-threshold", "50", "--default-flow-resume-threshold", "60"],
    ["--bogus"],
    ["--port", "many"],
])
def test_qflowd_bad_option(args):
    done = subprocess.run([*qflowd_command(), "--no-data-dir", *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ})
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.endswith("\n") and done.stderr.count("\n") == 1, repr(done.stderr)
    assert done.stderr.strip()
