"""qflow as a PySpark Python data source (pyspark >= 4.0): batch and streaming, read and write.

    from qflow.spark import register
    register(spark)
    df = spark.read.format("qflow").option("broker", "127.0.0.1:5672").option("queue", "orders").load()
    df.write.format("qflow").option("queue", "copy").mode("append").save()

Reading browses: it delivers copies of a range of sequence numbers and takes
nothing, so a Spark task that fails and runs again reads the same messages.
The streaming source's offsets are those sequence numbers; ``commit(end)``
(which Spark calls once a micro-batch is durable downstream) removes every
message through ``end`` with ``queue.remove-through``, which releases held
producers exactly as consuming does. Delivery is at least once.

Writing sends with a capacity window, so broker flow control throttles the
Spark task, which then simply waits; the task returns only when every
transfer is complete. Each message gets a deterministic id,
``BATCH-PARTITION-ROW``, so a consumer can drop the duplicates a retried task
sends.

Everything held by the classes here pickles: a task opens its own connection
inside ``read``/``write`` (a short ``trio.run`` per call) and closes it before
returning.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

import qflow

try:  # pyspark >= 4.2: admission control and Trigger.AvailableNow for Python sources
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - pyspark 4.0/4.1
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

log = logging.getLogger("qflow.spark")

FORMAT = "qflow"
SCHEMA = ("body binary, routing_key string, exchange string, message_id string, correlation_id string, "
          "content_type string, headers map<string,string>, sequence long, redelivered boolean")
COLUMNS = ("body", "routing_key", "exchange", "message_id", "correlation_id", "content_type", "headers",
           "sequence", "redelivered")

# Columns a written DataFrame may carry: the first five set the message; the
# rest are ignored, so that what was read can be written back unchanged.
WRITE_COLUMNS = ("body", "routing_key", "message_id", "correlation_id", "content_type", "headers")
IGNORED_WRITE_COLUMNS = ("exchange", "sequence", "redelivered")

DEFAULT_BROKER = "127.0.0.1:5672"
DEFAULT_CAPACITY = 1000
MAX_PARTITIONS = 8  # default split of a range: one partition per ...
MESSAGES_PER_PARTITION = 10_000  # ... this many messages, at most MAX_PARTITIONS
CHUNK = 5000  # messages browsed per connection while a task reads its range

# Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


class QflowOptionError(ValueError):
    """A qflow data source option is missing or malformed."""


# -- options --------------------------------------------------------------------
def _lower(options: Mapping[str, str]) -> dict[str, str]:
    # Spark hands the options over with lower-cased keys; lower them again in
    # case a caller builds the source directly.
    return {str(k).lower(): str(v) for k, v in dict(options).items()}


def parse_broker(value: str) -> tuple[str, int]:
    """``host:port``, ``[v6-address]:port`` or ``host`` (port 5672)."""
    text = value.strip()
    if not text:
        raise QflowOptionError("qflow option 'broker' is empty: use host:port, e.g. 127.0.0.1:5672")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise QflowOptionError(f"qflow option 'broker' {value!r} is not [address]:port")
        port_text = rest[1:] if rest else "5672"
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise QflowOptionError(f"qflow option 'broker' {value!r}: write an IPv6 address as [address]:port")
    else:
        host, port_text = text, "5672"
    if not host:
        raise QflowOptionError(f"qflow option 'broker' {value!r} has no host")
    try:
        port = int(port_text)
    except ValueError:
        raise QflowOptionError(f"qflow option 'broker' {value!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise QflowOptionError(f"qflow option 'broker' {value!r}: port must be 1..65535")
    return host, port


def _int(opts: dict[str, str], key: str, name: str, default: int | None, minimum: int) -> int | None:
    if key not in opts:
        return default
    try:
        value = int(opts[key].strip())
    except ValueError:
        raise QflowOptionError(f"qflow option '{name}' must be an integer, not {opts[key]!r}") from None
    if value < minimum:
        raise QflowOptionError(f"qflow option '{name}' must be at least {minimum}, not {value}")
    return value


def _float(opts: dict[str, str], key: str, name: str, default: float | None) -> float | None:
    if key not in opts:
        return default
    text = opts[key].strip().lower()
    if text in ("", "none", "inf", "infinite", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise QflowOptionError(f"qflow option '{name}' must be a number of seconds, not {opts[key]!r}") from None
    if not value > 0 or math.isinf(value):
        return None
    return value


def _bool(opts: dict[str, str], key: str, name: str, default: bool) -> bool:
    if key not in opts:
        return default
    text = opts[key].strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise QflowOptionError(f"qflow option '{name}' must be true or false, not {opts[key]!r}")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    connect_timeout: float
    username: str | None = None  # with password: SCRAM-SHA-256, for a broker with --auth yes
    password: str | None = field(default=None, repr=False)  # never in a plan or a log

    @classmethod
    def parse(cls, opts: dict[str, str]) -> Endpoint:
        host, port = parse_broker(opts.get("broker", DEFAULT_BROKER))
        timeout = _float(opts, "connecttimeout", "connectTimeout", 10.0) or 10.0
        username, password = opts.get("username"), opts.get("password")
        if (username is None) != (password is None):
            raise QflowOptionError("qflow options 'username' and 'password' go together: give both or neither")
        if username is not None and not username:
            raise QflowOptionError("qflow option 'username' is empty")
        return cls(host, port, timeout, username, password)

    async def connect(self) -> qflow.client.Connection:
        credentials = {} if self.username is None else {"username": self.username, "password": self.password}
        try:
            with trio.fail_after(self.connect_timeout):
                return await qflow.connect(self.host, self.port, name="qflow.spark", **credentials)
        except trio.TooSlowError:
            raise ConnectionError(f"qflow: no answer from the broker at {self.host}:{self.port} "
                                  f"within {self.connect_timeout:g} s (option connectTimeout)") from None
        except OSError as exc:
            raise ConnectionError(f"qflow: cannot connect to the broker at {self.host}:{self.port} "
                                  f"(option broker): {exc}") from None


@dataclass(frozen=True)
class ReadOptions:
    endpoint: Endpoint
    queue: str
    num_partitions: int | None
    max_per_trigger: int | None
    consume: bool
    starting: str
    idle_timeout: float

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        opts = _lower(options)
        queue = opts.get("queue", "").strip()
        if not queue:
            raise QflowOptionError("qflow: reading needs option 'queue' (the queue to read)")
        starting = opts.get("startingoffsets", "earliest").strip().lower()
        if starting not in ("earliest", "latest"):
            raise QflowOptionError(f"qflow option 'startingOffsets' must be earliest or latest, not {starting!r}")
        return cls(
            endpoint=Endpoint.parse(opts),
            queue=queue,
            num_partitions=_int(opts, "numpartitions", "numPartitions", None, 1),
            max_per_trigger=_int(opts, "maxmessagespertrigger", "maxMessagesPerTrigger", None, 1),
            consume=_bool(opts, "consume", "consume", False),
            starting=starting,
            idle_timeout=_float(opts, "readidletimeout", "readIdleTimeout", 10.0) or 10.0,
        )


@dataclass(frozen=True)
class WriteOptions:
    endpoint: Endpoint
    queue: str
    exchange: str
    routing_key: str
    capacity: int
    send_timeout: float | None
    write_id: str | None

    @property
    def address(self) -> str:
        return self.queue if self.queue else f"{self.exchange}/{self.routing_key}"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        opts = _lower(options)
        queue = opts.get("queue", "").strip()
        exchange = opts.get("exchange", "").strip()
        routing_key = opts.get("routingkey", "")
        if queue and exchange:
            raise QflowOptionError("qflow: give either option 'queue' or option 'exchange' (with 'routingKey'), "
                                   "not both")
        if not queue and not exchange:
            raise QflowOptionError("qflow: writing needs option 'queue', or 'exchange' (with 'routingKey' or a "
                                   "routing_key column)")
        if queue and routing_key:
            raise QflowOptionError("qflow option 'routingKey' goes with 'exchange'; a 'queue' is its own key")
        if "/" in exchange:
            raise QflowOptionError(f"qflow option 'exchange' {exchange!r} must not contain '/'")
        return cls(
            endpoint=Endpoint.parse(opts),
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            capacity=_int(opts, "capacity", "capacity", DEFAULT_CAPACITY, 1),
            send_timeout=_float(opts, "sendtimeout", "sendTimeout", None),
            write_id=opts.get("writeid") or None,
        )


def _check_write_schema(schema: StructType) -> None:
    names = [f.name for f in schema.fields]
    by_name = dict(zip(names, schema.fields, strict=True))
    if "body" not in by_name:
        raise QflowOptionError(f"qflow: the DataFrame to write needs a 'body' column (binary or string); "
                               f"it has {names}")
    unknown = [n for n in names if n not in WRITE_COLUMNS + IGNORED_WRITE_COLUMNS]
    if unknown:
        raise QflowOptionError(f"qflow: cannot write columns {unknown}: a message is written from 'body' and "
                               f"optional {list(WRITE_COLUMNS[1:])} (select or rename the columns first)")
    if not isinstance(by_name["body"].dataType, (BinaryType, StringType)):
        raise QflowOptionError(f"qflow: column 'body' must be binary or string, not "
                               f"{by_name['body'].dataType.simpleString()}")
    for name in ("routing_key", "message_id", "correlation_id", "content_type"):
        if name in by_name and not isinstance(by_name[name].dataType, StringType):
            raise QflowOptionError(f"qflow: column {name!r} must be a string, not "
                                   f"{by_name[name].dataType.simpleString()}")
    if "headers" in by_name:
        t = by_name["headers"].dataType
        if not (isinstance(t, MapType) and isinstance(t.keyType, StringType)):
            raise QflowOptionError(f"qflow: column 'headers' must be a map with string keys, "
                                   f"not {t.simpleString()}")


def _run(fn: Any, *args: Any) -> Any:
    """Run one short trio program: the connector's every broker conversation."""
    return trio.run(fn, *args)


async def _stats(endpoint: Endpoint, queue: str) -> dict[str, Any]:
    conn = await endpoint.connect()
    try:
        with trio.fail_after(endpoint.connect_timeout):
            ssn = await conn.session()
            return await ssn.query_queue(queue)
    finally:
        await conn.close()


def queue_stats(endpoint: Endpoint, queue: str) -> dict[str, Any]:
    try:
        return _run(_stats, endpoint, queue)
    except qflow.NotFound:
        raise QflowOptionError(f"qflow: queue {queue!r} does not exist on the broker at "
                               f"{endpoint.host}:{endpoint.port} (declare it first)") from None


async def _remove_through(endpoint: Endpoint, queue: str, sequence: int) -> int:
    conn = await endpoint.connect()
    try:
        with trio.fail_after(endpoint.connect_timeout):
            ssn = await conn.session()
            return await ssn.remove_through(queue, sequence)
    finally:
        await conn.close()


def remove_through(broker: str, queue: str, sequence: int, connect_timeout: float = 10.0,
                   username: str | None = None, password: str | None = None) -> int:
    """Remove every available message of ``queue`` with a sequence number up
    to and including ``sequence`` (what a job that read them commits)."""
    host, port = parse_broker(broker)
    return _run(_remove_through, Endpoint(host, port, connect_timeout, username, password), queue, int(sequence))


# -- reading ----------------------------------------------------------------------
class SequenceRange(InputPartition):
    """Sequence numbers ``first`` through ``last`` (inclusive) of one queue."""

    def __init__(self, index: int, first: int, last: int) -> None:
        self.index = index
        self.first = first
        self.last = last

    def __repr__(self) -> str:
        return f"SequenceRange({self.index}, {self.first}..{self.last})"


def split_range(first: int, last: int, parts: int | None) -> list[SequenceRange]:
    """Split ``first..last`` into ``parts`` contiguous ranges (default: one per
    MESSAGES_PER_PARTITION messages, at most MAX_PARTITIONS)."""
    n = last - first + 1
    if n <= 0:
        return []
    if parts is None:
        parts = min(MAX_PARTITIONS, math.ceil(n / MESSAGES_PER_PARTITION))
    parts = max(1, min(parts, n))
    out = []
    start = first
    for i in range(parts):
        size = n // parts + (1 if i < n % parts else 0)
        out.append(SequenceRange(i, start, start + size - 1))
        start += size
    return out


def _row(m: qflow.ReceivedMessage) -> tuple:
    headers = m.headers
    if headers:
        headers = {str(k): (v if v is None or isinstance(v, str) else str(v)) for k, v in headers.items()}
    else:
        headers = None
    return (m.body, m.routing_key, m.exchange, m.message_id, m.correlation_id, m.content_type, headers,
            m.sequence, bool(m.redelivered))


async def _browse_chunk(opts: ReadOptions, start: int, last: int, limit: int) -> tuple[list[tuple], int, bool]:
    """Browse ``opts.queue`` from sequence ``start``: up to ``limit`` messages
    with sequences up to ``last``. Returns (rows, next start, whether the
    range is finished)."""
    rows: list[tuple] = []
    conn = await opts.endpoint.connect()
    try:
        capacity = max(1, min(limit, last - start + 1, 1000))
        with trio.fail_after(opts.endpoint.connect_timeout):
            ssn = await conn.session()
            receiver = await ssn.receiver(opts.queue, browse=True, start_sequence=start, capacity=capacity)
        quiet = 0.0
        poll = min(0.5, opts.idle_timeout)
        while len(rows) < limit:
            try:
                m = await receiver.fetch(timeout=poll)
            except qflow.Empty:
                # Nothing more came. Either the rest of the range is gone
                # (removed by someone else, or dropped by a ring queue) or it
                # is late; the statistics can prove the first case.
                with trio.fail_after(opts.endpoint.connect_timeout):
                    st = await ssn.query_queue(opts.queue)
                if st["msgDepth"] == 0 or st["firstSequence"] > last:
                    return rows, last + 1, True
                quiet += poll
                if quiet >= opts.idle_timeout:
                    log.warning("qflow: queue %r: no message from sequence %d through %d arrived in %.0f s; "
                                "taking them as removed (option readIdleTimeout)", opts.queue, start, last, quiet)
                    return rows, last + 1, True
                continue
            quiet = 0.0
            if m.sequence > last:
                return rows, last + 1, True
            rows.append(_row(m))
            start = m.sequence + 1
            if m.sequence >= last:
                return rows, last + 1, True
        return rows, start, False
    finally:
        await conn.close()


def read_range(opts: ReadOptions, first: int, last: int, indices: list[int] | None = None) -> Iterator[tuple]:
    """Every available message with a sequence in ``first..last``, in order,
    browsed a chunk per connection so memory stays bounded."""
    start = first
    while start <= last:
        rows, start, done = _run(_browse_chunk, opts, start, last, CHUNK)
        if indices is None:
            yield from rows
        else:
            for r in rows:
                yield tuple(r[i] for i in indices)
        if done:
            break


def _indices(schema: StructType) -> list[int] | None:
    names = [f.name.lower() for f in schema.fields]
    if tuple(names) == COLUMNS:
        return None
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise QflowOptionError(f"qflow: unknown columns {unknown} in the read schema; qflow provides {SCHEMA}")
    return [COLUMNS.index(n) for n in names]


class QflowBatchReader(DataSourceReader):
    """Reads what is in the queue at planning time, by browsing."""

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        self.opts = opts
        self.indices = _indices(schema)

    def partitions(self) -> list[SequenceRange]:
        st = queue_stats(self.opts.endpoint, self.opts.queue)
        # consume=true reads one partition: removing through the end of a range
        # removes everything before it too, which another task may be reading.
        parts = split_range(st["firstSequence"], st["lastSequence"],
                            1 if self.opts.consume else self.opts.num_partitions)
        return parts or [SequenceRange(0, 1, 0)]  # an empty range: no rows

    def read(self, partition: SequenceRange) -> Iterator[tuple]:
        yield from read_range(self.opts, partition.first, partition.last, self.indices)
        if self.opts.consume and partition.last >= partition.first:
            # Spark's batch reader has no job-commit hook: remove the range once
            # the task has handed over every row of it (not if it stopped early).
            _run(_remove_through, self.opts.endpoint, self.opts.queue, partition.last)


class QflowStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{"sequence": N}``: everything through N has been planned."""

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        self.opts = opts
        self.indices = _indices(schema)
        self._target: int | None = None  # Trigger.AvailableNow: the last sequence to read
        self._last_end: int | None = None  # for pyspark < 4.2, which passes no start

    def initialOffset(self) -> dict:
        st = queue_stats(self.opts.endpoint, self.opts.queue)
        if self.opts.starting == "latest":
            return {"sequence": st["lastSequence"]}
        return {"sequence": st["firstSequence"] - 1}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = queue_stats(self.opts.endpoint, self.opts.queue)["lastSequence"]

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        st = queue_stats(self.opts.endpoint, self.opts.queue)
        latest = st["lastSequence"]
        if self._target is not None:
            latest = min(latest, self._target)
        if start is None:  # pyspark < 4.2: no start, no limit; apply maxMessagesPerTrigger here
            begin = max(self._last_end or 0, st["firstSequence"] - 1)
            max_rows = self.opts.max_per_trigger
        else:
            begin = int(start["sequence"])
            max_rows = getattr(limit, "max_rows", None) if limit is not None else None
        if latest < begin:
            # The queue was deleted and declared again: sequences restarted.
            log.warning("qflow: queue %r last sequence %d is behind the offset %d; waiting for new messages",
                        self.opts.queue, latest, begin)
            latest = begin
        end = latest if max_rows is None else min(latest, begin + max_rows)
        self._last_end = end
        return {"sequence": end}

    def partitions(self, start: dict, end: dict) -> list[SequenceRange]:
        return split_range(int(start["sequence"]) + 1, int(end["sequence"]), self.opts.num_partitions)

    def read(self, partition: SequenceRange) -> Iterator[tuple]:
        return read_range(self.opts, partition.first, partition.last, self.indices)

    def commit(self, end: dict) -> None:
        removed = _run(_remove_through, self.opts.endpoint, self.opts.queue, int(end["sequence"]))
        log.info("qflow: committed queue %r through sequence %s (%d removed)", self.opts.queue, end["sequence"],
                 removed)

    def stop(self) -> None:
        pass


# -- writing ----------------------------------------------------------------------
@dataclass
class QflowCommitMessage(WriterCommitMessage):
    partition: int
    messages: int
    id_prefix: str


def _task() -> tuple[int, str | None, str | None]:
    """(partition id, streaming batch id, streaming query id) of the running task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, None, None
    return ctx.partitionId(), ctx.getLocalProperty(BATCH_ID_PROPERTY), ctx.getLocalProperty(QUERY_ID_PROPERTY)


def _get(row: Any, name: str) -> Any:
    try:
        return row[name]
    except (KeyError, ValueError, IndexError):
        return None


async def _send_rows(opts: WriteOptions, rows: Iterable[Any], id_prefix: str) -> int:
    # A queue is its own routing key: a routing_key column (say, carried over
    # from a read) must not send the messages elsewhere.
    keyed = not opts.queue
    conn = await opts.endpoint.connect()
    try:
        with trio.fail_after(opts.endpoint.connect_timeout):
            ssn = await conn.session()
        sender = ssn.sender(opts.address, capacity=opts.capacity, flow_timeout=opts.send_timeout)
        n = 0
        for row in rows:
            body = _get(row, "body")
            if body is None:
                body = b""
            elif type(body) is not bytes:
                body = body.encode() if isinstance(body, str) else bytes(body)
            message_id = _get(row, "message_id") or f"{id_prefix}-{n}"
            headers = _get(row, "headers")
            if headers:
                headers = {str(k): v for k, v in dict(headers).items() if v is not None}
            await sender.send(body, routing_key=_get(row, "routing_key") if keyed else None, message_id=message_id,
                              correlation_id=_get(row, "correlation_id"), content_type=_get(row, "content_type"),
                              headers=headers or None)
            n += 1
            if n % 256 == 0:
                await trio.lowlevel.checkpoint()  # let the connection write and read
        with trio.fail_after(opts.send_timeout or math.inf):
            await sender.sync()
        return n
    finally:
        await conn.close()


async def _check_destination(opts: WriteOptions) -> None:
    conn = await opts.endpoint.connect()
    try:
        with trio.fail_after(opts.endpoint.connect_timeout):
            ssn = await conn.session()
            if opts.queue:
                await ssn.query_queue(opts.queue)
            else:
                await ssn.declare_exchange(opts.exchange, passive=True)
    finally:
        await conn.close()


def check_destination(opts: WriteOptions) -> None:
    try:
        _run(_check_destination, opts)
    except qflow.NotFound:
        what = f"queue {opts.queue!r}" if opts.queue else f"exchange {opts.exchange!r}"
        raise QflowOptionError(f"qflow: {what} does not exist on the broker at {opts.endpoint.host}:"
                               f"{opts.endpoint.port} (declare it first)") from None


class _Writer:
    def __init__(self, opts: WriteOptions, write_id: str | None) -> None:
        self.opts = opts
        self.write_id = write_id

    def _batch(self) -> tuple[int, str]:
        """(partition, the BATCH part of the ids): the write id of a batch
        write; QUERY-ID-BATCH-ID for a micro-batch, the same when it is replayed."""
        partition, batch_id, query_id = _task()
        if self.write_id is not None:
            return partition, self.write_id
        if batch_id is not None:
            return partition, f"{query_id}-{batch_id}" if query_id else batch_id
        return partition, "0"

    def write(self, iterator: Iterator[Any]) -> QflowCommitMessage:
        partition, batch = self._batch()
        prefix = f"{batch}-{partition}"
        n = _run(_send_rows, self.opts, iterator, prefix)
        return QflowCommitMessage(partition, n, prefix)

    @staticmethod
    def _total(messages: list[QflowCommitMessage | None]) -> int:
        return sum(m.messages for m in messages if m is not None)


class QflowBatchWriter(_Writer, DataSourceWriter):
    def commit(self, messages: list[QflowCommitMessage | None]) -> None:
        log.info("qflow: wrote %d messages to %s (write id %s)", self._total(messages), self.opts.address,
                 self.write_id)

    def abort(self, messages: list[QflowCommitMessage | None]) -> None:
        log.warning("qflow: write %s to %s failed; %d messages that completed tasks sent stay on the broker "
                    "(their ids start with %r: drop duplicates by message id)", self.write_id, self.opts.address,
                    self._total(messages), self.write_id)


class QflowStreamWriter(_Writer, DataSourceStreamWriter):
    def commit(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.info("qflow: batch %d: wrote %d messages to %s", batchId, self._total(messages), self.opts.address)

    def abort(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.warning("qflow: batch %d to %s failed after %d messages were sent; its retry sends the same "
                    "message ids", batchId, self.opts.address, self._total(messages))


# -- the data source ---------------------------------------------------------------
def _append_only(overwrite: bool, streaming: bool) -> None:
    if overwrite:
        if streaming:
            raise QflowOptionError("qflow: a queue cannot be truncated, so outputMode('complete') is not "
                                   "supported; use outputMode('append') (Spark itself refuses 'update' for "
                                   "Python data sources)")
        raise QflowOptionError("qflow: a queue cannot be overwritten; mode('append') is the supported save mode")


class QflowDataSource(DataSource):
    """``format("qflow")``: a qflow queue as a Spark source and sink."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> QflowBatchReader:
        return QflowBatchReader(ReadOptions.parse(self.options), schema)

    def streamReader(self, schema: StructType) -> QflowStreamReader:
        opts = ReadOptions.parse(self.options)
        if opts.consume:
            raise QflowOptionError("qflow: option 'consume' is for batch reads; a streaming read removes what it "
                                   "read when Spark commits each micro-batch")
        return QflowStreamReader(opts, schema)

    def writer(self, schema: StructType, overwrite: bool) -> QflowBatchWriter:
        _append_only(overwrite, streaming=False)
        _check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowBatchWriter(opts, opts.write_id or uuid.uuid4().hex[:12])

    def streamWriter(self, schema: StructType, overwrite: bool) -> QflowStreamWriter:
        _append_only(overwrite, streaming=True)
        _check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowStreamWriter(opts, opts.write_id)


def register(spark: Any) -> None:
    """Make ``format("qflow")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(QflowDataSource)
