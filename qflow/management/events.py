"""The web console's live feed: server-sent events (``GET /api/events``). No I/O.

An :class:`EventStream` is what the API answers to ``GET /api/events``
instead of a Response; ``http.ManagementServer`` writes its events, one
``next_event()`` every ``INTERVAL`` seconds, for as long as the client reads
them. Each event is one whole snapshot (``event: snapshot``, JSON data): the
queues, connections and broker totals as ``/api/queues``,
``/api/connections`` and ``/api/broker`` show them, built from the same
views, so the console never shows a number the API would not. Nothing here
touches the per-message path: a snapshot reads the statistics the broker
keeps anyway.

Rates are computed here, per stream, from the counters of this stream's
previous snapshot: ``enqueueRate`` and ``dequeueRate`` (messages per second)
are the change of ``msgTotalEnqueues`` and ``msgTotalDequeues`` divided by
the time between the two snapshots; None on a stream's first snapshot of a
queue (no interval yet). A queue is known by its name and ``incarnation``,
so a queue deleted and declared again starts afresh instead of showing a
negative rate.

Memory is bounded by construction: the server builds the next snapshot only
once the previous one has been handed to the socket, and drops a client that
does not read one within its timeout. Time is bounded too: a snapshot's cost
grows with the number of queues and connections, so a stream whose last
snapshot took longer than 1/``COST_SHARE`` of ``INTERVAL`` to build waits
``COST_SHARE`` times that cost before the next. A stream never takes more
than about 5 % of the broker's time, however large the broker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

INTERVAL = 0.5  # seconds between two snapshots of a stream
RETRY_MS = 2000  # how long a browser's EventSource waits before reconnecting (after a broker restart)
CONTENT_TYPE = "text/event-stream; charset=utf-8"
COST_SHARE = 20  # a stream waits at least this many times what its last snapshot took to build

Snapshot = Callable[[], dict[str, Any]]


class EventStream:
    """One client's feed. ``snapshot()`` gives the current views (the API
    binds it to the requesting user, so an ACL filters every snapshot as it
    filters the routes); ``clock`` is a monotonic clock in seconds."""

    def __init__(self, snapshot: Snapshot, clock: Callable[[], float], interval: float = INTERVAL) -> None:
        self.snapshot = snapshot
        self.clock = clock
        self.least_interval = interval
        self.interval = interval  # how long to wait before the next event: more on a large broker
        self.sent = 0  # events built so far: the server builds one only after the last was written
        self._previous: tuple[float, dict[tuple[str, str], tuple[int, int]]] | None = None

    def next_event(self) -> bytes:
        """The next event, framed for the wire (the first also sets the client's reconnection delay)."""
        now = self.clock()
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
        self.interval = max(self.least_interval, (self.clock() - now) * COST_SHARE)
        head = f"retry: {RETRY_MS}\n" if self.sent == 0 else ""
        self.sent += 1
        # JSON from json.dumps holds no raw newline, so the whole snapshot is one data line.
        return f"{head}event: snapshot\ndata: {data}\n\n".encode()
