"""Session bookkeeping: command ids and completion ranges. No I/O.

As in AMQP 0-10, each command a client sends on a session has an implicit id,
counting from 0. The broker completes commands in any order (a transfer held
by flow control must not delay later ones) and reports newly completed ids as
ranges in ``session.completed``, one report per batch of input.
``execution.sync`` completes only once every command before it has.

``IncomingCommands`` is the broker's side, ``OutgoingCommands`` the client's.
"""

from __future__ import annotations

from qflow.ranges import RangeSet


class IncomingCommands:
    """Broker side: numbers incoming commands, gathers completions to report."""

    __slots__ = ("next_id", "to_report", "floor", "_above", "_syncs")

    def __init__(self) -> None:
        self.next_id = 0
        self.to_report = RangeSet()  # completed since the last report
        self.floor = 0  # every id below floor is complete
        self._above = RangeSet()  # completed ids above floor
        self._syncs: list[int] = []

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
            sync_id = syncs.pop(0)
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
                self._above = RangeSet(r for r in self._above.ranges() if r[0] > end)

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
    """Client side: assigns ids to outgoing commands and tracks the incomplete ones."""

    __slots__ = ("next_id", "incomplete")

    def __init__(self) -> None:
        self.next_id = 0
        self.incomplete: dict[int, object] = {}  # id -> what waits on it (sender or None)

    def send(self, owner: object = None) -> int:
        command_id = self.next_id
        self.next_id = command_id + 1
        self.incomplete[command_id] = owner
        return command_id

    def completed(self, wire: list[int]) -> list[tuple[int, object]]:
        """Apply a ``session.completed`` report; return (id, owner) for each
        command that became complete (ids already complete are ignored)."""
        done: list[tuple[int, object]] = []
        pop = self.incomplete.pop
        for i in range(0, len(wire) - 1, 2):
            first, last = wire[i], wire[i + 1]
            if last - first > len(self.incomplete):
                ids = [c for c in self.incomplete if first <= c <= last]
            else:
                ids = range(first, last + 1)
            for command_id in ids:
                owner = pop(command_id, _MISSING)
                if owner is not _MISSING:
                    done.append((command_id, owner))
        return done

    def completed_counts(self, wire: list[int]) -> dict[object, int]:
        """As :meth:`completed`, but only how many commands of each owner
        became complete: a sender needs the count, not the ids, and a report
        covers hundreds of its transfers."""
        counts: dict[object, int] = {}
        incomplete = self.incomplete
        pop = incomplete.pop
        owner = last_owner = _MISSING
        n = 0
        for i in range(0, len(wire) - 1, 2):
            first, last = wire[i], wire[i + 1]
            if last - first > len(incomplete):
                ids = [c for c in incomplete if first <= c <= last]
            else:
                ids = range(first, last + 1)
            for command_id in ids:
                owner = pop(command_id, _MISSING)
                if owner is last_owner:
                    n += 1
                elif owner is not _MISSING:
                    if n:
                        counts[last_owner] = counts.get(last_owner, 0) + n
                    last_owner, n = owner, 1
        if n:
            counts[last_owner] = counts.get(last_owner, 0) + n
        return counts


_MISSING = object()
