"""The accounting's interface and its op log's format: one definition that
the Python accounting, the C accounting (native/accounting.h) and the C
transfer scanner (native/transfers.h) share. The C side includes
native/qflow_shared.h, which the build writes from this file
(native/shared_header.py); keep this module's imports to the standard library.

See qflow.broker.accounting for what each op means.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from struct import Struct
from typing import Protocol

OP_WORDS = 5
OP_TRANSFER = 1
OP_ENQUEUE = 2
OP_END = 3
OP_TRANSFER1 = 4
OP_DEQUEUE = 5
OP_DEQUEUE_N = 6
OP_HOLD = 7
OP_RELEASE = 8

# The C accounting's status codes (native/accounting.h): what NativeAccounting
# turns into the AccountingError PyAccounting raises.
ACCT_OK = 0
ERR_NOMEM = 1
ERR_UNKNOWN_QUEUE = 2
ERR_LOG_LENGTH = 3
ERR_NESTED_TRANSFER = 4
ERR_ENQUEUE_OVERFLOW = 5
ERR_DEQUEUE_UNDERFLOW = 6
ERR_END_WITHOUT_TRANSFER = 7
ERR_UNKNOWN_OP = 8
ERR_UNTERMINATED = 9
ERR_UNKNOWN_HOLDER = 10
ERR_HOLD_OUTSIDE_TRANSFER = 11

# A hold token is (generation << 32) | index: the generation of its queue's (or
# holder's) holds when it was given. A queue that lets all its holds go moves
# on to the next generation, so its older tokens are known stale by this alone.
GENERATION_SHIFT = 32
GENERATION_MASK = 0x7FFFFFFF  # keeps tokens non-negative int64s


def make_token(generation: int, index: int) -> int:
    """The hold token of hold ``index`` of ``generation``."""
    return generation << GENERATION_SHIFT | index


def generation_of(token: int) -> int:
    """The generation of the holds a hold token belongs to."""
    return token >> GENERATION_SHIFT


def next_generation(generation: int) -> int:
    """The generation after ``generation`` (what a queue's holds move on to when it lets all go)."""
    return (generation + 1) & GENERATION_MASK


# One op of the log, packed: a precompiled Struct into a bytearray costs half
# of array('q').extend with a tuple.
pack_op = Struct(f"={OP_WORDS}q").pack

COUNT_MAX = 0xFFFFFFFF
SIZE_MAX = 0xFFFFFFFFFFFFFFFF

def thresholds_ok(stop: int, resume: int, limit: int) -> bool:
    """One unit's thresholds as set_thresholds accepts them (both implementations): each in
    0..limit, and resume <= stop where stop is non-zero (a unit with stop 0 may keep a resume)."""
    return 0 <= stop <= limit and 0 <= resume <= limit and (stop == 0 or resume <= stop)


CompletedRange = tuple[int, int, int]  # (session slot, first command id, last command id): transfers completed
Hold = tuple[int, int, int, int]
Transition = tuple[int, bool, int, int]


class AccountingError(Exception):
    """An impossible accounting state was requested (underflow, overflow,
    unknown queue or holder, malformed op). The state is left as it was before the op
    that failed; ops before it in the same log have been applied."""


class Accounting(Protocol):
    name: str

    def add_queue(self) -> int: ...
    def remove_queue(self, queue: int) -> list[CompletedRange]: ...
    def add_holder(self) -> int: ...
    def remove_holder(self, holder: int) -> list[CompletedRange]: ...
    def set_thresholds(
        self, queue: int, stop_count: int, resume_count: int, stop_size: int, resume_size: int
    ) -> tuple[list[CompletedRange], list[Transition]]: ...
    def apply(self, log: array) -> tuple[list[CompletedRange], Sequence[Hold], list[Transition]]: ...
    def drop_session(self, session: int) -> None: ...
    def stats(self, queue: int) -> tuple[int, int, bool, int, int]: ...
    def holds_of(self, holder: int) -> list[tuple[int, int]]: ...
