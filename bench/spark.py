"""The Spark data source's throughput: ``make bench-spark`` (``--quick``: seconds).

One qflowd (its own temporary data directory, loopback, free ports) and one
local[2] SparkSession. Each workload moves N messages of 64 bytes:

* ``broker_alone``: one client sends them with send_many and another fetches
  them with fetch_many (the ceiling the connector works under);
* ``broker_alone_distinct_ids``: the same, each message with its own
  message id, as the Spark writer sends them (send_many's message_ids);
* ``spark_alone_read``: Spark's own ceiling, no broker: a data source that
  hands Spark the same Arrow batches (pre-built) that a qflow read task
  makes, read and summed as ``batch_read`` does;
* ``batch_write``: ``df.write.format("qflow")`` of N rows;
* ``batch_read``: ``spark.read.format("qflow")`` of N messages, every body
  summed so that nothing is pruned;
* ``streaming``: qflow -> Spark -> qflow, a streaming copy of N queued
  messages to another queue (Trigger.AvailableNow), until every message is
  on the output queue and the input queue is empty: N over the time from
  ``start()`` to the query's end, its start-up included;
  ``streaming_sustained``: N over the micro-batches' own time (the sum of
  their ``triggerExecution``, Spark's progress reports), once the query runs.
  ``streaming_batches`` gives each micro-batch's rows and phases (ms).

Figures drift on shared machines: compare the ratios to ``broker_alone`` of
one run. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import qflow  # noqa: E402
from qflow import testing as qflowd  # noqa: E402

BODY = b"x" * 64
GOALS = {"streaming": 100_000, "batch_read": 200_000, "batch_write": 200_000}  # msg/s on two cores


def on_broker(port: int, fn, *args):
    async def main():
        async with qflow.open_connection("127.0.0.1", port) as conn:
            return await fn(await conn.session(), *args)

    return trio.run(main)


async def _declare(ssn: qflow.Session, *names: str) -> None:
    for name in names:
        await ssn.declare_queue(name)


async def _depth(ssn: qflow.Session, name: str) -> int:
    return (await ssn.query_queue(name))["msgDepth"]


async def _fill(ssn: qflow.Session, name: str, n: int) -> None:
    sender = ssn.sender(name, capacity=2000)
    left = n
    while left:
        k = min(left, 10_000)
        await sender.send_many([BODY] * k)
        left -= k
    await sender.sync()


async def _drain(ssn: qflow.Session, name: str, n: int) -> None:
    receiver = await ssn.receiver(name, capacity=5000, accept="none")
    got = 0
    while got < n:
        got += len(await receiver.fetch_many(timeout=60))


def broker_alone(port: int, n: int) -> float:
    on_broker(port, _declare, "alone")
    t0 = time.perf_counter()

    async def both(ssn: qflow.Session) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_fill, ssn, "alone", n)
            nursery.start_soon(_drain, ssn, "alone", n)

    on_broker(port, both)
    return n / (time.perf_counter() - t0)


def broker_alone_distinct_ids(port: int, n: int) -> float:
    """As broker_alone, but each message with its own message id, as the Spark
    writer sends them (deterministic ids for dedupe): the transfers differ
    only in their ids, which the broker still takes as runs."""
    on_broker(port, _declare, "alone-ids")

    async def fill(ssn: qflow.Session) -> None:
        sender = ssn.sender("alone-ids", capacity=2000)
        for k in range(0, n, 10_000):
            m = min(10_000, n - k)
            await sender.send_many([BODY] * m, message_ids=[f"w-0-{i}" for i in range(k, k + m)])
        await sender.sync()

    t0 = time.perf_counter()

    async def both(ssn: qflow.Session) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill, ssn)
            nursery.start_soon(_drain, ssn, "alone-ids", n)

    on_broker(port, both)
    return n / (time.perf_counter() - t0)


def spark_session():
    from pyspark.sql import SparkSession

    from qflow.spark import register

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    spark = (SparkSession.builder.master("local[2]").appName("qflow-bench-spark")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def batch_write(spark, broker: str, port: int, n: int, queue: str = "bw") -> float:
    from pyspark.sql.functions import expr

    on_broker(port, _declare, queue)
    df = spark.range(n, numPartitions=2).select(expr("repeat('x', 64)").cast("binary").alias("body")).cache()
    df.count()  # build the rows first: time the writing only
    t0 = time.perf_counter()
    df.write.format("qflow").option("broker", broker).option("queue", queue).mode("append").save()
    rate = n / (time.perf_counter() - t0)
    df.unpersist()
    assert on_broker(port, _depth, queue) == n
    return rate


def batch_read(spark, broker: str, port: int, n: int) -> float:
    on_broker(port, _declare, "br")
    on_broker(port, _fill, "br", n)
    t0 = time.perf_counter()
    row = spark.read.format("qflow").option("broker", broker).option("queue", "br").option("numPartitions", "2") \
        .load().selectExpr("count(*) AS n", "sum(length(body)) AS bytes").collect()[0]
    rate = n / (time.perf_counter() - t0)
    assert (row.n, row.bytes) == (n, n * len(BODY)), row
    return rate


def streaming(spark, broker: str, port: int, n: int, name: str = "st") -> tuple[float, float, list]:
    """(N / seconds from start() to the end, N / the micro-batches' own
    seconds, each micro-batch's rows and phases)."""
    on_broker(port, _declare, f"{name}-in", f"{name}-out")
    on_broker(port, _fill, f"{name}-in", n)
    checkpoint = tempfile.mkdtemp(prefix="qflow-bench-spark-")
    t0 = time.perf_counter()
    query = spark.readStream.format("qflow").option("broker", broker).option("queue", f"{name}-in") \
        .option("numPartitions", "2").load().select("body").writeStream.format("qflow") \
        .option("broker", broker).option("queue", f"{name}-out").option("checkpointLocation", checkpoint) \
        .trigger(availableNow=True).start()
    query.awaitTermination()
    rate = n / (time.perf_counter() - t0)
    assert on_broker(port, _depth, f"{name}-out") == n and on_broker(port, _depth, f"{name}-in") == 0
    batches = [{"rows": p["numInputRows"], **p["durationMs"]} for p in query.recentProgress]
    busy = sum(b.get("triggerExecution", 0) for b in batches) / 1000
    return rate, n / busy if busy else 0.0, batches


def spark_alone_read(spark, n: int) -> float:
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from qflow.spark.schema import COLUMNS, SCHEMA, arrow_types

    class Rows(InputPartition):
        def __init__(self, rows: int) -> None:
            self.rows = rows

    class Reader(DataSourceReader):
        def partitions(self):
            return [Rows(n // 2), Rows(n - n // 2)]

        def read(self, part):
            import pyarrow as pa

            k = 32768  # as a read task's batches, once past its first
            cols = [[BODY] * k, [""] * k, ["br"] * k, *[[None] * k] * 4, list(range(k)), [False] * k, ["br"] * k,
                    [None] * k]  # ..., sequence, redelivered, queue, timestamp
            batch = pa.RecordBatch.from_arrays([pa.array(c, t) for c, t in zip(cols, arrow_types(), strict=True)],
                                               names=list(COLUMNS))
            left = part.rows
            while left:
                yield batch if left >= k else batch.slice(0, left)
                left -= min(left, k)

    class Alone(DataSource):
        @classmethod
        def name(cls):
            return "qflow-bench-alone"

        def schema(self):
            return SCHEMA

        def reader(self, schema):
            return Reader()

    spark.dataSource.register(Alone)
    best = 0.0
    for _ in range(3):  # the best of three (the first also warms it up): a ceiling
        t0 = time.perf_counter()
        row = spark.read.format("qflow-bench-alone").load() \
            .selectExpr("count(*) AS n", "sum(length(body)) AS bytes").collect()[0]
        rate = n / (time.perf_counter() - t0)
        assert (row.n, row.bytes) == (n, n * len(BODY)), row
        best = max(best, rate)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=300_000, help="messages per workload")
    p.add_argument("--quick", action="store_true", help="20,000 messages per workload")
    args = p.parse_args()
    n = 20_000 if args.quick else args.messages
    daemon = qflowd.start("--no-data-dir")
    spark = None
    try:
        broker = f"127.0.0.1:{daemon.port}"
        results = {"messages": n, "body_bytes": len(BODY), "broker_alone": broker_alone(daemon.port, n)}
        results["broker_alone_distinct_ids"] = broker_alone_distinct_ids(daemon.port, n)
        print(f"broker alone: {results['broker_alone']:,.0f} msg/s; with a message id each "
              f"{results['broker_alone_distinct_ids']:,.0f} msg/s", flush=True)
        spark = spark_session()
        # Warm up Spark, its Python workers and the JIT on each path before timing.
        batch_write(spark, broker, daemon.port, min(n, 20_000), "warm-up")
        spark.read.format("qflow").option("broker", broker).option("queue", "warm-up").option("numPartitions", "2") \
            .load().selectExpr("count(*)").collect()
        streaming(spark, broker, daemon.port, min(n, 20_000), "warm-up-st")
        results["spark_alone_read"] = spark_alone_read(spark, n)
        print(f"spark alone (a source of pre-built Arrow batches, no broker): read {results['spark_alone_read']:,.0f} "
              f"msg/s", flush=True)
        for name, fn in (("batch_write", batch_write), ("batch_read", batch_read)):
            results[name] = fn(spark, broker, daemon.port, n)
        results["streaming"], results["streaming_sustained"], results["streaming_batches"] = \
            streaming(spark, broker, daemon.port, n)
        for name in (*GOALS, "streaming_sustained"):
            goal = GOALS.get(name, GOALS["streaming"])
            print(f"{name}: {results[name]:,.0f} msg/s ({results[name] / results['broker_alone']:.2f} of the "
                  f"broker alone; goal {goal:,})", flush=True)
        print(f"batch_read is {results['batch_read'] / results['spark_alone_read']:.2f} of spark alone", flush=True)
        print("streaming micro-batches (rows, ms):", json.dumps(results["streaming_batches"]), flush=True)
        rated = ("broker_alone_distinct_ids", "spark_alone_read", *GOALS, "streaming_sustained")
        results["ratios"] = {k: round(results[k] / results["broker_alone"], 3) for k in rated}
        results["batch_read_of_spark_alone"] = round(results["batch_read"] / results["spark_alone_read"], 3)
        results["goals_met"] = {k: results[k] >= v for k, v in GOALS.items()}
        results["goals_met"]["streaming_sustained"] = results["streaming_sustained"] >= GOALS["streaming"]
        for k in ("broker_alone", *rated):
            results[k] = round(results[k])
    finally:
        if spark is not None:
            spark.stop()
        daemon.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
