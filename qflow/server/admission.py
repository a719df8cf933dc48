"""Who may connect: qflowd's connection limits, and an accept loop that no
accept error can end.

qpidd's names and defaults where it has them: ``--max-connections`` (500),
``--max-negotiate-time`` (10000 ms). A connection over a limit is still
accepted, told why in a ``connection.close`` and closed, so its client reads
a reason rather than a reset; the broker logs a refusal once per
``LOG_INTERVAL`` per kind, not once per refused connection.
"""

from __future__ import annotations

import errno
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

log = logging.getLogger("qflow.server")

LOG_INTERVAL = 10.0  # seconds between two log lines about the same kind of refusal or accept error
# accept() failing for want of descriptors or memory: waiting is the cure, so the loop backs off
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
BACKOFF_MIN, BACKOFF_MAX = 0.05, 1.0  # seconds, doubling while accept keeps failing
LINGER = 1.0  # seconds a refused connection is kept open so the client reads its reason, not a reset
MAX_LINGERING = 64  # refused connections kept lingering at once; beyond it they are closed at once


@dataclass(frozen=True)
class ConnectionLimits:
    """qflowd's limits on connections; 0 turns a limit off."""

    max_connections: int = 500  # qpidd's --max-connections default
    per_ip: int = 0  # --connection-limit-per-ip: off by default, as in qpidd (NAT puts many clients on one address)
    negotiate_time: float = 10.0  # seconds to finish the handshake (qpidd's --max-negotiate-time, 10000 ms)
    idle_timeout: float = 0.0  # seconds a connection without heartbeats may send nothing (0: forever, as qpidd)
    per_user: int = 0  # --connection-limit-per-user: off by default, as in qpidd
    # --max-unfinished-input: bytes held in unfinished frames over all connections (qflow.server.input_budget)
    max_unfinished_input: int = 256 * 1024 * 1024


class Throttle:
    """Logs a kind of event at most once per ``interval`` seconds, with the
    count of those not logged in between."""

    def __init__(self, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._next: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg`` unless ``kind`` was logged less than ``interval`` ago; True if logged."""
        now = self.clock()
        if now < self._next.get(kind, -1.0):
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return False
        self._next[kind] = now + self.interval
        quiet = self._quiet.pop(kind, 0)
        if quiet:
            msg += " (%d more since the last such line)"
            args = (*args, quiet)
        log.log(level, msg, *args)
        return True


class Admission:
    """Counts the connections being served, and decides whether a new one
    from ``ip`` may be: :meth:`refuse` gives the reason it may not."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.count = 0
        self.per_ip: dict[str, int] = {}
        self.per_user: dict[str, int] = {}

    def refuse(self, ip: str) -> str | None:
        """Why a new connection from ``ip`` is refused, or None: it may come in."""
        limits = self.limits
        if limits.max_connections and self.count >= limits.max_connections:
            return f"connection limit reached: {limits.max_connections} connections (--max-connections)"
        if limits.per_ip and self.per_ip.get(ip, 0) >= limits.per_ip:
            return (f"connection limit per address reached: {limits.per_ip} connections from {ip} "
                    f"(--connection-limit-per-ip)")
        return None

    def refuse_user(self, user: str) -> str | None:
        """Why one more connection of ``user`` (authenticated, or
        "anonymous") is refused, or None."""
        limit = self.limits.per_user
        if limit and self.per_user.get(user, 0) >= limit:
            return (f"connection limit per user reached: {limit} connections for user {user!r} "
                    "(--connection-limit-per-user)")
        return None

    def enter_user(self, user: str) -> None:
        self.per_user[user] = self.per_user.get(user, 0) + 1

    def leave_user(self, user: str) -> None:
        left = self.per_user[user] - 1
        if left:
            self.per_user[user] = left
        else:
            del self.per_user[user]

    def enter(self, ip: str) -> None:
        self.count += 1
        self.per_ip[ip] = self.per_ip.get(ip, 0) + 1

    def leave(self, ip: str) -> None:
        self.count -= 1
        left = self.per_ip[ip] - 1
        if left:
            self.per_ip[ip] = left
        else:
            del self.per_ip[ip]


async def accept_forever(listener: trio.SocketListener, handle: Callable[[trio.SocketStream], Awaitable[None]],
                         nursery: trio.Nursery, throttle: Throttle) -> None:
    """Accept connections on ``listener`` and start ``handle`` for each in
    ``nursery``, until cancelled. An accept that fails is logged (once per
    interval) and retried: out of descriptors or memory, after a pause that
    doubles while it lasts (connections ending free what it lacks). Only
    cancellation, or the listener itself closed, ends the loop."""
    backoff = BACKOFF_MIN
    while True:
        try:
            stream = await listener.accept()
        except trio.ClosedResourceError:
            return
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            if exc.errno in CAPACITY_ERRNOS:
                throttle.log(logging.ERROR, f"accept-{name}", "cannot accept connections: %s (%s); "
                             "retrying, backing off up to %g s", name, exc.strerror, BACKOFF_MAX)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
            else:
                throttle.log(logging.WARNING, f"accept-{name}", "accept failed: %s (%s)", name, exc.strerror)
                await trio.sleep(0)
            continue
        except MemoryError:
            throttle.log(logging.ERROR, "accept-memory", "out of memory accepting a connection; retrying")
            await trio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
            continue
        backoff = BACKOFF_MIN
        try:
            nursery.start_soon(handle, stream)
        except MemoryError:
            socket_of(stream).close()
            throttle.log(logging.ERROR, "accept-memory", "out of memory starting a connection; closed it")


async def serve_listeners(handle: Callable[[trio.SocketStream], Awaitable[None]],
                          listeners: list[trio.SocketListener], throttle: Throttle | None = None) -> None:
    """As trio.serve_listeners, with :func:`accept_forever`'s loop on each
    listener (the management port's accept loop, in qflowd)."""
    throttle = throttle or Throttle()
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept_forever, listener, handle, nursery, throttle)


def socket_of(stream: trio.SocketStream | trio.SSLStream) -> trio.socket.SocketType:
    """The socket under a plain or a TLS stream."""
    return stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket


async def send_refusal(stream: trio.SocketStream | trio.SSLStream, frame: bytes) -> None:
    """Send a refused client ``frame`` (its ``connection.close``, from
    qflow.protocol.connection.refusal) and close. What the client already
    sent is read and dropped for up to ``LINGER`` s first: closing a socket
    with unread input resets it, and the reset can reach the client before
    the reason does."""
    try:
        with trio.move_on_after(LINGER):
            await stream.send_all(frame)
            if isinstance(stream, trio.abc.HalfCloseableStream):  # TLS has no half-close
                await stream.send_eof()
            while await stream.receive_some(4096):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError):
        pass
    finally:
        await stream.aclose()

