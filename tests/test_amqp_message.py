"""AMQP 1.0 message sections (qflow/protocol/amqp/message.py): found by offset,
decoded on demand, delivery-count rewritten alone, and the mapping to and
from qflow's model, checked against proton.Message."""

from __future__ import annotations

import uuid

import proton
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.amqp.codec import DecodeError, Described, Symbol, ULong, encode
from qflow.protocol.amqp.message import (
    AMQP_VALUE,
    APPLICATION_PROPERTIES,
    DATA,
    HEADER,
    MESSAGE_ANNOTATIONS,
    PROPERTIES,
    Message,
    from_qflow,
    sections,
    to_qflow,
    with_delivery_count,
)


def proton_message(**kwargs) -> bytes:
    m = proton.Message(**{k: v for k, v in kwargs.items() if k not in ("delivery_count", "annotations")})
    if "delivery_count" in kwargs:
        m.delivery_count = kwargs["delivery_count"]
    if "annotations" in kwargs:
        m.annotations = kwargs["annotations"]
    return bytes(m.encode())


def decoded(payload: bytes) -> proton.Message:
    m = proton.Message()
    m.decode(payload)
    return m


def test_sections_by_offset():
    payload = proton_message(body=b"hello", id="m-1", subject="s", durable=True, properties={"k": 1},
                             annotations={proton.symbol("x-opt"): "a"})
    found = sections(payload)
    assert [s.code for s in found] == [HEADER, MESSAGE_ANNOTATIONS, PROPERTIES, APPLICATION_PROPERTIES,
                                       AMQP_VALUE]
    assert found[0].start == 0 and found[-1].end == len(payload)
    assert all(a.end == b.start for a, b in zip(found, found[1:], strict=False))
    m = Message(payload)
    assert m.header().durable and m.header().priority == 4
    assert m.properties().message_id == "m-1" and m.properties().subject == "s"
    assert m.application_properties() == {"k": 1}
    assert m.body() == b"hello"


def test_symbolic_section_descriptor():
    payload = bytes(encode(Described(Symbol("amqp:data:binary"), b"abc")))
    assert sections(payload)[0].code == DATA
    assert Message(payload).body() == b"abc"


@pytest.mark.parametrize(("payload", "what"), [
    (b"\x40", "must be a described value"),
    (b"\x00\x53\x99\x40", "unknown message section 0x99"),
    (b"\x00\x53\x75\xa0\x05ab", "announces 5 bytes"),
])
def test_bad_sections(payload, what):
    with pytest.raises(DecodeError, match=what):
        sections(payload)


@settings(max_examples=100)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.binary(max_size=300),
       st.dictionaries(st.text(max_size=8), st.integers(-1000, 1000), max_size=3))
def test_delivery_count_rewritten_alone(count, durable, body, props):
    payload = proton_message(body=body, durable=durable, properties=props, id="x", ttl=5)
    rewritten = with_delivery_count(payload, count)
    m = decoded(rewritten)
    assert m.delivery_count == count and m.durable == durable and m.ttl == 5
    assert bytes(m.body) == body and m.properties == props
    # Every byte after the header is as it was.
    assert rewritten.endswith(payload[sections(payload)[0].end:])


def test_delivery_count_added_when_there_is_no_header():
    payload = bytes(encode(Described(ULong(DATA), b"x")))
    rewritten = with_delivery_count(payload, 2)
    assert rewritten.endswith(payload) and decoded(rewritten).delivery_count == 2


def test_to_qflow():
    u = uuid.uuid4()
    payload = proton_message(body=b"body", id=u, subject="orders.eu", durable=True, correlation_id="c",
                             content_type="application/json", creation_time=1.5, properties={"a": 1, "b": "x"})
    q = to_qflow(payload)
    assert q.routing_key == "orders.eu" and q.body == b"body"
    assert q.properties == {"durable": True, "message_id": str(u), "correlation_id": "c",
                            "content_type": "application/json", "timestamp": 1500, "headers": {"a": 1, "b": "x"}}


def test_to_qflow_bodies():
    assert to_qflow(proton_message(body="text é")).body == "text é".encode()
    data = bytes(encode(Described(ULong(DATA), b"ab"))) + bytes(encode(Described(ULong(DATA), b"cd")))
    assert to_qflow(data).body == b"abcd"
    other = proton_message(body={"k": [1, 2]})
    q = to_qflow(other)
    assert q.properties["amqp_body"] == "encoded" and q.body == other[sections(other)[-1].start:]
    # ... and it goes back as it came.
    assert decoded(from_qflow("", q.properties, q.body)).body == {"k": [1, 2]}


def test_from_qflow_read_by_proton():
    payload = from_qflow("rk", {"message_id": "m1", "durable": True, "correlation_id": "c", "content_type": "t/p",
                                "timestamp": 2500, "headers": {"h": 1, "n": None, "nested": {"a": 1}}}, b"body")
    m = decoded(payload)
    assert m.subject == "rk" and m.id == "m1" and m.durable and m.correlation_id == "c"
    assert m.content_type == "t/p" and m.creation_time == 2.5
    assert m.properties == {"h": 1, "n": None, "nested": "{'a': 1}"}
    assert bytes(m.body) == b"body"


@settings(max_examples=100)
@given(st.text(max_size=20), st.binary(max_size=500), st.booleans(), st.one_of(st.none(), st.text(max_size=10)),
       st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**60, 2**60), st.text(max_size=8),
                                                      st.booleans(), st.binary(max_size=8)), max_size=4))
def test_qflow_round_trip(routing_key, body, durable, message_id, headers):
    props = {}
    if durable:
        props["durable"] = True
    if message_id is not None:
        props["message_id"] = message_id
    if headers:
        props["headers"] = headers
    back = to_qflow(from_qflow(routing_key, props, body))
    assert back == (routing_key, props, body)
