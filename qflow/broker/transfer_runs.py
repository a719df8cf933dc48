"""Runs of message.transfer frames, scanned and stored by ``native/transfers.c``.

The broker's usual input is hundreds of transfers back to back, from one
sender to one queue or exchange, whose frames differ only in their bodies. Handling them
one frame at a time in Python (decode six fields, route, check, build the
entry, log the op) is most of the broker's work per message. Here C scans
such a run in the read buffer and writes every message's queue entry and
accounting op in one pass (a run routed to several queues, a fanout: one
pass per queue for the entries, one for the ops); Python decodes the run's
exchange, routing key and properties once and routes once. ``native/transfers.h`` says which
frames make a run; any other frame goes the usual way (``Connection``).

There is no Python twin: the frame-by-frame path is the reference, and
``tests/test_transfer_runs.py`` checks that both leave the broker in the same
state for the same bytes.
"""

from __future__ import annotations

from typing import Any

from qflow._transfers_native import ffi, lib

MAX_RUN = 4096  # frames per store call
ENTRY_BYTES = 1 << 20  # entry buffer; a run stops where it is full
U64_MAX = (1 << 64) - 1

_scan = lib.qf_scan_transfers
_store = lib.qf_store_transfers
_fanout = lib.qf_fanout_ops
_transfer1_ops = lib.qf_transfer1_ops
_from_buffer = ffi.from_buffer
_buffer = ffi.buffer
_unpack = ffi.unpack


class TransferRuns:
    """Scratch buffers for one broker, reused for every run."""

    __slots__ = ("run", "_stored", "_entries", "_ends", "_ops")

    def __init__(self) -> None:
        self.run = ffi.new("qf_run *")
        self._stored = ffi.new("qf_stored *")
        self._entries = ffi.new("uint8_t[]", ENTRY_BYTES)
        self._ends = ffi.new("uint32_t[]", MAX_RUN)
        self._ops = ffi.new("int64_t[]", MAX_RUN * lib.QF_OP_WORDS)

    def scan(self, buf: bytes, pos: int, max_frame: int) -> int:
        """Frames in the run at ``buf[pos]`` (0: none starts there); ``run``
        then says where its key's fields are."""
        return _scan(_from_buffer(buf), len(buf), pos, max_frame, MAX_RUN, self.run)

    def store(self, buf: bytes, pos: int, count: int, max_bytes: int, first_seq: int, session: int,
              first_command: int, queue: int) -> tuple[int, int, int, list[bytes], Any]:
        """Store up to ``count`` frames of the run scanned at ``pos`` while their
        messages' sizes (qflow.protocol.entries) fit in ``max_bytes``: (frames
        stored, bytes of ``buf`` they span, their total size, their queue
        entries, their ops' bytes)."""
        out = self._stored
        _store(_from_buffer(buf), len(buf), pos, self.run, count, min(max_bytes, U64_MAX), first_seq,
               session, first_command, queue, self._entries, ENTRY_BYTES, self._ends, self._ops, out)
        n = out.count
        if not n:
            return 0, 0, 0, [], b""
        blob = _buffer(self._entries, out.entry_bytes)
        if out.entry_bytes < 256 * n:
            # Small entries: slicing a bytes copy is faster than slicing the
            # C buffer; big ones are copied only once (measured, 90 and 1050 B).
            blob = blob[:]
        ends = _unpack(self._ends, n)
        starts = [0, *ends]
        starts.pop()
        return n, out.consumed, out.nbytes, [blob[a:b] for a, b in zip(starts, ends, strict=True)], \
            _buffer(self._ops, n * 8 * lib.QF_OP_WORDS)

    def transfer1_ops(self, sizes: Any, session: int, first_command: int, queue: int) -> Any:
        """The ops' bytes of transfers to one queue whose entries were made elsewhere: one
        OP_TRANSFER1 each, ``sizes`` their sizes (a buffer of native uint64s)."""
        n = memoryview(sizes).nbytes // 8
        ops = ffi.new("int64_t[]", n * lib.QF_OP_WORDS)
        _transfer1_ops(ffi.from_buffer("uint64_t[]", sizes), n, session, first_command, queue, ops)
        return _buffer(ops, n * 8 * lib.QF_OP_WORDS)

    def fanout_ops(self, buf: bytes, pos: int, count: int, session: int, first_command: int,
                   queues: list[int], holders: list[int]) -> Any:
        """The ops' bytes for the first ``count`` frames of the run scanned at
        ``pos``, each going to every queue of ``queues`` (slots) and held by
        every outside holder of ``holders`` (slots); their entries come from
        :meth:`store`, called once per queue."""
        words = count * (2 + len(queues) + len(holders)) * lib.QF_OP_WORDS
        ops = ffi.new("int64_t[]", words)
        _fanout(_from_buffer(buf), len(buf), pos, self.run, count, session, first_command,
                ffi.new("int64_t[]", queues), len(queues), ffi.new("int64_t[]", holders), len(holders), ops)
        return _buffer(ops, words * 8)
