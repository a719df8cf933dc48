"""Session bookkeeping: command ids and completion ranges. No I/O.

As in AMQP 0-10, each command a client sends on a session has an implicit id,
counting from 0. The broker completes commands in any order (a transfer held
by flow control must not delay later ones) and reports newly completed ids as
ranges in ``session.completed``, one report per batch of input.
``execution.sync`` completes only once every command before it has.

``IncomingCommands`` is the broker's side, ``OutgoingCommands`` the client's.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

from qflow.protocol.ranges import RangeSet


class IncomingCommands:
    """Broker side: numbers incoming commands, gathers completions to report."""

    __slots__ = ("next_id", "to_report", "floor", "_above", "_syncs")

    def __init__(self) -> None:
        self.next_id = 0
        self.to_report = RangeSet()  # completed since the last report
        self.floor = 0  # every id below floor is complete
        self._above = RangeSet()  # completed ids above floor
        self._syncs: deque[int] = deque()  # waiting execution.sync ids, in order

    def receive(self) -> int:
        """Assign the next command id."""
        command_id = self.next_id
        self.next_id = command_id + 1
        return command_id

    def complete(self, command_id: int) -> None:
        self.complete_range(command_id, command_id)

    def complete_range(self, first: int, last: int) -> None:
        self._complete_range(first, last)
        syncs = self._syncs
        while syncs and syncs[0] <= self.floor:  # a loop, not recursion: syncs may queue up by the thousand
            sync_id = syncs.popleft()
            self._complete_range(sync_id, sync_id)

    def _complete_range(self, first: int, last: int) -> None:
        self.to_report.add_range(first, last)
        if first == self.floor and not self._above:
            self.floor = last + 1  # the usual case: in order
        else:
            self._above.add_range(first, last)
            end = self._above.prefix_end(self.floor)
            if end > self.floor:
                self.floor = end
                self._above.drop_below(end)  # in place: thousands of ranges may remain above

    def sync(self, command_id: int) -> None:
        """execution.sync ``command_id`` completes once every earlier command has."""
        if self.floor >= command_id:
            self.complete(command_id)
        else:
            self._syncs.append(command_id)

    def incomplete_count(self) -> int:
        """Commands received and not yet complete (waiting syncs included)."""
        return self.next_id - self.floor - len(self._above)

    @property
    def waiting_syncs(self) -> int:
        return len(self._syncs)

    @property
    def all_complete(self) -> bool:
        return self.floor == self.next_id

    def take_report(self) -> list[int] | None:
        """The wire ranges to send in ``session.completed``, or None."""
        if not self.to_report:
            return None
        wire = self.to_report.to_wire()
        self.to_report.clear()
        return wire


class OutgoingCommands:
    """Client side: assigns ids to outgoing commands and tracks the incomplete ones.

    Ids are consecutive and completions come as ranges, so nothing is kept
    per id: ``_firsts``/``_owners`` are runs of consecutive ids with one
    owner (a sender's transfers make long runs), and the incomplete ids are
    those in [``floor``, ``next_id``) that are not in ``_done`` (ids completed
    out of order, above the floor). Sending is a counter and, when the owner
    changes, a new run; a completion report costs per range, not per id.
    """

    __slots__ = ("next_id", "floor", "last_owner", "_firsts", "_owners", "_done")

    def __init__(self) -> None:
        self.next_id = 0
        self.floor = 0  # every id below is complete
        self.last_owner: object = _MISSING  # the owner of the newest run
        self._firsts: list[int] = []  # run k: ids [_firsts[k], _firsts[k + 1]) (the last, up to next_id)
        self._owners: list[object] = []
        self._done = RangeSet()

    def send(self, owner: object = None) -> int:
        """Number the next command, sent by ``owner``; its id."""
        command_id = self.next_id
        self.next_id = command_id + 1
        if owner is not self.last_owner:
            self.new_run(command_id, owner)
        return command_id

    def send_run(self, owner: object, n: int) -> int:
        """Number the next ``n`` commands, all sent by ``owner``; the first id."""
        first = self.next_id
        self.next_id = first + n
        if owner is not self.last_owner:
            self.new_run(first, owner)
        return first

    def new_run(self, first: int, owner: object) -> None:
        """Ids from ``first`` on belong to ``owner`` (the per-message path
        calls this only when the owner changes)."""
        self._firsts.append(first)
        self._owners.append(owner)
        self.last_owner = owner

    def owner_of(self, command_id: int) -> object:
        """The owner of an incomplete command; ``_MISSING`` if it is complete or was never sent."""
        if command_id < self.floor or command_id >= self.next_id or command_id in self._done:
            return _MISSING
        return self._owners[bisect_right(self._firsts, command_id) - 1]

    @property
    def incomplete(self) -> dict[int, object]:
        """id -> owner for every incomplete command (a view for tests and shutdown: it costs per id)."""
        return {i: self._owners[bisect_right(self._firsts, i) - 1]
                for i in range(self.floor, self.next_id) if i not in self._done}

    def _apply(self, wire: list[int]) -> list[tuple[object, int, int]]:
        """Mark the ranges of ``wire`` complete; returns (owner, first, last)
        for the parts that were incomplete, in id order within each range."""
        parts: list[tuple[object, int, int]] = []
        done = self._done
        for i in range(0, len(wire) - 1, 2):
            first, last = max(wire[i], self.floor), min(wire[i + 1], self.next_id - 1)
            if first > last:
                continue
            new = []
            if done:  # what completed out of order before is not new
                for a, b in done.ranges():
                    if b < first:
                        continue
                    if a > last:
                        break
                    if a > first:
                        new.append((first, a - 1))
                    first = b + 1
                    if first > last:
                        break
            if first <= last:
                new.append((first, last))
            for first, last in new:
                parts += self._runs_in(first, last)
                done.add_range(first, last)
        floor = done.prefix_end(self.floor)
        if floor > self.floor:
            self.floor = floor
            self._done = RangeSet(r for r in done.ranges() if r[0] > floor)
            k = bisect_right(self._firsts, floor) - 1  # runs wholly below the floor are over
            if k > 0:
                del self._firsts[:k], self._owners[:k]
        return parts

    def _runs_in(self, first: int, last: int) -> list[tuple[object, int, int]]:
        """(owner, first, last) for the parts of the runs within [first, last]."""
        firsts, owners = self._firsts, self._owners
        k = bisect_right(firsts, first) - 1
        out = []
        while first <= last:
            end = firsts[k + 1] - 1 if k + 1 < len(firsts) else last
            if end > last:
                end = last
            out.append((owners[k], first, end))
            first = end + 1
            k += 1
        return out

    def completed(self, wire: list[int]) -> list[tuple[int, object]]:
        """Apply a ``session.completed`` report; return (id, owner) for each
        command that became complete (ids already complete, or never sent,
        are ignored)."""
        return sorted((i, owner) for owner, first, last in self._apply(wire) for i in range(first, last + 1))

    def completed_counts(self, wire: list[int]) -> dict[object, int]:
        """As :meth:`completed`, but only how many commands of each owner
        became complete: a sender needs the count, not the ids."""
        counts: dict[object, int] = {}
        for owner, first, last in self._apply(wire):
            counts[owner] = counts.get(owner, 0) + last - first + 1
        return counts


_MISSING = object()
