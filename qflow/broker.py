"""The broker model: exchanges route to queues, queues feed consumers, and the
accounting decides when transfers complete. No I/O: connections (``server``)
feed commands in and take frames out of each session's connection encoder.

One input batch, as the connection drives it: every frame is handled (a
transfer appends its enqueues to the op log, never touching the accounting
itself), then :meth:`Broker.flush` applies the log in one accounting call,
dispatches to consumers, applies again, and writes one ``session.completed``
per session that has news. See qflow.accounting for the op log.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from struct import Struct
from typing import Any

from qflow import protocol as P
from qflow.accounting import (
    OP_DEQUEUE,
    OP_END,
    OP_ENQUEUE,
    OP_TRANSFER,
    OP_TRANSFER1,
    OP_WORDS,
    Accounting,
    AccountingError,
    load_accounting,
)
from qflow.exchange import EXCHANGE_TYPES, Exchange
from qflow.flow import FlowDefaults, SettingsError, describe_transition, resolve
from qflow.protocol import CommandError
from qflow.queue import E_REDELIVERED, E_SEQ, E_SIZE, E_TOKEN, Consumer, Entry, Queue
from qflow.ranges import RangeSet
from qflow.session import IncomingCommands

log = logging.getLogger("qflow.broker")

MAX_NAME = 255


class BrokerSession:
    """A session's broker-side state. ``conn`` is anything with ``encoder``
    (a FrameEncoder) and ``wake()``."""

    __slots__ = ("conn", "channel", "name", "slot", "commands", "next_delivery", "unacked", "consumers",
                 "capacity", "closed", "held_since", "last_queues")

    def __init__(self, conn: Any, channel: int, name: str, slot: int) -> None:
        self.conn = conn
        self.channel = channel
        self.name = name
        self.slot = slot  # the accounting's session number, never reused
        self.commands = IncomingCommands()
        self.next_delivery = 0
        self.unacked: dict[int, tuple[Queue, Entry]] = {}
        self.consumers: dict[str, Consumer] = {}
        self.capacity = 0  # announced by the client's senders
        self.closed = False
        self.last_queues: Any = None  # the destinations of its last transfer
        self.held_since: dict[str, float] = {}  # queue name -> wall time it began holding us (management view)


class Broker:
    def __init__(self, defaults: FlowDefaults | None = None, accounting: Accounting | None = None) -> None:
        self.defaults = defaults or FlowDefaults()
        self.acct = accounting or load_accounting()
        self.queues: dict[str, Queue] = {}
        self._queue_by_slot: dict[int, Queue] = {}
        self.exchanges: dict[str, Exchange] = {
            name: Exchange(name, type_, durable=True)
            for name, type_ in (("", "direct"), ("amq.direct", "direct"), ("amq.fanout", "fanout"),
                                ("amq.topic", "topic"))
        }
        self.sessions: dict[int, BrokerSession] = {}
        self._next_session_slot = 0
        self._log = bytearray()  # the op log: OP_WORDS native int64s per op, packed by _op
        self._log_entries: list[Entry | None] = []
        self._dirty_queues: dict[Queue, None] = {}
        self._dirty_sessions: dict[BrokerSession, None] = {}
        self.on_queue_deleted: list[Callable[[Queue], None]] = []

    # -- sessions -------------------------------------------------------------
    def open_session(self, conn: Any, channel: int, name: str) -> BrokerSession:
        slot = self._next_session_slot
        self._next_session_slot += 1
        ssn = BrokerSession(conn, channel, name, slot)
        self.sessions[slot] = ssn
        return ssn

    def close_session(self, ssn: BrokerSession) -> None:
        """Detach or connection loss: unaccepted deliveries go back to their
        queues marked redelivered, subscriptions end, held transfers are
        forgotten (their messages stay enqueued)."""
        if ssn.closed:
            return
        ssn.closed = True
        self._apply()
        for _did, (q, e) in sorted(ssn.unacked.items(), key=lambda item: -item[1][1][E_SEQ]):
            if not q.deleted:
                e[E_REDELIVERED] = True
                q.put_back(e)
                self._dirty_queues[q] = None
        ssn.unacked.clear()
        for c in list(ssn.consumers.values()):
            self._remove_consumer(c)
        for q in list(self.queues.values()):
            q.held_sessions.discard(ssn)
            q.writers.pop(ssn, None)
            if q.exclusive and q.owner is ssn:
                self._delete_queue(q)
        self.acct.drop_session(ssn.slot)
        del self.sessions[ssn.slot]
        self._dirty_sessions.pop(ssn, None)
        self.flush()

    def fail(self, ssn: BrokerSession, command_id: int, code: int, text: str) -> None:
        """A command failed alone: report it and count it complete."""
        ssn.conn.encoder.write([P.EXCEPTION, ssn.channel, command_id, code, text])
        ssn.commands.complete(command_id)
        self._dirty_sessions[ssn] = None

    # -- the per-message path -------------------------------------------------
    def transfer(self, ssn: BrokerSession, command_id: int, exchange: str, routing_key: str,
                 properties: dict | None, body: bytes) -> None:
        if exchange == "":
            q = self.queues.get(routing_key)
            queues = q.route if q is not None else ()
        else:
            ex = self.exchanges.get(exchange)
            if ex is None:
                raise CommandError(P.NOT_FOUND, f"message.transfer: exchange {exchange!r} not found")
            queues = ex.route(routing_key)
        if properties is not None:
            P.check_properties(properties)
        size = len(body)
        if not queues:
            ssn.commands.complete(command_id)
            self._dirty_sessions[ssn] = None
            return
        for q in queues:
            if (q.max_count and q.count >= q.max_count) or (q.max_size and q.nbytes + size > q.max_size):
                policy = q.settings.policy
                if policy == "reject" or (policy == "ring-strict" and q.oldest_is_acquired()):
                    q.discards_overflow += 1
                    raise CommandError(
                        P.RESOURCE_LIMIT_EXCEEDED,
                        f"message.transfer: queue {q.name!r} is full (policy {policy}, depth {q.count} messages, "
                        f"{q.nbytes} bytes, limits {q.max_count} messages, {q.max_size} bytes)",
                    )
        if exchange == "":
            routing_key = queues[0].name  # share the queue's string, not one decoded copy per message
        message = (exchange, routing_key, properties, body)
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        if len(queues) == 1:
            # _enqueue inlined: the one-destination transfer is the per-message path,
            # and a method call here costs a tenth of the whole enqueue.
            q = queues[0]
            seq = q.next_seq
            entry = [message, size, -1, False, seq]
            q.next_seq = seq + 1
            q.entries.append(entry)
            q.count += 1
            q.nbytes += size
            if q.consumers or q.browsers:
                self._dirty_queues[q] = None
            self._log_entries.append(entry)
            self._log += _op(OP_TRANSFER1, ssn.slot, command_id, q.slot, size)
            if q.ring:
                self._trim_ring(q)
            return
        log_ = self._log
        entries = self._log_entries
        log_ += _op(OP_TRANSFER, ssn.slot, command_id, 0, 0)
        entries.append(None)
        for q in queues:
            entries.append(self._enqueue(q, message, size))
            log_ += _op(OP_ENQUEUE, q.slot, size, 0, 0)
        log_ += _op(OP_END, 0, 0, 0, 0)
        entries.append(None)
        for q in queues:
            if q.ring:
                self._trim_ring(q)

    def _note_writer(self, ssn: BrokerSession, queues: Any) -> None:
        """Remember which queues a session writes to, with its sender capacity
        (for worstCaseDepth). Checked once per change of destination, not per message."""
        ssn.last_queues = queues
        for q in queues:
            if q.writers.get(ssn) != ssn.capacity:
                q.writers[ssn] = ssn.capacity
                self._check_worst_case(q)

    def _enqueue(self, q: Queue, message: tuple, size: int) -> Entry:
        seq = q.next_seq
        entry = [message, size, -1, False, seq]
        q.next_seq = seq + 1
        q.entries.append(entry)
        q.count += 1
        q.nbytes += size
        if q.consumers or q.browsers:
            self._dirty_queues[q] = None
        return entry

    def _dequeue(self, q: Queue, entry: Entry) -> None:
        size = entry[E_SIZE]
        q.count -= 1
        q.nbytes -= size
        q.total_dequeues += 1
        q.byte_total_dequeues += size
        self._log += _op(OP_DEQUEUE, q.slot, size, entry[E_TOKEN], 0)
        self._log_entries.append(None)

    def _trim_ring(self, q: Queue) -> None:
        s = q.settings
        entries = q.entries
        while entries and ((s.max_count and q.count > s.max_count) or (s.max_size and q.nbytes > s.max_size)):
            self._dequeue(q, entries.popleft())
            q.discards_ring += 1

    # -- delivery -------------------------------------------------------------
    def _dispatch(self, q: Queue) -> None:
        for c in q.browsers:
            self._browse(c, q)
        entries = q.entries
        consumers = q.consumers
        while entries and consumers:
            n = len(consumers)
            size = entries[0][E_SIZE]
            for _ in range(n):
                c = consumers[q.next_consumer % n]
                q.next_consumer += 1
                if c.credit != 0 and (c.byte_credit < 0 or c.byte_credit >= size):
                    break
            else:
                return
            self._deliver(c, q, entries.popleft())

    def _browse(self, c: Consumer, q: Queue) -> None:
        """Deliver copies of the entries from the browser's cursor on, as credit allows."""
        entries = q.entries
        if not entries or entries[-1][E_SEQ] < c.cursor or c.credit == 0:
            return
        i = bisect_left(entries, c.cursor, key=_seq_of)
        n = len(entries)
        ssn = c.session
        write = ssn.conn.encoder.write
        while i < n and c.credit != 0:
            e = entries[i]
            if c.byte_credit >= 0:
                if c.byte_credit < e[E_SIZE]:
                    break
                c.byte_credit -= e[E_SIZE]
            if c.credit > 0:
                c.credit -= 1
            did = ssn.next_delivery
            ssn.next_delivery = did + 1
            exchange, routing_key, properties, body = e[0]
            write((P.DELIVER, ssn.channel, c.destination, did, e[E_REDELIVERED], exchange, routing_key, properties,
                   body, e[E_SEQ]))
            c.cursor = e[E_SEQ] + 1
            i += 1
        self._dirty_sessions[ssn] = None

    def _deliver(self, c: Consumer, q: Queue, e: Entry) -> None:
        ssn = c.session
        did = ssn.next_delivery
        ssn.next_delivery = did + 1
        exchange, routing_key, properties, body = e[0]
        ssn.conn.encoder.write(
            (P.DELIVER, ssn.channel, c.destination, did, e[E_REDELIVERED], exchange, routing_key, properties, body,
             e[E_SEQ])
        )
        if c.credit > 0:
            c.credit -= 1
        if c.byte_credit > 0:
            c.byte_credit -= e[E_SIZE]
        if c.accept_mode == P.ACCEPT_EXPLICIT:
            ssn.unacked[did] = (q, e)
            q.acquired[e[E_SEQ]] = e
        else:
            self._dequeue(q, e)
        self._dirty_sessions[ssn] = None

    # -- the end of a batch ---------------------------------------------------
    def _apply(self) -> None:
        if not self._log:
            return
        log_, entries = memoryview(self._log).cast("q"), self._log_entries
        self._log = bytearray()
        self._log_entries = []
        try:
            completions, holds, transitions = self.acct.apply(log_)
        except AccountingError:
            log.exception("accounting refused an op: this is a broker bug")
            return
        for op_index, token, session_slot, queue_slot in holds:
            entries[op_index][E_TOKEN] = token  # type: ignore[index]
            ssn = self.sessions.get(session_slot)
            q = self._queue_by_slot[queue_slot]
            if ssn is not None and ssn not in q.held_sessions:
                q.held_sessions.add(ssn)
                ssn.held_since[q.name] = time.time()
                ssn.conn.encoder.write([P.FLOW_NOTICE, ssn.channel, q.name, True])
                self._dirty_sessions[ssn] = None
        for queue_slot, flow_on, count, nbytes in transitions:
            q = self._queue_by_slot[queue_slot]
            log.info(describe_transition(q.name, q.settings, flow_on, count, nbytes))
            if not flow_on:
                self._notify_released(q)
        self._complete(completions)

    def _complete(self, completions: list[tuple[int, int, int]]) -> None:
        sessions = self.sessions
        for session_slot, first, last in completions:
            ssn = sessions.get(session_slot)
            if ssn is not None:
                ssn.commands.complete_range(first, last)
                self._dirty_sessions[ssn] = None

    def _notify_released(self, q: Queue) -> None:
        for ssn in q.held_sessions:
            ssn.held_since.pop(q.name, None)
            ssn.conn.encoder.write([P.FLOW_NOTICE, ssn.channel, q.name, False])
            self._dirty_sessions[ssn] = None
        q.held_sessions.clear()

    def flush(self) -> None:
        """End of an input batch: apply the op log, dispatch, report completions."""
        while True:
            self._apply()
            if not self._dirty_queues:
                break
            queues, self._dirty_queues = self._dirty_queues, {}
            for q in queues:
                if not q.deleted:
                    self._dispatch(q)
        if not self._dirty_sessions:
            return
        conns = {}
        for ssn in self._dirty_sessions:
            report = ssn.commands.take_report()
            if report is not None:
                ssn.conn.encoder.write([P.COMPLETED, ssn.channel, report])
            conns[ssn.conn] = None
        self._dirty_sessions.clear()
        for conn in conns:
            conn.wake()

    # -- commands -------------------------------------------------------------
    def execute(self, ssn: BrokerSession, command_id: int, code: int, args: list[Any]) -> Any:
        """Run one validated non-transfer command. Returns a result value to
        send (or None); raises CommandError. The command is complete on return,
        except execution.sync, which completes when every earlier command has."""
        handler = self._handlers.get(code)
        # Commands read or change state the pending op log may not have reached yet.
        self._apply()
        if handler is None:
            raise CommandError(P.NOT_IMPLEMENTED, f"{P.command_name(code)} is not implemented")
        return handler(self, ssn, command_id, *args)

    def _check_name(self, kind: str, name: str) -> None:
        if not name or len(name.encode()) > MAX_NAME:
            raise CommandError(P.INVALID_ARGUMENT, f"{kind} name must be 1 to {MAX_NAME} bytes, got {len(name.encode())}")

    def _queue(self, command: str, name: str) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise CommandError(P.NOT_FOUND, f"{command}: queue {name!r} not found")
        return q

    def declare_queue(self, name: str, durable: bool = False, exclusive: bool = False, auto_delete: bool = False,
                      arguments: dict[str, Any] | None = None, passive: bool = False,
                      owner: BrokerSession | None = None) -> tuple[Queue, bool]:
        """Declare a queue; returns (queue, created). Redeclaring an existing
        queue succeeds and changes nothing, as in AMQP."""
        arguments = {} if arguments is None else arguments
        self._check_name("queue", name)
        q = self.queues.get(name)
        if q is not None:
            if q.exclusive and q.owner is not owner:
                raise CommandError(P.RESOURCE_LOCKED, f"queue.declare: queue {name!r} is exclusive to another session")
            return q, False
        if passive:
            raise CommandError(P.NOT_FOUND, f"queue.declare: queue {name!r} not found (passive)")
        try:
            settings = resolve(arguments, self.defaults)
        except SettingsError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"queue.declare {name!r}: {exc}") from None
        slot = self.acct.add_queue()
        self.acct.set_thresholds(slot, settings.stop_count, settings.resume_count, settings.stop_size,
                                 settings.resume_size)
        q = Queue(name, durable, exclusive, auto_delete, arguments, settings, slot, owner if exclusive else None)
        self.queues[name] = q
        self._queue_by_slot[slot] = q
        self.exchanges[""].bind(q, name)
        return q, True

    def modify_queue(self, q: Queue, arguments: dict[str, Any]) -> None:
        """Change a live queue's limits and thresholds; re-evaluates its flow state.

        Setting a stop threshold to 0 turns that unit off, so its old resume
        threshold goes too unless the change names one."""
        merged = {**q.arguments, **arguments}
        for stop_key, resume_key in (("qpid.flow_stop_count", "qpid.flow_resume_count"),
                                     ("qpid.flow_stop_size", "qpid.flow_resume_size")):
            if arguments.get(stop_key) == 0 and resume_key not in arguments:
                merged.pop(resume_key, None)
        try:
            settings = resolve(merged, self.defaults)
        except SettingsError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"queue.modify {q.name!r}: {exc}") from None
        self._apply()
        completions, transitions = self.acct.set_thresholds(
            q.slot, settings.stop_count, settings.resume_count, settings.stop_size, settings.resume_size
        )
        q.arguments = merged
        q.set_settings(settings)
        for _slot, flow_on, count, nbytes in transitions:
            log.info(describe_transition(q.name, settings, flow_on, count, nbytes))
            if not flow_on:
                self._notify_released(q)
        self._complete(completions)

    def delete_queue(self, name: str, if_empty: bool = False, if_unused: bool = False) -> int:
        q = self._queue("queue.delete", name)
        if if_empty and q.count:
            raise CommandError(P.PRECONDITION_FAILED, f"queue.delete: queue {name!r} is not empty ({q.count} messages)")
        if if_unused and q.consumers:
            raise CommandError(P.PRECONDITION_FAILED,
                               f"queue.delete: queue {name!r} is in use ({len(q.consumers)} consumers)")
        count = q.count
        self._delete_queue(q)
        return count

    def _delete_queue(self, q: Queue) -> None:
        self._apply()
        for ex in self.exchanges.values():
            ex.unbind_queue(q)
        for c in q.consumers + q.browsers:
            c.session.consumers.pop(c.destination, None)
        q.consumers.clear()
        q.browsers.clear()
        q.deleted = True
        del self.queues[q.name]
        del self._queue_by_slot[q.slot]
        self._notify_released(q)
        self._complete(self.acct.remove_queue(q.slot))
        for callback in self.on_queue_deleted:
            callback(q)

    def remove_through(self, name: str, sequence: int) -> int:
        """Dequeue every available message with a sequence number up to and
        including ``sequence`` (a browsing reader's commit). Dequeuing releases
        held producers exactly as consuming does. Acquired messages stay with
        their consumers."""
        q = self._queue("queue.remove-through", name)
        entries = q.entries
        n = 0
        while entries and entries[0][E_SEQ] <= sequence:
            self._dequeue(q, entries.popleft())
            n += 1
        return n

    def purge_queue(self, name: str) -> int:
        q = self._queue("queue.purge", name)
        self._apply()
        n = len(q.entries)
        while q.entries:
            self._dequeue(q, q.entries.popleft())
        self._apply()
        return n

    def queue_stats(self, q: Queue) -> dict[str, Any]:
        count, nbytes, flow_on, stopped_count, held = self.acct.stats(q.slot)
        s = q.settings
        stats = q.stats()
        stats.update(
            flowStopped=flow_on, flowStoppedCount=stopped_count, flowStopCount=s.stop_count,
            flowResumeCount=s.resume_count, flowStopSize=s.stop_size, flowResumeSize=s.resume_size,
            heldTransfers=held, worstCaseDepth=self.worst_case(q),
        )
        return stats

    def worst_case(self, q: Queue) -> int:
        """The manual's worst case: stop threshold plus the capacities of the
        senders currently writing to the queue (0 without a count threshold)."""
        if not q.settings.stop_count:
            return 0
        return q.settings.stop_count + sum(q.writers.values())

    def declare_exchange(self, name: str, type_: str, durable: bool = False, passive: bool = False) -> bool:
        self._check_name("exchange", name)
        ex = self.exchanges.get(name)
        if ex is not None:
            if passive or ex.type == type_:
                return False
            raise CommandError(P.NOT_ALLOWED, f"exchange.declare: exchange {name!r} exists with type {ex.type!r}")
        if passive:
            raise CommandError(P.NOT_FOUND, f"exchange.declare: exchange {name!r} not found (passive)")
        if type_ not in EXCHANGE_TYPES:
            raise CommandError(P.INVALID_ARGUMENT,
                               f"exchange.declare: type must be one of {', '.join(EXCHANGE_TYPES)}, not {type_!r}")
        if name.startswith("amq."):
            raise CommandError(P.NOT_ALLOWED, f"exchange.declare: names starting with 'amq.' are reserved ({name!r})")
        self.exchanges[name] = Exchange(name, type_, durable)
        return True

    def delete_exchange(self, name: str, if_unused: bool = False) -> None:
        ex = self.exchanges.get(name)
        if ex is None:
            raise CommandError(P.NOT_FOUND, f"exchange.delete: exchange {name!r} not found")
        if name == "" or name.startswith("amq."):
            raise CommandError(P.NOT_ALLOWED, f"exchange.delete: {name!r} is a built-in exchange")
        if if_unused and ex.binding_count:
            raise CommandError(P.PRECONDITION_FAILED, f"exchange.delete: exchange {name!r} has bindings")
        for _key, q in ex.bindings():
            q.binding_count -= 1
        del self.exchanges[name]

    def bind(self, exchange: str, queue: str, key: str, unbind: bool = False) -> bool:
        command = "exchange.unbind" if unbind else "exchange.bind"
        ex = self.exchanges.get(exchange)
        if ex is None:
            raise CommandError(P.NOT_FOUND, f"{command}: exchange {exchange!r} not found")
        if exchange == "":
            raise CommandError(P.NOT_ALLOWED, f"{command}: the default exchange's bindings are fixed")
        q = self._queue(command, queue)
        if unbind:
            changed = ex.unbind(q, key)
            q.binding_count -= changed
        else:
            changed = ex.bind(q, key)
            q.binding_count += changed
        return changed

    def bindings(self) -> list[dict[str, str]]:
        return [{"exchange": ex.name, "queue": q.name, "key": key}
                for ex in self.exchanges.values() if ex.name for key, q in ex.bindings()]

    def _remove_consumer(self, c: Consumer) -> None:
        q = c.queue
        c.session.consumers.pop(c.destination, None)
        if c in q.consumers:
            q.consumers.remove(c)
        if c in q.browsers:
            q.browsers.remove(c)
        if q.auto_delete and q.had_consumer and not q.consumers and not q.deleted:
            self._delete_queue(q)

    # -- protocol command handlers: (self, ssn, command_id, *fields) -----------
    def _h_queue_declare(self, ssn, cid, queue, durable, exclusive, auto_delete, arguments, passive):
        q, created = self.declare_queue(queue, durable, exclusive, auto_delete, arguments, passive, owner=ssn)
        return {"queue": q.name, "created": created}

    def _h_queue_delete(self, ssn, cid, queue, if_empty, if_unused):
        return {"messages": self.delete_queue(queue, if_empty, if_unused)}

    def _h_queue_remove_through(self, ssn, cid, queue, sequence):
        return {"messages": self.remove_through(queue, sequence)}

    def _h_queue_purge(self, ssn, cid, queue):
        return {"messages": self.purge_queue(queue)}

    def _h_queue_query(self, ssn, cid, queue):
        return self.queue_stats(self._queue("queue.query", queue))

    def _h_queue_modify(self, ssn, cid, queue, arguments):
        self.modify_queue(self._queue("queue.modify", queue), arguments)
        return self.queue_stats(self.queues[queue])

    def _h_exchange_declare(self, ssn, cid, exchange, type_, durable, passive):
        return {"exchange": exchange, "created": self.declare_exchange(exchange, type_, durable, passive)}

    def _h_exchange_delete(self, ssn, cid, exchange, if_unused):
        self.delete_exchange(exchange, if_unused)

    def _h_bind(self, ssn, cid, exchange, queue, key):
        self.bind(exchange, queue, key)

    def _h_unbind(self, ssn, cid, exchange, queue, key):
        self.bind(exchange, queue, key, unbind=True)

    def _h_subscribe(self, ssn, cid, queue, destination, accept_mode, acquire_mode, start_sequence):
        q = self._queue("message.subscribe", queue)
        if accept_mode not in (P.ACCEPT_EXPLICIT, P.ACCEPT_NONE):
            raise CommandError(P.INVALID_ARGUMENT, f"message.subscribe: accept_mode must be 0 or 1, not {accept_mode}")
        if acquire_mode not in (P.ACQUIRE_PRE_ACQUIRED, P.ACQUIRE_NOT_ACQUIRED):
            raise CommandError(P.INVALID_ARGUMENT,
                               f"message.subscribe: acquire_mode must be 0 (acquire) or 1 (browse), not {acquire_mode}")
        if start_sequence < 0:
            raise CommandError(P.INVALID_ARGUMENT, "message.subscribe: start_sequence must be >= 0")
        if destination in ssn.consumers:
            raise CommandError(P.NOT_ALLOWED, f"message.subscribe: destination {destination!r} is already in use")
        if q.exclusive and q.owner is not ssn:
            raise CommandError(P.RESOURCE_LOCKED, f"message.subscribe: queue {queue!r} is exclusive to another session")
        c = Consumer(ssn, destination, q, accept_mode, acquire_mode)
        ssn.consumers[destination] = c
        if acquire_mode == P.ACQUIRE_NOT_ACQUIRED:
            c.cursor = start_sequence
            q.browsers.append(c)
        else:
            q.consumers.append(c)
            q.had_consumer = True

    def _consumer(self, command: str, ssn: BrokerSession, destination: str) -> Consumer:
        c = ssn.consumers.get(destination)
        if c is None:
            raise CommandError(P.NOT_FOUND, f"{command}: no subscription with destination {destination!r}")
        return c

    def _h_flow(self, ssn, cid, destination, messages, nbytes):
        c = self._consumer("message.flow", ssn, destination)
        if messages < -1 or nbytes < -1:
            raise CommandError(P.INVALID_ARGUMENT, "message.flow: credit must be >= 0, or -1 for unlimited")
        c.credit = -1 if messages == -1 or c.credit == -1 else c.credit + messages
        c.byte_credit = -1 if nbytes == -1 or c.byte_credit == -1 else c.byte_credit + nbytes
        self._dirty_queues[c.queue] = None

    def _ids(self, command: str, wire: list) -> RangeSet:
        try:
            return RangeSet.from_wire(wire)
        except ValueError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"{command}: {exc}") from None

    def _h_accept(self, ssn, cid, transfers):
        unacked = ssn.unacked
        ids = self._ids("message.accept", transfers)
        for first, last in ids.ranges():
            if last - first > len(unacked):
                todo = [d for d in unacked if first <= d <= last]
            else:
                todo = range(first, last + 1)
            for did in todo:
                item = unacked.pop(did, None)
                if item is not None:
                    q, e = item
                    if not q.deleted:
                        del q.acquired[e[E_SEQ]]
                        self._dequeue(q, e)

    def _h_release(self, ssn, cid, transfers):
        unacked = ssn.unacked
        released = []
        for first, last in self._ids("message.release", transfers).ranges():
            # As accept: never loop over a range wider than the unaccepted ids (a client may send [0, 2**62]).
            if last - first > len(unacked):
                todo = [d for d in unacked if first <= d <= last]
            else:
                todo = range(first, last + 1)
            for did in todo:
                item = unacked.pop(did, None)
                if item is not None:
                    released.append(item)
        for q, e in sorted(released, key=lambda item: -item[1][E_SEQ]):
            if not q.deleted:
                e[E_REDELIVERED] = True
                q.put_back(e)
                self._dirty_queues[q] = None

    def _h_cancel(self, ssn, cid, destination):
        self._remove_consumer(self._consumer("message.cancel", ssn, destination))

    def _h_sync(self, ssn, cid):
        ssn.commands.sync(cid)
        self._dirty_sessions[ssn] = None  # it may have completed at once: report it at the batch's end
        return _NO_COMPLETE

    def _h_sender_capacity(self, ssn, cid, capacity):
        if capacity < 0:
            raise CommandError(P.INVALID_ARGUMENT, "session.sender-capacity: capacity must be >= 0")
        ssn.capacity = capacity
        for q in self.queues.values():
            if ssn in q.writers:
                q.writers[ssn] = capacity
                self._check_worst_case(q)

    def _check_worst_case(self, q: Queue) -> None:
        """Warn once when the manual's worst case no longer fits the queue."""
        s = q.settings
        over = bool(s.stop_count and s.max_count and self.worst_case(q) > s.max_count)
        if over and not q.worst_warned:
            log.warning('queue "%s": worst-case depth %d (stop %d + sender capacities %d) exceeds qpid.max_count %d;'
                        " a transfer can still be rejected despite flow control",
                        q.name, self.worst_case(q), s.stop_count, sum(q.writers.values()), s.max_count)
        q.worst_warned = over

    _handlers: dict[int, Callable[..., Any]] = {
        P.QUEUE_DECLARE: _h_queue_declare, P.QUEUE_DELETE: _h_queue_delete, P.QUEUE_PURGE: _h_queue_purge,
        P.QUEUE_QUERY: _h_queue_query, P.QUEUE_REMOVE_THROUGH: _h_queue_remove_through, P.QUEUE_MODIFY: _h_queue_modify, P.EXCHANGE_DECLARE: _h_exchange_declare,
        P.EXCHANGE_DELETE: _h_exchange_delete, P.EXCHANGE_BIND: _h_bind, P.EXCHANGE_UNBIND: _h_unbind,
        P.SUBSCRIBE: _h_subscribe, P.FLOW: _h_flow, P.ACCEPT: _h_accept, P.RELEASE: _h_release,
        P.CANCEL: _h_cancel, P.SYNC: _h_sync, P.SENDER_CAPACITY: _h_sender_capacity,
    }


_NO_COMPLETE = object()

# One op of the accounting's log, packed: a precompiled Struct into a bytearray
# costs half of array('q').extend with a tuple.
_op = Struct(f"={OP_WORDS}q").pack


def _seq_of(entry: Entry) -> int:
    return entry[E_SEQ]  # a handler's answer meaning "the command completes later"
