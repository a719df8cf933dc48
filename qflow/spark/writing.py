"""Spark's writers to qflow: each task sends its rows as messages and
returns only when the broker has completed every transfer.

A task sends with a capacity window, so broker flow control throttles it:
while a destination's flow is stopped the window stays full and the task
simply waits. Each message gets a deterministic id, ``BATCH-PARTITION-ROW``
(unless its row has a ``message_id``), so a consumer can drop the
duplicates a retried task sends, and a ``timestamp`` property.
docs/spark.md, "Writing", tells the whole story.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import trio
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

import qflow
from qflow.spark.connection import on_session, profiled
from qflow.spark.options import Endpoint, QflowOptionError, WriteOptions
from qflow.spark.schema import HEADER_FIELDS

log = logging.getLogger("qflow.spark")

# Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass
class QflowCommitMessage(WriterCommitMessage):
    """What a writing task tells the driver: its partition, how many
    messages it sent, and the prefix of their ids (``BATCH-PARTITION``)."""

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


def _body_column(column: Any) -> list[bytes]:
    import pyarrow as pa

    values = column.to_pylist()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return [b"" if v is None else v.encode() for v in values]
    return [b"" if v is None else v for v in values]


def _header_from_struct(value: dict[str, Any] | None) -> Any:
    """The value a typed header struct (as qflow reads it) carries: its one field that is set."""
    if value is None:
        return None
    for name in HEADER_FIELDS:
        v = value.get(name)
        if v is not None:
            return json.loads(v) if name == "json" else v
    return None


def _headers_column(column: Any) -> list[dict[str, Any] | None]:
    import pyarrow as pa

    # A map column comes out of Arrow as lists of (key, value) pairs; each
    # value keeps its type (a long stays an integer, binary stays bytes).
    rows = column.to_pylist()
    if pa.types.is_struct(column.type.item_type):
        return [{str(k): _header_from_struct(v) for k, v in pairs} or None if pairs else None for pairs in rows]
    return [{str(k): v for k, v in pairs} or None if pairs else None for pairs in rows]


def _timestamp_column(column: Any, now: int) -> list[int]:
    """Milliseconds since the epoch; a null is ``now``, the time of the send."""
    import pyarrow as pa

    if pa.types.is_timestamp(column.type):
        per_ms = {"s": 0.001, "ms": 1, "us": 1000, "ns": 1_000_000}[column.type.unit]
        return [now if v is None else int(v // per_ms) for v in column.cast(pa.int64()).to_pylist()]
    return [now if v is None else int(v) for v in column.to_pylist()]


async def _send_batches(endpoint: Endpoint, ssn: qflow.Session, opts: WriteOptions, batches: Iterable[Any],
                        id_prefix: str) -> int:
    """Send every row of ``batches`` (Arrow record batches) as a message
    through ``ssn``, each with its row's ``message_id`` or ``ID_PREFIX-ROW``;
    return when the broker has completed them all, with how many there were."""
    # A queue is its own routing key: a routing_key column (say, carried over
    # from a read) must not send the messages elsewhere.
    keyed = not opts.queue
    sender = ssn.sender(opts.address, capacity=opts.capacity, flow_timeout=opts.send_timeout,
                        durable=opts.durable)
    send = sender.send_with
    durable = opts.durable
    n = 0
    for batch in batches:
        # Columns are looked up once per batch, never per row; a column
        # that is null throughout (say, carried over from a read) sets nothing.
        names = batch.schema.names
        bodies = _body_column(batch.column(names.index("body")))
        rows = len(bodies)
        if not rows:
            continue
        column = {name: batch.column(i) for i, name in enumerate(names)
                  if name == "body" or batch.column(i).null_count < rows}
        if "message_id" in column:
            ids = [mid or f"{id_prefix}-{n + i}" for i, mid in enumerate(column["message_id"].to_pylist())]
        else:
            ids = [f"{id_prefix}-{i}" for i in range(n, n + rows)]
        # Every message carries the time it was sent (or its row's
        # timestamp): what a reader's timestamp column shows.
        now = int(time.time() * 1000)
        shared: dict[str, Any] = {"timestamp": now}
        per_row: dict[str, list] = {}
        if "timestamp" in column:
            per_row["timestamp"] = _timestamp_column(column["timestamp"], now)
        if keyed and "routing_key" in column:
            per_row["routing_key"] = column["routing_key"].to_pylist()
        for name in ("correlation_id", "content_type"):
            if name in column:
                per_row[name] = column[name].to_pylist()
        if "headers" in column:
            per_row["headers"] = _headers_column(column["headers"])
        # A value the same in every row is the batch's: the run's shared properties.
        for name in [name for name, values in per_row.items() if values.count(values[0]) == rows]:
            value = per_row.pop(name)[0]
            if value or name in ("timestamp", "routing_key"):
                shared[name] = value
        if not per_row:
            # One run of transfers, an id each (the map's first key) and the rest
            # shared: the broker takes it whole (native/transfers.h).
            await sender.send_many(bodies, message_ids=ids, **shared)
        else:
            # Some property differs per row: one message at a time (docs/spark.md says so).
            keys = per_row.pop("routing_key", None)
            base = {k: v for k, v in shared.items() if k != "routing_key"}
            if durable:
                base["durable"] = True
            key = shared.get("routing_key")
            for i, body in enumerate(bodies):
                props = {"message_id": ids[i], **base}
                for name, values in per_row.items():
                    if values[i] or name == "timestamp":
                        props[name] = values[i]
                await send(body, props, routing_key=key if keys is None else keys[i])
        n += rows
    with trio.fail_after(opts.send_timeout or math.inf):
        await sender.sync()
    return n


async def _check_destination(endpoint: Endpoint, ssn: qflow.Session, opts: WriteOptions) -> None:
    with trio.fail_after(endpoint.connect_timeout):
        if opts.queue:
            await ssn.query_queue(opts.queue)
        else:
            await ssn.declare_exchange(opts.exchange, passive=True)


def check_destination(opts: WriteOptions) -> None:
    """Refuse a write whose queue or exchange does not exist, before any task runs.

    Args:
      opts: the write's options.

    Raises:
      QflowOptionError: naming the destination and the broker.
      ConnectionError: if the broker cannot be reached.
    """
    try:
        on_session(opts.endpoint, _check_destination, opts)
    except qflow.NotFound:
        what = f"queue {opts.queue!r}" if opts.queue else f"exchange {opts.exchange!r}"
        raise QflowOptionError(f"qflow: {what} does not exist on the broker at {opts.endpoint.host}:"
                               f"{opts.endpoint.port} (declare it first)") from None


class _Writer:
    """What the batch and the streaming writer share: a task's ``write``."""

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
        n = profiled(f"write-{self.opts.address}", on_session, self.opts.endpoint, _send_batches, self.opts, iterator,
                     prefix)
        return QflowCommitMessage(partition, n, prefix)

    @staticmethod
    def _total(messages: list[QflowCommitMessage | None]) -> int:
        return sum(m.messages for m in messages if m is not None)


class QflowBatchWriter(_Writer, DataSourceArrowWriter):
    """Spark's batch writer: each task sends its rows and returns when the
    broker has completed them; the ids are ``WRITE_ID-PARTITION-ROW``.

    Args:
      opts: the write's options.
      write_id: the BATCH part of the ids: option ``writeId``, or one chosen
        once per write.
    """

    def commit(self, messages: list[QflowCommitMessage | None]) -> None:
        log.info("qflow: wrote %d messages to %s (write id %s)", self._total(messages), self.opts.address,
                 self.write_id)

    def abort(self, messages: list[QflowCommitMessage | None]) -> None:
        log.warning("qflow: write %s to %s failed; %d messages that completed tasks sent stay on the broker "
                    "(their ids start with %r: drop duplicates by message id)", self.write_id, self.opts.address,
                    self._total(messages), self.write_id)


class QflowStreamWriter(_Writer, DataSourceStreamArrowWriter):
    """Spark's streaming writer: as the batch writer, each micro-batch's ids
    ``QUERY_ID-BATCH_ID-PARTITION-ROW``, the same when Spark replays it.

    Args:
      opts: the write's options.
      write_id: option ``writeId`` (None: the query's and the micro-batch's ids).
    """

    def commit(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.info("qflow: batch %d: wrote %d messages to %s", batchId, self._total(messages), self.opts.address)

    def abort(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.warning("qflow: batch %d to %s failed after %d messages were sent; its retry sends the same "
                    "message ids", batchId, self.opts.address, self._total(messages))

