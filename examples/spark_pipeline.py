"""End-to-end back-pressure through Spark: ``python examples/spark_pipeline.py``.

    producer --> [orders] --> Spark Structured Streaming --> [revenue] --> slow consumer
                  flow                 |  parse JSON, revenue per product       flow
                  controlled           |  per one-minute event-time window      controlled
                                       +--> (--parquet DIR: each batch as Parquet too)

The consumer drains ``revenue`` slowly, so ``revenue``'s flow stops; Spark's
writer tasks then wait on their sender window, micro-batches slow down, the
source commits (removes) ``orders`` only as batches finish, so ``orders``
fills until its flow stops and the producer waits in turn. Nothing is dropped:
the run ends with a check that every order is counted exactly once, after
dropping duplicate messages by message id.

Starts its own qflowd on free loopback ports (and stops it) unless given
``--broker HOST:PORT``. Prints a live summary every ``--every`` seconds:
depths, flow state, held transfers, and rows per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import trio

import qflow
from qflow import testing as qflowd
from qflow.spark.datasource import parse_broker

EPOCH_MS = 1_790_000_000_000  # event time of the first order (simulated, so windows close quickly)
WATERMARK = "1 minute"
CLOSE_AFTER_MS = 5 * 60_000  # the closing marker's event time, after the last order
PRODUCTS = ["anvil", "bolt", "cog", "dynamo", "escapement", "flywheel", "gear", "hinge", "idler", "jack",
            "kingpin", "lever"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/spark_pipeline.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--broker", help="HOST:PORT of a running qflowd (default: start one on a free loopback port)")
    p.add_argument("--orders", type=int, default=3000, help="orders to publish")
    p.add_argument("--products", type=int, default=8, help=f"distinct products (at most {len(PRODUCTS)})")
    p.add_argument("--orders-per-minute", type=int, default=100,
                   help="event-time density: orders per simulated minute (one aggregation window)")
    p.add_argument("--max-per-trigger", type=int, default=300, help="maxMessagesPerTrigger of the Spark source")
    p.add_argument("--trigger", type=float, default=1.0, help="micro-batch trigger interval, seconds")
    p.add_argument("--orders-flow", default="600:400", metavar="STOP:RESUME",
                   help="qpid.flow_stop_count:qpid.flow_resume_count of queue orders")
    p.add_argument("--revenue-flow", default="20:10", metavar="STOP:RESUME",
                   help="qpid.flow_stop_count:qpid.flow_resume_count of queue revenue")
    p.add_argument("--producer-capacity", type=int, default=50, help="the producer's sender window")
    p.add_argument("--writer-capacity", type=int, default=10, help="each Spark writer task's sender window")
    p.add_argument("--consumer-rate", type=float, default=8.0, help="messages per second the slow consumer takes")
    p.add_argument("--parquet", metavar="DIR", help="also write each micro-batch's results as Parquet under DIR")
    p.add_argument("--checkpoint", metavar="DIR", help="Spark checkpoint directory (default: a temporary one)")
    p.add_argument("--master", default="local[2]", help="Spark master")
    p.add_argument("--every", type=float, default=2.0, help="seconds between summary lines")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    p.add_argument("--purge", action="store_true", help="empty queues orders and revenue first (--broker)")
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
    for name in ("orders", "orders_per_minute", "max_per_trigger", "producer_capacity", "writer_capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.consumer_rate <= 0 or args.trigger <= 0 or args.every <= 0 or args.timeout <= 0:
        p.error("rates, intervals and timeouts must be positive")
    return args


# -- the broker -------------------------------------------------------------------
def on_broker(broker: str, fn: Any, *args: Any, timeout: float = 30) -> Any:
    host, port = parse_broker(broker)

    async def main() -> Any:
        with trio.fail_after(timeout):
            conn = await qflow.connect(host, port, name="pipeline")
        try:
            with trio.fail_after(timeout):
                return await fn(await conn.session(), *args)
        finally:
            await conn.close()

    return trio.run(main)


async def _stats(ssn: qflow.Session, *queues: str) -> list[dict[str, Any]]:
    return [await ssn.query_queue(q) for q in queues]


# -- producer and consumer: each a trio program in its own thread ----------------------
@dataclass
class Producer:
    broker: str
    n: int
    products: list[str]
    per_minute: int
    capacity: int
    sent: int = 0
    revenue_cents: int = 0
    id_sum: int = 0
    waited: float = 0.0  # seconds spent in send() waiting for completions (flow control)
    longest_wait: float = 0.0
    close_ts_ms: int = 0
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
        sender = ssn.sender("orders", capacity=self.capacity)
        for order_id in range(1, self.n + 1):
            product = rng.choice(self.products)
            quantity = rng.randint(1, 5)
            body = json.dumps({"order_id": order_id, "product": product, "quantity": quantity,
                               "price_cents": prices[product],
                               "ts_ms": EPOCH_MS + order_id * 60_000 // self.per_minute})
            before = time.monotonic()
            await sender.send(body, message_id=f"order-{order_id}", content_type="application/json")
            spent = time.monotonic() - before
            if spent > 0.005:
                self.waited += spent
                self.longest_wait = max(self.longest_wait, spent)
            self.sent = order_id
            self.revenue_cents += quantity * prices[product]
            self.id_sum += order_id
        # No order follows: a marker whose event time moves the watermark past
        # the last window, so Spark closes (and sends) it.
        self.close_ts_ms = EPOCH_MS + self.n * 60_000 // self.per_minute + CLOSE_AFTER_MS
        await sender.send(json.dumps({"ts_ms": self.close_ts_ms}), message_id="end-of-orders")
        await sender.sync()


@dataclass
class Consumer:
    broker: str
    rate: float
    stop: threading.Event = field(default_factory=threading.Event)
    messages: list[tuple[str, dict]] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            on_broker(self.broker, self._consume, timeout=86400)
        except BaseException as exc:
            self.error = exc

    async def _consume(self, ssn: qflow.Session) -> None:
        # A small credit window and a fixed rate: the deliberately slow consumer.
        receiver = await ssn.receiver("revenue", capacity=2, rate=self.rate)
        while True:
            try:
                m = await receiver.fetch(timeout=0.5)
            except qflow.Empty:
                if self.stop.is_set():
                    break
                continue
            self.messages.append((m.message_id, json.loads(m.body)))
        await receiver.close()


# -- the Spark job ----------------------------------------------------------------------
def spark_session(master: str) -> Any:
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName("qflow-pipeline")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from qflow.spark import register

    register(spark)
    return spark


def start_query(spark: Any, args: argparse.Namespace, broker: str, checkpoint: str) -> Any:
    from pyspark.sql import functions as F

    orders = (spark.readStream.format("qflow").option("broker", broker).option("queue", "orders")
              .option("maxMessagesPerTrigger", str(args.max_per_trigger)).load())
    schema = "order_id long, product string, quantity int, price_cents long, ts_ms long"
    parsed = (orders.select(F.from_json(F.col("body").cast("string"), schema).alias("o")).select("o.*")
              .withColumn("ts", F.timestamp_millis("ts_ms")))
    # Append mode (the one Spark allows for a Python data source sink): a
    # window's totals are sent once, when the watermark passes its end. The
    # producer's closing marker carries event time past the last window; its
    # own group (no product) never closes, so it is never sent.
    revenue = (parsed.withWatermark("ts", WATERMARK)
               .groupBy(F.window("ts", "1 minute").alias("window"), "product")
               .agg(F.count("*").alias("orders"), F.sum(F.col("quantity") * F.col("price_cents")).alias("revenue_cents"),
                    F.sum("order_id").alias("order_id_sum")))
    # The id names the result (window, product), so a retried or replayed
    # batch repeats it whatever order its shuffle delivers the rows in.
    window_start = F.date_format("window.start", "yyyy-MM-dd'T'HH:mm")
    out = revenue.select(
        F.to_json(F.struct(window_start.alias("window"), "product", "orders", "revenue_cents",
                           "order_id_sum")).alias("body"),
        F.concat_ws("/", window_start, "product").alias("message_id"),
    )
    writer = out.writeStream.outputMode("append").option("checkpointLocation", checkpoint) \
        .trigger(processingTime=f"{args.trigger} seconds").queryName("revenue")
    qflow_options = {"broker": broker, "queue": "revenue", "capacity": str(args.writer_capacity)}
    if not args.parquet:
        return writer.format("qflow").options(**qflow_options).start()

    parquet_dir = args.parquet

    def each_batch(batch: Any, batch_id: int) -> None:
        # Both writes are idempotent per batch id: a replay overwrites its
        # Parquet directory and repeats its message ids.
        batch.persist()
        batch.write.mode("overwrite").parquet(os.path.join(parquet_dir, f"batch={batch_id}"))
        batch.write.format("qflow").options(**qflow_options).mode("append").save()
        batch.unpersist()

    return writer.foreachBatch(each_batch).start()


def _offset(progress: dict) -> int | None:
    try:
        end = progress["sources"][0]["endOffset"]
        if isinstance(end, str):
            end = json.loads(end)
        return int(end["sequence"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _watermark_ms(progress: dict | None) -> int:
    """The event-time watermark a batch ran with, in epoch milliseconds."""
    try:
        text = progress["eventTime"]["watermark"]
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
    except (KeyError, TypeError, ValueError):
        return 0


def _flow(st: dict) -> str:
    state = "STOPPED" if st["flowStopped"] else "flowing"
    held = f", {st['heldTransfers']} held" if st.get("heldTransfers") else ""
    return f"depth {st['msgDepth']:>4} ({state}{held})"


# -- the run -----------------------------------------------------------------------------
def run(args: argparse.Namespace, broker: str) -> bool:
    async def setup(ssn: qflow.Session) -> None:
        for name, (stop, resume) in (("orders", args.orders_flow), ("revenue", args.revenue_flow)):
            await ssn.declare_queue(name, arguments={"qpid.flow_stop_count": stop, "qpid.flow_resume_count": resume})
            st = await ssn.query_queue(name)
            if st["msgDepth"] and not args.purge:
                raise SystemExit(f"queue {name} holds {st['msgDepth']} messages: pass --purge to empty it first")
            if args.purge:
                await ssn.purge_queue(name)
            if (st["flowStopCount"], st["flowResumeCount"]) != (stop, resume):
                await ssn.modify_queue(name, {"qpid.flow_stop_count": stop, "qpid.flow_resume_count": resume})

    on_broker(broker, setup)
    print(f"broker {broker}: orders flow stop/resume {args.orders_flow[0]}/{args.orders_flow[1]}, "
          f"revenue {args.revenue_flow[0]}/{args.revenue_flow[1]}; consumer {args.consumer_rate:g} msg/s")

    started = time.monotonic()
    deadline = started + args.timeout
    print("starting Spark ...", flush=True)
    spark = spark_session(args.master)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="qflow-pipeline-")
    producer = Producer(broker, args.orders, PRODUCTS[:args.products], args.orders_per_minute, args.producer_capacity)
    consumer = Consumer(broker, args.consumer_rate)
    threads = [threading.Thread(target=producer.run, daemon=True, name="producer"),
               threading.Thread(target=consumer.run, daemon=True, name="consumer")]
    query = None
    peaks = {"orders": 0, "revenue": 0}
    batches: dict[int, dict] = {}
    try:
        query = start_query(spark, args, broker, checkpoint)
        print(f"Spark {spark.version} query started in {time.monotonic() - started:.1f} s; publishing "
              f"{args.orders} orders", flush=True)
        for t in threads:
            t.start()
        next_line = time.monotonic()
        last_end = None
        while time.monotonic() < deadline:
            if query.exception() is not None:
                raise RuntimeError(f"the Spark query failed: {query.exception()}")
            if producer.error is not None or consumer.error is not None:
                raise RuntimeError(f"producer/consumer failed: {producer.error or consumer.error!r}")
            for p in query.recentProgress:
                if p["batchId"] not in batches and p["numInputRows"]:
                    batches[p["batchId"]] = p
                    durations = p.get("durationMs", {})
                    print(f"  batch {p['batchId']:>3}: {p['numInputRows']:>4} messages in, through sequence "
                          f"{_offset(p)}, write {durations.get('addBatch', 0) / 1000:5.1f} s, "
                          f"total {durations.get('triggerExecution', 0) / 1000:5.1f} s", flush=True)
            if query.lastProgress is not None:
                last_end = _offset(query.lastProgress) or last_end
            orders, revenue = on_broker(broker, _stats, "orders", "revenue")
            peaks["orders"] = max(peaks["orders"], orders["msgDepth"])
            peaks["revenue"] = max(peaks["revenue"], revenue["msgDepth"])
            if time.monotonic() >= next_line:
                next_line += args.every
                print(f"{time.monotonic() - started:6.1f}s  orders {_flow(orders)}  revenue {_flow(revenue)}  "
                      f"produced {producer.sent:>5}/{args.orders} (waited {producer.waited:5.1f} s)  "
                      f"consumed {len(consumer.messages):>4}", flush=True)
            caught_up = producer.done and last_end is not None and last_end >= orders["lastSequence"]
            if caught_up and not query.status["isTriggerActive"] and \
                    _watermark_ms(query.lastProgress) >= producer.close_ts_ms - 60_000:
                break  # everything read, and the last windows closed and sent
            time.sleep(0.5)
        else:
            raise RuntimeError(f"gave up after {args.timeout:g} s (--timeout)")
        # Spark tells a source to commit a batch when it plans the next one; the
        # source plans an empty batch after the last one, so the query commits
        # (removes) everything it read by itself.
        while time.monotonic() < deadline and on_broker(broker, _stats, "orders")[0]["msgDepth"]:
            time.sleep(0.5)
        query.stop()
        consumer.stop.set()
        while time.monotonic() < deadline:
            revenue = on_broker(broker, _stats, "revenue")[0]
            if revenue["msgDepth"] == 0:
                break
            time.sleep(0.5)
        threads[1].join(timeout=max(1.0, deadline - time.monotonic()))
        if consumer.error is not None:
            raise RuntimeError(f"consumer failed: {consumer.error!r}")
        orders, revenue = on_broker(broker, _stats, "orders", "revenue")
        return report(args, producer, consumer, batches, peaks, orders, revenue, time.monotonic() - started)
    finally:
        consumer.stop.set()
        if query is not None and query.isActive:
            query.stop()
        spark.stop()
        if not args.checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)


def report(args: argparse.Namespace, producer: Producer, consumer: Consumer, batches: dict[int, dict],
           peaks: dict[str, int], orders: dict, revenue: dict, elapsed: float) -> bool:
    unique: dict[str, dict] = {}
    for message_id, body in consumer.messages:
        unique.setdefault(message_id, body)
    duplicates = len(consumer.messages) - len(unique)
    final: dict[tuple[str, str], dict] = {}  # (window, product) -> its totals, sent once per window
    for body in unique.values():
        key = (body["window"], body["product"])
        if key in final:
            print(f"window {key} sent twice with different ids: {final[key]} and {body}")
        final[key] = body
    counted = sum(b["orders"] for b in final.values())
    revenue_cents = sum(b["revenue_cents"] for b in final.values())
    id_sum = sum(b["order_id_sum"] for b in final.values())
    rows = [b["numInputRows"] for b in batches.values()]
    print()
    print(f"done in {elapsed:.1f} s")
    print(f"Spark: {len(rows)} micro-batches with data; messages per batch min {min(rows, default=0)}, "
          f"mean {sum(rows) / max(1, len(rows)):.0f}, max {max(rows, default=0)}; longest write "
          f"{max((b.get('durationMs', {}).get('addBatch', 0) for b in batches.values()), default=0) / 1000:.1f} s")
    print(f"back-pressure: orders peak depth {peaks['orders']} (flow stopped {orders['flowStoppedCount']} times), "
          f"producer waited {producer.waited:.1f} s in send (longest {producer.longest_wait:.1f} s); "
          f"revenue peak depth {peaks['revenue']} (flow stopped {revenue['flowStoppedCount']} times)")
    print(f"left on the broker: orders {orders['msgDepth']}, revenue {revenue['msgDepth']}")
    print(f"revenue messages consumed {len(consumer.messages)}, duplicates dropped by message id {duplicates}, "
          f"windows x products {len(final)}")
    ok = (counted == producer.sent == args.orders and revenue_cents == producer.revenue_cents
          and id_sum == producer.id_sum and orders["msgDepth"] == 0)
    print(f"exactly-once check: {counted} of {producer.sent} orders counted, revenue {revenue_cents / 100:.2f} of "
          f"{producer.revenue_cents / 100:.2f}, order-id sum {id_sum} of {producer.id_sum}: "
          f"{'OK, every order accounted for exactly once' if ok else 'MISMATCH'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Spark's Python workers must run this interpreter (with qflow installed),
    # and everything here stays on the loopback interface.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    daemon = None
    try:
        if args.broker:
            parse_broker(args.broker)
            broker = args.broker
        else:
            daemon = qflowd.start("--log-level", "warning")
            broker = daemon.address
        return 0 if run(args, broker) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
