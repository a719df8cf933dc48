"""A priority queue's entries: one FIFO per priority level. No I/O.

A queue declared with ``qpid.priorities`` (or ``x-max-priority``) keeps its
available entries here instead of in one deque, chosen once at declare: the
default queue's path is untouched. Delivery order is the highest level first,
FIFO within a level; :class:`PriorityEntries` offers the deque operations the
delivery and the queue use in that order (``popleft``, ``[0]``, iteration,
``extendleft`` of entries taken from the front), and :meth:`in_sequence` for
what goes by sequence number (browsing, ``queue.available``, the removals by
sequence): each level is in sequence order, so their merge is.

``[-1]`` is the entry with the highest sequence number (the one enqueued last
of those present), as for a FIFO deque.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from heapq import merge
from itertools import chain

from qflow.protocol.entries import Entry, seq_of


class PriorityEntries:
    """Entries by level, ``levels[0]`` the lowest. ``level_of(entry)`` says an
    entry's level when one comes back without it (a release, a delivery
    that found no room)."""

    __slots__ = ("levels", "level_of", "count")

    def __init__(self, levels: int, level_of: Callable[[Entry], int]) -> None:
        self.levels: list[deque[Entry]] = [deque() for _ in range(levels)]
        self.level_of = level_of
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[Entry]:
        """In delivery order: the highest level first, FIFO within one."""
        return chain.from_iterable(reversed(self.levels))

    def __getitem__(self, index: int) -> Entry:
        if index == 0:
            for level in reversed(self.levels):
                if level:
                    return level[0]
        elif index == -1 and self.count:
            return max((level[-1] for level in self.levels if level), key=seq_of)
        raise IndexError(f"priority entries: only [0] and [-1], and not empty ({self.count} entries)")

    def append_at(self, level: int, entry: Entry) -> None:
        self.levels[level].append(entry)
        self.count += 1

    def popleft(self) -> Entry:
        """The next entry to deliver."""
        for level in reversed(self.levels):
            if level:
                self.count -= 1
                return level.popleft()
        raise IndexError("pop from empty priority entries")

    def pop_lowest(self) -> Entry:
        """The oldest entry of the lowest level (what a full ring drops)."""
        for level in self.levels:
            if level:
                self.count -= 1
                return level.popleft()
        raise IndexError("pop from empty priority entries")

    pop = pop_lowest  # letting go of a deleted queue's entries, in any order

    def clear(self) -> None:
        for level in self.levels:
            level.clear()
        self.count = 0

    def put_back(self, entries: Iterable[Entry]) -> None:
        """Return entries taken out, each to its place by sequence number in its level."""
        by_level: dict[int, list[Entry]] = {}
        for entry in entries:
            by_level.setdefault(self.level_of(entry), []).append(entry)
        for i, returned in by_level.items():
            returned.sort(key=seq_of)
            level = self.levels[i]
            newest = seq_of(returned[-1])
            older = []
            while level and seq_of(level[0]) < newest:
                older.append(level.popleft())
            level.extendleft(reversed(list(merge(older, returned, key=seq_of))))
            self.count += len(returned)

    def extendleft(self, entries: Iterable[Entry]) -> None:
        """As deque.extendleft(reversed(taken)) for entries taken from the front."""
        self.put_back(entries)

    def in_sequence(self) -> Iterator[Entry]:
        """Every entry, in sequence-number order."""
        return merge(*self.levels, key=seq_of)

    def take(self, wanted: Callable[[int], bool], most: int, first: int = 0) -> tuple[list[Entry], int, bool]:
        """Take out, in sequence order, the entries numbered ``first`` or more whose
        numbers ``wanted`` accepts, looking at no more than ``most`` of them.
        Returns (those taken, the number to go on from, whether any numbered
        ``first`` or more were left unlooked at)."""
        seen = 0
        taken: list[Entry] = []
        nxt = first
        more = False
        for entry in self.in_sequence():
            seq = seq_of(entry)
            if seq < first:
                continue
            if seen == most:
                more = True
                break
            seen += 1
            nxt = seq + 1
            if wanted(seq):
                taken.append(entry)
        if taken:
            gone = {id(e) for e in taken}
            for i, level in enumerate(self.levels):
                if any(id(e) in gone for e in level):
                    self.levels[i] = deque(e for e in level if id(e) not in gone)
            self.count -= len(taken)
        return taken, nxt, more
