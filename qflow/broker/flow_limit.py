"""A queue's flow limit as the broker sees it beside the accounting: the
senders writing to the queue, and the manual's worst case. No I/O.

The limit itself (the thresholds, the ON/OFF state, "When the total number of
enqueued messages is greater than [stop], the queue's flow control state
transitions to ON ... it remains ON until the total number of enqueued
messages is less than [resume]") is counted by the accounting
(qflow.broker.accounting); what it holds is the completion's
(qflow.broker.completion). What is left here is the depth a queue can reach
while its flow control is ON: "a producer may send its capacity worth of
messages _after_ a queue has reached the flow stop threshold" (the Qpid C++
manual: with a stop of 100 and senders of capacity 50 and 15, "worst-case,
the queue may receive up to 165 messages"), and the warning when that no
longer fits the queue's limit.
"""

from __future__ import annotations

import logging
from typing import Any

from qflow.broker.queue import Queue
from qflow.broker.settings import QueueSettings
from qflow.protocol.names import printable

log = logging.getLogger("qflow.broker")


class FlowLimit:
    """The senders writing to one queue, and whether its worst case was warned of."""

    __slots__ = ("writers", "worst_warned")

    def __init__(self) -> None:
        self.writers: dict[Any, int] = {}  # session -> its announced sender capacity
        self.worst_warned = False

    def worst_case(self, settings: QueueSettings) -> int:
        """The manual's worst case: stop threshold plus the capacities of the
        senders currently writing to the queue (0 without a count threshold)."""
        if not settings.stop_count:
            return 0
        return settings.stop_count + sum(self.writers.values())

    def note_writer(self, q: Queue, ssn: Any, capacity: int) -> None:
        """``ssn`` writes to ``q`` with sender capacity ``capacity``."""
        if self.writers.get(ssn) != capacity:
            self.writers[ssn] = capacity
            self.check_worst_case(q)

    def check_worst_case(self, q: Queue) -> None:
        """Warn once when the manual's worst case no longer fits the queue."""
        s = q.settings
        worst = self.worst_case(s)
        over = bool(s.stop_count and s.max_count and worst > s.max_count)
        if over and not self.worst_warned:
            log.warning('queue "%s": worst-case depth %d (stop %d + sender capacities %d) exceeds qpid.max_count %d;'
                        " a transfer can still be rejected despite flow control",
                        printable(q.name), worst, s.stop_count, sum(self.writers.values()), s.max_count)
        self.worst_warned = over
