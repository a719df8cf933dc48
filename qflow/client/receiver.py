"""Receivers: a subscription's messages as they arrive, credit given back and
fetched messages accepted in batches."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import trio

from qflow import protocol as P
from qflow.client.message import ReceivedMessage, _Deliveries, _NoDeliveries
from qflow.client.pacing import pace
from qflow.protocol.ranges import RangeSet

if TYPE_CHECKING:
    from qflow.client.session import Session

_new = object.__new__


class Empty(Exception):
    """``fetch`` timed out with no message."""


class Receiver:
    """A subscription to a queue, with a credit window of ``capacity``
    messages (Session.receiver makes one). The connection's reader appends
    the runs of deliveries that arrive; ``fetch`` and ``fetch_many`` take
    messages from them and give credit back (and, in auto mode, accept) in
    batches."""

    def __init__(self, session: Session, queue: str, destination: str, capacity: int, accept: str,
                 rate: float | None, ack_frequency: int | None) -> None:
        self.session = session
        self.queue = queue
        self.destination = destination
        self.capacity = capacity
        self.accept_mode = accept
        self.ack_frequency = ack_frequency or max(1, capacity // 2)
        self._buffer: deque[_Deliveries] = deque()  # runs the connection's reader appends, not yet begun
        self._run: _Deliveries | _NoDeliveries = _NoDeliveries()  # the run being fetched from
        self._i = 0  # the next message of _run to fetch
        self._event = trio.Event()
        # Credit and auto-accept are settled every so many fetches: _taken counts
        # every message fetched, the marks say where each was last settled, and
        # _next_settle is the count at which one of them is next due.
        self._taken = 0
        self._credit_mark = 0
        self._credit_batch = max(1, capacity // 2)  # credit goes back in batches this big
        self._ack_mark = 0
        self._set_next_settle()
        self._to_accept = RangeSet()
        self._spanned = 0  # auto accept: _run's messages before this one are in _to_accept
        self._interval = 1.0 / rate if rate else 0.0
        self._next_fetch = 0.0

    def available(self) -> int:
        """Messages arrived and not fetched yet."""
        return self._run.count - self._i + sum(run.count for run in self._buffer)

    async def fetch(self, timeout: float | None = None) -> ReceivedMessage:
        """The next message; raises Empty after ``timeout`` seconds without one."""
        run = self._run
        i = self._i
        if i == run.count or self._interval:
            run, i = await self._fetch_slowly(timeout)
        self._i = i + 1
        taken = self._taken + 1
        self._taken = taken
        if taken >= self._next_settle:
            await self._settle()
        # ReceivedMessage(run, i) without the cost of calling __init__: the per-message path.
        message = _new(ReceivedMessage)
        message._run = run
        message._i = i
        return message

    async def _fetch_slowly(self, timeout: float | None) -> tuple[_Deliveries, int]:
        """fetch's other path: pacing, and a run to begin (waiting for one)."""
        if self._interval:
            self._next_fetch = await pace(self._next_fetch, self._interval)
        if self._i == self._run.count:
            if not self._buffer:
                await self._wait_for_message(timeout)
            self._next_run()
        return self._run, self._i

    async def fetch_many(self, limit: int | None = None, timeout: float | None = None) -> list[ReceivedMessage]:
        """The messages that have arrived, at most ``limit`` (all by default) and
        at least one: waits for the first as ``fetch`` does, raising Empty after
        ``timeout`` seconds. Credit and auto-accept work as for ``fetch``, once
        per call instead of once per message."""
        if limit is not None and limit < 1:
            raise ValueError(f"fetch_many: limit must be at least 1, not {limit}")
        if self._interval:  # paced: one at a time is the point
            return [await self.fetch(timeout)]
        available = self.available()
        if not available:
            await self._wait_for_message(timeout)
            available = self.available()
        n = available if limit is None else min(limit, available)
        messages: list[ReceivedMessage] = []
        while len(messages) < n:
            run = self._run
            i = self._i
            if i == run.count:
                run = self._next_run()
                i = 0
            j = min(run.count, i + n - len(messages))
            append = messages.append
            for k in range(i, j):  # ReceivedMessage(run, k), without calling __init__, as fetch does
                message = _new(ReceivedMessage)
                message._run = run
                message._i = k
                append(message)
            self._i = j
        self._taken += n
        if self._taken >= self._next_settle:
            await self._settle()
        return messages

    def _set_next_settle(self) -> None:
        self._next_settle = min(self._credit_mark + self._credit_batch, self._ack_mark + self.ack_frequency)

    async def _settle(self) -> None:
        """Auto-accept what was fetched, give credit back, each when due (at
        least one is: both set _next_settle again)."""
        if self._taken - self._ack_mark >= self.ack_frequency:
            self._flush_acks()
        fetched = self._taken - self._credit_mark
        if fetched >= self._credit_batch:
            self.session._send_command(P.FLOW, self.destination, fetched, 0)
            self._credit_mark = self._taken
            self._set_next_settle()
            await trio.lowlevel.checkpoint()  # the credit goes out now, not when the buffer runs dry

    def _next_run(self) -> _Deliveries:
        """Begin the next run in the buffer (there is one)."""
        self._span()
        run = self._run = self._buffer.popleft()
        self._i = self._spanned = 0
        return run

    async def _wait_for_message(self, timeout: float | None) -> None:
        while not self._buffer:
            self.session.check()
            self._flush_acks()
            self._event = trio.Event()
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await self._event.wait()  # set by deliveries or Session._shutdown
            if not self._buffer:
                self.session.check()
                if not self._event.is_set():
                    raise Empty(f"no message on {self.queue!r} within {timeout} s")

    def _span(self) -> None:
        """Auto accept: the messages of the current run fetched since the last
        span go into _to_accept, as one range (a run's ids are consecutive)."""
        i = self._i
        if i > self._spanned and self.accept_mode == "auto":
            first = self._run.first_id
            self._to_accept.add_range(first + self._spanned, first + i - 1)
        self._spanned = i

    def _flush_acks(self) -> None:
        self._span()
        if self._to_accept and self.session.error is None:
            self.session._send_command(P.ACCEPT, self._to_accept.to_wire())
            self._to_accept = RangeSet()
        self._ack_mark = self._taken
        self._set_next_settle()

    def accept(self, messages: list[ReceivedMessage]) -> None:
        ids = RangeSet()
        for m in messages:
            ids.add(m.delivery_id)
        self.session._send_command(P.ACCEPT, ids.to_wire())

    def release(self, messages: list[ReceivedMessage]) -> None:
        ids = RangeSet()
        for m in messages:
            ids.add(m.delivery_id)
        self.session._send_command(P.RELEASE, ids.to_wire())

    async def close(self) -> None:
        """Accept what was fetched (auto mode) and cancel the subscription."""
        self._flush_acks()
        await self.session._call(P.CANCEL, self.destination)
        self.session.receivers.pop(self.destination, None)
