"""The trio client: connections, sessions, senders with a capacity, receivers with credit.

    async with await qflow.connect("127.0.0.1", 5672) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("orders")
        sender = ssn.sender("orders", capacity=100)
        await sender.send(b"hello")
        await sender.sync()

A sender's *capacity* is the number of its transfers that may be incomplete;
``send`` waits while that many are outstanding. The broker holds completions
back while a destination queue's flow is stopped, so a sender stops after at
most ``capacity`` transfers: that is producer flow control.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import Any

import msgpack
import trio

from qflow import protocol as P
from qflow.protocol import DELIVER, DELIVER_RUN
from qflow.protocol.commands import OutgoingCommands
from qflow.protocol.entries import (
    ENTRY_HEAD,
    ENTRY_HEAD_SIZE,
    REDELIVERED_NO,
    REDELIVERED_YES,
    EntryError,
    scan_entries,
    seq_and_size,
)
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, READ_SIZE, FrameDecoder, FrameEncoder, FramingError
from qflow.protocol.ranges import RangeSet

log = logging.getLogger("qflow.client")

YIELD_EVERY = 256  # sends between checkpoints: big enough for 64 KiB-ish writes


class QflowError(Exception):
    """An error reported by the broker, with its AMQP-style code and text."""

    code = 0

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{text} (code {code})")
        self.code = code
        self.text = text


class NotFound(QflowError):
    pass


class ResourceLocked(QflowError):
    pass


class PreconditionFailed(QflowError):
    pass


class ResourceLimitExceeded(QflowError):
    pass


class InvalidArgument(QflowError):
    pass


class NotAllowed(QflowError):
    pass


class ConnectionClosed(QflowError):
    """The connection ended; ``code``/``text`` say why when the broker said."""


class FlowControlTimeout(QflowError):
    """``send`` waited longer than the sender's flow_timeout; the message was not sent."""


_BY_CODE = {P.NOT_FOUND: NotFound, P.RESOURCE_LOCKED: ResourceLocked, P.PRECONDITION_FAILED: PreconditionFailed,
            P.RESOURCE_LIMIT_EXCEEDED: ResourceLimitExceeded, P.INVALID_ARGUMENT: InvalidArgument,
            P.NOT_ALLOWED: NotAllowed}


_new = object.__new__

PACE_SLACK = 0.002  # a rate limiter sleeps only once this far ahead of its schedule


def _to_bytes(body: Any) -> bytes:
    if type(body) is str:
        return body.encode()
    return bytes(body)


def _properties(message_id: str | None, correlation_id: str | None, content_type: str | None, durable: bool,
                headers: dict[str, Any] | None) -> dict[str, Any]:
    props: dict[str, Any] = {}
    if message_id is not None:
        props["message_id"] = message_id
    if correlation_id is not None:
        props["correlation_id"] = correlation_id
    if content_type is not None:
        props["content_type"] = content_type
    if durable:
        props["durable"] = True
    if headers:
        props["headers"] = headers
    return props


async def _pace(previous: float, interval: float) -> float:
    """Rate limiting (HornetQ's producer-/consumer-max-rate): the slot of the
    next operation is ``interval`` after the previous one's. A sleep costs
    about a millisecond whatever its length, so sleeping per message would cap
    the rate near 1000/s: sleep only when ``PACE_SLACK`` ahead."""
    now = trio.current_time()
    slot = previous + interval
    if slot < now:
        slot = now  # idle time earns no burst
    if slot - now > PACE_SLACK:
        await trio.sleep_until(slot)
    return slot


def error_for(code: int, text: str) -> QflowError:
    return _BY_CODE.get(code, QflowError)(code, text)


async def connect(host: str = "127.0.0.1", port: int = 5672, *, name: str = "", heartbeat: float = 0,
                  max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> Connection:
    """Open a connection (ANONYMOUS) and wait for the broker's connection.open-ok."""
    stream = await trio.open_tcp_stream(host, port)
    conn = Connection(stream, name, heartbeat, max_frame_size)
    await conn._start()
    return conn


class _Waiter:
    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: Any = None
        self.error: QflowError | None = None


class Connection:
    def __init__(self, stream: trio.SocketStream, name: str, heartbeat: float, max_frame_size: int) -> None:
        self.stream = stream
        self.name = name
        self.heartbeat = heartbeat
        self.max_frame_size = max_frame_size
        self.decoder = FrameDecoder(max_frame_size, expect_header=False)
        self.encoder = FrameEncoder()
        self.sessions: dict[int, Session] = {}
        self.error: ConnectionClosed | None = None
        self._opened = trio.Event()
        self._wake = trio.Event()
        self._closed = trio.Event()
        self._next_channel = 0
        self._scope: trio.CancelScope | None = None
        self._tasks_done = trio.Event()

    async def _start(self) -> None:
        # The reader and writer live as long as the connection, not as long as
        # the caller's nursery: a system task owns them, and close() cancels it.
        self._scope = trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._background, name=f"qflow connection {self.name!r}")
        self.encoder.write_header()
        self.encoder.write([P.OPEN, {"mechanism": "ANONYMOUS", "name": self.name, "heartbeat": self.heartbeat,
                                     "max_frame_size": self.max_frame_size, "deliver_runs": True}])
        self.wake()
        try:
            await self._wait(self._opened)
        except BaseException:
            await self.close()
            raise

    async def _background(self) -> None:
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._writer)
                    if self.heartbeat:
                        nursery.start_soon(self._heartbeats)
        except Exception as exc:  # a system task must not raise: end the connection instead
            log.exception("qflow client connection failed")
            self._shutdown(ConnectionClosed(P.INTERNAL_ERROR, f"client error: {exc!r}"))
        finally:
            self._tasks_done.set()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def wake(self) -> None:
        self._wake.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def _wait(self, event: trio.Event) -> None:
        """Wait for ``event`` unless the connection closes first."""
        if event.is_set():
            return
        self.check()
        async with trio.open_nursery() as nursery:
            async def watch_close() -> None:
                await self._closed.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_close)
            await event.wait()
            nursery.cancel_scope.cancel()
        if not event.is_set():
            self.check()

    async def session(self, name: str = "") -> Session:
        self.check()
        channel = self._next_channel
        self._next_channel += 1
        ssn = Session(self, channel, name)
        self.sessions[channel] = ssn
        self.encoder.write([P.ATTACH, channel, name])
        self.wake()
        await self._wait(ssn._attached)
        return ssn

    async def close(self) -> None:
        """Close the connection; incomplete commands fail with ConnectionClosed."""
        if self._scope is None:
            return
        scope, self._scope = self._scope, None
        if self.error is None:
            self.encoder.write([P.CLOSE, P.NORMAL, "client closing"])
            self.wake()
            with trio.move_on_after(2):
                await self._closed.wait()
        self._shutdown(ConnectionClosed(P.NORMAL, "connection closed by the client"))
        scope.cancel()
        await self._tasks_done.wait()
        await self.stream.aclose()

    def _shutdown(self, error: ConnectionClosed) -> None:
        if self.error is None:
            self.error = error
        self._closed.set()
        for ssn in self.sessions.values():
            ssn._shutdown(self.error)

    async def _writer(self) -> None:
        # Runs until the encoder has no parts left before it waits again:
        # Sender.send wakes it only when it finds none.
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self.encoder.parts:
                    await self.stream.send_all(self.encoder.take())
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._shutdown(ConnectionClosed(P.CONNECTION_FORCED, f"connection lost: {exc}"))

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(self.heartbeat)
            self.encoder.write([P.HEARTBEAT])
            self.wake()

    async def _reader(self) -> None:
        timeout = self.heartbeat * 2 if self.heartbeat else math.inf
        try:
            while True:
                with trio.move_on_after(timeout) as scope:
                    data = await self.stream.receive_some(READ_SIZE)
                if scope.cancelled_caught:
                    raise ConnectionClosed(P.CONNECTION_FORCED, f"no frame from the broker for {timeout} s")
                if not data:
                    raise ConnectionClosed(P.CONNECTION_FORCED, "connection closed by the broker")
                self.decoder.feed(data)
                receiver = None  # the last receiver given deliveries: woken once per batch
                for frame in self.decoder.frames():
                    code = frame[0]
                    if code == DELIVER_RUN or code == DELIVER:
                        ssn = self.sessions.get(frame[1]) if len(frame) > 2 else None
                        r = ssn.receivers.get(frame[2]) if ssn is not None else None
                        if r is not None:
                            run = _Deliveries(r, frame) if code == DELIVER_RUN else _Deliveries.of_one(r, frame)
                            r._buffer.append(run)
                            if r is not receiver:
                                if receiver is not None:
                                    receiver._event.set()
                                receiver = r
                    else:
                        self._handle(frame)
                if receiver is not None:
                    receiver._event.set()
        except ConnectionClosed as exc:
            self._shutdown(exc)
        except (FramingError, EntryError) as exc:
            self._shutdown(ConnectionClosed(getattr(exc, "code", P.FRAMING_ERROR), f"bad data from the broker: {exc}"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._shutdown(ConnectionClosed(P.CONNECTION_FORCED, f"connection lost: {exc}"))

    def _handle(self, frame: list[Any]) -> None:
        code = frame[0]
        if code == P.COMPLETED:
            self.sessions[frame[1]]._completed(frame[2])
        elif code == P.RESULT:
            self.sessions[frame[1]]._result(frame[2], frame[3])
        elif code == P.EXCEPTION:
            self.sessions[frame[1]]._exception(frame[2], frame[3], frame[4])
        elif code == P.FLOW_NOTICE:
            self.sessions[frame[1]]._flow_notice(frame[2], frame[3])
        elif code == P.ATTACHED:
            self.sessions[frame[1]]._attached.set()
        elif code == P.DETACHED:
            ssn = self.sessions.pop(frame[1], None)
            if ssn is not None:
                ssn._shutdown(ConnectionClosed(frame[2], f"session detached: {frame[3]}"))
        elif code == P.OPEN_OK:
            self.max_frame_size = frame[1].get("max_frame_size", self.max_frame_size)
            self._opened.set()
        elif code == P.CLOSE:
            raise ConnectionClosed(frame[1], frame[2])
        elif code == P.HEARTBEAT:
            pass
        else:
            raise ConnectionClosed(P.FRAMING_ERROR, f"unexpected frame code {code} from the broker")


class Session:
    def __init__(self, conn: Connection, channel: int, name: str) -> None:
        self.conn = conn
        self.channel = channel
        self.name = name
        self.commands = OutgoingCommands()
        self.senders: list[Sender] = []
        self.receivers: dict[str, Receiver] = {}
        self.held_by: dict[str, float] = {}  # queue -> trio time its flow notice arrived
        self.error: ConnectionClosed | None = None
        self._attached = trio.Event()
        self._next_destination = 0

    # -- frames from the connection ------------------------------------------
    def _completed(self, wire: list[int]) -> None:
        for owner, n in self.commands.completed_counts(wire).items():
            if owner is None:
                continue
            if type(owner) is _Waiter:
                owner.event.set()
            else:
                owner._complete(n)

    def _result(self, cid: int, value: Any) -> None:
        owner = self.commands.owner_of(cid)
        if type(owner) is _Waiter:
            owner.result = value

    def _exception(self, cid: int, code: int, text: str) -> None:
        owner = self.commands.owner_of(cid)
        err = error_for(code, text)
        if type(owner) is _Waiter:
            owner.error = err
        elif isinstance(owner, Sender):
            owner.errors.append(err)
        else:
            log.warning("broker refused command %d: %s", cid, err)

    def _flow_notice(self, queue: str, held: bool) -> None:
        if held:
            self.held_by[queue] = trio.current_time()
        else:
            self.held_by.pop(queue, None)

    def _shutdown(self, error: ConnectionClosed) -> None:
        self.error = error
        for owner in list(self.commands.incomplete.values()):
            if type(owner) is _Waiter:
                owner.error = owner.error or error
                owner.event.set()
        for sender in self.senders:
            sender._wake()
        for receiver in self.receivers.values():
            receiver._event.set()

    # -- commands ---------------------------------------------------------------
    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _send_command(self, code: int, *fields: Any, owner: Any = None) -> int:
        self.check()
        cid = self.commands.send(owner)
        self.conn.encoder.write([code, self.channel, *fields])
        self.conn.wake()
        return cid

    async def _call(self, code: int, *fields: Any) -> Any:
        waiter = _Waiter()
        self._send_command(code, *fields, owner=waiter)
        await self.conn._wait(waiter.event)
        if waiter.error is not None:
            raise waiter.error
        self.check()
        return waiter.result

    async def declare_queue(self, name: str, *, durable: bool = False, exclusive: bool = False,
                            auto_delete: bool = False, arguments: dict[str, Any] | None = None,
                            passive: bool = False) -> dict[str, Any]:
        return await self._call(P.QUEUE_DECLARE, name, durable, exclusive, auto_delete, arguments or {}, passive)

    async def delete_queue(self, name: str, *, if_empty: bool = False, if_unused: bool = False) -> dict[str, Any]:
        return await self._call(P.QUEUE_DELETE, name, if_empty, if_unused)

    async def remove_through(self, name: str, sequence: int) -> int:
        """Remove every available message of ``name`` with a sequence number up
        to and including ``sequence``; returns how many were removed."""
        return (await self._call(P.QUEUE_REMOVE_THROUGH, name, sequence))["messages"]

    async def purge_queue(self, name: str) -> dict[str, Any]:
        return await self._call(P.QUEUE_PURGE, name)

    async def query_queue(self, name: str) -> dict[str, Any]:
        """The queue's statistics, with the QMF names (msgDepth, flowStopped, ...)."""
        return await self._call(P.QUEUE_QUERY, name)

    async def modify_queue(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Change a live queue's limits or flow thresholds."""
        return await self._call(P.QUEUE_MODIFY, name, arguments)

    async def declare_exchange(self, name: str, type: str = "direct", *, durable: bool = False,
                               passive: bool = False) -> dict[str, Any]:
        return await self._call(P.EXCHANGE_DECLARE, name, type, durable, passive)

    async def delete_exchange(self, name: str, *, if_unused: bool = False) -> None:
        await self._call(P.EXCHANGE_DELETE, name, if_unused)

    async def bind(self, exchange: str, queue: str, key: str = "") -> None:
        await self._call(P.EXCHANGE_BIND, exchange, queue, key)

    async def unbind(self, exchange: str, queue: str, key: str = "") -> None:
        await self._call(P.EXCHANGE_UNBIND, exchange, queue, key)

    async def sync(self) -> None:
        """execution.sync: wait until every command sent so far is complete."""
        await self._call(P.SYNC)

    def sender(self, address: str, *, capacity: int = 1000, rate: float | None = None,
               flow_notify: float = 5.0, flow_timeout: float | None = None) -> Sender:
        """A sender to ``address``: a queue name (default exchange) or ``EXCHANGE/ROUTING-KEY``."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        exchange, _, key = address.partition("/") if "/" in address else ("", "", address)
        sender = Sender(self, exchange, key, capacity, rate, flow_notify, flow_timeout)
        self.senders.append(sender)
        self._announce_capacity()
        return sender

    def _announce_capacity(self) -> None:
        self._send_command(P.SENDER_CAPACITY, sum(s.capacity for s in self.senders if not s.closed))

    async def receiver(self, queue: str, *, capacity: int = 1000, accept: str = "auto",
                       destination: str | None = None, rate: float | None = None,
                       ack_frequency: int | None = None, browse: bool = False,
                       start_sequence: int = 0) -> Receiver:
        """Subscribe to ``queue``. ``accept``: ``auto`` (fetched messages are
        accepted in batches), ``explicit`` (call ``accept``), or ``none`` (the
        broker dequeues on delivery). ``capacity`` is the credit window in messages.
        ``browse=True`` reads without removing (as Qpid's browse mode), from the
        message with sequence number ``start_sequence`` on."""
        if accept not in ("auto", "explicit", "none"):
            raise ValueError("accept must be 'auto', 'explicit' or 'none'")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if destination is None:
            destination = f"{queue}#{self._next_destination}"
            self._next_destination += 1
        receiver = Receiver(self, queue, destination, capacity, accept, rate, ack_frequency)
        self.receivers[destination] = receiver
        if browse:
            accept = "none"
        mode = P.ACCEPT_NONE if accept == "none" else P.ACCEPT_EXPLICIT
        acquire = P.ACQUIRE_NOT_ACQUIRED if browse else P.ACQUIRE_PRE_ACQUIRED
        receiver.accept_mode = accept
        try:
            await self._call(P.SUBSCRIBE, queue, destination, mode, acquire, start_sequence)
        except BaseException:
            del self.receivers[destination]
            raise
        self._send_command(P.FLOW, destination, capacity, P.UNLIMITED)
        return receiver


def _bin_header(n: int) -> bytes:
    """msgpack's bin header for ``n`` bytes, as the Packer writes it."""
    if n < 0x100:
        return bytes((0xC4, n))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class Sender:
    def __init__(self, session: Session, exchange: str, routing_key: str, capacity: int, rate: float | None,
                 flow_notify: float, flow_timeout: float | None) -> None:
        self.session = session
        self._exchange = exchange
        self._routing_key = routing_key
        self._set_head()
        self._commands = session.commands  # for the per-message path: these objects live as long as the sender
        self._conn = session.conn
        self._parts = session.conn.encoder.parts
        self.capacity = capacity
        self.incomplete = 0
        self.max_incomplete = 0  # the most ever outstanding at once
        self.errors: list[QflowError] = []
        self.closed = False
        self.flow_notify = flow_notify
        self.flow_timeout = flow_timeout
        self._interval = 1.0 / rate if rate else 0.0
        self._next_send = 0.0
        self._space = trio.Event()
        self._unyielded = 0

    def _set_head(self) -> None:
        # A transfer with no properties, encoded as the Packer would: these
        # bytes, then the body's bin header and the body. The header of the
        # last body size is kept with them: bodies of one size are the rule.
        self._head = (b"\x96" + msgpack.packb(P.TRANSFER) + msgpack.packb(self.session.channel)
                      + msgpack.packb(self._exchange) + msgpack.packb(self._routing_key) + b"\xc0")
        self._prefix_size = 0
        self._prefix = self._head + _bin_header(0)

    @property
    def exchange(self) -> str:
        return self._exchange

    @exchange.setter
    def exchange(self, value: str) -> None:
        self._exchange = value
        self._set_head()

    @property
    def routing_key(self) -> str:
        return self._routing_key

    @routing_key.setter
    def routing_key(self, value: str) -> None:
        self._routing_key = value
        self._set_head()

    def _complete(self, n: int) -> None:
        self.incomplete -= n
        self._space.set()

    def _wake(self) -> None:
        self._space.set()

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.session.check()

    async def send(self, body: bytes | str, *, routing_key: str | None = None, message_id: str | None = None,
                   correlation_id: str | None = None, content_type: str | None = None, durable: bool = False,
                   headers: dict[str, Any] | None = None) -> None:
        """Send one message; waits while ``capacity`` transfers are incomplete.
        Raises the broker's error for an earlier transfer that it refused."""
        incomplete = self.incomplete
        if (incomplete >= self.capacity or self.errors or self.session.error or self._interval
                or routing_key is not None or message_id is not None or correlation_id is not None
                or content_type is not None or durable or headers or type(body) is not bytes
                or len(body) != self._prefix_size):
            await self._send(body, routing_key, message_id, correlation_id, content_type, durable, headers)
            return
        # The per-message path: a transfer with no properties whose body is the
        # size of the last, written from cached bytes (what _send does, less).
        commands = self._commands
        cid = commands.next_id
        commands.next_id = cid + 1
        if commands.last_owner is not self:
            commands.new_run(cid, self)
        parts = self._parts
        if not parts:
            self._conn._wake.set()  # pieces waiting mean the writer was woken for them
        parts.append(self._prefix)
        parts.append(body)
        incomplete += 1
        self.incomplete = incomplete
        if incomplete > self.max_incomplete:
            self.max_incomplete = incomplete
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    async def _send(self, body: bytes | str, routing_key: str | None, message_id: str | None,
                    correlation_id: str | None, content_type: str | None, durable: bool,
                    headers: dict[str, Any] | None) -> None:
        """send, any message: waits for room, paces, encodes properties."""
        if self.errors or self.session.error:
            self._raise_errors()
        if self.incomplete >= self.capacity:
            await self._wait_for_space()
        if self._interval:
            self._next_send = await _pace(self._next_send, self._interval)
        if type(body) is not bytes:
            body = _to_bytes(body)
        # Session._send_command, with the sender's own encoding of a plain transfer.
        ssn = self.session
        commands = ssn.commands
        cid = commands.next_id
        commands.next_id = cid + 1
        if commands.last_owner is not self:
            commands.new_run(cid, self)
        conn = ssn.conn
        if (routing_key is None and message_id is None and correlation_id is None and content_type is None
                and not durable and not headers):
            if len(body) != self._prefix_size:
                self._prefix_size = len(body)
                self._prefix = self._head + _bin_header(len(body))
            parts = conn.encoder.parts
            if not parts:
                # Pieces waiting mean the writer was woken for them and will
                # take this too (it writes until there are none).
                conn._wake.set()
            parts.append(self._prefix)
            parts.append(body)
        else:
            props = None
            if message_id is not None or correlation_id is not None or content_type is not None or durable \
                    or headers:
                props = _properties(message_id, correlation_id, content_type, durable, headers)
            conn.encoder.write((P.TRANSFER, ssn.channel, self._exchange,
                                self._routing_key if routing_key is None else routing_key, props, body))
            conn._wake.set()
        self.incomplete += 1
        if self.incomplete > self.max_incomplete:
            self.max_incomplete = self.incomplete
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            # Let the writer send this batch while we pack the next one.
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    async def send_many(self, bodies: Iterable[bytes | str], *, routing_key: str | None = None,
                        message_id: str | None = None, correlation_id: str | None = None,
                        content_type: str | None = None, durable: bool = False,
                        headers: dict[str, Any] | None = None) -> int:
        """Send one message per body, in order, all with the same routing key and
        properties; returns how many were sent. The same as calling ``send`` for
        each body (the capacity still bounds the incomplete transfers, and
        ``send_many`` waits while it is reached), at a fraction of the cost per
        message: transfers are encoded in runs as long as the window allows.
        A refusal of an earlier transfer is raised, and the bodies not yet sent
        then are not sent."""
        if self._interval:  # paced: one at a time is the point
            n = 0
            for body in bodies:
                await self.send(body, routing_key=routing_key, message_id=message_id, correlation_id=correlation_id,
                                content_type=content_type, durable=durable, headers=headers)
                n += 1
            return n
        if self.errors or self.session.error:
            self._raise_errors()
        props = None
        if message_id is not None or correlation_id is not None or content_type is not None or durable or headers:
            props = _properties(message_id, correlation_id, content_type, durable, headers)
        key = self._routing_key if routing_key is None else routing_key
        ssn = self.session
        conn = ssn.conn
        commands = ssn.commands
        write = conn.encoder.write
        head = (P.TRANSFER, ssn.channel, self._exchange, key, props)
        plain = props is None and key == self._routing_key  # then as send encodes it
        it = iter(bodies)
        sent = 0
        while True:
            if self.errors or ssn.error:
                self._raise_errors()  # a refusal stops the run: what is left is not sent
            room = self.capacity - self.incomplete
            if room <= 0:
                await self._wait_for_space()
                continue
            # A run: at most the window's room, and small enough to be written
            # while the next one is encoded.
            run = list(islice(it, min(room, YIELD_EVERY)))
            if not run:
                return sent
            cid = commands.next_id
            if plain:
                append = conn.encoder.parts.append
                for body in run:
                    if type(body) is not bytes:
                        body = _to_bytes(body)
                    if len(body) != self._prefix_size:
                        self._prefix_size = len(body)
                        self._prefix = self._head + _bin_header(len(body))
                    append(self._prefix)
                    append(body)
            else:
                for body in run:
                    if type(body) is not bytes:
                        body = _to_bytes(body)
                    write((*head, body))
            n = len(run)
            if commands.last_owner is not self:
                commands.new_run(cid, self)
            commands.next_id = cid + n
            self.incomplete += n
            if self.incomplete > self.max_incomplete:
                self.max_incomplete = self.incomplete
            sent += n
            conn._wake.set()
            await trio.lowlevel.checkpoint()

    async def _wait_for_space(self) -> None:
        started = trio.current_time()
        next_notice = started + self.flow_notify
        deadline = started + self.flow_timeout if self.flow_timeout else math.inf
        while self.incomplete >= self.capacity:
            self._raise_errors()
            self._space = trio.Event()
            with trio.move_on_at(min(next_notice, deadline)):
                # No Connection._wait (a nursery and a task per wait): a session
                # shutting down sets _space itself (Session._shutdown).
                await self._space.wait()
                continue
            now = trio.current_time()
            held = ", ".join(sorted(self.session.held_by)) or "none"
            if now >= deadline:
                raise FlowControlTimeout(
                    P.RESOURCE_LIMIT_EXCEEDED,
                    f"send timed out after {now - started:.0f}s waiting for broker flow control (queues: {held})")
            if self.session.held_by:
                log.warning("send delayed by %.0fs due to broker flow control on queue %s", now - started, held)
            next_notice += self.flow_notify
        self._raise_errors()

    async def sync(self) -> None:
        """Wait until every transfer of this sender is complete; raises the
        first refusal among them, if any."""
        self.session.conn.encoder.write([P.FLUSH, self.session.channel])
        self.session.conn.wake()
        while self.incomplete:
            self._raise_errors()
            self._space = trio.Event()
            await self._space.wait()  # set by a completion or Session._shutdown
        self._raise_errors()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.session._announce_capacity()


class _Deliveries:
    """The messages of one message.deliver-run frame: ``count`` stored entries
    back to back in ``blob`` (qflow.protocol.entries), delivery ids ``first_id`` on.
    Scanned once; a message's fields are read out of the blob when asked for."""

    __slots__ = ("receiver", "first_id", "count", "blob", "offsets")

    def __init__(self, receiver: Receiver, frame: list[Any]) -> None:
        if len(frame) != 6 or type(frame[3]) is not int or type(frame[4]) is not int or frame[4] < 1 \
                or type(frame[5]) is not bytes:
            raise FramingError(f"malformed message.deliver-run for {frame[2]!r}")
        self.receiver = receiver
        self.first_id = frame[3]
        self.count = frame[4]
        self.blob = frame[5]
        self.offsets = scan_entries(self.blob, self.count)

    @classmethod
    def of_one(cls, receiver: Receiver, frame: list[Any]) -> _Deliveries:
        """A message.deliver frame (a broker that sends no runs) as a run of one."""
        try:
            _, _, _, did, redelivered, seq, size, exchange, key, props, body = frame
            blob = ENTRY_HEAD.pack(REDELIVERED_YES if redelivered else REDELIVERED_NO, 0xCF, seq, 0xCF, size) \
                + msgpack.packb(exchange) + msgpack.packb(key) + msgpack.packb(props) + msgpack.packb(body)
        except Exception as exc:  # a wrong field count or type: struct and msgpack say which
            raise FramingError(f"malformed message.deliver: {type(exc).__name__}: {exc}") from None
        return cls(receiver, [DELIVER_RUN, frame[1], frame[2], did, 1, blob])


class _NoDeliveries:
    """Where a receiver starts: a run with nothing left in it."""

    first_id = count = 0


class ReceivedMessage:
    """A delivered message. Its fields are read from the frame that carried it
    when asked for, not copied out for every message; so a message kept alive
    keeps that frame's bytes (up to a frame's size) alive too."""

    __slots__ = ("_run", "_i", "_fields")

    def __init__(self, run: _Deliveries, i: int) -> None:
        self._run = run
        self._i = i

    @property
    def body(self) -> bytes:
        run = self._run
        j = 2 * self._i
        return run.blob[run.offsets[j + 1]:run.offsets[j + 2]]

    @property
    def delivery_id(self) -> int:
        return self._run.first_id + self._i

    @property
    def redelivered(self) -> bool:
        run = self._run
        return run.blob[run.offsets[2 * self._i]] == REDELIVERED_YES

    @property
    def sequence(self) -> int:
        """The message's place in its queue."""
        run = self._run
        return seq_and_size(run.blob, run.offsets[2 * self._i])[0]

    def _decoded(self) -> tuple[str, str, dict[str, Any]]:
        try:
            return self._fields
        except AttributeError:
            run = self._run
            j = 2 * self._i
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            unpacker.feed(run.blob[run.offsets[j] + ENTRY_HEAD_SIZE:run.offsets[j + 1]])
            self._fields = (unpacker.unpack(), unpacker.unpack(), unpacker.unpack() or {})
            return self._fields

    @property
    def exchange(self) -> str:
        return self._decoded()[0]

    @property
    def routing_key(self) -> str:
        return self._decoded()[1]

    @property
    def properties(self) -> dict[str, Any]:
        return self._decoded()[2]

    @property
    def message_id(self) -> str | None:
        return self.properties.get("message_id")

    @property
    def correlation_id(self) -> str | None:
        return self.properties.get("correlation_id")

    @property
    def content_type(self) -> str | None:
        return self.properties.get("content_type")

    @property
    def durable(self) -> bool:
        return bool(self.properties.get("durable", False))

    @property
    def headers(self) -> dict[str, Any]:
        return self.properties.get("headers") or {}

    def accept(self) -> None:
        self._run.receiver.accept([self])

    def release(self) -> None:
        self._run.receiver.release([self])


class Empty(Exception):
    """``fetch`` timed out with no message."""


class Receiver:
    def __init__(self, session: Session, queue: str, destination: str, capacity: int, accept: str,
                 rate: float | None, ack_frequency: int | None) -> None:
        self.session = session
        self.queue = queue
        self.destination = destination
        self.capacity = capacity
        self.accept_mode = accept
        self.ack_frequency = ack_frequency or max(1, capacity // 2)
        self._buffer: deque[_Deliveries] = deque()  # runs the connection's reader appends, not yet begun
        self._run: _Deliveries | _NoDeliveries = _NoDeliveries()  # the run being fetched from
        self._i = 0  # the next message of _run to fetch
        self._event = trio.Event()
        # Credit and auto-accept are settled every so many fetches: _taken counts
        # every message fetched, the marks say where each was last settled, and
        # _next_settle is the count at which one of them is next due.
        self._taken = 0
        self._credit_mark = 0
        self._credit_batch = max(1, capacity // 2)  # credit goes back in batches this big
        self._ack_mark = 0
        self._set_next_settle()
        self._to_accept = RangeSet()
        self._spanned = 0  # auto accept: _run's messages before this one are in _to_accept
        self._interval = 1.0 / rate if rate else 0.0
        self._next_fetch = 0.0

    def available(self) -> int:
        """Messages arrived and not fetched yet."""
        return self._run.count - self._i + sum(run.count for run in self._buffer)

    async def fetch(self, timeout: float | None = None) -> ReceivedMessage:
        """The next message; raises Empty after ``timeout`` seconds without one."""
        run = self._run
        i = self._i
        if i == run.count or self._interval:
            run, i = await self._fetch_slowly(timeout)
        self._i = i + 1
        taken = self._taken + 1
        self._taken = taken
        if taken >= self._next_settle:
            await self._settle()
        # ReceivedMessage(run, i) without the cost of calling __init__: the per-message path.
        message = _new(ReceivedMessage)
        message._run = run
        message._i = i
        return message

    async def _fetch_slowly(self, timeout: float | None) -> tuple[_Deliveries, int]:
        """fetch's other path: pacing, and a run to begin (waiting for one)."""
        if self._interval:
            self._next_fetch = await _pace(self._next_fetch, self._interval)
        if self._i == self._run.count:
            if not self._buffer:
                await self._wait_for_message(timeout)
            self._next_run()
        return self._run, self._i

    async def fetch_many(self, limit: int | None = None, timeout: float | None = None) -> list[ReceivedMessage]:
        """The messages that have arrived, at most ``limit`` (all by default) and
        at least one: waits for the first as ``fetch`` does, raising Empty after
        ``timeout`` seconds. Credit and auto-accept work as for ``fetch``, once
        per call instead of once per message."""
        if limit is not None and limit < 1:
            raise ValueError(f"fetch_many: limit must be at least 1, not {limit}")
        if self._interval:  # paced: one at a time is the point
            return [await self.fetch(timeout)]
        available = self.available()
        if not available:
            await self._wait_for_message(timeout)
            available = self.available()
        n = available if limit is None else min(limit, available)
        messages: list[ReceivedMessage] = []
        while len(messages) < n:
            run = self._run
            i = self._i
            if i == run.count:
                run = self._next_run()
                i = 0
            j = min(run.count, i + n - len(messages))
            append = messages.append
            for k in range(i, j):  # ReceivedMessage(run, k), without calling __init__, as fetch does
                message = _new(ReceivedMessage)
                message._run = run
                message._i = k
                append(message)
            self._i = j
        self._taken += n
        if self._taken >= self._next_settle:
            await self._settle()
        return messages

    def _set_next_settle(self) -> None:
        self._next_settle = min(self._credit_mark + self._credit_batch, self._ack_mark + self.ack_frequency)

    async def _settle(self) -> None:
        """Auto-accept what was fetched, give credit back, each when due (at
        least one is: both set _next_settle again)."""
        if self._taken - self._ack_mark >= self.ack_frequency:
            self._flush_acks()
        fetched = self._taken - self._credit_mark
        if fetched >= self._credit_batch:
            self.session._send_command(P.FLOW, self.destination, fetched, 0)
            self._credit_mark = self._taken
            self._set_next_settle()
            await trio.lowlevel.checkpoint()  # the credit goes out now, not when the buffer runs dry

    def _next_run(self) -> _Deliveries:
        """Begin the next run in the buffer (there is one)."""
        self._span()
        run = self._run = self._buffer.popleft()
        self._i = self._spanned = 0
        return run

    async def _wait_for_message(self, timeout: float | None) -> None:
        while not self._buffer:
            self.session.check()
            self._flush_acks()
            self._event = trio.Event()
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await self._event.wait()  # set by deliveries or Session._shutdown
            if not self._buffer:
                self.session.check()
                if not self._event.is_set():
                    raise Empty(f"no message on {self.queue!r} within {timeout} s")

    def _span(self) -> None:
        """Auto accept: the messages of the current run fetched since the last
        span go into _to_accept, as one range (a run's ids are consecutive)."""
        i = self._i
        if i > self._spanned and self.accept_mode == "auto":
            first = self._run.first_id
            self._to_accept.add_range(first + self._spanned, first + i - 1)
        self._spanned = i

    def _flush_acks(self) -> None:
        self._span()
        if self._to_accept and self.session.error is None:
            self.session._send_command(P.ACCEPT, self._to_accept.to_wire())
            self._to_accept = RangeSet()
        self._ack_mark = self._taken
        self._set_next_settle()

    def accept(self, messages: list[ReceivedMessage]) -> None:
        ids = RangeSet()
        for m in messages:
            ids.add(m.delivery_id)
        self.session._send_command(P.ACCEPT, ids.to_wire())

    def release(self, messages: list[ReceivedMessage]) -> None:
        ids = RangeSet()
        for m in messages:
            ids.add(m.delivery_id)
        self.session._send_command(P.RELEASE, ids.to_wire())

    async def close(self) -> None:
        """Accept what was fetched (auto mode) and cancel the subscription."""
        self._flush_acks()
        await self.session._call(P.CANCEL, self.destination)
        self.session.receivers.pop(self.destination, None)
