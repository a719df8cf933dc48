"""Ranged sets of ids (command ids, delivery ids), as AMQP 0-10's sequence sets.

Stored as a sorted list of disjoint, non-adjacent ``[first, last]`` ranges.
Ids usually arrive in increasing order, so adding at the end is the fast path.
On the wire a set is a flat list ``[first0, last0, first1, last1, ...]``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator

# The most ranges one command may carry (message.accept, message.release,
# queue.remove-sequences) or one queue.available answer may hold: the broker
# refuses more, and the client splits what it sends to fit.
MAX_RANGES = 10_000


class RangeSet:
    __slots__ = ("_firsts", "_lasts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []
        for first, last in ranges:
            self.add_range(first, last)

    @classmethod
    def from_wire(cls, flat: object) -> RangeSet:
        """Parse ``[f0, l0, f1, l1, ...]``; raises ValueError naming the fault."""
        if type(flat) is not list or len(flat) % 2:
            raise ValueError("a range set is a list of [first, last] pairs flattened")
        rs = cls()
        pairs = list(zip(flat[0::2], flat[1::2], strict=True))
        ordered = True
        previous = -1
        for first, last in pairs:
            if type(first) is not int or type(last) is not int or first < 0 or last < first:
                raise ValueError(f"bad range [{first!r}, {last!r}]")
            if first < previous:
                ordered = False
            previous = first
        if not ordered:
            # Merged in order, every range is added at the end: O(n log n) for a set sent in
            # any order, where adding each in the middle would cost O(n) apiece.
            pairs.sort()
        for first, last in pairs:
            rs.add_range(first, last)
        return rs

    def to_wire(self) -> list[int]:
        out: list[int] = []
        for first, last in zip(self._firsts, self._lasts, strict=True):
            out.append(first)
            out.append(last)
        return out

    def add(self, value: int) -> None:
        self.add_range(value, value)

    def add_range(self, first: int, last: int) -> None:
        firsts, lasts = self._firsts, self._lasts
        if not firsts or first > lasts[-1] + 1:
            firsts.append(first)
            lasts.append(last)
            return
        if first >= firsts[-1]:  # overlaps or touches the last range
            if last > lasts[-1]:
                lasts[-1] = last
            return
        # General case: merge every range overlapping or adjacent to [first, last].
        i = bisect_left(lasts, first - 1)
        j = i
        while j < len(firsts) and firsts[j] <= last + 1:
            first = min(first, firsts[j])
            last = max(last, lasts[j])
            j += 1
        firsts[i:j] = [first]
        lasts[i:j] = [last]

    def update(self, other: RangeSet) -> None:
        for first, last in zip(other._firsts, other._lasts, strict=True):
            self.add_range(first, last)

    def __contains__(self, value: int) -> bool:
        i = bisect_left(self._lasts, value)
        return i < len(self._firsts) and self._firsts[i] <= value

    def ranges(self) -> Iterator[tuple[int, int]]:
        return zip(self._firsts, self._lasts, strict=True)

    def __iter__(self) -> Iterator[int]:
        for first, last in zip(self._firsts, self._lasts, strict=True):
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in zip(self._firsts, self._lasts, strict=True))

    def __bool__(self) -> bool:
        return bool(self._firsts)

    @property
    def range_count(self) -> int:
        """How many disjoint ranges it holds (its wire form has twice as many numbers)."""
        return len(self._firsts)

    def clear(self) -> None:
        self._firsts.clear()
        self._lasts.clear()

    def drop_below(self, value: int) -> None:
        """Remove every range that begins below ``value`` (callers drop a
        completed prefix, which ends below ``value``)."""
        i = bisect_left(self._firsts, value)
        if i:
            del self._firsts[:i]
            del self._lasts[:i]

    def prefix_end(self, start: int = 0) -> int:
        """The largest n such that every id in [start, n) is in the set."""
        i = bisect_left(self._lasts, start)  # the first range that may hold start
        if i < len(self._firsts) and self._firsts[i] <= start:
            return self._lasts[i] + 1
        return start

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and self._firsts == other._firsts and self._lasts == other._lasts

    def __repr__(self) -> str:
        return f"RangeSet({list(self.ranges())!r})"
