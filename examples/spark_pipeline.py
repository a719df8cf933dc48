"""End-to-end back-pressure through Spark: ``python examples/spark_pipeline.py``.

    producer --> [orders-*] --> Spark Structured Streaming --> [revenue-*] --> results consumer
                  flow                |  parse JSON; per product per        flow
                  controlled          |  one-minute event-time window:     controlled
                                      |  orders, revenue, their message ids

The same pipeline runs twice, with the same paced producer: once with a fast
results consumer and once with a slow one, and the two are printed side by
side. With the slow consumer, ``revenue``'s flow stops; Spark's writer tasks
wait on their sender window, micro-batches slow down, the source commits
(removes) ``orders`` only as batches finish, so ``orders`` fills to its stop
threshold and the producer is held. With the fast one, none of that happens.
Spark runs in a driver process of its own, warmed up before anything is
measured, with no per-trigger cap: the difference is back-pressure.

Then the exactly-once check: the pipeline runs a third time and the Spark
driver process (with its JVM and Python workers) is killed with SIGKILL in
the middle of the run; a new driver restarts the query from its checkpoint.
Every order event's message id must appear in exactly one result.

Starts its own qflowd on free loopback ports (and stops it) unless given
``--broker HOST:PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import trio

import qflow
from qflow import testing as qflowd
from qflow.spark.options import parse_broker

EPOCH_MS = 1_790_000_000_000  # event time of the first order (simulated, so windows close quickly)
WATERMARK = "1 minute"
CLOSE_AFTER_MS = 5 * 60_000  # the closing marker's event time, after the last order
WARM_UP = 20  # messages that warm up the query (its Python workers) before anything is measured
SHUFFLE_PARTITIONS = 2  # the aggregation's partitions: as many writer tasks per micro-batch
PRODUCTS = ["anvil", "bolt", "cog", "dynamo", "escapement", "flywheel", "gear", "hinge", "idler", "jack",
            "kingpin", "lever"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/spark_pipeline.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--broker", help="HOST:PORT of a running qflowd (default: start one on a free loopback port)")
    p.add_argument("--orders", type=int, default=2000, help="orders to publish in each run")
    p.add_argument("--rate", type=float, default=100.0, help="orders per second the producer offers")
    p.add_argument("--products", type=int, default=8, help=f"distinct products (at most {len(PRODUCTS)})")
    p.add_argument("--orders-per-minute", type=int, default=100,
                   help="event-time density: orders per simulated minute (one aggregation window)")
    p.add_argument("--max-per-trigger", type=int, default=0,
                   help="maxMessagesPerTrigger of the Spark source (0: none, the default: no cap)")
    p.add_argument("--orders-flow", default="500:300", metavar="STOP:RESUME",
                   help="qpid.flow_stop_count:qpid.flow_resume_count of the orders queues")
    p.add_argument("--revenue-flow", default="20:10", metavar="STOP:RESUME",
                   help="qpid.flow_stop_count:qpid.flow_resume_count of the revenue queues")
    p.add_argument("--producer-capacity", type=int, default=50, help="the producer's sender window")
    p.add_argument("--writer-capacity", type=int, default=10, help="each Spark writer task's sender window")
    p.add_argument("--slow-rate", type=float, default=4.0, help="results per second the slow consumer takes")
    p.add_argument("--no-crash-check", dest="crash_check", action="store_false",
                   help="skip the third run, which kills the Spark driver and restarts it from its checkpoint")
    p.add_argument("--master", default="local[2]", help="Spark master")
    p.add_argument("--every", type=float, default=5.0, help="seconds between summary lines")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a run after this many seconds")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the Spark driver process
    args = p.parse_args(argv)
    for name in ("orders_flow", "revenue_flow"):
        try:
            stop, resume = (int(x) for x in getattr(args, name).split(":"))
        except ValueError:
            p.error(f"--{name.replace('_', '-')} must be STOP:RESUME, two integers")
        if not 0 < resume <= stop:
            p.error(f"--{name.replace('_', '-')}: need 0 < RESUME <= STOP")
        setattr(args, name, (stop, resume))
    if not 1 <= args.products <= len(PRODUCTS):
        p.error(f"--products must be 1..{len(PRODUCTS)}")
    for name in ("orders", "orders_per_minute", "producer_capacity", "writer_capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_per_trigger < 0:
        p.error("--max-per-trigger must be 0 (none) or more")
    if args.rate <= 0 or args.slow_rate <= 0 or args.every <= 0 or args.timeout <= 0:
        p.error("rates, intervals and timeouts must be positive")
    return args


# -- the broker -------------------------------------------------------------------
def on_broker(broker: str, fn: Any, *args: Any, timeout: float = 30) -> Any:
    host, port = parse_broker(broker)

    async def main() -> Any:
        with trio.fail_after(timeout):
            async with qflow.open_connection(host, port, name="pipeline") as conn:
                return await fn(await conn.session(), *args)

    return trio.run(main)


async def _stats(ssn: qflow.Session, *queues: str) -> list[dict[str, Any]]:
    return [await ssn.query_queue(q) for q in queues]


def window_of(ts_ms: int) -> str:
    """The window's start as the query's results name it (UTC, to the minute)."""
    return datetime.fromtimestamp(ts_ms // 60_000 * 60, UTC).strftime("%Y-%m-%dT%H:%M")


# -- producer and consumer: each a trio program in its own thread ----------------------
@dataclass
class Producer:
    broker: str
    queue: str
    n: int
    rate: float
    products: list[str]
    per_minute: int
    capacity: int
    sent: int = 0
    held: float = 0.0  # seconds spent in send() waiting for completions: flow control
    longest_hold: float = 0.0
    expected: dict[str, set[str]] = field(default_factory=dict)  # result id -> the order ids it must count
    done: bool = False
    error: BaseException | None = None

    def run(self) -> None:
        try:
            on_broker(self.broker, self._produce, timeout=86400)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True

    async def _produce(self, ssn: qflow.Session) -> None:
        rng = random.Random(6)
        prices = {p: 199 + 150 * i for i, p in enumerate(self.products)}
        sender = ssn.sender(self.queue, capacity=self.capacity)
        started = trio.current_time()
        for order_id in range(1, self.n + 1):
            # Paced: the producer offers ``rate`` orders a second, and is behind
            # only when send() holds it.
            due = started + (order_id - 1) / self.rate
            if due > trio.current_time():
                await trio.sleep_until(due)
            product = rng.choice(self.products)
            ts_ms = EPOCH_MS + order_id * 60_000 // self.per_minute
            body = json.dumps({"order_id": order_id, "product": product, "quantity": rng.randint(1, 5),
                               "price_cents": prices[product], "ts_ms": ts_ms})
            before = trio.current_time()
            await sender.send(body, message_id=f"order-{order_id}", content_type="application/json")
            spent = trio.current_time() - before
            if spent > 0.005:
                self.held += spent
                self.longest_hold = max(self.longest_hold, spent)
            self.sent = order_id
            self.expected.setdefault(f"{window_of(ts_ms)}/{product}", set()).add(f"order-{order_id}")
        # No order follows: a marker whose event time moves the watermark past
        # the last window, so Spark closes (and sends) it.
        close_ts_ms = EPOCH_MS + self.n * 60_000 // self.per_minute + CLOSE_AFTER_MS
        await sender.send(json.dumps({"ts_ms": close_ts_ms}), message_id="end-of-orders")
        await sender.sync()


@dataclass
class Consumer:
    broker: str
    queue: str
    rate: float | None  # None: as fast as it can
    stop: threading.Event = field(default_factory=threading.Event)
    messages: list[tuple[str, dict]] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            on_broker(self.broker, self._consume, timeout=86400)
        except BaseException as exc:
            self.error = exc

    async def _consume(self, ssn: qflow.Session) -> None:
        # The slow one: a small credit window and a fixed rate.
        if self.rate is None:
            receiver = await ssn.receiver(self.queue, capacity=100)
        else:
            receiver = await ssn.receiver(self.queue, capacity=2, rate=self.rate)
        while True:
            try:
                m = await receiver.fetch(timeout=0.5)
            except qflow.Empty:
                if self.stop.is_set():
                    break
                continue
            self.messages.append((m.message_id, json.loads(m.body)))
        await receiver.close()


# -- the Spark driver: a process of its own, so that the crash check can kill it -------------
def spark_session(master: str) -> Any:
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName("qflow-pipeline")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from qflow.spark import register

    register(spark)
    return spark


def start_query(spark: Any, cmd: dict) -> Any:
    from pyspark.sql import functions as F

    reader = spark.readStream.format("qflow").option("broker", cmd["broker"]).option("queue", cmd["source"])
    if cmd["max_per_trigger"]:
        reader = reader.option("maxMessagesPerTrigger", str(cmd["max_per_trigger"]))
    orders = reader.load()
    schema = "order_id long, product string, quantity int, price_cents long, ts_ms long"
    parsed = (orders.select(F.from_json(F.col("body").cast("string"), schema).alias("o"), "message_id")
              .select("o.*", "message_id").withColumn("ts", F.timestamp_millis("ts_ms")))
    # Append mode (the one Spark allows for a Python data source sink): a
    # window's totals are sent once, when the watermark passes its end. The
    # closing marker and the warm-up messages have no product: their groups
    # are dropped after the aggregation, by an aggregate (Spark would push a
    # filter on the product, a grouping key, below the watermark, and the
    # marker would no longer move it).
    revenue = (parsed.withWatermark("ts", WATERMARK)
               .groupBy(F.window("ts", "1 minute").alias("window"), "product")
               .agg(F.count("*").alias("orders"),
                    F.sum(F.col("quantity") * F.col("price_cents")).alias("revenue_cents"),
                    F.collect_list("message_id").alias("ids"), F.count("product").alias("with_product"))
               .where(F.col("with_product") > 0))
    # The id names the result (window, product), so a replayed batch repeats it
    # whatever order its shuffle delivers the rows in.
    window_start = F.date_format("window.start", "yyyy-MM-dd'T'HH:mm")
    out = revenue.select(
        F.to_json(F.struct(window_start.alias("window"), "product", "orders", "revenue_cents", "ids")).alias("body"),
        F.concat_ws("/", window_start, "product").alias("message_id"),
    )
    return (out.writeStream.outputMode("append").option("checkpointLocation", cmd["checkpoint"])
            .queryName(cmd["source"]).format("qflow")
            .options(broker=cmd["broker"], queue=cmd["sink"], capacity=str(cmd["writer_capacity"])).start())


def driver_main(args: argparse.Namespace) -> int:
    """Commands as JSON lines on stdin (start, stop); events as JSON lines on stdout."""
    def emit(**event: Any) -> None:
        print(json.dumps(event), flush=True)

    spark = spark_session(args.master)
    spark.range(1000).selectExpr("sum(id)").collect()  # the JVM warms up before anything is measured
    emit(event="ready", spark=spark.version)
    query = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "start":
            query = start_query(spark, cmd)
            emit(event="started")
        elif cmd["cmd"] == "status" and query is not None:
            error = query.exception() if not query.isActive else None
            emit(event="status", active=query.isActive, error=None if error is None else str(error)[:2000],
                 batches=len([p for p in query.recentProgress if p["numInputRows"]]))
        elif cmd["cmd"] == "stop" and query is not None:
            rows = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
            query.stop()
            emit(event="stopped", batches=len(rows), max_rows=max(rows, default=0))
    spark.stop()
    return 0


class Driver:
    """The Spark driver process, from this side: commands in, events out."""

    def __init__(self, args: argparse.Namespace) -> None:
        # A session of its own: the crash check kills the driver, its JVM and
        # its Python workers at once, as a machine failure would.
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--driver", "--master", args.master],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="driver-events").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the Spark driver sent no {event!r} within {timeout:g} s") from None
            if got["event"] == event:
                return got
            if got["event"] == "exited":
                raise RuntimeError(f"the Spark driver exited (status {self.proc.wait()}) before {event!r}")

    def check(self, timeout: float) -> dict:
        self.send(cmd="status")
        status = self.wait("status", timeout)
        if not status["active"]:
            raise RuntimeError(f"the Spark query stopped: {status['error']}")
        return status

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()


# -- one run ---------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    held: float = 0.0
    longest_hold: float = 0.0
    orders_peak: int = 0
    revenue_peak: int = 0
    orders_bound: int = 0
    revenue_bound: int = 0
    orders_stops: int = 0
    revenue_stops: int = 0
    seconds: float = 0.0
    results: int = 0
    duplicates: int = 0
    batches: int = 0
    killed_at: int | None = None  # orders sent when the driver was killed
    exactly_once: bool = False
    problem: str = ""


def run_once(args: argparse.Namespace, broker: str, driver: Driver, name: str, slow: bool,
             crash: bool = False) -> tuple[Run, Driver]:
    source, sink = f"orders-{name}", f"revenue-{name}"

    async def setup(ssn: qflow.Session) -> None:
        for q, (stop, resume) in ((source, args.orders_flow), (sink, args.revenue_flow)):
            await ssn.declare_queue(q, arguments={"qpid.flow_stop_count": stop, "qpid.flow_resume_count": resume})
            await ssn.purge_queue(q)

    on_broker(broker, setup)
    checkpoint = tempfile.mkdtemp(prefix=f"qflow-pipeline-{name}-")
    start = {"cmd": "start", "broker": broker, "source": source, "sink": sink, "checkpoint": checkpoint,
             "max_per_trigger": args.max_per_trigger, "writer_capacity": args.writer_capacity}
    run = Run(name, orders_bound=args.orders_flow[0] + args.producer_capacity,
              revenue_bound=args.revenue_flow[0] + SHUFFLE_PARTITIONS * args.writer_capacity)
    deadline = time.monotonic() + args.timeout
    try:
        driver.send(**start)
        driver.wait("started", args.timeout)

        # Warm-up: the query reads, writes and commits a few messages (its
        # Python workers start) before the producer starts and anything is measured.
        async def warm_up(ssn: qflow.Session) -> None:
            sender = ssn.sender(source, capacity=WARM_UP)
            for i in range(WARM_UP):
                await sender.send(json.dumps({"ts_ms": EPOCH_MS - 3_600_000}), message_id=f"warm-up-{i}")
            await sender.sync()

        on_broker(broker, warm_up)
        while on_broker(broker, _stats, source)[0]["msgDepth"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up messages were not read")
            time.sleep(0.2)
        before = {st["name"]: st["flowStoppedCount"] for st in on_broker(broker, _stats, source, sink)}

        producer = Producer(broker, source, args.orders, args.rate, PRODUCTS[:args.products],
                            args.orders_per_minute, args.producer_capacity)
        consumer = Consumer(broker, sink, args.slow_rate if slow else None)
        threads = [threading.Thread(target=t.run, daemon=True, name=f"{name}-{type(t).__name__}")
                   for t in (producer, consumer)]
        started = time.monotonic()
        for t in threads:
            t.start()
        next_line = started + args.every
        next_check = started + 2
        try:
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gave up after {args.timeout:g} s (--timeout)")
                if producer.error is not None or consumer.error is not None:
                    raise RuntimeError(f"producer/consumer failed: {producer.error or consumer.error!r}")
                orders, revenue = on_broker(broker, _stats, source, sink)
                run.orders_peak = max(run.orders_peak, orders["msgDepth"])
                run.revenue_peak = max(run.revenue_peak, revenue["msgDepth"])
                got = {mid for mid, _ in consumer.messages}
                if crash and run.killed_at is None and producer.sent >= args.orders // 2:
                    run.killed_at = producer.sent
                    print(f"  {name}: {producer.sent} orders sent, {len(got)} results in: killing the Spark driver "
                          f"(SIGKILL to its process group)", flush=True)
                    driver.kill()
                    driver = Driver(args)
                    driver.wait("ready", args.timeout)
                    driver.send(**start)
                    driver.wait("started", args.timeout)
                    print(f"  {name}: a new driver restarted the query from its checkpoint", flush=True)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 2
                    run.batches = driver.check(args.timeout)["batches"]
                if now >= next_line:
                    next_line = now + args.every
                    print(f"  {name:>5} {now - started:6.1f}s  orders depth {orders['msgDepth']:>4}"
                          f"{' STOPPED' if orders['flowStopped'] else ''}  revenue depth {revenue['msgDepth']:>3}"
                          f"{' STOPPED' if revenue['flowStopped'] else ''}  produced {producer.sent:>5}/{args.orders}"
                          f" (held {producer.held:5.1f} s)  results {len(consumer.messages):>4}", flush=True)
                if producer.done and not orders["msgDepth"] and set(producer.expected) <= got:
                    break  # every window closed and was consumed, and everything read was committed
                time.sleep(0.2)
            run.seconds = time.monotonic() - started
        finally:
            consumer.stop.set()
            threads[1].join(timeout=30)
        driver.send(cmd="stop")
        stopped = driver.wait("stopped", args.timeout)
        run.batches = stopped["batches"] if run.killed_at is None else run.batches
        after = {st["name"]: st["flowStoppedCount"] for st in on_broker(broker, _stats, source, sink)}
        run.orders_stops = after[source] - before[source]
        run.revenue_stops = after[sink] - before[sink]
        run.held, run.longest_hold = producer.held, producer.longest_hold
        check(run, producer, consumer)
        return run, driver
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)


def check(run: Run, producer: Producer, consumer: Consumer) -> None:
    """Exactly once, by message id: after dropping duplicate results by their
    id, every order's message id is counted in exactly one result, its own."""
    unique: dict[str, dict] = {}
    for message_id, body in consumer.messages:
        if unique.setdefault(message_id, body) != body:
            run.problem = f"result {message_id} came twice with different contents"
    run.results, run.duplicates = len(unique), len(consumer.messages) - len(unique)
    counted: dict[str, str] = {}
    for message_id, body in unique.items():
        if len(body["ids"]) != body["orders"]:
            run.problem = f"result {message_id} counts {body['orders']} orders but names {len(body['ids'])}"
        for order in body["ids"]:
            if order in counted:
                run.problem = f"{order} counted twice: in {counted[order]} and {message_id}"
            counted[order] = message_id
    expected = {order: rid for rid, orders in producer.expected.items() for order in orders}
    if not run.problem and counted != expected:
        missing = sorted(set(expected) - set(counted))[:5]
        extra = sorted(set(counted) - set(expected))[:5]
        wrong = sorted(o for o in set(expected) & set(counted) if expected[o] != counted[o])[:5]
        run.problem = f"orders not counted: {missing}, unknown: {extra}, in the wrong result: {wrong}"
    run.exactly_once = not run.problem and len(counted) == producer.sent == len(expected)


def report(runs: list[Run]) -> None:
    fast, slow = runs[0], runs[1]
    rows = [
        ("producer held in send (s)", f"{fast.held:.1f}", f"{slow.held:.1f}"),
        ("longest single hold (s)", f"{fast.longest_hold:.1f}", f"{slow.longest_hold:.1f}"),
        ("orders: peak depth (bound)", f"{fast.orders_peak} ({fast.orders_bound})",
         f"{slow.orders_peak} ({slow.orders_bound})"),
        ("revenue: peak depth (bound)", f"{fast.revenue_peak} ({fast.revenue_bound})",
         f"{slow.revenue_peak} ({slow.revenue_bound})"),
        ("orders: flow stops", str(fast.orders_stops), str(slow.orders_stops)),
        ("revenue: flow stops", str(fast.revenue_stops), str(slow.revenue_stops)),
        ("run time (s)", f"{fast.seconds:.1f}", f"{slow.seconds:.1f}"),
        ("micro-batches with data", str(fast.batches), str(slow.batches)),
        ("results (duplicates dropped)", f"{fast.results} ({fast.duplicates})", f"{slow.results} ({slow.duplicates})"),
        ("exactly once by message id", "OK" if fast.exactly_once else "MISMATCH",
         "OK" if slow.exactly_once else "MISMATCH"),
    ]
    print()
    print(f"{'':32}{'fast consumer':>16}{'slow consumer':>16}")
    for label, a, b in rows:
        print(f"{label:32}{a:>16}{b:>16}")
    for run in runs:
        if run.problem:
            print(f"{run.name}: {run.problem}")
    if len(runs) > 2:
        crash = runs[2]
        print(f"exactly-once check: the Spark driver was killed (SIGKILL) after {crash.killed_at} orders and the "
              f"query restarted from its checkpoint: {crash.results} results, {crash.duplicates} duplicates dropped "
              f"by message id; every order event counted exactly once: {'OK' if crash.exactly_once else 'MISMATCH'}")
    print(json.dumps({"runs": [run.__dict__ for run in runs]}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Spark's Python workers must run this interpreter (with qflow installed),
    # and everything here stays on the loopback interface.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if args.driver:
        return driver_main(args)
    daemon = None
    driver = None
    try:
        if args.broker:
            parse_broker(args.broker)
            broker = args.broker
        else:
            daemon = qflowd.start("--log-level", "warning")
            broker = daemon.address
        print(f"broker {broker}: orders flow stop/resume {args.orders_flow[0]}/{args.orders_flow[1]}, revenue "
              f"{args.revenue_flow[0]}/{args.revenue_flow[1]}; {args.orders} orders at {args.rate:g}/s; slow "
              f"consumer {args.slow_rate:g} results/s", flush=True)
        print("starting the Spark driver ...", flush=True)
        driver = Driver(args)
        ready = driver.wait("ready", args.timeout)
        print(f"Spark {ready['spark']} ready", flush=True)
        runs = []
        for name, slow in (("fast", False), ("slow", True)):
            run, driver = run_once(args, broker, driver, name, slow)
            runs.append(run)
        if args.crash_check:
            run, driver = run_once(args, broker, driver, "crash", False, crash=True)
            runs.append(run)
        report(runs)
        return 0 if all(run.exactly_once for run in runs) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        if driver is not None:
            driver.close()
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
