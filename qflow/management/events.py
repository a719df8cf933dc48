"""The web console's live feed: server-sent events (``GET /api/events``). No I/O.

An :class:`EventStream` is what the API answers to ``GET /api/events``
instead of a Response; ``http.ManagementServer`` writes its events, one
``next_event()`` every ``interval`` seconds, for as long as the client reads
them. Each event is one whole snapshot (``event: snapshot``, JSON data): the
queues, connections and broker totals as ``/api/queues``,
``/api/connections`` and ``/api/broker`` show them, built from the same
views, so the console never shows a number the API would not. Nothing here
touches the per-message path: a snapshot reads the statistics the broker
keeps anyway.

The snapshots are a user's :class:`Feed`, shared by all that user's streams
(the API keeps one per user while a stream uses it): one snapshot is built
and encoded per interval however many consoles watch, and a stream is sent
the latest, at most one interval old.

Rates are computed by the feed from the counters of its previous snapshot:
``enqueueRate`` and ``dequeueRate`` (messages per second) are the change of
``msgTotalEnqueues`` and ``msgTotalDequeues`` divided by the time between
the two snapshots; None on the feed's first snapshot of a queue (no interval
yet). A queue is known by its name and ``incarnation``, so a queue deleted
and declared again starts afresh instead of showing a negative rate.

Memory is bounded by construction: the server takes the next event only once
the previous one has been handed to the socket, and drops a client that does
not read one within its timeout. Time is bounded too: a snapshot's cost grows
with the number of queues and connections, so a feed whose last snapshot took
longer than 1/``COST_SHARE`` of ``INTERVAL`` to build waits ``COST_SHARE``
times that cost before the next. A user's consoles never take more than
about 5 % of the broker's time, however large the broker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

INTERVAL = 0.5  # seconds between two snapshots of a feed, at least
RETRY_MS = 2000  # how long a browser's EventSource waits before reconnecting (after a broker restart)
CONTENT_TYPE = "text/event-stream; charset=utf-8"
COST_SHARE = 20  # a feed waits at least this many times what its last snapshot took to build

Snapshot = Callable[[], dict[str, Any]]


class Feed:
    """One user's snapshots, shared by that user's streams. ``snapshot()``
    gives the current views (the API binds it to the user, so an ACL filters
    every snapshot as it filters the routes); ``clock`` is a monotonic clock
    in seconds."""

    def __init__(self, snapshot: Snapshot, clock: Callable[[], float], interval: float = INTERVAL) -> None:
        self.snapshot = snapshot
        self.clock = clock
        self.least_interval = interval
        self.interval = interval  # between two snapshots: more on a large broker
        self.built = 0  # snapshots built so far
        self._event = b""
        self._built_at = 0.0
        self._previous: tuple[float, dict[tuple[str, str], tuple[int, int]]] | None = None

    def latest(self) -> bytes:
        """The latest snapshot as an event, built anew if it is an interval old (or there is none)."""
        now = self.clock()
        if self.built and now - self._built_at < self.interval:
            return self._event
        view = self.snapshot()
        counters: dict[tuple[str, str], tuple[int, int]] = {}
        previous_time, previous = self._previous if self._previous is not None else (now, {})
        elapsed = now - previous_time
        for q in view["queues"]:
            key = (q["name"], q.get("incarnation", ""))
            now_counts = (q["msgTotalEnqueues"], q["msgTotalDequeues"])
            counters[key] = now_counts
            before = previous.get(key)
            if before is None or elapsed <= 0:
                q["enqueueRate"] = q["dequeueRate"] = None
            else:
                q["enqueueRate"] = round(max(0, now_counts[0] - before[0]) / elapsed, 1)
                q["dequeueRate"] = round(max(0, now_counts[1] - before[1]) / elapsed, 1)
        self._previous = (now, counters)
        data = json.dumps(view, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        # JSON from json.dumps holds no raw newline, so the whole snapshot is one data line.
        self._event = f"event: snapshot\ndata: {data}\n\n".encode()
        self._built_at = now
        self.built += 1
        self.interval = max(self.least_interval, (self.clock() - now) * COST_SHARE)
        return self._event


class EventStream:
    """One client's stream of its user's :class:`Feed`."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.sent = 0  # events taken so far: the server takes one only after the last was written

    @property
    def interval(self) -> float:
        """How long to wait before the next event."""
        return self.feed.interval

    def next_event(self) -> bytes:
        """The next event, framed for the wire (the first also sets the client's reconnection delay)."""
        event = self.feed.latest()
        self.sent += 1
        return f"retry: {RETRY_MS}\n".encode() + event if self.sent == 1 else event
