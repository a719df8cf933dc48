"""The PySpark data source: batch and streaming, read and write, against a real
qflowd subprocess (Spark's Python workers are separate processes).

One local[1,2] SparkSession (one core; a failed task is tried twice)
serves the whole module. Skipped only when pyspark
cannot be imported; ``make test`` installs it (the ``test`` extra pulls in
``qflow[spark]``), so CI runs these.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import trio  # noqa: E402

import qflow  # noqa: E402
from qflow.protocol.ranges import RangeSet  # noqa: E402
from qflow.spark import QflowDataSource, register  # noqa: E402
from qflow.spark.options import ReadOptions, WriteOptions, parse_broker  # noqa: E402
from qflow.spark.sequences import SequenceSet, describe, intersect, minus, split_sequences  # noqa: E402
from tests.conftest import Daemon, start_qflowd  # noqa: E402

# Spark is slow to start and does not depend on the accounting implementation:
# run these once (make test runs the suite again under QFLOW_ACCOUNTING=python).
pytestmark = pytest.mark.native_only

SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",  # loopback only
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "1",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}


# -- fixtures ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_qflowd()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    # Spark's workers run `python3` from PATH unless told otherwise.
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    builder = SparkSession.builder.master("local[1,2]").appName("qflow-tests")
    for k, v in SPARK_CONF.items():
        builder = builder.config(k, v)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def broker(daemon: Daemon) -> str:
    return f"127.0.0.1:{daemon.port}"


# -- helpers: short trio programs against the daemon ---------------------------------
def on_broker(daemon: Daemon, fn: Any, *args: Any, timeout: float = 60) -> Any:
    async def main() -> Any:
        with trio.fail_after(timeout):
            async with qflow.open_connection("127.0.0.1", daemon.port) as conn:
                return await fn(await conn.session(), *args)

    return trio.run(main)


def declare(daemon: Daemon, *names: str, **arguments: Any) -> None:
    async def go(ssn: qflow.Session) -> None:
        for name in names:
            await ssn.declare_queue(name, arguments=arguments or None)

    on_broker(daemon, go)


def send(daemon: Daemon, queue: str, bodies: list[str]) -> None:
    async def go(ssn: qflow.Session) -> None:
        sender = ssn.sender(queue, capacity=100)
        for b in bodies:
            await sender.send(b)
        await sender.sync()

    on_broker(daemon, go)


def stats(daemon: Daemon, queue: str) -> dict[str, Any]:
    async def go(ssn: qflow.Session) -> dict[str, Any]:
        return await ssn.query_queue(queue)

    return on_broker(daemon, go)


def browse(daemon: Daemon, queue: str) -> list[qflow.ReceivedMessage]:
    """Every message on ``queue``, without taking any."""
    async def go(ssn: qflow.Session) -> list[qflow.ReceivedMessage]:
        depth = (await ssn.query_queue(queue))["msgDepth"]
        receiver = await ssn.receiver(queue, browse=True)
        out = [await receiver.fetch(timeout=10) for _ in range(depth)]
        await receiver.close()
        return out

    return on_broker(daemon, go)


def drain(daemon: Daemon, queue: str, n: int, timeout: float = 60) -> list[qflow.ReceivedMessage]:
    async def go(ssn: qflow.Session) -> list[qflow.ReceivedMessage]:
        receiver = await ssn.receiver(queue, capacity=10)
        out = []
        with trio.fail_after(timeout):
            while len(out) < n:
                out.append(await receiver.fetch())
        await receiver.close()
        return out

    return on_broker(daemon, go)


def read(spark: Any, broker: str, queue: str, **options: str) -> Any:
    return spark.read.format("qflow").option("broker", broker).option("queue", queue).options(**options).load()


# -- no Spark needed: options and ranges ---------------------------------------------
def test_parse_broker() -> None:
    assert parse_broker("127.0.0.1:5673") == ("127.0.0.1", 5673)
    assert parse_broker("localhost") == ("localhost", 5672)
    assert parse_broker("[::1]:7000") == ("::1", 7000)
    for bad, text in [("", "empty"), ("h:x", "not a number"), ("h:0", "1..65535"), ("::1", "IPv6"),
                      (":5672", "no host")]:
        with pytest.raises(ValueError, match=text):
            parse_broker(bad)


def test_options_are_case_insensitive_and_checked() -> None:
    opts = ReadOptions.parse({"QUEUE": "q", "maxMessagesPerTrigger": "10", "Broker": "h:1"})
    assert (opts.queue, opts.max_per_trigger, opts.endpoint.host, opts.endpoint.port) == ("q", 10, "h", 1)
    with pytest.raises(ValueError, match="needs option 'queue'"):
        ReadOptions.parse({})
    with pytest.raises(ValueError, match="maxMessagesPerTrigger' must be an integer"):
        ReadOptions.parse({"queue": "q", "maxmessagespertrigger": "lots"})
    with pytest.raises(ValueError, match="'failOnDataLoss' must be true or false"):
        ReadOptions.parse({"queue": "q", "failondataloss": "maybe"})
    assert ReadOptions.parse({"queue": "q"}).fail_on_data_loss is True
    opts = ReadOptions.parse({"queue": "q", "startingOffsets": "5", "endingOffsets": "9"})
    assert (opts.starting, opts.ending) == (5, 9)
    assert (ReadOptions.parse({"queue": "q"}).starting, ReadOptions.parse({"queue": "q"}).ending) == ("earliest", None)
    for bad, text in [({"startingoffsets": "soon"}, "'startingOffsets' must be earliest, latest or a sequence"),
                      ({"startingoffsets": "0"}, "sequence numbers start at 1"),
                      ({"endingoffsets": "earliest"}, "'endingOffsets' must be latest or a sequence number")]:
        with pytest.raises(ValueError, match=text):
            ReadOptions.parse({"queue": "q", **bad})
    assert ReadOptions.parse({"queue": "q", "failOnDataLoss": "false"}).fail_on_data_loss is False
    w = WriteOptions.parse({"exchange": "ex", "routingkey": "k", "capacity": "7"})
    assert (w.address, w.capacity, w.send_timeout) == ("ex/k", 7, None)
    assert WriteOptions.parse({"queue": "q", "sendtimeout": "2.5"}).send_timeout == 2.5
    assert (w.durable, WriteOptions.parse({"queue": "q", "Durable": "true"}).durable) == (False, True)
    for bad, text in [({}, "needs option 'queue'"), ({"queue": "q", "exchange": "e"}, "not both"),
                      ({"queue": "q", "capacity": "0"}, "at least 1"),
                      ({"queue": "q", "durable": "sometimes"}, "'durable' must be true or false"),
                      ({"queue": "q", "routingkey": "k"}, "goes with 'exchange'")]:
        with pytest.raises(ValueError, match=text):
            WriteOptions.parse(bad)
    # A misspelt or retired option is refused, naming it, never silently ignored.
    with pytest.raises(ValueError, match="unknown option maxmessagespertriger "):
        ReadOptions.parse({"queue": "q", "maxMessagesPerTriger": "10"})
    with pytest.raises(ValueError, match="unknown option readidletimeout "):
        ReadOptions.parse({"queue": "q", "readIdleTimeout": "5"})
    with pytest.raises(ValueError, match="unknown option durable ") as refused:  # a writer's option, to a reader
        ReadOptions.parse({"queue": "q", "durable": "true"})
    # The options it lists are those a reader takes: not consume, which is refused.
    assert "failondataloss" in str(refused.value) and "consume" not in str(refused.value)
    with pytest.raises(ValueError, match="'consume' is not supported"):
        ReadOptions.parse({"queue": "q", "consume": "true"})
    with pytest.raises(ValueError, match="unknown options numpartitions, startingoffsets "):
        WriteOptions.parse({"queue": "q", "startingOffsets": "earliest", "numPartitions": "2"})
    # What Spark itself hands on (a streaming query's name and checkpoint) is not the user's mistake.
    WriteOptions.parse({"queue": "q", "queryName": "revenue", "checkpointLocation": "/tmp/c", "__internal": "x"})


def test_split_sequences() -> None:
    def parts(ranges: list[tuple[int, int]], n: int | None, per_part: int = 10_000) -> list[list[tuple[int, int]]]:
        return [list(p.ranges()) for p in split_sequences(RangeSet(ranges), n, per_part)]

    assert parts([], None) == []
    assert parts([(1, 10)], 3) == [[(1, 4)], [(5, 7)], [(8, 10)]]
    # a planned set with holes splits by count of messages, not by numbers
    assert parts([(1, 2), (5, 6), (9, 10)], 2) == [[(1, 2), (5, 5)], [(6, 6), (9, 10)]]
    assert len(parts([(1, 2)], 8)) == 2  # never an empty partition
    assert len(parts([(1, 1_000_000)], None)) == 8
    assert parts([(1, 5)], None, per_part=2) == [[(1, 2)], [(3, 4)], [(5, 5)]]
    assert describe(RangeSet([(5, 7), (9, 9)])) == "5..7, 9"


def test_minus_and_intersect_of_sequence_sets_go_range_by_range() -> None:
    """What a plan finds missing and what a re-browse finds gone or still
    there: the same as set difference and intersection, for any two sets,
    without a step per number (a million-number range is one range)."""
    import random

    rng = random.Random(15)
    for _ in range(300):
        a = RangeSet((f, f + rng.randrange(6)) for f in rng.sample(range(60), rng.randrange(6)))
        b = RangeSet((f, f + rng.randrange(6)) for f in rng.sample(range(60), rng.randrange(6)))
        assert set(minus(a, b)) == set(a) - set(b), (a, b)
        assert set(intersect(a, b)) == set(a) & set(b), (a, b)
    huge = RangeSet([(1, 10**9)])
    assert list(minus(huge, RangeSet([(5, 10**9 - 1)])).ranges()) == [(1, 4), (10**9, 10**9)]
    assert list(intersect(huge, RangeSet([(7, 8), (10**9, 2 * 10**9)])).ranges()) == [(7, 8), (10**9, 10**9)]


def test_everything_pickles() -> None:
    """Spark pickles the source, its readers, writers and partitions: none may
    hold a socket or a lock before read/write runs."""
    import pickle

    from pyspark.sql.types import StringType, StructField, StructType

    from qflow.spark import COLUMNS
    from qflow.spark.writing import QflowBatchWriter, QflowStreamWriter

    ds = QflowDataSource({"queue": "q", "broker": "127.0.0.1:1"})
    schema = StructType([StructField(name, StringType()) for name in COLUMNS])  # only the names matter
    opts = WriteOptions.parse({"queue": "q"})
    for obj in (ds, ds.reader(schema), ds.streamReader(schema), SequenceSet(0, "abc", [1, 10]),
                QflowBatchWriter(opts, "w"), QflowStreamWriter(opts, None)):
        assert type(pickle.loads(pickle.dumps(obj))) is type(obj)


# -- Spark ------------------------------------------------------------------------------
def test_batch_write_and_read_round_trip(spark: Any, daemon: Daemon, broker: str) -> None:
    declare(daemon, "rt", "rt-copy", "by-key-1", "by-key-2")
    rows = [(f"order {i}", f"id-{i}" if i % 2 else None, {"n": str(i)}) for i in range(30)]
    df = spark.createDataFrame(rows, "body string, message_id string, headers map<string,string>").repartition(2)
    df.write.format("qflow").option("broker", broker).option("queue", "rt").option("capacity", "8") \
        .mode("append").save()

    st = stats(daemon, "rt")
    assert (st["msgDepth"], st["firstSequence"], st["lastSequence"]) == (30, 1, 30)
    got = read(spark, broker, "rt", numPartitions="3").orderBy("sequence").collect()
    assert [r.sequence for r in got] == list(range(1, 31))
    assert sorted(r.body.decode() for r in got) == sorted(b for b, _, _ in rows)
    by_body = {r.body.decode(): r for r in got}
    for body, mid, headers in rows:
        r = by_body[body]
        assert {k: v.string for k, v in r.headers.items()} == headers and r.routing_key == "rt" and r.exchange == "" and r.redelivered is False
        if mid is not None:
            assert r.message_id == mid
        else:  # deterministic: WRITE-ID-PARTITION-ROW
            write_id, partition, row = r.message_id.rsplit("-", 2)
            assert len(write_id) == 12 and partition in ("0", "1") and row.isdigit()
    assert len({r.message_id for r in got}) == 30
    assert stats(daemon, "rt")["msgDepth"] == 30  # reading browses: nothing taken

    # What was read writes back unchanged (the extra columns are ignored), to a
    # queue or through an exchange with a routing_key column.
    read(spark, broker, "rt").write.format("qflow").option("broker", broker).option("queue", "rt-copy") \
        .mode("append").save()
    copied = browse(daemon, "rt-copy")
    assert sorted(m.body for m in copied) == sorted(r.body for r in got)
    assert {m.routing_key for m in copied} == {"rt-copy"}

    async def topology(ssn: qflow.Session) -> None:
        await ssn.declare_exchange("orders-ex", "direct")
        await ssn.bind("orders-ex", "by-key-1", "k1")
        await ssn.bind("orders-ex", "by-key-2", "k2")

    on_broker(daemon, topology)
    keyed = spark.createDataFrame([(b"x", "k1"), (b"y", "k2"), (b"z", "k2")], "body binary, routing_key string")
    keyed.write.format("qflow").option("broker", broker).option("exchange", "orders-ex").mode("append").save()
    assert [m.body for m in browse(daemon, "by-key-1")] == [b"x"]
    assert [m.body for m in browse(daemon, "by-key-2")] == [b"y", b"z"]

    # A task Spark stops reading early (a limit) ends its reader thread and connection.
    assert len(read(spark, broker, "rt").limit(3).collect()) == 3
    wait_until(lambda: stats(daemon, "rt")["consumerCount"] == 0, "the early-stopped task's browser to go", 60)
    # Reading browses: nothing was taken.
    assert stats(daemon, "rt")["msgDepth"] == 30


def stream(spark: Any, broker: str, source: str, sink: str, checkpoint: str, per_trigger: int,
           transform: Any = None) -> Any:
    df = spark.readStream.format("qflow").option("broker", broker).option("queue", source) \
        .option("maxMessagesPerTrigger", str(per_trigger)).load()
    df = transform(df) if transform else df.select("body")
    return df.writeStream.format("qflow").option("broker", broker).option("queue", sink) \
        .option("checkpointLocation", checkpoint).trigger(availableNow=True).start()


def test_streaming_available_now_reads_writes_and_commits(spark: Any, daemon: Daemon, broker: str,
                                                          tmp_path: Any) -> None:
    declare(daemon, "s-in", "s-out")
    send(daemon, "s-in", [f"m{i}" for i in range(10)])
    checkpoint = str(tmp_path / "ckpt")
    q = stream(spark, broker, "s-in", "s-out", checkpoint, per_trigger=4)
    assert q.awaitTermination(120)
    progress = [p for p in q.recentProgress if p["numInputRows"]]
    assert [p["numInputRows"] for p in progress] == [4, 4, 2]  # admission control
    # Lag in the progress: the source's latestOffset says how far the queue is ahead of the batch.
    latest = [p["sources"][0]["latestOffset"] for p in progress]
    lags = [(json.loads(x) if isinstance(x, str) else x)["s-in"]["lag"] for x in latest]
    assert lags == [6, 2, 0], lags
    out = browse(daemon, "s-out")
    assert [m.body for m in out] == [f"m{i}".encode() for i in range(10)]
    # Ids are QUERY-ID-BATCH-PARTITION-ROW: a replayed batch repeats them.
    assert [m.message_id.rsplit("-", 3)[1:] for m in out[:5]] == [["0", "0", str(i)] for i in range(4)] + [
        ["1", "0", "0"]]
    assert {m.message_id.rsplit("-", 3)[0] for m in out} == {q.id}
    # Spark commits a batch's source offsets when it plans the next batch; the
    # source plans an empty one after the last, so every batch is committed
    # (removed) by the end of the run.
    st = stats(daemon, "s-in")
    assert (st["msgDepth"], st["firstSequence"]) == (0, 11)

    send(daemon, "s-in", ["late-1", "late-2", "late-3"])
    q = stream(spark, broker, "s-in", "s-out", checkpoint, per_trigger=4)
    assert q.awaitTermination(120)
    out = browse(daemon, "s-out")
    assert [m.body for m in out][10:] == [b"late-1", b"late-2", b"late-3"]  # nothing read twice
    st = stats(daemon, "s-in")
    assert (st["msgDepth"], st["firstSequence"]) == (0, 14)


def test_replay_after_restart_before_commit(spark: Any, daemon: Daemon, broker: str, tmp_path: Any) -> None:
    """Batch 0 fails in its write task after sending part of its rows; the
    query restarts from its checkpoint, replays batch 0 with the same range and
    the same message ids, and nothing is lost: dedupe by id gives each once."""
    from pyspark.sql.functions import col, udf

    declare(daemon, "r-in", "r-out")
    send(daemon, "r-in", [f"r{i}" for i in range(6)])
    flag = tmp_path / "fail"
    flag.write_text("1")
    flag_path = str(flag)

    @udf("string", useArrow=False)
    def body_or_fail(body: bytes) -> str:
        if body == b"r2" and os.path.exists(flag_path):
            raise RuntimeError("injected failure")
        return body.decode()

    def transform(df: Any) -> Any:
        return df.select(body_or_fail(col("body")).alias("body"))

    checkpoint = str(tmp_path / "ckpt")
    q = stream(spark, broker, "r-in", "r-out", checkpoint, per_trigger=4, transform=transform)
    with pytest.raises(Exception, match="injected failure"):
        q.awaitTermination(120)
    assert stats(daemon, "r-in")["msgDepth"] == 6  # not committed
    send(daemon, "r-in", ["r6", "r7"])  # arrives while the query is down

    flag.unlink()
    q = stream(spark, broker, "r-in", "r-out", checkpoint, per_trigger=4, transform=transform)
    assert q.awaitTermination(120)
    out = browse(daemon, "r-out")
    first = {}
    for m in out:
        assert first.setdefault(m.message_id, m.body) == m.body  # a duplicate is the same message
    assert sorted(first.values()) == [f"r{i}".encode() for i in range(8)]
    batches = sorted({m.message_id.rsplit("-", 3)[1] for m in out})
    assert batches == ["0", "1"]  # batch 0 replayed its range (r0..r3), r4..r7 came in batch 1
    assert sorted(first[k] for k in first if k.rsplit("-", 3)[1] == "0") == [b"r0", b"r1", b"r2", b"r3"]


def test_a_restarted_driver_removes_the_committed_batch_its_predecessor_did_not(spark: Any, daemon: Daemon,
                                                                               broker: str) -> None:
    """Spark tells a source that batch N is committed while it plans batch
    N + 1. A driver killed between the two left N's messages in the queue,
    before every offset the query reads again: the new driver's first batch
    (start = N's end) removes them. A fresh query's first batch (start = its
    initial offset) removes nothing."""
    from pyspark.sql.types import StructType

    from qflow.spark import SCHEMA

    declare(daemon, "k-in")
    send(daemon, "k-in", [f"k{i}" for i in range(6)])
    schema = StructType.fromDDL(SCHEMA)
    source = QflowDataSource({"broker": broker, "queue": "k-in"})
    first = source.streamReader(schema)  # the first driver
    start = first.initialOffset()
    end = first.latestOffset(start, None)
    assert len(first.partitions(start, end)) >= 1  # batch 0 is planned: k0..k5
    assert stats(daemon, "k-in")["msgDepth"] == 6  # nothing removed by a fresh query's first batch
    # Batch 0 ran and Spark committed it; the driver died before batch 1 was planned (commit(end) never ran).
    send(daemon, "k-in", ["k6"])
    second = source.streamReader(schema)  # the new driver resumes from the checkpoint: batch 1 starts at end
    end1 = second.latestOffset(end, None)
    second.partitions(end, end1)
    st = stats(daemon, "k-in")
    assert (st["msgDepth"], st["firstSequence"]) == (1, 7)  # batch 0's six are gone, batch 1's k6 is there
    second.partitions(end, end1)  # a second plan in the same driver removes nothing more
    assert stats(daemon, "k-in")["msgDepth"] == 1


def test_write_blocks_on_flow_stopped_queue_until_drained(spark: Any, daemon: Daemon, broker: str) -> None:
    """A Spark write task meets a flow-stopped queue: it waits (no Spark
    timeout fires) and finishes once a consumer drains the queue."""
    declare(daemon, "slow", **{"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
    df = spark.createDataFrame([(f"b{i}",) for i in range(40)], "body string").coalesce(1)
    seen: dict[str, Any] = {}
    saved = threading.Event()

    def consumer() -> None:  # Spark stays on the main thread, where its session is active
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not stats(daemon, "slow")["flowStopped"]:
                time.sleep(0.2)
            time.sleep(2)  # the task is held: it neither finishes nor fails
            seen["held"] = stats(daemon, "slow")
            seen["saved_while_held"] = saved.is_set()
            seen["drain_started"] = time.monotonic()
            seen["got"] = drain(daemon, "slow", 40)
        except BaseException as exc:  # reported below
            seen["error"] = exc

    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    df.write.format("qflow").option("broker", broker).option("queue", "slow").option("capacity", "2") \
        .mode("append").save()
    saved_at = time.monotonic()
    saved.set()
    thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in seen, seen
    held = seen["held"]
    assert held["flowStopped"] and 5 < held["msgDepth"] <= 5 + 2 and held["heldTransfers"] >= 1, held
    assert not seen["saved_while_held"] and saved_at > seen["drain_started"]
    got = seen["got"]
    assert sorted(m.body for m in got) == sorted(f"b{i}".encode() for i in range(40))
    assert len({m.message_id for m in got}) == 40
    # The writer's messages, each with its own id, are taken by the broker as runs: the accounting
    # stays exact, the held queue's bytes are its messages' sizes (exchange, routing key, properties, body).
    sizes = [len(msgpack.packb("")) + len(msgpack.packb("slow"))
             + len(msgpack.packb({"message_id": m.message_id, "timestamp": m.timestamp})) + len(m.body) for m in got]
    assert held["byteDepth"] == sum(sizes[:held["msgDepth"]]), (held, sizes)
    st = stats(daemon, "slow")
    assert st["flowStoppedCount"] >= 1 and (st["msgDepth"], st["byteDepth"]) == (0, 0)


def test_option_errors(spark: Any, daemon: Daemon, broker: str) -> None:
    declare(daemon, "errs")
    df = spark.createDataFrame([("x",)], "body string")

    def fails(action: Any, text: str) -> None:
        with pytest.raises(Exception, match=text):
            action()

    fails(lambda: spark.read.format("qflow").option("broker", broker).load().collect(), "needs option 'queue'")
    fails(lambda: read(spark, broker, "no-such-queue").collect(), "queue 'no-such-queue' does not exist")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    fails(lambda: read(spark, closed, "errs").collect(), "cannot connect to the broker")

    def write(frame: Any = df, mode: str = "append", **options: str) -> Any:
        return lambda: frame.write.format("qflow").option("broker", broker).options(**options).mode(mode).save()

    fails(write(queue="errs", mode="overwrite"), r"mode\('append'\) is the supported save mode")
    fails(write(queue="errs", mode="error"), "Append")  # Spark's own refusal of the other modes
    fails(write(queue="errs", capacity="none"), "'capacity' must be an integer")
    fails(write(queue="nowhere"), "queue 'nowhere' does not exist")
    fails(write(spark.createDataFrame([("x", 1)], "body string, priority int"), queue="errs"),
          r"cannot write columns \['priority'\]")
    fails(write(spark.createDataFrame([(1,)], "payload int"), queue="errs"), "needs a 'body' column")
    assert stats(daemon, "errs")["msgDepth"] == 0


# -- authentication ----------------------------------------------------------------------------
def test_username_and_password_options_are_checked_and_kept_out_of_reprs() -> None:
    opts = ReadOptions.parse({"queue": "q", "UserName": "alice", "password": "s3cret"})
    assert (opts.endpoint.username, opts.endpoint.password) == ("alice", "s3cret")
    assert "s3cret" not in repr(opts)
    for bad, text in [({"queue": "q", "username": "alice"}, "go together"),
                      ({"queue": "q", "password": "x"}, "go together"),
                      ({"queue": "q", "username": "", "password": "x"}, "'username' is empty")]:
        with pytest.raises(ValueError, match=text):
            ReadOptions.parse(bad)
        with pytest.raises(ValueError, match=text):
            WriteOptions.parse(bad)


def test_write_and_read_with_credentials_on_an_authenticating_broker(spark: Any, tmp_path: Any) -> None:
    db = tmp_path / "users.json"
    subprocess.run([sys.executable, "-m", "qflow.cli.qflow_passwd", "--sasl-db", str(db), "--iterations", "4096",
                    "spark"], input="sp4rk\n", text=True, check=True, timeout=60)
    d = start_qflowd("--auth", "yes", "--sasl-db", str(db))
    try:
        broker = f"127.0.0.1:{d.port}"

        async def declare_authenticated() -> None:
            with trio.fail_after(60):
                async with qflow.open_connection("127.0.0.1", d.port, username="spark", password="sp4rk") as c:
                    await (await c.session()).declare_queue("secured")

        trio.run(declare_authenticated)
        creds = {"username": "spark", "password": "sp4rk"}
        df = spark.createDataFrame([("a",), ("b",)], "body string")
        df.write.format("qflow").option("broker", broker).option("queue", "secured").options(**creds) \
            .mode("append").save()
        got = read(spark, broker, "secured", **creds).collect()
        assert sorted(bytes(r.body) for r in got) == [b"a", b"b"]
        with pytest.raises(Exception, match="authentication failed"):
            read(spark, broker, "secured", username="spark", password="wrong").collect()
        with pytest.raises(Exception, match="authentication required"):
            read(spark, broker, "secured").collect()
    finally:
        d.stop()


# -- issue 15: no silent loss, no hang, persistent writes ------------------------------
def available_now(spark: Any, broker: str, source: str, sink: str, checkpoint: str, **options: str) -> Any:
    """A streaming copy of ``source``'s bodies to ``sink`` with default options
    (no maxMessagesPerTrigger) and Trigger.AvailableNow."""
    df = spark.readStream.format("qflow").option("broker", broker).option("queue", source).options(**options).load()
    return df.select("body").writeStream.format("qflow").option("broker", broker).option("queue", sink) \
        .option("checkpointLocation", checkpoint).trigger(availableNow=True).start()


def fails_with_data_loss(query: Any, queue: str, *texts: str) -> None:
    with pytest.raises(Exception) as info:  # Spark wraps it: StreamingQueryException
        query.awaitTermination(180)
    message = str(info.value)
    assert f"data loss on queue {queue!r}" in message and "failOnDataLoss=false" in message, message
    for text in texts:
        assert text in message, message


def bodies(daemon: Daemon, queue: str) -> list[bytes]:
    return [m.body for m in browse(daemon, queue)]


def wait_until(predicate: Any, what: str, timeout: float = 300) -> None:
    """Poll until ``predicate()``: room for a slow machine, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting ({timeout:.0f} s) for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "stateful"])
def test_flow_controlled_source_with_default_options_does_not_hang_its_producer(spark: Any, daemon: Daemon,
                                                                                 broker: str, tmp_path: Any,
                                                                                 stateful: bool) -> None:
    """Issue 15's hang: a stateless (or stateful: dropDuplicates) query with
    default options (no maxMessagesPerTrigger, the default trigger) on a
    source whose producer is flow-controlled. The batch that read the held
    messages must be committed although no new message can arrive: every one
    of 3000 messages arrives."""
    n = 3000
    source, sink = ("hang-in-stateful", "hang-out-stateful") if stateful else ("hang-in", "hang-out")
    declare(daemon, source, **{"qpid.flow_stop_count": 500, "qpid.flow_resume_count": 400})
    declare(daemon, sink)
    done: dict[str, Any] = {}

    def produce() -> None:
        async def main() -> None:
            with trio.fail_after(300):
                async with qflow.open_connection("127.0.0.1", daemon.port) as conn:
                    sender = (await conn.session()).sender(source, capacity=50)
                    for i in range(n):
                        await sender.send(b"h%d" % i)
                    await sender.sync()

        try:
            trio.run(main)
            done["ok"] = True
        except BaseException as exc:  # reported below
            done["error"] = exc

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    df = spark.readStream.format("qflow").option("broker", broker).option("queue", source).load().select("body")
    if stateful:
        df = df.dropDuplicates(["body"])  # state kept across micro-batches
    query = df.writeStream.format("qflow").option("broker", broker).option("queue", sink) \
        .option("checkpointLocation", str(tmp_path / "ckpt")).start()
    try:
        wait_until(lambda: stats(daemon, sink)["msgDepth"] == n or not query.isActive,
                   f"every message to arrive in {sink}")
        assert query.isActive, query.exception()
        producer.join(timeout=120)
        assert done.get("ok"), done
        wait_until(lambda: stats(daemon, source)["msgDepth"] == 0, "the last batch to be committed")
    finally:
        query.stop()
    assert sorted(bodies(daemon, sink)) == sorted(b"h%d" % i for i in range(n))
    assert stats(daemon, source)["flowStoppedCount"] >= 1  # the producer was held on the way


def test_queue_deleted_and_declared_again_is_reported_not_deleted_unread(spark: Any, daemon: Daemon, broker: str,
                                                                        tmp_path: Any) -> None:
    """Issue 15: "A queue deleted and re-declared: 100 of 150 new messages
    deleted unread." The query's offsets belong to the old queue: by default
    the query fails naming the queue and the incarnation, and nothing of the
    new queue is removed; with failOnDataLoss=false it reads the new queue
    from its first message."""
    declare(daemon, "inc-in", "inc-out")
    send(daemon, "inc-in", [f"old{i}" for i in range(50)])
    checkpoint = str(tmp_path / "ckpt")
    assert available_now(spark, broker, "inc-in", "inc-out", checkpoint).awaitTermination(180)
    assert stats(daemon, "inc-in")["msgDepth"] == 0
    old = stats(daemon, "inc-in")["incarnation"]

    on_broker(daemon, lambda ssn: ssn.delete_queue("inc-in"))
    declare(daemon, "inc-in")
    send(daemon, "inc-in", [f"new{i}" for i in range(150)])
    fails_with_data_loss(available_now(spark, broker, "inc-in", "inc-out", checkpoint), "inc-in",
                         f"incarnation {old}", "read through sequence 50")
    assert stats(daemon, "inc-in")["msgDepth"] == 150  # nothing removed
    assert len(bodies(daemon, "inc-out")) == 50

    assert available_now(spark, broker, "inc-in", "inc-out", checkpoint, failOnDataLoss="false") \
        .awaitTermination(180)
    assert sorted(bodies(daemon, "inc-out")[50:]) == sorted(f"new{i}".encode() for i in range(150))
    assert stats(daemon, "inc-in")["msgDepth"] == 0


def test_messages_another_consumer_holds_are_reported_and_never_removed_unread(spark: Any, daemon: Daemon,
                                                                              broker: str, tmp_path: Any) -> None:
    """Issue 15: "Messages released by another consumer: 20 of 260 lost."
    Another consumer holds sequences 101..120 while the query plans: a gap in
    what it can read. By default the query fails naming them; with
    failOnDataLoss=false it reads the rest, and the 20, released afterwards,
    are still in the queue: the commit removed exactly what was read."""
    declare(daemon, "rel-in", "rel-out")
    send(daemon, "rel-in", [f"a{i}" for i in range(100)])
    checkpoint = str(tmp_path / "ckpt")
    assert available_now(spark, broker, "rel-in", "rel-out", checkpoint).awaitTermination(180)
    send(daemon, "rel-in", [f"b{i}" for i in range(160)])  # sequences 101..260

    holding, release, state = threading.Event(), threading.Event(), {}

    def hold() -> None:  # another consumer: acquires 20, accepts none, then lets them go
        async def main() -> None:
            async with qflow.open_connection("127.0.0.1", daemon.port) as conn:
                receiver = await (await conn.session()).receiver("rel-in", capacity=20, accept="explicit")
                with trio.fail_after(60):
                    while receiver.available() < 20:
                        await trio.sleep(0.01)
                holding.set()
                await trio.to_thread.run_sync(release.wait)

        try:
            trio.run(main)
        except BaseException as exc:  # reported below
            state["error"] = exc
        holding.set()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(60) and "error" not in state, state
        fails_with_data_loss(available_now(spark, broker, "rel-in", "rel-out", checkpoint), "rel-in",
                             "sequences 101..120")
        assert stats(daemon, "rel-in")["msgDepth"] == 160
        assert available_now(spark, broker, "rel-in", "rel-out", checkpoint, failOnDataLoss="false") \
            .awaitTermination(180)
        assert sorted(bodies(daemon, "rel-out")[100:]) == sorted(f"b{i}".encode() for i in range(20, 160))
    finally:
        release.set()
        holder.join(timeout=60)
    assert "error" not in state, state
    wait_until(lambda: stats(daemon, "rel-in")["msgDepth"] == 20, "the released messages to be back")
    back = browse(daemon, "rel-in")
    assert [m.sequence for m in back] == list(range(101, 121))
    assert [m.body for m in back] == [f"b{i}".encode() for i in range(20)]


def test_ring_queue_overwrites_are_reported_not_skipped_silently(spark: Any, daemon: Daemon, broker: str,
                                                                tmp_path: Any) -> None:
    """Issue 15: "Ring-queue overwrites: skipped silently." A ring queue of 50
    overwrote sequences 11..60 before the query read them: by default the
    query fails naming them; with failOnDataLoss=false it reads 61..110."""
    declare(daemon, "ring-in", **{"qpid.max_count": 50, "qpid.policy_type": "ring"})
    declare(daemon, "ring-out")
    send(daemon, "ring-in", [f"r{i}" for i in range(1, 11)])
    checkpoint = str(tmp_path / "ckpt")
    assert available_now(spark, broker, "ring-in", "ring-out", checkpoint).awaitTermination(180)
    send(daemon, "ring-in", [f"r{i}" for i in range(11, 111)])
    assert stats(daemon, "ring-in")["firstSequence"] == 61
    fails_with_data_loss(available_now(spark, broker, "ring-in", "ring-out", checkpoint), "ring-in",
                         "sequences 11..60")
    assert available_now(spark, broker, "ring-in", "ring-out", checkpoint, failOnDataLoss="false") \
        .awaitTermination(180)
    assert bodies(daemon, "ring-out") == [f"r{i}".encode() for i in (*range(1, 11), *range(61, 111))]


def test_starting_offsets_latest_leaves_the_backlog_alone(spark: Any, daemon: Daemon, broker: str,
                                                         tmp_path: Any) -> None:
    """Issue 15: "startingOffsets=latest deletes the backlog it skipped." The
    query reads only what arrives after it started, and its commits remove
    exactly that: the 40 messages of the backlog stay."""
    declare(daemon, "late-in", "late-out")
    send(daemon, "late-in", [f"backlog{i}" for i in range(40)])
    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "100")
    try:
        query = spark.readStream.format("qflow").option("broker", broker).option("queue", "late-in") \
            .option("startingOffsets", "latest").load().select("body").writeStream.format("qflow") \
            .option("broker", broker).option("queue", "late-out") \
            .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="200 milliseconds").start()
        try:
            # A progress report means the first trigger ran: the starting point is set.
            wait_until(lambda: query.lastProgress is not None or not query.isActive, "the query's first trigger")
            send(daemon, "late-in", [f"new{i}" for i in range(10)])
            wait_until(lambda: stats(daemon, "late-in")["msgDepth"] == 40 or not query.isActive,
                       "the new messages to be read and committed")
            assert query.isActive, query.exception()
        finally:
            query.stop()
    finally:
        spark.conf.unset("spark.sql.streaming.noDataProgressEventInterval")
    assert bodies(daemon, "late-out") == [f"new{i}".encode() for i in range(10)]
    assert bodies(daemon, "late-in") == [f"backlog{i}".encode() for i in range(40)]


def test_consume_option_is_refused_and_removes_nothing(spark: Any, daemon: Daemon, broker: str) -> None:
    """Issue 15: "consume=true lost all 1000 messages when a later step of the
    job failed." Spark's batch reader has no commit, so the option goes: it is
    refused with the way to do it safely, and nothing is removed."""
    declare(daemon, "consume-in")
    send(daemon, "consume-in", [f"c{i}" for i in range(20)])
    with pytest.raises(Exception, match="'consume' is not supported") as info:
        read(spark, broker, "consume-in", consume="true").collect()
    assert "availableNow" in str(info.value)
    assert stats(daemon, "consume-in")["msgDepth"] == 20


def test_durable_writer_option_makes_messages_persistent(spark: Any) -> None:
    """The durable-store issue: "A message is persistent when its sender marks
    it so: ... and the Spark writer's option". Written with durable=true to a
    durable queue, 50 messages come back after qflowd is killed (-9) and
    restarted on its data directory; written without it, they do not."""
    first = start_qflowd()
    second = None
    try:
        async def topology(ssn: qflow.Session) -> None:
            await ssn.declare_queue("kept", durable=True)
            await ssn.declare_queue("not-kept", durable=True)

        on_broker(first, topology)
        url = f"127.0.0.1:{first.port}"
        df = spark.createDataFrame([(f"p{i}",) for i in range(50)], "body string").repartition(2)
        df.write.format("qflow").option("broker", url).option("queue", "kept").option("durable", "true") \
            .mode("append").save()
        df.write.format("qflow").option("broker", url).option("queue", "not-kept").mode("append").save()
        assert (stats(first, "kept")["msgDepth"], stats(first, "not-kept")["msgDepth"]) == (50, 50)
        first.kill()
        first.proc.wait(timeout=30)
        second = start_qflowd("--data-dir", first.own_data_dir)
        kept = browse(second, "kept")
        assert sorted(m.body for m in kept) == sorted(f"p{i}".encode() for i in range(50))
        assert all(m.redelivered for m in kept)
        assert stats(second, "not-kept")["msgDepth"] == 0  # transient: gone with the broker
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_batch_read_between_starting_and_ending_offsets(spark: Any, daemon: Daemon, broker: str) -> None:
    """As Kafka's batch source: startingOffsets (the first sequence number to
    read) and endingOffsets (exclusive) bound a batch read; latest cannot
    start one, and a streaming read has no end."""
    declare(daemon, "bounded")
    send(daemon, "bounded", [f"m{i}" for i in range(1, 13)])  # sequences 1..12
    got = read(spark, broker, "bounded", startingOffsets="5", endingOffsets="9").orderBy("sequence").collect()
    assert [(r.sequence, r.body) for r in got] == [(i, f"m{i}".encode()) for i in range(5, 9)]
    assert [r.sequence for r in read(spark, broker, "bounded", endingOffsets="3").collect()] == [1, 2]
    with pytest.raises(Exception, match="'startingOffsets' cannot be latest for a batch read"):
        read(spark, broker, "bounded", startingOffsets="latest").collect()
    query = spark.readStream.format("qflow").option("broker", broker).option("queue", "bounded") \
        .option("endingOffsets", "5").load().writeStream.format("console").start()
    try:
        with pytest.raises(Exception, match="'endingOffsets' is for batch reads"):
            query.awaitTermination(120)
    finally:
        query.stop()
    assert stats(daemon, "bounded")["msgDepth"] == 12


def test_tls_options_write_and_read_over_mutual_tls_as_the_certificate_name(spark: Any, tmp_path: Any) -> None:
    """Options ssl, sslCaFile, sslCertFile, sslKeyFile: the sink and the source over TLS to a broker that
    requires client certificates; with no username, the certificate's CN is the user (EXTERNAL)."""
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tmp_path / "broker.pem")
    client = ca.issue_cert("spark.example", common_name="spark-job")
    client.cert_chain_pems[0].write_to_path(tmp_path / "client.crt")
    client.private_key_pem.write_to_path(tmp_path / "client.key")
    d = start_qflowd("--ssl-cert-file", str(tmp_path / "broker.pem"), "--ssl-ca-file", str(tmp_path / "ca.pem"),
                     "--ssl-require-client-authentication")
    try:
        broker = f"127.0.0.1:{d.ssl_port}"
        tls = {"ssl": "true", "sslCaFile": str(tmp_path / "ca.pem"), "sslCertFile": str(tmp_path / "client.crt"),
               "sslKeyFile": str(tmp_path / "client.key")}

        async def declare() -> None:
            context = qflow.tls_context(**{"ca_file": tls["sslCaFile"], "cert_file": tls["sslCertFile"],
                                           "key_file": tls["sslKeyFile"]})
            with trio.fail_after(60):
                async with qflow.open_connection("127.0.0.1", d.ssl_port, ssl_context=context,
                                                 mechanism="EXTERNAL") as c:
                    await (await c.session()).declare_queue("over.tls")

        trio.run(declare)
        df = spark.createDataFrame([("a",), ("b",)], "body string")
        df.write.format("qflow").option("broker", broker).option("queue", "over.tls").options(**tls) \
            .mode("append").save()
        got = read(spark, broker, "over.tls", **tls).collect()
        assert sorted(bytes(r.body) for r in got) == [b"a", b"b"]
        assert "user 'spark-job'" in d.log()
        with pytest.raises(Exception, match="TLS with the broker at 127.0.0.1"):
            read(spark, broker, "over.tls", ssl="true", sslCaFile=tls["sslCaFile"]).collect()  # no certificate
        with pytest.raises(ValueError, match="qflow option 'sslCaFile' is for TLS: add option ssl=true"):
            ReadOptions.parse({"queue": "q", "sslCaFile": "ca.pem"})
        with pytest.raises(ValueError, match="'sslKeyFile' goes with option 'sslCertFile'"):
            ReadOptions.parse({"queue": "q", "ssl": "true", "sslKeyFile": "k.pem"})
    finally:
        d.stop()


# -- issue 15: what users of Kafka's source expect; idempotent writes -------------------
def test_several_queues_and_per_queue_offsets_are_parsed_and_checked() -> None:
    opts = ReadOptions.parse({"queue": "a, b", "startingOffsets": '{"a": 17, "b": "latest"}',
                              "endingOffsets": '{"a": 30}'})
    assert opts.queues == ("a", "b") and opts.pattern is None
    assert (opts.starting_for("a"), opts.starting_for("b")) == (17, "latest")
    assert (opts.ending_for("a"), opts.ending_for("b")) == (30, None)
    # Kafka's -2 (earliest) and -1 (latest) are understood.
    opts = ReadOptions.parse({"queue": "a,b", "startingOffsets": '{"a": -2, "b": -1}', "endingOffsets": '{"b": -1}'})
    assert (opts.starting_for("a"), opts.starting_for("b"), opts.ending_for("b")) == ("earliest", "latest", None)
    opts = ReadOptions.parse({"queuePattern": "orders-.*", "startingOffsets": '{"orders-1": 5}'})
    assert opts.matches("orders-1") and not opts.matches("x-orders-1") and not opts.matches("orders")
    assert (opts.starting_for("orders-1"), opts.starting_for("orders-2")) == (5, "earliest")  # new: earliest
    for bad, text in [({"queue": "a,,b"}, "each once, none empty"),
                      ({"queue": "a,a"}, "each once, none empty"),
                      ({"queue": "a", "queuePattern": "a.*"}, "not both"),
                      ({"queuePattern": "("}, "'queuePattern' '\\(' is not a regular expression"),
                      ({"queue": "a,b", "startingOffsets": "5"}, "a sequence number is of one queue"),
                      ({"queuePattern": "a.*", "endingOffsets": "5"}, "a sequence number is of one queue"),
                      ({"queue": "a,b", "startingOffsets": '{"c": 1}'}, "names queue 'c', which is not among"),
                      ({"queuePattern": "a.*", "startingOffsets": '{"b": 1}'}, "which queuePattern 'a.\\*' does"),
                      ({"queue": "a", "startingOffsets": '{"a": 0}'}, "queue 'a' has 0"),
                      ({"queue": "a", "startingOffsets": "{nope"}, "'startingOffsets' is not valid JSON"),
                      ({"queue": "a", "endingOffsets": '{"a": "earliest"}'}, "queue 'a' has 'earliest'"),
                      ({}, "needs option 'queue'")]:
        with pytest.raises(ValueError, match=text):
            ReadOptions.parse(bad)


def send_many(daemon: Daemon, queue: str, bodies: list[str]) -> None:
    send(daemon, queue, bodies)


def test_batch_read_of_several_queues_with_per_queue_offsets(spark: Any, daemon: Daemon, broker: str) -> None:
    """As Kafka's `subscribe` of several topics, `subscribePattern`, and
    per-partition JSON offsets: a comma list or a pattern reads several
    queues, each row names its queue, and startingOffsets/endingOffsets bound
    each queue by its own sequence numbers ({"kq-a": 3} starts queue kq-a at
    its third message; endingOffsets is exclusive)."""
    declare(daemon, "kq-a", "kq-b", "kq-c", "other-kq")
    for q in ("kq-a", "kq-b", "kq-c", "other-kq"):
        send(daemon, q, [f"{q}/{i}" for i in range(1, 6)])  # sequences 1..5 of each

    def got(**options: str) -> list[tuple[str, int, bytes]]:
        df = spark.read.format("qflow").option("broker", broker).options(**options).load()
        return sorted((r.queue, r.sequence, r.body) for r in df.collect())

    rows = got(queue="kq-a,kq-b", startingOffsets='{"kq-a": 3}', endingOffsets='{"kq-b": 3}')
    assert rows == [("kq-a", i, f"kq-a/{i}".encode()) for i in (3, 4, 5)] + \
                   [("kq-b", i, f"kq-b/{i}".encode()) for i in (1, 2)]
    rows = got(queuePattern="kq-.*", startingOffsets='{"kq-c": -2, "kq-b": 5}')
    assert [(q, s) for q, s, _ in rows] == [("kq-a", i) for i in range(1, 6)] + [("kq-b", 5)] + \
                                         [("kq-c", i) for i in range(1, 6)]
    assert got(queuePattern="no-such-.*") == []
    with pytest.raises(Exception, match="'startingOffsets' cannot be latest for a batch read .* queue 'kq-b'"):
        got(queue="kq-a,kq-b", startingOffsets='{"kq-b": "latest"}')
    assert stats(daemon, "kq-a")["msgDepth"] == 5  # a batch read browses


def progress_offsets(progress: dict, key: str) -> dict:
    value = progress["sources"][0][key]
    return json.loads(value) if isinstance(value, str) else value


def test_streaming_pattern_picks_up_new_queues_and_reports_lag_per_queue(spark: Any, daemon: Daemon, broker: str,
                                                                        tmp_path: Any) -> None:
    """queuePattern is matched against the broker's queues when each
    micro-batch is planned: a matching queue declared while the query runs is
    read from its first message at the next micro-batch. Offsets, commits and
    lag are per queue; failOnDataLoss names the queue."""
    declare(daemon, "pat-a", "pat-out")
    send(daemon, "pat-a", [f"a{i}" for i in range(5)])
    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "100")
    try:
        query = spark.readStream.format("qflow").option("broker", broker).option("queuePattern", "pat-[a-z]") \
            .option("maxMessagesPerTrigger", "4").load().selectExpr("queue", "body") \
            .selectExpr("cast(concat(queue, ':', cast(body as string)) as binary) AS body") \
            .writeStream.format("qflow").option("broker", broker).option("queue", "pat-out") \
            .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="200 milliseconds").start()
        try:
            wait_until(lambda: stats(daemon, "pat-out")["msgDepth"] == 5 or not query.isActive, "pat-a's messages")
            declare(daemon, "pat-b")  # after the query started
            send(daemon, "pat-b", [f"b{i}" for i in range(6)])
            wait_until(lambda: stats(daemon, "pat-out")["msgDepth"] == 11 or not query.isActive, "pat-b's messages")
            wait_until(lambda: stats(daemon, "pat-a")["msgDepth"] + stats(daemon, "pat-b")["msgDepth"] == 0
                       or not query.isActive, "both queues' batches to be committed")
            assert query.isActive, query.exception()
            progress = [p for p in query.recentProgress if p["numInputRows"]]
        finally:
            query.stop()
    finally:
        spark.conf.unset("spark.sql.streaming.noDataProgressEventInterval")
    assert sorted(bodies(daemon, "pat-out")) == sorted([f"pat-a:a{i}".encode() for i in range(5)] +
                                                       [f"pat-b:b{i}".encode() for i in range(6)])
    # Offsets are keyed by queue, each with its own incarnation; "pat-out" does not match.
    last_end = progress_offsets(progress[-1], "endOffset")
    assert set(last_end) == {"pat-a", "pat-b"}
    assert last_end["pat-a"]["incarnation"] == stats(daemon, "pat-a")["incarnation"]
    # Lag per queue: the queue's last sequence number minus the batch's end, in the progress report.
    lags = [{q: v["lag"] for q, v in progress_offsets(p, "latestOffset").items()} for p in progress]
    assert any(lag.get("pat-b", 0) > 0 for lag in lags), lags  # 6 messages, at most 4 per trigger
    assert lags[-1] == {"pat-a": 0, "pat-b": 0}, lags
    # failOnDataLoss names the queue: pat-b deleted and declared again.
    on_broker(daemon, lambda ssn: ssn.delete_queue("pat-b"))
    declare(daemon, "pat-b")
    send(daemon, "pat-b", ["again"])
    failing = spark.readStream.format("qflow").option("broker", broker).option("queuePattern", "pat-[a-z]").load() \
        .select("body").writeStream.format("qflow").option("broker", broker).option("queue", "pat-out") \
        .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start()
    fails_with_data_loss(failing, "pat-b", "read through sequence 6")
    assert stats(daemon, "pat-b")["msgDepth"] == 1


def test_timestamp_column_and_typed_headers_round_trip(spark: Any, daemon: Daemon, broker: str) -> None:
    """The timestamp column is the sender's timestamp property (the Spark
    writer stamps each message with its send time, or its row's timestamp).
    Headers keep their types: a long stays a long, binary stays binary; what
    was read writes back as the same typed properties."""
    declare(daemon, "typed", "typed-copy", "typed-map")
    headers = {"s": "text", "n": 7, "big": -(1 << 40), "f": 1.5, "yes": True, "raw": b"\x00\xff", "none": None,
               "list": [1, "two"]}
    stamp = 1_790_000_000_123

    async def publish(ssn: qflow.Session) -> None:
        sender = ssn.sender("typed", capacity=10)
        await sender.send_with(b"with", {"headers": headers, "timestamp": stamp, "message_id": "m1"})
        await sender.send(b"without")
        await sender.send(b"qpid-send", headers={"ts": stamp * 1_000_000 + 999})  # qflow-send --timestamp yes
        await sender.sync()

    on_broker(daemon, publish)
    rows = {r.body: r for r in read(spark, broker, "typed").selectExpr("*", "unix_millis(timestamp) AS ms").collect()}
    with_ = rows[b"with"]
    assert with_.ms == stamp and with_.timestamp is not None
    h = with_.headers
    assert (h["s"].string, h["n"].long, h["big"].long, h["f"].double, h["yes"].boolean, bytes(h["raw"].binary)) == \
        ("text", 7, -(1 << 40), 1.5, True, b"\x00\xff")
    assert h["none"] is None and json.loads(h["list"].json) == [1, "two"]
    assert h["n"].string is None and h["s"].long is None  # one field per value: its type's
    assert rows[b"without"].ms is None and rows[b"without"].headers is None
    assert rows[b"qpid-send"].ms == stamp  # nanoseconds, as qpid-send's ts
    assert spark.sql("SELECT 1").collect()  # the session is unharmed

    before = int(time.time() * 1000)
    read(spark, broker, "typed").write.format("qflow").option("broker", broker).option("queue", "typed-copy") \
        .mode("append").save()
    after = int(time.time() * 1000)
    copied = {m.body: m for m in browse(daemon, "typed-copy")}
    assert copied[b"qpid-send"].timestamp == stamp
    assert copied[b"with"].headers == headers and copied[b"with"].timestamp == stamp
    assert copied[b"with"].message_id == "m1"
    assert copied[b"without"].headers == {} and before <= copied[b"without"].timestamp <= after  # stamped when sent

    df = spark.createDataFrame([("x", {"count": 3, "total": 40})], "body string, headers map<string,bigint>")
    df.write.format("qflow").option("broker", broker).option("queue", "typed-map").mode("append").save()
    assert browse(daemon, "typed-map")[0].headers == {"count": 3, "total": 40}
    bad = spark.createDataFrame([("x", {"k": [1]})], "body string, headers map<string,array<int>>")
    with pytest.raises(Exception, match="column 'headers' must be a map with string keys and values of one type"):
        bad.write.format("qflow").option("broker", broker).option("queue", "typed-map").mode("append").save()


def test_a_write_batch_shares_one_timestamp_and_its_constant_properties(spark: Any, daemon: Daemon,
                                                                         broker: str) -> None:
    """A batch is one run (send_many with an id each): without a timestamp
    column, its messages carry one send time; a timestamp, headers or
    correlation_id column with one value throughout is the batch's. The reader
    gives them back as the timestamp, headers and queue columns."""
    import datetime

    declare(daemon, "shared-now", "shared-const")
    n = 300  # one Arrow batch of one partition
    df = spark.createDataFrame([(f"row {i}",) for i in range(n)], "body string").coalesce(1)
    before = int(time.time() * 1000)
    df.write.format("qflow").option("broker", broker).option("queue", "shared-now").option("writeId", "w1") \
        .mode("append").save()
    after = int(time.time() * 1000)
    got = browse(daemon, "shared-now")
    assert [m.body for m in got] == [f"row {i}".encode() for i in range(n)]
    assert [m.message_id for m in got] == [f"w1-0-{i}" for i in range(n)]
    stamps = {m.timestamp for m in got}
    assert len(stamps) == 1 and before <= stamps.pop() <= after

    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    const = spark.createDataFrame([(f"row {i}", when, {"src": "orders"}, "c-1") for i in range(n)],
                                  "body string, timestamp timestamp, headers map<string,string>, "
                                  "correlation_id string").coalesce(1)
    const.write.format("qflow").option("broker", broker).option("queue", "shared-const").mode("append").save()
    ms = int(when.timestamp() * 1000)
    got = browse(daemon, "shared-const")
    assert len({m.message_id for m in got}) == n
    assert {(m.timestamp, tuple(m.headers.items()), m.correlation_id) for m in got} == \
        {(ms, (("src", "orders"),), "c-1")}
    rows = read(spark, broker, "shared-const").selectExpr("queue", "unix_millis(timestamp) AS ms",
                                                          "headers['src'].string AS src").distinct().collect()
    assert [(r.queue, r.ms, r.src) for r in rows] == [("shared-const", ms, "orders")]


def broker_clients(port: int) -> set[int]:
    """PIDs of this user's processes with a TCP connection to 127.0.0.1:``port``
    (from /proc: the sockets' inodes, then each process's descriptors)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.add(int(pid))
        except OSError:  # gone, or not ours
            continue
    return pids


def drain_ids(daemon: Daemon, queue: str, n: int, timeout: float = 240) -> list[qflow.ReceivedMessage]:
    """Take messages until ``n`` distinct message ids have come."""
    async def go(ssn: qflow.Session) -> list[qflow.ReceivedMessage]:
        receiver = await ssn.receiver(queue, capacity=10)
        out, ids = [], set()
        with trio.fail_after(timeout):
            while len(ids) < n:
                m = await receiver.fetch()
                out.append(m)
                ids.add(m.message_id)
        await receiver.close()
        return out

    # The whole program within the same time (on_broker's 60 s would cut the wait short).
    return on_broker(daemon, go, timeout=timeout)


def test_batch_write_ids_survive_a_task_retry(spark: Any, daemon: Daemon, broker: str) -> None:
    """Idempotent writes without writeId: a write task is held by a
    flow-stopped queue after sending part of its rows, and its Python worker
    is killed (-9). Spark retries the task, which sends the same message ids
    (write id, partition, row), so a consumer that drops duplicates by id ends
    with each row exactly once."""
    import signal

    declare(daemon, "retry-out", **{"qpid.flow_stop_count": 50, "qpid.flow_resume_count": 40})
    n = 400
    df = spark.createDataFrame([(f"row {i}",) for i in range(n)], "body string").coalesce(1)
    killed: dict[str, Any] = {}

    def kill_the_writer() -> None:
        try:
            wait_until(lambda: stats(daemon, "retry-out")["heldTransfers"] >= 1, "the writer to be held", 120)
            killed["sent"] = stats(daemon, "retry-out")["msgDepth"]
            workers = broker_clients(daemon.port) - {os.getpid(), daemon.proc.pid}
            assert len(workers) == 1, workers  # the held write task's Python worker
            killed["pid"] = workers.pop()
            os.kill(killed["pid"], signal.SIGKILL)
            killed["got"] = drain_ids(daemon, "retry-out", n)
        except BaseException as exc:  # reported below
            killed["error"] = exc

    thread = threading.Thread(target=kill_the_writer, daemon=True)
    thread.start()
    df.write.format("qflow").option("broker", broker).option("queue", "retry-out").option("capacity", "5") \
        .mode("append").save()
    thread.join(timeout=300)
    assert not thread.is_alive() and "error" not in killed, killed
    got = killed["got"] + drain(daemon, "retry-out", stats(daemon, "retry-out")["msgDepth"])
    assert 50 <= killed["sent"] < n  # the first attempt sent part of its rows
    first: dict[str, bytes] = {}
    for m in got:
        assert first.setdefault(m.message_id, m.body) == m.body  # a duplicate is the same message
    assert len(got) >= n + killed["sent"]  # the retry sent every row again
    assert sorted(first.values()) == sorted(f"row {i}".encode() for i in range(n))
    assert len({k.rsplit("-", 2)[0] for k in first}) == 1  # one write: the same id in both attempts
    assert stats(daemon, "retry-out")["msgDepth"] == 0
