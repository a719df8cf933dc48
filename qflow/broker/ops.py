"""The accounting's interface and its op log's format: one definition that
the Python accounting, the C accounting (native/accounting.h) and the C
transfer scanner (native/transfers.h) share. tests/test_native_layouts.py
checks the C headers' values against these.

See qflow.broker.accounting for what each op means.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
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
