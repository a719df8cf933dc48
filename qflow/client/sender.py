"""Senders: message.transfer with a capacity window, which is what makes the
broker's flow control bound a queue's depth.

One transfer path: every transfer, from ``send`` or ``send_many``, plain or
with properties, is numbered by the session's OutgoingCommands and encoded as
``prefix + body``, where the prefix is qflow.protocol.encodings's (the same
bytes msgpack's Packer writes). A plain transfer (the sender's routing key and
its default properties: none, or ``{"durable": true}`` for a durable sender)
takes its prefix from a cache keyed by the body's size; that is the
per-message fast path, and it differs from the general one only there.

A sender knows its session only as a :class:`SenderSession`: its numbering,
its channel and the connection's encoder to write to.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any, Protocol

import trio

from qflow import protocol as P
from qflow.client.errors import ConnectionClosed, FlowControlTimeout, QflowError, ResourceLimitExceeded
from qflow.client.pacing import pace
from qflow.protocol.commands import OutgoingCommands
from qflow.protocol.encodings import bin_header, str_header, transfer_prefix, transfer_prefix_around_id
from qflow.protocol.framing import FrameEncoder

log = logging.getLogger("qflow.client")

YIELD_EVERY = 256  # sends between checkpoints: big enough for 64 KiB-ish writes


def _to_bytes(body: Any) -> bytes:
    if type(body) is str:
        return body.encode()
    return bytes(body)


def _properties(message_id: str | None, correlation_id: str | None, content_type: str | None, durable: bool,
                headers: dict[str, Any] | None, timestamp: int | None = None, ttl: int | None = None,
                priority: int | None = None) -> dict[str, Any] | None:
    """message.transfer's properties map, or None when there are none."""
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
    if timestamp is not None:
        props["timestamp"] = timestamp
    if ttl is not None:
        props["ttl"] = ttl
    if priority is not None:
        props["priority"] = priority
    return props or None


def _check_ids(bodies: Iterable[Any], ids: Sequence[Any], message_id: str | None) -> tuple[Sequence[Any],
                                                                                         Sequence[str]]:
    """send_many's ``message_ids``, checked before anything is sent."""
    if message_id is not None:
        raise ValueError("send_many: give message_id (one for all) or message_ids (one per body), not both")
    if not isinstance(bodies, (list, tuple)):
        bodies = list(bodies)
    if not isinstance(ids, (list, tuple)):
        ids = list(ids)
    if len(ids) != len(bodies):
        raise ValueError(f"send_many: {len(bodies)} bodies but {len(ids)} message ids; nothing sent")
    if not set(map(type, ids)) <= {str}:
        i = next(i for i, mid in enumerate(ids) if type(mid) is not str)
        raise ValueError(f"send_many: message_ids[{i}] is {type(ids[i]).__name__}, not str; nothing sent")
    return bodies, ids


def _head_part(attr: str, doc: str) -> property:
    """A sender's exchange, routing key or durability: setting it re-encodes the cached transfer head."""

    def get(self: Sender) -> str:
        return getattr(self, attr)

    def set_(self: Sender, value: str) -> None:
        setattr(self, attr, value)
        self._set_head()

    return property(get, set_, doc=doc)


class SenderConnection(Protocol):
    """What a sender uses of its connection (:class:`qflow.client.Connection` is one)."""

    encoder: FrameEncoder
    wakeup: trio.Event

    @property
    def max_frame_size(self) -> int: ...


class SenderSession(Protocol):
    """What a sender uses of its session (:class:`qflow.client.Session` is one)."""

    channel: int
    commands: OutgoingCommands
    error: ConnectionClosed | None
    held_by: dict[str, float]

    @property
    def conn(self) -> SenderConnection: ...

    def check(self) -> None: ...

    def held_text(self) -> str: ...

    def flush(self) -> None: ...

    def announce_capacity(self) -> None: ...


class Sender:
    """A producer: sends messages to one address, at most ``capacity`` of
    them incomplete at once (:meth:`Session.sender <qflow.client.Session.sender>`
    makes one).

    :meth:`send` waits while ``capacity`` transfers are incomplete, and the
    broker holds completions back while a destination queue's flow is
    stopped: that is how flow control reaches a producer. While it waits, a
    warning is logged every ``flow_notify`` seconds; after ``flow_timeout``
    seconds (if set) the send gives up with FlowControlTimeout.

    Completions may arrive out of order: a persistent message accepted before
    its commit completes at once, ahead of earlier ones still waiting for the
    disk, so "N completions" does not mean "the first N are safe"; read
    completion per command id.

    Its session calls :meth:`on_completed`, :meth:`on_refused` and
    :meth:`wake` as the broker reports on its transfers; they are not for
    applications.

    Attributes:
      session: the session it is on.
      capacity: the most transfers that may be incomplete at once.
      incomplete: its transfers sent and not complete yet.
      max_incomplete: the most that were ever incomplete at once.
      errors: the broker's refusals of its transfers not raised yet; the next
        call raises the first.
      closed: whether :meth:`close` was called.
      flow_notify: seconds between the warnings of a send held by flow control.
      flow_timeout: seconds a send waits for flow control before it gives up
        (None: no limit).
    """

    def __init__(self, session: SenderSession, exchange: str, routing_key: str, capacity: int,
                 rate: float | None, flow_notify: float, flow_timeout: float | None, durable: bool = False) -> None:
        self.session = session
        self._durable = bool(durable)
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
        # A plain transfer is _head, the body's bin header and the body. The
        # prefix of the last body size is kept: bodies of one size are the rule.
        self._props = _properties(None, None, None, self._durable, None)
        self._head = transfer_prefix(self.session.channel, self._exchange, self._routing_key, self._props)
        self._prefix_size = 0
        self._prefix = self._head + bin_header(0)

    def _plain_prefix(self, size: int) -> bytes:
        """A plain transfer's bytes before a body of ``size`` bytes (cached)."""
        if size != self._prefix_size:
            self._prefix_size = size
            self._prefix = self._head + bin_header(size)
        return self._prefix

    def _head_for(self, routing_key: str | None, props: dict[str, Any] | None) -> bytes | None:
        """The bytes before the bin header of a transfer with these fields;
        None for a plain one (its prefix is cached)."""
        if props == self._props and (routing_key is None or routing_key == self._routing_key):
            return None
        key = self._routing_key if routing_key is None else routing_key
        return transfer_prefix(self.session.channel, self._exchange, key, props)

    exchange = _head_part("_exchange", "The exchange this sender's messages go to.")
    routing_key = _head_part("_routing_key", "The routing key its messages carry unless a send gives one.")
    durable = _head_part("_durable", "Whether its messages are persistent unless a send says otherwise.")

    # -- reports from the session ------------------------------------------------
    def on_completed(self, n: int) -> None:
        """``n`` more of its transfers are complete: as many sends may go."""
        self.incomplete -= n
        self._space.set()

    def on_refused(self, error: QflowError) -> None:
        """The broker refused one of its transfers: the next call raises ``error``."""
        self.errors.append(error)

    def wake(self) -> None:
        """Wake the task waiting in a send or sync, to look again (its session ended)."""
        self._space.set()

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.session.check()

    async def send(self, body: bytes | str, *, routing_key: str | None = None, message_id: str | None = None,
                   correlation_id: str | None = None, content_type: str | None = None, durable: bool | None = None,
                   headers: dict[str, Any] | None = None, ttl: int | None = None,
                   priority: int | None = None) -> None:
        """Send one message, waiting while ``capacity`` transfers are incomplete.

        It returns once the transfer is queued for the connection's writer,
        not once the broker has it: :meth:`sync` waits for that.

        Args:
          body: the message's body (a str is sent as UTF-8).
          routing_key: instead of the sender's.
          message_id, correlation_id, content_type: the message's properties of those names.
          durable: whether it is persistent (None: the sender's ``durable``);
            on a durable queue its transfer completes only once the broker
            has it on disk.
          headers: application headers, a map.
          ttl: milliseconds the message may wait in a queue; once they have
            passed it is not delivered (the broker stamps its ``expiration``
            on arrival). None or 0: for ever (or the queue's ``x-message-ttl``).
          priority: 0 to 9 (None: none, which a priority queue takes as 4,
            as qpidd does); on a priority queue, higher goes first.

        Raises:
          QflowError: the broker's refusal of an earlier transfer of this sender.
          ResourceLimitExceeded: if its transfer would be larger than the
            connection's negotiated frame size; nothing is sent, and the
            session stays usable.
          FlowControlTimeout: if it waited ``flow_timeout`` seconds for room; not sent.
          ConnectionClosed: if the session or its connection ended.
        """
        incomplete = self.incomplete
        if (incomplete >= self.capacity or self.errors or self.session.error or self._interval
                or routing_key is not None or message_id is not None or correlation_id is not None
                or content_type is not None or durable is not None or headers or ttl is not None
                or priority is not None or type(body) is not bytes
                or len(body) != self._prefix_size):
            if durable is None:
                durable = self._durable
            body, prefix = await self._prepare(body, routing_key, _properties(
                message_id, correlation_id, content_type, durable, headers, ttl=ttl, priority=priority))
            incomplete = self.incomplete
        else:  # the per-message path: a plain transfer whose body is the size of the last, from cached bytes
            prefix = self._prefix
        # The one place a single transfer is numbered and written (send_many's runs do the same per run):
        # OutgoingCommands.send, inlined, because a call per message here costs the producer a few percent.
        commands = self._commands
        command_id = commands.next_id
        commands.next_id = command_id + 1
        if commands.last_owner is not self:
            commands.new_run(command_id, self)
        parts = self._parts
        if not parts:
            # Pieces waiting mean the writer was woken for them and will take
            # these too (it writes until there are none).
            self._conn.wakeup.set()
        parts.append(prefix)
        parts.append(body)
        incomplete += 1
        self.incomplete = incomplete
        if incomplete > self.max_incomplete:
            self.max_incomplete = incomplete
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            # Let the writer send this batch while we encode the next one.
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    async def send_with(self, body: bytes | str, properties: dict[str, Any] | None, *,
                        routing_key: str | None = None) -> None:
        """Send one message with a properties map the caller built; otherwise
        as :meth:`send`.

        For a writer that sets the properties per message, such as the Spark
        writer. :meth:`send` itself takes no timestamp: a parameter more would
        cost its per-message path a few percent.

        Args:
          body: the message's body (a str is sent as UTF-8).
          properties: any of message.transfer's keys (``message_id``,
            ``correlation_id``, ``content_type``, ``durable``, ``headers``,
            ``timestamp``: milliseconds since the Unix epoch; the broker does
            not stamp messages). Taken as it is: without ``durable`` the
            message is transient. None: the sender's default properties.
          routing_key: instead of the sender's.

        Raises:
          As :meth:`send`.
        """
        if properties is None and self._durable:
            properties = {"durable": True}
        props = properties or None
        body, _ = await self._prepare(body, routing_key, props)  # refusals, room, rate, size
        self._write_run([body], self._head_for(routing_key, props))  # numbered and written as a run of one
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    async def _prepare(self, body: bytes | str, routing_key: str | None,
                       props: dict[str, Any] | None) -> tuple[bytes, bytes]:
        """send's preliminaries, when there are any: raise a refusal, wait
        for room in the window, keep the rate; the body as bytes, and the
        transfer's bytes before it."""
        if self.errors or self.session.error:
            self._raise_errors()
        if self.incomplete >= self.capacity:
            await self._wait_for_space()
        if self._interval:
            self._next_send = await pace(self._next_send, self._interval)
        if type(body) is not bytes:
            body = _to_bytes(body)
        head = self._head_for(routing_key, props)
        self._check_size(len(body), head)
        return body, self._plain_prefix(len(body)) if head is None else head + bin_header(len(body))

    def _max_body(self, head: bytes | None) -> int:
        """The largest body that surely fits a transfer with ``head`` (or the
        plain head) in the connection's negotiated frame size."""
        return self._conn.max_frame_size - len(self._head if head is None else head) - 5  # bin 32's header

    def _check_size(self, size: int, head: bytes | None) -> None:
        """Refuse a body the broker could not take: a frame over the negotiated
        size would end the whole connection (the broker's 506), so the send is
        refused here, and the session stays usable."""
        if size <= self._max_body(head):
            return
        limit = self._conn.max_frame_size
        frame = len(self._head if head is None else head) + len(bin_header(size)) + size
        if frame > limit:
            raise ResourceLimitExceeded(
                P.RESOURCE_LIMIT_EXCEEDED, f"message too large: its transfer would be {frame} bytes, and this "
                f"connection's frames are at most {limit} bytes (the negotiated max_frame_size; the broker's "
                f"--max-frame-size); not sent")

    async def send_many(self, bodies: Iterable[bytes | str], *, routing_key: str | None = None,
                        message_id: str | None = None, correlation_id: str | None = None,
                        content_type: str | None = None, durable: bool | None = None,
                        headers: dict[str, Any] | None = None, timestamp: int | None = None,
                        message_ids: Sequence[str] | None = None) -> int:
        """Send one message per body, in order, all with the same routing key
        and properties.

        The same as calling :meth:`send` for each body (the capacity still
        bounds the incomplete transfers, and ``send_many`` waits while it is
        reached), at a fraction of the cost per message: transfers are
        encoded in runs as long as the window allows.

        Args:
          bodies: the messages' bodies.
          routing_key, message_id, correlation_id, content_type, durable, headers:
            as for :meth:`send`, the same for every message.
          timestamp: milliseconds since the Unix epoch, the same for all; with
            ``message_ids`` it follows each id in the properties.
          message_ids: one str per body, giving each message its own id
            (instead of ``message_id``, the same for all); the broker still
            takes such transfers as one run.

        Returns:
          How many messages were sent.

        Raises:
          ValueError: if ``message_ids`` and ``bodies`` differ in number, an id
            is not a str, or both ``message_id`` and ``message_ids`` are given;
            nothing is sent.
          QflowError: the broker's refusal of an earlier transfer; the bodies
            not sent yet then are not sent.
          ResourceLimitExceeded: if a body is too large for the connection's
            frames; the bodies before it are sent, it and those after it are not.
          FlowControlTimeout, ConnectionClosed: as for :meth:`send`.
        """
        if durable is None:
            durable = self._durable
        if message_ids is not None:
            bodies, message_ids = _check_ids(bodies, message_ids, message_id)
        if self._interval:  # paced: one at a time is the point
            props = _properties(message_id, correlation_id, content_type, durable, headers, timestamp) or {}
            n = 0
            ids = iter(message_ids) if message_ids is not None else None
            for body in bodies:
                # The id first, as the client always writes it (transfer_prefix_around_id).
                await self.send_with(body, props if ids is None else {"message_id": next(ids), **props},
                                     routing_key=routing_key)
                n += 1
            return n
        if self.errors or self.session.error:
            self._raise_errors()
        props = _properties(message_id, correlation_id, content_type, durable, headers, timestamp)
        if message_ids is not None:
            key = self._routing_key if routing_key is None else routing_key
            around = transfer_prefix_around_id(self.session.channel, self._exchange, key, props)
            return await self._send_with_ids(bodies, message_ids, around)
        head = self._head_for(routing_key, props)
        it = iter(bodies)
        sent = 0
        while True:
            if self.errors or self.session.error:
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
            self._write_run(run, head)
            sent += len(run)
            await trio.lowlevel.checkpoint()

    async def _send_with_ids(self, bodies: Sequence[Any], ids: Sequence[str], around: tuple[bytes, bytes]) -> int:
        """send_many's loop when each message has its own id."""
        sent, total = 0, len(bodies)
        while sent < total:
            if self.errors or self.session.error:
                self._raise_errors()
            room = self.capacity - self.incomplete
            if room <= 0:
                await self._wait_for_space()
                continue
            end = sent + min(room, YIELD_EVERY)
            self._write_id_run(bodies[sent:end], ids[sent:end], around)
            sent += len(bodies[sent:end])
            await trio.lowlevel.checkpoint()
        return sent

    def _write_id_run(self, bodies: Sequence[Any], ids: Sequence[str], around: tuple[bytes, bytes]) -> None:
        """_write_run for messages with an id each: ``before + id + after``
        (qflow.protocol.encodings.transfer_prefix_around_id), the bin header
        and the body, written as one piece per message."""
        before, after = around
        parts = self._parts
        if not parts:
            self._conn.wakeup.set()
        append = parts.append
        # The largest body and id that surely fit the frame: less the head, and the str and
        # bin headers (5 bytes each at most); past that, _check_size says.
        room = self._conn.max_frame_size - len(before) - len(after) - 10
        id_len = body_len = -1
        head_id = tail = b""
        sent = 0
        for body, mid in zip(bodies, ids, strict=True):
            if type(body) is not bytes:
                body = _to_bytes(body)
            encoded = mid.encode()
            if len(encoded) != id_len:  # ids of one length, bodies of one size: the rule
                id_len = len(encoded)
                head_id = before + str_header(id_len)
            if len(body) != body_len:
                body_len = len(body)
                tail = after + bin_header(body_len)
            if body_len + id_len > room:
                try:
                    self._check_size(body_len, head_id + encoded + after)
                except ResourceLimitExceeded:
                    self._commands.send_run(self, sent)  # those before it go, numbered; it and the rest do not
                    self.incomplete += sent
                    raise
            append(head_id + encoded + tail + body)
            sent += 1
        self._commands.send_run(self, sent)
        self.incomplete += sent
        if self.incomplete > self.max_incomplete:
            self.max_incomplete = self.incomplete

    def _write_run(self, bodies: list[Any], head: bytes | None) -> None:
        """Number and write a run of transfers, as send does one: each is its
        prefix (cached if plain, ``head`` and its bin header if not) and body."""
        parts = self._parts
        if not parts:
            self._conn.wakeup.set()
        append = parts.append
        start = len(parts)
        max_body = self._max_body(head)
        try:
            if head is None:  # the per-message loop of send_many: one length per body, no attribute
                prefix, prefix_size = self._prefix, self._prefix_size
                for body in bodies:
                    if type(body) is not bytes:
                        body = _to_bytes(body)
                    size = len(body)
                    if size != prefix_size:
                        if size > max_body:
                            self._check_size(size, head)
                        prefix, prefix_size = self._plain_prefix(size), size
                    append(prefix)
                    append(body)
            else:
                for body in bodies:
                    if type(body) is not bytes:
                        body = _to_bytes(body)
                    if len(body) > max_body:
                        self._check_size(len(body), head)
                    append(head + bin_header(len(body)))
                    append(body)
        except ResourceLimitExceeded:
            n = (len(parts) - start) // 2  # the bodies before it go, numbered; it and the rest do not
            self._commands.send_run(self, n)
            self.incomplete += n
            raise
        # Numbered once written: nothing else writes to this session's commands in between.
        n = len(bodies)
        self._commands.send_run(self, n)
        self.incomplete += n
        if self.incomplete > self.max_incomplete:
            self.max_incomplete = self.incomplete

    async def _wait_for_space(self) -> None:
        started = trio.current_time()
        next_notice = started + self.flow_notify
        deadline = started + self.flow_timeout if self.flow_timeout else math.inf
        while self.incomplete >= self.capacity:
            self._raise_errors()
            self._space = trio.Event()
            with trio.move_on_at(min(next_notice, deadline)):
                # No task per wait: a session that ends wakes its senders (wake()).
                await self._space.wait()
                continue
            now = trio.current_time()
            held = self.session.held_text()
            if now >= deadline:
                raise FlowControlTimeout(
                    P.RESOURCE_LIMIT_EXCEEDED,
                    f"send timed out after {now - started:.0f}s waiting for broker flow control (held by {held})")
            if self.session.held_by:
                log.warning("send delayed by %.0fs due to broker flow control: held by %s", now - started, held)
            next_notice += self.flow_notify
        self._raise_errors()

    async def sync(self) -> None:
        """Wait until every transfer of this sender is complete.

        It asks the broker for a completion report at once (session.flush)
        rather than waiting for the broker's next one.

        Raises:
          QflowError: the broker's first refusal among them, if any.
          ConnectionClosed: if the session or its connection ended.
        """
        self._raise_errors()
        self.session.flush()
        while self.incomplete:
            self._raise_errors()
            self._space = trio.Event()
            await self._space.wait()  # set by a completion, or wake() when the session ends
        self._raise_errors()

    def close(self) -> None:
        """Stop sending: its capacity no longer counts in what the session
        tells the broker it may have incomplete. Its transfers already sent
        still complete."""
        if not self.closed:
            self.closed = True
            self.session.announce_capacity()
