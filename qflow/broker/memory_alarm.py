"""The broker-wide memory alarm (RabbitMQ's ``vm_memory_high_watermark``). No I/O.

RabbitMQ's rule: when the broker's memory use goes above the high watermark
"it raises a memory alarm and will block all connections that are publishing
messages. Once the memory alarm has cleared (e.g. due to delivering some
messages to clients that consume and acknowledge the deliveries) normal
service resumes." Connections that only consume are not blocked.

qflowd does it with the mechanism queue flow control and the store use: while
the alarm is set, one more outside holder (qflow.broker.completion.Holder)
holds the completion of every transfer routed to any queue, so each producer
stops after its capacity of unfinished sends. Nothing is refused, nothing is
lost, and deliveries go on. The alarm clears below the low watermark (a lower
mark than the high one, so it does not flap); letting the holder go completes
every transfer nothing else holds, in order.

This module only decides: :meth:`MemoryAlarm.update` is fed the memory in use
(qflow.server.memory_monitor measures it) and sets or clears the alarm.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qflow.broker.broker import Broker
    from qflow.broker.completion import Holder
    from qflow.broker.queue import Queue

log = logging.getLogger("qflow.broker")


class MemoryAlarm:
    """The alarm of ``broker``: set above ``high`` bytes in use, cleared below
    ``low`` (``low`` <= ``high``). ``high`` 0: never set."""

    def __init__(self, broker: Broker, high: int, low: int) -> None:
        if high < 0 or low < 0 or low > high:
            raise ValueError(f"memory watermarks: need 0 <= low <= high, not low {low}, high {high}")
        self.broker = broker
        self.high = high
        self.low = low
        self.used = 0
        self.alarm_count = 0  # times the alarm was set
        self._holder: Holder | None = None

    @property
    def alarmed(self) -> bool:
        return self._holder is not None

    def update(self, used: int) -> bool:
        """``used`` bytes are in use now; True if that set or cleared the alarm (logged)."""
        self.used = used
        holder = self._holder
        if holder is not None:
            holder.take()  # its holds are let go all at once when the alarm clears: nothing to keep
            if used < self.low:
                self._clear(used)
                return True
            return False
        if self.high and used > self.high:
            self._set(used)
            return True
        return False

    def _set(self, used: int) -> None:
        broker = self.broker
        holder = self._holder = broker.add_holder("memory alarm")
        broker.name_holder(holder, "memory alarm")  # the sessions it holds are told so, by this name
        broker.carry(holder, _every_queue)
        self.alarm_count += 1
        log.warning("memory alarm set: %d bytes in use > high watermark %d; every producer is held", used,
                    self.high)

    def _clear(self, used: int) -> None:
        holder, self._holder = self._holder, None
        self.broker.remove_holder(holder)  # no queue carries it any more; completes what nothing else holds
        log.warning("memory alarm cleared: %d bytes in use < low watermark %d; producers released", used, self.low)

    def stats(self) -> dict[str, int | bool]:
        """What the management API shows."""
        return {"memoryUsed": self.used, "memoryHighWatermark": self.high, "memoryLowWatermark": self.low,
                "memoryAlarm": self.alarmed, "memoryAlarmCount": self.alarm_count}


def _every_queue(q: Queue) -> bool:
    """The alarm holds every producer: every queue, present and future, carries it."""
    return True
