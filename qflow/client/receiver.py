"""Receivers: a subscription's messages as they arrive, credit given back and
fetched messages accepted in batches.

A receiver knows its session only as a :class:`ReceiverSession`, the few
commands it sends; the connection hands it the frames addressed to it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol

import trio

from qflow.client.errors import ConnectionClosed
from qflow.client.message import Deliveries, NoDeliveries, ReceivedMessage
from qflow.client.pacing import pace
from qflow.protocol.ranges import RangeSet

_new = object.__new__


class Empty(Exception):
    """``fetch`` or ``fetch_many`` waited ``timeout`` seconds and no message arrived."""


class ReceiverSession(Protocol):
    """What a receiver uses of its session (:class:`qflow.client.Session` is one)."""

    error: ConnectionClosed | None

    def check(self) -> None: ...

    def add_credit(self, destination: str, messages: int) -> None: ...

    def accept(self, ids: RangeSet) -> None: ...

    def release(self, ids: RangeSet) -> None: ...

    async def cancel(self, destination: str) -> None: ...


class Receiver:
    """A subscription to a queue, and the messages it delivers
    (:meth:`Session.receiver <qflow.client.Session.receiver>` makes one).

    The broker sends at most ``capacity`` messages ahead of those fetched
    (its credit window); :meth:`fetch` and :meth:`fetch_many` take them in
    order and give the credit back in batches of half the window. With
    ``accept="auto"`` what was fetched is accepted in batches of
    ``ack_frequency`` (and before a fetch waits, and when the receiver, its
    session or its connection closes cleanly);
    with ``"explicit"`` the application accepts (:meth:`accept`,
    :meth:`ReceivedMessage.accept`); with ``"none"`` the broker removes each
    message as it sends it.

    Its connection calls :meth:`on_deliver_run`, :meth:`on_deliver` and
    :meth:`wake` as frames for it arrive, and its session calls :meth:`wake`
    when it ends; they are not for applications.

    Attributes:
      session: the session it is on.
      queue: the queue it receives from.
      destination: its name on the session, which the broker's deliveries carry.
      capacity: the credit window, in messages.
      accept_mode: ``"auto"``, ``"explicit"`` or ``"none"``.
      ack_frequency: auto accept: fetched messages accepted at a time.
    """

    def __init__(self, session: ReceiverSession, queue: str, destination: str, capacity: int, accept: str,
                 rate: float | None, ack_frequency: int | None) -> None:
        self.session = session
        self.queue = queue
        self.destination = destination
        self.capacity = capacity
        self.accept_mode = accept
        self.ack_frequency = ack_frequency or max(1, capacity // 2)
        self._buffer: deque[Deliveries] = deque()  # runs arrived, not begun yet
        self._run: Deliveries | NoDeliveries = NoDeliveries()  # the run being fetched from
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

    # -- frames from the connection ---------------------------------------------
    def on_deliver_run(self, frame: list[Any]) -> None:
        """A message.deliver-run frame for this receiver arrived: its
        messages join those to fetch. A fetch waiting for them wakes on
        :meth:`wake`, which the connection calls once per read, not per frame.

        Raises:
          FramingError, EntryError: if the frame is malformed.
        """
        self._buffer.append(Deliveries(self, frame))

    def on_deliver(self, frame: list[Any]) -> None:
        """A message.deliver frame (one message) for this receiver arrived; as
        :meth:`on_deliver_run`."""
        self._buffer.append(Deliveries.of_one(self, frame))

    def wake(self) -> None:
        """Wake the task waiting in a fetch, to look again: messages arrived,
        or the session ended."""
        self._event.set()

    def available(self) -> int:
        """The number of messages arrived and not fetched yet."""
        return self._run.count - self._i + sum(run.count for run in self._buffer)

    async def fetch(self, timeout: float | None = None) -> ReceivedMessage:
        """The next message, waiting for one to arrive if none has.

        Every so many fetches it gives credit back and, with
        ``accept="auto"``, accepts what was fetched (see the class).

        Args:
          timeout: seconds to wait for a message; None: no limit.

        Returns:
          The message.

        Raises:
          Empty: if no message arrived within ``timeout`` seconds.
          ConnectionClosed: if the session or its connection ended.
        """
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
        message.run = run
        message.index = i
        return message

    async def _fetch_slowly(self, timeout: float | None) -> tuple[Deliveries, int]:
        """fetch's other path: pacing, and a run to begin (waiting for one)."""
        if self._interval:
            self._next_fetch = await pace(self._next_fetch, self._interval)
        if self._i == self._run.count:
            if not self._buffer:
                await self._wait_for_message(timeout)
            self._next_run()
        return self._run, self._i

    async def fetch_many(self, limit: int | None = None, timeout: float | None = None) -> list[ReceivedMessage]:
        """The messages that have arrived, at least one: waits for the first
        as :meth:`fetch` does.

        Credit and auto accept work as for ``fetch``, once per call instead of
        once per message.

        Args:
          limit: at most this many (None: all that have arrived).
          timeout: seconds to wait for the first message; None: no limit.

        Returns:
          The messages, in order.

        Raises:
          ValueError: if ``limit`` is less than 1.
          Empty: if no message arrived within ``timeout`` seconds.
          ConnectionClosed: if the session or its connection ended.
        """
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
                message.run = run
                message.index = k
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
            self.session.add_credit(self.destination, fetched)
            self._credit_mark = self._taken
            self._set_next_settle()
            await trio.lowlevel.checkpoint()  # the credit goes out now, not when the buffer runs dry

    def _next_run(self) -> Deliveries:
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
                await self._event.wait()  # set by wake(): deliveries, or the session's end
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
            self.session.accept(self._to_accept)
            self._to_accept = RangeSet()
        self._ack_mark = self._taken
        self._set_next_settle()

    def accept_fetched(self) -> None:
        """Accept now what was fetched and not accepted yet (``accept="auto"``;
        nothing otherwise). Its session and connection call it when they close
        cleanly; nothing is sent once the session has ended."""
        self._flush_acks()

    def accept(self, messages: list[ReceivedMessage]) -> None:
        """Accept ``messages``: the broker removes them from the queue. For
        ``accept="explicit"``; sent at once, without waiting for the broker.

        Raises:
          ConnectionClosed: if the session or its connection ended.
        """
        self.session.accept(_delivery_ids(messages))

    def release(self, messages: list[ReceivedMessage]) -> None:
        """Release ``messages``: the broker puts them back in their places in
        the queue, marked redelivered. Sent at once, without waiting.

        Raises:
          ConnectionClosed: if the session or its connection ended.
        """
        self.session.release(_delivery_ids(messages))

    async def close(self) -> None:
        """Accept what was fetched (``accept="auto"``) and cancel the
        subscription; returns once the broker has cancelled it.

        Raises:
          ConnectionClosed: if the session or its connection ended.
        """
        self._flush_acks()
        await self.session.cancel(self.destination)


def _delivery_ids(messages: list[ReceivedMessage]) -> RangeSet:
    """The delivery numbers of ``messages``, as message.accept and message.release take them."""
    ids = RangeSet()
    for m in messages:
        ids.add(m.delivery_id)
    return ids
