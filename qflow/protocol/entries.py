"""Stored entries: one message on one queue, as it is kept and as it is delivered. No I/O.

An entry is one ``bytes`` object: the encoded tail of the message.deliver
frame that will carry it, from ``redelivered`` on (see docs/protocol.md).
Delivering copies it after a per-delivery head; nothing is re-encoded. One
untracked object per message costs a third of the memory of a list, a tuple
and a body, and the garbage collector never scans it. Its fixed head:

  byte 0        0xc2 / 0xc3    redelivered (msgpack false / true)
  bytes 1-9     0xcf + u64     sequence number in the queue
  bytes 10-18   0xcf + u64     the message's size (below)
  bytes 19-     exchange, routing key (str), properties (nil or map), body (bin)

A message's size is what byte depth, byte limits, flow thresholds and byte
credit count (docs/protocol.md, "Message size"): its exchange, routing key,
properties and body as encoded here, less the bin header msgpack needs for
the body (so, as msgpack writes them, the fields' bytes plus the body's
length). A message with an empty body still has a size, as in qpidd since
QPID-5199 (its 0-10 header frame counts). :func:`message_size` computes it
for the broker's frame-by-frame path; native/transfers.c for runs.

A message.deliver-run frame carries entries back to back; :func:`scan_entries`
checks such a blob and says where each entry and its body start, so the
client reads a message's fields out of the blob only when asked.
"""

from __future__ import annotations

from struct import Struct
from typing import Any

import msgpack

Entry = bytes
ENTRY_HEAD = Struct(">BBQBQ")  # pack(REDELIVERED_NO, 0xCF, seq, 0xCF, size)
ENTRY_HEAD_SIZE = ENTRY_HEAD.size
_pack_head = ENTRY_HEAD.pack
REDELIVERED_NO, REDELIVERED_YES = 0xC2, 0xC3
seq_and_size = Struct(">2xQxQ").unpack_from  # (seq, size) of an entry
_SEQ = Struct(">2xQ").unpack_from


def message_size(tail_len: int, body_len: int) -> int:
    """The size of a message whose encoding after an entry's head is
    ``tail_len`` bytes long and whose body is ``body_len``. The bin header left
    out is the one msgpack needs, not the one the sender wrote, so the two
    lengths are enough: no byte of the message is looked at."""
    return tail_len - (2 if body_len < 0x100 else 3 if body_len < 0x10000 else 5)


def new_entry(seq: int, size: int, tail: bytes, redelivered: bool = False) -> Entry:
    """The entry of message ``seq`` of ``size`` bytes whose encoding after the head is ``tail``."""
    return _pack_head(REDELIVERED_YES if redelivered else REDELIVERED_NO, 0xCF, seq, 0xCF, size) + tail


def seq_of(entry: Entry) -> int:
    return _SEQ(entry)[0]


def str_end(entry: Entry, pos: int) -> int:
    """Where the msgpack str at ``pos`` of ``entry`` ends (the exchange's or the routing key's)."""
    b = entry[pos]
    if 0xA0 <= b <= 0xBF:
        return pos + 1 + (b & 0x1F)
    if b == 0xD9:
        return pos + 2 + entry[pos + 1]
    if b == 0xDA:
        return pos + 3 + int.from_bytes(entry[pos + 1:pos + 3], "big")
    if b == 0xDB:
        return pos + 5 + int.from_bytes(entry[pos + 1:pos + 5], "big")
    raise ValueError(f"entry: byte {pos} is 0x{b:02x}, not a str")


def properties_at(entry: Entry) -> int:
    """Where ``entry``'s properties (a msgpack map, or nil) begin: after its exchange and routing key,
    found without decoding anything."""
    return str_end(entry, str_end(entry, ENTRY_HEAD_SIZE))


def properties_of(entry: Entry) -> dict[str, Any] | None:
    """``entry``'s properties, decoded (and nothing after them)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(memoryview(entry)[properties_at(entry):])
    return unpacker.unpack()


def redelivered(entry: Entry) -> Entry:
    """The entry marked redelivered (a new object: entries are immutable)."""
    return entry if entry[0] == REDELIVERED_YES else b"\xc3" + entry[1:]


def entry_tail(entry: Entry) -> tuple[Any, ...]:
    """(exchange, routing_key, properties, body), decoded (management views, tests)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(entry[ENTRY_HEAD_SIZE:])
    return tuple(unpacker)


class EntryError(ValueError):
    """A blob of entries is not what its frame said."""


_STR = frozenset(range(0xA0, 0xC0)) | {0xD9, 0xDA, 0xDB}
_PROPS = frozenset(range(0x80, 0x90)) | {0xC0, 0xDE, 0xDF}
_BIN = frozenset({0xC4, 0xC5, 0xC6})


def scan_entries_python(blob: bytes, count: int) -> list[int]:
    """The Python twin of ``qf_scan_entries`` (native/transfers.h), which says
    what is checked: ``[start_0, body_0, start_1, body_1, ..., len(blob)]``
    where entry i starts at ``start_i`` and its body's bytes run from
    ``body_i`` to the next start. Raises EntryError naming the bad entry."""
    # Maps come out as lists of pairs (object_pairs_hook): a key is never hashed, so any
    # well-formed map passes, as in C; unpack() (not skip()) refuses an ext at any depth.
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_ext_len=0, max_buffer_size=max(len(blob), 1),
                                object_pairs_hook=list)
    unpacker.feed(blob)
    offsets: list[int] = []
    end = len(blob)
    for i in range(count):
        start = unpacker.tell()
        if (end - start < ENTRY_HEAD_SIZE or blob[start] not in (REDELIVERED_NO, REDELIVERED_YES)
                or blob[start + 1] != 0xCF or blob[start + 10] != 0xCF):
            raise EntryError(f"entry {i} of {count}: bad head")
        size = seq_and_size(blob, start)[1]
        try:
            for _ in range(3):  # redelivered, sequence, size: checked above
                unpacker.skip()
            for allowed in (_STR, _STR, _PROPS):
                pos = unpacker.tell()
                if pos >= end or blob[pos] not in allowed:
                    raise EntryError(f"entry {i} of {count}: exchange, routing key or properties of the wrong type")
                if allowed is _PROPS:
                    unpacker.unpack()  # not skip(): skip() lets an ext nested in the map through, C refuses it
                else:
                    unpacker.skip()
            pos = unpacker.tell()
            if pos >= end or blob[pos] not in _BIN:
                raise EntryError(f"entry {i} of {count}: the body is not bin")
            unpacker.skip()
        except (msgpack.OutOfData, ValueError) as exc:  # ValueError: ext, 0xc1 and the like
            if isinstance(exc, EntryError):
                raise
            raise EntryError(f"entry {i} of {count}: {type(exc).__name__}: {exc}") from None
        stop = unpacker.tell()
        body_len = stop - pos - (1 << (blob[pos] - 0xC4)) - 1
        actual = message_size(stop - start - ENTRY_HEAD_SIZE, body_len)
        if actual != size:
            raise EntryError(f"entry {i} of {count}: head says size {size}, but the message's is {actual} "
                             f"({stop - start - ENTRY_HEAD_SIZE} bytes of fields and a body of {body_len})")
        offsets += (start, stop - body_len)
    if unpacker.tell() != end:
        raise EntryError(f"{end - unpacker.tell()} bytes after the last of {count} entries")
    offsets.append(end)
    return offsets


def total_size_python(entries: list[Entry]) -> int:
    """The total size of ``entries`` (their heads' sizes)."""
    return sum(seq_and_size(e)[1] for e in entries)


def _native() -> Any:
    try:
        from qflow._transfers_native import ffi, lib
    except ImportError:
        return None, None
    scan, sizes, new, from_buffer, unpack = lib.qf_scan_entries, lib.qf_entries_size, ffi.new, \
        ffi.from_buffer, ffi.unpack
    join = b"".join

    def scan_entries_native(blob: bytes, count: int) -> list[int]:
        """``qf_scan_entries`` (native/transfers.c); as :func:`scan_entries_python`."""
        offsets = new("int64_t[]", 2 * count + 1)
        got = scan(from_buffer(blob), len(blob), count, offsets)
        if got != count:
            i = -got - 1
            if i == count:
                raise EntryError(f"bytes after the last of {count} entries")
            raise EntryError(f"entry {i} of {count} is malformed")
        return unpack(offsets, 2 * count + 1)

    def total_size_native(entries: list[Entry]) -> int:
        """``qf_entries_size``; as :func:`total_size_python`."""
        blob = join(entries)
        total = sizes(from_buffer(blob), len(blob))
        if total < 0:
            raise EntryError("not well-formed entries")
        return total

    return scan_entries_native, total_size_native


scan_entries_native, total_size_native = _native()
scan_entries = scan_entries_native or scan_entries_python
total_size = total_size_native or total_size_python


_packer = msgpack.Packer(use_bin_type=True, autoreset=False)


def encode_tail(exchange: str, routing_key: str, properties: dict | None, body: bytes) -> bytes:
    """A message's encoding as stored after an entry's head (see qflow.broker.queue)."""
    pack = _packer.pack
    pack(exchange)
    pack(routing_key)
    pack(properties)
    pack(body)
    tail = _packer.bytes()
    _packer.reset()
    return tail
