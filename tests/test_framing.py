"""FrameDecoder and FrameEncoder, sans-I/O: bytes in, frames out; frames in, bytes out. No sockets."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qflow.protocol.framing import (
    DEFAULT_MAX_FRAME_SIZE,
    MIN_MAX_FRAME_SIZE,
    PROTOCOL_HEADER,
    READ_SIZE,
    FrameDecoder,
    FrameEncoder,
    FrameTooLarge,
    FramingError,
)
from tests.conftest import examples

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python

FRAMES = [
    [0, {"mechanism": "ANONYMOUS", "name": "t", "heartbeat": 0, "max_frame_size": 65536}],
    [10, 1, "session-a"],
    [30, 1, "amq.direct", "key", {"message_id": "m1", "headers": {"k": 1}}, b"\x00\x01body" * 50],
    [3],
    [44, 1],
    [30, 1, "", "q", None, b""],
    [41, 1, [0, 5, 7, 7]],
]


def encode(frames: list[list]) -> bytes:
    return b"".join(msgpack.packb(f, use_bin_type=True) for f in frames)


def decode_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[list]:
    out: list[list] = []
    for chunk in chunks:
        decoder.feed(chunk)
        out.extend(decoder.frames())
    return out


def fresh(max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> FrameDecoder:
    """A decoder past the protocol header."""
    d = FrameDecoder(max_frame_size)
    d.feed(PROTOCOL_HEADER)
    assert d.header_done
    return d


# -- protocol header -----------------------------------------------------------------------------------------


def test_header_split_across_several_feeds() -> None:
    d = FrameDecoder()
    for i, byte in enumerate(PROTOCOL_HEADER[:-1]):
        d.feed(bytes([byte]))
        assert not d.header_done, f"header done after {i + 1} bytes"
        assert list(d.frames()) == []
    d.feed(PROTOCOL_HEADER[-1:] + encode(FRAMES[:2]))
    assert d.header_done
    assert list(d.frames()) == FRAMES[:2]


def test_header_and_frames_in_one_feed() -> None:
    d = FrameDecoder()
    d.feed(PROTOCOL_HEADER + encode(FRAMES))
    assert list(d.frames()) == FRAMES


def test_wrong_header_names_expected_header() -> None:
    d = FrameDecoder()
    with pytest.raises(FramingError) as info:
        d.feed(b"AMQP\x00\x00\x09\x01")
    assert type(info.value) is FramingError
    assert repr(PROTOCOL_HEADER) in str(info.value)
    assert "AMQP" in str(info.value)
    assert not d.header_done


def test_wrong_version_detected_at_first_bad_byte() -> None:
    d = FrameDecoder()
    d.feed(PROTOCOL_HEADER[:5])  # b"QFLOW" is fine so far
    assert not d.header_done
    with pytest.raises(FramingError, match="expected"):
        d.feed(b"\x02")  # version 2.x


def test_no_header_expected() -> None:
    d = FrameDecoder(expect_header=False)
    assert d.header_done
    d.feed(encode(FRAMES[:3]))
    assert list(d.frames()) == FRAMES[:3]


# -- splitting and batching ----------------------------------------------------------------------------------


def test_split_at_every_byte_boundary_decodes_identically() -> None:
    stream = PROTOCOL_HEADER + encode(FRAMES)
    for cut in range(len(stream) + 1):
        got = decode_all(FrameDecoder(), [stream[:cut], stream[cut:]])
        assert got == FRAMES, f"cut at {cut}"


def test_one_byte_at_a_time() -> None:
    stream = PROTOCOL_HEADER + encode(FRAMES)
    got = decode_all(FrameDecoder(), [stream[i:i + 1] for i in range(len(stream))])
    assert got == FRAMES


def test_frames_out_as_soon_as_complete() -> None:
    d = fresh()
    first, second = encode(FRAMES[1:2]), encode(FRAMES[2:3])
    d.feed(first + second[:10])
    assert list(d.frames()) == [FRAMES[1]]
    d.feed(second[10:])
    assert list(d.frames()) == [FRAMES[2]]
    assert list(d.frames()) == []


def test_many_frames_in_one_feed() -> None:
    frames = [[30, 1, "ex", f"key.{i}", None, i.to_bytes(4, "big")] for i in range(2000)]
    d = fresh()
    d.feed(encode(frames))
    got = list(d.frames())
    assert len(got) == 2000
    assert got == frames


# -- malformed frames ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [{"code": 30}, 30, "frame", b"frame", None, [], ["30", 1], [True, 1], [1.5, 1],
                                 [None]])
def test_frame_not_an_array_starting_with_int(obj: object) -> None:
    d = fresh()
    d.feed(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(FramingError, match="array starting with a frame code") as info:
        list(d.frames())
    assert type(info.value) is FramingError


@pytest.mark.parametrize("data", [
    b"\xc1",  # the one byte msgpack never uses
    b"\x92\x01\xc1",  # inside an array
    b"\x92\x01\xa3\xff\xfe\xfd",  # str that is not UTF-8
    b"\x92\x01\x81\x90\x01",  # map with an unhashable (array) key
    b"\x91" * 2000 + b"\x01",  # nested deeper than the unpacker's stack
])
def test_not_msgpack(data: bytes) -> None:
    d = fresh()
    d.feed(data)
    with pytest.raises(FramingError, match="malformed frame") as info:
        list(d.frames())
    assert type(info.value) is FramingError


def test_good_frames_before_a_bad_one_are_delivered() -> None:
    d = fresh()
    d.feed(encode(FRAMES[:2]) + b"\xc1")
    it = d.frames()
    assert next(it) == FRAMES[0]
    assert next(it) == FRAMES[1]
    with pytest.raises(FramingError):
        next(it)


# -- frame size limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [
    b"\xc6\xff\xff\xff\xf0",  # bin32 of ~4 GiB
    b"\xdb\xff\xff\xff\xf0",  # str32 of ~4 GiB
    b"\xc9\xff\xff\xff\xf0\x05",  # ext32 of ~4 GiB
    b"\xc6\xff",  # bin32 whose length is only partly in: at least 0xff000000 bytes
])
@pytest.mark.parametrize("inside_array", [True, False])
def test_huge_declared_length_refused_without_allocating(header: bytes, inside_array: bool) -> None:
    d = fresh()
    data = (b"\x93\x1e\x01" if inside_array else b"") + header + (b"abc" if len(header) > 2 else b"")
    tracemalloc.start()
    try:
        d.feed(data)
        with pytest.raises(FrameTooLarge):
            list(d.frames())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * DEFAULT_MAX_FRAME_SIZE, peak  # never anything like 4 GiB
    assert isinstance(FrameTooLarge("x"), FramingError)


def test_bin16_larger_than_small_limit_refused_early() -> None:
    d = fresh(MIN_MAX_FRAME_SIZE)
    d.feed(b"\x92\x1e\xc5\x20\x00")  # bin16 of 8192 bytes, limit 4096
    with pytest.raises(FrameTooLarge):
        list(d.frames())


def test_declared_length_that_fits_waits_for_the_rest() -> None:
    frame = [30, 1, "ex", "k", None, b"x" * 70000]  # bin32
    data = encode([frame])
    d = fresh()
    d.feed(data[:40])
    assert list(d.frames()) == []
    d.feed(data[40:])
    assert list(d.frames()) == [frame]


def test_header_bytes_in_data_do_not_trigger_a_false_refusal() -> None:
    # The bytes before the unpacker's stop point look like a bin32 header claiming 4 GiB, but they are the
    # content of a complete bin; the frame is small and must be accepted.
    frame = [30, b"\xc6\xff\xff\xff", "hello"]
    data = encode([frame])
    for cut in range(1, len(data)):
        d = fresh(MIN_MAX_FRAME_SIZE)
        assert decode_all(d, [data[:cut], data[cut:]]) == [frame], f"cut at {cut}"


def _frame_of_size(size: int) -> list:
    """A [1, bin] frame whose encoding is exactly ``size`` bytes (bin16 body)."""
    frame = [1, b"x" * (size - 5)]  # fixarray 1 + int 1 + bin16 header 3
    assert len(msgpack.packb(frame, use_bin_type=True)) == size
    return frame


def test_frame_of_exactly_max_size_accepted_one_more_byte_refused() -> None:
    d = fresh(MIN_MAX_FRAME_SIZE)
    ok = _frame_of_size(MIN_MAX_FRAME_SIZE)
    d.feed(encode([ok]))
    assert list(d.frames()) == [ok]
    d.feed(encode([_frame_of_size(MIN_MAX_FRAME_SIZE + 1)]))
    with pytest.raises(FrameTooLarge, match=str(MIN_MAX_FRAME_SIZE)):
        list(d.frames())


def _many_small_elements(total: int) -> list:
    """A frame of about ``total`` bytes of 9-byte strings, in arrays short enough for every array limit."""
    inner = ["abcdefgh"] * 1000  # 9003 bytes
    return [30, 1, [inner] * max(total // 9003, 1)]


def test_frame_of_many_small_elements_over_limit_refused_in_one_feed() -> None:
    frame = _many_small_elements(12000)
    data = encode([frame])
    assert MIN_MAX_FRAME_SIZE < len(data) < MIN_MAX_FRAME_SIZE + 2 * READ_SIZE  # fits the unpacker's buffer
    d = fresh(MIN_MAX_FRAME_SIZE)
    d.feed(data)
    with pytest.raises(FrameTooLarge):
        list(d.frames())


def test_frame_of_many_small_elements_over_limit_refused_when_trickled() -> None:
    # Fed in small pieces, the unpacker parses the frame as it comes and its own buffer never fills: the
    # decoder must still count the frame's bytes and refuse it once they pass the limit.
    data = encode([_many_small_elements(4_000_000)])
    assert len(data) > 2 * MIN_MAX_FRAME_SIZE + 2 * READ_SIZE
    d = fresh(MIN_MAX_FRAME_SIZE)
    fed = 0
    with pytest.raises(FrameTooLarge):
        for i in range(0, len(data), 500):
            d.feed(data[i:i + 500])
            fed += 500
            list(d.frames())
    assert fed <= MIN_MAX_FRAME_SIZE + 500


def test_frame_larger_than_the_buffer_refused_by_feed() -> None:
    data = encode([_many_small_elements(MIN_MAX_FRAME_SIZE + 2 * READ_SIZE + 20000)])
    d = fresh(MIN_MAX_FRAME_SIZE)
    with pytest.raises(FrameTooLarge):
        d.feed(data)  # the unpacker's buffer limit: refused before any decoding


def test_limit_counts_per_frame_not_per_feed() -> None:
    # Many frames each under the limit, together far over it, in one feed: all fine.
    frame = _frame_of_size(MIN_MAX_FRAME_SIZE - 10)
    d = fresh(MIN_MAX_FRAME_SIZE)
    d.feed(encode([frame] * 50))
    assert list(d.frames()) == [frame] * 50


# -- set_max_frame_size --------------------------------------------------------------------------------------


def test_set_max_frame_size_keeps_buffered_frames() -> None:
    d = fresh()
    d.feed(encode(FRAMES))
    d.set_max_frame_size(65536)
    assert d.max_frame_size == 65536
    assert list(d.frames()) == FRAMES


def test_set_max_frame_size_during_iteration_keeps_following_frames() -> None:
    # As the server does: it applies the negotiated limit while handling connection.open, inside the loop.
    d = fresh()
    d.feed(encode(FRAMES))
    got = []
    for frame in d.frames():
        got.append(frame)
        if frame[0] == 0:
            d.set_max_frame_size(65536)
    assert got == FRAMES


def test_set_max_frame_size_keeps_a_partly_decoded_frame() -> None:
    d = fresh()
    data = encode(FRAMES)
    cut = len(encode(FRAMES[:3])) - 20  # inside the transfer's body
    d.feed(data[:cut])
    assert list(d.frames()) == FRAMES[:2]  # the unpacker has now started on the third frame
    d.set_max_frame_size(65536)
    d.feed(data[cut:])
    assert list(d.frames()) == FRAMES[2:]


def test_set_max_frame_size_applies_the_new_limit() -> None:
    d = fresh()
    big = _frame_of_size(8000)
    d.feed(encode([big]))
    assert list(d.frames()) == [big]
    d.set_max_frame_size(MIN_MAX_FRAME_SIZE)
    d.feed(encode([big]))
    with pytest.raises(FrameTooLarge):
        list(d.frames())


def test_set_max_frame_size_can_raise_the_limit() -> None:
    d = fresh(MIN_MAX_FRAME_SIZE)
    d.set_max_frame_size(16384)
    big = _frame_of_size(8000)
    d.feed(encode([big]))
    assert list(d.frames()) == [big]


# -- encoder -------------------------------------------------------------------------------------------------


def test_encoder_batches_writes_into_one_take() -> None:
    enc = FrameEncoder()
    assert len(enc) == 0
    enc.write_header()
    for frame in FRAMES:
        enc.write(frame)
    expected = PROTOCOL_HEADER + encode(FRAMES)
    assert len(enc) == len(expected)
    data = enc.take()
    assert data == expected
    assert type(data) is bytes
    assert len(enc) == 0
    assert enc.take() == b""
    enc.write((3,))  # tuples pack as arrays
    assert enc.take() == msgpack.packb([3])


def test_encoder_output_decodes() -> None:
    enc = FrameEncoder()
    enc.write_header()
    for frame in FRAMES:
        enc.write(frame)
    first = enc.take()
    enc.write([14, 1, [0, 9]])
    second = enc.take()
    assert decode_all(FrameDecoder(), [first, second]) == FRAMES + [[14, 1, [0, 9]]]


def test_take_is_a_copy() -> None:
    enc = FrameEncoder()
    enc.write([3])
    data = enc.take()
    enc.write([44, 1])
    assert data == msgpack.packb([3])


# -- fuzz ----------------------------------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.lists(st.sampled_from(FRAMES), max_size=3),
    junk=st.binary(max_size=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
)
def test_fuzz_random_bytes_after_header(prefix: list, junk: bytes, cuts: list[int]) -> None:
    data = PROTOCOL_HEADER + encode(prefix) + junk
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    d = FrameDecoder(MIN_MAX_FRAME_SIZE)
    got: list = []
    try:
        for chunk in chunks:
            d.feed(chunk)
            for frame in d.frames():
                assert type(frame) is list and frame and type(frame[0]) is int
                got.append(frame)
    except FramingError:  # FrameTooLarge included
        pass
    assert got[: len(prefix)] == prefix


# -- what arrays claim (a guarded decoder: qflowd's) ---------------------------------------------------------


def guarded(max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> FrameDecoder:
    d = FrameDecoder(max_frame_size, expect_header=False, guard_claims=True)
    d.hold_exact = False
    return d


def test_nested_array_claims_past_the_frame_size_are_refused_at_once() -> None:
    """1,000 nested array16(65535) heads (3 KB) claim 65 million elements: a
    guarded decoder refuses the unfinished frame at once, as too large for
    the bytes its frame may still have, instead of building the lists."""
    tracemalloc.start()
    try:
        d = guarded()
        d.feed(b"\x96\x1e\x00\xa0\xa1q" + b"\xdc\xff\xff" * 1000)
        with pytest.raises(FrameTooLarge, match="declares more than the maximum frame size 1048576"):
            list(d.frames())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, peak  # the unguarded Unpacker: hundreds of MB of lists


def test_nested_claims_within_the_limit_cost_at_most_the_claimed_bound() -> None:
    """Arrays of up to CLAIMED_ARRAY_LEN are taken as they come: 1,020 nested
    heads of 64 hold at most 1024 x 64 x 8 bytes of lists (plus their objects)."""
    from qflow.protocol.framing import CLAIMED_ARRAY_LEN
    tracemalloc.start()
    try:
        d = guarded()
        before, _ = tracemalloc.get_traced_memory()
        d.feed(b"\x96\x1e\x00\xa0\xa1q" + (b"\xdc" + CLAIMED_ARRAY_LEN.to_bytes(2, "big")) * 1020)
        assert list(d.frames()) == []
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - before < 1024 * (CLAIMED_ARRAY_LEN * 8 + 200), held - before


LONG = [
    [41, 1, list(range(2000))],  # message.accept with 1000 ranges
    [30, 1, "", "q", {"headers": {"tags": ["t"] * 300}}, b"body" * 10],
    [60, 1, "q", "inc", list(range(70000, 70200))],
    [30, 1, "", "q", {"headers": {"l": [1] * 100}}, b"y" * 30000],  # past the probe's first window
]


@pytest.mark.parametrize("cut", ["whole", "bytewise", "halves"])
def test_a_guarded_decoder_decodes_frames_with_long_arrays(cut: str) -> None:
    """Frames with arrays longer than CLAIMED_ARRAY_LEN decode whole, among
    others, however the bytes are cut; each frame's tail is where it was."""
    frames = [FRAMES[1], LONG[0], FRAMES[2], LONG[1], FRAMES[6], LONG[2], FRAMES[5], LONG[3], FRAMES[1]]
    stream = encode(frames)
    if cut == "whole":
        chunks = [stream]
    elif cut == "bytewise":
        chunks = [stream[i:i + 7] for i in range(0, len(stream), 7)]
    else:
        chunks = [stream[:len(stream) // 2], stream[len(stream) // 2:]]
    d = guarded()
    got, tails = [], []
    for chunk in chunks:
        d.feed(chunk)
        for frame in d.frames():
            got.append(frame)
            tails.append(d.frame_tail(msgpack.packb(frame[:2])[:1] + msgpack.packb(frame[0])))
    assert got == frames
    for frame, tail in zip(frames, tails, strict=True):
        if tail is not None:  # None: the frame's start was not kept (the broker encodes it again)
            assert tail == msgpack.packb(frame, use_bin_type=True)[2:]


def test_a_long_array_frame_held_until_whole_counts_in_pending_and_keeps_its_limit() -> None:
    d = guarded(MIN_MAX_FRAME_SIZE)
    head = msgpack.packb([41, 1, list(range(1000))])[:20]
    d.feed(head)
    assert list(d.frames()) == []
    assert d.pending >= len(head)
    d.feed(b"\xda\x0f\xff")  # a str of 4095 bytes: fits the 4096 bytes of a frame only on its own
    assert list(d.frames()) == []
    with pytest.raises(FrameTooLarge, match="exceeds the maximum frame size 4096"):
        d.feed(b"x" * MIN_MAX_FRAME_SIZE)


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guarded"])
def test_nesting_too_deep_is_refused_naming_it(guard: bool) -> None:
    """msgpack's Unpacker refuses containers nested more than 1024 deep with
    an exception that says nothing: the close says what was wrong."""
    d = FrameDecoder(expect_header=False, guard_claims=guard)
    d.feed(b"\x91" * 10000 + b"\xc0")
    with pytest.raises(FramingError, match="nested more than 1024 deep"):
        list(d.frames())


def test_reserved_type_byte_is_named() -> None:
    d = FrameDecoder(expect_header=False)
    d.feed(b"\x92\x1e\xc1")
    with pytest.raises(FramingError, match="0xc1"):
        list(d.frames())


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(st.one_of(
        st.sampled_from(FRAMES),
        st.builds(lambda n, ch: [41, ch, list(range(n))], st.integers(0, 300), st.integers(0, 3)),
        st.builds(lambda n, b: [30, 1, "", "q", {"headers": {"l": [1] * n}}, b],
                  st.integers(0, 200), st.binary(max_size=3000)),
    ), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=8),
    hold_exact=st.booleans(),
)
def test_fuzz_guarded_decoder_matches_plain(frames: list, cuts: list[int], hold_exact: bool) -> None:
    """A guarded decoder yields the same frames as a plain one, however cut."""
    data = encode(frames)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    g = guarded(MIN_MAX_FRAME_SIZE * 4)
    g.hold_exact = hold_exact
    assert decode_all(g, chunks) == frames
    assert g.pending == 0
