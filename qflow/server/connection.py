"""One client connection of qflowd, served with trio.

The protocol and the broker are driven by a sans-I/O ConnectionPump
(qflow.server.pump); this module moves bytes and time between it and the
socket. Each connection owns a nursery with a reader (receive up to 256 KiB,
hand it to the pump, which decodes every frame in it and ends the batch with
one Broker.flush), a writer (sends whatever the encoder has gathered, as one
write) and, if asked for, heartbeats. A connection error (bad header,
malformed frame, frame too large, protocol misuse) closes that connection with
a ``connection.close`` naming the fault; other connections carry on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.protocol.connection import AuthFailed, ConnectionEnd, Opened
from qflow.protocol.framing import READ_SIZE, FramingError
from qflow.protocol.names import printable
from qflow.protocol.sasl import Users
from qflow.server.auth_guard import AuthGuard
from qflow.server.input_budget import InputBudget
from qflow.server.memory_monitor import PublishGate
from qflow.server.pump import ConnectionPump
from qflow.transport.tls import certificate_name, handshake_failure

log = logging.getLogger("qflow.server")

MEMORY_ALARM = "memory alarm"  # the memory alarm's name as a holder (qflow.broker.memory_alarm)

# Bytes of deliveries a connection may have queued or in the socket's send at
# once. Past it the broker delivers nothing more to it until its peer reads:
# a consumer that stops reading keeps its messages in their queues, not in
# the broker's memory. Two of the largest frames: one being written while the
# next is gathered, so a consumer that keeps up never waits on this limit.
OUTPUT_LIMIT_FRAMES = 2


class TlsHandshakeFailed(Exception):
    """The TLS handshake of a connection failed (no client certificate where one
    is required, an untrusted one, a client that does not speak TLS)."""


def _negotiated(attr: str) -> property:
    """A connection's read-only view of its protocol state's ``attr``."""
    return property(lambda self: getattr(self.protocol, attr), doc=f"The connection's {attr}, once open.")


class Connection:
    """A broker connection served over ``stream``. The management API reads
    ``name``, ``user``, ``peer``, ``connected_at``, ``sessions`` and ``protocol_name``."""

    protocol_name = "qflow"

    def __init__(self, broker: Broker, stream: trio.abc.Stream, max_frame_size: int, peer: str,
                 users: Users | None = None, secret: bytes = b"", announce: dict[str, Any] | None = None, *,
                 negotiate_time: float = 0.0, idle_timeout: float = 0.0,
                 admit: Callable[[str], str | None] | None = None, budget: InputBudget | None = None,
                 auth_guard: AuthGuard | None = None, ip: str = "?", publish_gate: PublishGate | None = None,
                 initial: bytes = b"", connected_at: float | None = None) -> None:
        """``budget``: the broker-wide bound on input in unfinished frames, told after each read;
        ``auth_guard``: failed authentication per address (``ip``, the peer's), PLAIN's hashing off the loop;
        ``publish_gate``: closed while the memory alarm is set (then a connection that only publishes is not read);
        ``initial``: its first bytes, read already (to tell its protocol); ``connected_at``: when
        it was accepted (its handshake's time counts from then), if not now."""
        self.initial = initial
        self.broker = broker
        self.stream = stream
        self.peer = peer
        self.connected_at = trio.current_time() if connected_at is None else connected_at
        self.pump = ConnectionPump(broker, max_frame_size, self.connected_at, self.wake, self._opened, users,
                                   secret, announce, negotiate_time=negotiate_time, idle_timeout=idle_timeout,
                                   admit=admit, peer=peer)
        self.protocol = self.pump.protocol
        self.encoder = self.pump.encoder
        self.encoder.limit = OUTPUT_LIMIT_FRAMES * max_frame_size
        self.sessions: dict[int, BrokerSession] = self.pump.sessions
        self._wake = trio.Event()
        self._written = trio.Event()  # set by the writer after each write: the output may have room again
        self._closing = False  # the connection is ending: the writer sends what is queued and returns
        self._torn = False  # a write was cut off mid-frame: nothing more can be sent
        self._nursery: trio.Nursery | None = None  # the reader's and writer's, open while run() runs
        self._heartbeat_scope = trio.CancelScope()
        self._writer_scope = trio.CancelScope(shield=True)
        self._reader_scope = trio.CancelScope()
        self.budget = budget
        self.evicted: str | None = None  # why the broker closed this connection (the input budget, an operator)
        self.auth_guard = auth_guard
        self.ip = ip
        self.publish_gate = publish_gate
        if auth_guard is not None:
            self.pump.defer_password_checks()

    # The negotiated values, as the management API reads them.
    name = _negotiated("name")
    heartbeat = _negotiated("heartbeat")
    max_frame_size = _negotiated("max_frame_size")
    deliver_runs = _negotiated("deliver_runs")
    user = _negotiated("user")

    @property
    def output_bytes(self) -> int:
        """Bytes of deliveries queued for this connection or being written to it."""
        return self.encoder.queued + self.encoder.sending

    @property
    def input_bytes(self) -> int:
        """Bytes read from this connection and not yet taken as whole frames."""
        return self.pump.decoder.pending

    def wake(self) -> None:
        self._wake.set()

    def evict(self, reason: str) -> None:
        """Close this connection for holding too much unfinished input: it is
        told ``reason`` with RESOURCE_LIMIT_EXCEEDED; its sessions close as on
        any other end."""
        if self.evicted is None:
            self.evicted = reason
            self.protocol.close(P.RESOURCE_LIMIT_EXCEEDED, reason)
            self._reader_scope.cancel()

    def close_by_operator(self, reason: str) -> None:
        """Close this connection at an operator's request (the management API):
        the client is told ``reason`` with CONNECTION_FORCED (320), the close is
        logged with it, and its sessions close as on any other end (deliveries
        not accepted go back to their queues)."""
        if self.evicted is None:
            self.evicted = reason
            self.protocol.close(P.CONNECTION_FORCED, reason)
            self._reader_scope.cancel()

    def _opened(self, event: Opened) -> None:
        # A tool's probe (its management-port discovery) only connects: logged at debug, not info.
        log.log(logging.DEBUG if event.probe else logging.INFO, "connection %s opened: name '%s', user '%s'%s",
                self.peer, printable(event.name), printable(event.user), " (a probe)" if event.probe else "")
        if event.heartbeat:
            self._nursery.start_soon(self._send_heartbeats)

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
                    with self._reader_scope:
                        await self._reader()
                    if self.evicted is not None:
                        self._log_closed(self.evicted)
                except TlsHandshakeFailed as exc:
                    protocol.connection_lost()  # no TLS session: nothing can be written to it
                    log.warning("connection %s: TLS handshake failed: %s", self.peer, exc)
                except AuthFailed as exc:
                    if self.auth_guard is not None:
                        self.auth_guard.failed(self.ip, self.peer, exc.user, exc.detail)
                    else:
                        log.warning("connection %s: authentication failed for user '%s' (%s)", self.peer,
                                    printable(exc.user), exc.detail)
                except ConnectionEnd as exc:
                    self._log_closed(printable(exc.text))
                except FramingError as exc:
                    self._log_closed(printable(exc))
                    protocol.malformed(exc)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    protocol.connection_lost()  # the peer is gone
                    self._log_closed("connection lost")
                except trio.Cancelled:
                    if not self._torn:  # not the writer's doing: the broker is stopping
                        protocol.close(P.CONNECTION_FORCED, "broker shutting down")
                    self._log_closed("broker shutting down" if not self._torn else "connection lost")
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
            if self.budget is not None:
                self.budget.forget(self)
            with trio.CancelScope(shield=True):
                try:
                    for _ in self.pump.close_steps():  # many deliveries to put back: others are served between
                        await trio.lowlevel.checkpoint()
                except Exception:
                    log.exception("connection %s: error while closing its sessions", self.peer)
                if self._torn:
                    protocol.connection_lost()
                # Written after everything else, and taken with no checkpoint in
                # between: nothing (a heartbeat, a completion) can follow it.
                if protocol.write_close():
                    with trio.move_on_after(1):
                        await self._send_pending()
                await self._close_stream()

    async def _close_stream(self) -> None:
        """Close the socket. Over TLS that sends close_notify, which a peer that
        does not read (or broke the TLS session) cannot hold up for long."""
        with trio.move_on_after(1):
            try:
                await self.stream.aclose()
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(self.stream)

    def _log_closed(self, reason: str) -> None:
        # Before the open there is no name or user yet: the address says who it was.
        log.log(logging.DEBUG if self.protocol.probe else logging.INFO, "connection %s closed: name '%s', user '%s': %s",
                self.peer, printable(self.protocol.name), printable(self.protocol.user or "-"), reason)

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
        broker = self.broker
        with self._writer_scope:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while encoder.parts:
                    data = encoder.take()
                    encoder.sending = len(data)
                    try:
                        await send_all(data)
                        encoder.sending = 0
                        self._written.set()
                        if broker.stalled and not self._closing:
                            broker.output_drained()  # ours, or another's: dispatching a full one is a no-op
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        self._torn = True
                        self._nursery.cancel_scope.cancel()  # the peer is gone: the reader stops too
                        return
                    except trio.Cancelled:
                        self._torn = True
                        raise
                if self._closing:
                    return

    def _only_publishes(self) -> bool:
        """The memory alarm holds this connection's transfers, and it consumes
        nothing: not reading it cannot hold up what would free memory."""
        held = False
        for ssn in self.sessions.values():
            if ssn is None:
                continue
            if ssn.consumers or ssn.unacked_count:
                return False
            held = held or MEMORY_ALARM in ssn.holder_since
        return held

    @property
    def reading_paused(self) -> bool:
        """The connection's output is full: the broker reads nothing more from it until its peer reads."""
        return self.pump.output_full

    async def _output_room(self) -> None:
        encoder = self.encoder
        while encoder.queued + encoder.sending >= encoder.limit:
            self._written = trio.Event()
            self.wake()
            await self._written.wait()

    async def _send_heartbeats(self) -> None:
        protocol = self.protocol
        with self._heartbeat_scope:
            while True:
                await trio.sleep_until(protocol.heartbeat_deadline)
                if not protocol.send_heartbeat(trio.current_time()):
                    return
                self.wake()

    async def _handshake(self, stream: trio.SSLStream) -> None:
        """The TLS handshake, within the time the handshake as a whole has
        (--max-negotiate-time); the verified client certificate's name, if
        any, goes to the protocol state machine (EXTERNAL)."""
        with trio.move_on_at(self.protocol.peer_deadline) as scope:
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                raise TlsHandshakeFailed(handshake_failure(exc)) from None
        if scope.cancelled_caught:
            raise TlsHandshakeFailed("not completed in time")
        name = certificate_name(stream.getpeercert())
        if name is not None:
            self.protocol.set_peer_identity(name)
        elif stream.getpeercert():
            log.warning("connection %s: its client certificate has no usable common name (CN): EXTERNAL is "
                        "not offered", self.peer)

    async def _reader(self) -> None:
        receive = self.stream.receive_some
        protocol = self.protocol
        now = trio.current_time
        if isinstance(self.stream, trio.SSLStream):
            await self._handshake(self.stream)
        decoder = self.pump.decoder
        budget = self.budget
        guard = self.auth_guard
        if guard is not None:  # an address that failed recently waits its turn before its open is read
            with trio.move_on_at(protocol.peer_deadline):
                await guard.wait_turn(self.ip)
        initial, self.initial = self.initial, b""
        while True:
            if initial:
                data, initial = initial, b""
            else:
                with trio.move_on_at(protocol.peer_deadline) as scope:
                    data = await receive(READ_SIZE)
                if scope.cancelled_caught:
                    raise protocol.peer_timed_out()
            if budget is not None:
                decoder.hold_exact = budget.crowded
            self.pump.receive(data, now())  # b"" (the client is gone) ends it
            check = self.pump.password_check
            if check is not None:  # PLAIN: its hashing in a worker thread, the loop serves the others
                self.pump.finish_password_check(await guard.check_password(check.verifier, check.password))
            if budget is not None:
                for conn, reason in budget.update(self, decoder.pending):
                    conn.evict(reason)
            if self.pump.unfinished is not None or self.pump.output_full:
                while self.pump.unfinished is not None or self.pump.output_full:
                    if self.pump.unfinished is not None:  # a long command: others are served between its steps
                        await trio.lowlevel.checkpoint()
                        self.pump.step()
                    else:  # its replies fill the output: its commands wait until it reads
                        await self._output_room()
                        self.pump.resume()
                protocol.kept_waiting(now())  # its heartbeats wait unread meanwhile
            gate = self.publish_gate
            if gate is not None and gate.closed and self._only_publishes():
                await gate.wait_open()  # TCP back-pressure: its producer stops until the alarm clears
                protocol.kept_waiting(now())
