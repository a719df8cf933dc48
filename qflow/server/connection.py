"""One client connection of qflowd: trio wraps the sans-I/O core.

Each connection owns a nursery with a reader (receive up to 256 KiB, decode
every frame in it, then one ``Broker.flush``) and a writer (sends whatever
the encoder has gathered, as one write). A connection error (bad header,
malformed frame, frame too large, protocol misuse) closes that connection
with a ``connection.close`` naming the fault; other connections carry on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.broker.commands import NO_COMPLETE
from qflow.protocol import CommandError
from qflow.protocol.framing import (
    MIN_MAX_FRAME_SIZE,
    READ_SIZE,
    FrameDecoder,
    FrameEncoder,
    FramingError,
)

log = logging.getLogger("qflow.server")

MAX_SESSIONS = 256
RUN_RETRY = 16  # frames to take one by one after a transfer that starts no run


class ConnectionError_(Exception):  # noqa: N801 - distinct from the builtin
    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


class Connection:
    def __init__(self, broker: Broker, stream: trio.SocketStream, max_frame_size: int, peer: str) -> None:
        self.broker = broker
        self.stream = stream
        self.peer = peer
        self.max_frame_size = max_frame_size
        self.decoder = FrameDecoder(max_frame_size)
        self.encoder = FrameEncoder()
        self.sessions: dict[int, BrokerSession] = {}
        self.opened = False
        self.deliver_runs = False  # the client takes message.deliver-run frames (connection.open)
        self.name = ""
        self.heartbeat = 0
        self._wake = trio.Event()
        self._closing = False  # the connection is ending: the writer sends what is queued and returns
        self._close_frame: list[Any] | None = None
        self._torn = False  # a write was cut off mid-frame: nothing more can be sent
        self._nursery: trio.Nursery | None = None  # the reader's and writer's, open while run() runs
        self._heartbeat_scope = trio.CancelScope()
        self._writer_scope = trio.CancelScope(shield=True)
        self.connected_at = trio.current_time()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Serve the connection until it ends. Whatever ends it, its sessions
        are closed (deliveries released, held transfers dropped) and the socket
        is closed: nothing outlives the connection. A close the broker starts
        (an error, a heartbeat timeout, shutdown) sends ``connection.close``
        with its code and text, and that frame is the last one sent."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                try:
                    await self._reader()
                except ConnectionError_ as exc:
                    log.info("connection %s closed: %s", self.peer, exc.text)
                    self._close_with(exc.code, exc.text)
                except FramingError as exc:
                    log.info("connection %s closed: %s", self.peer, exc)
                    if not self.decoder.header_done:
                        # As AMQP: answer a bad header with our own, then close.
                        self.encoder.write_header()
                    self._close_with(exc.code, str(exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass  # the peer is gone
                except trio.Cancelled:
                    if not self._torn:  # not the writer's doing: the broker is stopping
                        self._close_with(P.CONNECTION_FORCED, "broker shutting down")
                    raise
                except Exception:  # a broker bug: this connection ends, the broker carries on
                    log.exception("connection %s: internal error", self.peer)
                    self._close_with(P.INTERNAL_ERROR, "internal broker error")
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
                if self._close_frame is not None and not self._torn:
                    # Written after everything else, and taken with no checkpoint in
                    # between: nothing (a heartbeat, a completion) can follow it.
                    self.encoder.write(self._close_frame)
                    with trio.move_on_after(1):
                        await self._send_pending()
                await self.stream.aclose()

    def _close_with(self, code: int, text: str) -> None:
        """End this connection with ``connection.close`` [code, text]. run()
        sends the frame last; the first reason given is the one sent."""
        self._closing = True
        if self._close_frame is None:
            self._close_frame = [P.CLOSE, code, text]

    def _close_sessions(self) -> None:
        for ssn in list(self.sessions.values()):
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

    async def _send_heartbeats(self, interval: float) -> None:
        # At most one a second, as before: a client asking for less cannot make us spin.
        interval = max(interval, 1.0)
        with self._heartbeat_scope:
            while True:
                await trio.sleep(interval)
                self.encoder.write([P.HEARTBEAT])
                self.wake()

    async def _reader(self) -> None:
        receive = self.stream.receive_some
        decoder = self.decoder
        while True:
            timeout = self.heartbeat * 2 if self.heartbeat else math.inf
            with trio.move_on_after(timeout) as scope:
                data = await receive(READ_SIZE)
            if scope.cancelled_caught:
                raise ConnectionError_(P.CONNECTION_FORCED, f"no frame for {timeout} seconds (heartbeat)")
            if not data:
                return
            decoder.feed(data)
            self._handle_frames()
            self.broker.flush()

    def _handle_frames(self) -> None:
        broker = self.broker
        sessions = self.sessions
        decoder = self.decoder
        last, base = decoder.last_chunk()
        run = broker.transfer_run if broker.runs is not None and self.opened else None
        frames = decoder.frames()
        skip_runs = 0
        while True:
            if run is not None:
                # A run of transfers to one queue is taken whole (Broker.transfer_run);
                # a transfer that starts none goes below, and so do the next few.
                i = decoder.position() - base
                if skip_runs:
                    skip_runs -= 1
                elif 0 <= i < len(last) - 2 and last[i] == 0x96 and last[i + 1] == 30:
                    taken = run(sessions, last, i, decoder.max_frame_size)
                    if taken:
                        decoder.skip(taken)
                        continue
                    skip_runs = RUN_RETRY
            frame = next(frames, None)
            if frame is None:
                break
            code = frame[0]
            if code == P.TRANSFER and len(frame) == 6:
                channel = frame[1]
                ssn = sessions.get(channel) if type(channel) is int else None
                if ssn is None:
                    self._no_session(frame)
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
                    if i >= 0 and channel < 128 and last[i + 2] == channel and last[i] == 0x96 and last[i + 1] == 30:
                        tail = last[i + 3:decoder.frame_end - base]
                    else:
                        tail = decoder.frame_tail(ssn.transfer_head)
                    broker.transfer(ssn, cid, exchange, routing_key, props, body, tail)
                except CommandError as exc:
                    broker.fail(ssn, cid, exc.code, exc.text)
            elif code >= P.FIRST_COMMAND:
                ssn = sessions.get(frame[1]) if len(frame) > 1 and type(frame[1]) is int else None
                if ssn is None:
                    self._no_session(frame)
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

    def _no_session(self, frame: list[Any]) -> None:
        channel = frame[1] if len(frame) > 1 else None
        raise ConnectionError_(P.COMMAND_INVALID,
                               f"{P.command_name(frame[0])} on channel {channel!r}, which has no attached session")

    def _control(self, frame: list[Any]) -> None:
        code = frame[0]
        if not self.opened:
            if code != P.OPEN:
                raise ConnectionError_(P.COMMAND_INVALID, f"expected connection.open first, got frame code {code}")
            self._open(frame)
            return
        if code == P.HEARTBEAT:
            return
        if code == P.ATTACH:
            if len(frame) != 3 or type(frame[1]) is not int or type(frame[2]) is not str:
                raise ConnectionError_(P.COMMAND_INVALID, "session.attach must be [10, channel, name]")
            channel = frame[1]
            if channel in self.sessions:
                raise ConnectionError_(P.COMMAND_INVALID, f"session.attach: channel {channel} is already attached")
            if len(self.sessions) >= MAX_SESSIONS or not 0 <= channel < 65536:
                raise ConnectionError_(P.RESOURCE_LIMIT_EXCEEDED,
                                       f"session.attach: channel {channel} out of range or too many sessions")
            self.sessions[channel] = self.broker.open_session(channel, frame[2], self.encoder, self.wake,
                                                              self.deliver_runs, self.max_frame_size)
            self.encoder.write([P.ATTACHED, channel])
            self.wake()
        elif code == P.DETACH:
            ssn = self.sessions.pop(frame[1], None) if len(frame) == 2 and type(frame[1]) is int else None
            if ssn is None:
                raise ConnectionError_(P.COMMAND_INVALID, f"session.detach: bad frame or no session: {frame!r:.80}")
            self.broker.flush()
            self.broker.close_session(ssn)
            self.encoder.write([P.DETACHED, ssn.channel, P.NORMAL, "detached"])
            self.wake()
        elif code == P.FLUSH:
            ssn = self.sessions.get(frame[1]) if len(frame) == 2 and type(frame[1]) is int else None
            if ssn is None:
                raise ConnectionError_(P.COMMAND_INVALID, f"session.flush: bad frame or no session: {frame!r:.80}")
            self.broker._dirty_sessions[ssn] = None  # flush() at the end of this batch reports
        elif code == P.CLOSE:
            raise ConnectionError_(P.NORMAL, "closed by the client")
        elif code == P.OPEN:
            raise ConnectionError_(P.COMMAND_INVALID, "connection.open sent twice")
        else:
            raise ConnectionError_(P.COMMAND_INVALID, f"unknown frame code {code}")

    def _open(self, frame: list[Any]) -> None:
        opts = frame[1] if len(frame) == 2 else None
        if type(opts) is not dict:
            raise ConnectionError_(P.COMMAND_INVALID, "connection.open must be [0, {options}]")
        mechanism = opts.get("mechanism", "ANONYMOUS")
        if mechanism != "ANONYMOUS":
            raise ConnectionError_(P.NOT_ALLOWED, f"authentication mechanism {mechanism!r} is not supported (ANONYMOUS)")
        name = opts.get("name", "")
        heartbeat = opts.get("heartbeat", 0)
        max_frame = opts.get("max_frame_size", self.max_frame_size)
        deliver_runs = opts.get("deliver_runs", False)
        if (type(name) is not str or type(heartbeat) not in (int, float) or type(max_frame) is not int
                or type(deliver_runs) is not bool):
            raise ConnectionError_(P.COMMAND_INVALID, "connection.open: name must be a string, heartbeat a number, "
                                   "max_frame_size an int, deliver_runs a boolean")
        if math.isnan(heartbeat) or heartbeat < 0 or max_frame < MIN_MAX_FRAME_SIZE:  # NaN: no timer takes it
            raise ConnectionError_(P.COMMAND_INVALID, f"connection.open: heartbeat must be >= 0 and max_frame_size "
                                   f">= {MIN_MAX_FRAME_SIZE}")
        self.name = name
        self.heartbeat = heartbeat
        self.max_frame_size = min(max_frame, self.max_frame_size)
        self.deliver_runs = deliver_runs
        self.decoder.set_max_frame_size(self.max_frame_size)
        self.opened = True
        if heartbeat:
            self._nursery.start_soon(self._send_heartbeats, heartbeat)
        self.encoder.write([P.OPEN_OK, {"heartbeat": heartbeat, "max_frame_size": self.max_frame_size,
                                        "broker": "qflow"}])
        self.wake()
