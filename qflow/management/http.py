"""The management HTTP server: h11 on trio, in front of a ManagementApi.

Everything about HTTP as a transport lives here and nothing about what the
routes mean: one task per connection, keep-alive and pipelining, bounded
request line, head, header count and body, a deadline for each request
(slowloris), a bounded number of connections in all and per client (peer
address), and a response for whatever the client got wrong. The API it serves is sans-I/O (``api.ManagementApi``):
this module hands it (method, target, body) and writes back its Response,
or, for the web console's ``GET /api/events``, the events of its
EventStream (qflow.management.events) for as long as the client reads them.
"""

from __future__ import annotations

import base64
import binascii
import logging
import ssl
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import h11
import trio

from qflow import __version__
from qflow.management.api import ManagementApi, Pending, Response, error_response
from qflow.management.events import CONTENT_TYPE as EVENTS_TYPE
from qflow.management.events import EventStream
from qflow.management.guard import RequestGuard
from qflow.protocol.framing import PROTOCOL_HEADER
from qflow.protocol.names import printable
from qflow.transport.tls import certificate_name, handshake_failure

log = logging.getLogger("qflow.management")

DEFAULT_PORT = 8672
DEFAULT_TIMEOUT = 10.0  # seconds for a whole request to arrive, and for an idle keep-alive connection
MAX_BODY = 1 << 20  # bytes of request body
MAX_HEAD = 16 * 1024  # bytes of request line plus headers (h11's own default)
MAX_TARGET = 8 * 1024  # bytes of request target: a name is at most 255 bytes, 765 percent-encoded
MAX_HEADERS = 64
MAX_CONNECTIONS = 64
# Connections one client (peer address) may have at once: a client holding unfinished
# requests open, renewed as they time out, takes at most these slots, never them all.
# Its next one is answered 429, as RabbitMQ's and nginx's per-client limits do.
MAX_PER_CLIENT = 8
# Event streams (the web console's GET /api/events) are long-lived connections, counted in the
# limits above like any other, and limited again so they can never take a client's or the server's
# every slot: half a client's (4 console tabs) leaves it 4 connections for its tools and the
# console's own actions, and a quarter of all leaves 48 for everyone else.
MAX_STREAMS = 16
MAX_STREAMS_PER_CLIENT = 4
READ_SIZE = 64 * 1024
WRONG_PORT_HINT = ("this is qflowd's management HTTP port, not its messaging port: give the broker's "
                   "address (port 5672 by default)")


class _Reject(Exception):
    """Stop reading this request: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.head = False  # the refused request is a HEAD: its answer has no body


# (user, password) -> whether they are a user's credentials; None: no authentication (--auth no)
Authenticate = Callable[[str, str], bool]


def basic_credentials(headers: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """The (user, password) of an ``Authorization: Basic`` header (RFC 7617),
    or None if there is none or it is malformed."""
    value = next((v for k, v in headers if k == b"authorization"), None)
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, ValueError):
        return None
    return (user, password) if sep else None


def unauthorized(headers: list[tuple[bytes, bytes]], authenticate: Authenticate | None, peer: str,
                 certificate_user: str | None = None
                 ) -> Response | None:
    """The 401 answer to a request without valid credentials for this broker's
    users (``--auth yes``), or None when it may go on. A request over TLS with
    a verified client certificate (``certificate_user``, its CN) and no Basic
    credentials is that user's, as EXTERNAL is on the messaging port; Basic
    credentials, if sent, are checked whatever the certificate. A failure is logged,
    with the user (escaped) and the peer; the answer never says which part was wrong."""
    if authenticate is None or (certificate_user is not None and basic_credentials(headers) is None):
        return None
    credentials = basic_credentials(headers)
    if credentials is not None and authenticate(*credentials):
        return None
    if credentials is not None:
        log.warning("management %s: authentication failed for user '%s'", peer, printable(credentials[0]))
    response = error_response(401, "authentication required: this broker's management API takes HTTP Basic "
                                   "credentials of its users (--sasl-db)" if credentials is None
                              else "authentication failed")
    response.headers.append(("www-authenticate", 'Basic realm="qflowd", charset="UTF-8"'))
    return response


ServeListeners = Callable[[Callable[[trio.SocketStream], Awaitable[None]], list[trio.SocketListener]], Awaitable[None]]


class ManagementServer:
    """Serves a ManagementApi over HTTP/1.1.

    Guarantees: a request must arrive whole within ``timeout`` seconds of the
    previous response (else 408, or a silent close if nothing of it came);
    heads over 16 KiB (431), targets over 8 KiB (414), more than 64 headers (431) or bodies over 1 MiB
    (413) are refused without reading further; at most ``max_connections``
    at once (503 beyond), and at most ``max_per_client`` from one peer
    address (429 beyond). A faulty request closes its own connection only.
    An event stream is exempt from the request deadline once it has begun,
    for as long as its client reads: each event must be written within
    ``timeout`` (a client that stops reading is dropped, and the next event
    is built only once the last is written, so a stalled client costs one
    event's memory at most); at most ``max_streams`` streams at once (503
    beyond) and ``max_streams_per_client`` from one address (429 beyond).
    Before any route runs, and whatever the authentication setting, ``guard``
    (qflow.management.guard) refuses requests a web page could have sent: a
    foreign Host (421), a foreign Origin (403) or a state-changing request
    whose body is not declared JSON (415); each refusal is logged and closes
    the connection.
    """

    def __init__(self, api: ManagementApi, *, timeout: float = DEFAULT_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_PER_CLIENT,
                 max_streams: int = MAX_STREAMS, max_streams_per_client: int = MAX_STREAMS_PER_CLIENT,
                 authenticate: Authenticate | None = None, guard: RequestGuard | None = None,
                 serve_listeners: ServeListeners | None = None) -> None:
        """``authenticate``: every request needs HTTP Basic credentials it accepts (401 without).
        ``guard``: the Host, Origin and Content-Type rules (default: the broker's own names only).
        ``serve_listeners(handler, listeners)`` runs the accept loop
        (trio.serve_listeners if None; qflowd passes its own, which no accept
        error ends and which logs such errors once per interval)."""
        self.api = api
        self.authenticate = authenticate
        self.guard = guard if guard is not None else RequestGuard()
        self.timeout = timeout
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.active = 0
        self._serve_listeners = serve_listeners or trio.serve_listeners
        self.per_client: dict[str, int] = {}  # peer address -> its connections now
        self.max_streams = max_streams
        self.max_streams_per_client = max_streams_per_client
        self.streams = 0
        self.streams_per_client: dict[str, int] = {}  # peer address -> its event streams now

    async def serve(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host``:``port`` (0: a free one, given to ``task_status``);
        with ``ssl_context``, HTTPS only (qflowd with --ssl-cert-file)."""
        if ssl_context is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        else:
            listeners = await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host)
        self.guard.listen_on(host)
        task_status.started(_socket(listeners[0]).getsockname()[1])
        await self._serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream | trio.SSLStream) -> None:
        try:
            try:
                client = _socket(stream).getpeername()[0]
            except OSError:
                client = "?"
            mine = self.per_client.get(client, 0)
            if mine >= self.max_per_client:
                await self._send_raw(stream, error_response(
                    429, f"too many management connections from {client}: {mine}, the limit per client is "
                         f"{self.max_per_client}"))
                return
            if self.active >= self.max_connections:
                await self._send_raw(stream, error_response(503, "too many management connections"))
                return
            self.active += 1
            self.per_client[client] = mine + 1
            try:
                await self._connection(stream, client)
            finally:
                self.active -= 1
                _leave(self.per_client, client)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away: nothing to answer
        except Exception:
            log.exception("management connection failed")
        finally:
            await trio.aclose_forcefully(stream)

    async def _connection(self, stream: trio.SocketStream | trio.SSLStream, client: str) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        local, peer = _addresses(stream)
        certificate_user = None  # a verified client certificate's CN: the user when no Basic credentials come
        if isinstance(stream, trio.SSLStream):
            with trio.move_on_after(self.timeout) as scope:
                try:
                    await stream.do_handshake()
                except trio.BrokenResourceError as exc:
                    log.warning("management %s: TLS handshake failed: %s", peer, handshake_failure(exc))
                    return
            if scope.cancelled_caught:
                return  # nothing came in time: closed, as an idle plain connection is
            certificate_user = certificate_name(stream.getpeercert())
        while True:
            received = [False]  # did any byte of this request arrive?
            request = None
            with trio.move_on_after(self.timeout) as scope:
                try:
                    request = await self._read_request(conn, stream, received, local, peer)
                except _Reject as exc:
                    await self._respond(conn, stream, error_response(exc.status, exc.message), close=True,
                                        head=exc.head)
                    await self._linger(stream)
                    return
            if scope.cancelled_caught:
                if received[0] or conn.trailing_data[0] or conn.their_state is not h11.IDLE:
                    await self._respond(conn, stream, error_response(
                        408, f"request not received in full within {self.timeout:g} seconds"), close=True)
                return  # an idle keep-alive connection simply closes
            if request is None:
                return
            method, target, body, headers = request
            credentials = basic_credentials(headers)
            user = credentials[0] if credentials else certificate_user or "anonymous"
            accept = b",".join(v for k, v in headers if k == b"accept").decode("latin-1")
            response = unauthorized(headers, self.authenticate, peer, certificate_user) or self.api.handle_in_steps(
                method, target, body, user, peer=peer, accept=accept)
            while type(response) is Pending:  # a purge or delete of a deep queue: others are served between steps
                await trio.lowlevel.checkpoint()
                response = response.step() or response
            if type(response) is EventStream:
                await self._stream(conn, stream, response, client, peer, head=method == "HEAD")
                return  # a stream ends its connection
            with trio.move_on_after(self.timeout) as scope:
                await self._respond(conn, stream, response, head=method == "HEAD")
            if scope.cancelled_caught or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _stream(self, conn: h11.Connection, stream: trio.SocketStream, events: EventStream, client: str,
                      peer: str, *, head: bool) -> None:
        """Write ``events`` until the client goes away or stops reading, within the stream limits."""
        mine = self.streams_per_client.get(client, 0)
        refusal = None
        if mine >= self.max_streams_per_client:
            refusal = error_response(429, f"too many event streams from {client}: {mine}, the limit per client "
                                          f"is {self.max_streams_per_client}")
        elif self.streams >= self.max_streams:
            refusal = error_response(503, f"too many event streams: {self.streams}, the limit is {self.max_streams}")
        if refusal is not None:
            with trio.move_on_after(self.timeout):
                await self._respond(conn, stream, refusal, close=True, head=head)
            return
        self.streams += 1
        self.streams_per_client[client] = mine + 1
        try:
            data = conn.send(h11.Response(status_code=200, reason=b"OK", headers=[
                ("content-type", EVENTS_TYPE), ("cache-control", "no-store"), ("server", f"qflowd/{__version__}"),
                ("x-accel-buffering", "no"), ("connection", "close")]))
            if head:
                with trio.move_on_after(self.timeout):
                    await stream.send_all(data + conn.send(h11.EndOfMessage()))
                return
            while True:
                steps = events.next_event_steps()
                while True:  # a large broker's snapshot is built in steps: others are served between two
                    try:
                        next(steps)
                    except StopIteration as stop:
                        event: bytes = stop.value
                        break
                    await trio.lowlevel.checkpoint()
                data += conn.send(h11.Data(data=event))
                with trio.move_on_after(self.timeout) as scope:
                    await stream.send_all(data)
                if scope.cancelled_caught:
                    log.warning("event stream to %s dropped: an event was not read within %g seconds", peer,
                                self.timeout)
                    return
                data = b""
                await trio.sleep(events.interval)
        finally:
            self.streams -= 1
            _leave(self.streams_per_client, client)

    async def _read_request(self, conn: h11.Connection, stream: trio.SocketStream, received: list[bool],
                            local: str | None, peer: str
                            ) -> tuple[str, bytes, bytes, list[tuple[bytes, bytes]]] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Reject(exc.error_status_hint, f"malformed HTTP request: {exc}") from None
            if event is h11.NEED_DATA:
                if request is not None and conn.they_are_waiting_for_100_continue:
                    await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                data = await stream.receive_some(READ_SIZE)
                if data and not received[0] and conn.their_state is h11.IDLE \
                        and data.startswith(PROTOCOL_HEADER[:len(data)]):
                    # A qflow client on the wrong port: tell it now, not after the request timeout.
                    raise _Reject(400, WRONG_PORT_HINT)
                if data:
                    received[0] = True
                conn.receive_data(data)
            elif type(event) is h11.Request:
                request = event
                try:
                    self._check_head(event, local, peer)
                except _Reject as exc:
                    exc.head = event.method == b"HEAD"
                    raise
            elif type(event) is h11.Data:
                body += event.data
                if len(body) > MAX_BODY:
                    raise _Reject(413, f"request body exceeds the limit of {MAX_BODY} bytes")
            elif type(event) is h11.EndOfMessage:
                assert request is not None
                return (request.method.decode("ascii", "replace"), bytes(request.target), bytes(body),
                        list(request.headers))
            elif type(event) is h11.ConnectionClosed:
                return None
            else:  # PAUSED cannot happen before EndOfMessage; anything else ends the connection
                return None

    def _check_head(self, event: h11.Request, local: str | None, peer: str) -> None:
        """Refuse (raise _Reject) a request on its head alone: version, sizes, then the guard."""
        if event.http_version not in (b"1.0", b"1.1"):
            raise _Reject(505, f"HTTP/{event.http_version.decode('ascii', 'replace')} is not supported; "
                               "use HTTP/1.1")
        if len(event.target) > MAX_TARGET:
            raise _Reject(414, f"request target longer than {MAX_TARGET} bytes")
        if len(event.headers) > MAX_HEADERS:
            raise _Reject(431, f"more than {MAX_HEADERS} header fields")
        # h11 bounds a head only while it is incomplete; one that arrived whole in a single
        # read may be longer, so measure it (near enough: line ends and separators count 4).
        if sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD:
            raise _Reject(431, f"request header fields longer than {MAX_HEAD} bytes")
        length = next((v for k, v in event.headers if k == b"content-length"), None)
        if length is not None and any(k == b"transfer-encoding" for k, _ in event.headers):
            # h11 would let Transfer-Encoding win; a proxy in front might take Content-Length, and the rest
            # of the body would be read as a second request (smuggling). RFC 9112 6.1 allows refusing it.
            raise _Reject(400, "a request must not have both Content-Length and Transfer-Encoding")
        if length is not None and int(length) > MAX_BODY:  # h11 has checked it is digits
            raise _Reject(413, f"request body of {int(length)} bytes exceeds the limit of {MAX_BODY}")
        refusal = self.guard.check(event.method, event.headers, local, bytes(event.target))
        if refusal is not None:
            log.warning("refused %s %s from %s: %s", printable(event.method.decode("latin-1")),
                        printable(event.target.decode("latin-1")[:200]), peer, refusal.message)
            raise _Reject(refusal.status, refusal.message)

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, response: Response, *,
                       close: bool = False, head: bool = False) -> None:
        headers = _headers(response, close)
        try:
            data = conn.send(h11.Response(status_code=response.status, headers=headers,
                                          reason=_reason(response.status)))
            if not head:
                data += conn.send(h11.Data(data=response.body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            # h11 will not frame a response here (say, after a half-sent one): nothing sane to add.
            return
        await stream.send_all(data)

    async def _send_raw(self, stream: trio.SocketStream, response: Response) -> None:
        head = f"HTTP/1.1 {response.status} {_reason(response.status).decode()}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in _headers(response, True)) + "\r\n"
        with trio.move_on_after(self.timeout):
            await stream.send_all(head.encode() + response.body)
            await self._linger(stream)

    async def _linger(self, stream: trio.SocketStream) -> None:
        """Half-close and drain a little, so a client still sending the body
        we refused reads our answer instead of a connection reset."""
        try:
            if isinstance(stream, trio.SocketStream):  # TLS has no half-close: drain all the same
                await stream.send_eof()
            with trio.move_on_after(min(self.timeout, 2.0)):
                drained = 0
                while drained < 4 * MAX_BODY:
                    data = await stream.receive_some(READ_SIZE)
                    if not data:
                        break
                    drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def _socket(stream: trio.SocketStream | trio.SSLStream | trio.SocketListener | trio.SSLListener
            ) -> trio.socket.SocketType:
    """The socket under a plain or TLS stream or listener."""
    if isinstance(stream, trio.SSLStream):
        return stream.transport_stream.socket
    if isinstance(stream, trio.SSLListener):
        return stream.transport_listener.socket
    return stream.socket


def _addresses(stream: trio.SocketStream | trio.SSLStream) -> tuple[str | None, str]:
    """The connection's local address (a Host naming it is ours) and its peer, as host:port for the log."""
    try:
        local = _socket(stream).getsockname()[0]
        peer_address = _socket(stream).getpeername()
    except (OSError, AttributeError):
        return None, "?"
    return local, f"{peer_address[0]}:{peer_address[1]}"


def _headers(response: Response, close: bool) -> list[tuple[str, str]]:
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               ("server", f"qflowd/{__version__}"), ("cache-control", "no-store"), *response.headers]
    if close:
        headers.append(("connection", "close"))
    return headers


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _leave(counts: dict[str, int], client: str) -> None:
    """One of ``client``'s connections or streams ended: its count falls, and
    goes once it is 0, so the table holds only the peers connected now."""
    left = counts[client] - 1
    if left:
        counts[client] = left
    else:
        del counts[client]
