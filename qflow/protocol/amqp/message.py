"""An AMQP 1.0 message's sections (part 3.2), found by offset, decoded on demand;
and its mapping to and from qflow's own message model.

A transfer's payload is a run of sections, each a described value: header,
delivery-annotations, message-annotations, properties,
application-properties, a body (data sections, amqp-sequence sections or one
amqp-value) and footer. A broker relays the payload as it came; only the
header's delivery-count may change on redelivery (:func:`with_delivery_count`
rewrites it and keeps every other byte).

Mapping to qflow's model (exchange, routing key, properties, body; see
docs/amqp.md, "Mapping"):

=============================  =============================================
AMQP 1.0                       qflow
=============================  =============================================
data section(s)                body (several: joined)
amqp-value holding binary      body
amqp-value holding a string    body, UTF-8
other bodies                   body = the encoded body sections, and property ``amqp_body`` = ``"encoded"``
header.durable                 properties ``durable``
properties.message-id          properties ``message_id`` (a uuid as its str)
properties.correlation-id      properties ``correlation_id``
properties.content-type        properties ``content_type``
properties.creation-time       properties ``timestamp`` (ms)
properties.subject             routing key
application-properties         properties ``headers``
=============================  =============================================
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from .codec import (
    DESCRIBED,
    Array,
    DecodeError,
    Described,
    Symbol,
    Timestamp,
    UInt,
    ULong,
    decode,
    encode,
    skip,
)
from .performatives import FieldError, composite

HEADER, DELIVERY_ANNOTATIONS, MESSAGE_ANNOTATIONS, PROPERTIES = 0x70, 0x71, 0x72, 0x73
APPLICATION_PROPERTIES, DATA, AMQP_SEQUENCE, AMQP_VALUE, FOOTER = 0x74, 0x75, 0x76, 0x77, 0x78
_SECTION_NAMES = {
    "amqp:header:list": HEADER, "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": MESSAGE_ANNOTATIONS, "amqp:properties:list": PROPERTIES,
    "amqp:application-properties:map": APPLICATION_PROPERTIES, "amqp:data:binary": DATA,
    "amqp:amqp-sequence:list": AMQP_SEQUENCE, "amqp:value:*": AMQP_VALUE, "amqp:footer:map": FOOTER,
}

Header = composite("Header", HEADER, [("durable", "bool", False), ("priority", "ubyte", 4), ("ttl", "uint"),
                                      ("first_acquirer", "bool", False), ("delivery_count", "uint", 0)])
Properties = composite("Properties", PROPERTIES, [
    ("message_id", "any"), ("user_id", "bin"), ("to", "str"), ("subject", "str"), ("reply_to", "str"),
    ("correlation_id", "any"), ("content_type", "sym"), ("content_encoding", "sym"),
    ("absolute_expiry_time", "timestamp"), ("creation_time", "timestamp"), ("group_id", "str"),
    ("group_sequence", "uint"), ("reply_to_group_id", "str")])


class Section(NamedTuple):
    """One section: its code (:data:`HEADER` ... :data:`FOOTER`) and its
    span in the payload, whole (``start``: its descriptor) and its value's
    (``value_start``)."""
    code: int
    start: int
    value_start: int
    end: int


def sections(payload: bytes | memoryview) -> list[Section]:
    """The sections of a message payload, by offset, nothing decoded but
    their descriptors.

    Raises:
      DecodeError: a section that is not a described value of a known
        section type, or truncated.
    """
    out = []
    pos, end = 0, len(payload)
    while pos < end:
        if payload[pos] != DESCRIBED:
            raise DecodeError("a message section must be a described value", pos)
        if pos + 2 < end and payload[pos + 1] == 0x53:  # the usual smallulong descriptor
            code = payload[pos + 2]
            value_start = pos + 3
        else:
            value_start = skip(payload, pos + 1, end)
            descriptor = decode(payload, pos + 1, value_start)
            code = (int(descriptor) if type(descriptor) is ULong
                    else _SECTION_NAMES.get(str(descriptor), -1) if isinstance(descriptor, Symbol) else -1)
        if not HEADER <= code <= FOOTER:
            raise DecodeError(f"unknown message section 0x{code:02x}" if code >= 0 else "unknown message section",
                              pos)
        section_end = skip(payload, value_start, end)
        out.append(Section(code, pos, value_start, section_end))
        pos = section_end
    return out


class Message:
    """A message payload and its sections, each decoded when first asked for.

    Args:
      payload: the transfer's payload (kept as given; never copied).

    Raises:
      DecodeError: from the constructor, if the sections cannot be found.
    """

    __slots__ = ("payload", "sections")

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.sections = sections(payload)

    def _section(self, code: int) -> Section | None:
        for s in self.sections:
            if s.code == code:
                return s
        return None

    def _composite(self, code: int, cls: type) -> Any:
        s = self._section(code)
        if s is None:
            return cls()
        value = decode(self.payload, s.value_start, s.end)
        try:
            return cls.from_fields(value)
        except FieldError as e:
            raise DecodeError(str(e), s.start) from None

    def header(self) -> Any:
        """The header (:data:`Header`: durable, priority, ttl, first_acquirer,
        delivery_count); the defaults if the message has none."""
        return self._composite(HEADER, Header)

    def properties(self) -> Any:
        """The properties section (:data:`Properties`); all absent if none."""
        return self._composite(PROPERTIES, Properties)

    def application_properties(self) -> dict:
        """The application-properties map ({} if none)."""
        s = self._section(APPLICATION_PROPERTIES)
        if s is None:
            return {}
        value = decode(self.payload, s.value_start, s.end)
        if not isinstance(value, dict):
            raise DecodeError("application-properties is not a map", s.value_start)
        return value

    def body_sections(self) -> list[Section]:
        """The body's sections (data, amqp-sequence or amqp-value)."""
        return [s for s in self.sections if DATA <= s.code <= AMQP_VALUE]

    def body(self) -> Any:
        """The body decoded: bytes for data sections (joined), else the
        amqp-value's value, or the list of amqp-sequence lists."""
        parts = self.body_sections()
        if parts and parts[0].code == AMQP_VALUE:
            return decode(self.payload, parts[0].value_start, parts[0].end)
        values = [decode(self.payload, s.value_start, s.end) for s in parts]
        if parts and parts[0].code == DATA:
            return b"".join(values)
        return values


def with_delivery_count(payload: bytes, count: int) -> bytes:
    """``payload`` with its header's delivery-count set to ``count``: every
    other byte as it was (a header is added in front if there is none)."""
    msg_sections = sections(payload)
    first = msg_sections[0] if msg_sections else None
    if first is None or first.code != HEADER:
        return bytes(Header(delivery_count=count).encode()) + bytes(payload)
    fields = decode(payload, first.value_start, first.end)
    if not isinstance(fields, list):
        raise DecodeError("the header is not a list", first.value_start)
    fields = fields + [None] * (5 - len(fields))
    fields[4] = UInt(count)
    header = encode(Described(ULong(HEADER), fields))
    return bytes(header) + bytes(payload[first.end:])


# ---- mapping to and from qflow's model ---------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A value qflow's properties (msgpack) can carry."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Array):
        return [_plain(v) for v in value.items]
    if isinstance(value, dict):
        return {_plain(k) if not isinstance(k, list | dict) else repr(k): _plain(v) for k, v in value.items()}
    return repr(value)


class QflowMessage(NamedTuple):
    """A message in qflow's model: what a qflow transfer carries."""
    routing_key: str
    properties: dict[str, Any]
    body: bytes


def to_qflow(payload: bytes) -> QflowMessage:
    """The qflow message for an AMQP 1.0 payload (see the module's table).

    Raises:
      DecodeError: the payload's sections cannot be read.
    """
    msg = Message(payload)
    props: dict[str, Any] = {}
    header = msg.header()
    if header.durable:
        props["durable"] = True
    p = msg.properties()
    if p.message_id is not None:
        props["message_id"] = _plain(p.message_id)
    if p.correlation_id is not None:
        props["correlation_id"] = _plain(p.correlation_id)
    if p.content_type is not None:
        props["content_type"] = p.content_type
    if p.creation_time is not None:
        props["timestamp"] = p.creation_time
    app = msg.application_properties()
    if app:
        props["headers"] = {str(k): _plain(v) for k, v in app.items()}
    parts = msg.body_sections()
    if all(s.code == DATA for s in parts):
        body = b"".join(decode(payload, s.value_start, s.end) for s in parts)
    else:
        value = decode(payload, parts[0].value_start, parts[0].end) if len(parts) == 1 else None
        if parts[0].code == AMQP_VALUE and isinstance(value, bytes):
            body = value
        elif parts[0].code == AMQP_VALUE and isinstance(value, str) and type(value) is str:
            body = value.encode("utf-8")
        else:
            body = bytes(payload[parts[0].start:parts[-1].end])
            props["amqp_body"] = "encoded"
    return QflowMessage(p.subject or "", props, body)


def _simple(value: Any) -> Any:
    """An application-properties value: AMQP allows only simple types there."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    return str(value)


def from_qflow(routing_key: str, properties: dict[str, Any] | None, body: bytes) -> bytes:
    """The AMQP 1.0 payload for a qflow message (see the module's table).
    A qflow body that ``to_qflow`` marked ``amqp_body: encoded`` goes back
    as the body sections it was."""
    properties = properties or {}
    out = bytearray()
    if properties.get("durable"):
        Header(durable=True).encode(out)
    p = Properties()
    message_id = properties.get("message_id")
    if message_id is not None:
        p.message_id = message_id if isinstance(message_id, str | bytes) else ULong(message_id) \
            if isinstance(message_id, int) and message_id >= 0 else str(message_id)
    if properties.get("correlation_id") is not None:
        p.correlation_id = properties["correlation_id"]
    if properties.get("content_type") is not None:
        p.content_type = str(properties["content_type"])
    if properties.get("timestamp") is not None:
        p.creation_time = int(properties["timestamp"])
    if routing_key:
        p.subject = routing_key
    if p.fields():
        p.encode(out)
    headers = properties.get("headers")
    if headers:
        encode(Described(ULong(APPLICATION_PROPERTIES), {str(k): _simple(v) for k, v in headers.items()}), out)
    if properties.get("amqp_body") == "encoded":
        out += body
    else:
        encode(Described(ULong(DATA), bytes(body)), out)
    return bytes(out)


__all__ = ["Header", "Properties", "Message", "Section", "sections", "with_delivery_count", "to_qflow",
           "from_qflow", "QflowMessage", "Timestamp"]
