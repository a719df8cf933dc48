"""The journal's native sync thread (docs/store.md "Group commit, on
the loop and off it"). No trio: the server's store task waits on
:attr:`SyncThread.event_fd` with its event loop.

A commit that only appends a record to the open segment (the usual one:
``Journal.fd_for``) is encoded, checksummed, written and ``fdatasync``ed by a
POSIX thread of native/sync_thread.c, which never takes the GIL; it says it
is done through an eventfd. A Python worker thread doing the same takes the
GIL back after each step (the encoder's setup, the write, the sync) and
hands it over again, and with the event loop busy each turn costs both
threads a wait. The rare commit that opens a segment or unlinks dead ones
still goes through ``Journal.write_and_sync`` in a worker thread.
"""

from __future__ import annotations

import os

from qflow._journal_native import ffi as _ffi
from qflow._journal_native import lib as _lib
from qflow.store.journal import Batch, JournalError, encode_native, encoder_for, native_batch


def wanted() -> bool:
    """Whether commits go through the native thread: when the journal's
    encoder is the native one (``$QFLOW_ACCOUNTING`` python keeps every commit
    on the Python path, so that make test's second pass runs it) and the
    system has eventfd (Linux)."""
    return encoder_for() is encode_native and hasattr(os, "eventfd")


class SyncThread:
    """One native sync thread: :meth:`submit` a commit, wait until
    :attr:`event_fd` is readable, then :meth:`done`. One commit at a time."""

    def __init__(self) -> None:
        self.event_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        thread = _lib.qf_sync_start(self.event_fd)
        if thread == _ffi.NULL:
            err = _ffi.errno
            os.close(self.event_fd)
            raise OSError(err, f"cannot start the journal's sync thread: {os.strerror(err)}")
        self._thread = thread
        self._keep: tuple[object, ...] | None = None  # what C reads while a commit is under way

    def submit(self, fd: int, batch: Batch) -> None:
        """Append ``batch`` as a record to ``fd`` (``Journal.fd_for``) and sync it."""
        if self._keep is not None:
            raise JournalError("submit() while a commit is under way: call done() first")
        b, keep, out, size = native_batch(batch)
        if _lib.qf_sync_submit(self._thread, fd, b, keep[-1], size) != 0:
            raise JournalError("the journal's sync thread refused a commit (one is under way, or it stopped)")
        self._keep = (b, keep, out)

    def done(self) -> None:
        """After :attr:`event_fd` became readable: the commit is durable, or
        this raises why not (OSError for the write or the sync)."""
        try:
            os.eventfd_read(self.event_fd)
        except BlockingIOError:
            raise JournalError("done() before the sync thread said so") from None
        self._keep = None
        result = _lib.qf_sync_result(self._thread)
        if result > 0:
            raise OSError(result, f"writing the journal: {os.strerror(result)}")
        if result < 0:
            raise JournalError(f"the batch encoder returned {result} (-1: too small, -2: inconsistent columns, "
                               "-3: out of memory, -4: another length than the batch's)")

    def close(self) -> None:
        """End the thread (after the commit under way, if any) and close the eventfd."""
        if self._thread is not None:
            _lib.qf_sync_stop(self._thread)
            self._thread = None
            os.close(self.event_fd)


def crc32(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """native/sync_thread.c's crc32, which must be zlib's (tests/test_sync_thread.py)."""
    buf = _ffi.from_buffer(data)
    return int(_lib.qf_crc32(crc, buf, len(buf)))

