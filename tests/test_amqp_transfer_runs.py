"""Runs of AMQP 1.0 transfers (native/amqp_transfers.c and its Python twin in
qflow/protocol/amqp/transfer_runs.py): both find the same runs in the same
bytes, and the connection gives the same deliveries whichever scans."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.amqp import events as ev
from qflow.protocol.amqp.codec import UInt, encode
from qflow.protocol.amqp.connection import Connection
from qflow.protocol.amqp.frames import AMQP_HEADER, FRAME_HEADER, frame, transfer_frame
from qflow.protocol.amqp.performatives import Attach, Begin, Detach, Open, Target, Transfer
from qflow.protocol.amqp.transfer_runs import ROW, Scanner, TransferRun, scan_transfers_python

NATIVE = Scanner(native=True)


def test_the_extension_is_built():
    """make's setup builds it; without it the twin would be all that is tested."""
    assert NATIVE.native


def raw_transfer(channel: int, fields: list, payload: bytes) -> bytes:
    body = bytearray(8)
    body += b"\x00\x53\x14"
    encode(fields, body)
    body += payload
    FRAME_HEADER.pack_into(body, 0, len(body), 2, 0, channel)
    return bytes(body)


# One transfer frame, plain or not: each field drawn from what a client may send.
FRAMES = st.builds(
    lambda ch, h, did, tag, fmt, settled, more, extra, payload, use_fast: (
        transfer_frame(ch, h, did or 0, tag or b"", bool(settled), payload, fmt or 0, bool(more)) if use_fast else
        raw_transfer(ch, [UInt(h), UInt(did) if did is not None else None, tag,
                          UInt(fmt) if fmt is not None else None, settled, more, *extra], payload)),
    st.sampled_from([0, 1]), st.sampled_from([0, 1, 300]), st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.one_of(st.none(), st.binary(max_size=32)), st.one_of(st.none(), st.sampled_from([0, 5])),
    st.one_of(st.none(), st.booleans()), st.one_of(st.none(), st.booleans()),
    st.sampled_from([[], [None], [None, None, False], [None, None, None, True], [None, None, None, None, True],
                     [UInt(1)]]),
    st.binary(max_size=100), st.booleans())


@settings(max_examples=300)
@given(st.lists(FRAMES, max_size=8), st.binary(max_size=12), st.sampled_from([512, 4096]))
def test_native_and_python_find_the_same_run(frames, tail, max_frame):
    buf = b"".join(frames) + tail
    native = NATIVE.scan(buf, 0, max_frame)
    python = scan_transfers_python(buf, 0, max_frame)
    if native[0] == 0:
        assert python[0] == 0
    else:
        assert native == python


def test_a_run_stops_where_the_shape_changes():
    plain = transfer_frame(0, 0, 1, b"t", False, b"x")
    buf = plain * 3 + transfer_frame(0, 0, 4, b"t", False, b"x", more=True) + plain
    for scan in (NATIVE.scan, scan_transfers_python):
        count, end, channel, handle, fmt, rows = scan(buf, 0, 4096)
        assert (count, end, channel, handle, fmt) == (3, 3 * len(plain), 0, 0, 0)
        assert rows[:ROW] == [1, 26, 1, 34, 1, 0] and rows[ROW + 3] == len(plain) + 34
    other_handle = transfer_frame(0, 1, 2, b"t", False, b"x")
    assert NATIVE.scan(plain + other_handle, 0, 4096)[0] == 1
    truncated = plain + plain[:-1]
    assert NATIVE.scan(truncated, 0, 4096)[0] == 1


def opened(native: bool, credit: int = 100, window: int = 1 << 20) -> Connection:
    ours = Connection(native_scan=native, incoming_window=window)
    ours.receive_data(AMQP_HEADER + frame(0, Open(container_id="c")))
    ours.open()
    ours.receive_data(frame(0, Begin(next_outgoing_id=0, incoming_window=100, outgoing_window=100)))
    ours.begin(0)
    ours.receive_data(frame(0, Attach(name="l", handle=0, role=False, initial_delivery_count=0,
                                      target=Target(address="q"))))
    ours.attach(0, 0, target=Target(address="q"))
    ours.flow(0, 0, credit)
    ours.data_to_send()
    return ours


def flat(events: list) -> list:
    out = []
    for e in events:
        out += e.transfers() if isinstance(e, TransferRun) else [e]
    return out


@pytest.mark.parametrize("native", [True, False])
def test_a_run_is_cut_at_the_credit_and_the_rest_refused(native):
    ours = opened(native, credit=3)
    data = b"".join(transfer_frame(0, 0, i, b"%d" % i, False, b"m%d" % i) for i in range(5))
    got = ours.receive_data(data)
    assert isinstance(got[0], TransferRun) and got[0].count == 3
    assert [t.payload for t in got[0].transfers()] == [b"m0", b"m1", b"m2"]
    assert isinstance(got[1], ev.LinkDetached) and got[1].error.condition == "amqp:link:transfer-limit-exceeded"
    # The frame after the refused one was in flight: read and dropped, the connection reading on.
    assert len(got) == 2 and ours.frames_received == 3 + 3 + 2 and not ours.closed


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=2000), st.booleans(), st.booleans()), min_size=1, max_size=20),
       st.integers(1, 3000))
def test_both_scanners_give_the_same_deliveries(messages, chunk):
    """Deliveries, some in several frames, some pre-settled, fed in arbitrary
    chunks: the same events whichever scanner runs, and the payloads intact."""
    data = bytearray()
    for i, (payload, settled, split) in enumerate(messages):
        if split and len(payload) > 1:
            half = len(payload) // 2
            data += frame(0, Transfer(handle=0, delivery_id=i, delivery_tag=b"t%d" % i, settled=settled,
                                      more=True), payload[:half])
            data += frame(0, Transfer(handle=0, more=False), payload[half:])
        else:
            data += transfer_frame(0, 0, i, b"t%d" % i, settled, payload)
    results = []
    for native in (True, False):
        ours = opened(native, window=8)
        got = []
        for start in range(0, len(data), chunk):
            got += ours.receive_data(bytes(data[start:start + chunk]))
        results.append(flat(got))
        assert [(t.delivery_id, t.payload, t.settled) for t in results[-1]] == \
            [(i, p, s) for i, (p, s, _split) in enumerate(messages)]
        assert ours.link_credit(0, 0) == 100 - len(messages)
    assert results[0] == results[1]


def test_a_detached_link_takes_its_unfinished_bytes():
    ours = opened(True)
    ours.receive_data(frame(0, Transfer(handle=0, delivery_id=0, delivery_tag=b"t", more=True), b"x" * 500))
    assert ours.unfinished_input == 500
    got = ours.receive_data(frame(0, Detach(handle=0, closed=True)))
    assert got == [ev.LinkDetached(0, 0, True, None, True)]
    assert ours.unfinished_input == 0
