"""Sessions: a connection's channels, each numbering its own commands, with
the queue and exchange commands, and the senders and receivers made on it."""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

import trio

from qflow import protocol as P
from qflow.client.errors import ConnectionClosed, QflowError, error_for
from qflow.client.receiver import Receiver
from qflow.client.sender import Sender
from qflow.protocol.commands import OutgoingCommands
from qflow.protocol.names import printable
from qflow.protocol.ranges import MAX_RANGES, RangeSet

if TYPE_CHECKING:
    from qflow.client.connection import Connection

log = logging.getLogger("qflow.client")


class _Waiter:
    """A command's owner while a call waits for it: its result or error."""

    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: Any = None
        self.error: QflowError | None = None


class Session:
    """A session on a connection (Connection.session makes one): its commands
    are numbered, and the broker reports them complete, per session. Queue
    and exchange commands wait for their result; senders and receivers are
    made here."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.commands = OutgoingCommands()
        self.senders: list[Sender] = []
        self.receivers: dict[str, Receiver] = {}
        self.held_by: dict[str, float] = {}  # queue or holder -> trio time its flow notice arrived
        # The names in held_by that are broker-wide holders (the memory alarm, the store's disk quota), not queues.
        self.holders: set[str] = set()
        self.error: ConnectionClosed | None = None
        self._attached = trio.Event()  # set by session.attached, or _shutdown
        self._next_destination = 0
        self.channel = conn.protocol.attach(name, self)  # writes session.attach

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
            log.warning("broker refused command %d: %s", cid, printable(err))

    def _flow_notice(self, name: str, held: bool, holder: bool) -> None:
        if held:
            self.held_by[name] = trio.current_time()
            if holder:
                self.holders.add(name)
        else:
            self.held_by.pop(name, None)
            self.holders.discard(name)

    def held_text(self) -> str:
        """What holds this session's transfers now, for people: "queue orders,
        the store disk quota" ("none" when nothing does)."""
        return describe_holds(self.held_by, self.holders) or "none"

    def _shutdown(self, error: ConnectionClosed) -> None:
        """The session has ended (detached, or its connection ended): every
        waiting call wakes and raises ``error``."""
        self.error = error
        self._attached.set()
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

    def _flush(self) -> None:
        """session.flush: ask for a completion report now."""
        self.check()
        self.conn.protocol.flush(self.channel)
        self.conn.wake()

    async def _call(self, code: int, *fields: Any) -> Any:
        """Send a command and wait for it to complete; its result, or the
        broker's refusal raised. No task per call: the waiter's event is set
        by the completion, or by _shutdown when the session ends."""
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
        return await self._call(P.QUEUE_DECLARE, name, durable, exclusive, auto_delete, arguments or {}, passive)

    async def delete_queue(self, name: str, *, if_empty: bool = False, if_unused: bool = False) -> dict[str, Any]:
        return await self._call(P.QUEUE_DELETE, name, if_empty, if_unused)

    async def remove_through(self, name: str, sequence: int) -> int:
        """Remove every available message of ``name`` with a sequence number up
        to and including ``sequence``; returns how many were removed."""
        return (await self._call(P.QUEUE_REMOVE_THROUGH, name, sequence))["messages"]

    async def available(self, name: str, after: int = 0, limit: int = -1) -> dict[str, Any]:
        """Which messages of ``name`` are available above sequence ``after`` (the
        first ``limit``; -1: all): ``{incarnation, sequences, firstSequence,
        lastSequence}``, ``sequences`` as a RangeSet."""
        result = await self._call(P.QUEUE_AVAILABLE, name, after, limit)
        result["sequences"] = RangeSet.from_wire(result["sequences"])
        return result

    async def remove_sequences(self, name: str, incarnation: str, sequences: RangeSet) -> int:
        """Remove exactly the available messages of ``name`` numbered in
        ``sequences``, if the queue is still ``incarnation`` (else the broker
        refuses with PRECONDITION_FAILED and removes nothing); returns how many went.
        More than MAX_RANGES ranges go in several commands, in order: a refusal
        of a later one leaves the earlier ones' removals done."""
        wire = sequences.to_wire()
        step = 2 * MAX_RANGES
        removed = 0
        for i in range(0, len(wire), step):
            removed += (await self._call(P.QUEUE_REMOVE_SEQUENCES, name, incarnation, wire[i:i + step]))["messages"]
        return removed

    async def list_queues(self) -> list[str]:
        """The names of the broker's queues (those this user may access)."""
        return (await self._call(P.QUEUE_LIST))["queues"]

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
               flow_notify: float = 5.0, flow_timeout: float | None = None, durable: bool = False) -> Sender:
        """A sender to ``address``: a queue name (default exchange) or ``EXCHANGE/ROUTING-KEY``.
        ``durable=True``: its messages are persistent unless a send says ``durable=False``."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        exchange, _, key = address.partition("/") if "/" in address else ("", "", address)
        sender = Sender(self, exchange, key, capacity, rate, flow_notify, flow_timeout, durable)
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
