"""Sessions: a connection's channels, each numbering its own commands, with
the queue and exchange commands, and the senders and receivers made on it.

A session knows its connection only as a :class:`SessionConnection`: where
it writes its frames, and how it wakes the writer. Its senders and receivers
reach it through the methods their modules' protocols name
(qflow.client.sender.SenderSession, qflow.client.receiver.ReceiverSession).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import Any, Protocol

import trio

from qflow import protocol as P
from qflow.client.errors import ConnectionClosed, QflowError, error_for
from qflow.client.receiver import Receiver
from qflow.client.sender import Sender
from qflow.protocol.commands import OutgoingCommands
from qflow.protocol.connection import ProtocolConnection
from qflow.protocol.framing import FrameEncoder
from qflow.protocol.names import printable
from qflow.protocol.ranges import MAX_RANGES, RangeSet

log = logging.getLogger("qflow.client")


class SessionConnection(Protocol):
    """What a session uses of its connection (:class:`qflow.client.Connection` is one)."""

    protocol: ProtocolConnection
    encoder: FrameEncoder

    @property
    def max_frame_size(self) -> int: ...

    def wake(self) -> None: ...


class _Waiter:
    """A command's owner while a call waits for it: its result or error."""

    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: Any = None
        self.error: QflowError | None = None


class Session:
    """A session on a connection: the queue and exchange commands, and the
    senders and receivers made on it (:meth:`Connection.session
    <qflow.client.Connection.session>` makes one).

    Its commands are numbered, and the broker reports them complete, per
    session. The queue and exchange commands wait for their result and raise
    the broker's refusal as the QflowError for its code.

    Its connection calls the ``on_*`` methods as the broker's frames for it
    arrive; they, and the commands its senders and receivers send through
    it (:meth:`flush`, :meth:`announce_capacity`, :meth:`add_credit`,
    :meth:`accept`, :meth:`release`, :meth:`cancel`), are the client's own
    and not needed by applications.

    Attributes:
      conn: the connection it is on.
      name: its name, as given to ``Connection.session``.
      channel: its channel number on the connection.
      commands: its numbering of the commands it sent, and which are complete.
      senders: the senders made on it.
      receivers: its receivers by destination.
      held_by: what holds its transfers now (a queue whose flow is stopped,
        or a broker-wide holder such as the memory alarm) -> the trio time
        the broker said so.
      holders: the names in ``held_by`` that are broker-wide holders, not queues.
      error: why it ended (ConnectionClosed), or None while it is usable.
    """

    def __init__(self, conn: SessionConnection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.commands = OutgoingCommands()
        self.senders: list[Sender] = []
        self.receivers: dict[str, Receiver] = {}
        self.held_by: dict[str, float] = {}
        self.holders: set[str] = set()
        self.error: ConnectionClosed | None = None
        self._attached = trio.Event()  # set by session.attached, or the session's end
        self._ended = trio.Event()  # set by the session's end
        self._next_destination = 0
        self.channel = conn.protocol.attach(name, self)  # writes session.attach

    async def wait_attached(self) -> None:
        """Wait for the broker's session.attached.

        Raises:
          ConnectionClosed: if the session ended first.
        """
        await self._attached.wait()
        self.check()

    # -- frames from the connection ------------------------------------------
    def on_attached(self) -> None:
        """The broker's session.attached arrived."""
        self._attached.set()

    def on_completed(self, wire: list[int]) -> None:
        """The broker's session.completed: the commands in ``wire`` (ranges,
        as on the wire) are complete. Wakes the calls waiting on them, and
        frees room in their senders' windows."""
        for owner, n in self.commands.completed_counts(wire).items():
            if owner is None:
                continue
            if type(owner) is _Waiter:
                owner.event.set()
            else:
                owner.on_completed(n)

    def on_result(self, cid: int, value: Any) -> None:
        """The broker's result of command ``cid``: what its call returns."""
        owner = self.commands.owner_of(cid)
        if type(owner) is _Waiter:
            owner.result = value

    def on_failed(self, cid: int, code: int, text: str) -> None:
        """The broker refused command ``cid``: its call, or its sender's
        next, raises the error for ``code``; a refusal nobody waits for is
        logged."""
        owner = self.commands.owner_of(cid)
        err = error_for(code, text)
        if type(owner) is _Waiter:
            owner.error = err
        elif isinstance(owner, Sender):
            owner.on_refused(err)
        else:
            log.warning("broker refused command %d: %s", cid, printable(err))

    def on_flow_notice(self, name: str, held: bool, holder: bool) -> None:
        """The broker's flow notice: ``name`` (a queue, or a broker-wide
        holder if ``holder``) now holds this session's transfers, or no
        longer does."""
        if held:
            self.held_by[name] = trio.current_time()
            if holder:
                self.holders.add(name)
        else:
            self.held_by.pop(name, None)
            self.holders.discard(name)

    def on_end(self, error: ConnectionClosed) -> None:
        """The session has ended (detached, or its connection ended): every
        waiting call wakes and raises ``error``, as does every later one."""
        self.error = error
        self._attached.set()
        self._ended.set()
        for owner in list(self.commands.incomplete.values()):
            if type(owner) is _Waiter:
                owner.error = owner.error or error
                owner.event.set()
        for sender in self.senders:
            sender.wake()
        for receiver in self.receivers.values():
            receiver.wake()

    def accept_fetched(self) -> None:
        """Accept now what its receivers with ``accept="auto"`` fetched and
        have not accepted yet (:meth:`Receiver.accept_fetched`)."""
        for receiver in list(self.receivers.values()):
            receiver.accept_fetched()

    async def close(self) -> None:
        """End the session cleanly, and return once the broker has detached it.

        What its receivers with ``accept="auto"`` fetched is accepted first,
        so the broker removes those messages; then session.detach goes out.
        Messages delivered and not fetched (or, with ``accept="explicit"``,
        not accepted) go back to their queues, marked redelivered. Commands
        still incomplete, and calls waiting on the session, then fail with
        ConnectionClosed. Closing an ended session does nothing.
        """
        if self.error is not None:
            return
        self.accept_fetched()
        self.conn.protocol.detach(self.channel)
        self.conn.wake()
        await self._ended.wait()

    def held_text(self) -> str:
        """What holds this session's transfers now, for people: "queue orders,
        the store disk quota" ("none" when nothing does)."""
        return describe_holds(self.held_by, self.holders) or "none"

    # -- commands ---------------------------------------------------------------
    def check(self) -> None:
        """Raise the session's error, if it has ended.

        Raises:
          ConnectionClosed: why it ended.
        """
        if self.error is not None:
            raise self.error

    def _send_command(self, code: int, *fields: Any, owner: Any = None) -> int:
        self.check()
        cid = self.commands.send(owner)
        self.conn.encoder.write([code, self.channel, *fields])
        self.conn.wake()
        return cid

    def flush(self) -> None:
        """Ask the broker for a completion report now (session.flush), rather
        than at its next.

        Raises:
          ConnectionClosed: if the session has ended.
        """
        self.check()
        self.conn.protocol.flush(self.channel)
        self.conn.wake()

    def announce_capacity(self) -> None:
        """Tell the broker how many transfers this session's open senders
        may have incomplete in all (session.sender-capacity).

        Raises:
          ConnectionClosed: if the session has ended.
        """
        self._send_command(P.SENDER_CAPACITY, sum(s.capacity for s in self.senders if not s.closed))

    # add_credit and accept are _send_command inlined: with capacity 1 or
    # ack_frequency 1, or an accept per message, they are called once per message.
    def add_credit(self, destination: str, messages: int) -> None:
        """Let the broker send ``messages`` more to the subscription
        ``destination`` (message.flow).

        Args:
          destination: the subscription's destination (its receiver's).
          messages: how many more messages it may be sent.

        Raises:
          ConnectionClosed: if the session has ended.
        """
        if self.error is not None:
            raise self.error
        self.commands.send(None)
        self.conn.encoder.write([P.FLOW, self.channel, destination, messages, 0])
        self.conn.wake()

    def accept(self, ids: RangeSet) -> None:
        """Accept the deliveries numbered ``ids`` (message.accept): the broker
        removes their messages from their queues.

        Args:
          ids: the deliveries' numbers in this session.

        Raises:
          ConnectionClosed: if the session has ended.
        """
        if self.error is not None:
            raise self.error
        self.commands.send(None)
        self.conn.encoder.write([P.ACCEPT, self.channel, ids.to_wire()])
        self.conn.wake()

    def release(self, ids: RangeSet) -> None:
        """Release the deliveries numbered ``ids`` (message.release): the
        broker puts their messages back, marked redelivered.

        Args:
          ids: the deliveries' numbers in this session.

        Raises:
          ConnectionClosed: if the session has ended.
        """
        self._send_command(P.RELEASE, ids.to_wire())  # once per release call, not per message: not inlined

    async def cancel(self, destination: str) -> None:
        """Cancel the subscription ``destination`` (message.cancel) and wait
        for the broker to have done it; its receiver is then no longer this
        session's.

        Args:
          destination: the subscription's destination (its receiver's).

        Raises:
          NotFound: if the session has no such subscription.
          ConnectionClosed: if the session has ended.
        """
        await self._call(P.CANCEL, destination)
        self.receivers.pop(destination, None)

    async def _call(self, code: int, *fields: Any) -> Any:
        """Send a command and wait for it to complete; its result, or the
        broker's refusal raised. No task per call: the waiter's event is set
        by the completion, or by on_end when the session ends."""
        waiter = _Waiter()
        self._send_command(code, *fields, owner=waiter)
        await waiter.event.wait()
        if waiter.error is not None:
            raise waiter.error
        self.check()
        return waiter.result

    async def declare_queue(self, name: str, *, durable: bool = False, exclusive: bool = False,
                            auto_delete: bool = False, arguments: dict[str, Any] | None = None,
                            passive: bool = False) -> dict[str, Any]:
        """Declare the queue ``name``: create it unless it exists.

        Args:
          name: the queue's name.
          durable: kept, with its persistent messages, across a broker restart.
          exclusive: usable only by this session, and deleted when it ends.
          auto_delete: deleted once its last consumer goes.
          arguments: its limits and flow thresholds (``qpid.flow_stop_count``, ...).
          passive: only check that it exists; create nothing.

        Returns:
          ``{"queue": name, "created": bool}``.

        Raises:
          NotFound: ``passive``, and there is no such queue.
          InvalidArgument, PreconditionFailed, NotAllowed, ResourceLocked: the broker's refusal.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.QUEUE_DECLARE, name, durable, exclusive, auto_delete, arguments or {}, passive)

    async def delete_queue(self, name: str, *, if_empty: bool = False, if_unused: bool = False) -> dict[str, Any]:
        """Delete the queue ``name`` and its messages.

        Args:
          if_empty: only if it has no messages.
          if_unused: only if it has no consumers.

        Returns:
          ``{"messages": n}``: how many messages it had.

        Raises:
          NotFound: there is no such queue.
          PreconditionFailed: ``if_empty`` or ``if_unused`` did not hold.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.QUEUE_DELETE, name, if_empty, if_unused)

    async def remove_through(self, name: str, sequence: int) -> int:
        """Remove every available message of the queue ``name`` with a
        sequence number up to and including ``sequence``.

        Args:
          name: the queue's name.
          sequence: the last sequence number to remove.

        Returns:
          How many were removed.

        Raises:
          NotFound: there is no such queue.
          ConnectionClosed: if the session has ended.
        """
        return (await self._call(P.QUEUE_REMOVE_THROUGH, name, sequence))["messages"]

    async def available(self, name: str, after: int = 0, limit: int = -1) -> dict[str, Any]:
        """Which messages of the queue ``name`` are available above sequence
        ``after``.

        Args:
          name: the queue's name.
          after: only sequence numbers above this.
          limit: at most this many (-1: all).

        Returns:
          ``{"incarnation", "sequences", "firstSequence", "lastSequence"}``,
          ``sequences`` as a RangeSet.

        Raises:
          NotFound: there is no such queue.
          InvalidArgument: ``after`` is negative or ``limit`` below -1.
          ConnectionClosed: if the session has ended.
        """
        result = await self._call(P.QUEUE_AVAILABLE, name, after, limit)
        result["sequences"] = RangeSet.from_wire(result["sequences"])
        return result

    async def remove_sequences(self, name: str, incarnation: str, sequences: RangeSet) -> int:
        """Remove exactly the available messages of the queue ``name``
        numbered in ``sequences``, if the queue is still ``incarnation``.

        More than MAX_RANGES ranges go in several commands, in order: a
        refusal of a later one leaves the earlier ones' removals done.

        Args:
          name: the queue's name.
          incarnation: the queue's incarnation, as :meth:`available` returned it.
          sequences: the sequence numbers to remove.

        Returns:
          How many were removed.

        Raises:
          NotFound: there is no such queue.
          PreconditionFailed: the queue is not ``incarnation`` (deleted and
            declared again); nothing is removed.
          ConnectionClosed: if the session has ended.
        """
        wire = sequences.to_wire()
        step = 2 * MAX_RANGES
        removed = 0
        for i in range(0, len(wire), step):
            removed += (await self._call(P.QUEUE_REMOVE_SEQUENCES, name, incarnation, wire[i:i + step]))["messages"]
        return removed

    async def list_queues(self) -> list[str]:
        """The names of the broker's queues (those this user may access).

        Raises:
          ConnectionClosed: if the session has ended.
        """
        return (await self._call(P.QUEUE_LIST))["queues"]

    async def purge_queue(self, name: str) -> dict[str, Any]:
        """Remove every message available on the queue ``name`` now.

        Args:
          name: the queue's name.

        Returns:
          ``{"messages": n}``: how many were removed.

        Raises:
          NotFound: there is no such queue.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.QUEUE_PURGE, name)

    async def query_queue(self, name: str) -> dict[str, Any]:
        """The statistics of the queue ``name``, with the QMF names
        (``msgDepth``, ``flowStopped``, ...).

        Args:
          name: the queue's name.

        Raises:
          NotFound: there is no such queue.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.QUEUE_QUERY, name)

    async def modify_queue(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Change the limits or flow thresholds of the queue ``name`` while it is in use.

        Args:
          name: the queue's name.
          arguments: the arguments to change, as ``declare_queue`` takes them.

        Returns:
          Its statistics afterwards, as ``query_queue``.

        Raises:
          NotFound: there is no such queue.
          InvalidArgument: an argument the queue cannot take; nothing is changed.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.QUEUE_MODIFY, name, arguments)

    async def declare_exchange(self, name: str, type: str = "direct", *, durable: bool = False,
                               passive: bool = False) -> dict[str, Any]:
        """Declare the exchange ``name``: create it unless it exists.

        Args:
          name: the exchange's name.
          type: ``direct``, ``fanout`` or ``topic``.
          durable: kept across a broker restart.
          passive: only check that it exists; create nothing.

        Returns:
          ``{"exchange": name, "created": bool}``.

        Raises:
          NotFound: ``passive``, and there is no such exchange.
          NotAllowed: it exists with another type, or ``name`` starts with ``amq.``.
          InvalidArgument: an unknown type, or a name that is not 1 to 255 bytes.
          ConnectionClosed: if the session has ended.
        """
        return await self._call(P.EXCHANGE_DECLARE, name, type, durable, passive)

    async def delete_exchange(self, name: str, *, if_unused: bool = False) -> None:
        """Delete the exchange ``name``.

        Args:
          name: the exchange's name.
          if_unused: only if no queue is bound to it.

        Raises:
          NotFound: there is no such exchange.
          NotAllowed: it is one of the broker's built-in exchanges.
          PreconditionFailed: ``if_unused``, and a queue is bound to it.
          ConnectionClosed: if the session has ended.
        """
        await self._call(P.EXCHANGE_DELETE, name, if_unused)

    async def bind(self, exchange: str, queue: str, key: str = "") -> None:
        """Bind ``queue`` to ``exchange`` with the binding key ``key``.

        Args:
          exchange: the exchange's name.
          queue: the queue's name.
          key: the binding key (a topic exchange's may hold ``*`` and ``#``).

        Raises:
          NotFound: there is no such exchange or queue.
          NotAllowed: ``exchange`` is the default exchange, whose bindings are fixed.
          ConnectionClosed: if the session has ended.
        """
        await self._call(P.EXCHANGE_BIND, exchange, queue, key)

    async def unbind(self, exchange: str, queue: str, key: str = "") -> None:
        """Remove the binding of ``queue`` to ``exchange`` with ``key``.

        Args:
          exchange: the exchange's name.
          queue: the queue's name.
          key: the binding key it was bound with.

        Raises:
          NotFound: there is no such exchange or queue.
          NotAllowed: ``exchange`` is the default exchange, whose bindings are fixed.
          ConnectionClosed: if the session has ended.
        """
        await self._call(P.EXCHANGE_UNBIND, exchange, queue, key)

    async def sync(self) -> None:
        """Wait until every command this session sent so far is complete
        (execution.sync), its senders' transfers included.

        Raises:
          ConnectionClosed: if the session has ended.
        """
        await self._call(P.SYNC)

    def sender(self, address: str, *, capacity: int = 1000, rate: float | None = None,
               flow_notify: float = 5.0, flow_timeout: float | None = None, durable: bool = False) -> Sender:
        """A new sender on this session.

        Args:
          address: a queue name (sent through the default exchange) or
            ``EXCHANGE/ROUTING-KEY``.
          capacity: the most transfers it may have incomplete at once.
          rate: at most this many sends a second (None: no limit).
          flow_notify: seconds between the warnings of a send held by flow control.
          flow_timeout: seconds a send waits for flow control before it raises
            FlowControlTimeout (None: no limit).
          durable: its messages are persistent unless a send says ``durable=False``.

        Returns:
          The Sender.

        Raises:
          ValueError: if ``capacity`` is less than 1.
          ConnectionClosed: if the session has ended.
        """
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        exchange, _, key = address.partition("/") if "/" in address else ("", "", address)
        sender = Sender(self, exchange, key, capacity, rate, flow_notify, flow_timeout, durable)
        self.senders.append(sender)
        self.announce_capacity()
        return sender

    async def receiver(self, queue: str, *, capacity: int = 1000, accept: str = "auto",
                       destination: str | None = None, rate: float | None = None,
                       ack_frequency: int | None = None, browse: bool = False,
                       start_sequence: int = 0) -> Receiver:
        """Subscribe to ``queue``: a new receiver of its messages.

        Args:
          queue: the queue to receive from.
          capacity: the credit window: how many messages the broker may send ahead.
          accept: ``"auto"`` (fetched messages are accepted in batches),
            ``"explicit"`` (the application calls ``accept``), or ``"none"``
            (the broker removes each message as it delivers it).
          destination: the subscription's name on the session (default: one made up).
          rate: at most this many fetches a second (None: no limit).
          ack_frequency: auto accept: how many fetched messages are accepted
            at a time (default: half of ``capacity``).
          browse: read without removing (as Qpid's browse mode), from the
            message with sequence number ``start_sequence`` on.
          start_sequence: with ``browse``, where to start.

        Returns:
          The Receiver, once the broker has made the subscription.

        Raises:
          ValueError: if ``accept`` is not one of the three, or ``capacity`` is less than 1.
          NotFound: there is no such queue.
          ConnectionClosed: if the session has ended.
        """
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


def describe_holds(held_by: Iterable[str], holders: Container[str]) -> str:
    """The flow-control holds of a session, for people: each queue as "queue
    NAME" and each broker-wide holder (``holders``) as "the NAME", longest held
    first when ``held_by`` is a mapping of name to since, as Session.held_by is.

    Args:
      held_by: what holds the session (its names, or name -> since).
      holders: the names among them that are holders, not queues.
    """
    names = sorted(held_by, key=held_by.get) if isinstance(held_by, dict) else list(held_by)
    return ", ".join(f"the {printable(n)}" if n in holders else f"queue {printable(n)}" for n in names)
