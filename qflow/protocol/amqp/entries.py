"""AMQP 1.0 messages in qflow's queues: how one is stored, and how a stored
message is handed to a consumer of either protocol. No I/O.

A 1.0 message is stored as it arrived: its encoded sections are the body of
a queue entry (qflow.protocol.entries), whose properties map is only
``{"amqp1": true}`` (with ``"durable": true`` for a message whose header
says durable, which is what makes it persistent on a durable queue), and
whose exchange and routing key are those it was routed with. So a 1.0
consumer gets it back byte for byte (only the header's delivery-count can
change), and nothing is decoded on its way in but the header's durable flag
(and the subject, when an exchange routes it).

Between the protocols the mapping of :mod:`.message` applies, at delivery:
a qflow consumer gets :func:`qflow_entry` (a data section as the body,
application-properties as headers...), a 1.0 consumer of a qflow message gets
:func:`amqp_payload`'s sections.
"""

from __future__ import annotations

import msgpack

from qflow.protocol.entries import (
    ENTRY_HEAD_SIZE,
    REDELIVERED_YES,
    Entry,
    encode_tail,
    message_size,
    new_entry,
    properties_at,
    seq_and_size,
)

from .codec import DecodeError, decode
from .message import HEADER, PROPERTIES, from_qflow, sections, to_qflow, with_delivery_count

MARK = "amqp1"  # the property that says an entry's body is a 1.0 message's sections
_PROPERTIES = {MARK: True}
_DURABLE_PROPERTIES = {"durable": True, MARK: True}
_PACKED = msgpack.packb(_PROPERTIES)
_PACKED_DURABLE = msgpack.packb(_DURABLE_PROPERTIES)
_HEADER_START = b"\x00\x53\x70"  # a header section, as every client encodes its descriptor


def stored_properties(payload: bytes) -> dict[str, bool]:
    """The properties map a 1.0 message is stored with: durable if its header says so.

    Raises:
      DecodeError: its header section cannot be read.
    """
    if not payload.startswith(_HEADER_START):
        return _PROPERTIES
    first = sections(payload)[0]
    if first.code != HEADER:
        return _PROPERTIES
    fields = decode(payload, first.value_start, first.end)
    durable = isinstance(fields, list) and len(fields) > 0 and fields[0] is True
    return _DURABLE_PROPERTIES if durable else _PROPERTIES


def subject(payload: bytes) -> str:
    """The subject of a 1.0 message ("" if it has none): the routing key an exchange routes it by.

    Raises:
      DecodeError: its sections cannot be read.
    """
    for section in sections(payload):
        if section.code == PROPERTIES:
            fields = decode(payload, section.value_start, section.end)
            value = fields[3] if isinstance(fields, list) and len(fields) > 3 else None
            return value if isinstance(value, str) else ""
        if section.code > PROPERTIES:
            break
    return ""


def is_amqp(entry: Entry) -> bool:
    """Whether a stored entry holds a 1.0 message's sections."""
    at = properties_at(entry)
    return entry.startswith(_PACKED, at) or entry.startswith(_PACKED_DURABLE, at)


def _tail(entry: Entry) -> tuple[str, str, dict | None, bytes]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(memoryview(entry)[ENTRY_HEAD_SIZE:])
    exchange, routing_key, properties, body = unpacker
    return exchange, routing_key, properties, body


def delivered_count(entry: Entry, failures: int) -> int:
    """The delivery-count a message goes out with: ``failures`` (what
    ``modified`` outcomes with delivery-failed counted), or at least 1 if it
    was delivered before (returned, released)."""
    return max(failures, 1 if entry[0] == REDELIVERED_YES else 0)


def amqp_payload(entry: Entry, failures: int = 0) -> bytes:
    """The 1.0 message a 1.0 consumer gets for a stored entry: a 1.0
    message's own sections (its delivery-count :func:`delivered_count` when
    that is not 0), or a qflow message mapped (:func:`.message.from_qflow`,
    with that delivery-count too)."""
    _, routing_key, properties, body = _tail(entry)
    if properties is not None and properties.get(MARK):
        if failures:
            try:
                return with_delivery_count(body, delivered_count(entry, failures))
            except DecodeError:
                return body
        if entry[0] == REDELIVERED_YES:
            try:
                first = sections(body)
                if not first or first[0].code != HEADER:
                    return with_delivery_count(body, 1)
                fields = decode(body, first[0].value_start, first[0].end)
                if not (isinstance(fields, list) and len(fields) > 4 and fields[4]):
                    return with_delivery_count(body, 1)
            except DecodeError:
                return body
        return body
    mapped = from_qflow(routing_key, properties, body)
    count = delivered_count(entry, failures)
    return with_delivery_count(mapped, count) if count else mapped


def qflow_entry(entry: Entry) -> Entry:
    """What a qflow consumer gets for a stored entry: a 1.0 message mapped
    (:func:`.message.to_qflow`; its size the mapped message's, as the client
    checks), any other entry as it is."""
    if not is_amqp(entry):
        return entry
    exchange, routing_key, _, body = _tail(entry)
    try:
        mapped = to_qflow(body)
        properties, body = mapped.properties, mapped.body
    except DecodeError:  # stored as it came: a qflow consumer gets the sections as they are
        properties = {"amqp_body": "encoded"}
    tail = encode_tail(exchange, routing_key, properties or None, body)
    seq = seq_and_size(entry)[0]
    return new_entry(seq, message_size(len(tail), len(body)), tail, entry[0] == REDELIVERED_YES)
