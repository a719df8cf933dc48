"""One client connection of qflowd, sans I/O: its bytes through the protocol
core into the broker. No trio: the trio glue (qflow.server.connection) and
the in-memory harness (qflow.testing) both drive a pump.

A read's worth of bytes goes in through :meth:`ConnectionPump.receive`: the
protocol state machine (qflow.protocol.connection) checks the handshake and
every control frame; command frames go straight to the broker, a run of
transfers to one queue in a few C calls (Broker.transfer_run), others frame by
frame; then one Broker.flush ends the batch. Everything to send (this
connection's control frames, and its sessions' output, which the broker
writes) gathers in ``encoder``; ``wake()`` is called when there is some.
Refusals raise qflow.protocol.connection.ConnectionEnd or
qflow.protocol.framing.FramingError, with the close frame recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.broker.broker import Steps
from qflow.broker.commands import Unfinished, execute
from qflow.protocol import CommandError
from qflow.protocol.connection import (
    AttachRequested,
    DetachRequested,
    FlushRequested,
    Opened,
    PasswordCheck,
    ProtocolConnection,
    Role,
    State,
)
from qflow.protocol.encodings import TRANSFER_FIXARRAY, transfer_head
from qflow.protocol.sasl import Users

RUN_RETRY = 16  # frames to take one by one after a transfer that starts no run


def _nothing(*args: Any) -> None:
    pass


class Detaching:
    """A session detaching with many unaccepted deliveries, put back in steps
    (Broker.close_session_steps); the detach is confirmed after the last."""

    __slots__ = ("protocol", "channel", "steps")

    def __init__(self, protocol: ProtocolConnection, channel: int, steps: Steps) -> None:
        self.protocol = protocol
        self.channel = channel
        self.steps = steps

    def step(self, broker: Broker) -> bool:
        if next(self.steps, self) is self:
            self.protocol.finish_detach(self.channel)
            return True
        return False

    def finish(self, broker: Broker) -> None:
        while not self.step(broker):
            pass


class ConnectionPump:
    """The broker side of one connection, fed bytes. ``wake`` is called when
    output is waiting in ``encoder``; ``on_opened`` gets the Opened event
    (the glue starts heartbeats if one was negotiated)."""

    def __init__(self, broker: Broker, max_frame_size: int, now: float,
                 wake: Callable[[], None] = _nothing, on_opened: Callable[[Opened], None] = _nothing,
                 users: Users | None = None, secret: bytes = b"", announce: dict[str, Any] | None = None, *,
                 negotiate_time: float = 0.0, idle_timeout: float = 0.0,
                 admit: Callable[[str], str | None] | None = None, peer: str = "") -> None:
        """``peer``: the client's address (its sessions carry it, for the change
        log); ``users``: authenticate clients against them (None: authentication
        off); ``secret``: the broker's, for unknown users' decoy verifiers;
        ``negotiate_time`` and ``idle_timeout``: the connection's clocks
        (qflow.protocol.connection); ``admit``: the per-user limit's check."""
        self.broker = broker
        self.peer = peer
        self.protocol = ProtocolConnection(Role.SERVER, max_frame_size=max_frame_size, now=now, users=users,
                                           secret=secret, announce=announce, negotiate_time=negotiate_time,
                                           idle_timeout=idle_timeout, admit=admit)
        self.decoder = self.protocol.decoder
        self.encoder = self.protocol.encoder
        self.sessions: dict[int, BrokerSession] = self.protocol.sessions
        self.transfer_heads: dict[int, bytes] = {}  # channel -> its transfers' first bytes
        self.wake = wake
        self.on_opened = on_opened
        # A long command of this connection under way (qflow.broker.commands.Unfinished): until
        # it is done, the frames after it wait in the decoder, so nothing overtakes it.
        self.unfinished: Unfinished | Detaching | None = None
        # The output reached its limit while commands were being taken: the frames after wait in
        # the decoder (and the glue reads no more) until the peer has read some (resume()).
        self.output_full = False
        # A PLAIN password for the glue to check off its loop (``defer_password_checks``); the frames
        # after the open wait in the decoder until finish_password_check().
        self.password_check: PasswordCheck | None = None

    def defer_password_checks(self) -> None:
        """Hand PLAIN's password checks to the glue (``password_check``) instead of hashing inline."""
        self.protocol.defer_password_checks = True

    def finish_password_check(self, matches: bool) -> None:
        """The glue checked ``password_check``: open the connection (and take
        the frames that waited), or raise AuthFailed."""
        self.password_check = None
        event = self.protocol.finish_password_check(matches)
        if event is not None:
            self.on_opened(event)
        self.wake()
        self._handle_frames()
        self.broker.flush()

    @property
    def opened(self) -> bool:
        return self.protocol.state is State.OPEN

    def receive(self, data: bytes, now: float) -> None:
        """One read: ``b""`` when the peer's stream ended (that ends the connection)."""
        self.protocol.receive_data(data, now)
        self._handle_frames()
        self.broker.flush()

    def step(self) -> None:
        """One more step of the unfinished command; once it is done, the frames
        that came after it are handled. The glue yields to others between two steps."""
        if self.unfinished.step(self.broker):
            self.unfinished = None
            self._handle_frames()
        self.broker.flush()

    def resume(self) -> None:
        """The output has room again: take the frames that waited for it."""
        self.output_full = False
        self._handle_frames()
        self.broker.flush()

    def close_sessions(self) -> None:
        """The connection is ending: an unfinished command is finished, every
        session is closed (deliveries released, held transfers dropped), and
        the broker's batch ended. All at once: see :meth:`close_steps`."""
        for _ in self.close_steps():
            pass

    def close_steps(self) -> Iterator[None]:
        """:meth:`close_sessions` in bounded steps (the glue yields to other
        connections between two): the unfinished command's steps, then every
        session closed at once (no more deliveries to it) and their unaccepted
        deliveries put back SLICE at a time (Broker.close_session_steps)."""
        broker = self.broker
        if self.unfinished is not None:
            while not self.unfinished.step(broker):
                broker.flush()
                yield
            self.unfinished = None
        closing = []
        for ssn in list(self.sessions.values()):
            if ssn is not None:
                steps = broker.close_session_steps(ssn)
                if next(steps, steps) is not steps:  # its first step: closed, its subscriptions ended
                    closing.append(steps)
        self.sessions.clear()
        broker.flush()
        for steps in closing:
            yield
            for _ in steps:
                broker.flush()
                yield
            broker.flush()

    def _handle_frames(self) -> None:
        broker = self.broker
        sessions = self.sessions
        decoder = self.decoder
        last, base = decoder.last_chunk()
        run = broker.transfer_run if broker.runs is not None and self.opened else None
        frames = decoder.frames()
        fixarray, transfer = TRANSFER_FIXARRAY, P.TRANSFER  # a transfer's first two bytes, as usually encoded
        encoder = self.encoder
        skip_runs = 0
        while True:
            if run is not None:
                # A run of transfers to one queue is taken whole (Broker.transfer_run);
                # a transfer that starts none goes below, and so do the next few.
                i = decoder.position() - base
                if skip_runs:
                    skip_runs -= 1
                elif 0 <= i < len(last) - 2 and last[i] == fixarray and last[i + 1] == transfer:
                    taken = run(sessions, last, i, decoder.max_frame_size)
                    if taken:
                        decoder.skip(taken)
                        continue
                    skip_runs = RUN_RETRY
            frame = next(frames, None)
            if frame is None:
                break
            code = frame[0]
            if code == transfer and len(frame) == 6:
                channel = frame[1]
                ssn = sessions.get(channel) if type(channel) is int else None
                if ssn is None:
                    raise self.protocol.no_session(frame)
                commands = ssn.commands
                cid = commands.next_id
                commands.next_id = cid + 1
                exchange, routing_key, props, body = frame[2], frame[3], frame[4], frame[5]
                try:
                    if type(body) is not bytes or type(exchange) is not str or type(routing_key) is not str:
                        P.parse_command(frame)
                    # The message is stored as its transfer encoded it, after [30, channel]:
                    # checked here byte by byte for the usual head, else by the decoder.
                    i = decoder.frame_begin - base
                    if i >= 0 and channel < 128 and last[i + 2] == channel and last[i] == fixarray and last[i + 1] == transfer:
                        tail = last[i + 3:decoder.frame_end - base]
                    else:
                        tail = decoder.frame_tail(self.transfer_heads[channel])
                    broker.transfer(ssn, cid, exchange, routing_key, props, body, tail)
                except CommandError as exc:
                    broker.fail(ssn, cid, exc.code, exc.text)
            elif code >= P.FIRST_COMMAND:
                ssn = sessions.get(frame[1]) if len(frame) > 1 and type(frame[1]) is int else None
                if ssn is None:
                    raise self.protocol.no_session(frame)
                cid = ssn.commands.receive()
                try:
                    args = P.parse_command(frame)
                except CommandError as exc:
                    broker.fail(ssn, cid, exc.code, exc.text)
                    continue
                execute(broker, ssn, cid, code, args)
                if broker.unfinished is not None:
                    self.unfinished, broker.unfinished = broker.unfinished, None
                    break
                if encoder.queued + encoder.sending >= encoder.limit:  # replies wait for the peer to read
                    self.output_full = True
                    break
            else:
                self._control(frame)
                if self.unfinished is not None or self.password_check is not None:
                    break  # a detach with many deliveries to put back, or a password to check
                if encoder.queued + encoder.sending >= encoder.limit:
                    self.output_full = True
                    break
                last, base = decoder.last_chunk()  # connection.open may have replaced the decoder's buffer
                run = broker.transfer_run if broker.runs is not None and self.opened else None

    def _control(self, frame: list[Any]) -> None:
        """A control frame: the state machine rules, the broker acts."""
        event = self.protocol.receive_control(frame)
        if event is None:
            if self.encoder.parts:  # a SASL challenge
                self.wake()
            return
        kind = type(event)
        if kind is PasswordCheck:
            self.password_check = event
            return
        if kind is AttachRequested:
            ssn = self.broker.open_session(event.channel, event.name,
                                           self.protocol.session_output(event.channel, self.wake), self.protocol.user,
                                           self.peer)
            # The rest of a transfer frame after this head is stored as it came.
            self.transfer_heads[event.channel] = transfer_head(event.channel)
            self.protocol.accept_attach(event.channel, ssn)
        elif kind is FlushRequested:
            self.broker.report(event.session)  # flush() at the end of this batch reports
            return
        elif kind is DetachRequested:
            self.broker.flush()
            detach = Detaching(self.protocol, event.channel, self.broker.close_session_steps(event.session))
            if not detach.step(self.broker):
                self.unfinished = detach  # many deliveries to put back: the rest in steps
        elif kind is Opened:
            self.on_opened(event)
        self.wake()
