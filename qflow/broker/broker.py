"""The broker model: exchanges route to queues, queues feed consumers, and the
accounting decides when transfers complete. No I/O: connections (``server``)
feed commands in and take frames out of each session's connection encoder.

One input batch, as the connection drives it: every frame is handled (a
transfer appends its enqueues to the op log, never touching the accounting
itself), then :meth:`Broker.flush` applies the log in one accounting call,
dispatches to consumers, applies again, and writes one ``session.completed``
per session that has news. See qflow.broker.accounting for the op log.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable
from functools import partial
from struct import Struct
from typing import Any

import msgpack

from qflow import protocol as P
from qflow.broker.accounting import (
    OP_DEQUEUE,
    OP_DEQUEUE_N,
    OP_END,
    OP_ENQUEUE,
    OP_TRANSFER,
    OP_TRANSFER1,
    OP_WORDS,
    Accounting,
    AccountingError,
    load_accounting,
)
from qflow.broker.exchange import EXCHANGE_TYPES, Exchange
from qflow.broker.flow import FlowDefaults, SettingsError, describe_transition, resolve
from qflow.broker.queue import (
    ENTRY_HEAD,
    REDELIVERED_NO,
    Consumer,
    Entry,
    Queue,
    redelivered,
    seq_and_size,
    seq_of,
)
from qflow.protocol import CommandError
from qflow.protocol.commands import IncomingCommands
from qflow.protocol.entries import body_bytes
from qflow.protocol.ranges import RangeSet

log = logging.getLogger("qflow.broker")

MAX_NAME = 255


class BrokerSession:
    """A session's broker-side state. ``conn`` is anything with ``encoder``
    (a FrameEncoder) and ``wake()``.

    Deliveries awaiting accept are kept in delivery-id order in two parallel
    lists (the entry, and its queue), ``unacked[did - unacked_base]``, with
    None where a delivery was accepted, released or needs no accept. Ids are
    consecutive per session, so an accept of a range is a walk over a slice.
    """

    __slots__ = ("conn", "channel", "name", "slot", "commands", "next_delivery", "unacked", "unacked_queues",
                 "unacked_base", "unacked_count", "consumers", "capacity", "closed", "held_since", "last_queues",
                 "transfer_head")

    def __init__(self, conn: Any, channel: int, name: str, slot: int) -> None:
        self.conn = conn
        self.channel = channel
        self.name = name
        self.slot = slot  # the accounting's session number, never reused
        self.commands = IncomingCommands()
        self.next_delivery = 0
        self.unacked: list[Entry | None] = []
        self.unacked_queues: list[Queue | None] = []
        self.unacked_base = 0  # the delivery id of unacked[0]
        self.unacked_count = 0  # entries in unacked that are not None
        self.consumers: dict[str, Consumer] = {}
        self.capacity = 0  # announced by the client's senders
        self.closed = False
        self.last_queues: Any = None  # the destinations of its last transfer
        self.held_since: dict[str, float] = {}  # queue name -> wall time it began holding us (management view)
        # How this session's transfers begin on the wire when encoded as msgpack-python
        # does: [30, channel, ...]. The rest of such a frame is stored as it came.
        self.transfer_head = b"\x96" + msgpack.packb(P.TRANSFER) + msgpack.packb(channel)

    def take_unacked(self, first: int, last: int) -> tuple[list[Queue], list[Entry]]:
        """Remove the deliveries awaiting accept with ids in [first, last];
        returns their queues and entries, in delivery order."""
        base = self.unacked_base
        entries, queues = self.unacked, self.unacked_queues
        lo = max(first, base) - base
        hi = min(last - base + 1, len(entries))
        if lo >= hi:
            return [], []
        taken_q = queues[lo:hi]
        taken_e = entries[lo:hi]
        entries[lo:hi] = queues[lo:hi] = [None] * (hi - lo)
        if None in taken_e:  # holes: already accepted, released, or needing no accept
            taken_q = [q for q in taken_q if q is not None]
            taken_e = [e for e in taken_e if e is not None]
        if taken_e:
            self.unacked_count -= len(taken_e)
            self._trim()
        return taken_q, taken_e

    def take_all_unacked(self) -> tuple[list[Queue], list[Entry]]:
        return self.take_unacked(self.unacked_base, self.unacked_base + len(self.unacked))

    def _trim(self) -> None:
        entries = self.unacked
        if not self.unacked_count:
            self.unacked_base += len(entries)
            entries.clear()
            self.unacked_queues.clear()
            return
        i = 0
        while entries[i] is None:
            i += 1
        if i:
            del entries[:i]
            del self.unacked_queues[:i]
            self.unacked_base += i


def _load_transfer_runs(enabled: bool | None) -> Any:
    """The C scanner of transfer runs, unless disabled (``enabled=False`` or
    ``$QFLOW_TRANSFER_RUNS=0``) or not built: None then, and every frame goes
    the frame-by-frame way, which behaves the same."""
    if enabled is None:
        enabled = os.environ.get("QFLOW_TRANSFER_RUNS", "1") != "0"
    if not enabled:
        return None
    try:
        from qflow.broker.transfer_runs import TransferRuns
    except ImportError:
        return None
    return TransferRuns()


class Broker:
    def __init__(self, defaults: FlowDefaults | None = None, accounting: Accounting | None = None,
                 transfer_runs: bool | None = None) -> None:
        self.defaults = defaults or FlowDefaults()
        self.acct = accounting or load_accounting()
        self.runs = _load_transfer_runs(transfer_runs)
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
        self._log_entries: list[int | None] = []  # per op: the sequence number it enqueued, if any
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
        self._put_back(*ssn.take_all_unacked())
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
                 properties: dict | None, body: bytes, tail: bytes | None = None) -> None:
        """Route and enqueue one message. ``tail`` is the message's encoding as
        it arrived (exchange, routing key, properties, body), if the connection
        had it at hand; otherwise it is encoded here."""
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
                if policy == "reject" or (policy == "ring-strict" and self._oldest_is_acquired(q)):
                    q.discards_overflow += 1
                    raise CommandError(
                        P.RESOURCE_LIMIT_EXCEEDED,
                        f"message.transfer: queue {q.name!r} is full (policy {policy}, depth {q.count} messages, "
                        f"{q.nbytes} bytes, limits {q.max_count} messages, {q.max_size} bytes)",
                    )
        if tail is None:
            tail = _encode_tail(exchange, routing_key, properties, body)
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        if len(queues) == 1:
            # _enqueue inlined: the one-destination transfer is the per-message path,
            # and a method call here costs a tenth of the whole enqueue.
            q = queues[0]
            seq = q.next_seq
            q.next_seq = seq + 1
            q.entries.append(_entry_head(REDELIVERED_NO, 0xCF, seq, 0xCF, size) + tail)
            q.count += 1
            q.nbytes += size
            if q.consumers or q.browsers:
                self._dirty_queues[q] = None
            self._log_entries.append(seq)
            self._log += _op(OP_TRANSFER1, ssn.slot, command_id, q.slot, size)
            if q.ring:
                self._trim_ring(q)
            return
        log_ = self._log
        entries = self._log_entries
        log_ += _op(OP_TRANSFER, ssn.slot, command_id, 0, 0)
        entries.append(None)
        for q in queues:
            entries.append(self._enqueue(q, tail, size))
            log_ += _op(OP_ENQUEUE, q.slot, size, 0, 0)
        log_ += _op(OP_END, 0, 0, 0, 0)
        entries.append(None)
        for q in queues:
            if q.ring:
                self._trim_ring(q)

    def transfer_run(self, sessions: dict[int, BrokerSession], buf: bytes, pos: int, max_frame: int) -> int:
        """Take the run of transfers at ``buf[pos]`` (see qflow.broker.transfer_runs)
        if its queues (one, or several: a fanout) have room for it, or for its
        first messages; returns the bytes taken, 0 if none: the frame at ``pos`` then goes
        through :meth:`transfer` (which also reports every error: a run is
        only taken when each of its transfers would succeed there)."""
        runs = self.runs
        count = runs.scan(buf, pos, max_frame)
        if not count:
            return 0
        run = runs.run
        ssn = sessions.get(run.channel)
        if ssn is None:
            return 0
        try:
            exchange = buf[run.exchange:run.exchange + run.exchange_len].decode()
            routing_key = buf[run.routing_key:run.routing_key + run.routing_key_len].decode()
            if run.properties_len != 1:  # not nil
                P.check_properties(msgpack.unpackb(buf[run.properties:run.properties + run.properties_len],
                                                   raw=False, strict_map_key=False))
        except (ValueError, TypeError, CommandError):  # bad UTF-8, unhashable keys, bad properties
            return 0
        if exchange == "":
            q = self.queues.get(routing_key)
            if q is None:
                return 0
            queues = q.route
        else:
            ex = self.exchanges.get(exchange)
            if ex is None:
                return 0
            queues = ex.route(routing_key)
            if not queues:
                return 0
        max_bytes = 1 << 64
        for q in queues:
            if q.max_count:
                count = min(count, q.max_count - q.count)
            if q.max_size:
                max_bytes = min(max_bytes, q.max_size - q.nbytes)
        if count <= 0 or max_bytes < 0:
            return 0
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        if len(queues) > 1:
            return self._fanout_run(ssn, queues, buf, pos, count, max_bytes)
        q = queues[0]
        seq = q.next_seq
        commands = ssn.commands
        cid = commands.next_id
        n, consumed, nbytes, entries, ops = runs.store(buf, pos, count, max_bytes, seq, ssn.slot, cid, q.slot)
        if not n:
            return 0
        commands.next_id = cid + n
        q.next_seq = seq + n
        q.entries.extend(entries)
        q.count += n
        q.nbytes += nbytes
        if q.consumers or q.browsers:
            self._dirty_queues[q] = None
        self._log_entries.extend(range(seq, seq + n))
        self._log += ops
        return consumed

    def _fanout_run(self, ssn: BrokerSession, queues: list[Queue], buf: bytes, pos: int, count: int,
                    max_bytes: int) -> int:
        """:meth:`transfer_run` for a run routed to several queues: each queue
        gets its own entries (their sequence numbers differ), and the ops are
        those :meth:`transfer` logs for a transfer to several queues."""
        runs = self.runs
        cid = ssn.commands.next_id
        stored = [runs.store(buf, pos, count, max_bytes, q.next_seq, ssn.slot, cid, q.slot) for q in queues]
        n, consumed, nbytes = stored[0][:3]
        if not n:
            return 0
        ops = runs.fanout_ops(buf, pos, n, ssn.slot, cid, [q.slot for q in queues])
        ssn.commands.next_id = cid + n
        seqs = [q.next_seq for q in queues]
        for q, (_, _, _, entries, _) in zip(queues, stored, strict=True):
            q.next_seq += n
            q.entries.extend(entries)
            q.count += n
            q.nbytes += nbytes
            if q.consumers or q.browsers:
                self._dirty_queues[q] = None
        # One log entry per op: None for OP_TRANSFER and OP_END, each queue's sequence number for its OP_ENQUEUE.
        log_entries = self._log_entries
        for i in range(n):
            log_entries.append(None)
            log_entries += [s + i for s in seqs]
            log_entries.append(None)
        self._log += ops
        return consumed

    def _note_writer(self, ssn: BrokerSession, queues: Any) -> None:
        """Remember which queues a session writes to, with its sender capacity
        (for worstCaseDepth). Checked once per change of destination, not per message."""
        ssn.last_queues = queues
        for q in queues:
            if q.writers.get(ssn) != ssn.capacity:
                q.writers[ssn] = ssn.capacity
                self._check_worst_case(q)

    def _enqueue(self, q: Queue, tail: bytes, size: int) -> int:
        """Append one message; returns its sequence number."""
        seq = q.next_seq
        q.next_seq = seq + 1
        q.entries.append(_entry_head(REDELIVERED_NO, 0xCF, seq, 0xCF, size) + tail)
        q.count += 1
        q.nbytes += size
        if q.consumers or q.browsers:
            self._dirty_queues[q] = None
        return seq

    def _dequeue(self, q: Queue, entry: Entry) -> None:
        seq, size = seq_and_size(entry)
        token = q.tokens.pop(seq, -1) if q.tokens else -1
        q.count -= 1
        q.nbytes -= size
        q.total_dequeues += 1
        q.byte_total_dequeues += size
        self._log += _op(OP_DEQUEUE, q.slot, size, token, 0)
        self._log_entries.append(None)

    def _dequeue_many(self, q: Queue, entries: list[Entry]) -> None:
        """Dequeue entries of one queue: those whose transfer is held here one by
        one (their holds are released), the rest in one OP_DEQUEUE_N."""
        tokens = q.tokens
        if not tokens:  # the usual case: no transfer held here
            n, nbytes = len(entries), body_bytes(entries)
        else:
            n = nbytes = 0
            for e in entries:
                seq, size = seq_and_size(e)
                if seq in tokens:
                    self._dequeue(q, e)
                else:
                    n += 1
                    nbytes += size
        if n:
            q.count -= n
            q.nbytes -= nbytes
            q.total_dequeues += n
            q.byte_total_dequeues += nbytes
            self._log += _op(OP_DEQUEUE_N, q.slot, nbytes, n, 0)
            self._log_entries.append(None)

    def _trim_ring(self, q: Queue) -> None:
        s = q.settings
        entries = q.entries
        while entries and ((s.max_count and q.count > s.max_count) or (s.max_size and q.nbytes > s.max_size)):
            self._dequeue(q, entries.popleft())
            q.discards_ring += 1

    def _oldest_is_acquired(self, q: Queue) -> bool:
        """Is the queue's oldest message delivered and awaiting accept? (ring-strict;
        a rare path: only when a ring-strict queue is full)"""
        oldest = None
        for ssn in self.sessions.values():
            for qq, e in zip(ssn.unacked_queues, ssn.unacked, strict=True):
                if qq is q and e is not None:
                    seq = seq_of(e)
                    oldest = seq if oldest is None else min(oldest, seq)
                    break  # a session's deliveries from one queue come in queue order
        if oldest is None:
            return False
        return not q.entries or oldest < seq_of(q.entries[0])

    # -- delivery -------------------------------------------------------------
    def _dispatch(self, q: Queue) -> None:
        for c in q.browsers:
            self._browse(c, q)
        entries = q.entries
        consumers = q.consumers
        if len(consumers) == 1:
            self._deliver(consumers[0], q, -1)
            return
        while entries and consumers:  # round robin, one message at a time
            n = len(consumers)
            size = seq_and_size(entries[0])[1]
            for _ in range(n):
                c = consumers[q.next_consumer % n]
                q.next_consumer += 1
                if c.credit != 0 and (c.byte_credit < 0 or c.byte_credit >= size):
                    break
            else:
                return
            self._deliver(c, q, 1)

    def _browse(self, c: Consumer, q: Queue) -> None:
        """Deliver copies of the entries from the browser's cursor on, as credit allows."""
        entries = q.entries
        if not entries or seq_of(entries[-1]) < c.cursor or c.credit == 0:
            return
        i = bisect_left(entries, c.cursor, key=seq_of)
        n = len(entries)
        ssn = c.session
        out = ssn.conn.encoder.parts
        untracked = bool(ssn.unacked)
        runs = c.run_head is not None
        batch: list[Entry] = []
        first_did = ssn.next_delivery
        while i < n and c.credit != 0:
            e = entries[i]
            seq, size = seq_and_size(e)
            if c.byte_credit >= 0:
                if c.byte_credit < size:
                    break
                c.byte_credit -= size
            if c.credit > 0:
                c.credit -= 1
            did = ssn.next_delivery
            ssn.next_delivery = did + 1
            if runs:
                batch.append(e)
            else:
                out.append(c.head(0xCF, did))
                out.append(e)
            if untracked:
                ssn.unacked.append(None)
                ssn.unacked_queues.append(None)
            c.cursor = seq + 1
            i += 1
        if batch:
            self._write_runs(c, first_did, batch)
        self._dirty_sessions[ssn] = None

    def _deliver(self, c: Consumer, q: Queue, limit: int) -> None:
        """Deliver from the head of ``q`` to ``c`` while it has credit, at most
        ``limit`` messages (-1: no limit). The per-message path: the frame is
        the consumer's head, the delivery id and the stored entry, copied."""
        if c.run_head is not None:
            self._deliver_runs(c, q, limit)
            return
        entries = q.entries
        credit = c.credit
        if not entries or credit == 0:
            return
        ssn = c.session
        out = ssn.conn.encoder.parts
        head = c.head
        did = first_did = ssn.next_delivery
        byte_credit = c.byte_credit
        explicit = c.accept_mode == P.ACCEPT_EXPLICIT
        unacked, unacked_queues = ssn.unacked, ssn.unacked_queues
        if explicit and not unacked:
            ssn.unacked_base = did
        untracked = not explicit and bool(unacked)  # keep unacked's index = delivery id - base
        done: list[Entry] = []  # delivered without accept: dequeued at once
        popleft = entries.popleft
        while entries and credit != 0 and limit != 0:
            e = entries[0]
            if byte_credit >= 0:
                size = seq_and_size(e)[1]
                if byte_credit < size:
                    break
                byte_credit -= size
            popleft()
            out.append(head(0xCF, did))
            out.append(e)
            did += 1
            limit -= 1
            if credit > 0:
                credit -= 1
            if explicit:
                unacked.append(e)
                unacked_queues.append(q)
            else:
                if untracked:
                    unacked.append(None)
                    unacked_queues.append(None)
                done.append(e)
        if done:
            self._dequeue_many(q, done)
        c.credit = credit
        c.byte_credit = byte_credit
        if did != first_did:
            ssn.next_delivery = did
            if explicit:
                ssn.unacked_count += did - first_did
            self._dirty_sessions[ssn] = None

    def _deliver_runs(self, c: Consumer, q: Queue, limit: int) -> None:
        """:meth:`_deliver` to a connection that takes message.deliver-run
        frames: the same deliveries, many entries per frame, and nothing
        done per message but taking it off the queue."""
        entries = q.entries
        credit = c.credit
        n = len(entries)
        if not n or credit == 0 or limit == 0:
            return
        if 0 < credit < n:
            n = credit
        if 0 < limit < n:
            n = limit
        byte_credit = c.byte_credit
        popleft = entries.popleft
        if byte_credit < 0:
            if n == len(entries):  # the usual case: the consumer keeps up
                batch = list(entries)
                entries.clear()
            else:
                batch = [popleft() for _ in range(n)]
        else:
            batch = []
            for _ in range(n):
                size = seq_and_size(entries[0])[1]
                if byte_credit < size:
                    break
                byte_credit -= size
                batch.append(popleft())
            if not batch:
                return
            n = len(batch)
            c.byte_credit = byte_credit
        if credit > 0:
            c.credit = credit - n
        ssn = c.session
        did = ssn.next_delivery
        ssn.next_delivery = did + n
        self._write_runs(c, did, batch)
        unacked = ssn.unacked
        if c.accept_mode == P.ACCEPT_EXPLICIT:
            if not unacked:
                ssn.unacked_base = did
            unacked += batch
            ssn.unacked_queues += [q] * n
            ssn.unacked_count += n
        else:
            if unacked:  # keep unacked's index = delivery id - base
                unacked += [None] * n
                ssn.unacked_queues += [None] * n
            self._dequeue_many(q, batch)
        self._dirty_sessions[ssn] = None

    @staticmethod
    def _write_runs(c: Consumer, did: int, batch: list[Entry]) -> None:
        """message.deliver-run frames for ``batch``, delivery ids from ``did`` on,
        as few as the connection's frame size allows. The entries themselves
        go to the encoder: they are copied once, when it joins its parts."""
        out = c.session.conn.encoder.parts
        run_head, cap = c.run_head, c.run_cap
        size = sum(map(len, batch))
        if size <= cap:
            out.append(run_head(0xCF, did, 0xCE, len(batch), 0xC6, size))
            out += batch
            return
        first = size = 0
        for i, e in enumerate(batch):
            if size and size + len(e) > cap:
                out.append(run_head(0xCF, did + first, 0xCE, i - first, 0xC6, size))
                out += batch[first:i]
                first, size = i, 0
            size += len(e)
        out.append(run_head(0xCF, did + first, 0xCE, len(batch) - first, 0xC6, size))
        out += batch[first:]

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
            q = self._queue_by_slot[queue_slot]
            q.tokens[entries[op_index]] = token  # type: ignore[index]
            ssn = self.sessions.get(session_slot)
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
        while entries and seq_of(entries[0]) <= sequence:
            self._dequeue(q, entries.popleft())
            n += 1
        return n

    def purge_queue(self, name: str) -> int:
        q = self._queue("queue.purge", name)
        self._apply()
        n = len(q.entries)
        self._dequeue_many(q, list(q.entries))
        q.entries.clear()
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
        # message.deliver's fields up to the delivery id: [18, channel, destination, 0xCF + u64 delivery id]
        head = b"\x9b" + msgpack.packb(P.DELIVER) + msgpack.packb(ssn.channel) + msgpack.packb(destination)
        c.head = partial(Struct(f">{len(head)}sBQ").pack, head)
        if getattr(ssn.conn, "deliver_runs", False):
            head = b"\x96" + msgpack.packb(P.DELIVER_RUN) + msgpack.packb(ssn.channel) + msgpack.packb(destination)
            run_head = Struct(f">{len(head)}sBQBIBI")
            c.run_head = partial(run_head.pack, head)
            c.run_cap = ssn.conn.max_frame_size - run_head.size
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
        for first, last in self._ids("message.accept", transfers).ranges():
            queues, entries = ssn.take_unacked(first, last)
            if not entries:
                continue
            q = queues[0]
            if queues.count(q) == len(queues):  # the usual case: all from one queue
                if not q.deleted:
                    self._dequeue_many(q, entries)
                continue
            by_queue: dict[Queue, list[Entry]] = {}
            for q, e in zip(queues, entries, strict=True):
                by_queue.setdefault(q, []).append(e)
            for q, es in by_queue.items():
                if not q.deleted:
                    self._dequeue_many(q, es)

    def _h_release(self, ssn, cid, transfers):
        queues: list[Queue] = []
        entries: list[Entry] = []
        for first, last in self._ids("message.release", transfers).ranges():
            qs, es = ssn.take_unacked(first, last)
            queues += qs
            entries += es
        self._put_back(queues, entries)

    def _put_back(self, queues: list[Queue], entries: list[Entry]) -> None:
        """Released or abandoned deliveries go back to their queues, marked
        redelivered, newest first so each lands in its old place."""
        for q, e in sorted(zip(queues, entries, strict=True), key=lambda item: -seq_of(item[1])):
            if not q.deleted:
                q.put_back(redelivered(e))
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
_entry_head = ENTRY_HEAD.pack
_packer = msgpack.Packer(use_bin_type=True, autoreset=False)


def _encode_tail(exchange: str, routing_key: str, properties: dict | None, body: bytes) -> bytes:
    """A message's encoding as stored after an entry's head (see qflow.broker.queue)."""
    pack = _packer.pack
    pack(exchange)
    pack(routing_key)
    pack(properties)
    pack(body)
    tail = _packer.bytes()
    _packer.reset()
    return tail
