"""One qflow connection, sans I/O: the state machine both roles run.

Rules of this file
------------------
* Everything that changes a connection's state lives here: the handshake,
  sessions attached and detached, session flushes, heartbeats and close. The
  trio glue (``qflow/server/connection.py``, ``qflow/client/connection.py``)
  moves bytes and time in, acts on the events that come out, and decides
  nothing about the protocol.
* No I/O, no trio, no clock. Time comes in as ``now`` arguments (any
  monotonic clock, the same one throughout); deadlines go out as numbers the
  glue sleeps until.
* Every transition is one entry of ``_TRANSITIONS``: role -> state -> frame
  code -> handler. A control frame with no row gets ``_DEFAULTS[role, state]``:
  refused with that code and text, or ignored (``None``). No transition is
  decided anywhere else.
* A refusal raises :class:`ConnectionEnd` after recording the close frame to
  send; so does the peer's close. Nothing is read after one.
* The close frame is the last frame this connection writes: ``write_close``
  writes it (after everything the glue queued before) and moves to CLOSED,
  after which nothing is encoded here, not even a heartbeat.
* The per-message path never passes through the table. Command frames
  (code >= ``FIRST_COMMAND``, transfers and transfer runs included) and, on
  the client, message.deliver and message.deliver-run are taken by the glue
  straight from ``decoder.frames()`` and handed to its sink in bulk, with no
  event per message. That is safe because of one invariant: ``sessions`` is
  empty unless the connection is open, so a frame for a session is accepted
  only once the handshake is done; :meth:`no_session` gives the refusal.

Theory of operation
-------------------
A server starts in AWAIT_OPEN: its decoder expects the protocol header, then
``connection.open``. The open is checked (every field) and answered with
``connection.open-ok``; the connection is then OPEN and the :class:`Opened` event carries the negotiated values. A
client starts in OPENING, having written the header and its open; the
open-ok moves it to OPEN with the same event.

Authentication is part of this handshake (qflow.protocol.sasl holds the
mechanisms). The open names the client's ``mechanism`` and carries its
initial ``response``. ANONYMOUS and PLAIN need nothing more: the open-ok
follows at once, or the refusal. SCRAM-SHA-256 takes one more round trip:
the server answers the open with ``[4, server-first]`` and moves to
AUTHENTICATING; the client answers ``[5, client-final]`` and moves there
too; the server's open-ok then carries ``sasl`` (server-final), which the
client checks before it counts as OPEN. A server built with ``users`` (the
broker's ``--auth yes``) offers only PLAIN and SCRAM-SHA-256 and checks
them; without, it offers ANONYMOUS as well and believes whatever user a
client names (Qpid's ``--auth no``). Every failure of the exchange is
refused alike, ``530 authentication failed``, saying nothing of whether the
user exists (:class:`AuthFailed` tells the glue, for its log).

EXTERNAL (a TLS client certificate) is offered, whatever the auth setting,
only once the glue has handed in the verified certificate's name with
:meth:`set_peer_identity` (it alone sees the TLS session); the connection's
user is then that name. A client asks for it with ``mechanism="EXTERNAL"``
and no username.

Once open, ``session.attach`` / ``detach`` / ``flush`` are checked here and
come out as :class:`AttachRequested`, :class:`DetachRequested` and
:class:`FlushRequested`; the server answers with :meth:`accept_attach` and
:meth:`finish_detach` once its broker has done its part. The client attaches
with :meth:`attach` and hears back :class:`SessionAttached`,
:class:`SessionDetached`, :class:`Completed`, :class:`Result`,
:class:`Failed` and :class:`FlowNotice`, each naming the session object the
glue registered.

Heartbeats: after the open, ``heartbeat_deadline`` says when to call
:meth:`send_heartbeat`; ``peer_deadline`` says when a silent peer is dead
(twice the interval after the last bytes from it; :meth:`peer_timed_out`).
The same deadline carries the server's other two clocks: before the open,
the handshake's (``negotiate_time`` after the start, qpidd's
--max-negotiate-time); once open without heartbeats, ``idle_timeout`` after
the peer's last bytes. A server that refuses a connection before any of
this (a connection limit) sends :func:`refusal`'s bytes.

Close: whoever decides to end the connection calls :meth:`close` (the
first reason given wins) and, once nothing else is to be written,
:meth:`write_close`. A second wire protocol would be a second module shaped
like this one, with the same events, chosen by the glue from the header.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from qflow.protocol import sasl
from qflow.protocol import spec as P
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, MIN_MAX_FRAME_SIZE, FrameDecoder, FrameEncoder
from qflow.protocol.session_output import SessionOutput

MAX_SESSIONS = 256  # per connection
CHANNELS = 65536  # channel numbers run 0 .. CHANNELS - 1
MECHANISMS = (sasl.ANONYMOUS, *sasl.AUTH_MECHANISMS)  # offered without authentication (--auth no)
CLIENT_MECHANISMS = (*MECHANISMS, sasl.EXTERNAL)  # what a client may ask for
WRONG_PORT_HINT = ("this is an HTTP server (qflowd's management port?), not qflowd's messaging port: "
                   "give the broker's address, port 5672 by default")


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    AWAIT_OPEN = "await-open"  # server: the header and connection.open are due
    OPENING = "opening"  # client: header and connection.open written, open-ok due
    AUTHENTICATING = "authenticating"  # a SASL exchange of more than one message is under way
    OPEN = "open"
    CLOSING = "closing"  # our close is decided; write_close writes its frame, last
    CLOSED = "closed"  # the close frame is written (or the peer's read, or the stream lost): nothing more


class ConnectionEnd(Exception):
    """Input ended the connection: a refusal (the close frame to send is
    recorded), the peer's ``connection.close`` (``by_peer``), a silent peer,
    or the peer's byte stream ending with no close frame (``stream_ended``:
    what a TLS peer that refused this side's certificate does).
    ``code`` and ``text`` say why, as the glue reports it."""

    def __init__(self, code: int, text: str, by_peer: bool = False, stream_ended: bool = False) -> None:
        super().__init__(text)
        self.code = code
        self.text = text
        self.by_peer = by_peer
        self.stream_ended = stream_ended


class AuthFailed(ConnectionEnd):
    """The server refused a client's credentials. The peer is told only
    ``authentication failed``; ``user`` (as the client named it) and
    ``detail`` (why) are for the broker's log."""

    def __init__(self, user: str, detail: str) -> None:
        super().__init__(P.NOT_ALLOWED, sasl.FAILED)
        self.user = user
        self.detail = detail


class LocalProtocolError(Exception):
    """This side asked for something its state does not allow (attach before
    the open, anything after close): a bug of the caller, nothing was written."""


# -- events: one per control frame that asks something of the glue ------------------
class Opened(NamedTuple):
    """The handshake is done. Server: the client's label; client: the broker's name."""

    name: str
    heartbeat: float
    max_frame_size: int
    deliver_runs: bool
    user: str = ""  # the authenticated user ("anonymous" for ANONYMOUS)
    probe: bool = False  # server: the client only reads open-ok and closes (it may attach no session)


class PasswordCheck(NamedTuple):
    """Server, with ``defer_password_checks``: a PLAIN open whose password
    must be checked against ``verifier`` (PBKDF2: milliseconds of CPU, which
    the glue runs off its event loop). The glue answers with
    :meth:`ProtocolConnection.finish_password_check`; until then the
    connection takes no other frame."""

    user: str
    password: str
    verifier: sasl.Verifier
    known: bool  # False: ``verifier`` is an unknown user's decoy, and the check fails whatever it says


class AttachRequested(NamedTuple):
    """Server: answer with accept_attach(channel, your session object)."""

    channel: int
    name: str


class DetachRequested(NamedTuple):
    """Server: the session is gone from ``sessions``; end it, then finish_detach(channel)."""

    channel: int
    session: Any


class FlushRequested(NamedTuple):
    """Server: report the session's completions at the end of this batch."""

    session: Any


class SessionAttached(NamedTuple):
    session: Any


class SessionDetached(NamedTuple):
    session: Any
    code: int
    text: str


class Completed(NamedTuple):
    """session.completed: a flat range list of newly complete command ids."""

    session: Any
    ranges: list[int]


class Result(NamedTuple):
    session: Any
    command_id: int
    value: Any


class Failed(NamedTuple):
    """execution.exception: the command failed (it is then reported complete)."""

    session: Any
    command_id: int
    code: int
    text: str


class FlowNotice(NamedTuple):
    session: Any
    queue: str  # the queue's name, or the holder's when ``holder``
    held: bool
    holder: bool = False  # a broker-wide holder (the memory alarm, the store's disk quota), not a queue


Event = (Opened | AttachRequested | DetachRequested | FlushRequested | SessionAttached | SessionDetached
         | Completed | Result | Failed | FlowNotice)

FRAME_NAMES = {
    P.OPEN: "connection.open", P.OPEN_OK: "connection.open-ok", P.CLOSE: "connection.close",
    P.HEARTBEAT: "heartbeat", P.SASL_CHALLENGE: "sasl challenge", P.SASL_RESPONSE: "sasl response",
    P.ATTACH: "session.attach", P.ATTACHED: "session.attached",
    P.DETACH: "session.detach", P.DETACHED: "session.detached", P.COMPLETED: "session.completed",
    P.FLUSH: "session.flush", P.RESULT: "execution.result", P.EXCEPTION: "execution.exception",
    P.DELIVER: "message.deliver", P.FLOW_NOTICE: "flow notice", P.DELIVER_RUN: "message.deliver-run",
}

# The client's session frames: the fields after [code, channel] and their types.
_SESSION_FRAMES: dict[int, tuple[type, ...]] = {
    P.ATTACHED: (), P.DETACHED: (int, str), P.COMPLETED: (list,), P.RESULT: (int, object),
    P.EXCEPTION: (int, int, str), P.FLOW_NOTICE: (str, bool),
}
# Fields a session frame may add after those: a flow notice's "a holder, not a queue".
_OPTIONAL_FIELDS: dict[int, tuple[type, ...]] = {P.FLOW_NOTICE: (bool,)}


class ProtocolConnection:
    """A qflow connection's protocol state, for either role.

    Feed it what arrives (:meth:`receive_data`, then each control frame of
    ``decoder.frames()`` to :meth:`receive_control`); write what it encodes
    (``encoder``). ``sessions`` maps each attached channel to the glue's own
    session object; the broker's hot path reads it directly.
    """

    def __init__(self, role: Role, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, name: str = "",
                 heartbeat: float = 0, now: float = 0.0, users: sasl.Users | None = None,
                 secret: bytes = b"", username: str | None = None, password: str = "",
                 mechanism: str | None = None, announce: dict[str, Any] | None = None, negotiate_time: float = 0.0,
                 idle_timeout: float = 0.0, admit: Callable[[str], str | None] | None = None,
                 probe: bool = False) -> None:
        """A server (``max_frame_size``: its own limit; ``users``: check
        credentials against them, None: authentication off; ``secret``: for
        the decoys of unknown users) waits for the client. A client
        (``name``, ``heartbeat`` and ``max_frame_size``: what it asks for;
        ``username`` and ``password``, with SCRAM-SHA-256 unless
        ``mechanism`` says PLAIN; no username: ANONYMOUS) writes its header
        and ``connection.open`` at once.

        ``announce`` (server): extra properties of ``connection.open-ok``, read
        when the open is answered (so the glue may fill it in later), such as
        ``management_port``: how the tools find the management API from the
        broker's one address. ``negotiate_time`` (seconds, 0: none) is how
        long a server gives the handshake, authentication included;
        ``idle_timeout`` (0: none) how long a peer that negotiated no
        heartbeat may send nothing. ``admit(user)``, once a server knows who
        the client is, says why it may not connect (a per-user limit), or None.
        ``probe`` (client): the connection only reads the broker's open-ok
        and closes; it says so in its open, and may attach no session."""
        self.role = role
        self.announce = announce if announce is not None else {}
        self.peer_properties: dict[str, Any] = {}  # a client: the broker's open-ok options
        self.users = users
        self.secret = secret
        self.user = ""  # who the connection is authenticated as, once open
        self.mechanism = ""
        self.peer_identity: str | None = None  # server: a verified TLS client certificate's name (EXTERNAL)
        self._scram_server: sasl.ScramServer | None = None
        self._scram_client: sasl.ScramClient | None = None
        self._open_options: tuple[str, float, int, bool] = ("", 0, max_frame_size, False)
        self.max_frame_size = max_frame_size
        self.name = name  # this connection's label (a server learns it from the open)
        self.peer_name = ""  # a client learns the broker's name from the open-ok
        self.heartbeat = heartbeat  # negotiated once open (a client's request until then; a server's 0)
        self.deliver_runs = False
        self.probe = probe  # a server learns it from the open
        # A broker guards against what untrusted peers' arrays claim (framing.CLAIMED_ARRAY_LEN).
        self.decoder = FrameDecoder(max_frame_size, expect_header=role is Role.SERVER, guard_claims=role is Role.SERVER)
        # Server: hand PLAIN's password check to the glue (PasswordCheck) instead of hashing inline.
        self.defer_password_checks = False
        self._password_check: PasswordCheck | None = None
        self.encoder = FrameEncoder()
        self.sessions: dict[int, Any] = {}
        self.close_frame: list[Any] | None = None
        self._table = _TABLES[role]
        self._heard_at = now  # when bytes last came from the peer
        self.negotiate_time = negotiate_time
        self._open_by = now + negotiate_time if negotiate_time else math.inf
        self.idle_timeout = idle_timeout
        self._admit = admit
        self._beat_due = math.inf
        self._attaching: set[int] = set()  # client: attach sent, attached not yet heard
        self._next_channel = 0
        if role is Role.SERVER:
            self.state = State.AWAIT_OPEN
        else:
            self.state = State.OPENING
            self.deliver_runs = True
            self.encoder.write_header()
            opts: dict[str, Any] = {"mechanism": self._client_mechanism(username, password, mechanism)}
            if self.mechanism == sasl.SCRAM_SHA_256:
                self._scram_client = sasl.ScramClient(username or "", password)
                opts["response"] = self._scram_client.first()
            elif self.mechanism == sasl.PLAIN:
                opts["response"] = sasl.plain_response(username or "", password)
            elif self.mechanism == sasl.EXTERNAL:
                opts["response"] = b""  # no authorisation identity: the certificate's name is the user
            opts.update(name=name, heartbeat=heartbeat, max_frame_size=max_frame_size, deliver_runs=True)
            if probe:
                opts["probe"] = True
            self.encoder.write([P.OPEN, opts])

    def _client_mechanism(self, username: str | None, password: str, mechanism: str | None) -> str:
        if mechanism is None:
            mechanism = sasl.ANONYMOUS if username is None else sasl.SCRAM_SHA_256
        if mechanism not in CLIENT_MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(CLIENT_MECHANISMS)}, not {mechanism!r}")
        if (mechanism in (sasl.ANONYMOUS, sasl.EXTERNAL)) != (username is None):
            raise ValueError(f"{mechanism} {'takes no' if username is not None else 'needs a'} username")
        self.mechanism = mechanism
        return mechanism

    def set_peer_identity(self, name: str) -> None:
        """Server: the name of the client certificate TLS verified (the glue's
        to hand in before the open arrives): EXTERNAL is offered, as that user."""
        self.peer_identity = name

    # -- input --------------------------------------------------------------------
    def receive_data(self, data: bytes, now: float) -> None:
        """Bytes from the peer; ``b""`` when its stream ended (as h11 takes it):
        that raises ConnectionEnd, with nothing to write. Raises FramingError
        for bytes that are not a qflow stream (see :meth:`malformed`)."""
        if not data:
            self.connection_lost()
            raise ConnectionEnd(P.CONNECTION_FORCED, _EOF_TEXT[self.role], by_peer=True, stream_ended=True)
        if self.state is State.OPENING and data.startswith(b"HTTP/"):
            # The commonest mistake of all: the management port given for the messaging one.
            self.connection_lost()
            raise ConnectionEnd(P.CONNECTION_FORCED, WRONG_PORT_HINT)
        self._heard_at = now
        self.decoder.feed(data)

    def receive_control(self, frame: list[Any]) -> Event | None:
        """Apply one control frame (code < FIRST_COMMAND, or any code the
        glue does not take itself); returns the event for the glue, if any.
        Raises ConnectionEnd when the frame ends the connection."""
        handler = self._table.get((self.state, frame[0]))
        if handler is not None:
            return handler(self, frame)
        default = _DEFAULTS[self.role, self.state]
        if default is None:
            return None
        code, text = default
        raise self._refuse(code, text.format(code=frame[0]))

    def no_session(self, frame: list[Any]) -> ConnectionEnd:
        """The refusal of a frame for a channel with no attached session."""
        channel = frame[1] if len(frame) > 1 else None
        name = FRAME_NAMES.get(frame[0]) or P.command_name(frame[0])
        return self._refuse(P.COMMAND_INVALID, f"{name} on channel {channel!r}, which has no attached session")

    def malformed(self, exc: Exception) -> ConnectionEnd:
        """The refusal of bytes that are not a qflow stream (a FramingError,
        or on the client an EntryError of a delivery run). A server answers a
        bad header with its own header first, as AMQP does."""
        code = getattr(exc, "code", P.FRAMING_ERROR)
        if self.role is Role.CLIENT:
            return self._refuse(code, f"bad data from the broker: {exc}")
        if not self.decoder.header_done and self.state is State.AWAIT_OPEN:
            self.encoder.write_header()
        return self._refuse(code, str(exc))

    # -- handshake ---------------------------------------------------------------
    def _server_open(self, frame: list[Any]) -> Opened:
        opts = frame[1] if len(frame) == 2 else None
        if type(opts) is not dict:
            raise self._refuse(P.COMMAND_INVALID, "connection.open must be [0, {options}]")
        name = opts.get("name", "")
        heartbeat = opts.get("heartbeat", 0)
        max_frame = opts.get("max_frame_size", self.max_frame_size)
        deliver_runs = opts.get("deliver_runs", False)
        probe = opts.get("probe", False)
        if (type(name) is not str or type(heartbeat) not in (int, float) or type(max_frame) is not int
                or type(deliver_runs) is not bool or type(probe) is not bool):
            raise self._refuse(P.COMMAND_INVALID, "connection.open: name must be a string, heartbeat a number, "
                               "max_frame_size an int, deliver_runs and probe booleans")
        self.probe = probe
        if math.isnan(heartbeat) or heartbeat < 0 or max_frame < MIN_MAX_FRAME_SIZE:  # NaN: no timer takes it
            raise self._refuse(P.COMMAND_INVALID, f"connection.open: heartbeat must be >= 0 and max_frame_size "
                               f">= {MIN_MAX_FRAME_SIZE}")
        self._open_options = (name, heartbeat, min(max_frame, self.max_frame_size), deliver_runs)
        return self._authenticate(opts.get("mechanism", sasl.ANONYMOUS), opts.get("response", b""))

    # -- authentication: server ---------------------------------------------------------
    def _authenticate(self, mechanism: Any, response: Any) -> Opened | PasswordCheck | None:
        """The open's credentials: open-ok (Opened), or a SCRAM challenge
        (None: AUTHENTICATING), or a PLAIN password for the glue to check
        (PasswordCheck, with ``defer_password_checks``), or a refusal."""
        offered = MECHANISMS if self.users is None else sasl.AUTH_MECHANISMS
        if self.peer_identity:
            offered = (*offered, sasl.EXTERNAL)
        if mechanism not in offered:
            if mechanism == sasl.EXTERNAL:
                raise self._refuse(P.NOT_ALLOWED, "EXTERNAL needs a TLS connection with a client certificate the "
                                   f"broker verified (offered: {', '.join(offered)})")
            # An old client sends no mechanism: it meant ANONYMOUS, and hears what is offered instead.
            if self.users is not None and mechanism == sasl.ANONYMOUS:
                raise self._refuse(P.NOT_ALLOWED, "authentication required: ANONYMOUS is not offered "
                                   f"(offered: {', '.join(offered)})")
            raise self._refuse(P.NOT_ALLOWED, f"authentication mechanism {mechanism!r:.40} is not supported "
                               f"({', '.join(offered)})")
        if type(response) is not bytes:
            raise self._refuse(P.COMMAND_INVALID, "connection.open: response must be bytes")
        self.mechanism = mechanism
        scram: sasl.ScramServer | None = None
        try:
            if mechanism == sasl.ANONYMOUS:
                return self._negotiate("anonymous")
            if mechanism == sasl.EXTERNAL:
                return self._negotiate(sasl.external_user(self.peer_identity, response))
            if mechanism == sasl.PLAIN:
                user, password = sasl.parse_plain(response)
                if self.users is not None:
                    check = self._check_plain(user, password)
                    if check is not None:
                        return check  # type: ignore[return-value]
                return self._negotiate(user)
            scram = sasl.ScramServer(self.users or _NO_USERS, self.secret)
            challenge = scram.first(response)
            if self.users is None:  # nothing to check: believed, as PLAIN is
                return self._negotiate(scram.user)
            self._scram_server = scram
            self.encoder.write([P.SASL_CHALLENGE, challenge])
            self.state = State.AUTHENTICATING
            return None
        except sasl.AuthError as exc:
            raise self._auth_failed(scram.user if scram is not None else "", exc.detail) from None

    def _check_plain(self, user: str, password: str) -> PasswordCheck | None:
        verifier = self.users.verifier(user)
        # An unknown user costs the same hashing as a known one: the time taken tells nothing.
        decoy = verifier or sasl.decoy_verifier(user, self.secret, self.users.usual_iterations)
        check = self._password_check = PasswordCheck(user, password, decoy, verifier is not None)
        if self.defer_password_checks:
            return check
        self.finish_password_check(sasl.check_password(decoy, password))
        return None

    def finish_password_check(self, matches: bool) -> Opened | None:
        """Server: the result of the :class:`PasswordCheck` handed out (whether
        the password matches its verifier). Returns Opened (the open-ok is
        written), or raises AuthFailed (the close is recorded)."""
        check, self._password_check = self._password_check, None
        if check is None:
            raise LocalProtocolError("finish_password_check() with no password check under way")
        if not check.known or not matches:
            raise self._auth_failed(check.user, "unknown user" if not check.known else "wrong password")
        return self._negotiate(check.user) if self.defer_password_checks else None

    @property
    def password_check_pending(self) -> bool:
        return self._password_check is not None

    def _server_sasl_response(self, frame: list[Any]) -> Opened:
        scram = self._scram_server
        if len(frame) != 2 or type(frame[1]) is not bytes:
            raise self._auth_failed(scram.user, f"malformed sasl response {frame!r:.60}")
        try:
            server_final = scram.final(frame[1])
        except sasl.AuthError as exc:
            raise self._auth_failed(scram.user, exc.detail) from None
        self._scram_server = None
        return self._negotiate(scram.user, server_final)

    def _auth_failed(self, user: str, detail: str) -> AuthFailed:
        self.close(P.NOT_ALLOWED, sasl.FAILED)
        return AuthFailed(user, detail)

    def _negotiate(self, user: str, server_final: bytes | None = None) -> Opened:
        """Server: the open is accepted and authenticated: answer it, unless
        ``admit`` refuses the user (506, with its reason)."""
        if self._admit is not None:
            reason = self._admit(user)
            if reason is not None:
                raise self._refuse(P.RESOURCE_LIMIT_EXCEEDED, reason)
        name, heartbeat, max_frame_size, deliver_runs = self._open_options
        self.name = name
        self.user = user
        self.max_frame_size = max_frame_size
        self.deliver_runs = deliver_runs
        self.decoder.set_max_frame_size(max_frame_size)
        opts = {**self.announce, "heartbeat": heartbeat, "max_frame_size": max_frame_size, "broker": "qflow",
                "user": user}
        if server_final is not None:
            opts["sasl"] = server_final
        self.encoder.write([P.OPEN_OK, opts])
        return self._opened(heartbeat, name)

    def _client_open_ok(self, frame: list[Any]) -> Opened:
        opts = frame[1] if len(frame) == 2 else None
        if type(opts) is not dict:
            raise self._refuse(P.FRAMING_ERROR, "connection.open-ok must be [1, {options}]")
        max_frame = opts.get("max_frame_size", self.max_frame_size)
        heartbeat = opts.get("heartbeat", self.heartbeat)
        name = opts.get("broker", "")
        user = opts.get("user", "")
        if type(max_frame) is not int or type(heartbeat) not in (int, float) or type(name) is not str \
                or math.isnan(heartbeat) or heartbeat < 0 or type(user) is not str:
            raise self._refuse(P.FRAMING_ERROR, f"connection.open-ok: bad options {opts!r:.80}")
        if self.state is State.AUTHENTICATING:
            # The broker proves it knows this user's verifier: an impostor cannot.
            server_final = opts.get("sasl")
            try:
                self._scram_client.verify(server_final if type(server_final) is bytes else b"")
            except sasl.AuthError as exc:
                raise self._refuse(P.NOT_ALLOWED, exc.text) from None
        # A broker with authentication off (--auth no) opens a SCRAM connection without the exchange.
        self._scram_client = None
        self.user = user
        # The decoder keeps the limit this client asked for: a delivery can be a
        # few dozen bytes longer than the largest transfer the broker takes.
        self.max_frame_size = max_frame
        self.peer_name = name
        self.peer_properties = opts
        return self._opened(heartbeat, name)

    def _client_challenge(self, frame: list[Any]) -> None:
        if self._scram_client is None or self.state is not State.OPENING:
            raise self._refuse(P.FRAMING_ERROR, f"unexpected sasl challenge from the broker ({self.mechanism})")
        if len(frame) != 2 or type(frame[1]) is not bytes:
            raise self._refuse(P.FRAMING_ERROR, f"malformed sasl challenge from the broker: {frame!r:.80}")
        try:
            self.encoder.write([P.SASL_RESPONSE, self._scram_client.final(frame[1])])
        except sasl.AuthError as exc:
            raise self._refuse(P.NOT_ALLOWED, exc.text) from None
        self.state = State.AUTHENTICATING

    def _opened(self, heartbeat: float, name: str) -> Opened:
        self.heartbeat = heartbeat
        self.state = State.OPEN
        if heartbeat:
            self._beat_due = self._heard_at + self.heartbeat_interval
        return Opened(name, heartbeat, self.max_frame_size, self.deliver_runs, self.user, self.probe)

    # -- sessions: server ------------------------------------------------------------
    def _server_attach(self, frame: list[Any]) -> AttachRequested:
        if len(frame) != 3 or type(frame[1]) is not int or type(frame[2]) is not str:
            raise self._refuse(P.COMMAND_INVALID, "session.attach must be [10, channel, name]")
        channel = frame[1]
        if self.probe:  # what makes a probe's quieter log safe: it can do nothing but connect
            raise self._refuse(P.COMMAND_INVALID, "session.attach on a probe connection (its open said probe)")
        if channel in self.sessions:
            raise self._refuse(P.COMMAND_INVALID, f"session.attach: channel {channel} is already attached")
        if len(self.sessions) >= MAX_SESSIONS or not 0 <= channel < CHANNELS:
            raise self._refuse(P.RESOURCE_LIMIT_EXCEEDED,
                               f"session.attach: channel {channel} out of range or too many sessions")
        self.sessions[channel] = None  # taken: accept_attach puts the session here
        return AttachRequested(channel, frame[2])

    def session_output(self, channel: int, wake: Callable[[], None]) -> SessionOutput:
        """Server: the output of the session attaching on ``channel``, for the
        broker to tell it things: qflow frames into this connection's encoder,
        as negotiated (frame size, deliver-run frames)."""
        return SessionOutput(channel, self.encoder, wake, self.deliver_runs, self.max_frame_size)

    def accept_attach(self, channel: int, session: Any) -> None:
        """Server: the session for an AttachRequested; writes session.attached."""
        if self.sessions.get(channel, _NONE) is not None:
            raise LocalProtocolError(f"no attach of channel {channel} is waiting")
        self.sessions[channel] = session
        self.encoder.write([P.ATTACHED, channel])

    def _server_detach(self, frame: list[Any]) -> DetachRequested:
        ssn = self.sessions.pop(frame[1], None) if len(frame) == 2 and type(frame[1]) is int else None
        if ssn is None:
            raise self._refuse(P.COMMAND_INVALID, f"session.detach: bad frame or no session: {frame!r:.80}")
        return DetachRequested(frame[1], ssn)

    def finish_detach(self, channel: int) -> None:
        """Server: the detached session is ended; writes session.detached."""
        self.encoder.write([P.DETACHED, channel, P.NORMAL, "detached"])

    def _server_flush(self, frame: list[Any]) -> FlushRequested:
        ssn = self.sessions.get(frame[1]) if len(frame) == 2 and type(frame[1]) is int else None
        if ssn is None:
            raise self._refuse(P.COMMAND_INVALID, f"session.flush: bad frame or no session: {frame!r:.80}")
        return FlushRequested(ssn)

    # -- sessions: client --------------------------------------------------------------
    def attach(self, name: str, session: Any) -> int:
        """Client: attach ``session`` on the next channel (returned); writes
        session.attach. SessionAttached follows when the broker answers."""
        self._require_open("attach a session")
        channel = self._next_channel
        self._next_channel += 1
        self.sessions[channel] = session
        self._attaching.add(channel)
        self.encoder.write([P.ATTACH, channel, name])
        return channel

    def detach(self, channel: int) -> None:
        """Client: ask the broker to end the session on ``channel``."""
        self._require_open("detach a session")
        if channel not in self.sessions:
            raise LocalProtocolError(f"no session on channel {channel}")
        self.encoder.write([P.DETACH, channel])

    def flush(self, channel: int) -> None:
        """Client: ask for the session's completion report now."""
        self._require_open("flush a session")
        self.encoder.write([P.FLUSH, channel])

    def _client_session_frame(self, frame: list[Any]) -> Event:
        code = frame[0]
        types = _SESSION_FRAMES[code]
        if len(frame) != 2 + len(types):
            types += _OPTIONAL_FIELDS.get(code, ())[:len(frame) - 2 - len(types)]
        if len(frame) != 2 + len(types) or any(t is not object and type(v) is not t
                                               for t, v in zip(types, frame[2:], strict=True)):
            raise self._refuse(P.FRAMING_ERROR, f"malformed {FRAME_NAMES[code]} from the broker: {frame!r:.80}")
        channel = frame[1]
        ssn = self.sessions.get(channel) if type(channel) is int else None
        if ssn is None or (code == P.ATTACHED) != (channel in self._attaching):
            if ssn is not None:
                raise self._refuse(P.COMMAND_INVALID, f"{FRAME_NAMES[code]} on channel {channel}, which is "
                                   f"{'not yet' if code != P.ATTACHED else 'already'} attached")
            raise self.no_session(frame)
        if code == P.COMPLETED:
            return Completed(ssn, frame[2])
        if code == P.RESULT:
            return Result(ssn, frame[2], frame[3])
        if code == P.EXCEPTION:
            return Failed(ssn, frame[2], frame[3], frame[4])
        if code == P.FLOW_NOTICE:
            return FlowNotice(ssn, frame[2], frame[3], len(frame) > 4 and frame[4])
        if code == P.ATTACHED:
            self._attaching.discard(channel)
            return SessionAttached(ssn)
        del self.sessions[channel]
        return SessionDetached(ssn, frame[2], frame[3])

    # -- heartbeats ---------------------------------------------------------------
    @property
    def heartbeat_interval(self) -> float:
        """Seconds between the heartbeats this side sends (0: none). A server
        sends at most one a second: a client asking for less cannot make it spin."""
        if not self.heartbeat:
            return 0
        return max(self.heartbeat, 1.0) if self.role is Role.SERVER else self.heartbeat

    @property
    def heartbeat_deadline(self) -> float:
        """When :meth:`send_heartbeat` is next due (inf: never, or not yet open)."""
        return self._beat_due

    def send_heartbeat(self, now: float) -> bool:
        """Write a heartbeat, unless the connection is no longer open (then
        nothing, and False: the glue's heartbeat task can end)."""
        if self.state is not State.OPEN:
            self._beat_due = math.inf
            return False
        self.encoder.write([P.HEARTBEAT])
        self._beat_due = now + self.heartbeat_interval
        return True

    @property
    def peer_deadline(self) -> float:
        """When a peer that sends nothing more counts as dead: before the
        open, the handshake's deadline (``negotiate_time`` after the start);
        once open, twice the heartbeat after the last bytes from it, or
        without heartbeats ``idle_timeout`` after them (inf if neither)."""
        beat = self._heard_at + 2 * self.heartbeat if self.heartbeat else math.inf
        if self.state in _NEGOTIATING:
            return min(self._open_by, beat)
        if self.heartbeat:
            return beat
        return self._heard_at + self.idle_timeout if self.idle_timeout else math.inf

    def kept_waiting(self, now: float) -> None:
        """We read nothing from the peer until ``now`` (a long command of its
        own held its later frames back): that silence is ours, not the peer's."""
        if now > self._heard_at:
            self._heard_at = now

    def _heartbeat(self, frame: list[Any]) -> None:
        return None  # receive_data has noted the time

    def peer_timed_out(self) -> ConnectionEnd:
        """The refusal of a peer silent past ``peer_deadline``."""
        timeout = self.heartbeat * 2
        if self.state in _NEGOTIATING and self._open_by <= self.peer_deadline:
            return self._refuse(P.CONNECTION_FORCED, f"handshake not finished within {self.negotiate_time:g} "
                                "seconds (--max-negotiate-time)")
        if self.role is Role.SERVER:
            if not self.heartbeat:
                return self._refuse(P.CONNECTION_FORCED, f"no frame for {self.idle_timeout:g} seconds "
                                    "(--idle-timeout)")
            return self._refuse(P.CONNECTION_FORCED, f"no frame for {timeout} seconds (heartbeat)")
        return self._refuse(P.CONNECTION_FORCED, f"no frame from the broker for {timeout} s")

    # -- close ----------------------------------------------------------------------
    def close(self, code: int, text: str) -> None:
        """End the connection with ``connection.close`` [code, text]. The
        frame is written by :meth:`write_close`, after everything else; the
        first reason given is the one sent."""
        if self.state is State.CLOSED:
            return
        if self.close_frame is None:
            self.close_frame = [P.CLOSE, code, text]
        self.state = State.CLOSING

    def write_close(self) -> bool:
        """Write the close frame, if one was decided, as the last frame; True
        if it was written. The connection is then CLOSED and encodes nothing more."""
        written = self.state is not State.CLOSED and self.close_frame is not None
        if written:
            self.encoder.write(self.close_frame)
        self.state = State.CLOSED
        self._beat_due = math.inf
        return written

    def connection_lost(self) -> None:
        """The stream ended or broke: CLOSED, with nothing more to write."""
        self.state = State.CLOSED
        self._beat_due = math.inf

    def _peer_close(self, frame: list[Any]) -> None:
        if self.role is Role.SERVER:
            self.close(P.NORMAL, "closed by the client")
            raise ConnectionEnd(P.NORMAL, "closed by the client", by_peer=True)
        code, text = (frame[1], frame[2]) if len(frame) == 3 else (P.FRAMING_ERROR, f"malformed {frame!r:.80}")
        self.connection_lost()  # a client does not answer: the broker closes the socket
        raise ConnectionEnd(code, text, by_peer=True)

    def _refuse_twice(self, frame: list[Any]) -> None:
        raise self._refuse(P.COMMAND_INVALID, "connection.open sent twice")

    def _refuse(self, code: int, text: str) -> ConnectionEnd:
        self.close(code, text)
        return ConnectionEnd(code, text)

    def _require_open(self, what: str) -> None:
        if self.state is not State.OPEN:
            raise LocalProtocolError(f"cannot {what}: the connection is {self.state.value}")

    @property
    def is_open(self) -> bool:
        return self.state is State.OPEN


def refusal(code: int, text: str) -> bytes:
    """Server: the bytes that refuse a connection before its handshake has
    begun (a limit is reached): ``connection.close`` [code, text], which a
    client in OPENING reads as the broker's close."""
    encoder = FrameEncoder()
    encoder.write([P.CLOSE, code, text])
    return encoder.take()


_NONE = object()


class _NoUsers:
    """With authentication off a SCRAM exchange is not run: its first message only names the user."""

    usual_iterations = sasl.DEFAULT_ITERATIONS

    def verifier(self, user: str) -> None:
        return None


_NO_USERS = _NoUsers()
_NEGOTIATING = (State.AWAIT_OPEN, State.OPENING, State.AUTHENTICATING)
_EOF_TEXT = {Role.SERVER: "connection closed by the client", Role.CLIENT: "connection closed by the broker"}
_C = ProtocolConnection
Handler = Callable[[ProtocolConnection, list[Any]], Any]

# role -> state -> frame code -> handler: every transition there is.
_TRANSITIONS: dict[Role, dict[State, dict[int, Handler]]] = {
    Role.SERVER: {
        State.AWAIT_OPEN: {P.OPEN: _C._server_open},
        State.AUTHENTICATING: {P.SASL_RESPONSE: _C._server_sasl_response, P.CLOSE: _C._peer_close},
        State.OPEN: {P.HEARTBEAT: _C._heartbeat, P.ATTACH: _C._server_attach, P.DETACH: _C._server_detach,
                     P.FLUSH: _C._server_flush, P.CLOSE: _C._peer_close, P.OPEN: _C._refuse_twice},
    },
    Role.CLIENT: {
        State.OPENING: {P.OPEN_OK: _C._client_open_ok, P.CLOSE: _C._peer_close,
                        P.SASL_CHALLENGE: _C._client_challenge},
        State.AUTHENTICATING: {P.OPEN_OK: _C._client_open_ok, P.CLOSE: _C._peer_close},
        State.OPEN: {P.HEARTBEAT: _C._heartbeat, P.CLOSE: _C._peer_close,
                     **dict.fromkeys(_SESSION_FRAMES, _C._client_session_frame)},
        # After our close only the broker's counts: it ends the connection.
        State.CLOSING: {P.CLOSE: _C._peer_close}, State.CLOSED: {P.CLOSE: _C._peer_close},
    },
}

# A control frame with no row gets its role and state's default: refused with
# (code, text), or ignored (None; what comes after our close is not acted on).
_UNEXPECTED = (P.FRAMING_ERROR, "unexpected frame code {code} from the broker")
_DEFAULTS: dict[tuple[Role, State], tuple[int, str] | None] = {
    (Role.SERVER, State.AWAIT_OPEN): (P.COMMAND_INVALID, "expected connection.open first, got frame code {code}"),
    (Role.SERVER, State.AUTHENTICATING): (P.COMMAND_INVALID, "authentication in progress, got frame code {code}"),
    (Role.SERVER, State.OPEN): (P.COMMAND_INVALID, "unknown frame code {code}"),
    **{(Role.CLIENT, state): _UNEXPECTED for state in (State.OPENING, State.AUTHENTICATING, State.OPEN)},
    **{(role, state): None for role in Role for state in (State.CLOSING, State.CLOSED)},
}

# The table as each role looks it up: (state, frame code) -> handler.
_TABLES: dict[Role, dict[tuple[State, int], Handler]] = {
    role: {(state, code): handler for state, row in states.items() for code, handler in row.items()}
    for role, states in _TRANSITIONS.items()
}
