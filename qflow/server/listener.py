"""qflowd's listener: accepts connections and runs each in its own task."""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import trio

from qflow.broker import Broker
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from qflow.protocol.sasl import Users
from qflow.server.connection import Connection

log = logging.getLogger("qflow.server")


class Server:
    """The broker's listener and its connections."""

    def __init__(self, broker: Broker, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, users: Users | None = None
                 ) -> None:
        """``users``: clients must authenticate against them (None: authentication off)."""
        self.broker = broker
        self.max_frame_size = max_frame_size
        self.users = users
        self.secret = os.urandom(32)  # unknown users' decoy verifiers: fixed per name while the broker runs
        self.connections: set[Connection] = set()
        # What every connection.open-ok tells the client beyond the handshake (the management port).
        self.announce: dict[str, Any] = {}
        self.started_at = 0.0

    async def serve(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host``:``port`` (0: a free port, given to ``task_status``);
        with ``ssl_context``, every connection is TLS (qflowd's --ssl-port)."""
        if ssl_context is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        else:
            listeners = await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host)
        self.started_at = self.started_at or trio.current_time()
        async with trio.open_nursery() as nursery:
            first = listeners[0]
            sock = first.transport_listener.socket if isinstance(first, trio.SSLListener) else first.socket
            task_status.started(sock.getsockname()[1])
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, stream: trio.SocketStream | trio.SSLStream) -> None:
        sock = stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket
        try:
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        conn = Connection(self.broker, stream, self.max_frame_size, peer, self.users, self.secret, self.announce)
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
