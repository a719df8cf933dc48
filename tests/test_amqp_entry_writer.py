"""A run of AMQP 1.0 deliveries stored as queue entries in one call
(native/amqp_transfers.c ``qa_store_entries`` and its Python twin in
qflow/protocol/amqp/entries.py): both take the same deliveries and write the
same entries, and every entry is the one the decoder's path stores for the
same payload (the same bytes, size and durable flag). And the other way:
``qa_write_transfers`` writes a consumer's transfer frames for stored
entries exactly as ``amqp_payload`` and ``transfer_frame`` do."""

from __future__ import annotations

import struct
from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.amqp.codec import DecodeError, Described, UByte, UInt, ULong, encode
from qflow.protocol.amqp.entries import (
    EntryWriter,
    amqp_payload,
    is_amqp,
    native_extension,
    store_entries_python,
    stored_forms,
    stored_properties,
)
from qflow.protocol.amqp.frames import transfer_frame
from qflow.protocol.amqp.transfer_runs import TransferRun
from qflow.protocol.entries import encode_tail, message_size, new_entry

NATIVE = EntryWriter(native=True)
PYTHON = EntryWriter(native=False)
PREFIX = msgpack.packb("") + msgpack.packb("q")


def test_the_extension_is_built():
    assert NATIVE.native


def section(code: int, value) -> bytes:
    out = bytearray()
    encode(Described(ULong(code), value), out)
    return bytes(out)


# Header fields as clients send them (and some they do not), then other sections, then junk sometimes.
HEADERS = st.one_of(
    st.just(b""),
    st.just(b"\x00\x53\x70\x45"),  # list0
    st.lists(st.sampled_from([None, True, False, UByte(4), UInt(7), UInt(1000), "x", 1.5]), max_size=5).map(
        lambda fields: section(0x70, fields)),
    st.sampled_from([b"\x00\x53\x70\xc0\x03\x01\x56\x01", b"\x00\x53\x70\xc0\x03\x01\x56\x00",
                     b"\x00\x53\x70\xc0\x03\x01\x56\x02", b"\x00\x53\x70\xc0\x04\x02\x42",
                     b"\x00\x53\x70\xd0\x00\x00\x00\x05\x00\x00\x00\x01\x41",
                     b"\x00\x80\x00\x00\x00\x00\x00\x00\x00\x70\xc0\x02\x01\x41"]))
BODIES = st.one_of(
    st.binary(max_size=300).map(lambda b: section(0x75, b)),
    st.text(max_size=50).map(lambda t: section(0x77, t)),
    st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3).map(lambda m: section(0x74, m)),
    st.lists(st.integers(0, 3), max_size=3).map(lambda v: section(0x76, v)))
PAYLOADS = st.builds(lambda h, bodies, junk: h + b"".join(bodies) + junk, HEADERS, st.lists(BODIES, max_size=3),
                     st.one_of(st.just(b""), st.binary(max_size=4)))


def run_of(payloads: list[bytes], base: int = 0) -> TransferRun:
    blob = bytearray(b"tag")
    rows: list[int] = []
    for i, p in enumerate(payloads):
        rows += [i, base, 3, base + len(blob), len(p), 0]
        blob += p
    return TransferRun(0, 0, bytes(blob), base, rows, 0)


def decoder_entry(payload: bytes, seq: int) -> bytes | None:
    """What the per-message path stores for ``payload``, None when it refuses it."""
    try:
        properties = stored_properties(payload)
    except DecodeError:
        return None
    tail = encode_tail("", "q", properties, payload)
    return new_entry(seq, message_size(len(tail), len(payload)), tail)


@settings(max_examples=400)
@given(st.lists(PAYLOADS, min_size=1, max_size=6), st.integers(0, 5), st.sampled_from([0, 7]),
       st.one_of(st.just(1 << 64), st.integers(0, 2000)))
def test_native_and_python_store_the_same_entries(payloads, first, base, max_bytes):
    run = run_of(payloads, base)
    first = min(first, len(payloads) - 1)
    count = len(payloads) - first
    native = NATIVE.store(run, first, count, PREFIX, 10, max_bytes)
    python = PYTHON.store(run, first, count, PREFIX, 10, max_bytes)
    assert native[0] == python[0]
    assert bytes(native[1]) == bytes(python[1])
    assert native[2] == python[2]
    entries, sizes = native[0], array("Q", bytes(native[1]))
    assert sum(sizes) == native[2] <= max_bytes
    for i, entry in enumerate(entries):
        assert entry == decoder_entry(payloads[first + i], 10 + i)  # taken: as the decoder would store it
    if len(entries) < count:  # stopped: not taken here, or over max_bytes
        payload = payloads[first + len(entries)]
        expected = decoder_entry(payload, 10 + len(entries))
        over = expected is not None and native[2] + message_size(len(expected) - 19, len(payload)) > max_bytes
        assert over or python_refuses(payload)


def python_refuses(payload: bytes) -> bool:
    return store_entries_python(payload, 0, [0, 0, -1, 0, len(payload), 0], 0, 1, PREFIX, 1, 1 << 64)[0] == []


@pytest.mark.parametrize("payload, durable", [
    (b"\x00\x53\x70\xc0\x04\x02\x42\x50\x00\x00\x53\x77\xa1\x01x", False),  # qpid-send's shape
    (b"\x00\x53\x70\xc0\x04\x02\x41\x50\x00\x00\x53\x75\xa0\x01x", True),
    (b"\x00\x53\x75\xa0\x01x", False),
])
def test_usual_shapes_are_taken_with_their_durable_flag(payload, durable):
    for writer in (NATIVE, PYTHON):
        entries, _, _ = writer.store(run_of([payload]), 0, 1, PREFIX, 1, 1 << 64)
        assert len(entries) == 1
        properties = msgpack.Unpacker(raw=False)
        properties.feed(entries[0][19:])
        assert list(properties)[2] == ({"durable": True, "amqp1": True} if durable else {"amqp1": True})


@pytest.mark.parametrize("payload", [
    b"\x00\x53\x70\xc0\x04\x02\x42\x50\x00\x00\x53\x77\xa1\x05x",  # a string announcing more than there is
    b"\x00\x53\x79\xa0\x01x",  # no such section
    b"\x01\x53\x75\xa0\x01x",  # not described
    b"\x00\x53\x70\xc0\x04\x05\x42\x50\x00",  # a header announcing more fields than it has
])
def test_what_it_does_not_take_is_left_to_the_decoder(payload):
    for writer in (NATIVE, PYTHON):
        assert writer.store(run_of([payload]), 0, 1, PREFIX, 1, 1 << 64)[0] == []


# -- the other way: stored entries written as transfer frames (qa_write_transfers) -------------------------------
def write_native(batch: list[bytes], channel: int, handle: int, first_id: int, first_tag: int, settled: bool,
                 max_frame: int) -> tuple[int, bytes]:
    ffi, lib = native_extension()
    blob = b"".join(batch)
    plain, durable = stored_forms()
    out = ffi.new("uint8_t[]", 1 << 16)
    written, consumed = ffi.new("size_t *"), ffi.new("size_t *")
    n = lib.qa_write_transfers(blob, len(blob), plain, len(plain), durable, len(durable), channel, handle, first_id,
                               first_tag, settled, max_frame, out, 1 << 16, written, consumed)
    assert consumed[0] == sum(map(len, batch[:n]))
    return n, ffi.buffer(out, written[0])[:]


STORED = st.one_of(
    PAYLOADS.map(lambda p: NATIVE.store(run_of([p]), 0, 1, PREFIX, 3, 1 << 64)[0]),  # 1.0, as stored (or none)
    st.binary(max_size=40).map(lambda b: [new_entry(4, 9, encode_tail("", "q", None, b))]),  # a qflow message
    st.binary(max_size=40).map(lambda b: [new_entry(4, 9, encode_tail("x", "q", {"amqp1": True}, b), True)]))


@settings(max_examples=300)
@given(st.lists(STORED, max_size=6), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 10), st.booleans(),
       st.sampled_from([100, 512, 1 << 20]))
def test_native_frames_are_those_the_python_way_writes(batches, first_id, first_tag, settled, max_frame):
    batch = [e for b in batches for e in b]
    n, frames = write_native(batch, 1, 2, first_id, first_tag, settled, max_frame)
    expected = 0
    for e in batch:  # it takes the 1.0 messages as stored, not redelivered, whose frame fits
        if e[0] != 0xC2 or not is_amqp(e) or len(amqp_payload(e)) + 41 > max_frame:
            break
        expected += 1
    assert n == expected
    assert frames == b"".join(transfer_frame(1, 2, (first_id + i) & 0xFFFFFFFF, struct.pack(">Q", first_tag + i),
                                             settled, amqp_payload(e)) for i, e in enumerate(batch[:n]))
