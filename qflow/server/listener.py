"""qflowd's listener: accepts connections, admits them within the
connection limits (qflow.server.admission), and runs each in its own task.

Nothing a single connection does, or fails to do, ends the listener: an
accept error is retried, a connection over a limit is refused with a reason,
and an error while a connection is being set up or served (even running out
of memory building it) ends that connection only.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
from collections.abc import Sequence
from typing import Any

import trio

from qflow import protocol as P
from qflow.broker import Broker
from qflow.protocol.amqp.frames import AMQP_HEADER
from qflow.protocol.connection import refusal
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, READ_SIZE
from qflow.protocol.sasl import Users
from qflow.server.admission import (
    MAX_LINGERING,
    Admission,
    ConnectionLimits,
    Throttle,
    accept_forever,
    send_refusal,
    socket_of,
)
from qflow.server.amqp_connection import AmqpConnection
from qflow.server.amqp_pump import DEFAULT_CREDIT_WINDOW
from qflow.server.auth_guard import AuthGuard
from qflow.server.connection import Connection
from qflow.server.input_budget import InputBudget
from qflow.server.memory_monitor import PublishGate
from qflow.transport.read_buffers import keep_read_buffers_in_heap
from qflow.transport.tls import certificate_name, handshake_failure

log = logging.getLogger("qflow.server")


class Server:
    """The broker's listener and its connections."""

    def __init__(self, broker: Broker, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, users: Users | None = None,
                 limits: ConnectionLimits | None = None, amqp_credit: int = DEFAULT_CREDIT_WINDOW,
                 queue_patterns: Sequence[str] = ()) -> None:
        """``users``: clients must authenticate against them (None: authentication off);
        ``limits``: on connections (qpidd's defaults if None); ``amqp_credit``: an AMQP 1.0
        sending link's credit window; ``queue_patterns``: an AMQP 1.0 link to an unknown
        address matching one creates the queue (qflow.server.amqp_pump.AmqpPump)."""
        self.broker = broker
        self.amqp_credit = amqp_credit
        self.queue_patterns = tuple(queue_patterns)
        self.max_frame_size = max_frame_size
        self.users = users
        self.secret = os.urandom(32)  # unknown users' decoy verifiers: fixed per name while the broker runs
        self.limits = limits or ConnectionLimits()
        self.admission = Admission(self.limits)  # one count over every port (plain and TLS)
        self.throttle = Throttle()
        self.input_budget = InputBudget(self.limits.max_unfinished_input, self.throttle)
        self.auth_guard = AuthGuard(throttle=self.throttle)  # failed authentication, per address
        self.publish_gate = PublishGate()  # closed by the memory monitor while the memory alarm is set
        self.connections: set[Connection | AmqpConnection] = set()
        # What every connection.open-ok tells the client beyond the handshake (the management port).
        self.announce: dict[str, Any] = {}
        self.refused = 0  # connections refused over a limit, since start
        self.started_at = 0.0
        self._lingering = 0  # refused connections still being told why
        # Encoded now: when they are needed there may be no memory to encode them.
        self._no_memory = refusal(P.RESOURCE_LIMIT_EXCEEDED, "broker out of memory")
        self._internal_error = refusal(P.INTERNAL_ERROR, "internal broker error")

    async def serve(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                    refuse: str | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host``:``port`` (0: a free port, given to ``task_status``);
        with ``ssl_context``, every connection is TLS (qflowd's --ssl-port). With
        ``refuse``, every connection is refused (NOT_ALLOWED, 530) with that text,
        and the refusal logged: qflowd's --require-encryption on the plain port."""
        keep_read_buffers_in_heap()
        if ssl_context is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        else:
            listeners = await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host)
        self.started_at = self.started_at or trio.current_time()
        async with trio.open_nursery() as nursery:
            handle = self._handle if refuse is None else functools.partial(self._handle, refuse=refuse)
            for listener in listeners:
                nursery.start_soon(accept_forever, listener, handle, nursery, self.throttle)
            first = listeners[0]
            sock = first.transport_listener.socket if isinstance(first, trio.SSLListener) else first.socket
            task_status.started(sock.getsockname()[1])

    async def _handle(self, stream: trio.SocketStream | trio.SSLStream, refuse: str | None = None) -> None:
        peer = "?"
        try:
            sock = socket_of(stream)
            try:
                host, port = sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                host = "?"
            if refuse is not None:
                await self._refuse(stream, peer, refuse, P.NOT_ALLOWED)
                return
            reason = self.admission.refuse(host)
            if reason is not None:
                await self._refuse(stream, peer, reason)
                return
            self.admission.enter(host)
            try:
                await self._serve(stream, sock, peer, host)
            finally:
                self.admission.leave(host)
        except Exception as exc:  # MemoryError included: this connection ends, the broker carries on
            await self._failed(stream, peer, exc)

    async def _failed(self, stream: trio.SocketStream | trio.SSLStream, peer: str, exc: Exception) -> None:
        """A connection failed outside its own error handling (being built,
        most likely for want of memory): log it, tell the client with a frame
        encoded in advance, close. Nothing here may raise: it would end the
        listener, and with it the broker."""
        try:
            self.throttle.log(logging.ERROR, "setup", "connection %s failed: %r", peer, exc)
        except Exception:  # noqa: S110 - out of memory even to log: the client is still told
            pass
        try:
            await send_refusal(stream, self._no_memory if isinstance(exc, MemoryError) else self._internal_error)
        except Exception:
            socket_of(stream).close()

    async def _serve(self, stream: trio.SocketStream | trio.SSLStream, sock: trio.socket.SocketType,
                     peer: str, ip: str = "?") -> None:
        admitted: list[str] = []  # the user counted for this connection, once authenticated

        def admit(user: str) -> str | None:
            reason = self.admission.refuse_user(user)
            if reason is None:
                self.admission.enter_user(user)
                admitted.append(user)
            else:
                self.refused += 1
                self.throttle.log(logging.WARNING, "refused", "refused connection from %s: %s", peer, reason)
            return reason

        accepted_at = trio.current_time()
        initial = await self._first_bytes(stream, peer)
        if initial is None:
            await trio.aclose_forcefully(stream)
            return
        conn: Connection | AmqpConnection
        if initial.startswith(AMQP_HEADER[:4]):  # AMQP 1.0, or its SASL layer: the header says which
            identity = certificate_name(stream.getpeercert()) if isinstance(stream, trio.SSLStream) else None
            conn = AmqpConnection(self.broker, stream, initial, self.max_frame_size, peer, self.users, self.secret,
                                  identity, credit_window=self.amqp_credit, idle_timeout=self.limits.idle_timeout,
                                  admit=admit if self.limits.per_user else None, queue_patterns=self.queue_patterns)
        else:
            conn = Connection(self.broker, stream, self.max_frame_size, peer, self.users, self.secret, self.announce,
                              negotiate_time=self.limits.negotiate_time, idle_timeout=self.limits.idle_timeout,
                              admit=admit if self.limits.per_user else None, budget=self.input_budget,
                              auth_guard=self.auth_guard, ip=ip, publish_gate=self.publish_gate,
                              initial=initial, connected_at=accepted_at)
        self.connections.add(conn)
        try:
            sock.setsockopt(6, 1, 1)  # TCP_NODELAY: completions are small and urgent
        except OSError:
            pass
        try:
            await conn.run()
        except Exception:
            log.exception("connection %s failed", peer)
        finally:
            self.connections.discard(conn)
            for user in admitted:
                self.admission.leave_user(user)

    async def _first_bytes(self, stream: trio.SocketStream | trio.SSLStream, peer: str) -> bytes | None:
        """A connection's first bytes (after the TLS handshake, on the TLS port),
        enough to tell its protocol by its header: qflow's, or AMQP's; what
        came (maybe nothing) once the handshake's time (--max-negotiate-time)
        is up, or the client closed. None if the TLS handshake failed."""
        data = b""
        with trio.move_on_after(self.limits.negotiate_time or float("inf")):
            try:
                while len(data) < 4:
                    chunk = await stream.receive_some(READ_SIZE)
                    if not chunk:
                        return data
                    data += chunk
                return data
            except trio.BrokenResourceError as exc:
                if isinstance(stream, trio.SSLStream):
                    log.warning("connection %s: TLS handshake failed: %s", peer, handshake_failure(exc))
                return None
            except (trio.ClosedResourceError, OSError):
                return None
        # Nothing that says AMQP in the handshake's time: qflow's side refuses it, with its reason
        # (the handshake's deadline, counted from the accept, has passed).
        return data

    async def _refuse(self, stream: trio.SocketStream | trio.SSLStream, peer: str, reason: str,
                      code: int = P.RESOURCE_LIMIT_EXCEEDED) -> None:
        self.refused += 1
        self.throttle.log(logging.WARNING, "refused", "refused connection from %s: %s", peer, reason)
        if self._lingering >= MAX_LINGERING:  # a flood: no time for reasons
            socket_of(stream).close()
            return
        self._lingering += 1
        try:
            await send_refusal(stream, refusal(code, reason))
        finally:
            self._lingering -= 1
