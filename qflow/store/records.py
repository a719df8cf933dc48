"""The record framing of every file the store writes (the durable
definitions' ``config.log`` and the message journal's segments). No I/O.

    record = u32 length | u32 crc32(payload) | payload        little-endian

A reader takes a record whole or says why it cannot: too short for its head,
a length that cannot be (zero, or past a file's own bound), a record that
runs past the end (a torn write), or a checksum that does not match. What it
does then (stop, skip, keep what came before) is each file's own rule. The
journal's C encoder (native/journal.c) writes the same framing; its tests
compare the bytes.
"""

from __future__ import annotations

import struct
import zlib

RECORD = struct.Struct("<II")  # length, crc32 of the payload
HEAD_SIZE = RECORD.size


class BadRecord(ValueError):
    """The bytes at a position are not a whole, intact record; the text says why."""


def frame(payload: bytes) -> bytes:
    """``payload`` as one record."""
    return RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def read_record(data: bytes | memoryview, pos: int, max_length: int | None = None) -> memoryview:
    """The payload of the record at ``pos`` of ``data`` (a view: nothing copied).

    Args:
      data: a file's bytes.
      pos: where the record starts.
      max_length: the longest payload the file can hold (None: what is left); a
        longer length field is damage, not data.

    Raises:
      BadRecord: naming why there is no whole, intact record at ``pos``.
    """
    end = len(data)
    if end - pos < HEAD_SIZE:
        raise BadRecord(f"{end - pos} bytes, too short for a record head (torn write)")
    length, crc = RECORD.unpack_from(data, pos)
    start = pos + HEAD_SIZE
    if max_length is not None and (length == 0 or length > max_length):
        raise BadRecord(f"impossible record length {length}")
    if length > end - start:
        raise BadRecord(f"record of {length} bytes, only {end - start} left (torn write)")
    payload = memoryview(data)[start:start + length]
    if zlib.crc32(payload) != crc:
        raise BadRecord(f"crc32 mismatch over {length} bytes")
    return payload
