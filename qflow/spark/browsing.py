"""A reading task: browse exactly the sequence numbers its partition was
planned with, and hand them to Spark as Arrow record batches.

Browsing delivers copies and takes nothing, so a task that fails and runs
again reads the same messages. The task follows its numbers with a cursor
(the browser delivers in sequence order): a message costs one comparison.
A planned number that is gone is data loss (option failOnDataLoss).

A task has one connection for its whole life, in a thread of its own; at
most two batches wait for Spark to take them, so its memory is bounded
whatever the size of its range.
"""

from __future__ import annotations

import json
import logging
import queue as _queue
import threading
from collections.abc import Iterator
from typing import Any

import trio

import qflow
from qflow.client.message import arrow_columns
from qflow.protocol.ranges import RangeSet
from qflow.spark.connection import open_session, profiled
from qflow.spark.options import ReadOptions
from qflow.spark.schema import COLUMNS, QUEUE_COLUMN, TIMESTAMP_COLUMN, arrow_types
from qflow.spark.sequences import describe, intersect, minus

log = logging.getLogger("qflow.spark")


class QflowDataLossError(RuntimeError):
    """Messages a read planned, or should have planned, are gone (option failOnDataLoss)."""


def data_loss(opts: ReadOptions, queue: str, what: str) -> None:
    """Report messages of ``queue`` that a read should have and has not.

    With failOnDataLoss=true (the default) the read fails; with false, the
    loss is logged as a warning and the read goes on.

    Args:
      opts: the read's options.
      queue: the queue the messages were of.
      what: which messages, and why they are gone, for people.

    Raises:
      QflowDataLossError: with failOnDataLoss=true, naming the queue and ``what``.
    """
    text = f"qflow: data loss on queue {queue!r}: {what}"
    if opts.fail_on_data_loss:
        raise QflowDataLossError(text + ". Set option failOnDataLoss=false to log such losses and go on.")
    log.warning("%s; going on (failOnDataLoss=false)", text)


POLL = 0.2  # seconds a reading task waits for its next message before asking the broker what is left
# Rows per Arrow batch a reading task hands to Spark: the first batch is small, so
# that the first rows come soon; each next one is 4 times larger, up to BATCH_ROWS
# (Spark's cost per batch is a fifth of the rows' at 4096 rows of 64 bytes, measured
# with a source of pre-built batches) ...
FIRST_BATCH_ROWS = 1024
BATCH_ROWS = 32768
BATCH_BYTES = 4 << 20  # ... or fewer, once their bodies reach this many bytes
READ_CAPACITY = 2000  # a reading task's credit window (messages in flight to it)


class _Columns:
    """One Arrow batch's worth of messages, as the Arrow arrays
    qflow.client.message.arrow_columns makes of each fetch."""

    __slots__ = ("chunks", "nbytes", "queue", "rows")

    def __init__(self, queue: str) -> None:
        self.chunks: list[tuple] = []
        self.nbytes = 0
        self.rows = 0
        self.queue = queue

    def __len__(self) -> int:
        return self.rows

    def add(self, messages: list[qflow.ReceivedMessage]) -> None:
        if not messages:
            return
        chunk = arrow_columns(messages)
        self.chunks.append(chunk)
        self.nbytes += chunk[0].nbytes
        self.rows += len(chunk[0])

    def batch(self, indices: list[int] | None) -> Any:
        import pyarrow as pa

        types = arrow_types()
        which = range(len(COLUMNS)) if indices is None else indices
        columns = []
        for i in which:
            if i == QUEUE_COLUMN:  # one value for the whole batch: the queue it was read from
                columns.append(pa.repeat(pa.scalar(self.queue, types[i]), self.rows))
                continue
            parts = [_column(i, chunk, types[i]) for chunk in self.chunks]
            columns.append(parts[0] if len(parts) == 1 else pa.concat_arrays(parts))
        return pa.RecordBatch.from_arrays(columns, names=[COLUMNS[i] for i in which])


def _column(i: int, chunk: tuple, type_: Any) -> Any:
    """Column ``i`` (of COLUMNS) of one arrow_columns chunk."""
    import pyarrow as pa

    bodies, seqs, redelivered, index, heads = chunk
    if i == 0:
        return bodies
    if i == 7:
        return seqs
    if i == 8:
        return redelivered
    values = pa.array([_FROM_HEAD[i](h) for h in heads], type_)
    if len(heads) > 1:
        return values.take(index)
    return pa.repeat(values[0], len(index)) if values[0].is_valid else pa.nulls(len(index), type_)


def _timestamp(props: dict) -> int | None:
    """The message's time in milliseconds: its ``timestamp`` property, else
    the ``ts`` header qflow-send --timestamp yes (as qpid-send) puts in,
    nanoseconds since the epoch."""
    stamp = props.get("timestamp")
    if stamp is None:
        headers = props.get("headers")
        ts = headers.get("ts") if headers else None
        if type(ts) is int and ts >= 0:
            return ts // 1_000_000
    return stamp


_INT64 = range(-(1 << 63), 1 << 63)


def _timestamp_us(props: dict) -> int | None:
    """The message's time as Spark's timestamp column holds it (microseconds, UTC)."""
    ms = _timestamp(props)
    return None if ms is None else ms * 1000


# Where each column comes from: a message's own array (body, sequence, redelivered), the
# queue read (_Columns.batch), or the message's head: (exchange, routing key, properties).
_FROM_HEAD = {1: lambda h: h[1], 2: lambda h: h[0], 3: lambda h: h[2].get("message_id"),
              4: lambda h: h[2].get("correlation_id"), 5: lambda h: h[2].get("content_type"),
              6: lambda h: _typed_headers(h[2].get("headers")), TIMESTAMP_COLUMN: lambda h: _timestamp_us(h[2])}


def header_value(value: Any) -> dict[str, Any] | None:
    """A header's value as the ``headers`` column's struct.

    The struct's field named by the value's type is set. None stays null;
    lists and maps, and integers beyond 64 bits, are JSON text (bytes in
    them as hex).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return {"boolean": value}
    if isinstance(value, int):
        return {"long": value} if value in _INT64 else {"json": str(value)}
    if isinstance(value, float):
        return {"double": value}
    if isinstance(value, str):
        return {"string": value}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"binary": bytes(value)}
    return {"json": json.dumps(value, default=lambda v: bytes(v).hex() if isinstance(v, (bytes, bytearray))
                               else str(v))}


def _typed_headers(headers: dict | None) -> list[tuple[str, dict[str, Any] | None]] | None:
    if not headers:
        return None
    return [(str(k), header_value(v)) for k, v in headers.items()]


async def _browse_wanted(opts: ReadOptions, ssn: qflow.Session, queue: str, incarnation: str, wanted: RangeSet,
                         emit: Any) -> RangeSet:
    """Browse exactly the messages numbered in ``wanted`` of ``incarnation`` of
    ``queue``, handing them to ``emit`` in batches. Returns the wanted numbers that are gone."""
    with trio.fail_after(opts.endpoint.connect_timeout):
        head = await ssn.available(queue, 0, 0)
    if head["incarnation"] != incarnation:
        return wanted
    pending = wanted
    gone = RangeSet()
    rows = FIRST_BATCH_ROWS
    while pending:
        ranges = list(pending.ranges())
        n = len(ranges)
        start, last = ranges[0][0], ranges[-1][1]
        with trio.fail_after(opts.endpoint.connect_timeout):
            receiver = await ssn.receiver(queue, browse=True, start_sequence=start,
                                          capacity=max(1, min(len(pending), READ_CAPACITY)))
        # A cursor over the wanted numbers: the browser delivers in sequence
        # order, so each message is compared with the next wanted number only.
        ri = 0
        nxt, hi = ranges[0]
        skipped = RangeSet()  # wanted numbers the browser went past: gone, or held by another consumer
        cols = _Columns(queue)
        while ri < n:
            try:
                delivered = await receiver.fetch_many(timeout=POLL)
            except qflow.Empty:
                break
            first_seq, last_seq = delivered[0].sequence, delivered[-1].sequence
            if first_seq == nxt and last_seq <= hi and last_seq - first_seq == len(delivered) - 1:
                # The usual case: all of them, the next wanted numbers in a row.
                cols.add(delivered)
                nxt = last_seq + 1
                if nxt > hi:
                    ri += 1
                    if ri < n:
                        nxt, hi = ranges[ri]
                if len(cols) >= rows or cols.nbytes >= BATCH_BYTES:
                    await emit(cols)
                    cols = _Columns(queue)
                    rows = min(4 * rows, BATCH_ROWS)
                continue
            taken: list[qflow.ReceivedMessage] = []
            for m in delivered:
                seq = m.sequence
                if seq < nxt:
                    continue
                while seq > hi:
                    skipped.add_range(nxt, hi)
                    ri += 1
                    if ri == n:
                        break
                    nxt, hi = ranges[ri]
                if ri == n:
                    break
                if seq < nxt:
                    continue
                if seq > nxt:
                    skipped.add_range(nxt, seq - 1)
                taken.append(m)
                nxt = seq + 1
                if nxt > hi:
                    ri += 1
                    if ri == n:
                        break
                    nxt, hi = ranges[ri]
            cols.add(taken)
            if len(cols) >= rows or cols.nbytes >= BATCH_BYTES:
                await emit(cols)
                cols = _Columns(queue)
                rows = min(4 * rows, BATCH_ROWS)
        if len(cols):
            await emit(cols)
        if ri < n:  # nothing more came: the rest of the wanted numbers are not here (yet)
            skipped.add_range(nxt, hi)
            for r in ranges[ri + 1:]:
                skipped.add_range(*r)
        with trio.fail_after(opts.endpoint.connect_timeout):
            await receiver.close()
        if not skipped:
            break
        # Ask which of them are still there. A message another consumer held
        # while the browser passed and has since released is behind the
        # browser's cursor: browse again from the first such one. The others are gone.
        with trio.fail_after(opts.endpoint.connect_timeout):
            now = await ssn.available(queue, start - 1, last - start + 1)
        if now["incarnation"] != incarnation:
            gone.update(skipped)
            break
        pending = intersect(skipped, now["sequences"])
        gone.update(minus(skipped, now["sequences"]))
    return gone


async def _read_task(opts: ReadOptions, queue: str, incarnation: str, sequences: RangeSet,
                     indices: list[int] | None, put: Any) -> None:
    """A reading task's one connection: every message numbered in ``sequences``,
    as Arrow batches handed to ``put`` (blocking, in a thread: memory stays
    bounded by what Spark has not taken yet)."""
    async def emit(cols: _Columns) -> None:
        await trio.to_thread.run_sync(put, cols.batch(indices))

    async with open_session(opts.endpoint) as ssn:
        try:
            gone = await _browse_wanted(opts, ssn, queue, incarnation, sequences, emit)
        except qflow.NotFound:  # the queue was deleted under the read
            gone = sequences
    if gone:
        data_loss(opts, queue, f"sequences {describe(gone)}, planned for this read, are no longer in the queue "
                               f"(overwritten by a ring queue, removed or taken by another consumer, or the "
                               f"queue was deleted: incarnation {incarnation})")


_DONE = object()


def read_sequences(opts: ReadOptions, queue_name: str, incarnation: str, sequences: RangeSet,
                   indices: list[int] | None = None) -> Iterator[Any]:
    """Every message numbered in ``sequences`` of a queue, as Arrow record batches.

    One connection for the whole task, run by a thread of its own: at most
    two batches wait for Spark to take them. When Spark stops taking them
    (a limit, a failure), the thread ends.

    Args:
      opts: the read's options.
      queue_name: the queue.
      incarnation: the queue's incarnation the numbers are of.
      sequences: the numbers to read.
      indices: the columns to give (schema.read_indices); None: all of them.

    Raises:
      QflowDataLossError: if a planned message is gone (failOnDataLoss=true).
      ConnectionError: if the broker cannot be reached (connection.open_session).
    """
    if not sequences:
        return
    handoff: _queue.Queue = _queue.Queue(maxsize=2)
    stop = threading.Event()

    def hand_over(item: Any) -> bool:
        """Put ``item`` in the hand-off; False if Spark stopped taking items first."""
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.5)  # a timeout, so that a stop is seen while Spark takes nothing
                return True
            except _queue.Full:
                continue
        return False

    def put(item: Any) -> None:
        if not hand_over(item):
            raise _Stopped()

    def run() -> None:
        try:
            profiled(f"read-{queue_name}", trio.run, _read_task, opts, queue_name, incarnation, sequences, indices,
                     put)
            result: Any = _DONE
        except _Stopped:
            return
        except BaseException as exc:  # handed to the task's thread, which raises it
            result = exc
        hand_over(result)

    thread = threading.Thread(target=run, name=f"qflow-read-{queue_name}", daemon=True)
    thread.start()
    try:
        while True:
            item = handoff.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=opts.endpoint.connect_timeout + 5)


class _Stopped(Exception):
    """Spark stopped taking a task's rows (a limit, a failure): the reader thread ends."""

