"""One AMQP 1.0 connection of qflowd, sans I/O: its bytes through the 1.0
connection core (qflow.protocol.amqp.connection) into the broker. No trio:
qflow.server.amqp_connection drives it.

The broker model is the one qflow connections use. A link a peer sends on is
a broker session of its own (its transfers are that session's commands, so
their completion, which the broker decides, is the link's to settle); the
links a peer receives on in one 1.0 session share one broker session (its
deliveries, numbered per session, are the 1.0 session's). What the broker
tells them goes out through the 1.0 session outputs
(qflow.protocol.amqp.session_output).

Producer flow control uses both of 1.0's levers, per link, with the broker's
holders deciding:

* credit: a sending link gets a window of credit (``credit_window``, 500 by
  default, as qpidd's fixed credit), topped up as its transfers complete,
  and none while any holder holds one of its transfers (a stopped queue, the
  memory alarm, the store's quota). A link that attaches to a queue whose
  flow is stopped gets one credit, so that its first transfer is held and
  the link waits with the others;
* settlement: an unsettled transfer is settled (``accepted``) only once its
  completion is released, exactly as a qflow transfer completes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.broker.acl import queue_request
from qflow.broker.exchange import topic_matches
from qflow.broker.queue import Consumer
from qflow.protocol import CommandError, sasl
from qflow.protocol.amqp import events as ev
from qflow.protocol.amqp.codec import DecodeError
from qflow.protocol.amqp.connection import Connection
from qflow.protocol.amqp.entries import EntryWriter, delivered_count, stored_properties, subject
from qflow.protocol.amqp.frames import ACCEPTED_STATE, RELEASED_STATE
from qflow.protocol.amqp.performatives import (
    RECEIVER,
    SASL_AUTH,
    SASL_OK,
    SENDER,
    Accepted,
    Modified,
    Rejected,
    Released,
    Source,
)
from qflow.protocol.amqp.session_output import (
    OutputRoom,
    ReceivingSessionOutput,
    SendingLinkOutput,
    condition_of,
)
from qflow.protocol.amqp.transfer_runs import ROW, TransferRun
from qflow.protocol.entries import encode_tail, seq_of
from qflow.protocol.names import check_name, printable

log = logging.getLogger("qflow.server")

DEFAULT_CREDIT_WINDOW = 500  # qpidd's fixed link credit (Incoming.cpp)
SETTLED = 1  # snd-settle-mode settled: the peer's deliveries come, or want to come, pre-settled
TEMPORARY_PREFIX = "amqp.dynamic."


def _nothing(*args: Any) -> None:
    pass


class SendingLink:
    """A link a peer sends on: its target, and the broker session of its transfers."""

    __slots__ = ("session", "output", "exchange", "queue", "prefix")

    def __init__(self, session: BrokerSession, output: SendingLinkOutput, exchange: str, queue: str) -> None:
        self.session = session
        self.output = output
        self.exchange = exchange  # "" when the target is a queue
        self.queue = queue  # the routing key when the target is a queue
        self.prefix = msgpack.packb(exchange) + msgpack.packb(queue)  # what every entry of a queue's run starts with


class ReceivingLink:
    """A link a peer receives on: its consumer, and whether it drains."""

    __slots__ = ("consumer", "draining", "temporary")

    def __init__(self, consumer: Consumer, temporary: str | None) -> None:
        self.consumer = consumer
        self.draining = False
        self.temporary = temporary  # the dynamic queue made for it, deleted with it


class AmqpSession:
    """One 1.0 session: its links, and the broker session its receiving links share."""

    __slots__ = ("channel", "sending", "receiving", "broker_session", "output")

    def __init__(self, channel: int) -> None:
        self.channel = channel
        self.sending: dict[int, SendingLink] = {}
        self.receiving: dict[int, ReceivingLink] = {}
        self.broker_session: BrokerSession | None = None
        self.output: ReceivingSessionOutput | None = None


class AmqpPump:
    """The broker side of one AMQP 1.0 connection, fed bytes.

    Args:
      broker: the broker.
      peer: the client's address, for the log and the views.
      max_frame_size: the largest frame taken (and offered).
      users: authenticate clients against them (None: authentication off,
        ANONYMOUS offered, PLAIN believed).
      secret: the broker's, for unknown users' decoy verifiers.
      peer_identity: the CN of a verified TLS client certificate (EXTERNAL).
      credit_window: a sending link's credit window.
      idle_timeout: seconds of silence after which the peer is closed (0: never).
      output_limit: bytes of deliveries written and not yet sent, past which
        the broker delivers no more to this connection.
      wake: called when there is something to send.
      admit: the per-user connection limit's check (None: no limit).
      queue_patterns: a link to an unknown address matching one of these
        (topic-exchange wildcards: ``*`` one word, ``#`` any number, words
        separated by dots) creates a queue of that name, as qpidd's option.
    """

    def __init__(self, broker: Broker, peer: str = "", *, max_frame_size: int = 65536, users: sasl.Users | None = None,
                 secret: bytes = b"", peer_identity: str | None = None, credit_window: int = DEFAULT_CREDIT_WINDOW,
                 idle_timeout: float = 0.0, output_limit: int = 1 << 20, wake: Callable[[], None] = _nothing,
                 admit: Callable[[str], str | None] | None = None, queue_patterns: Sequence[str] = ()) -> None:
        self.broker = broker
        self.queue_patterns = [p.split(".") for p in queue_patterns]
        self.peer = peer
        self.users = users
        self.secret = secret
        self.peer_identity = peer_identity
        self.credit_window = credit_window
        self.wake = wake
        self.admit = admit
        mechanisms = [sasl.SCRAM_SHA_256, sasl.PLAIN]
        if users is None:
            mechanisms.insert(0, sasl.ANONYMOUS)
        if peer_identity:
            mechanisms.insert(0, sasl.EXTERNAL)
        self.core = Connection("qflowd", max_frame_size=max_frame_size, idle_time_out=int(idle_timeout * 1000),
                               sasl_mechanisms=tuple(mechanisms), require_sasl=users is not None)
        self.room = OutputRoom(output_limit)
        self.user = "anonymous" if users is None else ""
        self.name = ""  # the peer's container id
        self.opened = False
        self.closed_reason: str | None = None
        self.sessions: dict[int, AmqpSession] = {}
        self._scram: sasl.ScramServer | None = None
        self._writer = EntryWriter()
        self._refused_runs = False  # the last store_run was refused by the broker, not cut short by the writer

    # -- input ------------------------------------------------------------------------------------------------
    def receive(self, data: bytes) -> None:
        """One read's bytes (``b""``: the peer's stream ended)."""
        if not data:
            self.closed_reason = self.closed_reason or "connection lost"
            self.close_sessions()
            return
        self._handle(self.core.receive_data(data))
        self.broker.flush()
        self._after_flush()
        self.wake()

    def _handle(self, events: list[Any]) -> None:
        for event in events:
            kind = type(event)
            if kind is TransferRun:
                self._transfers(event)
            elif kind is ev.DispositionReceived:
                self._disposition(event)
            elif kind is ev.FlowReceived:
                self._flow(event)
            elif kind is ev.LinkAttached:
                self._attach(event)
            elif kind is ev.LinkDetached:
                self._detached(event.channel, event.handle)
            elif kind is ev.SessionBegun:
                if event.channel in self.sessions:  # the core refuses a channel in use before this
                    continue
                self.sessions[event.channel] = AmqpSession(event.channel)
                self.core.begin(event.channel)
            elif kind is ev.SessionEnded:
                self._ended(event.channel)
            elif kind is ev.ConnectionOpened:
                self.name = event.container_id
                self.opened = True
                log.info("connection %s opened: name '%s', user '%s' (AMQP 1.0)", self.peer, printable(self.name),
                         printable(self.user))
                self.core.open(properties={"product": "qflowd"})
            elif kind is ev.SaslInitReceived:
                self._sasl_init(event)
            elif kind is ev.SaslResponseReceived:
                self._sasl_response(event)
            elif kind is ev.ConnectionClosed:
                error = event.error
                self.closed_reason = ("closed by the client" if event.by_peer else
                                      f"{error.condition}: {error.description}" if error is not None else "closed")
                self.close_sessions()

    # -- SASL ---------------------------------------------------------------------------------------------------
    def _sasl_init(self, event: ev.SaslInitReceived) -> None:
        mechanism, response = event.mechanism, event.initial_response or b""
        try:
            if mechanism == sasl.ANONYMOUS and self.users is None:
                self._authenticated("anonymous")
            elif mechanism == sasl.EXTERNAL and self.peer_identity:
                self._authenticated(sasl.external_user(self.peer_identity, response))
            elif mechanism == sasl.PLAIN:
                user, password = sasl.parse_plain(response)
                if self.users is not None:
                    verifier = self.users.verifier(user)
                    decoy = verifier or sasl.decoy_verifier(user, self.secret, self.users.usual_iterations)
                    if not sasl.check_password(decoy, password) or verifier is None:
                        self._refuse_sasl(user, "unknown user" if verifier is None else "wrong password")
                        return
                self._authenticated(user)
            elif mechanism == sasl.SCRAM_SHA_256:
                scram = sasl.ScramServer(self.users or _NoUsers(), self.secret)
                challenge = scram.first(response)
                if self.users is None:
                    self._authenticated(scram.user)
                    return
                self._scram = scram
                self.core.sasl_challenge(challenge)
            else:
                self._refuse_sasl("", f"mechanism {mechanism!r:.40} not offered")
        except sasl.AuthError as exc:
            self._refuse_sasl(self._scram.user if self._scram else "", exc.detail or exc.text)

    def _sasl_response(self, event: ev.SaslResponseReceived) -> None:
        scram, self._scram = self._scram, None
        if scram is None:
            self._refuse_sasl("", "a SASL response with no exchange under way")
            return
        try:
            server_final = scram.final(event.response)
        except sasl.AuthError as exc:
            self._refuse_sasl(scram.user, exc.detail or exc.text)
            return
        self._authenticated(scram.user, server_final)

    def _authenticated(self, user: str, additional: bytes | None = None) -> None:
        if self.admit is not None:
            reason = self.admit(user)
            if reason is not None:
                log.warning("connection %s (AMQP 1.0): %s", self.peer, reason)
                self.core.sasl_outcome(SASL_AUTH)
                self.closed_reason = reason
                return
        self.user = user
        self.core.sasl_outcome(SASL_OK, additional)
        self._handle(self.core.receive_data(b""))  # the client may have sent its AMQP header already

    def _refuse_sasl(self, user: str, detail: str) -> None:
        log.warning("connection %s (AMQP 1.0): authentication failed for user '%s' (%s)", self.peer, user, detail)
        self.core.sasl_outcome(SASL_AUTH)
        self.closed_reason = "authentication failed"

    # -- links ----------------------------------------------------------------------------------------------------
    def _attach(self, event: ev.LinkAttached) -> None:
        session = self.sessions.get(event.channel)
        if session is None:
            return
        if event.unsupported:
            self.core.refuse_link(event.channel, event.handle, "amqp:not-implemented",
                                  f"qflowd does not implement {', '.join(event.unsupported)} on links")
            return
        try:
            if event.peer_is_sender:
                self._attach_sending(session, event)
            else:
                self._attach_receiving(session, event)
        except CommandError as exc:
            self.core.refuse_link(event.channel, event.handle, condition_of(exc.code), exc.text)

    def _attach_sending(self, session: AmqpSession, event: ev.LinkAttached) -> None:
        address = event.address
        if not address:
            raise CommandError(P.NOT_IMPLEMENTED, "a link with no target address (the anonymous relay) is not "
                                                  "supported: name a queue or an exchange")
        broker = self.broker
        self._on_demand(address)
        if address in broker.queues:
            exchange, queue = "", address
            broker.queues[address].amqp = True
            broker.authorize(self.user, "publish", "exchange", {"name": "amq.default", "routingkey": address})
        elif address in broker.exchanges:
            exchange, queue = address, ""
        else:
            raise CommandError(P.NOT_FOUND, f"no queue or exchange named {address!r}")
        output = SendingLinkOutput(self.core, event.channel, event.handle, self.credit_window, int, self.wake)
        ssn = broker.open_session(event.channel, f"{self.name}/{event.name}", output, self.user,  # type: ignore[arg-type]
                                  self.peer)
        output.incomplete = ssn.commands.incomplete_count
        ssn.capacity = self.credit_window  # its worst case, as a qflow sender's capacity
        session.sending[event.handle] = SendingLink(ssn, output, exchange, queue)
        self.core.attach(event.channel, event.handle, source=event.source, target=event.target,
                         rcv_settle_mode=0)
        credit = self.credit_window
        if queue and broker.completion.stats(broker.queues[queue])[2]:  # stopped: one, to be held, then none
            credit = 1
        self.core.flow(event.channel, event.handle, credit)

    def _attach_receiving(self, session: AmqpSession, event: ev.LinkAttached) -> None:
        broker = self.broker
        temporary = None
        address = event.address
        if event.dynamic:
            address = temporary = f"{TEMPORARY_PREFIX}{uuid.uuid4()}"
            broker.declare_queue(address, exclusive=False, auto_delete=False)
        elif address:
            self._on_demand(address)
        if not address or address not in broker.queues:
            raise CommandError(P.NOT_FOUND, f"no queue named {address!r}")
        broker.authorize(self.user, "consume", "queue", {"name": address})
        ssn = session.broker_session
        if ssn is None:
            output = ReceivingSessionOutput(self.core, event.channel, self.room, self.wake)
            ssn = broker.open_session(event.channel, f"{self.name}/{event.channel}", output,  # type: ignore[arg-type]
                                      self.user, self.peer)
            session.broker_session, session.output = ssn, output
        destination = str(event.handle)
        presettled = event.snd_settle_mode == SETTLED
        session.output.presettled[destination] = presettled
        session.output.failures[destination] = broker.queues[address].delivery_failures
        browse = event.distribution_mode == "copy"
        consumer = broker.subscribe(ssn, address, destination, P.ACCEPT_NONE if presettled else P.ACCEPT_EXPLICIT,
                                    P.ACQUIRE_NOT_ACQUIRED if browse else P.ACQUIRE_PRE_ACQUIRED)
        consumer.byte_credit = -1  # 1.0 credit counts messages only
        consumer.maps_amqp = False  # its output maps qflow messages to 1.0 itself
        session.receiving[event.handle] = ReceivingLink(consumer, temporary)
        source = event.source if event.source is not None else Source()
        if temporary is not None:
            source.address = temporary
        self.core.attach(event.channel, event.handle, source=source, target=event.target,
                         snd_settle_mode=SETTLED if presettled else 0)

    def _on_demand(self, address: str) -> None:
        """An address no queue or exchange has, matching one of the queue
        patterns, becomes a queue (as qpidd's --queue-patterns), if the
        user may create it."""
        broker = self.broker
        if not self.queue_patterns or address in broker.queues or address in broker.exchanges:
            return
        words = address.split(".")
        if not any(topic_matches(pattern, words) for pattern in self.queue_patterns):
            return
        check_name("attach", "address", address)
        broker.authorize(self.user, "create", "queue", queue_request(address, {}, durable=False, autodelete=False,
                                                                    exclusive=False))
        broker.declare_queue(address)
        log.info("connection %s (AMQP 1.0): queue '%s' created on demand (--queue-patterns)", self.peer,
                 printable(address))

    def _detached(self, channel: int, handle: int) -> None:
        session = self.sessions.get(channel)
        if session is None:
            return
        link = session.sending.pop(handle, None)
        if link is not None:
            link.output.closed = True
            self.broker.close_session(link.session)
            return
        receiving = session.receiving.pop(handle, None)
        if receiving is not None:
            self._end_consumer(session, receiving)

    def _end_consumer(self, session: AmqpSession, link: ReceivingLink) -> None:
        broker = self.broker
        c = link.consumer
        broker.remove_consumer(c)
        ssn = session.broker_session
        # Its deliveries awaiting an outcome go back to their queue.
        queues, entries = [], []
        for did in session.output.forget(c.destination):
            qs, es = ssn.take_unacked(did, did)
            queues += qs
            entries += es
        broker.put_back(queues, entries)
        if link.temporary is not None and link.temporary in broker.queues:
            broker.delete_queue(link.temporary)

    def _ended(self, channel: int) -> None:
        session = self.sessions.pop(channel, None)
        if session is None:
            return
        for link in session.sending.values():
            link.output.closed = True
            self.broker.close_session(link.session)
        for link in session.receiving.values():
            if link.temporary is not None and link.temporary in self.broker.queues:
                self.broker.remove_consumer(link.consumer)
                self.broker.delete_queue(link.temporary)
        if session.broker_session is not None:
            self.broker.close_session(session.broker_session)

    def close_sessions(self) -> None:
        """The connection is over: every session closed, deliveries awaiting an outcome put back."""
        for channel in list(self.sessions):
            self._ended(channel)
        self.broker.flush()

    # -- transfers ----------------------------------------------------------------------------------------------
    def _transfers(self, run: TransferRun) -> None:
        session = self.sessions.get(run.channel)
        link = session.sending.get(run.handle) if session is not None else None
        if link is None:
            return
        total = len(run.rows) // ROW
        if link.exchange:
            self._transfer_each(link, run, 0, total)
            return
        i = 0
        while i < total:
            n = self._store_run(link, run, i, total - i)
            if n:
                i += n
            elif self._refused_runs:  # the queue takes no run now: each of the rest the usual way
                self._transfer_each(link, run, i, total)
                return
            else:  # one the entry writer does not take: the decoder does
                self._transfer_each(link, run, i, i + 1)
                i += 1

    def _store_run(self, link: SendingLink, run: TransferRun, first: int, count: int) -> int:
        """Deliveries ``first``... of ``run`` stored in one go by the entry writer
        (the usual case: plain transfers to a queue); returns how many (0: none)."""
        writer, prefix = self._writer, link.prefix
        self._refused_runs = True

        def make(first_seq: int, n: int, max_bytes: int) -> tuple[list, Any, int]:
            self._refused_runs = False
            return writer.store(run, first, n, prefix, first_seq, max_bytes)

        ssn = link.session
        n = self.broker.store_run(ssn, link.queue, count, make)
        if not n:
            return 0
        rows = run.rows
        cid = ssn.commands.next_id - n
        settled = rows[ROW * first + 5:ROW * (first + n):ROW]
        if 1 not in settled:  # all unsettled: each waits for its transfer's completion
            link.output.unsettled.update(zip(range(cid, cid + n), rows[ROW * first:ROW * (first + n):ROW], strict=True))
        elif 0 in settled:
            received = link.output.received
            for j, s in enumerate(settled):
                if s != 1:
                    received(cid + j, rows[ROW * (first + j)])
        return n

    def _transfer_each(self, link: SendingLink, run: TransferRun, first: int, end: int) -> None:
        """Deliveries ``first`` to ``end`` - 1 of ``run``, one by one through :meth:`Broker.transfer`."""
        broker = self.broker
        ssn = link.session
        commands = ssn.commands
        output = link.output
        exchange, queue = link.exchange, link.queue
        blob, base, rows = run.blob, run.base, run.rows
        for i in range(ROW * first, ROW * end, ROW):
            start = rows[i + 3] - base
            payload = bytes(blob[start:start + rows[i + 4]])
            cid = commands.receive()
            if rows[i + 5] != 1:
                output.received(cid, rows[i])
            try:
                try:
                    properties = stored_properties(payload)
                    routing_key = subject(payload) if exchange else queue
                except DecodeError as exc:
                    raise CommandError(P.FRAMING_ERROR, f"the message cannot be read: {exc}") from None
                # The marker properties are the broker's own: qflow clients cannot send them (nor need they be
                # checked as a client's), so the transfer is handed the stored form with no properties to check.
                broker.transfer(ssn, cid, exchange, routing_key, None, payload,
                                encode_tail(exchange, routing_key, properties, payload))
                if exchange:  # its queues now hold 1.0 messages: a qflow consumer gets them mapped
                    for q in broker.route(exchange, routing_key):
                        q.amqp = True
            except CommandError as exc:
                broker.fail(ssn, cid, exc.code, exc.text)

    # -- deliveries ---------------------------------------------------------------------------------------------
    def _flow(self, event: ev.FlowReceived) -> None:
        if event.handle is None:
            return
        session = self.sessions.get(event.channel)
        link = session.receiving.get(event.handle) if session is not None else None
        if link is None:
            return
        c = link.consumer
        c.credit = max(0, min(event.credit, self.core.session_window(event.channel)))
        link.draining = event.drain
        c.queue.ready[c.queue] = None

    def _after_flush(self) -> None:
        """A draining link with credit left after the batch's deliveries has nothing more: drained."""
        for session in self.sessions.values():
            for handle, link in session.receiving.items():
                if link.draining:
                    link.draining = False
                    if link.consumer.credit > 0:
                        link.consumer.credit = 0
                        self.core.drained(session.channel, handle)

    def _disposition(self, event: ev.DispositionReceived) -> None:
        if event.role != RECEIVER:
            return  # the peer's outcomes of what it sent are not asked for (this side settles first)
        session = self.sessions.get(event.channel)
        if session is None or session.broker_session is None:
            return
        state = event.state
        if not isinstance(state, Accepted | Rejected | Released | Modified):
            if event.settled:  # settled with no outcome: as released (part 3.4: the sender decides)
                state = Released()
            else:
                return  # no outcome yet (received): they stay with the consumer
        ssn, broker = session.broker_session, self.broker
        queues, entries = [], []
        ids = session.output.take(event.first, event.last)
        i, n = 0, len(ids)
        while i < n:  # by runs of consecutive ids: one take each
            j = i
            while j + 1 < n and ids[j + 1] == ids[j] + 1:
                j += 1
            qs, es = ssn.take_unacked(ids[i], ids[j])
            queues += qs
            entries += es
            i = j + 1
        if isinstance(state, Accepted | Rejected):
            if isinstance(state, Accepted):
                broker.accept(queues, entries)
                settled_state = ACCEPTED_STATE
            else:  # a dead letter: to its queue's alternate exchange if it has one, else dropped
                by_queue: dict[Any, list[Any]] = {}
                for q, e in zip(queues, entries, strict=True):
                    by_queue.setdefault(q, []).append(e)
                for q, es in by_queue.items():
                    broker.dead_letter(q, es)
                settled_state = bytes(state.encode())
        elif isinstance(state, Modified) and state.delivery_failed:
            for q, e in zip(queues, entries, strict=True):  # one more failed delivery, counted beside it
                seq = seq_of(e)
                q.delivery_failures[seq] = delivered_count(e, q.delivery_failures.get(seq, 0)) + 1
            broker.put_back(queues, entries)
            settled_state = bytes(state.encode())
        else:
            broker.put_back(queues, entries)
            settled_state = RELEASED_STATE if isinstance(state, Released) else bytes(state.encode())
        if not event.settled and entries:
            self.core.disposition(event.channel, event.first, event.last, settled=True, state=settled_state,
                                  role=SENDER)

    # -- output --------------------------------------------------------------------------------------------------
    def data_to_send(self) -> bytes:
        """What to send now; the delivery bytes in it stop counting as queued."""
        data = self.core.data_to_send()
        self.room.sending += self.room.queued
        self.room.queued = 0
        return data

    def sent(self) -> None:
        """The glue sent what :meth:`data_to_send` returned."""
        self.room.sending = 0

    def shutdown(self) -> None:
        """The broker is stopping: close with amqp:connection:forced."""
        self.core.close("amqp:connection:forced", "broker shutting down")
        self.close_sessions()


class _NoUsers:
    """Authentication off: SCRAM's exchange is believed, as PLAIN is."""

    usual_iterations = sasl.DEFAULT_ITERATIONS

    def verifier(self, user: str) -> None:
        return None


__all__ = ["AmqpPump", "DEFAULT_CREDIT_WINDOW"]
