"""A bounded soak of one qflowd (issue 17): ``make soak``, a few minutes.

1000 connections at once against a fresh qflowd: producers and consumers on
shared queues, a producer to a queue with a slow consumer (its flow stops and
resumes over and over), a bulk queue filled then purged, then deleted, each
while everything else runs (the long commands work in slices), and idle
connections making up the rest. A probe connection does round trips
(queue.query) all along. At the end the producers stop, the consumers drain
every queue, and each message whose send completed is looked for among the
received ones.

Reported (and as JSON on the last line): qflowd's resident set over time,
the probe's worst and 99th-percentile round trip, per phase, the flow
stops of the slow queue, and the messages lost (must be 0). Wall-clock
figures on a shared machine: compare them within one run (README.md).

    python bench/soak.py [--duration 120] [--connections 1000]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from pathlib import Path

import trio

import qflow
from qflow.testing import start

QUEUES = 4
SLOW_STOP, SLOW_RESUME = 400, 200


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


class Soak:
    def __init__(self, port: int, pid: int, args: argparse.Namespace) -> None:
        self.port = port
        self.pid = pid
        self.args = args
        self.sent: dict[str, int] = {}  # producer -> messages whose send completed (synced)
        self.received: set[bytes] = set()
        self.duplicates = 0
        self.waits: dict[str, list[float]] = {}  # phase -> the probe's round trips
        self.phase = "warm-up"
        self.rss: list[tuple[float, float]] = []
        self.stopping = trio.Event()
        self.t0 = time.monotonic()
        self.bulk = {}

    async def connect(self) -> qflow.client.Connection:
        return await qflow.connect("127.0.0.1", self.port)

    async def producer(self, name: str, queue: str, pause: float, task_status=trio.TASK_STATUS_IGNORED) -> None:
        conn = await self.connect()
        task_status.started()
        async with conn:
            ssn = await conn.session()
            sender = ssn.sender(queue, capacity=200)
            i = 0
            while not self.stopping.is_set():
                batch = [b"%s:%d" % (name.encode(), i + k) for k in range(50)]
                await sender.send_many(batch)
                i += len(batch)
                if pause:
                    await trio.sleep(pause)
                else:
                    await trio.lowlevel.checkpoint()
            await sender.sync()
            self.sent[name] = i

    async def consumer(self, queue: str, pause: float, task_status=trio.TASK_STATUS_IGNORED) -> None:
        conn = await self.connect()
        task_status.started()
        async with conn:
            ssn = await conn.session()
            receiver = await ssn.receiver(queue, capacity=100 if not pause else 5)
            while True:
                try:
                    messages = await receiver.fetch_many(limit=100 if not pause else 1,
                                                         timeout=0.5 if not self.stopping.is_set() else 3)
                except qflow.Empty:
                    if self.stopping.is_set() and self.drained.is_set():
                        break
                    continue
                for m in messages:
                    if m.body in self.received:
                        self.duplicates += 1
                    self.received.add(m.body)
                if pause:
                    await trio.sleep(pause)
            await receiver.close()

    async def idle(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        conn = await self.connect()
        task_status.started()
        async with conn:
            await conn.session()
            await self.stopping.wait()

    async def probe(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        conn = await self.connect()
        task_status.started()
        async with conn:
            ssn = await conn.session()
            while not self.finished.is_set():
                t = time.perf_counter()
                await ssn.query_queue("q0")
                self.waits.setdefault(self.phase, []).append(time.perf_counter() - t)
                await trio.sleep(0.01)

    async def sample_rss(self) -> None:
        while not self.finished.is_set():
            self.rss.append((round(time.monotonic() - self.t0, 1), round(rss_mib(self.pid), 1)))
            await trio.sleep(1)

    async def long_commands(self) -> None:
        """Fill a bulk queue, purge it; fill it again, delete it: each while everything runs."""
        conn = await self.connect()
        async with conn:
            ssn = await conn.session()
            for what in ("purge", "delete"):
                await ssn.declare_queue("bulk")
                sender = ssn.sender("bulk", capacity=5000)
                self.phase = f"fill bulk for {what}"
                for i in range(0, self.args.bulk, 1000):
                    await sender.send_many([b"b%d" % k for k in range(i, i + 1000)])
                await sender.sync()
                self.phase = f"{what} {self.args.bulk} bulk messages"
                t = time.perf_counter()
                result = await (ssn.purge_queue("bulk") if what == "purge" else ssn.delete_queue("bulk"))
                self.bulk[what] = {"messages": result["messages"], "seconds": round(time.perf_counter() - t, 2)}
                self.phase = "steady"
                await trio.sleep(2)

    async def run(self) -> dict:
        self.drained = trio.Event()
        self.finished = trio.Event()
        n = self.args.connections
        producers = 2 * QUEUES
        consumers = 2 * QUEUES
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sample_rss)
            setup = await self.connect()
            ssn = await setup.session()
            for k in range(QUEUES):
                await ssn.declare_queue(f"q{k}", arguments={"qpid.flow_stop_count": 5000,
                                                            "qpid.flow_resume_count": 2500})
            await ssn.declare_queue("slow", arguments={"qpid.flow_stop_count": SLOW_STOP,
                                                       "qpid.flow_resume_count": SLOW_RESUME})
            await nursery.start(self.probe)
            async with trio.open_nursery() as workers:
                for k in range(consumers):
                    await workers.start(self.consumer, f"q{k % QUEUES}", 0)
                await workers.start(self.consumer, "slow", 0.02)
                for k in range(producers):
                    await workers.start(self.producer, f"p{k}", f"q{k % QUEUES}", 0.02)
                await workers.start(self.producer, "slow-producer", "slow", 0)
                self.phase = "connecting idle"
                for _ in range(n - producers - consumers - 4):
                    await workers.start(self.idle)
                self.connected = n
                self.phase = "steady"
                workers.start_soon(self.long_commands)
                await trio.sleep(self.args.duration)
                self.phase = "drain"
                self.stopping.set()
                # The producers sync and stop; then the consumers read until the queues are empty.
                while len(self.sent) < producers + 1:
                    await trio.sleep(0.2)
                while True:
                    depths = [(await ssn.query_queue(q))["msgDepth"] for q in [*(f"q{k}" for k in range(QUEUES)),
                                                                               "slow"]]
                    if not any(depths):
                        break
                    await trio.sleep(0.5)
                self.drained.set()
            slow = await ssn.query_queue("slow")
            await setup.close()
            self.finished.set()
        expected = {b"%s:%d" % (name.encode(), i) for name, count in self.sent.items() for i in range(count)}
        lost = len(expected - self.received)
        def summary(w: list[float]) -> dict:
            w = sorted(w)
            return {"round_trips": len(w), "worst_ms": round(1000 * w[-1], 1),
                    "p99_ms": round(1000 * w[int(0.99 * (len(w) - 1))], 1)} if w else {}
        return {
            "connections": n, "duration_s": self.args.duration,
            "sent": sum(self.sent.values()), "received_unique": len(self.received & expected),
            "lost": lost, "duplicates": self.duplicates,
            "slow_queue_flow_stops": slow["flowStoppedCount"],
            "bulk": self.bulk,
            "probe": {phase: summary(w) for phase, w in self.waits.items()},
            "probe_worst_ms": round(1000 * max(max(w) for w in self.waits.values()), 1),
            "rss_mib": self.rss,
            "rss_peak_mib": max(r for _, r in self.rss),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=90, help="seconds of load before the drain")
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--bulk", type=int, default=300_000, help="messages in the bulk queue purged, then deleted")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.connections)), hard))
    # 1000 clients and the probe: above qflowd's default --max-connections (500, as qpidd's).
    daemon = start("--no-data-dir", "--max-connections", str(args.connections + 100), log="/tmp/qflow-soak-qflowd.log")
    try:
        result = trio.run(Soak(daemon.port, daemon.proc.pid, args).run)
    finally:
        daemon.stop()
    print(f"connections {result['connections']}, {result['duration_s']:g} s of load, "
          f"{result['sent']} messages sent, lost {result['lost']}, duplicates {result['duplicates']}")
    print(f"slow queue: flow stopped {result['slow_queue_flow_stops']} times")
    for what, b in result["bulk"].items():
        print(f"{what} of {b['messages']} bulk messages: {b['seconds']} s")
    print("probe round trips (queue.query), by phase:")
    for phase, s in result["probe"].items():
        if s:
            print(f"  {phase:36} {s['round_trips']:6} trips  worst {s['worst_ms']:8.1f} ms  p99 {s['p99_ms']:7.1f} ms")
    print("qflowd RSS (s, MiB): " + " ".join(f"{t:g}:{r:g}" for t, r in result["rss_mib"][::max(1, len(result['rss_mib']) // 20)]))
    print(f"RSS peak {result['rss_peak_mib']} MiB")
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}))
    return 1 if result["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
