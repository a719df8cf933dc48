"""Spark's readers of qflow: what a batch reads is planned on the driver,
exactly, by sequence number; tasks browse it (qflow.spark.browsing); a
streaming batch's messages are removed once Spark has committed it.

A streaming offset holds, per queue, the incarnation, the sequence number
planned through, and the set the batch ending there reads (``read``):
``commit(end)``, which Spark calls once a micro-batch is durable downstream,
removes exactly those with ``queue.remove-sequences``, which releases held
producers exactly as consuming does. Delivery is at least once.
docs/spark.md, "Reading", tells the whole story.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader
from pyspark.sql.types import StructType

import qflow
from qflow.protocol.ranges import RangeSet
from qflow.spark.browsing import data_loss, read_sequences
from qflow.spark.connection import on_session
from qflow.spark.options import Endpoint, QflowOptionError, ReadOptions, parse_broker
from qflow.spark.schema import read_indices
from qflow.spark.sequences import SequenceSet, describe, minus, split_sequences

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


async def _available_many(endpoint: Endpoint, ssn: qflow.Session, asks: list[tuple[str, int, int]]) -> list[dict]:
    out = []
    for queue, after, limit in asks:
        try:
            with trio.fail_after(endpoint.connect_timeout):
                out.append(await ssn.available(queue, after, limit))
        except qflow.NotFound:
            raise QflowOptionError(f"qflow: queue {queue!r} does not exist on the broker at "
                                   f"{endpoint.host}:{endpoint.port} (declare it first)") from None
    return out


def available(endpoint: Endpoint, queue: str, after: int, limit: int) -> dict[str, Any]:
    """The broker's ``queue.available`` of one queue: which messages a read may plan.

    Args:
      endpoint: the broker.
      queue: the queue.
      after: the sequence number after which to look.
      limit: at most this many numbers; -1: all.

    Returns:
      The broker's answer: ``incarnation``, ``sequences`` (a RangeSet),
      ``firstSequence``, ``lastSequence``.

    Raises:
      QflowOptionError: if the queue does not exist.
    """
    return on_session(endpoint, _available_many, [(queue, after, limit)])[0]


async def _list_queues(endpoint: Endpoint, ssn: qflow.Session) -> list[str]:
    with trio.fail_after(endpoint.connect_timeout):
        return await ssn.list_queues()


def resolve_queues(opts: ReadOptions) -> list[str]:
    """The queues a read is of now.

    The ``queue`` list as given, or the broker's queues (those the user may
    access) whose whole name ``queuePattern`` matches, in name order.
    """
    if opts.queues:
        return list(opts.queues)
    return sorted(q for q in on_session(opts.endpoint, _list_queues) if opts.matches(q))


def _partitions(opts: ReadOptions, queue: str, incarnation: str, sequences: RangeSet,
                first_index: int = 0) -> list[SequenceSet]:
    return [SequenceSet(first_index + i, incarnation, part.to_wire(), queue)
            for i, part in enumerate(split_sequences(sequences, opts.num_partitions))]


class _Reader:
    """What the batch and the streaming reader share: the options, the
    columns Spark asks for, and a task's read of its partition."""

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        self.opts = opts
        self.indices = read_indices(schema)

    def read(self, partition: SequenceSet) -> Iterator[Any]:
        return read_sequences(self.opts, partition.queue, partition.incarnation,
                              RangeSet.from_wire(partition.sequences), self.indices)


class QflowBatchReader(_Reader, DataSourceReader):
    """Spark's batch reader: exactly the messages available when the query
    is planned (within the offsets options), browsed; nothing is removed.

    Args:
      opts: the read's options.
      schema: the columns Spark asks for.
    """

    def partitions(self) -> list[SequenceSet]:
        opts = self.opts
        queues = resolve_queues(opts)
        asks = []
        for q in queues:
            starting = opts.starting_for(q)
            if starting == "latest":
                raise QflowOptionError(f"qflow option 'startingOffsets' cannot be latest for a batch read (it "
                                       f"would read nothing of queue {q!r}); use earliest or a sequence number")
            asks.append((q, starting - 1 if isinstance(starting, int) else 0, -1))
        out: list[SequenceSet] = []
        for q, a in zip(queues, on_session(opts.endpoint, _available_many, asks), strict=True):
            sequences = a["sequences"]
            ending = opts.ending_for(q)
            if ending is not None:
                sequences = RangeSet((f, min(b, ending - 1)) for f, b in sequences.ranges() if f < ending)
            out += _partitions(opts, q, a["incarnation"], sequences, len(out))
        return out or [SequenceSet(0, "", [], "")]


def offset(incarnation: str, sequence: int, read: RangeSet | None = None) -> dict:
    """One queue's part of a streaming offset, as JSON.

    Args:
      incarnation: the queue's incarnation the numbers are of.
      sequence: every message numbered through it has been planned.
      read: exactly what the batch that ends here reads of the queue (and
        what its commit removes); None: nothing.
    """
    return {"incarnation": incarnation, "sequence": sequence, "read": read.to_wire() if read else []}


def _shares(total: int, n: int) -> list[int]:
    """``total`` split over ``n`` queues as evenly as can be."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


class QflowStreamReader(_Reader, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's streaming reader: micro-batches planned by sequence number,
    browsed, and removed once Spark has committed them.

    Offsets are ``{queue: offset(...)}``. A batch reads exactly the numbers
    in each queue's ``read``; commit removes exactly those. It takes
    ``maxMessagesPerTrigger`` (shared among the queues) and
    ``Trigger.AvailableNow``.

    Args:
      opts: the read's options.
      schema: the columns Spark asks for.
    """

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        super().__init__(opts, schema)
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow: the last sequence to read, per queue
        self._last: dict | None = None  # for pyspark < 4.2, which passes no start
        self._initial: dict | None = None
        self._latest: dict[str, dict] = {}  # each queue as the last plan saw it, for Spark's progress reports
        self._planned = False  # whether partitions() ran in this reader (this driver) yet

    def _offsets(self, value: dict) -> dict[str, dict]:
        """An offset as {queue: part}. Checkpoints may hold an offset that is
        one part, not keyed by queue: that part is the ``queue`` option's."""
        if "sequence" in value and isinstance(value.get("sequence"), int):
            return {self.opts.queues[0] if self.opts.queues else "": value}
        return value

    def _starting_part(self, queue: str, a: dict) -> dict:
        starting = self.opts.starting_for(queue)
        if starting == "latest":
            through = a["lastSequence"]
        elif starting == "earliest":
            through = a["firstSequence"] - 1
        else:  # a sequence number: the first to read
            through = int(starting) - 1
        return offset(a["incarnation"], through)

    def initialOffset(self) -> dict:
        # Spark may ask again until the first batch is planned: "latest" must
        # stay the point the query started at, or messages sent in between
        # would be skipped.
        if self._initial is None:
            queues = resolve_queues(self.opts)
            heads = on_session(self.opts.endpoint, _available_many, [(q, 0, 0) for q in queues])
            self._initial = {q: self._starting_part(q, a) for q, a in zip(queues, heads, strict=True)}
        return self._initial

    def prepareForTriggerAvailableNow(self) -> None:
        queues = resolve_queues(self.opts)
        heads = on_session(self.opts.endpoint, _available_many, [(q, 0, 0) for q in queues])
        self._target = {q: a["lastSequence"] for q, a in zip(queues, heads, strict=True)}

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        if start is None:  # pyspark < 4.2: no start, no limit
            start = self._last or self.initialOffset()
            max_rows = self.opts.max_per_trigger
        else:
            max_rows = getattr(limit, "max_rows", None) if limit is not None else None
        end = self.plan(start, max_rows)
        self._last = end
        return end

    def plan(self, start: dict, max_rows: int | None) -> dict:
        """The next batch's end offset after ``start``: the first ``max_rows``
        (or all) available messages of each queue (``max_rows`` shared among
        the queues), up to the AvailableNow target."""
        return on_session(self.opts.endpoint, self._plan, self._offsets(start), max_rows)

    async def _plan(self, endpoint: Endpoint, ssn: qflow.Session, start: dict[str, dict],
                    max_rows: int | None) -> dict:
        opts = self.opts
        if opts.queues:
            queues = list(opts.queues)
        else:
            with trio.fail_after(endpoint.connect_timeout):
                queues = sorted(q for q in await ssn.list_queues() if opts.matches(q))
            for gone in sorted(set(start) - set(queues)):
                # A pattern's queue that was deleted: its unread messages (if
                # any) went with it; it is dropped from the offsets.
                log.warning("qflow: queue %r (matched by queuePattern %r) is gone; no longer read", gone,
                            opts.pattern)
        parts = {q: start[q] for q in queues if q in start}
        new = [q for q in queues if q not in start]
        if new:  # a queue the pattern found since the last batch: it starts as startingOffsets says
            heads = await _available_many(endpoint, ssn, [(q, 0, 0) for q in new])
            parts.update((q, self._starting_part(q, h)) for q, h in zip(new, heads, strict=True))
        asks = [(q, int(parts[q]["sequence"]), -1) for q in queues]
        if max_rows is None:
            found = await _available_many(endpoint, ssn, asks)
        else:
            # Admission control over several queues: each queue gets an even
            # share; what a queue leaves unused goes to the others.
            found = await _available_many(endpoint, ssn, [(q, after, share) for (q, after, _), share in
                                                          zip(asks, _shares(max_rows, len(asks)), strict=True)])
            left = max_rows - sum(len(a["sequences"]) for a in found)
            for (q, _, _), a in zip(asks, found, strict=True):
                if left <= 0:
                    break
                if not a["sequences"]:
                    continue
                last = max(b for _, b in a["sequences"].ranges())
                if last >= a["lastSequence"]:
                    continue
                more = (await _available_many(endpoint, ssn, [(q, last, left)]))[0]
                if more["incarnation"] == a["incarnation"]:
                    a["sequences"].update(more["sequences"])
                    left -= len(more["sequences"])
        end: dict[str, dict] = {}
        self._latest = {}
        for (q, _, _), a in zip(asks, found, strict=True):
            end[q] = await self._plan_queue(endpoint, ssn, q, parts[q], a, max_rows)
            self._latest[q] = {"incarnation": a["incarnation"], "sequence": a["lastSequence"]}
        if end == start:
            return start
        return end

    async def _plan_queue(self, endpoint: Endpoint, ssn: qflow.Session, queue: str, start: dict, a: dict,
                          max_rows: int | None) -> dict:
        opts = self.opts
        after = int(start["sequence"])
        incarnation = start.get("incarnation")
        if incarnation is not None and a["incarnation"] != incarnation:
            data_loss(opts, queue, f"the queue is not the one the query's offsets are of (incarnation "
                                   f"{incarnation}, read through sequence {after}): it was deleted and declared "
                                   f"again, or the broker restarted (incarnation {a['incarnation']} now); messages "
                                   f"of the old queue that the query had not read are lost")
            after = 0  # going on: read the new queue from its first message
            limit = -1 if max_rows is None else max(1, len(a["sequences"]))
            a = (await _available_many(endpoint, ssn, [(queue, after, limit)]))[0]
        sequences = a["sequences"]
        target = None if self._target is None else self._target.get(queue, after)
        limit_to = a["lastSequence"] if target is None else min(a["lastSequence"], target)
        if target is not None and sequences and max(b for _, b in sequences.ranges()) > limit_to:
            sequences = RangeSet(r for r in ((f, min(b, limit_to)) for f, b in sequences.ranges()) if r[0] <= r[1])
        if sequences:
            through = max(b for _, b in sequences.ranges())
        else:
            # Nothing to read: but messages numbered after ``after`` that are not
            # available are gone (or held by another consumer) all the same.
            through = max(limit_to, after)
        missing = RangeSet()
        if through > after:
            missing = minus(RangeSet([(after + 1, through)]), sequences)
        if missing:
            data_loss(opts, queue, f"sequences {describe(missing)} after the query's offset {after} are not in "
                                   f"the queue (overwritten by a ring queue, or removed or taken by another "
                                   f"consumer)")
        # Nothing new gives a part with an empty ``read``. If the batch that
        # ended at ``start`` still holds messages, that differs from it: Spark
        # then plans an empty batch, which commits the one before (Spark commits
        # a batch only when it plans the next). Its producers may be held by
        # exactly those messages; without this the query would wait forever.
        return offset(a["incarnation"], through, sequences)

    def reportLatestOffset(self) -> dict | None:
        """Per queue: its last sequence number when the batch was planned, and
        the lag, how many numbers past the batch's end were not planned yet
        (shown as the source's ``latestOffset`` in the query's progress)."""
        if not self._latest or self._last is None:
            return None
        last = self._offsets(self._last)
        return {q: {**latest, "lag": max(0, latest["sequence"] - int(last[q]["sequence"]))}
                for q, latest in self._latest.items() if q in last}

    def partitions(self, start: dict, end: dict) -> list[SequenceSet]:
        if not self._planned:
            self._planned = True
            if start:
                # Spark runs a batch only after the one before it is committed, and tells the source
                # so (commit) while it plans the batch after that. A driver that died between the two
                # left that batch's messages in the queue, before every offset this query will read
                # again: its first batch here removes them (removing is idempotent).
                self.commit(start)
        out: list[SequenceSet] = []
        start_parts = self._offsets(start) if start else {}
        for q, part in sorted(self._offsets(end).items()):
            incarnation = part.get("incarnation")
            if incarnation is None:  # checkpoints may hold parts without one: read what is there
                after = int(start_parts.get(q, {}).get("sequence", 0))
                a = available(self.opts.endpoint, q, after, -1)
                sequences = RangeSet((f, min(b, int(part["sequence"]))) for f, b in a["sequences"].ranges()
                                     if f <= int(part["sequence"]))
                out += _partitions(self.opts, q, a["incarnation"], sequences, len(out))
            else:
                out += _partitions(self.opts, q, incarnation, RangeSet.from_wire(part.get("read", [])), len(out))
        return out

    def commit(self, end: dict) -> None:
        parts = {q: p for q, p in self._offsets(end).items() if p.get("read") and p.get("incarnation")}
        if parts:
            on_session(self.opts.endpoint, _commit, parts)

    def stop(self) -> None:
        pass


async def _commit(endpoint: Endpoint, ssn: qflow.Session, parts: dict[str, dict]) -> None:
    for queue, part in parts.items():
        read = RangeSet.from_wire(part["read"])
        try:
            with trio.fail_after(endpoint.connect_timeout):
                removed = await ssn.remove_sequences(queue, part["incarnation"], read)
        except (qflow.PreconditionFailed, qflow.NotFound) as exc:
            # The queue those numbers belong to is gone: nothing of another one is removed.
            log.warning("qflow: commit of queue %r sequences %s removed nothing: %s", queue, describe(read), exc)
            continue
        log.info("qflow: committed queue %r sequences %s (%d removed)", queue, describe(read), removed)


async def _remove_through(endpoint: Endpoint, ssn: qflow.Session, queue: str, sequence: int) -> int:
    with trio.fail_after(endpoint.connect_timeout):
        return await ssn.remove_through(queue, sequence)


def remove_through(broker: str, queue: str, sequence: int, connect_timeout: float = 10.0,
                   username: str | None = None, password: str | None = None) -> int:
    """Remove every available message of ``queue`` numbered up to and
    including ``sequence``: what a job that read them commits.

    Args:
      broker: ``host:port`` of qflowd, as option ``broker``.
      queue: the queue.
      sequence: the last sequence number to remove.
      connect_timeout: seconds to connect, and for the command.
      username: with ``password``, the user to authenticate as (SCRAM-SHA-256).
      password: the user's password.

    Returns:
      How many messages were removed.

    Raises:
      QflowOptionError: if ``broker`` is malformed.
      ConnectionError: if the broker cannot be reached.
    """
    host, port = parse_broker(broker)
    endpoint = Endpoint(host, port, connect_timeout, username, password)
    return on_session(endpoint, _remove_through, queue, int(sequence))
