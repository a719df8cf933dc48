"""One AMQP 1.0 client connection of qflowd, served with trio.

The sans-I/O AmqpPump (qflow.server.amqp_pump) does the protocol and the
broker's side; this moves bytes and time between it and the socket: a
reader (each read through the pump, which ends it with one Broker.flush), a
writer (what the pump has to send, one write per wake-up), heartbeats at
half the peer's idle time-out, and qflowd's own idle time-out (a peer
silent for longer is closed with ``amqp:resource-limit-exceeded``, naming it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import trio

from qflow.broker import Broker
from qflow.protocol.framing import READ_SIZE
from qflow.protocol.names import printable
from qflow.protocol.sasl import Users
from qflow.server.amqp_pump import DEFAULT_CREDIT_WINDOW, AmqpPump

log = logging.getLogger("qflow.server")

OUTPUT_LIMIT = 1 << 20  # bytes of deliveries written and not yet sent: past it, no more are delivered


class AmqpConnection:
    """A broker connection speaking AMQP 1.0 over ``stream``, whose first
    bytes (``initial``) were read already to tell its protocol. The
    management API reads ``name``, ``user``, ``peer``, ``connected_at``,
    ``sessions`` and ``protocol_name``."""

    protocol_name = "amqp1.0"

    def __init__(self, broker: Broker, stream: trio.abc.Stream, initial: bytes, max_frame_size: int, peer: str,
                 users: Users | None = None, secret: bytes = b"", peer_identity: str | None = None, *,
                 credit_window: int = DEFAULT_CREDIT_WINDOW, idle_timeout: float = 0.0,
                 admit: Callable[[str], str | None] | None = None, queue_patterns: Sequence[str] = ()) -> None:
        self.broker = broker
        self.stream = stream
        self.initial = initial
        self.peer = peer
        self.connected_at = trio.current_time()
        self.pump = AmqpPump(broker, peer, max_frame_size=max(512, max_frame_size), users=users, secret=secret,
                             peer_identity=peer_identity, credit_window=credit_window, idle_timeout=idle_timeout,
                             output_limit=OUTPUT_LIMIT, wake=self.wake, admit=admit, queue_patterns=queue_patterns)
        self.idle_timeout = idle_timeout
        self._wake = trio.Event()
        self._written = trio.Event()  # set after each write: the output may have room again
        self._closing = False
        self._reader_scope = trio.CancelScope()

    @property
    def name(self) -> str:
        return self.pump.name

    @property
    def user(self) -> str:
        return self.pump.user

    @property
    def sessions(self) -> dict[tuple[int, int], Any]:
        """Its broker sessions, by (channel, handle): each sending link's, and a
        1.0 session's receiving links' (handle -1)."""
        out: dict[tuple[int, int], Any] = {}
        for ch, s in self.pump.sessions.items():
            if s.broker_session is not None:
                out[(ch, -1)] = s.broker_session
            for handle, link in s.sending.items():
                out[(ch, handle)] = link.session
        return out

    @property
    def output_bytes(self) -> int:
        """Bytes of deliveries written for this connection and not yet sent."""
        return self.pump.room.queued + self.pump.room.sending

    @property
    def input_bytes(self) -> int:
        """Bytes of unfinished multi-frame deliveries held for this connection."""
        return self.pump.core.unfinished_input

    @property
    def reading_paused(self) -> bool:
        """The connection's output is full: nothing more is read from it until its peer reads."""
        room = self.pump.room
        return room.queued + room.sending >= room.limit

    def wake(self) -> None:
        self._wake.set()

    def evict(self, reason: str) -> None:
        """Close it now, with ``reason`` (the management API's close, the input budget)."""
        self.pump.core.close("amqp:connection:forced", reason)
        self.pump.closed_reason = reason
        self._reader_scope.cancel()

    def close_by_operator(self, reason: str) -> None:
        """Close it at an operator's request (the management API): the client is
        told ``reason`` with ``amqp:connection:forced``; its sessions close as on
        any other end (deliveries awaiting an outcome go back to their queues)."""
        self.evict(reason)

    async def run(self) -> None:
        """Serve the connection until it ends; its sessions are closed whatever ends it."""
        pump = self.pump
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                try:
                    with self._reader_scope:
                        await self._reader(nursery)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pump.closed_reason = pump.closed_reason or "connection lost"
                except trio.Cancelled:
                    pump.shutdown()
                    pump.closed_reason = "broker shutting down"
                    raise
                except Exception:  # a broker bug: this connection ends, the broker carries on
                    log.exception("connection %s (AMQP 1.0): internal error", self.peer)
                    pump.core.close("amqp:internal-error", "internal broker error")
                    pump.closed_reason = "internal error"
                finally:
                    self._closing = True
                    self.wake()
                    nursery.cancel_scope.deadline = trio.current_time() + 1
        finally:
            with trio.CancelScope(shield=True):
                try:
                    pump.close_sessions()
                except Exception:
                    log.exception("connection %s (AMQP 1.0): error while closing its sessions", self.peer)
                log.info("connection %s closed: name '%s', user '%s' (AMQP 1.0): %s", self.peer,
                         printable(pump.name), printable(pump.user or "-"), pump.closed_reason or "closed")
                with trio.move_on_after(1):
                    try:
                        data = pump.data_to_send()
                        if data:
                            await self.stream.send_all(data)
                        await self.stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

    async def _reader(self, nursery: trio.Nursery) -> None:
        pump = self.pump
        core = pump.core
        if self.initial:
            pump.receive(self.initial)
        heartbeats = False
        while not core.closed and pump.closed_reason is None:
            if not heartbeats and pump.opened and core.peer_idle_time_out:
                heartbeats = True
                nursery.start_soon(self._heartbeats, core.peer_idle_time_out / 2000)
            with trio.move_on_after(self.idle_timeout or float("inf")) as scope:
                data = await self.stream.receive_some(READ_SIZE)
            if scope.cancelled_caught:
                reason = f"no frame for {self.idle_timeout:g} s (its idle time-out)"
                core.close("amqp:resource-limit-exceeded", reason)
                pump.closed_reason = reason
                return
            pump.receive(data)
            if not data:
                return
            while pump.room.queued + pump.room.sending >= pump.room.limit:
                # Its deliveries wait for its peer to read: so do its frames.
                self._written = trio.Event()
                self.wake()
                await self._written.wait()

    async def _writer(self) -> None:
        pump = self.pump
        send_all = self.stream.send_all
        broker = self.broker
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            data = pump.data_to_send()
            if data:
                try:
                    await send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
                pump.sent()
                self._written.set()
                if broker.stalled:
                    broker.output_drained()
            if self._closing:
                return

    async def _heartbeats(self, interval: float) -> None:
        while not self._closing:
            await trio.sleep(interval)
            self.pump.core.heartbeat()
            self.wake()
