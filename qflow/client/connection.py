"""Client connections: the client role of the protocol state machine
(qflow.protocol.connection), served over a TCP stream by tasks that the
connection owns.

    async with qflow.open_connection("127.0.0.1", 5672) as conn:
        ssn = await conn.session()
        ...

``open_connection`` opens a nursery in the caller's task: the connection's
reader, writer and heartbeats run in it and end with the ``async with``
block. Nothing of the connection outlives the block, and nothing it does goes
only to a log: an error of the connection (the broker's close, a lost
socket, bad data, a silent broker, a bug in these tasks) becomes
``ConnectionClosed``, raised by every call waiting on the connection and by
every later one.

``connect()`` opens a connection with no block around its life, for code
that cannot keep one open; ``open_connection`` is the one to use.

The top of the client: a connection makes sessions and hands them the
broker's frames (their ``on_*`` methods), and hands each delivery frame
straight to its receiver.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from qflow import protocol as P
from qflow.client.errors import ConnectionClosed, TlsError
from qflow.client.session import Session
from qflow.protocol import DELIVER, DELIVER_PART, DELIVER_RUN
from qflow.protocol.connection import (
    Completed,
    ConnectionEnd,
    Failed,
    FlowNotice,
    Opened,
    ProtocolConnection,
    Result,
    Role,
    SessionAttached,
    SessionDetached,
    State,
)
from qflow.protocol.entries import EntryError
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, READ_SIZE, FramingError
from qflow.protocol.parts import PartJoiner
from qflow.transport.read_buffers import keep_read_buffers_in_heap
from qflow.transport.tls import client_handshake_failure

CLOSE_TIMEOUT = 2.0  # seconds close() waits for the broker to answer its connection.close


def tls_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
                ) -> ssl.SSLContext:
    """A client's TLS context, for :func:`open_connection`'s ``ssl_context``.

    The broker's certificate is verified against the CA certificates of
    ``ca_file``, and its host name against the address connected to. TLS 1.2
    at least.

    Args:
      ca_file: the CA certificates, PEM (None: the system's).
      cert_file: this client's own certificate, PEM, which it then presents:
        with ``mechanism="EXTERNAL"`` it authenticates as the certificate's CN.
      key_file: the certificate's private key, unless it is in ``cert_file``.

    Returns:
      The context.

    Raises:
      OSError, ssl.SSLError: if a file cannot be read or used.
      ValueError: if ``key_file`` is given without ``cert_file``.
    """
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    elif key_file is not None:
        raise ValueError("key_file goes with cert_file")
    return context


def _tls_error(host: str, port: int, exc: BaseException) -> TlsError:
    error = TlsError(P.CONNECTION_FORCED,
                     f"TLS with the broker at {host}:{port} failed: {client_handshake_failure(exc)}")
    error.__cause__ = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
    return error


async def _open_stream(host: str, port: int, ssl_context: ssl.SSLContext | None) -> trio.abc.Stream:
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    if ssl_context is not None:
        stream = trio.SSLStream(stream, ssl_context, server_hostname=host)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(stream)
            raise _tls_error(host, port, exc)  # noqa: B904 - its cause is the ssl error, set by _tls_error
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    return stream


def _credentials(username: str | None, password: str | None, mechanism: str | None) -> dict[str, Any]:
    if (username is None) != (password is None):
        raise ValueError("username and password go together")
    return {"username": username, "password": password or "", "mechanism": mechanism}


@asynccontextmanager
async def open_connection(host: str = "127.0.0.1", port: int = 5672, *, name: str = "", heartbeat: float = 0,
                          max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, username: str | None = None,
                          password: str | None = None, mechanism: str | None = None,
                          ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Connection]:
    """A connection to a broker, open for the ``async with`` block it is used in.

    It connects, authenticates and waits for the broker's connection.open-ok
    before it yields the connection; leaving the block closes it
    (:meth:`Connection.close`). The connection's tasks run in a nursery
    opened here, in the caller's task, so they end with the block. An
    exception from the block propagates as itself (not in an exception
    group).

    This is the way to open a connection; :func:`connect` is for code that
    cannot keep a block open.

    Args:
      host, port: the broker's protocol address.
      name: the connection's name, which the broker shows (``qflow-stat -c``).
      heartbeat: seconds between heartbeats, each way, once open (0: none);
        a broker silent for two intervals ends the connection.
      max_frame_size: the largest frame to ask for; the broker may lower it.
      username, password: authenticate with SCRAM-SHA-256 (both or
        neither). Without them, ANONYMOUS, which only a broker with
        ``--auth no`` takes.
      mechanism: ``"PLAIN"`` sends the password itself (only over TLS);
        ``"EXTERNAL"`` (no username) authenticates as the CN of the client
        certificate in ``ssl_context``, which the broker verified.
      ssl_context: run over TLS with it (``trio.SSLStream``; the broker's
        name checked against ``host``; :func:`tls_context` makes one).

    Yields:
      The open Connection.

    Raises:
      OSError: if the broker cannot be reached.
      TlsError: if TLS fails (the broker's certificate, or the broker
        refusing this client's), naming the address and the reason.
      ConnectionClosed: if the broker refuses the connection (code 530,
        ``authentication failed``, for bad credentials); and on leaving the
        block if the connection's own tasks failed (a client bug, the
        original error as its ``__cause__``) and the block did not raise.
      ValueError: if only one of ``username`` and ``password`` is given.
    """
    conn = await _new_connection(host, port, name, heartbeat, max_frame_size, username, password, mechanism,
                                 ssl_context)
    raised: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn._serve)
            clean = False
            try:
                await conn._handshake()
                yield conn
                clean = True
            finally:
                # Leaving on an exception accepts nothing more: what was fetched may not have been handled.
                await conn.close(accept_fetched=clean)
    except BaseExceptionGroup as group:
        # The connection's tasks never raise (they end the connection instead):
        # a group holds what the block raised, which the caller expects bare.
        if len(group.exceptions) != 1:
            raise
        raised = group.exceptions[0]
    if raised is not None:
        raise raised  # outside the except clause: its context stays its own
    if conn._failure is not None:
        raise conn.error


async def _new_connection(host: str, port: int, name: str, heartbeat: float, max_frame_size: int,
                          username: str | None, password: str | None, mechanism: str | None,
                          ssl_context: ssl.SSLContext | None) -> Connection:
    """A Connection over a new stream to ``host:port``, not started yet."""
    keep_read_buffers_in_heap()
    credentials = _credentials(username, password, mechanism)
    stream = await _open_stream(host, port, ssl_context)
    try:
        conn = Connection(stream, name, heartbeat, max_frame_size, **credentials)
        conn.address = (host, port)
        return conn
    except ValueError:
        await trio.aclose_forcefully(stream)
        raise


async def connect(host: str = "127.0.0.1", port: int = 5672, *, name: str = "", heartbeat: float = 0,
                  max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, username: str | None = None,
                  password: str | None = None, mechanism: str | None = None,
                  ssl_context: ssl.SSLContext | None = None) -> Connection:
    """A connection to a broker, open until its ``close()``.

    It connects, authenticates and waits for the broker's connection.open-ok,
    as :func:`open_connection` does; ``close()`` it when done (``async with
    await connect(...)`` does). Use :func:`open_connection` unless the
    connection cannot live inside one ``async with`` block.

    With no block around its life, the connection's tasks cannot live in
    the caller's: they run in a nursery of the connection's own, hosted by a
    trio system task, until ``close()``. They behave as under
    ``open_connection``: their errors end the connection and reach the
    caller as ConnectionClosed from the next call. Only a client bug is
    reported differently: as ConnectionClosed from calls, not raised again
    at the end.

    Args:
      As :func:`open_connection`.

    Returns:
      The open Connection.

    Raises:
      As :func:`open_connection`, before it returns.
    """
    conn = await _new_connection(host, port, name, heartbeat, max_frame_size, username, password, mechanism,
                                 ssl_context)
    trio.lowlevel.spawn_system_task(conn._serve, name=f"qflow connection {name!r}")
    try:
        await conn._handshake()
    except BaseException:
        await conn.close()
        raise
    return conn


class Connection:
    """A client connection to a broker: the sessions on it, and the tasks
    that move its bytes (:func:`open_connection` makes one).

    Its reader hands the broker's frames to its sessions (their ``on_*``
    methods) and each delivery straight to its receiver; its writer sends
    what the encoder holds whenever :meth:`wake` is called.

    Attributes:
      name: the connection's name, as given.
      heartbeat: the heartbeat interval asked for, in seconds (0: none).
      address: the broker's ``(host, port)``, as connected to.
      sessions: its sessions by channel, while it is open.
      error: why it ended (ConnectionClosed), or None while it is open.
      protocol: its protocol state machine (qflow.protocol.connection).
      encoder: where sessions and senders write their frames.
      wakeup: the event the writer waits on: setting it is :meth:`wake`,
        without the call, for a sender's per-message path. The writer
        replaces it each time it wakes, so it is looked up each time.
    """

    def __init__(self, stream: trio.abc.Stream, name: str, heartbeat: float, max_frame_size: int,
                 username: str | None = None, password: str = "", mechanism: str | None = None) -> None:
        self.stream = stream
        self.name = name
        self.heartbeat = heartbeat
        self.protocol = ProtocolConnection(Role.CLIENT, max_frame_size=max_frame_size, name=name,
                                           heartbeat=heartbeat, now=trio.current_time(), username=username,
                                           password=password, mechanism=mechanism)
        self.decoder = self.protocol.decoder
        self.encoder = self.protocol.encoder
        self.sessions: dict[int, Session] = self.protocol.sessions
        self.error: ConnectionClosed | None = None
        self.address: tuple[str, int] = ("?", 0)  # the broker's, as connected to
        self._failure: BaseException | None = None  # an error of the connection's own tasks: a client bug
        self._opened = trio.Event()  # set by connection.open-ok, or when the connection ends
        self.wakeup = trio.Event()
        self._scope = trio.CancelScope()  # around the connection's tasks: close() cancels it
        self._nursery: trio.Nursery | None = None
        self._reader_done = trio.Event()
        self._writer_done = trio.Event()
        self._tasks_done = trio.Event()
        self._close_started = False
        self._parts = PartJoiner()

    @property
    def user(self) -> str:
        """The user the broker opened the connection as (``anonymous`` for ANONYMOUS)."""
        return self.protocol.user

    @property
    def server_properties(self) -> dict[str, Any]:
        """The broker's connection.open-ok options (``broker``, ``management_port``, ...), once open."""
        return self.protocol.peer_properties

    @property
    def max_frame_size(self) -> int:
        """The negotiated maximum frame size (what was asked, until the open-ok)."""
        return self.protocol.max_frame_size

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        await self.close(accept_fetched=exc_type is None)

    def wake(self) -> None:
        """Tell the writer the encoder has frames to send: its sessions call
        it after writing (a sender sets ``wakeup`` itself)."""
        self.wakeup.set()

    def check(self) -> None:
        """Raise the connection's error, if it has ended.

        Raises:
          ConnectionClosed: why it ended.
        """
        if self.error is not None:
            raise self.error

    async def session(self, name: str = "") -> Session:
        """A new session on this connection, once the broker has attached it.

        Args:
          name: the session's name.

        Returns:
          The Session.

        Raises:
          ConnectionClosed: if the connection has ended, or ends meanwhile.
        """
        self.check()
        ssn = Session(self, name)
        self.wake()
        await ssn.wait_attached()
        return ssn

    async def close(self, *, accept_fetched: bool = True) -> None:
        """Close the connection, and return once its tasks have ended.

        First, unless ``accept_fetched`` is False, what its receivers with
        ``accept="auto"`` fetched and have not accepted yet is accepted (the
        broker removes those messages); leaving an ``async with`` block on an
        exception closes with False, and the broker puts them back, marked
        redelivered. ``connection.close`` goes out after what is queued, and is the last
        frame sent; the broker's answer is awaited (at most ``CLOSE_TIMEOUT``
        seconds), then the tasks end and the socket closes. Incomplete
        commands and waiting calls fail with ConnectionClosed. Calling it
        again waits for the first call's end and does nothing more.

        Args:
          accept_fetched: accept what auto-accept receivers fetched first
            (False: the broker puts it back).
        """
        if self._close_started:
            with trio.CancelScope(shield=True):
                await self._tasks_done.wait()
            return
        self._close_started = True
        try:
            if self.error is None:
                if accept_fetched:
                    for ssn in list(self.sessions.values()):
                        ssn.accept_fetched()
                # Sessions refuse new commands first: nothing can be queued after the close frame.
                self._shutdown(ConnectionClosed(P.NORMAL, "connection closed by the client"))
                self.protocol.close(P.NORMAL, "client closing")
            if self.protocol.write_close():  # ours, or a refusal of the broker's data
                self.wake()
                with trio.move_on_after(CLOSE_TIMEOUT):
                    await self._writer_done.wait()
                    await self._reader_done.wait()
        finally:
            self._scope.cancel()
            with trio.CancelScope(shield=True):
                await self._tasks_done.wait()
                await self.stream.aclose()

    def _shutdown(self, error: ConnectionClosed) -> None:
        """The connection has ended: every session and every call waiting
        on it gets ``error`` (the first one, if it ends twice)."""
        if self.error is None:
            self.error = error
        self._opened.set()
        for ssn in list(self.sessions.values()):
            ssn.on_end(self.error)

    def _fail(self, exc: BaseException) -> None:
        """A task of the connection failed on a bug: the connection ends with it."""
        if self._failure is None:
            self._failure = exc
        self.protocol.connection_lost()
        error = ConnectionClosed(P.INTERNAL_ERROR, f"client error: {exc!r}")
        error.__cause__ = exc
        self._shutdown(error)

    # -- the connection's tasks -----------------------------------------------------
    async def _serve(self) -> None:
        """Run the reader, the writer and (once open, if asked for) heartbeats
        in the connection's own nursery, until close() cancels them. Raises
        nothing: each task turns its errors into the connection's end."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._writer)
        finally:
            self._tasks_done.set()

    async def _handshake(self) -> None:
        self.wake()  # the header and connection.open the state machine wrote
        await self._opened.wait()
        self.check()

    async def _writer(self) -> None:
        # Runs until the encoder has no parts left before it waits again:
        # Sender.send wakes it only when it finds none.
        encoder = self.encoder
        try:
            while True:
                await self.wakeup.wait()
                self.wakeup = trio.Event()
                while encoder.parts:
                    await self.stream.send_all(encoder.take())
                if self.protocol.state is State.CLOSED:
                    return  # the close frame, if any, was the last taken
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.protocol.connection_lost()
            self._shutdown(ConnectionClosed(P.CONNECTION_FORCED, f"connection lost: {exc}"))
        except Exception as exc:
            self._fail(exc)
        finally:
            self._writer_done.set()

    async def _heartbeats(self) -> None:
        protocol = self.protocol
        try:
            while True:
                await trio.sleep_until(protocol.heartbeat_deadline)
                if not protocol.send_heartbeat(trio.current_time()):
                    return
                self.wake()
        except Exception as exc:
            self._fail(exc)

    async def _reader(self) -> None:
        protocol = self.protocol
        try:
            while True:
                try:
                    with trio.fail_at(protocol.peer_deadline):  # heartbeats: a silent broker is dead
                        data = await self.stream.receive_some(READ_SIZE)
                except trio.TooSlowError:
                    raise protocol.peer_timed_out() from None
                protocol.receive_data(data, trio.current_time())  # b"" (the broker is gone) ends it
                self._handle_frames()
        except ConnectionEnd as exc:
            self._shutdown(ConnectionClosed(exc.code, exc.text))
        except (FramingError, EntryError) as exc:
            end = protocol.malformed(exc)
            self._shutdown(ConnectionClosed(end.code, end.text))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            protocol.connection_lost()
            if not self._opened.is_set() and isinstance(self.stream, trio.SSLStream) and \
                    isinstance(exc, trio.BrokenResourceError):
                # TLS 1.3: the broker checks this client's certificate after the client's handshake is done,
                # so its refusal arrives as the first read fails (its alert, or a reset if the broker closed
                # with our open unread).
                self._shutdown(_tls_error(*self.address, exc))
            else:
                self._shutdown(ConnectionClosed(P.CONNECTION_FORCED, f"connection lost: {exc}"))
        except Exception as exc:
            self._fail(exc)
        finally:
            self._reader_done.set()

    def _handle_frames(self) -> None:
        """Every frame decoded. Deliveries are the per-message path: the glue
        takes them itself, a run per frame, with no event per message (the
        state machine's ``sessions`` holds sessions only while it is open)."""
        sessions = self.sessions
        receive_control = self.protocol.receive_control
        receiver = None  # the last receiver given deliveries: woken once per batch
        for frame in self.decoder.frames():
            code = frame[0]
            if code == DELIVER_PART:  # a message larger than a frame, in parts: delivered once joined
                frame = self._parts.add(frame)
                if frame is None:
                    continue
                code = DELIVER_RUN
            if code == DELIVER_RUN or code == DELIVER:
                ssn = sessions.get(frame[1]) if len(frame) > 2 else None
                r = ssn.receivers.get(frame[2]) if ssn is not None else None
                if r is not None:
                    if code == DELIVER_RUN:
                        r.on_deliver_run(frame)
                    else:
                        r.on_deliver(frame)
                    if r is not receiver:
                        if receiver is not None:
                            receiver.wake()
                        receiver = r
            else:
                event = receive_control(frame)
                if event is not None:
                    self._on_event(event)
                elif self.encoder.parts:  # the answer to a SASL challenge
                    self.wake()
        if receiver is not None:
            receiver.wake()

    def _on_event(self, event: Any) -> None:
        kind = type(event)
        if kind is Opened:
            if self.protocol.heartbeat_interval:
                self._nursery.start_soon(self._heartbeats)
            self._opened.set()
            return
        ssn = event.session
        if kind is Completed:
            ssn.on_completed(event.ranges)
        elif kind is Result:
            ssn.on_result(event.command_id, event.value)
        elif kind is Failed:
            ssn.on_failed(event.command_id, event.code, event.text)
        elif kind is FlowNotice:
            ssn.on_flow_notice(event.queue, event.held, event.holder)
        elif kind is SessionAttached:
            ssn.on_attached()
        elif kind is SessionDetached:
            ssn.on_end(ConnectionClosed(event.code, f"session detached: {event.text}"))
