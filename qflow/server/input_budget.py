"""The broker-wide bound on input held in unfinished frames (qflowd's
``--max-unfinished-input``).

Each connection's decoder already holds at most one frame's worth (the
negotiated maximum frame size); many connections each stopped halfway
through a large frame would still add up. After each read a connection
tells the budget how many bytes its decoder holds; when the total over all
connections passes the limit, the connections holding the most are closed
(``connection.close`` with RESOURCE_LIMIT_EXCEEDED naming the limit) until
it is under again. Closing, not pausing: a paused connection would keep
its bytes, and if every holder were paused none would ever finish a frame.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from qflow.server.admission import Throttle

# Past this total, unfinished frames are held in one exact copy (FrameDecoder.hold_exact): below it
# a frame's bytes may cost up to twice their size in the Unpacker's buffer, which is cheaper to run.
COMPACT_ABOVE = 16 * 1024 * 1024


class InputBudget:
    """Bytes held in unfinished frames, per connection and in total."""

    def __init__(self, limit: int, throttle: Throttle | None = None, compact_above: int = COMPACT_ABOVE) -> None:
        self.limit = limit  # 0: unbounded
        self.compact_above = compact_above
        self.total = 0
        self.held: dict[Hashable, int] = {}
        self.evicted = 0  # connections closed over the limit, since start
        self.throttle = throttle or Throttle()

    def update(self, conn: Hashable, pending: int) -> list[tuple[Hashable, str]]:
        """``conn`` now holds ``pending`` bytes. Returns the connections to
        close, with the reason to give each (none while under the limit)."""
        old = self.held.get(conn, 0)
        if pending == old:
            return []
        if pending:
            self.held[conn] = pending
        else:
            del self.held[conn]
        self.total += pending - old
        if not self.limit or self.total <= self.limit:
            return []
        victims = []
        largest = 0
        while self.total > self.limit and self.held:
            worst = max(self.held, key=self.held.__getitem__)
            n = self.held.pop(worst)
            self.total -= n
            largest = max(largest, n)
            victims.append((worst, f"{n} bytes held in an unfinished frame when the broker's input in unfinished "
                                   f"frames passed --max-unfinished-input {self.limit}"))
        self.evicted += len(victims)
        self.throttle.log(logging.WARNING, "unfinished-input",
                          "input in unfinished frames passed --max-unfinished-input %d bytes: closed %d "
                          "connection(s), the largest holding %d bytes", self.limit, len(victims),
                          largest)
        return victims

    @property
    def crowded(self) -> bool:
        """Many bytes are held in unfinished frames: each should be held in one
        exact copy (FrameDecoder.hold_exact), at the cost of a copy and a parse."""
        return self.total > self.compact_above

    def forget(self, conn: Hashable) -> None:
        """``conn`` has ended."""
        self.total -= self.held.pop(conn, 0)
