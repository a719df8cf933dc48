"""What the web console's feed costs the broker: ``make bench-console``.

1. The snapshot alone, in process: the time one event (GET /api/events)
   takes to build for a broker of N queues, its longest step (the longest the
   broker serves nobody else while building it), and the interval its feed
   then keeps (qflow.management.events: at least 20 times that cost, 0.5 s at least).
2. End to end: one producer and one consumer through one queue
   (bench/run.py's clients, three processes over loopback), with no console
   and with ``--streams`` consoles reading the feed, on a broker that has
   ``--queues`` other queues (so that each snapshot has some weight).
   The two are run in alternation, ``--rounds`` times each; the figure is the
   ratio of the medians (with / without), as figures drift on a shared machine.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import run as bench  # noqa: E402 - bench/run.py: the broker and the clients
import trio  # noqa: E402

from qflow.broker import Broker  # noqa: E402
from qflow.management import ManagementApi  # noqa: E402
from qflow.management.events import Feed  # noqa: E402


def snapshot_cost(queues: int, reps: int = 5) -> dict:
    broker = Broker()
    api = ManagementApi(broker)
    for i in range(queues):
        broker.declare_queue(f"queue-{i:05d}")
    times, longest, size, feed = [], [], 0, None
    for _ in range(reps):  # a fresh feed each time: a feed sends its latest snapshot again within its interval
        feed = Feed(lambda: api.snapshot_steps("anonymous"), time.monotonic)
        steps = feed.latest_steps()
        total = worst = 0.0
        while True:
            t0 = time.perf_counter()
            try:
                next(steps)
            except StopIteration as stop:
                size = len(stop.value)
                break
            finally:
                took = time.perf_counter() - t0
                total += took
                worst = max(worst, took)
        times.append(total)
        longest.append(worst)
    return {"queues": queues, "event_ms": round(statistics.median(times) * 1000, 2),
            "longest_step_ms": round(statistics.median(longest) * 1000, 2), "event_bytes": size,
            "interval_s": round(feed.interval, 2)}


class Reader(threading.Thread):
    """A console: reads GET /api/events and throws it away, counting events."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.events = 0
        self.stopped = False

    def run(self) -> None:
        try:
            while not self.stopped:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                self.events += data.count(b"event: snapshot")
        except OSError:
            pass

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()


async def _declare_many(port: int, count: int) -> None:
    async with await bench.qflow.connect("127.0.0.1", port) as conn:
        ssn = await conn.session()
        for i in range(count):
            await ssn.declare_queue(f"idle-{i:05d}")


def end_to_end(count: int, size: int, streams: int, queues: int, rounds: int) -> dict:
    d = bench.start_broker()
    try:
        trio.run(_declare_many, d.port, queues)
        trio.run(bench._declare, d.port, "bench", bench.NO_FLOW, None, False)
        plain, watched, events = [], [], 0
        for _ in range(rounds):
            for with_console in (False, True):
                readers = [Reader(d.mgmt_port) for _ in range(streams)] if with_console else []
                for r in readers:
                    r.start()
                try:
                    consumer = bench._client("consume", d.port, "bench", count, size)
                    producer = bench._client("produce", d.port, "bench", count, size)
                    t_last, t0 = bench.run_clients(consumer, producer)
                finally:
                    for r in readers:
                        r.stop()
                    events += sum(r.events for r in readers)
                (watched if with_console else plain).append(count / (t_last - t0))
        return {"messages": count, "size": size, "streams": streams, "other_queues": queues, "rounds": rounds,
                "msgs_per_s_without": round(statistics.median(plain)),
                "msgs_per_s_with": round(statistics.median(watched)),
                "ratio_with_over_without": round(statistics.median(watched) / statistics.median(plain), 3),
                "events_read": events}
    finally:
        d.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--queues", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="seconds: small counts, one round")
    args = p.parse_args()
    if args.quick:
        args.messages, args.rounds = 20_000, 1
    result = {"snapshot": [snapshot_cost(n) for n in (10, 1000, 10_000)],
              "end_to_end": end_to_end(args.messages, args.size, args.streams, args.queues, args.rounds)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
