"""One client connection of qflowd: trio wraps the sans-I/O core.

The protocol's rules (handshake, sessions, heartbeats, close) are
``qflow.protocol.connection.ProtocolConnection``'s, in its server role; this
module moves bytes and time between it, the socket and the broker. Each
connection owns a nursery with a reader (receive up to 256 KiB, decode every
frame in it, then one ``Broker.flush``), a writer (sends whatever the encoder
has gathered, as one write) and, if asked for, heartbeats. A connection error
(bad header, malformed frame, frame too large, protocol misuse) closes that
connection with a ``connection.close`` naming the fault; other connections
carry on.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.broker.commands import NO_COMPLETE
from qflow.protocol import CommandError
from qflow.protocol.connection import (
    AttachRequested,
    ConnectionEnd,
    DetachRequested,
    FlushRequested,
    Opened,
    ProtocolConnection,
    Role,
    State,
)
from qflow.protocol.encodings import TRANSFER_FIXARRAY
from qflow.protocol.framing import READ_SIZE, FramingError

log = logging.getLogger("qflow.server")

RUN_RETRY = 16  # frames to take one by one after a transfer that starts no run


def _negotiated(attr: str) -> property:
    """A connection's read-only view of its protocol state's ``attr``."""
    return property(lambda self: getattr(self.protocol, attr), doc=f"The connection's {attr}, once open.")


class Connection:
    """A broker connection: the server role of the protocol state machine,
    served over ``stream``. The broker reaches it through ``encoder``,
    ``wake()``, ``deliver_runs`` and ``max_frame_size``; the management API
    through ``name``, ``peer``, ``connected_at`` and ``sessions``."""

    def __init__(self, broker: Broker, stream: trio.SocketStream, max_frame_size: int, peer: str) -> None:
        self.broker = broker
        self.stream = stream
        self.peer = peer
        self.connected_at = trio.current_time()
        self.protocol = ProtocolConnection(Role.SERVER, max_frame_size=max_frame_size, now=self.connected_at)
        self.decoder = self.protocol.decoder
        self.encoder = self.protocol.encoder
        self.sessions: dict[int, BrokerSession] = self.protocol.sessions
        self._wake = trio.Event()
        self._closing = False  # the connection is ending: the writer sends what is queued and returns
        self._torn = False  # a write was cut off mid-frame: nothing more can be sent
        self._nursery: trio.Nursery | None = None  # the reader's and writer's, open while run() runs
        self._heartbeat_scope = trio.CancelScope()
        self._writer_scope = trio.CancelScope(shield=True)

    # The negotiated values, as the broker and the management API read them.
    name = _negotiated("name")
    heartbeat = _negotiated("heartbeat")
    max_frame_size = _negotiated("max_frame_size")
    deliver_runs = _negotiated("deliver_runs")

    @property
    def opened(self) -> bool:
        return self.protocol.state is State.OPEN

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Serve the connection until it ends. Whatever ends it, its sessions
        are closed (deliveries released, held transfers dropped) and the socket
        is closed: nothing outlives the connection. A close the broker starts
        (an error, a heartbeat timeout, shutdown) sends ``connection.close``
        with its code and text, and that frame is the last one sent."""
        protocol = self.protocol
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                try:
                    await self._reader()
                except ConnectionEnd as exc:
                    log.info("connection %s closed: %s", self.peer, exc.text)
                except FramingError as exc:
                    log.info("connection %s closed: %s", self.peer, exc)
                    protocol.malformed(exc)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    protocol.connection_lost()  # the peer is gone
                except trio.Cancelled:
                    if not self._torn:  # not the writer's doing: the broker is stopping
                        protocol.close(P.CONNECTION_FORCED, "broker shutting down")
                    raise
                except Exception:  # a broker bug: this connection ends, the broker carries on
                    log.exception("connection %s: internal error", self.peer)
                    protocol.close(P.INTERNAL_ERROR, "internal broker error")
                finally:
                    # The writer sends what is already queued, then returns. A peer
                    # that does not read gets a second before the writer is cancelled.
                    self._closing = True
                    self._heartbeat_scope.cancel()
                    self.wake()
                    self._writer_scope.deadline = trio.current_time() + 1
        finally:
            with trio.CancelScope(shield=True):
                try:
                    self._close_sessions()
                    self.broker.flush()
                except Exception:
                    log.exception("connection %s: error while closing its sessions", self.peer)
                if self._torn:
                    protocol.connection_lost()
                # Written after everything else, and taken with no checkpoint in
                # between: nothing (a heartbeat, a completion) can follow it.
                if protocol.write_close():
                    with trio.move_on_after(1):
                        await self._send_pending()
                await self.stream.aclose()

    def _close_sessions(self) -> None:
        for ssn in list(self.sessions.values()):
            if ssn is not None:
                self.broker.close_session(ssn)
        self.sessions.clear()

    async def _send_pending(self) -> None:
        try:
            await self.stream.send_all(self.encoder.take())
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def _writer(self) -> None:
        """Send whatever the encoder gathers, one write per wake-up, until the
        connection is closing and nothing is left. Shutdown does not cancel it
        (a send cut short could leave half a frame on the wire); run() stops it
        by letting it drain, with a deadline for a peer that does not read. If
        a send fails or the deadline cuts one short, the connection is *torn*:
        nothing more is written to it, not even a close frame."""
        encoder = self.encoder
        send_all = self.stream.send_all
        with self._writer_scope:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while encoder.parts:
                    data = encoder.take()
                    try:
                        await send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        self._torn = True
                        self._nursery.cancel_scope.cancel()  # the peer is gone: the reader stops too
                        return
                    except trio.Cancelled:
                        self._torn = True
                        raise
                if self._closing:
                    return

    async def _send_heartbeats(self) -> None:
        protocol = self.protocol
        with self._heartbeat_scope:
            while True:
                await trio.sleep_until(protocol.heartbeat_deadline)
                if not protocol.send_heartbeat(trio.current_time()):
                    return
                self.wake()

    async def _reader(self) -> None:
        receive = self.stream.receive_some
        protocol = self.protocol
        now = trio.current_time
        while True:
            with trio.move_on_at(protocol.peer_deadline) as scope:
                data = await receive(READ_SIZE)
            if scope.cancelled_caught:
                raise protocol.peer_timed_out()
            protocol.receive_data(data, now())  # b"" (the client is gone) ends it
            self._handle_frames()
            self.broker.flush()

    def _handle_frames(self) -> None:
        broker = self.broker
        sessions = self.sessions
        decoder = self.decoder
        last, base = decoder.last_chunk()
        run = broker.transfer_run if broker.runs is not None and self.opened else None
        frames = decoder.frames()
        fixarray, transfer = TRANSFER_FIXARRAY, P.TRANSFER  # a transfer's first two bytes, as usually encoded
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
                        tail = decoder.frame_tail(ssn.transfer_head)
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
                    result = broker.execute(ssn, cid, code, args)
                except CommandError as exc:
                    broker.fail(ssn, cid, exc.code, exc.text)
                    continue
                if result is NO_COMPLETE:
                    continue
                if result is not None:
                    self.encoder.write([P.RESULT, ssn.channel, cid, result])
                ssn.commands.complete(cid)
                broker._dirty_sessions[ssn] = None
            else:
                self._control(frame)
                last, base = decoder.last_chunk()  # connection.open may have replaced the decoder's buffer
                run = broker.transfer_run if broker.runs is not None and self.opened else None

    def _control(self, frame: list[Any]) -> None:
        """A control frame: the state machine rules, the broker acts."""
        event = self.protocol.receive_control(frame)
        if event is None:
            return
        kind = type(event)
        if kind is AttachRequested:
            ssn = self.broker.open_session(event.channel, event.name, self.encoder, self.wake, self.deliver_runs,
                                           self.max_frame_size)
            self.protocol.accept_attach(event.channel, ssn)
        elif kind is FlushRequested:
            self.broker._dirty_sessions[event.session] = None  # flush() at the end of this batch reports
            return
        elif kind is DetachRequested:
            self.broker.flush()
            self.broker.close_session(event.session)
            self.protocol.finish_detach(event.channel)
        elif kind is Opened and event.heartbeat:
            self._nursery.start_soon(self._send_heartbeats)
        self.wake()
