"""The connection state machine (qflow.protocol.connection), both roles, with
no sockets and no clock: every transition, every refusal with its code and
text, heartbeat deadlines, and the close frame written last."""

from __future__ import annotations

import math

import msgpack
import pytest

from qflow import protocol as P
from qflow.protocol import encodings as enc
from qflow.protocol.connection import (
    _DEFAULTS,
    _TRANSITIONS,
    MAX_SESSIONS,
    AttachRequested,
    Completed,
    ConnectionEnd,
    DetachRequested,
    Failed,
    FlowNotice,
    FlushRequested,
    LocalProtocolError,
    Opened,
    ProtocolConnection,
    Result,
    Role,
    SessionAttached,
    SessionDetached,
    State,
)
from qflow.protocol.entries import scan_entries_python
from qflow.protocol.framing import PROTOCOL_HEADER, FrameTooLarge, FramingError

pack = msgpack.packb


def written(conn: ProtocolConnection) -> list[list]:
    """The frames ``conn`` has encoded since the last call (a header first, if any, as b"header")."""
    data = conn.encoder.take()
    frames: list = []
    if data.startswith(PROTOCOL_HEADER):
        frames.append(b"header")
        data = data[len(PROTOCOL_HEADER):]
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return frames + list(unpacker)


def feed(conn: ProtocolConnection, *frames: list, now: float = 0.0) -> list:
    """Feed ``frames`` and pass each to receive_control, as the glue does; the events."""
    conn.receive_data(b"".join(pack(f) for f in frames), now)
    return [conn.receive_control(f) for f in conn.decoder.frames()]


def refused(conn: ProtocolConnection, frame: list) -> ConnectionEnd:
    with pytest.raises(ConnectionEnd) as info:
        feed(conn, frame)
    assert conn.state is State.CLOSING
    assert conn.close_frame == [P.CLOSE, info.value.code, info.value.text]
    return info.value


# -- server ------------------------------------------------------------------------------
def server(opts: dict | None = None, max_frame_size: int = 1 << 20, now: float = 0.0) -> ProtocolConnection:
    conn = ProtocolConnection(Role.SERVER, max_frame_size=max_frame_size)
    conn.receive_data(PROTOCOL_HEADER, now)
    if opts is not None:
        assert feed(conn, [P.OPEN, opts], now=now)[0].__class__ is Opened
        written(conn)
    return conn


def test_server_open_negotiates_and_answers():
    conn = server()
    assert conn.state is State.AWAIT_OPEN and written(conn) == []
    [event] = feed(conn, [P.OPEN, {"mechanism": "ANONYMOUS", "name": "me", "heartbeat": 5, "max_frame_size": 65536,
                                   "deliver_runs": True}])
    assert event == Opened("me", 5, 65536, True, "anonymous")
    assert conn.state is State.OPEN and conn.is_open
    assert written(conn) == [[P.OPEN_OK, {"heartbeat": 5, "max_frame_size": 65536, "broker": "qflow",
                                          "user": "anonymous"}]]
    assert conn.decoder.max_frame_size == 65536
    # The defaults: no heartbeat, the server's own limit, single deliveries.
    conn = server()
    assert feed(conn, [P.OPEN, {}]) == [Opened("", 0, 1 << 20, False, "anonymous")]


def test_server_takes_the_smaller_frame_size():
    conn = server(max_frame_size=8192)
    assert feed(conn, [P.OPEN, {"max_frame_size": 1 << 20}])[0].max_frame_size == 8192
    assert conn.max_frame_size == conn.decoder.max_frame_size == 8192


@pytest.mark.parametrize("frame, code, text", [
    ([P.OPEN], P.COMMAND_INVALID, "connection.open must be [0, {options}]"),
    ([P.OPEN, []], P.COMMAND_INVALID, "connection.open must be [0, {options}]"),
    ([P.OPEN, {}, 1], P.COMMAND_INVALID, "connection.open must be [0, {options}]"),
    ([P.OPEN, {"mechanism": "KERBEROS"}], P.NOT_ALLOWED,
     "authentication mechanism 'KERBEROS' is not supported (ANONYMOUS, SCRAM-SHA-256, PLAIN)"),
    *[([P.OPEN, opts], P.COMMAND_INVALID, "connection.open: name must be a string, heartbeat a number, "
       "max_frame_size an int, deliver_runs and probe booleans")
      for opts in ({"name": 1}, {"heartbeat": "1"}, {"max_frame_size": "big"}, {"max_frame_size": 1.5e6},
                   {"deliver_runs": 1}, {"heartbeat": True})],
    *[([P.OPEN, opts], P.COMMAND_INVALID, "connection.open: heartbeat must be >= 0 and max_frame_size >= 4096")
      for opts in ({"heartbeat": math.nan}, {"heartbeat": -1}, {"max_frame_size": 100})],
    ([P.ATTACH, 0, "early"], P.COMMAND_INVALID, "expected connection.open first, got frame code 10"),
    ([P.CLOSE, 200, "bye"], P.COMMAND_INVALID, "expected connection.open first, got frame code 2"),
    ([P.HEARTBEAT], P.COMMAND_INVALID, "expected connection.open first, got frame code 3"),
])
def test_server_refusals_before_open(frame, code, text):
    conn = server()
    err = refused(conn, frame)
    assert (err.code, err.text, err.by_peer) == (code, text, False)
    assert written(conn) == []  # the close frame waits for write_close
    conn.write_close()
    assert written(conn) == [[P.CLOSE, code, text]]


def test_server_answers_a_bad_header_with_its_own():
    conn = ProtocolConnection(Role.SERVER)
    with pytest.raises(FramingError) as info:
        conn.receive_data(b"AMQP\x00\x00\x09\x01", 0.0)
    end = conn.malformed(info.value)
    assert end.code == P.FRAMING_ERROR and "bad protocol header" in end.text
    conn.write_close()
    assert written(conn) == [b"header", [P.CLOSE, P.FRAMING_ERROR, end.text]]


def test_server_refuses_an_oversized_frame_with_506():
    conn = server({"max_frame_size": 4096})
    with pytest.raises(FrameTooLarge) as info:
        feed(conn, [P.QUEUE_DECLARE, 0, "x" * 5000])
    end = conn.malformed(info.value)
    assert end.code == P.RESOURCE_LIMIT_EXCEEDED
    conn.write_close()
    assert written(conn) == [[P.CLOSE, P.RESOURCE_LIMIT_EXCEEDED, end.text]]  # no header: it was fine


def test_server_attach_detach_flush():
    conn = server({})
    assert feed(conn, [P.ATTACH, 3, "a"]) == [AttachRequested(3, "a")]
    assert conn.sessions == {3: None}  # the channel is taken until the glue accepts
    conn.accept_attach(3, "session-a")
    assert written(conn) == [[P.ATTACHED, 3]]
    assert conn.sessions == {3: "session-a"}
    with pytest.raises(LocalProtocolError):
        conn.accept_attach(3, "again")
    assert feed(conn, [P.FLUSH, 3]) == [FlushRequested("session-a")]
    assert feed(conn, [P.HEARTBEAT]) == [None]
    assert written(conn) == []
    assert feed(conn, [P.DETACH, 3]) == [DetachRequested(3, "session-a")]
    assert conn.sessions == {}
    assert written(conn) == []  # the broker ends the session first
    conn.finish_detach(3)
    assert written(conn) == [[P.DETACHED, 3, P.NORMAL, "detached"]]
    # A detached channel can be attached again.
    assert feed(conn, [P.ATTACH, 3, "b"]) == [AttachRequested(3, "b")]


@pytest.mark.parametrize("frame, code, text", [
    ([P.ATTACH, "zero", "x"], P.COMMAND_INVALID, "session.attach must be [10, channel, name]"),
    ([P.ATTACH, 1], P.COMMAND_INVALID, "session.attach must be [10, channel, name]"),
    ([P.ATTACH, 1, 2], P.COMMAND_INVALID, "session.attach must be [10, channel, name]"),
    ([P.ATTACH, 0, "again"], P.COMMAND_INVALID, "session.attach: channel 0 is already attached"),
    ([P.ATTACH, 65536, "x"], P.RESOURCE_LIMIT_EXCEEDED,
     "session.attach: channel 65536 out of range or too many sessions"),
    ([P.ATTACH, -1, "x"], P.RESOURCE_LIMIT_EXCEEDED, "session.attach: channel -1 out of range or too many sessions"),
    ([P.DETACH, 7], P.COMMAND_INVALID, "session.detach: bad frame or no session: [12, 7]"),
    ([P.DETACH, [0]], P.COMMAND_INVALID, "session.detach: bad frame or no session: [12, [0]]"),
    ([P.DETACH, 0, 1], P.COMMAND_INVALID, "session.detach: bad frame or no session: [12, 0, 1]"),
    ([P.FLUSH, 7], P.COMMAND_INVALID, "session.flush: bad frame or no session: [15, 7]"),
    ([P.FLUSH, []], P.COMMAND_INVALID, "session.flush: bad frame or no session: [15, []]"),
    ([P.OPEN, {}], P.COMMAND_INVALID, "connection.open sent twice"),
    ([25], P.COMMAND_INVALID, "unknown frame code 25"),
    ([9, 0], P.COMMAND_INVALID, "unknown frame code 9"),
    ([-1], P.COMMAND_INVALID, "unknown frame code -1"),
    ([P.DELIVER_RUN, 0], P.COMMAND_INVALID, "unknown frame code 20"),
    ([P.OPEN_OK, {}], P.COMMAND_INVALID, "unknown frame code 1"),
])
def test_server_refusals_when_open(frame, code, text):
    conn = server({})
    feed(conn, [P.ATTACH, 0, "s"])
    conn.accept_attach(0, "s")
    written(conn)
    err = refused(conn, frame)
    assert (err.code, err.text) == (code, text)


def test_server_refuses_the_257th_session():
    conn = server({})
    for channel in range(MAX_SESSIONS):
        feed(conn, [P.ATTACH, channel, ""])
        conn.accept_attach(channel, channel)
    err = refused(conn, [P.ATTACH, 1000, ""])
    assert (err.code, err.text) == (P.RESOURCE_LIMIT_EXCEEDED,
                                    "session.attach: channel 1000 out of range or too many sessions")


@pytest.mark.parametrize("frame, text", [
    ([P.QUEUE_DECLARE, 7, "q"], "queue.declare on channel 7, which has no attached session"),
    ([P.TRANSFER, 7, "", "q", None, b"x"], "message.transfer on channel 7, which has no attached session"),
    ([P.QUEUE_QUERY], "queue.query on channel None, which has no attached session"),
    ([99, 1], "command 99 on channel 1, which has no attached session"),
])
def test_no_session_refusal_names_the_command_and_channel(frame, text):
    conn = server({})
    err = conn.no_session(frame)
    assert (err.code, err.text) == (P.COMMAND_INVALID, text)
    assert conn.close_frame == [P.CLOSE, P.COMMAND_INVALID, text]


def test_server_answers_the_clients_close_and_writes_nothing_after():
    conn = server({"heartbeat": 1})
    with pytest.raises(ConnectionEnd) as info:
        feed(conn, [P.CLOSE, P.NORMAL, "client closing"])
    assert (info.value.code, info.value.text, info.value.by_peer) == (P.NORMAL, "closed by the client", True)
    assert conn.state is State.CLOSING
    assert not conn.send_heartbeat(5.0)  # closing: no heartbeat
    conn.encoder.write([P.COMPLETED, 0, [0, 0]])  # the broker's last words come before the close
    assert conn.write_close()
    assert written(conn) == [[P.COMPLETED, 0, [0, 0]], [P.CLOSE, P.NORMAL, "closed by the client"]]
    assert conn.state is State.CLOSED
    assert not conn.send_heartbeat(6.0) and not conn.write_close()
    assert written(conn) == []
    assert feed(conn, [P.ATTACH, 1, ""]) == [None]  # nothing is acted on once closed


def test_server_frames_after_a_refusal_are_ignored():
    conn = server({})
    refused(conn, [25])
    assert feed(conn, [P.ATTACH, 0, "late"], [P.CLOSE, 200, "x"]) == [None, None]
    assert conn.sessions == {}


def test_the_first_close_reason_is_the_one_sent():
    conn = server({})
    conn.close(P.CONNECTION_FORCED, "broker shutting down")
    conn.close(P.INTERNAL_ERROR, "internal broker error")
    conn.write_close()
    conn.close(P.NORMAL, "too late")
    assert written(conn) == [[P.CLOSE, P.CONNECTION_FORCED, "broker shutting down"]]


def test_a_lost_connection_writes_no_close():
    conn = server({})
    conn.close(P.CONNECTION_FORCED, "broker shutting down")
    conn.connection_lost()
    assert not conn.write_close()
    assert written(conn) == []


# -- heartbeats --------------------------------------------------------------------------
def test_server_heartbeat_deadlines():
    conn = server()
    assert conn.heartbeat_deadline == math.inf and conn.peer_deadline == math.inf  # not open yet
    feed(conn, [P.OPEN, {"heartbeat": 3}], now=10.0)
    written(conn)
    assert conn.heartbeat_interval == 3
    assert conn.heartbeat_deadline == 13.0
    assert conn.peer_deadline == 16.0  # twice the interval after the last bytes
    assert conn.send_heartbeat(13.0)
    assert written(conn) == [[P.HEARTBEAT]]
    assert conn.heartbeat_deadline == 16.0
    conn.receive_data(pack([P.HEARTBEAT]), 14.5)
    assert conn.peer_deadline == 20.5
    err = conn.peer_timed_out()
    assert (err.code, err.text) == (P.CONNECTION_FORCED, "no frame for 6 seconds (heartbeat)")
    assert conn.state is State.CLOSING


def test_server_sends_at_most_one_heartbeat_a_second():
    conn = server({"heartbeat": 0.25}, now=1.0)
    assert conn.heartbeat_interval == 1.0 and conn.heartbeat_deadline == 2.0
    assert conn.peer_deadline == 1.5  # the client's own promise: 2 x 0.25 s
    assert conn.peer_timed_out().text == "no frame for 0.5 seconds (heartbeat)"


def test_no_heartbeats_without_an_interval():
    conn = server({})
    assert conn.heartbeat_interval == 0
    assert conn.heartbeat_deadline == conn.peer_deadline == math.inf


def test_a_heartbeat_due_with_the_close_comes_before_it():
    """The mock-clock case of tests/test_server.py, without a clock: the
    heartbeat and the peer's deadline fall due at once; whichever the glue
    handles first, the close frame is the last one written."""
    for heartbeat_first in (True, False):
        conn = server({"heartbeat": 1})
        conn.send_heartbeat(1.0)
        if heartbeat_first:
            conn.send_heartbeat(2.0)
        conn.peer_timed_out()
        if not heartbeat_first:
            assert not conn.send_heartbeat(2.0)
        conn.write_close()
        frames = written(conn)
        assert frames[-1] == [P.CLOSE, P.CONNECTION_FORCED, "no frame for 2 seconds (heartbeat)"]
        assert frames.count([P.HEARTBEAT]) == (2 if heartbeat_first else 1)


# -- client ------------------------------------------------------------------------------
def client(open_ok: dict | None = None, **kw) -> ProtocolConnection:
    conn = ProtocolConnection(Role.CLIENT, **kw)
    if open_ok is not None:
        written(conn)
        assert type(feed(conn, [P.OPEN_OK, open_ok])[0]) is Opened
    return conn


def attached(conn: ProtocolConnection, session: object = "ssn") -> int:
    channel = conn.attach("", session)
    feed(conn, [P.ATTACHED, channel])
    written(conn)
    return channel


def test_client_writes_header_and_open_then_takes_open_ok():
    conn = client(name="me", heartbeat=2, max_frame_size=65536, now=5.0)
    assert conn.state is State.OPENING
    assert written(conn) == [b"header", [P.OPEN, {"mechanism": "ANONYMOUS", "name": "me", "heartbeat": 2,
                                                  "max_frame_size": 65536, "deliver_runs": True}]]
    assert conn.peer_deadline == 9.0  # the heartbeat asked for already guards the handshake
    assert feed(conn, [P.OPEN_OK, {"heartbeat": 2, "max_frame_size": 32768, "broker": "qflow"}], now=6.0) == \
        [Opened("qflow", 2, 32768, True)]
    assert conn.state is State.OPEN and conn.max_frame_size == 32768
    assert conn.decoder.max_frame_size == 65536  # deliveries may be a little longer than transfers
    assert conn.heartbeat_deadline == 8.0


@pytest.mark.parametrize("frame, code, text", [
    ([P.OPEN_OK], P.FRAMING_ERROR, "connection.open-ok must be [1, {options}]"),
    ([P.OPEN_OK, "x"], P.FRAMING_ERROR, "connection.open-ok must be [1, {options}]"),
    ([P.OPEN_OK, {"max_frame_size": "big"}], P.FRAMING_ERROR, "connection.open-ok: bad options {'max_frame_size': 'big'}"),
    ([P.OPEN_OK, {"heartbeat": -1}], P.FRAMING_ERROR, "connection.open-ok: bad options {'heartbeat': -1}"),
    ([P.ATTACHED, 0], P.FRAMING_ERROR, "unexpected frame code 11 from the broker"),
    ([P.HEARTBEAT], P.FRAMING_ERROR, "unexpected frame code 3 from the broker"),
])
def test_client_refusals_before_open(frame, code, text):
    conn = client()
    err = refused(conn, frame)
    assert (err.code, err.text) == (code, text)


def test_client_hears_a_refused_open():
    conn = client()
    with pytest.raises(ConnectionEnd) as info:
        feed(conn, [P.CLOSE, P.NOT_ALLOWED, "authentication mechanism 'X' is not supported (ANONYMOUS)"])
    assert (info.value.code, info.value.by_peer) == (P.NOT_ALLOWED, True)
    assert conn.state is State.CLOSED
    assert not conn.write_close()  # a client does not answer a close


def test_client_sessions_and_their_events():
    conn = client({})
    with pytest.raises(LocalProtocolError):
        client().attach("early", "x")
    assert conn.attach("a", "A") == 0 and conn.attach("b", "B") == 1
    assert written(conn) == [[P.ATTACH, 0, "a"], [P.ATTACH, 1, "b"]]
    assert feed(conn, [P.ATTACHED, 0], [P.ATTACHED, 1]) == [SessionAttached("A"), SessionAttached("B")]
    assert feed(conn, [P.COMPLETED, 0, [0, 4]], [P.RESULT, 1, 2, {"queue": "q"}], [P.EXCEPTION, 1, 3, 404, "gone"],
                [P.FLOW_NOTICE, 0, "q", True], [P.HEARTBEAT]) == [
        Completed("A", [0, 4]), Result("B", 2, {"queue": "q"}), Failed("B", 3, 404, "gone"),
        FlowNotice("A", "q", True), None]
    conn.flush(0)
    conn.detach(1)
    assert written(conn) == [[P.FLUSH, 0], [P.DETACH, 1]]
    assert feed(conn, [P.DETACHED, 1, P.NORMAL, "detached"]) == [SessionDetached("B", P.NORMAL, "detached")]
    assert conn.sessions == {0: "A"}
    with pytest.raises(LocalProtocolError):
        conn.detach(1)


@pytest.mark.parametrize("frame, code, text", [
    ([P.COMPLETED, 5, [0, 0]], P.COMMAND_INVALID, "session.completed on channel 5, which has no attached session"),
    ([P.RESULT, "0", 1, None], P.COMMAND_INVALID, "execution.result on channel '0', which has no attached session"),
    ([P.RESULT, 0, "1", None], P.FRAMING_ERROR, "malformed execution.result from the broker: [16, 0, '1', None]"),
    ([P.COMPLETED, 0, "0-4"], P.FRAMING_ERROR, "malformed session.completed from the broker: [14, 0, '0-4']"),
    ([P.EXCEPTION, 0, 1, 404], P.FRAMING_ERROR, "malformed execution.exception from the broker: [17, 0, 1, 404]"),
    ([P.FLOW_NOTICE, 0, "q", 1], P.FRAMING_ERROR, "malformed flow notice from the broker: [19, 0, 'q', 1]"),
    ([P.DETACHED, 0], P.FRAMING_ERROR, "malformed session.detached from the broker: [13, 0]"),
    ([P.ATTACHED, 0], P.COMMAND_INVALID, "session.attached on channel 0, which is already attached"),
    ([P.COMPLETED, 1, [0, 0]], P.COMMAND_INVALID, "session.completed on channel 1, which is not yet attached"),
    ([P.OPEN_OK, {}], P.FRAMING_ERROR, "unexpected frame code 1 from the broker"),
    ([P.TRANSFER, 0, "", "q", None, b""], P.FRAMING_ERROR, "unexpected frame code 30 from the broker"),
    ([P.ATTACH, 0, ""], P.FRAMING_ERROR, "unexpected frame code 10 from the broker"),
])
def test_client_refusals_when_open(frame, code, text):
    conn = client({})
    attached(conn)
    conn.attach("", "pending")  # channel 1: attach sent, no answer yet
    err = refused(conn, frame)
    assert (err.code, err.text) == (code, text)


def test_client_bad_data_names_the_broker():
    conn = client({})
    end = conn.malformed(FramingError("malformed frame: x"))
    assert (end.code, end.text) == (P.FRAMING_ERROR, "bad data from the broker: malformed frame: x")


def test_client_heartbeats_are_not_rounded_up():
    conn = client({"heartbeat": 0.5}, heartbeat=0.5)
    assert conn.heartbeat_interval == 0.5 and conn.heartbeat_deadline == 0.5
    assert conn.send_heartbeat(0.5) and conn.heartbeat_deadline == 1.0
    assert written(conn) == [[P.HEARTBEAT]]
    assert conn.peer_timed_out().text == "no frame from the broker for 1.0 s"


def test_client_close_is_last_and_then_only_the_brokers_close_counts():
    conn = client({"heartbeat": 1}, heartbeat=1)
    channel = attached(conn)
    conn.close(P.NORMAL, "client closing")
    conn.write_close()
    assert written(conn) == [[P.CLOSE, P.NORMAL, "client closing"]]
    with pytest.raises(LocalProtocolError):
        conn.flush(channel)
    assert not conn.send_heartbeat(1.0)
    assert written(conn) == []
    assert feed(conn, [P.COMPLETED, channel, [0, 0]], [P.ATTACHED, 9]) == [None, None]
    with pytest.raises(ConnectionEnd) as info:
        feed(conn, [P.CLOSE, P.NORMAL, "closed by the client"])
    assert (info.value.code, info.value.text, info.value.by_peer) == (P.NORMAL, "closed by the client", True)


# -- the table -------------------------------------------------------------------------
def test_every_state_of_each_role_says_what_a_frame_without_a_row_gets():
    for role in Role:
        for state in State:
            if (role, state) in ((Role.SERVER, State.OPENING), (Role.CLIENT, State.AWAIT_OPEN)):
                continue  # a role never is in the other's first state
            assert (role, state) in _DEFAULTS, (role, state)
    # Commands never go through the table: the glue hands them to its sink in bulk.
    assert all(code < P.FIRST_COMMAND for states in _TRANSITIONS.values() for row in states.values() for code in row)


def test_both_roles_talk_to_each_other():
    """A client and a server state machine, wired back to back: the handshake,
    a session, a flush, a detach and a close, with no socket in between."""
    c = ProtocolConnection(Role.CLIENT, name="pair", heartbeat=2, max_frame_size=8192)
    s = ProtocolConnection(Role.SERVER)

    def pump(src: ProtocolConnection, dst: ProtocolConnection) -> list:
        dst.receive_data(src.encoder.take(), 0.0)
        return [dst.receive_control(f) for f in dst.decoder.frames()]

    assert pump(c, s) == [Opened("pair", 2, 8192, True, "anonymous")]  # the client asks for delivery runs
    assert pump(s, c) == [Opened("qflow", 2, 8192, True, "anonymous")]
    c.attach("one", "client-session")
    [request] = pump(c, s)
    s.accept_attach(request.channel, "server-session")
    assert pump(s, c) == [SessionAttached("client-session")]
    c.flush(0)
    assert pump(c, s) == [FlushRequested("server-session")]
    c.detach(0)
    assert pump(c, s) == [DetachRequested(0, "server-session")]
    s.finish_detach(0)
    assert pump(s, c) == [SessionDetached("client-session", P.NORMAL, "detached")]
    c.close(P.NORMAL, "client closing")
    c.write_close()
    with pytest.raises(ConnectionEnd):
        pump(c, s)
    s.write_close()
    with pytest.raises(ConnectionEnd) as info:
        pump(s, c)
    assert (info.value.code, info.value.text) == (P.NORMAL, "closed by the client")
    assert c.state is s.state is State.CLOSED


# -- encodings --------------------------------------------------------------------------
@pytest.mark.parametrize("props", [None, {"message_id": "m"}])
@pytest.mark.parametrize("size", [0, 255, 256, 65536])
def test_transfer_encoding_is_the_packers(props, size):
    body = b"b" * size
    frame = enc.transfer_prefix(3, "amq.direct", "key", props) + enc.bin_header(size) + body
    assert frame == pack([P.TRANSFER, 3, "amq.direct", "key", props, body])
    assert frame.startswith(enc.transfer_head(3))
    assert frame[0] == enc.TRANSFER_FIXARRAY and frame[1] == P.TRANSFER


def test_delivery_heads_are_the_packers():
    deliver = pack([P.DELIVER, 300, "dest", 0, False, 1, 0, "", "", None, b""])
    assert deliver.startswith(enc.deliver_head(300, "dest"))
    run = pack([P.DELIVER_RUN, 2, "d", 0, 1, b""])
    assert run.startswith(enc.deliver_run_head(2, "d"))


def test_a_single_delivery_becomes_an_entry():
    did, entry = enc.entry_of_deliver([P.DELIVER, 0, "d", 7, True, 3, 2, "ex", "key", {"a": 1}, b"hi"])
    assert did == 7
    offsets = scan_entries_python(entry, 1)
    assert entry[offsets[1]:] == b"hi" and entry[0] == 0xC3
    with pytest.raises(ValueError):
        enc.entry_of_deliver([P.DELIVER, 0, "d", 0, False, 1])


@pytest.mark.parametrize("role, text", [(Role.SERVER, "connection closed by the client"),
                                        (Role.CLIENT, "connection closed by the broker")])
def test_the_end_of_the_stream_ends_the_connection(role, text):
    conn = ProtocolConnection(role)
    conn.close(P.INTERNAL_ERROR, "too late to say")
    with pytest.raises(ConnectionEnd) as info:
        conn.receive_data(b"", 1.0)
    assert (info.value.code, info.value.text, info.value.by_peer) == (P.CONNECTION_FORCED, text, True)
    assert conn.state is State.CLOSED and not conn.write_close()


def test_a_probe_says_so_in_its_open_and_may_attach_no_session():
    client = ProtocolConnection(Role.CLIENT, name="tool[1]", probe=True)
    [_header, (_code, opts)] = written(client)
    assert opts["probe"] is True
    assert "probe" not in written(ProtocolConnection(Role.CLIENT))[1][1]  # other clients do not say it
    conn = server()
    [event] = feed(conn, [P.OPEN, opts])
    assert event.probe is True and conn.probe
    err = refused(conn, [P.ATTACH, 0, "s"])
    assert (err.code, err.text) == (P.COMMAND_INVALID, "session.attach on a probe connection (its open said probe)")
    assert server({}).probe is False
    err = refused(server(), [P.OPEN, {"probe": 1}])
    assert err.code == P.COMMAND_INVALID and "probe" in err.text
