"""AMQP 1.0 framing (part 2.3): protocol headers, the 8-byte frame header, and
the fast encoders and decoder of the per-message frames (transfer and
disposition).

A frame is ``size`` (4 bytes, the whole frame), ``doff`` (1 byte, the body's
offset in 4-byte words, at least 2), ``type`` (0 AMQP, 1 SASL) and
``channel`` (2 bytes), then any extended header, then the body: one
performative and, for a transfer, the payload. A frame of 8 bytes has no
body: a heartbeat.

:func:`parse_transfer` reads a transfer performative without building any
object but the delivery tag, and :func:`transfer_frame` /
:func:`disposition_frame` write the frames a broker sends per message with one
``struct`` call each. Both are shaped so that a C version can take their place
(a flat tuple of ints and offsets in, bytes out).
"""

from __future__ import annotations

import struct
from typing import Any

from .codec import encode
from .performatives import Composite

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
TYPE_AMQP, TYPE_SASL = 0, 1
MIN_MAX_FRAME_SIZE = 512  # the spec's floor for any max-frame-size
HEARTBEAT = b"\x00\x00\x00\x08\x02\x00\x00\x00"

FRAME_HEADER = struct.Struct(">IBBH")
frame_header = FRAME_HEADER.unpack_from
TRANSFER_DESCRIPTOR = b"\x00\x53\x14"
DISPOSITION_DESCRIPTOR = b"\x00\x53\x15"


def frame(channel: int, performative: Composite, payload: bytes = b"", frame_type: int = TYPE_AMQP) -> bytes:
    """One frame carrying ``performative`` (and ``payload``) on ``channel``."""
    body = performative.encode(bytearray(8))
    body += payload
    FRAME_HEADER.pack_into(body, 0, len(body), 2, frame_type, channel)
    return bytes(body)


def frame_of_value(channel: int, value: Any, frame_type: int = TYPE_AMQP) -> bytes:
    """One frame whose body is any encoded value (tests build broken frames with it)."""
    body = encode(value, bytearray(8))
    FRAME_HEADER.pack_into(body, 0, len(body), 2, frame_type, channel)
    return bytes(body)


# ---- transfer, read fast -----------------------------------------------------------------------------------

_U32 = struct.Struct(">I").unpack_from
_NONE = -1
MORE, SETTLED, SETTLED_SET, ABORTED = 1, 2, 4, 8  # the flags parse_transfer returns


def parse_transfer(buf: Any, pos: int, end: int) -> tuple[int, int, int, int, int, int, int] | None:
    """The fields of the transfer performative at ``buf[pos:end]`` (just after
    its descriptor ``00 53 14``), read in place.

    Returns ``(handle, delivery_id, tag_offset, tag_length, message_format,
    flags, payload_start)``, where an absent delivery-id, tag (its length)
    or message-format is -1 and
    ``flags`` holds :data:`MORE`, :data:`SETTLED`, :data:`SETTLED_SET` (settled
    was given), :data:`ABORTED`. Returns None when the performative is not in
    the plain shape every client sends (a delivery state, resume, an
    unexpected encoding, a truncated field): the caller then decodes it the
    general way, which also reports what is wrong.
    """
    if pos >= end:
        return None
    code = buf[pos]
    if code == 0xC0:
        if pos + 3 > end:
            return None
        count = buf[pos + 2]
        list_end = pos + 2 + buf[pos + 1]
        pos += 3
    elif code == 0xD0:
        if pos + 9 > end:
            return None
        count = _U32(buf, pos + 5)[0]
        list_end = pos + 5 + _U32(buf, pos + 1)[0]
        pos += 9
    else:
        return None
    if list_end > end or count < 1 or count > 11:
        return None
    handle = delivery_id = message_format = tag_len = _NONE
    tag_off = 0
    flags = 0
    for i in range(count):
        if pos >= list_end:
            return None
        c = buf[pos]
        if i == 0 or i == 1 or i == 3:  # handle, delivery-id, message-format: uint
            if c == 0x52:
                if pos + 2 > list_end:
                    return None
                v = buf[pos + 1]
                pos += 2
            elif c == 0x70:
                if pos + 5 > list_end:
                    return None
                v = _U32(buf, pos + 1)[0]
                pos += 5
            elif c == 0x43:
                v = 0
                pos += 1
            elif c == 0x40 and i != 0:
                v = _NONE
                pos += 1
            else:
                return None
            if i == 0:
                handle = v
            elif i == 1:
                delivery_id = v
            else:
                message_format = v
        elif i == 2:  # delivery-tag: binary
            if c == 0xA0:
                if pos + 2 > list_end:
                    return None
                n = buf[pos + 1]
                pos += 2
            elif c == 0x40:
                pos += 1
                continue
            else:
                return None
            if pos + n > list_end:
                return None
            tag_off, tag_len = pos, n
            pos += n
        elif c == 0x40:  # an absent boolean, rcv-settle-mode or state
            pos += 1
        elif i == 6 or i == 7:  # rcv-settle-mode, state: the general path
            return None
        elif c == 0x41 or c == 0x42:
            if c == 0x41:
                if i == 4:
                    flags |= SETTLED
                elif i == 5:
                    flags |= MORE
                elif i == 9:
                    flags |= ABORTED
                elif i == 8:  # resume: the general path refuses it
                    return None
            if i == 4:
                flags |= SETTLED_SET
            pos += 1
        else:
            return None
    if pos != list_end or pos > end:
        return None
    return handle, delivery_id, tag_off, tag_len, message_format, flags, pos


# ---- per-message frames, written fast ----------------------------------------------------------------------

# Transfer list of 6 fields: handle (uint), delivery-id (uint), delivery-tag (vbin8), message-format (uint),
# settled, more. Fixed widths, so that one struct (one per tag length) writes all of it.
_TRANSFER_HEADS: dict[int, Any] = {}


def _transfer_head(n: int) -> Any:
    fmt = _TRANSFER_HEADS.get(n)
    if fmt is None:
        fmt = _TRANSFER_HEADS[n] = struct.Struct(f">IBBH3sBBBBIBIBB{n}sBIBB").pack
    return fmt


def transfer_frame(channel: int, handle: int, delivery_id: int, tag: bytes, settled: bool, payload: bytes,
                   message_format: int = 0, more: bool = False) -> bytes:
    """A transfer frame carrying ``payload`` whole (the caller splits a
    payload larger than the peer's max frame size: see
    :meth:`Connection.transfer`).

    The delivery tag is at most 32 bytes (the spec's bound)."""
    n = len(tag)
    fields = 19 + n
    return _transfer_head(n)(
        14 + fields + len(payload), 2, 0, channel, TRANSFER_DESCRIPTOR, 0xC0, fields + 1, 6, 0x70, handle,
        0x70, delivery_id, 0xA0, n, tag, 0x70, message_format, 0x41 if settled else 0x42,
        0x41 if more else 0x42) + payload


TRANSFER_OVERHEAD = 8 + 3 + 3 + 19  # a transfer frame's bytes besides its tag and payload


_DISPOSITION = struct.Struct(">IBBH3sBBBBBIBIB")


def disposition_frame(channel: int, role: bool, first: int, last: int, settled: bool, state: bytes) -> bytes:
    """A disposition frame; ``state`` is the delivery state already encoded
    (:data:`ACCEPTED_STATE` and friends), or b"" for none."""
    state = state or b"\x40"
    fields = 1 + 5 + 5 + 1 + len(state)
    return _DISPOSITION.pack(
        8 + 3 + 3 + fields, 2, 0, channel, DISPOSITION_DESCRIPTOR, 0xC0, fields + 1, 5, 0x41 if role else 0x42,
        0x70, first, 0x70, last, 0x41 if settled else 0x42) + state


ACCEPTED_STATE = b"\x00\x53\x24\x45"
RELEASED_STATE = b"\x00\x53\x26\x45"
