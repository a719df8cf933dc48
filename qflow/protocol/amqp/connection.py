"""The server side of an AMQP 1.0 connection, sans I/O (as h11 is for HTTP).

Feed it what the socket read (:meth:`Connection.receive_data`, which returns
the events in it, see :mod:`.events`); send what :meth:`Connection.data_to_send`
returns. Its methods answer the peer (``open``, ``begin``, ``attach``, ``flow``,
``transfer``, ``disposition``, ...). It keeps the protocol's own state right
on its own: header exchange, SASL framing, negotiated limits, session windows,
link credit and delivery counts, and it answers a peer's ``end``, ``detach``
and ``close`` itself.

What it decides alone: a bad protocol header is answered with the header of
the version this side speaks, then the connection is over; a peer that
breaks the protocol gets a close (or an end or detach, when the fault is a
session's or a link's) with the AMQP error condition and a text naming what
was wrong, and the matching event. What it leaves to its user: SASL
mechanisms (the events carry the client's messages), which sessions and
links to accept, credit, and every message's fate.

Bounds: a frame larger than this side's max frame size is a framing error;
the bytes of unfinished multi-frame deliveries count against
``max_unfinished_input`` (over it: amqp:resource-limit-exceeded); decoding is
bounded by :mod:`.codec`'s rules.

Transfers take a fast path: a transfer frame in the plain shape every client
sends is read by :func:`.frames.parse_transfer` without the general decoder.
"""

from __future__ import annotations

from typing import Any

from .codec import DecodeError, Decoder, Symbol
from .events import (
    ConnectionClosed,
    ConnectionOpened,
    DispositionReceived,
    FlowReceived,
    LinkAttached,
    LinkDetached,
    SaslInitReceived,
    SaslResponseReceived,
    SessionBegun,
    SessionEnded,
)
from .frames import (
    ABORTED,
    ACCEPTED_STATE,
    AMQP_HEADER,
    HEARTBEAT,
    MIN_MAX_FRAME_SIZE,
    MORE,
    SASL_HEADER,
    SETTLED,
    SETTLED_SET,
    TRANSFER_OVERHEAD,
    TYPE_AMQP,
    TYPE_SASL,
    disposition_frame,
    frame,
    frame_header,
    parse_transfer,
    transfer_frame,
)
from .performatives import (
    PERFORMATIVES,
    RECEIVER,
    SASL_FRAMES,
    SASL_OK,
    Attach,
    Begin,
    Close,
    Coordinator,
    Detach,
    Disposition,
    End,
    Error,
    FieldError,
    Flow,
    Open,
    SaslChallenge,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    SaslResponse,
    Source,
    Target,
    TransactionalState,
    Transfer,
    from_described,
)
from .transfer_runs import ROW, Scanner, TransferRun, single

DECODE_ERROR = "amqp:decode-error"
FRAMING_ERROR = "amqp:connection:framing-error"
NOT_ALLOWED = "amqp:not-allowed"
INVALID_FIELD = "amqp:invalid-field"
NOT_IMPLEMENTED = "amqp:not-implemented"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
FRAME_SIZE_TOO_SMALL = "amqp:frame-size-too-small"
INTERNAL_ERROR = "amqp:internal-error"
WINDOW_VIOLATION = "amqp:session:window-violation"
UNATTACHED_HANDLE = "amqp:session:unattached-handle"
HANDLE_IN_USE = "amqp:session:handle-in-use"
TRANSFER_LIMIT = "amqp:link:transfer-limit-exceeded"
DETACH_FORCED = "amqp:link:detach-forced"

_MASK = 0xFFFFFFFF
_HEADER, _SASL, _SASL_DONE, _OPEN, _OPENED, _CLOSED = range(6)


class ProtocolViolation(Exception):
    """The peer broke a rule; ``scope`` says what ends: "connection", "session" or "link"."""

    def __init__(self, condition: str, description: str, scope: str = "connection", channel: int = 0,
                 handle: int = 0) -> None:
        super().__init__(description)
        self.condition = condition
        self.description = description
        self.scope = scope
        self.channel = channel
        self.handle = handle


class _Link:
    __slots__ = ("handle", "name", "peer_is_sender", "credit", "delivery_count", "peer_delivery_count",
                 "peer_credit", "drain", "parts", "parts_size", "first", "answered", "closing")

    def __init__(self, handle: int, name: str, peer_is_sender: bool, delivery_count: int) -> None:
        self.handle = handle
        self.name = name
        self.peer_is_sender = peer_is_sender
        self.credit = 0  # a sending peer: credit granted and not used; a receiving peer: credit to send with
        self.delivery_count = delivery_count
        self.peer_delivery_count = delivery_count
        self.peer_credit = 0
        self.drain = False
        self.parts: list[bytes] | None = None  # an unfinished multi-frame delivery's payload so far
        self.parts_size = 0
        self.first: tuple[int, bytes | None, bool, int] | None = None  # its (delivery-id, tag, settled, format)
        self.answered = False
        self.closing = False  # this side sent its detach: the peer's frames for it are dropped until its own


class _Session:
    __slots__ = ("channel", "links", "next_incoming_id", "incoming_window", "window_size", "next_outgoing_id",
                 "peer_incoming_window", "peer_next_incoming_id", "handle_max", "answered", "closing")

    def __init__(self, channel: int, peer_next_outgoing_id: int, window: int) -> None:
        self.channel = channel
        self.links: dict[int, _Link] = {}
        self.next_incoming_id = peer_next_outgoing_id
        self.incoming_window = window
        self.window_size = window
        self.next_outgoing_id = 0
        self.peer_incoming_window = 0
        self.peer_next_incoming_id = 0
        self.handle_max = 0xFFFFFFFF
        self.answered = False
        self.closing = False  # this side sent its end: the peer's frames on it are dropped until its own


class Connection:
    """One AMQP 1.0 connection, the server's side.

    Args:
      container_id: this side's container id, sent in its open.
      max_frame_size: the largest frame this side accepts (and offers), at least 512.
      channel_max: the highest channel number this side accepts.
      idle_time_out: milliseconds of silence after which this side closes
        the connection (sent in its open, so the peer heartbeats); 0: none.
        The timer is the user's: see :attr:`frames_received`.
      sasl_mechanisms: the mechanisms offered to a client that opens with the
        SASL header; None: SASL is not offered.
      require_sasl: refuse a client that skips SASL (answer its AMQP header
        with the SASL header, then close).
      max_unfinished_input: bytes that the unfinished multi-frame deliveries
        of the connection may hold together.
      incoming_window: the session incoming window offered (transfer frames).
      native_scan: scan runs of transfers in C when the extension is built
        (False: its Python twin; for tests).
    """

    def __init__(self, container_id: str = "qflowd", *, max_frame_size: int = 65536, channel_max: int = 255,
                 idle_time_out: int = 0, sasl_mechanisms: tuple[str, ...] | None = None,
                 require_sasl: bool = False, max_unfinished_input: int = 16 << 20,
                 incoming_window: int = 1 << 20, native_scan: bool = True) -> None:
        if max_frame_size < MIN_MAX_FRAME_SIZE:
            raise ValueError(f"max_frame_size {max_frame_size} is below the spec's floor of 512")
        self.container_id = container_id
        self.max_frame_size = max_frame_size
        self.channel_max = channel_max
        self.idle_time_out = idle_time_out
        self.sasl_mechanisms = sasl_mechanisms
        self.require_sasl = require_sasl
        self.max_unfinished_input = max_unfinished_input
        self.incoming_window = incoming_window
        self.peer_max_frame_size = MIN_MAX_FRAME_SIZE
        self.peer_channel_max = 0
        self.peer_idle_time_out = 0  # ms; this side must send a frame at least this often (heartbeat at half)
        self.frames_received = 0  # grows with every frame (heartbeats too): the idle timer's clock
        self.unfinished_input = 0  # bytes held by unfinished multi-frame deliveries
        self.sasl_done = False
        self.state = _HEADER
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._sessions: dict[int, _Session] = {}
        self._open_sent = False
        self._events: list[Any] = []
        self._scanner = Scanner(native_scan)

    # ---- input ---------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Any]:
        """Feed bytes read from the socket; returns the events they complete.

        Never raises for what the peer sent: a fault becomes a close (or end,
        detach) frame to send and an event."""
        if self.state == _CLOSED:
            return []
        buf = self._buf
        buf += data
        events: list[Any] = []
        self._events = events
        pos = 0
        try:
            if self.state == _HEADER or self.state == _SASL_DONE:
                pos = self._header(buf)
                if pos == 0:
                    return events
            pos = self._frames(buf, pos, events)
        except ProtocolViolation as v:
            self._violation(v, events)
        finally:
            if self.state == _CLOSED:
                buf.clear()
            elif pos:
                del buf[:pos]
        return events

    def _header(self, buf: bytearray) -> int:
        got = bytes(buf[:8])
        if not (AMQP_HEADER.startswith(got) or SASL_HEADER.startswith(got)):
            self._refuse_header(f"unsupported protocol header {got!r}")
            return 0
        if len(got) < 8:
            return 0
        if got == SASL_HEADER:
            if self.state != _HEADER or not self.sasl_mechanisms:
                self._refuse_header("SASL is not offered here" if not self.sasl_mechanisms
                                    else "SASL header after SASL")
                return 0
            self._out.append(SASL_HEADER)
            self._out.append(frame(0, SaslMechanisms(sasl_server_mechanisms=tuple(self.sasl_mechanisms)),
                                   frame_type=TYPE_SASL))
            self.state = _SASL
            return 8
        if self.require_sasl and not self.sasl_done:
            self._refuse_header("SASL authentication is required", SASL_HEADER)
            return 0
        self._out.append(AMQP_HEADER)
        self.state = _OPEN
        return 8

    def _refuse_header(self, why: str, answer: bytes | None = None) -> None:
        if answer is None:
            answer = SASL_HEADER if self.require_sasl and not self.sasl_done else AMQP_HEADER
        self._out.append(answer)
        self.state = _CLOSED
        self._events.append(ConnectionClosed(Error(condition=FRAMING_ERROR, description=why), False))

    def _frames(self, buf: bytearray, pos: int, events: list[Any]) -> int:
        n = len(buf)
        max_frame = self.max_frame_size
        sessions = self._sessions
        while n - pos >= 8:
            if self.state == _SASL and buf[pos:pos + 4] == b"AMQP":
                break  # pipelined after the SASL exchange: read once sasl_outcome is given
            size, doff, ftype, channel = frame_header(buf, pos)
            if size > max_frame:
                raise ProtocolViolation(FRAMING_ERROR, f"frame of {size} bytes exceeds max-frame-size {max_frame}")
            if size < 8 or doff < 2 or doff * 4 > size:
                raise ProtocolViolation(FRAMING_ERROR, f"malformed frame header: size {size}, doff {doff}")
            end = pos + size
            if end > n:
                break
            self.frames_received += 1
            body = pos + doff * 4
            if body == end:  # heartbeat
                pos = end
                continue
            try:
                if end - body > 3 and buf[body + 2] == 0x14 and buf[body] == 0 and buf[body + 1] == 0x53 \
                        and self.state == _OPENED and ftype == TYPE_AMQP:
                    run_end = self._run(buf, pos, events)
                    if run_end:
                        pos = run_end
                        continue
                    fields = parse_transfer(buf, body + 3, end)
                    session = sessions.get(channel)
                    if fields is not None and session is not None:
                        tag_off, tag_len = fields[2], fields[3]
                        self._transfer(session, fields[0], fields[1], bytes(buf[tag_off:tag_off + tag_len])
                                       if tag_len >= 0 else None, fields[4], fields[5], bytes(buf[fields[6]:end]),
                                       events)
                        pos = end
                        continue
                self._frame(ftype, channel, buf, body, end, events)
            except ProtocolViolation as v:
                if v.scope == "connection":
                    raise
                self._violation(v, events)  # the session or link ends; the connection reads on
            if self.state == _CLOSED:
                return n
            pos = end
            if self.state == _SASL_DONE:  # the AMQP header follows the SASL outcome
                return pos
        return pos

    def _frame(self, ftype: int, channel: int, buf: bytearray, body: int, end: int, events: list[Any]) -> None:
        decoder = Decoder(buf, body, end)
        try:
            value = decoder.value()
        except DecodeError as e:
            raise ProtocolViolation(DECODE_ERROR, f"frame body: {e}") from None
        if self.state == _SASL:
            if ftype != TYPE_SASL:
                raise ProtocolViolation(FRAMING_ERROR, "an AMQP frame during SASL")
            try:
                sasl = from_described(value, SASL_FRAMES)
            except FieldError as e:
                raise ProtocolViolation(e.condition, str(e)) from None
            if isinstance(sasl, SaslInit):
                events.append(SaslInitReceived(sasl.mechanism, sasl.initial_response, sasl.hostname))
            elif isinstance(sasl, SaslResponse):
                events.append(SaslResponseReceived(sasl.response))
            else:
                raise ProtocolViolation(NOT_ALLOWED, f"a client does not send {sasl.NAME}")
            return
        if ftype != TYPE_AMQP:
            raise ProtocolViolation(FRAMING_ERROR, f"frame type {ftype} outside SASL")
        try:
            perf = from_described(value, PERFORMATIVES)
        except FieldError as e:
            raise ProtocolViolation(e.condition, str(e)) from None
        payload_start = decoder.pos
        if self.state == _OPEN:
            if not isinstance(perf, Open):
                raise ProtocolViolation(NOT_ALLOWED, f"{perf.NAME} before open")
            self._on_open(perf, events)
            return
        closing = self._sessions.get(channel)
        if closing is not None and closing.closing and not isinstance(perf, End):
            return  # in flight before the peer saw this side's end
        if isinstance(perf, Transfer):
            session = self._session(channel, "transfer")
            self._transfer_general(session, perf, buf, payload_start, end, events)
            return
        if payload_start != end:
            raise ProtocolViolation(DECODE_ERROR, f"{end - payload_start} bytes after a {perf.NAME}")
        handler = self._HANDLERS.get(type(perf))
        if handler is None:
            raise ProtocolViolation(NOT_ALLOWED, f"unexpected {perf.NAME}")
        handler(self, channel, perf, events)

    def _session(self, channel: int, what: str) -> _Session:
        session = self._sessions.get(channel)
        if session is None:
            raise ProtocolViolation(NOT_ALLOWED, f"{what} on channel {channel}, which has no session")
        return session

    def _link(self, session: _Session, handle: int, what: str) -> _Link:
        link = session.links.get(handle)
        if link is None:
            raise ProtocolViolation(UNATTACHED_HANDLE, f"{what} on handle {handle}, which is not attached",
                                    "session", session.channel)
        return link

    def _on_open(self, perf: Any, events: list[Any]) -> None:
        if perf.max_frame_size < MIN_MAX_FRAME_SIZE:
            raise ProtocolViolation(FRAME_SIZE_TOO_SMALL,
                                    f"max-frame-size {perf.max_frame_size} is below the minimum of 512")
        self.peer_max_frame_size = perf.max_frame_size
        self.peer_channel_max = perf.channel_max
        self.peer_idle_time_out = perf.idle_time_out or 0
        self.state = _OPENED
        events.append(ConnectionOpened(perf.container_id, perf.hostname, perf.max_frame_size, perf.channel_max,
                                       perf.idle_time_out, perf.properties, perf.offered_capabilities,
                                       perf.desired_capabilities))

    def _on_begin(self, channel: int, perf: Any, events: list[Any]) -> None:
        if perf.remote_channel is not None:
            raise ProtocolViolation(NOT_IMPLEMENTED, "a session begun by this side is never pending")
        if channel > self.channel_max:
            raise ProtocolViolation(NOT_ALLOWED, f"channel {channel} exceeds channel-max {self.channel_max}")
        if channel in self._sessions:
            raise ProtocolViolation(NOT_ALLOWED, f"channel {channel} already has a session")
        session = _Session(channel, perf.next_outgoing_id, self.incoming_window)
        session.peer_incoming_window = perf.incoming_window
        session.handle_max = perf.handle_max
        self._sessions[channel] = session
        events.append(SessionBegun(channel, perf.next_outgoing_id, perf.incoming_window, perf.outgoing_window,
                                   perf.handle_max))

    def _on_end(self, channel: int, perf: Any, events: list[Any]) -> None:
        session = self._session(channel, "end")
        self._drop_session(session)
        if session.closing:
            return  # the answer to this side's end
        self._out.append(frame(channel, End()))
        events.append(SessionEnded(channel, perf.error, True))

    def _drop_session(self, session: _Session) -> None:
        for link in session.links.values():
            self._free_parts(link)
        del self._sessions[session.channel]

    def _free_parts(self, link: _Link) -> None:
        self.unfinished_input -= link.parts_size
        link.parts, link.parts_size, link.first = None, 0, None

    def _on_attach(self, channel: int, perf: Any, events: list[Any]) -> None:
        session = self._session(channel, "attach")
        handle = perf.handle
        if handle in session.links:
            raise ProtocolViolation(HANDLE_IN_USE, f"handle {handle} is already attached", "session", channel)
        if handle > session.handle_max:
            raise ProtocolViolation(NOT_ALLOWED, f"handle {handle} exceeds handle-max", "session", channel)
        peer_is_sender = perf.role is not RECEIVER
        source, target = perf.source, perf.target
        unsupported = []
        if isinstance(target, Coordinator):
            unsupported.append("transactions (a coordinator target)")
        terminus = target if peer_is_sender else source
        if not peer_is_sender and isinstance(source, Source) and source.filter:
            unsupported.append("filters (" + ", ".join(str(k) for k in source.filter) + ")")
        if perf.unsettled:
            unsupported.append("link resume (an unsettled map)")
        if perf.incomplete_unsettled:
            unsupported.append("link resume (incomplete-unsettled)")
        if peer_is_sender and perf.initial_delivery_count is None:
            raise ProtocolViolation(INVALID_FIELD, "a sender's attach must carry initial-delivery-count",
                                    "session", channel)
        link = _Link(handle, perf.name, peer_is_sender,
                     perf.initial_delivery_count if peer_is_sender else 0)
        session.links[handle] = link
        address = terminus.address if isinstance(terminus, Source | Target) else None
        dynamic = bool(terminus.dynamic) if isinstance(terminus, Source | Target) else False
        mode = source.distribution_mode if isinstance(source, Source) and not peer_is_sender else None
        events.append(LinkAttached(channel, handle, perf.name, peer_is_sender, address, dynamic, mode,
                                   perf.snd_settle_mode, perf.rcv_settle_mode, perf.initial_delivery_count,
                                   perf.max_message_size, source, target, perf.properties, tuple(unsupported)))

    def _on_detach(self, channel: int, perf: Any, events: list[Any]) -> None:
        session = self._session(channel, "detach")
        link = self._link(session, perf.handle, "detach")
        self._drop_link(session, link)
        if link.closing:
            return  # the answer to this side's detach
        self._out.append(frame(channel, Detach(handle=perf.handle, closed=perf.closed)))
        events.append(LinkDetached(channel, perf.handle, perf.closed, perf.error, True))

    def _drop_link(self, session: _Session, link: _Link) -> None:
        self._free_parts(link)
        del session.links[link.handle]

    def _on_flow(self, channel: int, perf: Any, events: list[Any]) -> None:
        session = self._session(channel, "flow")
        session.peer_next_incoming_id = perf.next_incoming_id if perf.next_incoming_id is not None else 0
        # The peer's window as of our next-outgoing-id (part 2.5.6).
        session.peer_incoming_window = (session.peer_next_incoming_id + perf.incoming_window
                                        - session.next_outgoing_id) & _MASK
        if perf.handle is None:
            if perf.echo:
                self._out.append(self._flow_frame(session, None))
            events.append(FlowReceived(channel, None, None, None, 0, False, perf.echo, None))
            return
        link = self._link(session, perf.handle, "flow")
        if link.closing:
            return
        credit = 0
        if link.peer_is_sender:
            if perf.delivery_count is not None:
                # A sender that advanced its delivery-count without transfers (a drain) used that credit up.
                used = (perf.delivery_count - link.peer_delivery_count) & _MASK
                if used < 0x80000000:
                    link.credit = max(0, link.credit - used)
                link.peer_delivery_count = perf.delivery_count
            credit = link.credit
        else:
            count = perf.delivery_count if perf.delivery_count is not None else link.delivery_count
            link.peer_credit = perf.link_credit or 0
            link.credit = max(0, (count + link.peer_credit - link.delivery_count + 0x80000000) % (1 << 32)
                              - 0x80000000)
            link.drain = perf.drain
            credit = link.credit
        if perf.echo:
            self._out.append(self._flow_frame(session, link))
        events.append(FlowReceived(channel, perf.handle, perf.delivery_count, perf.link_credit, credit,
                                   perf.drain, perf.echo, perf.available))

    def _on_disposition(self, channel: int, perf: Any, events: list[Any]) -> None:
        self._session(channel, "disposition")
        if isinstance(perf.state, TransactionalState):
            raise ProtocolViolation(NOT_IMPLEMENTED, "transactions are not supported", "session", channel)
        last = perf.first if perf.last is None else perf.last
        events.append(DispositionReceived(channel, perf.role, perf.first, last, perf.settled, perf.state))

    def _on_close(self, channel: int, perf: Any, events: list[Any]) -> None:
        self._out.append(frame(0, Close()))
        self.state = _CLOSED
        events.append(ConnectionClosed(perf.error, True))

    _HANDLERS = {Begin: _on_begin, End: _on_end, Attach: _on_attach, Detach: _on_detach, Flow: _on_flow,
                 Disposition: _on_disposition, Close: _on_close}

    def _on_open_again(self, channel: int, perf: Any, events: list[Any]) -> None:
        raise ProtocolViolation(NOT_ALLOWED, "a second open")

    _HANDLERS[Open] = _on_open_again

    # ---- transfers -----------------------------------------------------------------------------------------

    def _run(self, buf: bytearray, pos: int, events: list[Any]) -> int:
        """The run of plain transfers at ``buf[pos]`` taken as one event, as
        far as the link's credit and the session's window go; returns where it
        ends (0: no run here, or it must go frame by frame to report a fault)."""
        count, end, channel, handle, message_format, rows = self._scanner.scan(buf, pos, self.max_frame_size)
        if not count:
            return 0
        session = self._sessions.get(channel)
        link = session.links.get(handle) if session is not None else None
        if link is None or not link.peer_is_sender or link.parts is not None or link.closing or session.closing:
            return 0
        k = min(count, link.credit, session.incoming_window)
        if k <= 0:
            return 0
        if k < count:
            del rows[k * ROW:]
            end = rows[-3] + rows[-2]
        link.credit -= k
        link.peer_delivery_count = (link.peer_delivery_count + k) & _MASK
        self.frames_received += k - 1  # the caller counted the first
        session.incoming_window -= k
        session.next_incoming_id = (session.next_incoming_id + k) & _MASK
        if session.incoming_window < session.window_size >> 1:
            self._out.append(self._flow_frame(session, None))
        events.append(TransferRun(channel, handle, bytes(memoryview(buf)[pos:end]), pos, rows,
                                  message_format if message_format >= 0 else 0))
        return end

    def _transfer(self, session: _Session, handle: int, delivery_id: int, tag: bytes | None, message_format: int,
                  flags: int, part: bytes, events: list[Any]) -> None:
        if session.closing:
            return
        link = session.links.get(handle)
        if link is not None and link.closing:
            return  # in flight before the peer saw this side's detach
        if link is None or not link.peer_is_sender:
            raise ProtocolViolation(UNATTACHED_HANDLE, f"transfer on handle {handle}, which is not attached"
                                    " with the peer sending", "session", session.channel)
        if session.incoming_window == 0:
            raise ProtocolViolation(WINDOW_VIOLATION, "transfer beyond the session's incoming window",
                                    "session", session.channel)
        session.incoming_window -= 1
        session.next_incoming_id = (session.next_incoming_id + 1) & _MASK
        if session.incoming_window < session.window_size >> 1:
            self._out.append(self._flow_frame(session, None))
        if flags & ABORTED:
            self._free_parts(link)
            return
        if link.parts is None:
            if delivery_id < 0:
                raise ProtocolViolation(INVALID_FIELD, "the first transfer of a delivery has no delivery-id",
                                        "session", session.channel)
            if link.credit <= 0:
                raise ProtocolViolation(TRANSFER_LIMIT, f"transfer on link {link.name!r} without credit",
                                        "link", session.channel, handle)
            link.credit -= 1
            link.peer_delivery_count = (link.peer_delivery_count + 1) & _MASK
            settled = flags & SETTLED != 0
            if not flags & MORE:
                events.append(single(session.channel, handle, delivery_id, tag, settled, part,
                                     message_format if message_format >= 0 else 0))
                return
            link.first = (delivery_id, tag, settled, message_format if message_format >= 0 else 0)
            link.parts = []
        if flags & SETTLED_SET and flags & SETTLED:
            link.first = link.first[:2] + (True,) + link.first[3:]  # type: ignore[index]
        self.unfinished_input += len(part)
        link.parts_size += len(part)
        if self.unfinished_input > self.max_unfinished_input:
            raise ProtocolViolation(RESOURCE_LIMIT, f"unfinished deliveries hold more than "
                                    f"{self.max_unfinished_input} bytes")
        link.parts.append(part)
        if flags & MORE:
            return
        delivery_id, tag, settled, message_format = link.first  # type: ignore[misc]
        payload = b"".join(link.parts)
        self._free_parts(link)
        events.append(single(session.channel, handle, delivery_id, tag, settled, payload, message_format))

    def _transfer_general(self, session: _Session, perf: Any, buf: bytearray, start: int, end: int,
                          events: list[Any]) -> None:
        if perf.resume:
            raise ProtocolViolation(NOT_IMPLEMENTED, "link resume (a resumed transfer) is not supported",
                                    "link", session.channel, perf.handle)
        if isinstance(perf.state, TransactionalState):
            raise ProtocolViolation(NOT_IMPLEMENTED, "transactions are not supported", "link", session.channel,
                                    perf.handle)
        flags = ((MORE if perf.more else 0) | (ABORTED if perf.aborted else 0)
                 | (SETTLED if perf.settled else 0) | (SETTLED_SET if perf.settled is not None else 0))
        self._transfer(session, perf.handle, -1 if perf.delivery_id is None else perf.delivery_id,
                       perf.delivery_tag, -1 if perf.message_format is None else perf.message_format, flags,
                       bytes(buf[start:end]), events)

    # ---- faults --------------------------------------------------------------------------------------------

    def _violation(self, v: ProtocolViolation, events: list[Any]) -> None:
        error = Error(condition=Symbol(v.condition), description=v.description)
        session = self._sessions.get(v.channel)
        if v.scope == "link" and session is not None and v.handle in session.links:
            link = session.links[v.handle]
            self._free_parts(link)
            link.closing = True
            self._out.append(frame(v.channel, Detach(handle=v.handle, closed=True, error=error)))
            events.append(LinkDetached(v.channel, v.handle, True, error, False))
            return
        if v.scope in ("session", "link") and session is not None:
            for link in session.links.values():
                self._free_parts(link)
            session.closing = True
            self._out.append(frame(v.channel, End(error=error)))
            events.append(SessionEnded(v.channel, error, False))
            return
        self._fail(error, events)

    def _fail(self, error: Any, events: list[Any]) -> None:
        if self.state in (_HEADER, _SASL_DONE):
            self._out.append(AMQP_HEADER)
        if self.state in (_SASL,):
            self._out.append(frame(0, SaslOutcome(code=2), frame_type=TYPE_SASL))
        elif not self._open_sent:
            self._out.append(frame(0, Open(container_id=self.container_id)))
            self._open_sent = True
            self._out.append(frame(0, Close(error=error)))
        else:
            self._out.append(frame(0, Close(error=error)))
        self.state = _CLOSED
        self.unfinished_input = 0
        self._sessions.clear()
        events.append(ConnectionClosed(error, False))

    # ---- output --------------------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Every byte the connection has to send so far (b"" if none)."""
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    @property
    def closed(self) -> bool:
        """Whether the connection is over (a close was sent or received, or the header refused)."""
        return self.state == _CLOSED

    def sasl_challenge(self, challenge: bytes) -> None:
        """Send a SASL challenge (the client answers with a response)."""
        self._out.append(frame(0, SaslChallenge(challenge=challenge), frame_type=TYPE_SASL))

    def sasl_outcome(self, code: int, additional_data: bytes | None = None) -> None:
        """End the SASL exchange: :data:`~.performatives.SASL_OK` lets the
        client go on to the AMQP header; any other code ends the connection.
        Call ``receive_data(b"")`` next: a client may have sent its AMQP
        header (and more) already."""
        self._out.append(frame(0, SaslOutcome(code=code, additional_data=additional_data), frame_type=TYPE_SASL))
        if code == SASL_OK:
            self.sasl_done = True
            self.state = _SASL_DONE
        else:
            self.state = _CLOSED

    def open(self, properties: dict | None = None, offered_capabilities: tuple[str, ...] | None = None) -> None:
        """Answer the peer's open with this side's limits."""
        self._open_sent = True
        self._out.append(frame(0, Open(
            container_id=self.container_id, max_frame_size=self.max_frame_size, channel_max=self.channel_max,
            idle_time_out=self.idle_time_out or None, properties=properties,
            offered_capabilities=offered_capabilities)))

    def begin(self, channel: int, properties: dict | None = None) -> None:
        """Answer the peer's begin on ``channel``."""
        session = self._sessions[channel]
        session.answered = True
        self._out.append(frame(channel, Begin(
            remote_channel=channel, next_outgoing_id=session.next_outgoing_id,
            incoming_window=session.incoming_window, outgoing_window=0x7FFFFFFF, properties=properties)))

    def end(self, channel: int, condition: str | None = None, description: str | None = None) -> None:
        """End a session (with an error if ``condition`` is given)."""
        session = self._sessions.get(channel)
        if session is not None:
            for link in session.links.values():
                self._free_parts(link)
            session.closing = True
        error = Error(condition=condition, description=description) if condition else None
        self._out.append(frame(channel, End(error=error)))

    def attach(self, channel: int, handle: int, *, source: Any = None, target: Any = None,
               snd_settle_mode: int | None = None, rcv_settle_mode: int | None = None,
               properties: dict | None = None, max_message_size: int | None = None) -> None:
        """Answer the peer's attach of (channel, handle), with the opposite
        role. For a sending peer, grant it credit with :meth:`flow`."""
        link = self._sessions[channel].links[handle]
        link.answered = True
        self._out.append(frame(channel, Attach(
            name=link.name, handle=handle, role=link.peer_is_sender, snd_settle_mode=snd_settle_mode,
            rcv_settle_mode=rcv_settle_mode, source=source, target=target,
            initial_delivery_count=None if link.peer_is_sender else link.delivery_count,
            max_message_size=max_message_size, properties=properties)))

    def refuse_link(self, channel: int, handle: int, condition: str, description: str) -> None:
        """Refuse the peer's attach: answer it with no terminus, then detach
        with the error (as part 2.6.3 asks)."""
        link = self._sessions[channel].links[handle]
        if not link.answered:
            self._out.append(frame(channel, Attach(name=link.name, handle=handle, role=link.peer_is_sender)))
        self.detach(channel, handle, condition=condition, description=description)

    def detach(self, channel: int, handle: int, closed: bool = True, condition: str | None = None,
               description: str | None = None) -> None:
        """Detach (close) a link, with an error if ``condition`` is given."""
        session = self._sessions.get(channel)
        if session is not None and handle in session.links:
            link = session.links[handle]
            self._free_parts(link)
            link.closing = True
        error = Error(condition=condition, description=description) if condition else None
        self._out.append(frame(channel, Detach(handle=handle, closed=closed, error=error)))

    def _flow_frame(self, session: _Session, link: _Link | None, drain: bool = False) -> bytes:
        if session.incoming_window < session.window_size // 2:
            session.incoming_window = session.window_size
        f = Flow(next_incoming_id=session.next_incoming_id, incoming_window=session.incoming_window,
                 next_outgoing_id=session.next_outgoing_id, outgoing_window=0x7FFFFFFF)
        if link is not None:
            f.handle = link.handle
            if link.peer_is_sender:
                f.delivery_count = link.peer_delivery_count
                f.link_credit = link.credit
            else:
                f.delivery_count = link.delivery_count
                f.link_credit = link.credit
                f.drain = drain or None
        return frame(session.channel, f)

    def flow(self, channel: int, handle: int, credit: int) -> None:
        """Grant a sending peer ``credit`` deliveries on its link (from now:
        the credit replaces what is left, as link-credit does)."""
        session = self._sessions[channel]
        link = session.links[handle]
        link.credit = credit
        self._out.append(self._flow_frame(session, link))

    def session_flow(self, channel: int) -> None:
        """Send the session's window (no link): reopens the incoming window."""
        session = self._sessions[channel]
        self._out.append(self._flow_frame(session, None))

    def link_credit(self, channel: int, handle: int) -> int:
        """A link's credit: for a sending peer, what it may still send; for a
        receiving peer, what this side may send it now."""
        return self._sessions[channel].links[handle].credit

    def drained(self, channel: int, handle: int) -> None:
        """For a receiving peer that asked to drain: use up the credit left (no
        more messages) and tell it, as part 2.6.7 asks."""
        session = self._sessions[channel]
        link = session.links[handle]
        link.delivery_count = (link.delivery_count + link.credit) & _MASK
        link.credit = 0
        link.drain = False
        self._out.append(self._flow_frame(session, link, drain=True))

    def transfer(self, channel: int, handle: int, payload: bytes, *, delivery_tag: bytes, settled: bool = False,
                 message_format: int = 0) -> int:
        """Send one delivery to a receiving peer; returns its delivery-id.

        The caller checks :meth:`link_credit` (a transfer uses one) and
        :meth:`session_window` first; a payload larger than the peer's frame
        size goes in several frames.
        """
        if len(delivery_tag) > 32:
            raise ValueError(f"a delivery tag is at most 32 bytes, not {len(delivery_tag)}")
        session = self._sessions[channel]
        link = session.links[handle]
        delivery_id = session.next_outgoing_id
        link.credit -= 1
        link.delivery_count = (link.delivery_count + 1) & _MASK
        room = self.peer_max_frame_size - TRANSFER_OVERHEAD - len(delivery_tag)
        if len(payload) <= room:
            self._out.append(transfer_frame(channel, handle, delivery_id, delivery_tag, settled, payload,
                                            message_format))
            session.next_outgoing_id = (delivery_id + 1) & _MASK
            session.peer_incoming_window -= 1
            return delivery_id
        view = memoryview(payload)
        for start in range(0, len(payload), room):
            more = start + room < len(payload)
            self._out.append(transfer_frame(channel, handle, delivery_id, delivery_tag, settled,
                                            bytes(view[start:start + room]), message_format, more))
            session.next_outgoing_id = (session.next_outgoing_id + 1) & _MASK
            session.peer_incoming_window -= 1
        return delivery_id

    def transfer_many(self, channel: int, handle: int, payloads: list[bytes], tags: list[bytes], *,
                      settled: bool = False, message_format: int = 0) -> int:
        """Send many deliveries to a receiving peer at once, as :meth:`transfer`
        does each (their delivery-ids follow each other only if none needs
        several frames); returns the first one's delivery-id."""
        session = self._sessions[channel]
        first = session.next_outgoing_id
        room = self.peer_max_frame_size - TRANSFER_OVERHEAD - 32
        if max(map(len, payloads), default=0) > room or max(map(len, tags), default=0) > 32:
            for payload, tag in zip(payloads, tags, strict=True):
                self.transfer(channel, handle, payload, delivery_tag=tag, settled=settled,
                              message_format=message_format)
            return first
        link = session.links[handle]
        n = len(payloads)
        out = self._out
        did = first
        for payload, tag in zip(payloads, tags, strict=True):
            out.append(transfer_frame(channel, handle, did, tag, settled, payload, message_format))
            did = (did + 1) & _MASK
        session.next_outgoing_id = did
        session.peer_incoming_window -= n
        link.credit -= n
        link.delivery_count = (link.delivery_count + n) & _MASK
        return first

    def next_delivery_id(self, channel: int) -> int:
        """The delivery-id the next transfer on session ``channel`` gets."""
        return self._sessions[channel].next_outgoing_id

    def transfers_written(self, channel: int, handle: int, count: int, frames: bytes) -> None:
        """Queue ``frames``: ``count`` single-frame transfers to a receiving
        peer, written elsewhere with the delivery-ids from
        :meth:`next_delivery_id` on (as :meth:`transfer_many` writes them)."""
        session = self._sessions[channel]
        link = session.links[handle]
        self._out.append(frames)
        session.next_outgoing_id = (session.next_outgoing_id + count) & _MASK
        session.peer_incoming_window -= count
        link.credit -= count
        link.delivery_count = (link.delivery_count + count) & _MASK

    def session_window(self, channel: int) -> int:
        """How many more transfer frames the peer's session window takes now."""
        return self._sessions[channel].peer_incoming_window

    def disposition(self, channel: int, first: int, last: int | None = None, *, settled: bool = True,
                    state: bytes = ACCEPTED_STATE, role: bool = RECEIVER) -> None:
        """Settle (or update) deliveries ``first``..``last``. ``state`` is an
        encoded delivery state (:data:`~.frames.ACCEPTED_STATE`, or
        ``Rejected(...).encode()``...). ``role`` True: this side received them."""
        self._out.append(disposition_frame(channel, role, first, first if last is None else last, settled,
                                           state))

    def heartbeat(self) -> None:
        """Queue an empty frame (send one at least every half of :attr:`peer_idle_time_out`)."""
        self._out.append(HEARTBEAT)

    def close(self, condition: str | None = None, description: str | None = None) -> None:
        """Close the connection (with an error if ``condition`` is given:
        ``amqp:connection:forced`` at shutdown, for instance)."""
        if self.state == _CLOSED:
            return
        if not self._open_sent and self.state == _OPENED:
            self.open()
        error = Error(condition=condition, description=description) if condition else None
        self._out.append(frame(0, Close(error=error)))
        self.state = _CLOSED
        self.unfinished_input = 0
        self._sessions.clear()
