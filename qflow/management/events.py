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
not read one within its timeout. Time is bounded too: a snapshot is built in
steps of at most ``api.SNAPSHOT_STEP`` queues, the server serving everyone
else between two (so a broker of 10,000 queues is never stopped for the
whole snapshot), and a feed whose last snapshot took longer than
1/``COST_SHARE`` of ``INTERVAL`` to build waits ``COST_SHARE`` times that
cost before the next: a user's consoles never take more than about 5 % of
the broker's time, however large the broker.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from typing import Any

INTERVAL = 0.5  # seconds between two snapshots of a feed, at least
RETRY_MS = 2000  # how long a browser's EventSource waits before reconnecting (after a broker restart)
CONTENT_TYPE = "text/event-stream; charset=utf-8"
COST_SHARE = 20  # a feed waits at least this many times what its last snapshot took to build

# A snapshot built in steps: yields the queues' views a chunk at a time, returns the rest
# ({time, user, broker, connections}); the caller may let others run between two chunks.
SnapshotSteps = Callable[[], Generator[list[dict[str, Any]], None, dict[str, Any]]]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def run_steps(steps: Generator[Any, None, Any]) -> Any:
    """Run a generator of steps to its end, all at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class Feed:
    """One user's snapshots, shared by that user's streams. ``snapshot_steps()``
    builds the current views in steps (the API binds it to the user, so an
    ACL filters every snapshot as it filters the routes); ``clock`` is a
    monotonic clock in seconds."""

    def __init__(self, snapshot_steps: SnapshotSteps, clock: Callable[[], float], interval: float = INTERVAL) -> None:
        self.snapshot_steps = snapshot_steps
        self.clock = clock
        self.least_interval = interval
        self.interval = interval  # between two snapshots: more on a large broker
        self.built = 0  # snapshots built so far
        self._event = b""
        self._built_at = 0.0
        self._building = False
        self._previous: tuple[float, dict[tuple[str, str], tuple[int, int]]] | None = None

    def latest(self) -> bytes:
        """:meth:`latest_steps` all at once."""
        return run_steps(self.latest_steps())

    def latest_steps(self) -> Generator[None, None, bytes]:
        """The latest snapshot as an event, built anew (in steps: yields between two chunks
        of queues, and the caller may serve others there) if it is an interval old or there
        is none. While one is being built for another stream, the previous one is it."""
        start = self.clock()
        if self.built and (self._building or start - self._built_at < self.interval):
            return self._event
        self._building = True
        try:
            previous_time, previous = self._previous if self._previous is not None else (start, {})
            elapsed = start - previous_time
            counters: dict[tuple[str, str], tuple[int, int]] = {}
            pieces: list[str] = []
            cost = 0.0  # this build's own time, not that of others served between its steps
            resumed = start
            steps = self.snapshot_steps()
            while True:
                try:
                    chunk = next(steps)
                except StopIteration as stop:
                    rest: dict[str, Any] = stop.value
                    break
                for q in chunk:
                    key = (q["name"], q.get("incarnation", ""))
                    now_counts = (q["msgTotalEnqueues"], q["msgTotalDequeues"])
                    counters[key] = now_counts
                    before = previous.get(key)
                    if before is None or elapsed <= 0:
                        q["enqueueRate"] = q["dequeueRate"] = None
                    else:
                        q["enqueueRate"] = round(max(0, now_counts[0] - before[0]) / elapsed, 1)
                        q["dequeueRate"] = round(max(0, now_counts[1] - before[1]) / elapsed, 1)
                if chunk:
                    pieces.append(_json(chunk)[1:-1])  # the chunk's views without the brackets
                cost += self.clock() - resumed
                yield
                resumed = self.clock()
            self._previous = (start, counters)
            data = (f'{{"time":{_json(rest["time"])},"user":{_json(rest["user"])},"broker":{_json(rest["broker"])},'
                    f'"queues":[{",".join(pieces)}],"connections":{_json(rest["connections"])}}}')
            # JSON from json.dumps holds no raw newline, so the whole snapshot is one data line.
            self._event = f"event: snapshot\ndata: {data}\n\n".encode()
            self._built_at = start
            self.built += 1
            cost += self.clock() - resumed
            self.interval = max(self.least_interval, cost * COST_SHARE)
            return self._event
        finally:
            self._building = False


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
        """:meth:`next_event_steps` all at once."""
        return run_steps(self.next_event_steps())

    def next_event_steps(self) -> Generator[None, None, bytes]:
        """The next event, framed for the wire (the first also sets the client's reconnection
        delay); built in steps, as :meth:`Feed.latest_steps`."""
        event = yield from self.feed.latest_steps()
        self.sent += 1
        return f"retry: {RETRY_MS}\n".encode() + event if self.sent == 1 else event
