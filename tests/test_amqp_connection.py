"""The AMQP 1.0 connection core (qflow/protocol/amqp/connection.py) against
proton's own engine, in one process with no network: proton's Transport and
our Connection are pumped into each other. Then hostile input, frame by frame."""

from __future__ import annotations

import tracemalloc

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Collector, Event, Message, Transport

from qflow.protocol.amqp import events as ev
from qflow.protocol.amqp.codec import Described, Symbol, UInt, ULong, decode, encode
from qflow.protocol.amqp.connection import Connection
from qflow.protocol.amqp.frames import (
    AMQP_HEADER,
    HEARTBEAT,
    RELEASED_STATE,
    SASL_HEADER,
    frame,
    frame_header,
    frame_of_value,
)
from qflow.protocol.amqp.performatives import (
    PERFORMATIVES,
    SASL_FRAMES,
    SASL_OK,
    Accepted,
    Attach,
    Begin,
    Close,
    Detach,
    End,
    Flow,
    Modified,
    Open,
    Rejected,
    Source,
    Target,
    Transfer,
    from_described,
)
from qflow.protocol.amqp.transfer_runs import TransferRun


def deliveries(events: list) -> list:
    """The events with each run of transfers spread into its deliveries."""
    out = []
    for e in events:
        out += e.transfers() if isinstance(e, TransferRun) else [e]
    return out


class Pair:
    """A proton client connection and our server connection, joined by a pump."""

    def __init__(self, sasl: tuple[str, ...] | None = None, user: str | None = None, password: str | None = None,
                 **ours) -> None:
        self.client = proton.Connection()
        self.client.container = "proton-client"
        if user:  # proton reads them when the transport is bound
            self.client.user = user
            self.client.password = password
        self.transport = Transport()
        if sasl:
            self.sasl = self.transport.sasl()
            self.sasl.allowed_mechs(" ".join(sasl))
            self.sasl.allow_insecure_mechs = True  # PLAIN without TLS: this is a test of framing
        self.transport.bind(self.client)
        self.collector = Collector()
        self.client.collect(self.collector)
        self.ours = Connection(sasl_mechanisms=sasl, **ours)
        self.events: list = []
        self.pending = b""

    def pump(self) -> list:
        """Moves bytes both ways until neither side has any; returns our events."""
        got = []
        for _ in range(1000):
            moved = False
            n = self.transport.pending()
            if n > 0:
                data = self.transport.peek(n)
                self.transport.pop(n)
                got += self.ours.receive_data(data)
                moved = True
            out = self.ours.data_to_send()
            self.pending += out
            while self.pending and self.transport.capacity() > 0:
                take = self.transport.capacity()
                try:
                    self.transport.push(self.pending[:take])
                except proton.TransportException:
                    self.pending = b""
                    break
                self.pending = self.pending[take:]
                moved = True
            if not moved:
                break
        self.events += got
        return got

    def proton_events(self) -> list:
        out = []
        while self.collector.peek():
            out.append(self.collector.peek().type)
            self.collector.pop()
        return out

    def open_session(self) -> proton.Session:
        self.client.open()
        session = self.client.session()
        session.open()
        got = self.pump()
        assert [type(e) for e in got] == [ev.ConnectionOpened, ev.SessionBegun]
        self.ours.open()
        self.ours.begin(got[1].channel)
        self.pump()
        return session

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def test_proton_sender_to_our_receiver():
    """Proton attaches a sender; we grant credit; its transfers (single and
    multi-frame) arrive whole; our accepted+settled dispositions settle them
    on proton's side."""
    pair = Pair()
    session = pair.open_session()
    sender = session.sender("producer-1")
    sender.target.address = "q1"
    sender.open()
    (attached,) = pair.pump()
    assert isinstance(attached, ev.LinkAttached)
    assert attached.peer_is_sender and attached.address == "q1" and attached.name == "producer-1"
    assert attached.unsupported == ()
    pair.ours.attach(attached.channel, attached.handle, source=attached.source, target=attached.target)
    pair.ours.flow(attached.channel, attached.handle, 5)
    pair.pump()
    assert sender.credit == 5
    messages = [Message(body=b"x" * 64, id=1), Message(body=b"y" * 100_000, id=2), Message(body="small", id=3)]
    for i, m in enumerate(messages):
        sender.delivery(b"tag-%d" % i)
        sender.send(m.encode())
        sender.advance()
    got = pair.pump()
    transfers = [e for e in deliveries(got) if isinstance(e, ev.TransferReceived)]
    assert [t.delivery_tag for t in transfers] == [b"tag-0", b"tag-1", b"tag-2"]
    for t, m in zip(transfers, messages, strict=True):
        assert t.payload == m.encode() and not t.settled and t.message_format == 0
        decoded = Message()
        decoded.decode(t.payload)
        assert decoded.id == m.id
    assert pair.ours.link_credit(0, attached.handle) == 2
    assert pair.ours.unfinished_input == 0
    pair.proton_events()
    for t in transfers:
        pair.ours.disposition(t.channel, t.delivery_id)
    pair.pump()
    settled = []
    for _ in range(10):
        if not pair.collector.peek():
            break
        e = pair.collector.peek()
        if e.type == Event.DELIVERY:
            settled.append((e.delivery.tag, e.delivery.remote_state, e.delivery.settled))
        pair.collector.pop()
    assert sorted(settled) == [(f"tag-{i}", proton.Delivery.ACCEPTED, True) for i in range(3)]


def test_transfer_beyond_credit_detaches_the_link():
    pair = Pair()
    session = pair.open_session()
    sender = session.sender("s")
    sender.target.address = "q"
    sender.open()
    (attached,) = pair.pump()
    pair.ours.attach(0, attached.handle, target=attached.target)
    pair.ours.flow(0, attached.handle, 1)
    pair.pump()
    # A well-behaved proton sender honours credit; write the extra transfer ourselves.
    sender.delivery(b"a")
    sender.send(Message(body=b"1").encode())
    sender.advance()
    pair.pump()
    got = pair.ours.receive_data(frame(0, Transfer(handle=attached.handle, delivery_id=1, delivery_tag=b"b",
                                                   settled=True), b"\x00\x53\x75\xa0\x01x"))
    assert got == [ev.LinkDetached(0, attached.handle, True, got[0].error, False)]
    assert got[0].error.condition == "amqp:link:transfer-limit-exceeded"
    assert "without credit" in got[0].error.description


def test_our_sender_to_proton_receiver_with_drain():
    pair = Pair()
    session = pair.open_session()
    receiver = session.receiver("consumer-1")
    receiver.source.address = "q2"
    receiver.open()
    (attached,) = pair.pump()
    assert not attached.peer_is_sender and attached.address == "q2"
    pair.ours.attach(0, attached.handle, source=Source(address="q2"), target=attached.target)
    receiver.flow(3)
    (flow,) = pair.pump()
    assert isinstance(flow, ev.FlowReceived) and flow.credit == 3 and not flow.drain
    bodies = [Message(body=b"a" * 10).encode(), Message(body=b"b" * 70_000).encode()]
    ids = [pair.ours.transfer(0, attached.handle, b, delivery_tag=b"d%d" % i) for i, b in enumerate(bodies)]
    assert ids == [0, 1]
    assert pair.ours.link_credit(0, attached.handle) == 1
    pair.pump()
    received = []
    pair.proton_events()
    while receiver.current is not None and not receiver.current.partial:
        d = receiver.current
        received.append(receiver.recv(d.pending))
        d.update(proton.Delivery.ACCEPTED)
        receiver.advance()
        d.settle()
    assert received == bodies
    got = pair.pump()
    dispositions = [e for e in got if isinstance(e, ev.DispositionReceived)]
    assert {(d.first, d.last) for d in dispositions} <= {(0, 0), (1, 1), (0, 1)}
    assert all(d.role is True and d.settled and isinstance(d.state, Accepted) for d in dispositions)
    assert sorted(i for d in dispositions for i in range(d.first, d.last + 1)) == [0, 1]
    # Drain: proton asks for 5 more and to drain; we have nothing, so we use the credit up.
    receiver.drain(5)
    (flow,) = pair.pump()
    assert flow.drain and flow.credit == 6
    pair.ours.drained(0, attached.handle)
    pair.pump()
    assert receiver.credit == 0
    assert not receiver.draining()


def test_refused_link_and_unsupported_features():
    """A receiver with a selector filter is reported as unsupported; refusing
    it gives proton the error condition and its text."""
    pair = Pair()
    session = pair.open_session()
    receiver = session.receiver("selective")
    receiver.source.address = "q3"
    receiver.source.filter.put_dict({proton.symbol("selector"): proton.Described(
        proton.symbol("apache.org:selector-filter:string"), "colour = 'red'")})
    receiver.open()
    (attached,) = pair.pump()
    assert attached.unsupported and "filters (selector)" in attached.unsupported[0]
    pair.ours.refuse_link(0, attached.handle, "amqp:not-implemented", "filters are not supported")
    pair.pump()
    assert receiver.remote_condition.name == "amqp:not-implemented"
    assert receiver.remote_condition.description == "filters are not supported"


def test_peer_detach_end_close_are_answered():
    pair = Pair()
    session = pair.open_session()
    sender = session.sender("s")
    sender.open()
    (attached,) = pair.pump()
    pair.ours.attach(0, attached.handle, target=Target(address="x"))
    pair.pump()
    sender.close()
    (detached,) = pair.pump()
    assert detached == ev.LinkDetached(0, attached.handle, True, None, True)
    session.close()
    (ended,) = pair.pump()
    assert ended == ev.SessionEnded(0, None, True)
    pair.client.close()
    (closed,) = pair.pump()
    assert closed == ev.ConnectionClosed(None, True)
    assert pair.ours.closed
    assert proton.Endpoint.REMOTE_CLOSED & pair.client.state


def test_negotiated_limits_and_heartbeat():
    pair = Pair(max_frame_size=4096, channel_max=7, idle_time_out=30_000)
    pair.transport.max_frame_size = 16384
    pair.transport.idle_timeout = 10.0
    pair.open_session()
    opened = pair.of(ev.ConnectionOpened)[0]
    # Proton announces half its idle timeout, so that the peer's heartbeats arrive in time.
    assert opened.max_frame_size == 16384 and opened.idle_time_out == 5_000 and opened.container_id == "proton-client"
    assert pair.ours.peer_idle_time_out == 5_000
    assert pair.transport.remote_max_frame_size == 4096
    assert pair.transport.remote_idle_timeout == 30.0
    # Our transfers to proton are cut at proton's frame size, proton's to us at ours.
    before = pair.ours.frames_received
    pair.ours.heartbeat()
    assert pair.ours.data_to_send() == HEARTBEAT
    assert pair.ours.receive_data(HEARTBEAT) == [] and pair.ours.frames_received == before + 1


def test_sasl_plain_then_amqp():
    pair = Pair(sasl=("PLAIN",), user="alice", password="secret")
    pair.client.open()
    got = pair.pump()
    assert [(e.mechanism, e.initial_response) for e in got] == [("PLAIN", b"\x00alice\x00secret")]
    pair.ours.sasl_outcome(SASL_OK)
    got = pair.ours.receive_data(b"")
    got += pair.pump()
    assert [type(e) for e in got] == [ev.ConnectionOpened]
    pair.ours.open()
    pair.pump()
    assert pair.client.remote_container == "qflowd"


def test_sasl_failure_ends_the_connection():
    pair = Pair(sasl=("PLAIN",), user="alice", password="wrong")
    pair.client.open()
    pair.pump()
    pair.ours.sasl_outcome(1)
    pair.pump()
    assert pair.ours.closed
    assert pair.transport.condition is not None
    assert pair.transport.condition.name == "amqp:unauthorized-access"


def test_sasl_required_refuses_a_bare_amqp_header():
    ours = Connection(sasl_mechanisms=("PLAIN",), require_sasl=True)
    got = ours.receive_data(AMQP_HEADER)
    assert ours.data_to_send() == SASL_HEADER
    assert ours.closed and "SASL authentication is required" in got[0].error.description


# ---- hostile input ---------------------------------------------------------------------------------------


def frames_of(data: bytes) -> list:
    """The performatives in what our side sent (headers skipped)."""
    out = []
    pos = 0
    while pos < len(data):
        if data[pos:pos + 4] == b"AMQP":
            pos += 8
            continue
        size, doff, ftype, _channel = frame_header(data, pos)
        if size > 8:
            out.append(from_described(decode(data, pos + doff * 4, pos + size) if ftype == 0 else
                                      decode(data, pos + doff * 4, pos + size),
                                      PERFORMATIVES if ftype == 0 else SASL_FRAMES))
        pos += size
    return out


def opened(**kwargs) -> Connection:
    ours = Connection(**kwargs)
    ours.receive_data(AMQP_HEADER + frame(0, Open(container_id="c")))
    ours.open()
    ours.receive_data(frame(0, Begin(next_outgoing_id=0, incoming_window=100, outgoing_window=100)))
    ours.begin(0)
    ours.receive_data(frame(0, Attach(name="l", handle=0, role=False, initial_delivery_count=0,
                                      target=Target(address="q"))))
    ours.attach(0, 0, target=Target(address="q"))
    ours.flow(0, 0, 100)
    ours.data_to_send()
    return ours


def closed_with(ours: Connection, got: list) -> tuple[str, str]:
    assert ours.closed
    (event,) = [e for e in got if isinstance(e, ev.ConnectionClosed)]
    sent = frames_of(ours.data_to_send())
    assert isinstance(sent[-1], Close) and sent[-1].error == event.error
    return str(event.error.condition), event.error.description


@pytest.mark.parametrize("header", [b"GET / HTTP/1.1\r\n", b"AMQP\x01\x01\x00\x00", b"AMQP\x00\x00\x09\x01",
                                    b"QFLOW\x01\x00"])
def test_wrong_header_is_answered_with_ours_then_closed(header):
    ours = Connection()
    got = ours.receive_data(header)
    assert ours.data_to_send() == AMQP_HEADER
    assert ours.closed and "unsupported protocol header" in got[0].error.description
    assert ours.receive_data(b"more") == []


def test_garbage_after_the_header():
    ours = Connection()
    got = ours.receive_data(AMQP_HEADER + b"\xff" * 64)
    condition, text = closed_with(ours, got)
    assert condition == "amqp:connection:framing-error" and "exceeds max-frame-size" in text


def test_oversized_frame_is_refused_before_it_arrives():
    ours = opened(max_frame_size=4096)
    got = ours.receive_data((1 << 20).to_bytes(4, "big") + b"\x02\x00\x00\x00" + b"x" * 1000)
    condition, text = closed_with(ours, got)
    assert condition == "amqp:connection:framing-error" and "1048576" in text
    assert len(ours._buf) == 0


def test_malformed_frame_header():
    ours = opened()
    got = ours.receive_data(b"\x00\x00\x00\x10\x01\x00\x00\x00" + b"\x00" * 8)
    assert closed_with(ours, got)[0] == "amqp:connection:framing-error"


def test_nested_claims_in_a_performative_cost_nothing():
    """Issue 29's shape for AMQP: a frame whose containers announce far more
    than it holds is a decode error, and nothing is allocated for the claims."""
    ours = opened(max_frame_size=65536)
    claims = b"\x00\x53\x13\xd0\x00\x00\xff\x00\x00\x00\xff\xff" + b"\xf0\xff\xff\xff\xf0\xff\xff\xff\xff" * 7000
    body = claims[:65536 - 8]
    data = (len(body) + 8).to_bytes(4, "big") + b"\x02\x00\x00\x00" + body
    tracemalloc.start()
    try:
        got = ours.receive_data(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    condition, text = closed_with(ours, got)
    assert condition == "amqp:decode-error" and "announces" in text
    assert peak < 4 * len(data)


def test_too_deep_nesting():
    ours = opened()
    value = None
    for _ in range(100):
        value = [value]
    got = ours.receive_data(frame_of_value(0, Described(ULong(0x13), value)))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:decode-error" and "nesting deeper" in text


def test_frame_size_below_512():
    ours = Connection()
    got = ours.receive_data(AMQP_HEADER + frame(0, Open(container_id="c", max_frame_size=100)))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:frame-size-too-small" and "100" in text
    with pytest.raises(ValueError, match="512"):
        Connection(max_frame_size=100)


def test_unknown_descriptor():
    ours = opened()
    got = ours.receive_data(frame_of_value(0, Described(ULong(0x99), [])))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:decode-error" and "unexpected descriptor" in text


def test_missing_mandatory_field_and_wrong_type():
    ours = opened()
    got = ours.receive_data(frame_of_value(0, Described(ULong(0x11), [None, None, UInt(1), UInt(1)])))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:invalid-field" and "next_outgoing_id is absent" in text
    ours = opened()
    got = ours.receive_data(frame_of_value(0, Described(ULong(0x16), ["not a handle"])))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:invalid-field" and "handle should be uint" in text


def test_frame_before_open_and_on_a_missing_session():
    ours = Connection()
    got = ours.receive_data(AMQP_HEADER + frame(0, Begin(next_outgoing_id=0, incoming_window=1,
                                                           outgoing_window=1)))
    assert closed_with(ours, got) == ("amqp:not-allowed", "begin before open")
    ours = opened()
    got = ours.receive_data(frame(5, Transfer(handle=0, delivery_id=0, delivery_tag=b"t"), b"x"))
    condition, text = closed_with(ours, got)
    assert condition == "amqp:not-allowed" and "channel 5" in text


def test_unfinished_deliveries_are_bounded_by_the_input_budget():
    ours = opened(max_frame_size=65536, max_unfinished_input=200_000)
    part = b"p" * 60_000
    got = []
    for i in range(10):
        got += ours.receive_data(frame(0, Transfer(handle=0, delivery_id=0 if i == 0 else None,
                                                   delivery_tag=b"t" if i == 0 else None, more=True), part))
        if ours.closed:
            break
    assert i == 3
    condition, text = closed_with(ours, got)
    assert condition == "amqp:resource-limit-exceeded" and "200000" in text
    assert ours.unfinished_input == 0


def test_aborted_delivery_frees_its_bytes():
    ours = opened()
    ours.receive_data(frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"t", more=True), b"x" * 1000))
    assert ours.unfinished_input == 1000
    assert ours.receive_data(frame(0, Transfer(handle=0, more=False, aborted=True))) == []
    assert ours.unfinished_input == 0
    got = deliveries(ours.receive_data(frame(0, Transfer(handle=0, delivery_id=1, delivery_tag=b"u"), b"ok")))
    assert got == [ev.TransferReceived(0, 0, 1, b"u", False, b"ok", 0)]
    # Another unfinished one, then the link goes: its bytes go with it, once.
    ours.receive_data(frame(0, Transfer(handle=0, delivery_id=2, delivery_tag=b"v", more=True), b"y" * 300))
    assert ours.unfinished_input == 300
    ours.receive_data(frame(0, Detach(handle=0, closed=True)))
    assert ours.unfinished_input == 0


def test_session_window_is_kept_and_enforced():
    ours = opened(incoming_window=4)
    for i in range(3):
        ours.receive_data(frame(0, Transfer(handle=0, delivery_id=i, delivery_tag=b"%d" % i, settled=True), b"x"))
    flows = frames_of(ours.data_to_send())
    # Below half the window, the core re-opened it with a session flow.
    assert flows and flows[-1].incoming_window == 4 and flows[-1].next_incoming_id == 3 and flows[-1].handle is None


def test_transactions_and_resume_are_refused_by_name():
    ours = opened()
    got = ours.receive_data(frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"t", resume=True), b"x"))
    (detached,) = got
    assert detached.error.condition == "amqp:not-implemented" and "resume" in detached.error.description


def test_general_path_transfer_matches_the_fast_path():
    """A transfer in an unusual but valid shape (a delivery state, list32,
    symbolic descriptor) takes the general decoder and gives the same event."""
    ours = opened()
    body = Transfer(handle=0, delivery_id=0, delivery_tag=b"t", state=Accepted()).encode()
    got = deliveries(ours.receive_data(frame_of_value(0, decode(body))))
    assert got == [ev.TransferReceived(0, 0, 0, b"t", False, b"", 0)]
    symbolic = encode(Described(Symbol("amqp:transfer:list"), [UInt(0), UInt(1), b"u"]))
    got = deliveries(ours.receive_data((8 + len(symbolic) + 3).to_bytes(4, "big") + b"\x02\x00\x00\x00" + symbolic
                                       + b"abc"))
    assert got == [ev.TransferReceived(0, 0, 1, b"u", False, b"abc", 0)]


def test_dispositions_with_other_outcomes_reach_proton():
    pair = Pair()
    session = pair.open_session()
    sender = session.sender("s")
    sender.target.address = "q"
    sender.open()
    (attached,) = pair.pump()
    pair.ours.attach(0, attached.handle, target=attached.target)
    pair.ours.flow(0, attached.handle, 2)
    pair.pump()
    for tag in (b"a", b"b"):
        sender.delivery(tag)
        sender.send(Message(body=tag).encode())
        sender.advance()
    transfers = [e for e in deliveries(pair.pump()) if isinstance(e, ev.TransferReceived)]
    rejected = Rejected(error=None)
    pair.ours.disposition(0, transfers[0].delivery_id, state=bytes(rejected.encode()))
    pair.ours.disposition(0, transfers[1].delivery_id, state=RELEASED_STATE)
    pair.pump()
    states = {}
    while pair.collector.peek():
        e = pair.collector.peek()
        if e.type == Event.DELIVERY:
            states[e.delivery.tag] = e.delivery.remote_state
        pair.collector.pop()
    assert states == {"a": proton.Delivery.REJECTED, "b": proton.Delivery.RELEASED}


def test_transfer_many_and_modified_outcome_with_proton():
    """Many deliveries in one call reach proton intact and in order; proton's
    modified(delivery-failed) outcome reaches us as a Modified state."""
    pair = Pair()
    session = pair.open_session()
    receiver = session.receiver("c")
    receiver.source.address = "q"
    receiver.open()
    (attached,) = pair.pump()
    pair.ours.attach(0, attached.handle, source=Source(address="q"))
    receiver.flow(50)
    pair.pump()
    window = pair.ours.session_window(0)
    bodies = [Message(body=b"%d" % i).encode() for i in range(40)] + [Message(body=b"z" * 50_000).encode()]
    first = pair.ours.transfer_many(0, attached.handle, bodies, [b"t%d" % i for i in range(len(bodies))])
    assert first == 0 and pair.ours.link_credit(0, attached.handle) == 50 - len(bodies)
    assert pair.ours.session_window(0) < window
    with pytest.raises(ValueError, match="32 bytes"):
        pair.ours.transfer(0, attached.handle, b"x", delivery_tag=b"t" * 33)
    pair.pump()
    got = []
    while receiver.current is not None and not receiver.current.partial:
        d = receiver.current
        got.append(bytes(receiver.recv(d.pending)))
        d.local.failed = True
        d.update(proton.Delivery.MODIFIED)
        receiver.advance()
        d.settle()
    assert got == bodies
    dispositions = [e for e in pair.pump() if isinstance(e, ev.DispositionReceived)]
    assert dispositions and all(isinstance(d.state, Modified) and d.state.delivery_failed for d in dispositions)
    assert sorted(i for d in dispositions for i in range(d.first, d.last + 1)) == list(range(len(bodies)))


def test_after_this_side_detaches_in_flight_frames_are_dropped_and_the_answer_not_answered():
    ours = opened()
    ours.detach(0, 0, condition="amqp:resource-limit-exceeded", description="queue q deleted")
    assert isinstance(frames_of(ours.data_to_send())[0], Detach)
    # The peer had sent these before it saw the detach: dropped.
    got = ours.receive_data(frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"t"), b"x")
                            + frame(0, Flow(next_incoming_id=0, incoming_window=10, next_outgoing_id=1,
                                            outgoing_window=10, handle=0, delivery_count=1, link_credit=0)))
    assert got == [] and not ours.closed
    # Its detach answers ours: nothing more is sent, and the handle is free again.
    assert ours.receive_data(frame(0, Detach(handle=0, closed=True))) == []
    assert ours.data_to_send() == b""
    got = ours.receive_data(frame(0, Attach(name="again", handle=0, role=False, initial_delivery_count=0,
                                            target=Target(address="q"))))
    assert isinstance(got[0], ev.LinkAttached) and got[0].name == "again"


def test_a_session_fault_ends_that_session_only():
    ours = opened()
    ours.receive_data(frame(1, Begin(next_outgoing_id=0, incoming_window=100, outgoing_window=100)))
    ours.begin(1)
    ours.data_to_send()
    got = ours.receive_data(frame(1, Transfer(handle=9, delivery_id=0, delivery_tag=b"t"), b"x")
                            + frame(1, Transfer(handle=9, delivery_id=1, delivery_tag=b"u"), b"y")
                            + frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"v"), b"z"))
    assert isinstance(got[0], ev.SessionEnded) and got[0].channel == 1
    assert got[0].error.condition == "amqp:session:unattached-handle" and "handle 9" in got[0].error.description
    assert [t.payload for t in deliveries(got[1:])] == [b"z"]
    (sent,) = frames_of(ours.data_to_send())
    assert isinstance(sent, End) and sent.error == got[0].error
    assert ours.receive_data(frame(1, End())) == [] and ours.data_to_send() == b""
    assert not ours.closed


# ---- fuzz: whatever arrives, receive_data answers with events, never an exception ----------------------

_VALID = [
    frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"t", more=True), b"part"),
    frame(0, Transfer(handle=0, delivery_id=1, delivery_tag=b"u", settled=True), b"whole"),
    frame(0, Transfer(handle=0), b"end"),
    frame(0, Transfer(handle=0, aborted=True)),
    frame(0, Flow(next_incoming_id=0, incoming_window=5, next_outgoing_id=0, outgoing_window=5, handle=0,
                  delivery_count=0, link_credit=10, echo=True)),
    frame(0, Attach(name="x", handle=1, role=True, source=Source(address="q"))),
    frame(0, Detach(handle=0, closed=True)),
    frame(0, End()), frame(1, Begin(next_outgoing_id=0, incoming_window=1, outgoing_window=1)),
    frame(0, Close()), HEARTBEAT,
]


@st.composite
def hostile_input(draw):
    parts = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(st.binary(max_size=40)))
        elif kind == 1:
            parts.append(draw(st.sampled_from(_VALID)))
        elif kind == 2:
            f = bytearray(draw(st.sampled_from(_VALID)))
            for _ in range(draw(st.integers(1, 3))):
                f[draw(st.integers(0, len(f) - 1))] = draw(st.integers(0, 255))
            parts.append(bytes(f))
        else:
            value = draw(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(0, 2**32 - 1).map(UInt),
                                                st.binary(max_size=8), st.text(max_size=8)),
                                      lambda c: st.lists(c, max_size=4), max_leaves=10))
            code = draw(st.sampled_from([0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x1d, 0x40]))
            parts.append(frame_of_value(draw(st.sampled_from([0, 1, 7])), Described(ULong(code), value)))
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(hostile_input(), st.integers(1, 64), st.booleans())
def test_hostile_input_gives_events_never_an_exception(data, chunk, native):
    ours = opened(max_frame_size=4096, max_unfinished_input=10_000, native_scan=native)
    for start in range(0, len(data), chunk):
        ours.receive_data(data[start:start + chunk])
        ours.data_to_send()
        assert 0 <= ours.unfinished_input <= 10_000
        assert len(ours._buf) < 4096 + chunk
        if ours.closed:
            break


def test_a_sender_advancing_its_delivery_count_uses_credit_up():
    """A sending peer that answers a drain by advancing its delivery-count has
    used that credit: what is left shrinks accordingly."""
    ours = opened()
    assert ours.link_credit(0, 0) == 100
    got = ours.receive_data(frame(0, Flow(next_incoming_id=0, incoming_window=10, next_outgoing_id=0,
                                          outgoing_window=10, handle=0, delivery_count=60, link_credit=40)))
    assert got[0].credit == 40 and ours.link_credit(0, 0) == 40
