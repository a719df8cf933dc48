"""Runs of AMQP 1.0 transfer frames, scanned in one call: the per-message path.

A producer's read is mostly transfer frames back to back, each a whole
delivery on one link. Reading them one by one in Python costs microseconds
per frame; ``native/amqp_transfers.c`` scans such a *run* in one call and
says, per delivery, where its tag and payload are (``native/amqp_transfers.h``
says which frames make a run). :func:`scan_transfers_python` is its twin,
used when the extension is not built, and checked against it by
``tests/test_amqp_transfer_runs.py``.

A run is handed on as one :class:`TransferRun` event: the frames' bytes copied
once, and a flat list of integers per delivery, so that the broker can store
or route the payloads without a Python object per delivery in between.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .events import TransferReceived
from .frames import ABORTED, MORE, SETTLED, frame_header, parse_transfer

ROW = 6  # ints per delivery: delivery-id, tag offset, tag length (-1: none), payload offset, payload length, settled
MAX_RUN = 4096


class TransferRun(NamedTuple):
    """Whole deliveries received on one link, in order.

    ``blob`` holds the bytes they came in, starting at offset ``base`` of
    the read they were in; ``rows`` has :data:`ROW` ints per delivery
    (delivery-id, tag offset, tag length or -1, payload offset, payload
    length, settled 0/1), offsets counted like ``base``. A delivery that
    came in several frames is a run of one whose blob is its tag and
    joined payload.
    """
    channel: int
    handle: int
    blob: bytes
    base: int
    rows: list[int]
    message_format: int

    @property
    def count(self) -> int:
        """How many deliveries."""
        return len(self.rows) // ROW

    def payload(self, i: int) -> bytes:
        """The ``i``-th delivery's payload (the encoded message)."""
        rows = self.rows
        start = rows[ROW * i + 3] - self.base
        return self.blob[start:start + rows[ROW * i + 4]]

    def delivery_id(self, i: int) -> int:
        return self.rows[ROW * i]

    def settled(self, i: int) -> bool:
        return self.rows[ROW * i + 5] == 1

    def tag(self, i: int) -> bytes | None:
        rows = self.rows
        n = rows[ROW * i + 2]
        if n < 0:
            return None
        start = rows[ROW * i + 1] - self.base
        return self.blob[start:start + n]

    def transfers(self) -> list[TransferReceived]:
        """Each delivery as its own tuple (for tests and slow paths)."""
        return [TransferReceived(self.channel, self.handle, self.delivery_id(i), self.tag(i), self.settled(i),
                                 self.payload(i), self.message_format) for i in range(self.count)]


def single(channel: int, handle: int, delivery_id: int, tag: bytes | None, settled: bool, payload: bytes,
           message_format: int) -> TransferRun:
    """A run of one delivery (a multi-frame one, or one in an unusual shape)."""
    n = len(tag) if tag is not None else 0
    return TransferRun(channel, handle, (tag or b"") + payload, 0,
                       [delivery_id, 0, n if tag is not None else -1, n, len(payload), 1 if settled else 0],
                       message_format)


def scan_transfers_python(buf: Any, pos: int, max_frame: int, max_count: int = MAX_RUN) \
        -> tuple[int, int, int, int, int, list[int]]:
    """The run at ``buf[pos]``: (count, end, channel, handle, message_format, rows) as the C scanner finds it."""
    n = len(buf)
    rows: list[int] = []
    count = 0
    channel = handle = fmt = -1
    while count < max_count and n - pos >= 8:
        size, doff, ftype, ch = frame_header(buf, pos)
        if size > max_frame or size < 12 or doff != 2 or ftype != 0 or size > n - pos:
            break
        body = pos + 8
        if buf[body] != 0 or buf[body + 1] != 0x53 or buf[body + 2] != 0x14:
            break
        fields = parse_transfer(buf, body + 3, pos + size)
        if fields is None:
            break
        h, delivery_id, tag_off, tag_len, message_format, flags, payload_start = fields
        if delivery_id < 0 or flags & (MORE | ABORTED):
            break
        if count == 0:
            channel, handle, fmt = ch, h, message_format
        elif ch != channel or h != handle or message_format != fmt:
            break
        rows += (delivery_id, tag_off if tag_len >= 0 else 0, tag_len, payload_start, pos + size - payload_start,
                 1 if flags & SETTLED else 0)
        count += 1
        pos += size
    return count, pos, channel, handle, fmt, rows


def _native() -> Any:
    try:
        from qflow._amqp_native import ffi, lib
    except ImportError:
        return None
    return ffi, lib


_NATIVE = _native()


class Scanner:
    """Scratch space for the C scanner, one per connection (or the Python twin)."""

    __slots__ = ("_rows", "_run", "native")

    def __init__(self, native: bool = True) -> None:
        self.native = native and _NATIVE is not None
        if self.native:
            ffi, lib = _NATIVE
            self._rows = ffi.new("int64_t[]", MAX_RUN * ROW)
            self._run = ffi.new("qa_run *")

    def scan(self, buf: Any, pos: int, max_frame: int) -> tuple[int, int, int, int, int, list[int]]:
        """(count, end, channel, handle, message_format, rows) of the run at ``buf[pos]``; count 0: none."""
        if not self.native:
            return scan_transfers_python(buf, pos, max_frame)
        ffi, lib = _NATIVE
        run = self._run
        count = lib.qa_scan_transfers(ffi.from_buffer(buf), len(buf), pos, max_frame, MAX_RUN, self._rows, run)
        if not count:
            return 0, pos, 0, 0, 0, []
        return count, run.end, run.channel, run.handle, run.message_format, ffi.unpack(self._rows, count * ROW)
