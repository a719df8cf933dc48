"""``NativeAccounting``: ``PyAccounting``'s interface over ``native/accounting.c``.

The specification is the docstring of ``qflow.broker.accounting``. The state lives in
C; each method is one C call, and ``apply`` hands the whole op log over
without copying. Results come back in buffers owned by the C state and are
turned into the same lists of tuples ``PyAccounting`` returns.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

from qflow._accounting_native import ffi, lib
from qflow.broker.ops import (
    COUNT_MAX,
    OP_WORDS,
    SIZE_MAX,
    AccountingError,
    CompletedRange,
    Hold,
    Transition,
    thresholds_ok,
)

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

_from_buffer = ffi.from_buffer
_buffer = ffi.buffer
# struct builds each record's tuple straight from the C buffer: about twice
# as fast as ffi.unpack into a flat list and zipping slices of it.
_iter_completions = struct.Struct("3q").iter_unpack
_iter_holds = struct.Struct("4q").iter_unpack
_iter_transitions = struct.Struct("4Q").iter_unpack


class HoldRows(Sequence[Hold]):
    """An apply's holds as the C accounting wrote them, ``words`` (4 per hold:
    op index, token, session, slot), made tuples only when read as a
    sequence: Completion takes the usual input (all one holder's) by column
    (``words[1::4]`` are the tokens), with no tuple per hold."""

    __slots__ = ("words",)

    def __init__(self, words: array) -> None:
        self.words = words

    def __len__(self) -> int:
        return len(self.words) >> 2

    def __iter__(self) -> Iterator[Hold]:
        return _iter_holds(self.words)

    @overload
    def __getitem__(self, i: int) -> Hold: ...
    @overload
    def __getitem__(self, i: slice) -> list[Hold]: ...
    def __getitem__(self, i: int | slice) -> Hold | list[Hold]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("hold index out of range")
        return tuple(self.words[4 * i:4 * i + 4])  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, HoldRows)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class NativeAccounting:
    """The C accounting; behaves exactly like ``PyAccounting``. Not
    thread-safe: cffi releases the GIL during each call."""

    name = "native"

    __slots__ = ("_st", "_out", "_stats")

    def __init__(self) -> None:
        st = lib.acct_new()
        if st == ffi.NULL:
            raise MemoryError("cannot allocate the accounting state")
        self._st = ffi.gc(st, lib.acct_free)
        self._out = lib.acct_output_of(st)  # lives as long as self._st
        self._stats = ffi.new("uint64_t[5]")

    # -- queues -------------------------------------------------------------
    def add_queue(self) -> int:
        return self._new_slot(lib.acct_add_queue)

    def remove_queue(self, queue: int) -> list[CompletedRange]:
        self._check(lib.acct_remove_queue(self._st, _slot(queue)), queue)
        return self._completions()

    # -- outside holders ----------------------------------------------------
    def add_holder(self) -> int:
        return self._new_slot(lib.acct_add_holder)

    def _new_slot(self, add: Any) -> int:
        """A queue's or holder's new slot (they share one table)."""
        slot = add(self._st)
        if slot < 0:
            raise MemoryError("cannot grow the queue table")
        return slot

    def remove_holder(self, holder: int) -> list[CompletedRange]:
        self._check(lib.acct_remove_holder(self._st, _slot(holder, "holder")), holder)
        return self._completions()

    def set_thresholds(
        self, queue: int, stop_count: int, resume_count: int, stop_size: int, resume_size: int
    ) -> tuple[list[CompletedRange], list[Transition]]:
        slot = _slot(queue)
        counts_ok = thresholds_ok(stop_count, resume_count, COUNT_MAX)
        sizes_ok = thresholds_ok(stop_size, resume_size, SIZE_MAX)
        if not (counts_ok and sizes_ok):
            # PyAccounting looks the queue up before validating.
            self._check(lib.acct_check_queue(self._st, slot), queue)
            if not counts_ok:
                raise AccountingError(f"bad count thresholds {stop_count}/{resume_count}")
            raise AccountingError(f"bad size thresholds {stop_size}/{resume_size}")
        self._check(
            lib.acct_set_thresholds(self._st, slot, stop_count, resume_count, stop_size, resume_size),
            queue,
        )
        return self._completions(), self._transitions()

    def stats(self, queue: int) -> tuple[int, int, bool, int, int]:
        """(count, bytes, flow_on, stopped_count, held); a holder's is (0, 0, False, 0, held)."""
        s = self._stats
        self._check(lib.acct_stats(self._st, _slot(queue), s), queue)
        return s[0], s[1], bool(s[2]), s[3], s[4]

    def holds_of(self, holder: int) -> list[tuple[int, int]]:
        """(token, session) of each live hold of outside holder ``holder``, in token index order."""
        slot = _slot(holder, "holder")
        n = lib.acct_holds_of(self._st, slot, ffi.NULL, ffi.NULL, 0)
        if n < 0:
            self._check(-n, holder)
        if not n:
            return []
        tokens, sessions = ffi.new("int64_t[]", n), ffi.new("int64_t[]", n)
        lib.acct_holds_of(self._st, slot, tokens, sessions, n)
        return list(zip(tokens, sessions, strict=True))

    def drop_session(self, session: int) -> None:
        # A session outside int64 cannot have come from an op log.
        if _INT64_MIN <= session <= _INT64_MAX:
            lib.acct_drop_session(self._st, session)

    # -- the batch ----------------------------------------------------------
    def apply(self, log: array) -> tuple[list[CompletedRange], Sequence[Hold], list[Transition]]:
        if not ((type(log) is array and log.typecode == "q") or (type(log) is memoryview and log.format == "q")):
            log = array("q", log)  # the odd caller; the broker passes a memoryview cast to 'q'
        rc = lib.acct_apply(self._st, _from_buffer("int64_t[]", log), len(log))
        if rc:
            self._check(rc)
        return self._completions(), self._holds(), self._transitions()

    # -- for tests ----------------------------------------------------------
    def _force_depth(self, queue: int, count: int, nbytes: int) -> None:
        """Set a queue's depth directly (the 32-bit limits cannot be reached
        by enqueuing in a test)."""
        self._check(lib.acct_force_depth(self._st, _slot(queue), count, nbytes), queue)

    # -- results ------------------------------------------------------------
    # Each reads its count first: a cffi field that is a pointer costs an
    # allocation per read, and most batches have no holds and no transitions.
    def _completions(self) -> list[CompletedRange]:
        out = self._out
        n = out.ncompletions
        return list(_iter_completions(_buffer(out.completions, 24 * n))) if n else []

    def _holds(self) -> Sequence[Hold]:
        out = self._out
        n = out.nholds
        if not n:
            return []
        words = array("q")
        words.frombytes(_buffer(out.holds, 32 * n))
        return HoldRows(words)

    def _transitions(self) -> list[Transition]:
        out = self._out
        n = out.ntransitions
        if not n:
            return []
        return [(q, bool(on), c, b) for q, on, c, b in _iter_transitions(_buffer(out.transitions, 32 * n))]

    def _check(self, rc: int, queue: int | None = None) -> None:
        """Raise the error PyAccounting raises for status ``rc``; ``queue`` is
        given for the calls about one queue or holder (their errors name no op)."""
        if rc == lib.ACCT_OK:
            return
        if queue is not None:  # a call about one queue or holder, not an op log
            if rc == lib.ACCT_ERR_UNKNOWN_QUEUE:
                raise AccountingError(f"unknown queue slot {queue}")
            if rc == lib.ACCT_ERR_UNKNOWN_HOLDER:
                raise AccountingError(f"unknown holder slot {queue}")
            if rc == lib.ACCT_ERR_NOMEM:
                raise MemoryError("out of memory")
        out = self._out
        index, value = out.err_op, out.err_value
        if rc == lib.ACCT_ERR_UNKNOWN_QUEUE:
            raise AccountingError(f"op {index}: unknown queue slot {value}")
        if rc == lib.ACCT_ERR_UNKNOWN_HOLDER:
            raise AccountingError(f"op {index}: unknown holder slot {value}")
        if rc == lib.ACCT_ERR_NOMEM:
            raise MemoryError(f"op {index}: out of memory")
        message = _MESSAGES.get(rc)
        if message is None:
            raise AccountingError(f"accounting status {rc}")
        raise AccountingError(message.format(index=index, value=value, words=OP_WORDS))


def _slot(slot: int, kind: str = "queue") -> int:
    """A slot the C side can take; anything else is no queue (or holder) at all."""
    if 0 <= slot <= _INT64_MAX:
        return slot
    raise AccountingError(f"unknown {kind} slot {slot}")


_MESSAGES = {
    lib.ACCT_ERR_LOG_LENGTH: "op log of {value} words is not a multiple of {words}",
    lib.ACCT_ERR_NESTED_TRANSFER: "op {index}: transfer opened inside a transfer",
    lib.ACCT_ERR_ENQUEUE_OVERFLOW: "op {index}: enqueue overflows queue {value}",
    lib.ACCT_ERR_DEQUEUE_UNDERFLOW: "op {index}: dequeue underflows queue {value}",
    lib.ACCT_ERR_END_WITHOUT_TRANSFER: "op {index}: end without a transfer",
    lib.ACCT_ERR_UNKNOWN_OP: "op {index}: unknown op code {value}",
    lib.ACCT_ERR_UNTERMINATED: "op log ends inside a transfer",
    lib.ACCT_ERR_HOLD_OUTSIDE_TRANSFER: "op {index}: hold outside a transfer",
}
