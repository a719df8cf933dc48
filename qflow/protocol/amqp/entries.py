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

from array import array
from struct import Struct
from typing import Any

import msgpack

from qflow.protocol.entries import (
    ENTRY_HEAD,
    ENTRY_HEAD_SIZE,
    REDELIVERED_NO,
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
from .transfer_runs import ROW, TransferRun

MARK = "amqp1"  # the property that says an entry's body is a 1.0 message's sections
_PROPERTIES = {MARK: True}
_DURABLE_PROPERTIES = {"durable": True, MARK: True}
_PACKED = msgpack.packb(_PROPERTIES)
_PACKED_DURABLE = msgpack.packb(_DURABLE_PROPERTIES)
_HEADER_START = b"\x00\x53\x70"  # a header section, as every client encodes its descriptor


def stored_forms() -> tuple[bytes, bytes]:
    """The encoded properties of a stored 1.0 message: (plain, durable)."""
    return _PACKED, _PACKED_DURABLE


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


# -- a run of deliveries stored at once -------------------------------------------------------------------------
# What store_entries takes without the decoder: each format code's fixed width (-1 - width) or the width of its
# length field (1 or 4); codes not here end the fast path (the decoder then takes that message).
_WIDTH = {**dict.fromkeys((0x40, 0x41, 0x42, 0x43, 0x44, 0x45), -1), **dict.fromkeys(range(0x50, 0x57), -2),
          0x60: -3, 0x61: -3, **dict.fromkeys(range(0x70, 0x75), -5), **dict.fromkeys(range(0x80, 0x85), -9),
          0x94: -17, 0x98: -17, **dict.fromkeys((0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0), 1),
          **dict.fromkeys((0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0), 4)}
_HEADER_FIELD_WIDTH = {0x40: 1, 0x41: 1, 0x42: 1, 0x43: 1, 0x50: 2, 0x52: 2, 0x56: 2, 0x70: 5}
_U32 = Struct(">I").unpack_from
ENTRY_BUFFER = 1 << 20  # bytes of entries one store_entries call writes at most


def _skip_value(p: Any, pos: int, end: int) -> int:
    """Where the value at ``p[pos]`` ends; -1 if it runs past ``end`` or its code is not taken."""
    if pos >= end:
        return -1
    w = _WIDTH.get(p[pos], 0)
    if w == 0:
        return -1
    if w < 0:
        n, pos = -w - 1, pos + 1
    else:
        if end - pos < 1 + w:
            return -1
        n = p[pos + 1] if w == 1 else _U32(p, pos + 1)[0]
        pos += 1 + w
    return pos + n if n <= end - pos else -1


def _header_durable(p: Any, pos: int, end: int) -> int:
    """1 (durable) or 0 for the header list at ``p[pos:end]``; -1 if not in a shape taken here."""
    code = p[pos]
    if code == 0x45:
        return 0 if pos + 1 == end else -1
    if code == 0xC0:
        if end - pos < 3:
            return -1
        list_end, count, pos = pos + 2 + p[pos + 1], p[pos + 2], pos + 3
    elif code == 0xD0:
        if end - pos < 9:
            return -1
        list_end, count, pos = pos + 5 + _U32(p, pos + 1)[0], _U32(p, pos + 5)[0], pos + 9
    else:
        return -1
    if list_end != end or pos > list_end:
        return -1
    durable = 0
    for i in range(count):
        if pos >= list_end:
            return -1
        code = p[pos]
        width = _HEADER_FIELD_WIDTH.get(code)
        if width is None or (code == 0x56 and (list_end - pos < 2 or p[pos + 1] > 1)):
            return -1
        if i == 0 and code in (0x41, 0x56):
            durable = 1 if code == 0x41 else p[pos + 1]
        pos += width
    return durable if pos == list_end else -1


def _sections_durable(p: Any, pos: int, end: int) -> int:
    """1 or 0 (whether its header says durable) for a payload whose sections are all taken here, else -1."""
    start, durable = pos, 0
    while pos < end:
        if end - pos < 4 or p[pos] != 0 or p[pos + 1] != 0x53 or not 0x70 <= p[pos + 2] <= 0x78:
            return -1
        value_end = _skip_value(p, pos + 3, end)
        if value_end < 0:
            return -1
        if p[pos + 2] == HEADER and pos == start:
            durable = _header_durable(p, pos + 3, value_end)
            if durable < 0:
                return -1
        pos = value_end
    return durable


def store_entries_python(blob: bytes, base: int, rows: list[int], first: int, count: int, prefix: bytes,
                         first_seq: int, max_bytes: int) -> tuple[list[Entry], array, int]:
    """The Python twin of ``qa_store_entries`` (native/amqp_transfers.h says what is taken and where it
    stops): the entries of deliveries ``first``... of a run, their sizes, and the sizes' total."""
    entries: list[Entry] = []
    sizes = array("Q")
    total = used = 0
    view = memoryview(blob)
    for i in range(first, first + count):
        start, n = rows[ROW * i + 3] - base, rows[ROW * i + 4]
        if start < 0 or n < 0 or start + n > len(blob) or n > 0xFFFFFFFF:
            break
        durable = _sections_durable(blob, start, start + n)
        if durable < 0:
            break
        props = _PACKED_DURABLE if durable else _PACKED
        bin_head = b"\xc4" + n.to_bytes(1, "big") if n < 0x100 else \
            b"\xc5" + n.to_bytes(2, "big") if n < 0x10000 else b"\xc6" + n.to_bytes(4, "big")
        size = len(prefix) + len(props) + n
        if size > max_bytes - total or ENTRY_HEAD_SIZE + size + len(bin_head) > ENTRY_BUFFER - used:
            break
        entry = b"".join((ENTRY_HEAD.pack(REDELIVERED_NO, 0xCF, first_seq + i - first, 0xCF, size), prefix, props,
                          bin_head, view[start:start + n]))
        entries.append(entry)
        sizes.append(size)
        total += size
        used += len(entry)
    return entries, sizes, total


def native_extension() -> Any:
    """``(ffi, lib)`` of ``qflow._amqp_native``, or None when it is not built."""
    try:
        from qflow._amqp_native import ffi, lib
    except ImportError:
        return None
    return ffi, lib


_NATIVE = native_extension()


class EntryWriter:
    """Stores the deliveries of transfer runs as queue entries, in C (or its Python twin): one per broker
    connection, its buffers reused.

    Args:
      native: use the C writer when it is built.
    """

    __slots__ = ("native", "_entries", "_ends", "_sizes", "_out", "_rows")

    def __init__(self, native: bool = True) -> None:
        self.native = native and _NATIVE is not None
        if self.native:
            ffi = _NATIVE[0]
            self._entries = ffi.new("uint8_t[]", ENTRY_BUFFER)
            self._ends = ffi.new("uint32_t[]", 4096)
            self._sizes = ffi.new("uint64_t[]", 4096)
            self._out = ffi.new("qa_stored *")

    def store(self, run: TransferRun, first: int, count: int, prefix: bytes, first_seq: int,
              max_bytes: int) -> tuple[list[Entry], Any, int]:
        """The queue entries of deliveries ``first``, ``first`` + 1 ... (at most ``count``) of ``run``,
        numbered from ``first_seq``, whose sizes add up to at most ``max_bytes``: (entries, their sizes
        as native uint64s (bytes or an array), their total). Fewer than asked (maybe none) when a payload
        is not in a shape taken here (the decoder takes that one: :func:`stored_properties`), or the
        sizes reach ``max_bytes``. ``prefix`` is the exchange and routing key, msgpack-encoded.
        """
        if not self.native:
            return store_entries_python(run.blob, run.base, run.rows, first, count, prefix, first_seq, max_bytes)
        ffi, lib = _NATIVE
        count = min(count, 4096)
        rows = run.rows
        # The rows of the deliveries asked for: a C array of them (the cffi call copies a list).
        crows = ffi.new("int64_t[]", rows[ROW * first:ROW * (first + count)])
        out = self._out
        lib.qa_store_entries(ffi.from_buffer(run.blob), len(run.blob), run.base, crows, count, prefix, len(prefix),
                             _PACKED, len(_PACKED), _PACKED_DURABLE, len(_PACKED_DURABLE), first_seq,
                             min(max_bytes, (1 << 64) - 1), self._entries, ENTRY_BUFFER, self._ends, self._sizes,
                             out)
        n = out.count
        if not n:
            return [], b"", 0
        blob = ffi.buffer(self._entries, out.entry_bytes)
        if out.entry_bytes < 256 * n:  # small entries: slicing a bytes copy is faster (as qflow's runs)
            blob = blob[:]
        ends = ffi.unpack(self._ends, n)
        starts = [0, *ends]
        starts.pop()
        return ([blob[a:b] for a, b in zip(starts, ends, strict=True)], ffi.buffer(self._sizes, 8 * n)[:],
                out.nbytes)
