"""The broker: sessions, routing, and the end of each input batch. No I/O.

One input batch, as a connection drives it: every frame is handled (a
transfer is routed and each destination queue enqueues and announces it in
the op log, qflow.broker.oplog; other commands go to qflow.broker.commands),
then :meth:`Broker.flush` applies the op log in one accounting call
(qflow.broker.completion decides which transfers complete), delivers to
consumers (qflow.broker.delivery), applies again, and writes one
``session.completed`` per session that has news into that session's output,
and what completion decided for it (held by a queue or a holder, or no
longer: ``session.flow-notice``).
The broker never sees a connection: a session's output is the session
output its connection gave :meth:`Broker.open_session`
(qflow.protocol.session_output), which turns what the broker says into frames.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Generator
from typing import Any

import msgpack

from qflow import protocol as P
from qflow.broker.accounting import load_accounting
from qflow.broker.acl import Acl, AclDenied
from qflow.broker.arguments import refuse_unsupported
from qflow.broker.completion import Completion, Dequeued, Holder, holders_of
from qflow.broker.config_hooks import ConfigHooks
from qflow.broker.delivery import Delivery
from qflow.broker.exchange import EXCHANGE_TYPES, Exchange, check_exchange_arguments, new_exchange
from qflow.broker.flow_limit import FlowLimit
from qflow.broker.oplog import OpLog
from qflow.broker.ops import Accounting
from qflow.broker.queue import Consumer, Queue
from qflow.broker.session import BrokerSession
from qflow.broker.settings import FlowDefaults, SettingsError, resolve, resume_without_stop
from qflow.protocol import CommandError
from qflow.protocol.entries import Entry, encode_tail, entry_tail, message_size, redelivered, seq_of
from qflow.protocol.names import printable
from qflow.protocol.ranges import RangeSet
from qflow.protocol.session_output import SessionOutput

log = logging.getLogger("qflow.broker")

MAX_NAME = 255
MAX_PUBLISHED = 4096  # (exchange, routing key) pairs a session's ACL decisions are remembered for
MAX_DESTINATION = 255  # bytes, as a queue's name: a delivery frame's head must fit in the smallest frame (4096)
# Subscriptions one session may hold at once: 50,000 in one write took qflowd 1.7 s and starved every
# other client; a session needs a handful (an AMQP 1.0 session's receiving links count here too).
MAX_CONSUMERS = 1_000

# The most messages one step of a long command handles (purge, delete, remove-through, an
# accept or release of many deliveries, a detach's put-back): between two steps the server
# serves every other connection (docs/architecture.md, "No unbounded work in one step").
SLICE = 10_000

Steps = Generator[None, None, int]  # a long command's steps; its value is the command's count


def finish(steps: Steps) -> Any:
    """Run every step of ``steps`` at once (the management API, tests); its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


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
    """The broker's model: its queues, exchanges and sessions, and the verbs
    the protocol, the management API, the store and the memory alarm call.

    Each input batch ends with :meth:`flush`, which applies what the batch
    logged and reports what completed. A refused command raises
    :class:`qflow.protocol.CommandError` with the code the client is told;
    nothing is changed then.

    Args:
      defaults: the flow thresholds and limits of a queue that names none
        (qflowd's options).
      accounting: the accounting that applies the op log (default:
        ``$QFLOW_ACCOUNTING``'s, else the C one if built).
      transfer_runs: whether runs of transfers are taken whole by the C
        scanner (None: unless ``$QFLOW_TRANSFER_RUNS=0``).
    """

    def __init__(self, defaults: FlowDefaults | None = None, accounting: Accounting | None = None,
                 transfer_runs: bool | None = None) -> None:
        self.defaults = defaults or FlowDefaults()
        self.oplog = OpLog()  # what queues, transfers and holders announce, until the next apply
        self.completion = Completion(accounting or load_accounting(), self.oplog, self._tell)
        self.limits: dict[Queue, FlowLimit] = {}  # each queue's writers and worst case
        self.runs = _load_transfer_runs(transfer_runs)
        self.queues: dict[str, Queue] = {}
        self.exchanges: dict[str, Exchange] = {
            name: new_exchange(name, type_, durable=True)
            for name, type_ in (("", "direct"), ("amq.direct", "direct"), ("amq.fanout", "fanout"),
                                ("amq.topic", "topic"))
        }
        self._default_exchange = self.exchanges[""]  # routed inline on the per-message path
        self.discards_no_route = 0  # transfers routed to no queue, broker-wide (Qpid's discardsNoRoute)
        self.sessions: dict[int, BrokerSession] = {}
        self._next_session_slot = 0
        self._ready: dict[Queue, None] = {}  # queues with messages to deliver
        self._dirty_sessions: dict[BrokerSession, None] = {}  # sessions with something to report
        self._stalled: dict[Queue, None] = {}  # queues a consumer's full output left undelivered
        self._delivery = Delivery(self._dirty_sessions, self._stalled, self._expire_for_delivery)
        # Now, in ms since the Unix epoch: what message expiry is measured by (tests set their own).
        self.clock: Callable[[], int] = _now_ms
        # (holder, matches, attached) per carry(): the rules that give every new queue its outside holders,
        # in the order they were made (the order a transfer's OP_HOLDs take).
        self._carries: list[tuple[Holder, Callable[[Queue], bool], Callable[[Queue], None] | None]] = []
        # Told of each configuration change before it is made; a store may refuse it (config_hooks.py).
        self.config_hooks = ConfigHooks()
        self.acl: Acl | None = None  # None: everything is allowed (no --acl-file)
        self._own: BrokerSession | None = None  # the broker's own session (_own_session), made when needed
        # A long command the last execute() started and did not finish in one step
        # (qflow.broker.commands.Unfinished): its connection takes it and runs the rest.
        self.unfinished: Any = None

    @property
    def acct(self) -> Accounting:
        """The accounting that applies the op log (completion's)."""
        return self.completion.acct

    # -- sessions -------------------------------------------------------------
    def open_session(self, channel: int, name: str, out: SessionOutput | None = None,
                     user: str = "", peer: str = "") -> BrokerSession:
        """Attach a session of ``user`` (its connection's authenticated user),
        connected from ``peer`` (its address, for the log).
        What it is told goes to ``out`` (one gathering qflow frames in memory
        if none), whose ``wake()`` is called after each batch that told it something.

        Args:
          channel: the session's channel on its connection.
          name: the session's name, as the client gave it.
          out: where what the session is told goes.
          user: its connection's authenticated user (ACL checks).
          peer: its connection's address (the log).
        """
        slot = self._next_session_slot
        self._next_session_slot += 1
        ssn = BrokerSession(channel, name, slot, out, user, peer)
        self.sessions[slot] = ssn
        self.completion.add_session(slot, ssn)
        return ssn

    def close_session(self, ssn: BrokerSession) -> None:
        """Detach or connection loss: unaccepted deliveries go back to their
        queues marked redelivered, subscriptions end, held transfers are
        forgotten (their messages stay enqueued)."""
        finish(self.close_session_steps(ssn))

    def close_session_steps(self, ssn: BrokerSession) -> Steps:
        """:meth:`close_session`, the deliveries put back SLICE at a time. The
        session is closed at the first step; its subscriptions end before
        anything is put back, so none of it is delivered to it again."""
        if ssn.closed:
            return
        ssn.closed = True
        self._apply()
        queues, entries = ssn.take_all_unacked()
        for c in list(ssn.consumers.values()):
            self.remove_consumer(c)
        yield from self.put_back_steps(queues, entries)
        self._finish_close(ssn)
        return 0

    def _finish_close(self, ssn: BrokerSession) -> None:
        for c in list(ssn.consumers.values()):
            self.remove_consumer(c)
        for q in list(self.queues.values()):
            if q.exclusive and q.owner is ssn:
                self.delete_queue_now(q)
        self.completion.drop_session(ssn.slot)
        for limit in self.limits.values():
            limit.writers.pop(ssn, None)
        self._dirty_sessions.pop(ssn, None)
        del self.sessions[ssn.slot]
        self.flush()

    def fail(self, ssn: BrokerSession, command_id: int, code: int, text: str) -> None:
        """A command failed alone: report it and count it complete."""
        ssn.out.exception(command_id, code, text)
        ssn.commands.complete(command_id)
        self._dirty_sessions[ssn] = None

    # -- access control (qflow.broker.acl) ---------------------------------------
    def set_acl(self, acl: Acl | None) -> None:
        """Put ``acl``'s rules in force (None: allow everything). Sessions
        forget what the old rules let them publish."""
        self.acl = acl
        for ssn in self.sessions.values():
            ssn.published.clear()
        if acl is None:
            self.__dict__.pop("transfer", None)  # the unchecked method again: no cost without an ACL
        else:
            self.transfer = self._checked_transfer  # type: ignore[method-assign]

    def authorize(self, user: str, action: str, obj: str, request: dict[str, Any]) -> None:
        """Check that the ACL lets ``user`` do ``action`` on ``obj``
        (qflow.broker.acl.Acl.check). Every client command and every
        management request is checked here.

        Raises:
          AclDenied: the ACL refuses it (code 530, NOT_ALLOWED).
        """
        if self.acl is not None:
            self.acl.check(user, action, obj, request)

    def _checked_transfer(self, ssn: BrokerSession, command_id: int, exchange: str, routing_key: str,
                          properties: dict | None, body: bytes, tail: bytes | None = None) -> None:
        # With an ACL: each (exchange, routing key) is decided once per session (and logged
        # once, for -log rules), then remembered: a refused producer's flood costs no rule
        # walk and no log line per message.
        key = (exchange, routing_key)
        published = ssn.published
        denied = published.get(key, True)
        if denied is True:
            denied = None
            try:
                self.acl.check(ssn.user, "publish", "exchange",  # type: ignore[union-attr]
                               {"name": exchange or "amq.default", "routingkey": routing_key})
            except AclDenied as exc:
                denied = exc.text
            if len(published) >= MAX_PUBLISHED:
                published.clear()
            published[key] = denied
        if denied is not None:
            raise AclDenied(denied)  # a new one each time: a raised exception keeps its traceback
        Broker.transfer(self, ssn, command_id, exchange, routing_key, properties, body, tail)

    def check_owner(self, q: Queue, command: str, ssn: BrokerSession | None) -> None:
        """An exclusive queue is usable only by the session that declared it,
        as in AMQP 0-10 and qpidd (so by no other connection). ``ssn`` None:
        the management API, never an owner.

        Raises:
          CommandError: RESOURCE_LOCKED, naming ``command``, if ``q`` is exclusive to another session.
        """
        if q.exclusive and q.owner is not ssn:
            raise CommandError(P.RESOURCE_LOCKED, f"{command}: queue {q.name!r} is exclusive to another session")

    # -- the per-message path -------------------------------------------------
    def route(self, exchange: str, routing_key: str, properties: dict | None = None) -> Any:
        """The queues a message to ``exchange`` with ``routing_key`` (and
        ``properties``, for exchange types that read them) goes to.

        Raises:
          CommandError: NOT_FOUND if there is no such exchange.
        """
        if exchange == "":
            q = self.queues.get(routing_key)
            return q.route if q is not None else ()
        ex = self.exchanges.get(exchange)
        if ex is None:
            raise CommandError(P.NOT_FOUND, f"message.transfer: exchange {exchange!r} not found")
        return ex.route(routing_key, properties)

    def transfer(self, ssn: BrokerSession, command_id: int, exchange: str, routing_key: str,
                 properties: dict | None, body: bytes, tail: bytes | None = None) -> None:
        """Route and enqueue one message. ``tail`` is the message's encoding as
        it arrived (exchange, routing key, properties, body), if the connection
        had it at hand; otherwise it is encoded here. The message's size is
        counted from ``tail``, as a run's is from the same bytes in C.

        Raises:
          CommandError: NOT_FOUND for an unknown exchange; RESOURCE_LIMIT_EXCEEDED
            when a destination is full and its policy refuses (nothing is enqueued);
            INVALID_ARGUMENT for properties the protocol does not take.
        """
        if properties is not None and P.check_properties(properties):
            # A ttl, an expiration or a priority: stamped on arrival (a message without costs nothing more).
            queues = self.route(exchange, routing_key, properties)
            ex = self.exchanges[exchange]
            if not queues and ex.alternate is not None:
                queues = self._alternate_route(ex, routing_key, properties)
            self._transfer_stamped(ssn, command_id, ex, queues, routing_key, properties, body)
            return
        if exchange == "":  # the default exchange, inline: this is the per-message path
            ex = self._default_exchange
            q = self.queues.get(routing_key)
            queues = q.route if q is not None else ()
        else:
            queues = self.route(exchange, routing_key, properties)
            ex = self.exchanges[exchange]
            if not queues and ex.alternate is not None:
                queues = self._alternate_route(ex, routing_key, properties)
        if tail is None:
            tail = encode_tail(exchange, routing_key, properties, body)
        # The message's size (qflow.protocol.entries.message_size), inline: a call per
        # message would cost more than the sum.
        n = len(body)
        size = len(tail) - (2 if n < 0x100 else 3 if n < 0x10000 else 5)
        if not queues:
            self._unroutable(ssn, command_id, ex, size)
            return
        for q in queues:
            if (q.max_count and q.count >= q.max_count) or (q.max_size and q.nbytes + size > q.max_size):
                self._refuse_when_full(q)
        ex.msg_in += 1
        ex.byte_in += size
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        if len(queues) == 1:
            q = queues[0]
            if not q.special:
                q.enqueue(tail, size, ssn.slot, command_id)
                return
            if q.stamps:
                self._transfer_stamped(ssn, command_id, ex, queues, routing_key, properties, body)
                return
            if not q.holders:  # a ring queue: room is made after the enqueue
                q.enqueue(tail, size, ssn.slot, command_id)
                self._trim_ring(q)
                return
        # Several destinations, or outside holders: the transfer is opened, each
        # queue enqueues, the queues' outside holders hold it, and closing it
        # drops its routing hold (qflow.broker.completion).
        if len(queues) > 1:
            for q in queues:
                if q.stamps:
                    self._transfer_stamped(ssn, command_id, ex, queues, routing_key, properties, body)
                    return
            ex.msg_extra += len(queues) - 1
            ex.byte_extra += size * (len(queues) - 1)
        oplog = self.oplog
        oplog.open_transfer(ssn.slot, command_id)
        special = False
        for q in queues:
            q.enqueue(tail, size)
            if q.special:
                special = True
        if special:
            self.completion.hold(queues)
        oplog.close_transfer()
        if special:
            for q in queues:
                if q.ring:
                    self._trim_ring(q)

    # -- expiry and dead letters (messages stamped on arrival) -------------------------------
    def _stamp(self, q: Queue, exchange: str, routing_key: str, properties: dict | None, body: bytes,
               now: int) -> tuple[bytes, int, int]:
        """A message as ``q`` stores it: (tail, size, expiry or 0). Its expiry is
        absolute, ms since the Unix epoch (``expiration``, as qpidd keeps it), so
        that it means the same after a restart: ``now`` + its ``ttl``, or its
        ``expiration`` as sent, and no later than ``now`` + the queue's
        ``x-message-ttl``. A ``ttl`` of 0 is none, as in Qpid."""
        expiration = 0
        if properties:
            ttl = properties.get("ttl")
            if ttl:
                expiration = now + ttl
            elif ttl is None:
                expiration = properties.get("expiration") or 0
        ttl = q.settings.ttl
        if ttl and (not expiration or now + ttl < expiration):
            expiration = now + ttl
        if expiration:
            properties = {**(properties or {}), "expiration": expiration}
        tail = encode_tail(exchange, routing_key, properties, body)
        return tail, message_size(len(tail), len(body)), expiration

    def _transfer_stamped(self, ssn: BrokerSession, command_id: int, ex: Exchange, queues: Any, routing_key: str,
                          properties: dict | None, body: bytes) -> None:
        """:meth:`transfer` for a message the broker stamps on arrival (an expiry, a
        priority level): each queue gets its own entry, and the transfer is the
        general one (opened, each queue enqueues, its holders hold it, closed)."""
        now = self.clock()
        stamped = [self._stamp(q, ex.name, routing_key, properties, body, now) for q in queues]
        if not queues:
            self._unroutable(ssn, command_id, ex, message_size(len(encode_tail(ex.name, routing_key, properties, body)),
                                                               len(body)))
            return
        for q, (_, size, _) in zip(queues, stamped, strict=True):
            if (q.max_count and q.count >= q.max_count) or (q.max_size and q.nbytes + size > q.max_size):
                self._refuse_when_full(q)
        size = stamped[0][1]
        ex.msg_in += 1
        ex.byte_in += size
        if len(queues) > 1:
            ex.msg_extra += len(queues) - 1
            ex.byte_extra += size * (len(queues) - 1)
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        oplog = self.oplog
        oplog.open_transfer(ssn.slot, command_id)
        held = False
        priority = properties.get("priority") if properties else None
        for q, (tail, size, expiration) in zip(queues, stamped, strict=True):
            if q.settings.levels:
                s = q.settings
                seq = q.enqueue_at(s.default_level if priority is None else s.levels[priority], tail, size)
            else:
                seq = q.enqueue(tail, size)
            if expiration:
                q.note_expiry(seq, expiration)
            if q.holders:
                held = True
        if held:
            self.completion.hold(queues)
        oplog.close_transfer()
        for q in queues:
            if q.ring:
                self._trim_ring(q)

    def _alternate_route(self, ex: Exchange, routing_key: str, properties: dict | None) -> Any:
        """Where a message ``ex`` routes nowhere goes: the queues its alternate
        exchange routes it to, or that one's alternate's, and so on (each
        exchange once); () if none."""
        seen = {ex.name}
        while ex.alternate is not None and ex.alternate not in seen:
            seen.add(ex.alternate)
            alternate = self.exchanges.get(ex.alternate)
            if alternate is None:
                return ()
            queues = self.route(alternate.name, routing_key, properties)
            if queues:
                return queues
            ex = alternate
        return ()

    def _trim_ring(self, q: Queue) -> None:
        """A ring queue over its limit drops its oldest: dead letters."""
        dropped = q.trim_ring()
        if dropped:
            self._route_dead(q, dropped)

    def dead_letter(self, q: Queue, entries: list[Entry]) -> None:
        """Dead-letter ``entries`` of ``q`` (a client's reject, an expiry), which
        the caller has taken off ``q`` (available ones out of its entries, or
        acquired ones a session gave up).

        Rules:
          * Each leaves ``q``'s depth exactly as a dequeue does: it is one
            (:meth:`Queue.dequeue_many`, through the op log), so a producer held
            by ``q`` is released by it as by an accept.
          * Each is then routed to ``q``'s alternate exchange, if it has one
            (``alternate-exchange``, ``x-dead-letter-exchange``), with
            ``x-dead-letter-routing-key`` or else its own routing key, without
            its ``ttl`` and ``expiration`` (a dead letter does not expire again
            by them; the queue it reaches may give it its own default).
          * On the queue it reaches it is an enqueue outside any transfer, as a
            message recovered by the store is: it counts in that queue's depth
            and can stop that queue's flow, and it holds no producer. A full
            queue (reject policy) does not take it; a full ring queue drops
            its oldest, which are not dead-lettered again (a ring of alternates
            would never end).
        """
        if not entries or q.deleted:
            return
        q.dequeue_many(entries)
        self._route_dead(q, entries)

    def _route_dead(self, q: Queue, entries: list[Entry]) -> None:
        """``entries``, dequeued from ``q``, go to its alternate exchange (see :meth:`dead_letter`)."""
        q.dead_letters += len(entries)
        name = q.settings.alternate
        if name is None:
            return
        ex = self.exchanges.get(name)
        if ex is None:
            return  # an alternate exchange not declared (yet): dropped, counted in deadLetters
        key = q.settings.dead_letter_key
        now = self.clock()
        for entry in entries:
            _, routing_key, properties, body = entry_tail(entry)
            if properties:
                properties = {k: v for k, v in properties.items() if k != "ttl" and k != "expiration"} or None
            if key is not None:
                routing_key = key
            queues = self.route(name, routing_key, properties)
            if not queues:
                queues = self._alternate_route(ex, routing_key, properties)
            stamped = [self._stamp(dq, name, routing_key, properties, body, now) for dq in queues]
            size = stamped[0][1] if stamped else message_size(len(encode_tail(name, routing_key, properties, body)),
                                                              len(body))
            ex.msg_in += 1
            ex.byte_in += size
            if not queues:
                ex.msg_drop += 1
                ex.byte_drop += size
                continue
            ex.msg_extra += len(queues) - 1
            ex.byte_extra += size * (len(queues) - 1)
            taking = []
            for dq, (tail, size, expiration) in zip(queues, stamped, strict=True):
                if not dq.ring and ((dq.max_count and dq.count >= dq.max_count)
                                    or (dq.max_size and dq.nbytes + size > dq.max_size)):
                    dq.discards_overflow += 1
                    continue
                taking.append((dq, tail, size, expiration))
            # A queue with outside holders (a durable queue: the store) must hold the dead letter as it
            # holds a transfer, or the store would never write it: it is then a transfer of the broker's
            # own session, which no producer waits on. Elsewhere it is an enqueue outside any transfer.
            held = any(dq.holders for dq, _, _, _ in taking)
            if held:
                own = self._own_session()
                self.oplog.open_transfer(own.slot, own.commands.receive())
            for dq, tail, size, expiration in taking:
                if dq.settings.levels:
                    s = dq.settings
                    priority = properties.get("priority") if properties else None
                    seq = dq.enqueue_at(s.default_level if priority is None else s.levels[priority], tail, size)
                else:
                    seq = dq.enqueue(tail, size)
                if expiration:
                    dq.note_expiry(seq, expiration)
            if held:
                self.completion.hold([dq for dq, _, _, _ in taking])
                self.oplog.close_transfer()
            for dq, _, _, _ in taking:
                if dq.ring:
                    dq.trim_ring()

    def _own_session(self) -> BrokerSession:
        """The broker's own session: the transfers it makes itself (dead letters to durable queues)."""
        own = self._own
        if own is None:
            own = self._own = self.open_session(-1, "qflowd: dead letters", _Unread(), "qflowd")  # type: ignore[arg-type]
        return own

    def _expire_due(self, q: Queue) -> Steps:
        """Dead-letter ``q``'s available messages whose expiry has come, SLICE per
        step; counted in ``discardsTtl``. Acquired ones wait: if they come back
        (released), the next delivery drops them."""
        due = q.expired(self.clock())
        n = 0
        if not due:
            return n
        ranges = list(due.ranges())
        first, last = ranges[0][0], ranges[-1][1]
        while not q.deleted:
            self._apply()  # dequeue_many reads which transfers the queue holds
            taken, first, more = q.take_sequences_slice(due, first, last, SLICE)
            if taken:
                q.discards_ttl += len(taken)
                self.dead_letter(q, taken)
                n += len(taken)
            if not more:
                break
            yield
        self._apply()
        return n

    def _expire_for_delivery(self, q: Queue) -> None:
        """Before ``q`` delivers: its expired messages go (Delivery calls this
        only for a queue with messages that expire)."""
        if q.next_expiry <= self.clock():
            finish(self._expire_due(q))

    def expire_steps(self) -> Steps:
        """Drop the expired messages of every queue (qpidd's periodic purge,
        ``--queue-purge-interval``): without it, expired messages on a queue
        nobody reads would stay, and hold its producers. Its value: how many
        expired."""
        now = self.clock()
        n = 0
        for q in list(self.queues.values()):
            if q.expiries and q.next_expiry <= now and not q.deleted:
                n += yield from self._expire_due(q)
        self.flush()
        return n

    def _unroutable(self, ssn: BrokerSession, command_id: int, ex: Exchange, size: int) -> None:
        """A transfer routed to no queue: completed and dropped, as qpidd does, but counted."""
        ex.msg_in += 1
        ex.byte_in += size
        ex.msg_drop += 1
        ex.byte_drop += size
        self.discards_no_route += 1
        ssn.commands.complete(command_id)
        self._dirty_sessions[ssn] = None

    def _refuse_when_full(self, q: Queue) -> None:
        """``q`` is full: raise unless its policy lets the message in (a ring
        queue does; the caller trims its oldest after the enqueue)."""
        policy = q.settings.policy
        if policy == "reject" or (policy == "ring-strict" and self._oldest_is_acquired(q)):
            q.discards_overflow += 1
            raise CommandError(
                P.RESOURCE_LIMIT_EXCEEDED,
                f"message.transfer: queue {q.name!r} is full (policy {policy}, depth {q.count} messages, "
                f"{q.nbytes} bytes, limits {q.max_count} messages, {q.max_size} bytes)",
            )

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
            properties = None
            if run.properties_len != 1:  # not nil
                properties = msgpack.unpackb(buf[run.properties:run.properties + run.properties_len],
                                             raw=False, strict_map_key=False)
                if P.check_properties(properties):
                    return 0  # stamped on arrival: frame by frame
            q = self.queues.get(routing_key) if exchange == "" else None
            if q is not None:  # the default exchange's usual case, inline
                ex, queues = self._default_exchange, q.route
            else:
                queues = self.route(exchange, routing_key, properties)
                ex = self.exchanges[exchange]
        except (ValueError, TypeError, CommandError):  # bad UTF-8, unhashable keys, bad properties, no exchange
            return 0
        if self.acl is not None and ssn.published.get((exchange, routing_key), True) is not None:
            return 0  # not (yet) allowed: the frame goes through transfer(), which asks the ACL (and remembers)
        if not queues:
            return 0
        max_bytes = 1 << 64
        for q in queues:
            if q.stamps:
                return 0
            if q.max_count:
                count = min(count, q.max_count - q.count)
            if q.max_size:
                max_bytes = min(max_bytes, q.max_size - q.nbytes)
        if count <= 0 or max_bytes < 0:
            return 0
        if ssn.last_queues is not queues:
            self._note_writer(ssn, queues)
        if len(queues) > 1 or queues[0].holders:
            return self._fanout_run(ssn, queues, ex, buf, pos, count, max_bytes)
        q = queues[0]
        seq = q.next_seq
        commands = ssn.commands
        cid = commands.next_id
        n, consumed, nbytes, entries, ops = runs.store(buf, pos, count, max_bytes, seq, ssn.slot, cid, q.slot)
        if not n:
            return 0
        commands.next_id = cid + n
        ex.msg_in += n  # counted once per run
        ex.byte_in += nbytes
        q.enqueue_run(entries, nbytes)
        self.oplog.add_run(ops, seq, n)
        return consumed

    def store_run(self, ssn: BrokerSession, queue: str, count: int,
                  make: Callable[[int, int, int], tuple[list[Entry], Any, int]]) -> int:
        """Enqueue a run of up to ``count`` transfers of ``ssn`` to ``queue``
        (by the default exchange), numbered from its next command id, whose
        entries another protocol writes: ``make(first_seq, count, max_bytes)``
        returns (entries, their sizes as native uint64s, their total size) for
        as many as it can. Returns how many were taken; 0 when the queue cannot
        take a run now (unknown, a ring, outside holders, full, no C scanner):
        then :meth:`transfer` takes each, and reports any error."""
        q = self.queues.get(queue)
        runs = self.runs
        if q is None or q.special or runs is None or len(q.route) != 1:
            return 0
        max_bytes = 1 << 64
        if q.max_count:
            count = min(count, q.max_count - q.count)
        if q.max_size:
            max_bytes = q.max_size - q.nbytes
        if count <= 0 or max_bytes < 0:
            return 0
        seq = q.next_seq
        entries, sizes, nbytes = make(seq, count, max_bytes)
        n = len(entries)
        if not n:
            return 0
        if ssn.last_queues is not q.route:
            self._note_writer(ssn, q.route)
        commands = ssn.commands
        cid = commands.next_id
        commands.next_id = cid + n
        ex = self._default_exchange
        ex.msg_in += n
        ex.byte_in += nbytes
        q.enqueue_run(entries, nbytes)
        self.oplog.add_run(runs.transfer1_ops(sizes, ssn.slot, cid, q.slot), seq, n)
        return n

    def _fanout_run(self, ssn: BrokerSession, queues: list[Queue], ex: Exchange, buf: bytes, pos: int,
                    count: int, max_bytes: int) -> int:
        """:meth:`transfer_run` for a run routed to several queues, or to queues
        with outside holders: each queue gets its own entries (their sequence
        numbers differ), and the ops are those :meth:`transfer` logs for such a
        transfer."""
        runs = self.runs
        cid = ssn.commands.next_id
        stored = [runs.store(buf, pos, count, max_bytes, q.next_seq, ssn.slot, cid, q.slot) for q in queues]
        n, consumed, nbytes = stored[0][:3]
        if not n:
            return 0
        holders = holders_of(queues)
        ops = runs.fanout_ops(buf, pos, n, ssn.slot, cid, [q.slot for q in queues], [h.slot for h in holders])
        ssn.commands.next_id = cid + n
        ex.msg_in += n
        ex.byte_in += nbytes
        ex.msg_extra += n * (len(queues) - 1)
        ex.byte_extra += nbytes * (len(queues) - 1)
        seqs = [q.next_seq for q in queues]
        for q, (_, _, _, entries, _) in zip(queues, stored, strict=True):
            q.enqueue_run(entries, nbytes)
        self.oplog.add_fanout_run(ops, queues, seqs, [st[3] for st in stored], list(holders.values()))
        return consumed

    def _note_writer(self, ssn: BrokerSession, queues: Any) -> None:
        """Remember which queues a session writes to, with its sender capacity
        (for worstCaseDepth). Checked once per change of destination, not per message."""
        ssn.last_queues = queues
        limits = self.limits
        for q in queues:
            limits[q].note_writer(q, ssn, ssn.capacity)

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
        return not q.entries or oldest < q.first_sequence()

    # -- outside holders ----------------------------------------------------------
    def add_holder(self, name: str, wake: Callable[[], None] | None = None, dequeued: Dequeued | None = None,
                   deleted: Callable[[Queue], None] | None = None, *, tracks: bool = False) -> Holder:
        """A new outside holder of transfers' completion (qflow.broker.completion.Holder):
        the durable store, the memory alarm. It holds nothing until queues
        carry it (:meth:`carry`).

        Args:
          name: what it is called in the log and the views.
          wake: called, on the loop, after an apply that gave it holds (it may
            run inside the apply: it must only signal).
          dequeued: ``dequeued(queue, entries)`` is told of every dequeue from
            a queue that carries it, as it happens.
          deleted: ``deleted(queue)`` is told when a queue that carries it is
            deleted, after the queue let its holds go.
          tracks: whether naming it (:meth:`name_holder`) also names the
            sessions of the holds it has then (asked of the accounting).
        """
        holder = self.completion.add_holder(name, wake, dequeued)
        holder.deleted = deleted
        holder.tracks = tracks
        return holder

    def name_holder(self, holder: Holder, label: str | None) -> None:
        """From now on every session ``holder`` holds is told so under ``label``
        (session.flow-notice with its holder flag, ``heldBy`` in the views), the
        ones it holds already included if it ``tracks``; None: no longer, and
        the sessions it holds now are told it holds them no more."""
        self.completion.name_holds(holder, label)

    def carry(self, holder: Holder, matches: Callable[[Queue], bool],
              attached: Callable[[Queue], None] | None = None) -> None:
        """Have ``holder`` hold the transfers routed to every queue ``matches``
        accepts: those there now and those declared later, until the holder is
        removed (:meth:`remove_holder`). ``attached(queue)`` is called for each
        such queue once it carries the holder."""
        rule = (holder, matches, attached)
        self._carries.append(rule)
        for q in list(self.queues.values()):
            _carry(rule, q)

    def remove_holder(self, holder: Holder) -> None:
        """The holder is gone (the store closes, the alarm clears): no queue
        carries it, and the transfers it held complete unless something else
        holds them. Reported at once, as a session's close is."""
        self._carries = [rule for rule in self._carries if rule[0] is not holder]
        self._complete(self.completion.remove_holder(holder))
        self.flush()

    def release_holds(self, holder: Holder, tokens: list[int]) -> None:
        """``holder`` lets go of ``tokens`` (Holder.release), and the batch is
        ended now (:meth:`flush`): the transfers left without a holder complete
        and their sessions are told. Call it on the loop, between input batches.

        Raises:
          ValueError: a token is not a hold token (nothing is released then).
        """
        if tokens:
            holder.release(tokens)
        self.flush()

    # -- acknowledgement ----------------------------------------------------------
    def accept(self, queues: list[Queue], entries: list[Entry]) -> None:
        """Accepted deliveries leave their queues for good."""
        if not entries:
            return
        q = queues[0]
        if queues.count(q) == len(queues):  # the usual case: all from one queue
            if not q.deleted:
                q.dequeue_many(entries)
            return
        by_queue: dict[Queue, list[Entry]] = {}
        for q, e in zip(queues, entries, strict=True):
            by_queue.setdefault(q, []).append(e)
        for q, es in by_queue.items():
            if not q.deleted:
                q.dequeue_many(es)

    def accept_steps(self, queues: list[Queue], entries: list[Entry]) -> Steps:
        """:meth:`accept`, SLICE deliveries per step (the dequeue joins their bytes)."""
        for i in range(0, len(entries), SLICE):
            if i:
                yield
            self._apply()
            self.accept(queues[i:i + SLICE], entries[i:i + SLICE])
        return len(entries)

    def put_back(self, queues: list[Queue], entries: list[Entry]) -> None:
        """Released or abandoned deliveries go back to their queues, marked
        redelivered, each to its old place."""
        finish(self.put_back_steps(queues, entries))

    def put_back_steps(self, queues: list[Queue], entries: list[Entry]) -> Steps:
        """:meth:`put_back`, SLICE deliveries per step, newest first: each slice
        is merged in front of the queue's older messages only (those put back
        before it are newer and stay behind it)."""
        by_queue: dict[Queue, list[Entry]] = {}
        for q, e in zip(queues, entries, strict=True):
            by_queue.setdefault(q, []).append(e)
        first = True
        for q, es in by_queue.items():
            es.sort(key=seq_of)
            for end in range(len(es), 0, -SLICE):
                if not first:
                    yield
                first = False
                if not q.deleted:
                    q.put_back_many([redelivered(e) for e in es[max(0, end - SLICE):end]])
        return len(entries)

    # -- the end of a batch ---------------------------------------------------
    def _apply(self) -> None:
        if self.oplog:  # most calls (the second of every flush) find nothing to apply
            self._complete(self.completion.apply())

    def _tell(self, ssn: BrokerSession, name: str, held: bool, holder: bool) -> None:
        """What completion decided for ``ssn``: held by ``name`` (a queue, or an
        outside holder if ``holder``), or no longer; told at the batch's end."""
        if ssn.closed:
            return
        since = ssn.holder_since if holder else ssn.held_since
        if held:
            since[name] = time.time()
        else:
            since.pop(name, None)
        ssn.out.flow_notice(name, held, holder)
        self._dirty_sessions[ssn] = None

    def _complete(self, completions: list[tuple[int, int, int]]) -> None:
        sessions = self.sessions
        for session_slot, first, last in completions:
            ssn = sessions.get(session_slot)
            if ssn is not None:
                ssn.commands.complete_range(first, last)
                self._dirty_sessions[ssn] = None

    def flush(self) -> None:
        """End of an input batch: apply the op log, deliver, report completions,
        and wake each session given output."""
        dispatch = self._delivery.dispatch
        while True:
            self._apply()
            if not self._ready:
                break
            queues = list(self._ready)
            self._ready.clear()  # the same dict: every queue announces into it
            for q in queues:
                if not q.deleted:
                    dispatch(q)
        if not self._dirty_sessions:
            return
        wakes = {}
        for ssn in self._dirty_sessions:
            report = ssn.commands.take_report()
            if report is not None:
                ssn.out.completed(report)
            wakes[ssn.out.wake] = None
        self._dirty_sessions.clear()
        for wake in wakes:
            wake()

    @property
    def stalled(self) -> bool:
        """Some queue holds messages back because a consumer's output is full."""
        return bool(self._stalled)

    def output_drained(self) -> None:
        """A connection's output has room again (its peer read): the queues
        held back for want of room are dispatched again, and the batch ended."""
        self._ready.update(self._stalled)
        self._stalled.clear()
        self.flush()

    # -- commands (qflow.broker.commands runs them) ---------------------------
    def apply_pending(self) -> None:
        """Apply the op log now: a command reads or changes state that the
        pending log may not have reached yet."""
        self._apply()

    def done(self, ssn: BrokerSession, command_id: int, result: Any = None) -> None:
        """A command succeeded: its result (if any) goes to the session's
        output, and its completion is reported at the batch's end."""
        if result is not None:
            ssn.out.result(command_id, result)
        ssn.commands.complete(command_id)
        self._dirty_sessions[ssn] = None

    def report(self, ssn: BrokerSession) -> None:
        """Report ``ssn``'s completions at the end of this batch (session.flush)."""
        self._dirty_sessions[ssn] = None

    def held_sessions(self, q: Queue) -> Collection[BrokerSession]:
        """The sessions ``q``'s flow control holds now: at least one transfer of each."""
        return self.completion.held_sessions(q).keys()

    def set_sender_capacity(self, ssn: BrokerSession, capacity: int) -> None:
        """``ssn`` announced its senders' capacity: the worst case of every
        queue it writes to is counted again (a warning if it no longer fits)."""
        ssn.capacity = capacity
        for q, limit in self.limits.items():
            if ssn in limit.writers:
                limit.note_writer(q, ssn, capacity)

    def _check_name(self, kind: str, name: str) -> None:
        if not name or len(name.encode()) > MAX_NAME:
            raise CommandError(P.INVALID_ARGUMENT, f"{kind} name must be 1 to {MAX_NAME} bytes, got {len(name.encode())}")

    def queue(self, command: str, name: str) -> Queue:
        """The queue called ``name``.

        Raises:
          CommandError: NOT_FOUND, naming ``command``, if there is none.
        """
        q = self.queues.get(name)
        if q is None:
            raise CommandError(P.NOT_FOUND, f"{command}: queue {name!r} not found")
        return q

    def declare_queue(self, name: str, durable: bool = False, exclusive: bool = False, auto_delete: bool = False,
                      arguments: dict[str, Any] | None = None, passive: bool = False,
                      owner: BrokerSession | None = None, recovered: bool = False) -> tuple[Queue, bool]:
        """Declare a queue; returns (queue, created). Redeclaring an existing
        queue succeeds and changes nothing, as in AMQP. An argument qflow does
        not support is refused (qflow.broker.arguments), unless ``recovered``.

        Args:
          name: 1 to 255 bytes.
          durable, exclusive, auto_delete: as queue.declare gives them.
          arguments: its limits and flow thresholds (qflow.broker.settings).
          passive: only find it; create nothing.
          owner: the declaring session (None: the management API or the store).
          recovered: declared by the store from the data directory.

        Raises:
          CommandError: NOT_FOUND (``passive``, no such queue), INVALID_ARGUMENT
            (a bad name or argument), RESOURCE_LOCKED (exclusive to another
            session), or the store's refusal to record it.
        """
        arguments = {} if arguments is None else arguments
        if not recovered:  # the store warns of those a queue was declared with before they were refused
            refuse_unsupported(f"queue.declare {name!r}", "queue", arguments)
        self._check_name("queue", name)
        q = self.queues.get(name)
        if q is not None:
            self.check_owner(q, "queue.declare", owner)
            return q, False
        if passive:
            raise CommandError(P.NOT_FOUND, f"queue.declare: queue {name!r} not found (passive)")
        try:
            settings = resolve(arguments, self.defaults)
        except SettingsError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"queue.declare {name!r}: {exc}") from None
        self._warn_resume_without_stop(name, arguments)
        self.config_hooks.declare_queue(name, durable, auto_delete, arguments)
        q = Queue(name, durable, exclusive, auto_delete, arguments, settings, self.completion.add_queue(settings),
                  self.oplog, self._ready, owner if exclusive else None)
        self.completion.attach(q)
        self.limits[q] = FlowLimit()
        self.queues[name] = q
        self.exchanges[""].bind(q, name)
        for rule in self._carries:
            _carry(rule, q)
        return q, True

    def modify_queue(self, q: Queue, arguments: dict[str, Any], by: BrokerSession | None = None) -> None:
        """Change a live queue's limits and thresholds; re-evaluates its flow state.

        The queue's arguments with the change laid over them are resolved
        exactly as a declare of them would be (qflow.broker.settings), so a live
        queue never has thresholds a declare could not give it: a key the
        change leaves out keeps its value, and a threshold no key names is
        pre-filled from the broker defaults again.

        Args:
          q: the queue.
          arguments: the keys to change.
          by: the session asking (None: the management API).

        Raises:
          CommandError: INVALID_ARGUMENT (nothing is changed), RESOURCE_LOCKED,
            or the store's refusal to record it.
        """
        self.check_owner(q, "queue.modify", by)
        refuse_unsupported(f"queue.modify {q.name!r}", "queue", arguments)
        merged = {**q.arguments, **arguments}
        try:
            settings = resolve(merged, self.defaults)
        except SettingsError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"queue.modify {q.name!r}: {exc}") from None
        if settings.levels != q.settings.levels:
            raise CommandError(P.INVALID_ARGUMENT, f"queue.modify {q.name!r}: a queue's priority levels are fixed "
                                                   "when it is declared")
        self._warn_resume_without_stop(q.name, merged)
        self.config_hooks.modify_queue(q, merged)
        completions = self.completion.set_thresholds(q, settings)
        q.arguments = merged
        q.set_settings(settings)
        self._complete(completions)

    @staticmethod
    def _warn_resume_without_stop(name: str, arguments: dict[str, Any]) -> None:
        # qpidd accepts such a queue and logs a warning; so does qflowd (the queue is not refused).
        warning = resume_without_stop(arguments)
        if warning:
            log.warning('queue "%s": %s', printable(name), warning)

    def delete_queue(self, name: str, if_empty: bool = False, if_unused: bool = False,
                     by: BrokerSession | None = None) -> int:
        """Delete queue ``name`` at the request of session ``by`` (None: the management API).

        Returns:
          How many messages it had.

        Raises:
          CommandError: NOT_FOUND, RESOURCE_LOCKED, PRECONDITION_FAILED
            (``if_empty`` or ``if_unused`` did not hold), or the store's
            refusal to record it; nothing is deleted then.
        """
        q = self.queue("queue.delete", name)
        self.check_owner(q, "queue.delete", by)
        if if_empty and q.count:
            raise CommandError(P.PRECONDITION_FAILED, f"queue.delete: queue {name!r} is not empty ({q.count} messages)")
        if if_unused and q.consumers:
            raise CommandError(P.PRECONDITION_FAILED,
                               f"queue.delete: queue {name!r} is in use ({len(q.consumers)} consumers)")
        count = q.count
        self.config_hooks.delete_queue(q)  # may refuse: nothing is deleted yet
        self.delete_queue_now(q, recorded=True)
        return count

    def delete_queue_steps(self, name: str, if_empty: bool = False, if_unused: bool = False,
                           by: BrokerSession | None = None) -> Steps:
        """:meth:`delete_queue`, whose messages are then let go of SLICE at a
        time (freeing millions at once would hold the loop for seconds); the
        queue itself is gone at the first step. Its value: the messages it had."""
        q = self.queue("queue.delete", name)
        entries = q.entries
        count = self.delete_queue(name, if_empty, if_unused, by)
        return self._drop(entries, count)

    @staticmethod
    def _drop(entries: Any, count: int) -> Steps:
        pop = entries.pop
        while entries:
            for _ in range(min(SLICE, len(entries))):
                pop()
            if entries:
                yield
        return count

    def delete_queue_now(self, q: Queue, recorded: bool = False) -> None:
        """Delete ``q`` now. Unless the caller has already told the config
        hooks (``recorded``), they are told here, and a refusal is only
        logged: the deletions the broker makes on its own (auto-delete,
        exclusive owner gone) cannot be refused."""
        if not recorded:
            try:
                self.config_hooks.delete_queue(q)
            except CommandError as exc:
                log.error('queue "%s" is deleted, but the store could not record it (it may come back after a '
                          'restart): %s', printable(q.name), printable(exc.text))
        self._apply()
        for ex in self.exchanges.values():
            ex.unbind_queue(q)
        for c in q.consumers + q.browsers:
            c.session.consumers.pop(c.destination, None)
        q.consumers.clear()
        q.browsers.clear()
        q.deleted = True
        del self.queues[q.name]
        holders = q.holders
        self._complete(self.completion.remove_queue(q))
        del self.limits[q]
        for holder in holders:
            if holder.deleted is not None:
                holder.deleted(q)

    def remove_through(self, name: str, sequence: int, by: BrokerSession | None = None) -> int:
        """Dequeue every available message with a sequence number up to and
        including ``sequence`` (a browsing reader's commit). Dequeuing releases
        held producers exactly as consuming does. Acquired messages stay with
        their consumers.

        Returns:
          How many were removed.

        Raises:
          CommandError: NOT_FOUND or RESOURCE_LOCKED.
        """
        return finish(self.remove_through_steps(name, sequence, by))

    def remove_through_steps(self, name: str, sequence: int, by: BrokerSession | None = None) -> Steps:
        """:meth:`remove_through`, SLICE messages per step."""
        q = self.queue("queue.remove-through", name)
        self.check_owner(q, "queue.remove-through", by)
        return self._remove_through(q, sequence)

    def _remove_through(self, q: Queue, sequence: int) -> Steps:
        entries = q.entries
        n = 0
        while not q.deleted:
            self._apply()
            batch = []
            if q.settings.levels:
                batch = entries.take(lambda seq: seq <= sequence, SLICE)[0]
            while entries and len(batch) < SLICE and seq_of(entries[0]) <= sequence:
                batch.append(entries.popleft())
            if batch:
                q.dequeue_many(batch)
                n += len(batch)
            if len(batch) < SLICE:
                break
            yield
        self._apply()
        return n

    def available(self, name: str, after: int, limit: int, by: BrokerSession | None = None) -> dict[str, Any]:
        """Which messages a browsing reader may plan to read: the sequence
        numbers of the first ``limit`` (-1: all) available messages above
        ``after``, with the queue's incarnation and sequence bounds.

        Raises:
          CommandError: NOT_FOUND, RESOURCE_LOCKED, or INVALID_ARGUMENT for a
            negative ``after`` or a ``limit`` below -1.
        """
        return finish(self.available_steps(name, after, limit, by))

    def available_steps(self, name: str, after: int, limit: int, by: BrokerSession | None = None,
                        max_ranges: int | None = None) -> Steps:
        """:meth:`available`, SLICE messages per step, each step going on from
        the last sequence number the one before saw. Past ``max_ranges``
        ranges in the answer, refused with RESOURCE_LIMIT_EXCEEDED."""
        q = self.queue("queue.available", name)
        self.check_owner(q, "queue.available", by)
        if after < 0 or limit < -1:
            raise CommandError(P.INVALID_ARGUMENT, "queue.available: after must be >= 0 and limit >= -1")
        return self._available(q, after, limit, max_ranges)

    def _available(self, q: Queue, after: int, limit: int, max_ranges: int | None) -> Steps:
        if q.expiries:  # an expired message is not available
            yield from self._expire_due(q)
        out = RangeSet()
        left = limit
        while not q.deleted:
            n, after, more = q.available_slice(out, after, left, SLICE)
            if left > 0:
                left -= n
            if max_ranges is not None and out.range_count > max_ranges:
                raise CommandError(P.RESOURCE_LIMIT_EXCEEDED,
                                   f"queue.available: the available messages make more than {max_ranges} ranges, "
                                   f"the limit of one answer; ask for fewer with limit (up to sequence {after} "
                                   f"they made {out.range_count})")
            if not more:
                break
            yield
        return {"incarnation": q.incarnation, "sequences": out.to_wire(),
                "firstSequence": q.first_sequence(),
                "lastSequence": q.next_seq - 1}

    def remove_sequences(self, name: str, incarnation: str, sequences: RangeSet,
                         by: BrokerSession | None = None) -> int:
        """Dequeue exactly the available messages of ``name`` numbered in
        ``sequences`` (a browsing reader's commit of what it read), provided the
        queue is still the ``incarnation`` that numbered them.

        Returns:
          How many were removed.

        Raises:
          CommandError: NOT_FOUND, RESOURCE_LOCKED, or PRECONDITION_FAILED if
            the queue is another incarnation (nothing is removed).
        """
        return finish(self.remove_sequences_steps(name, incarnation, sequences, by))

    def remove_sequences_steps(self, name: str, incarnation: str, sequences: RangeSet,
                               by: BrokerSession | None = None) -> Steps:
        """:meth:`remove_sequences`, looking at SLICE messages per step."""
        q = self.queue("queue.remove-sequences", name)
        self.check_owner(q, "queue.remove-sequences", by)
        if q.incarnation != incarnation:
            raise CommandError(P.PRECONDITION_FAILED,
                               f"queue.remove-sequences: queue {name!r} is incarnation {q.incarnation}, not "
                               f"{incarnation} (it was deleted and declared again, or the broker restarted): "
                               f"nothing removed")
        return self._remove_sequences(q, sequences)

    def _remove_sequences(self, q: Queue, sequences: RangeSet) -> Steps:
        n = 0
        if not sequences:
            return n
        ranges = list(sequences.ranges())
        first, last = ranges[0][0], ranges[-1][1]
        while not q.deleted:
            self._apply()  # dequeue_many reads which transfers the queue holds
            removed, first, more = q.remove_sequences_slice(sequences, first, last, SLICE)
            n += removed
            if not more:
                break
            yield
        self._apply()
        return n

    def purge_queue(self, name: str, by: BrokerSession | None = None) -> int:
        """Purge ``name`` at once (the management API); see :meth:`purge_steps`.

        Returns:
          How many messages were removed.

        Raises:
          CommandError: NOT_FOUND or RESOURCE_LOCKED.
        """
        return finish(self.purge_steps(name, by))

    def purge_steps(self, name: str, by: BrokerSession | None = None) -> Steps:
        """Purge the messages available on ``name`` now, SLICE at a time, at the
        request of session ``by`` (None: the management API): the queue's
        existence and owner are checked here; each step of the generator returned
        removes up to SLICE of them, and its value is how many it removed.
        Messages enqueued after the purge began are not purged."""
        q = self.queue("queue.purge", name)
        self.check_owner(q, "queue.purge", by)
        return self._purge(q, q.next_seq - 1)

    def _purge(self, q: Queue, newest: int) -> Steps:
        if q.expiries:  # the expired ones are counted as such, and dead-lettered
            yield from self._expire_due(q)
        entries = q.entries
        n = 0
        while True:
            self._apply()  # dequeue_many reads which transfers the queue holds
            if q.settings.levels:  # by level: those numbered up to newest, wherever they are
                batch, _, more = entries.take(lambda seq: seq <= newest, SLICE)
                k = SLICE if more else 0
            else:
                k = min(SLICE, len(entries))
                batch = [entries.popleft() for _ in range(k)]
            if batch and seq_of(batch[-1]) > newest:  # the last slice: newer messages stay
                newer = [e for e in batch if seq_of(e) > newest]
                del batch[len(batch) - len(newer):]
                entries.extendleft(reversed(newer))
                k = 0
            if batch and not q.deleted:
                q.dequeue_many(batch)
                n += len(batch)
            if k < SLICE or not entries or q.deleted:
                break
            yield
        self._apply()
        return n

    def queue_stats(self, q: Queue) -> dict[str, Any]:
        """``q``'s statistics with the QMF names, its flow state and worst case included."""
        count, nbytes, flow_on, stopped_count, held = self.completion.stats(q)
        s = q.settings
        stats = q.stats()
        stats.update(
            flowStopped=flow_on, flowStoppedCount=stopped_count, flowStopCount=s.stop_count,
            flowResumeCount=s.resume_count, flowStopSize=s.stop_size, flowResumeSize=s.resume_size,
            heldTransfers=held, worstCaseDepth=self.worst_case(q),
        )
        return stats

    def worst_case(self, q: Queue) -> int:
        """The manual's worst case of ``q`` (worstCaseDepth): its stop threshold plus the capacities
        of the senders writing to it now (0 without a count threshold)."""
        return self.limits[q].worst_case(q.settings)

    def declare_exchange(self, name: str, type_: str, durable: bool = False, passive: bool = False,
                         arguments: dict[str, Any] | None = None) -> bool:
        """Declare the exchange ``name`` unless it exists; whether it was created.

        Args:
          arguments: ``alternate-exchange`` (where what it routes nowhere goes),
            or labels; one another broker acts on and qflow does not is refused.

        Raises:
          CommandError: INVALID_ARGUMENT (a bad name, type or argument), NOT_FOUND
            (``passive``, no such exchange), NOT_ALLOWED (it exists with another
            type, or the name starts with ``amq.``), or the store's refusal.
        """
        arguments = arguments or {}
        refuse_unsupported(f"exchange.declare {name!r}", "exchange", arguments)
        try:
            check_exchange_arguments(arguments)
        except ValueError as exc:
            raise CommandError(P.INVALID_ARGUMENT, f"exchange.declare {name!r}: {exc}") from None
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
        self.config_hooks.declare_exchange(name, type_, durable, arguments)
        self.exchanges[name] = new_exchange(name, type_, durable, arguments)
        return True

    def delete_exchange(self, name: str, if_unused: bool = False) -> None:
        """Delete the exchange ``name`` and its bindings.

        Raises:
          CommandError: NOT_FOUND, NOT_ALLOWED (a built-in exchange),
            PRECONDITION_FAILED (``if_unused`` and it has bindings), or the
            store's refusal; nothing is deleted then.
        """
        ex = self.exchanges.get(name)
        if ex is None:
            raise CommandError(P.NOT_FOUND, f"exchange.delete: exchange {name!r} not found")
        if name == "" or name.startswith("amq."):
            raise CommandError(P.NOT_ALLOWED, f"exchange.delete: {name!r} is a built-in exchange")
        if if_unused and ex.binding_count:
            raise CommandError(P.PRECONDITION_FAILED, f"exchange.delete: exchange {name!r} has bindings")
        self.config_hooks.delete_exchange(ex)
        for _key, q in ex.bindings():
            q.binding_count -= 1
        del self.exchanges[name]

    def bind(self, exchange: str, queue: str, key: str, unbind: bool = False, by: BrokerSession | None = None) -> bool:
        """Bind ``queue`` to ``exchange`` with ``key`` (or remove that binding,
        if ``unbind``) at the request of session ``by``; whether anything changed.

        Raises:
          CommandError: NOT_FOUND (no such exchange or queue), NOT_ALLOWED (the
            default exchange), RESOURCE_LOCKED, or the store's refusal.
        """
        command = "exchange.unbind" if unbind else "exchange.bind"
        ex = self.exchanges.get(exchange)
        if ex is None:
            raise CommandError(P.NOT_FOUND, f"{command}: exchange {exchange!r} not found")
        if exchange == "":
            raise CommandError(P.NOT_ALLOWED, f"{command}: the default exchange's bindings are fixed")
        q = self.queue(command, queue)
        self.check_owner(q, command, by)
        exists = ex.has_binding(q, key)
        if unbind:
            if exists:
                self.config_hooks.unbind(ex, q, key)
                ex.unbind(q, key)
                q.binding_count -= 1
        elif not exists:
            self.config_hooks.bind(ex, q, key)
            ex.bind(q, key)
            q.binding_count += 1
        return exists if unbind else not exists

    def bindings(self) -> list[dict[str, str]]:
        """Every binding but the default exchange's, as ``{"exchange", "queue", "key"}``."""
        return [{"exchange": ex.name, "queue": q.name, "key": key}
                for ex in self.exchanges.values() if ex.name for key, q in ex.bindings()]

    def subscribe(self, ssn: BrokerSession, queue: str, destination: str, accept_mode: int, acquire_mode: int,
                  start_sequence: int = 0) -> Consumer:
        """A new consumer of ``queue`` on ``ssn``, delivering to ``destination``.

        Args:
          ssn: the session it delivers on.
          queue: the queue's name.
          destination: its name on the session (a delivery names it).
          accept_mode: P.ACCEPT_EXPLICIT (a delivery waits for its accept) or
            P.ACCEPT_NONE (dequeued as it is delivered).
          acquire_mode: P.ACQUIRE_PRE_ACQUIRED (each message to one consumer)
            or P.ACQUIRE_NOT_ACQUIRED (a browser: copies, from
            ``start_sequence`` on).
          start_sequence: a browser's first sequence number.

        Raises:
          CommandError: no such queue, a mode or destination not allowed, the
            destination in use, or the queue exclusive to another session.
        """
        q = self.queue("message.subscribe", queue)
        if accept_mode not in (P.ACCEPT_EXPLICIT, P.ACCEPT_NONE):
            raise CommandError(P.INVALID_ARGUMENT, f"message.subscribe: accept_mode must be 0 or 1, not {accept_mode}")
        if acquire_mode not in (P.ACQUIRE_PRE_ACQUIRED, P.ACQUIRE_NOT_ACQUIRED):
            raise CommandError(P.INVALID_ARGUMENT,
                               f"message.subscribe: acquire_mode must be 0 (acquire) or 1 (browse), not {acquire_mode}")
        if start_sequence < 0:
            raise CommandError(P.INVALID_ARGUMENT, "message.subscribe: start_sequence must be >= 0")
        if len(destination.encode()) > MAX_DESTINATION:  # every delivery frame carries it: it must leave room
            raise CommandError(P.INVALID_ARGUMENT, f"message.subscribe: destination must be at most {MAX_DESTINATION} "
                               f"bytes, got {len(destination.encode())}")
        if destination in ssn.consumers:
            raise CommandError(P.NOT_ALLOWED, f"message.subscribe: destination {destination!r} is already in use")
        if len(ssn.consumers) >= MAX_CONSUMERS:
            raise CommandError(P.RESOURCE_LIMIT_EXCEEDED,
                               f"message.subscribe: this session holds {len(ssn.consumers)} subscriptions, the most "
                               f"one session may hold; cancel some, or use another session")
        self.check_owner(q, "message.subscribe", ssn)
        c = Consumer(ssn, destination, q, accept_mode, acquire_mode)
        ssn.consumers[destination] = c
        if acquire_mode == P.ACQUIRE_NOT_ACQUIRED:
            c.cursor = start_sequence
            q.browsers.append(c)
        else:
            q.consumers.append(c)
            q.had_consumer = True
        return c

    def remove_consumer(self, c: Consumer) -> None:
        """End the subscription ``c``; an auto-delete queue whose last consumer it was is deleted."""
        q = c.queue
        c.session.consumers.pop(c.destination, None)
        if c in q.consumers:
            q.consumers.remove(c)
        if c in q.browsers:
            q.browsers.remove(c)
        if q.auto_delete and q.had_consumer and not q.consumers and not q.deleted:
            self.delete_queue_now(q)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Unread:
    """The output of the broker's own session: what it is told (its transfers' completions) is read by nobody."""

    def completed(self, report: list[int]) -> None:
        pass

    def flow_notice(self, name: str, held: bool, holder: bool = False) -> None:
        pass

    def exception(self, command_id: int, code: int, text: str) -> None:
        pass

    def result(self, command_id: int, value: Any) -> None:
        pass

    def wake(self) -> None:
        pass

    def room(self) -> int:
        return 0

    def deliveries(self, destination: str) -> Any:
        raise LookupError("the broker's own session has no consumers")


def _carry(rule: tuple[Holder, Callable[[Queue], bool], Callable[[Queue], None] | None], q: Queue) -> None:
    """Apply one :meth:`Broker.carry` rule to queue ``q``."""
    holder, matches, attached = rule
    if matches(q):
        q.add_holder(holder)
        if attached is not None:
            attached(q)
