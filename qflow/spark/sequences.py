"""Sets of sequence numbers, as a read plans, splits and checks them: range
by range, never number by number (a batch plans hundreds of thousands).

A queue numbers its messages 1, 2, 3, ...; a read is of exactly the numbers
its plan names (a RangeSet), split into Spark partitions
(:class:`SequenceSet`).
"""

from __future__ import annotations

import math

from pyspark.sql.datasource import InputPartition

from qflow.protocol.ranges import RangeSet

MAX_PARTITIONS = 8  # default split of a range: one partition per ...
MESSAGES_PER_PARTITION = 10_000  # ... this many messages, at most MAX_PARTITIONS


def describe(sequences: RangeSet) -> str:
    """``5..7, 9``: a set of sequence numbers as a person reads it."""
    parts = [f"{a}" if a == b else f"{a}..{b}" for a, b in sequences.ranges()]
    if len(parts) > 8:
        parts = parts[:8] + [f"... ({len(sequences)} in all)"]
    return ", ".join(parts)


class SequenceSet(InputPartition):
    """A Spark partition of a read: exactly these sequence numbers of one
    incarnation of a queue.

    Args:
      index: the partition's number in its batch.
      incarnation: the queue's incarnation the numbers are of.
      sequences: the numbers, as a flat range list (``RangeSet.to_wire``).
      queue: the queue's name.
    """

    def __init__(self, index: int, incarnation: str, sequences: list[int], queue: str = "") -> None:
        self.index = index
        self.incarnation = incarnation
        self.sequences = sequences
        self.queue = queue

    def __repr__(self) -> str:
        return f"SequenceSet({self.index}, {self.queue!r}, {describe(RangeSet.from_wire(self.sequences))})"


def split_sequences(sequences: RangeSet, parts: int | None, per_part: int = MESSAGES_PER_PARTITION) -> list[RangeSet]:
    """``sequences`` split into sets of consecutive members, as even as can be.

    Args:
      sequences: the numbers to split.
      parts: how many sets; None: one per ``per_part`` members, at most
        MAX_PARTITIONS. Never more than there are members.
      per_part: see ``parts``.

    Returns:
      The sets in order; none for no numbers.
    """
    n = len(sequences)
    if n == 0:
        return []
    if parts is None:
        parts = min(MAX_PARTITIONS, math.ceil(n / per_part))
    parts = max(1, min(parts, n))
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    out: list[RangeSet] = []
    current = RangeSet()
    room = sizes[0]
    for first, last in sequences.ranges():
        while first <= last:
            take = min(room, last - first + 1)
            current.add_range(first, first + take - 1)
            first += take
            room -= take
            if room == 0:
                out.append(current)
                current = RangeSet()
                room = sizes[len(out)] if len(out) < parts else 0
    return out


def minus(a: RangeSet, b: RangeSet) -> RangeSet:
    """The numbers of ``a`` that are not in ``b``, worked out range by range."""
    out = RangeSet()
    theirs = list(b.ranges())
    j = 0
    for first, last in a.ranges():
        while j < len(theirs) and theirs[j][1] < first:
            j += 1
        at = first
        k = j
        while k < len(theirs) and theirs[k][0] <= last:
            if theirs[k][0] > at:
                out.add_range(at, theirs[k][0] - 1)
            at = max(at, theirs[k][1] + 1)
            k += 1
        if at <= last:
            out.add_range(at, last)
    return out


def intersect(a: RangeSet, b: RangeSet) -> RangeSet:
    """The numbers in both ``a`` and ``b``, range by range."""
    return minus(a, minus(a, b))
