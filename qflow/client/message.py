"""Delivered messages: the runs they arrive in, and each message as the
receiver hands it out, read from its run's bytes when asked.

The bottom of the client: it imports no other module of it. A run knows its
receiver only as a :class:`Settler`, what accepts and releases messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgpack

from qflow.protocol import DELIVER_RUN
from qflow.protocol.encodings import entry_of_deliver
from qflow.protocol.entries import ENTRY_HEAD_SIZE, REDELIVERED_YES, scan_entries, seq_and_size
from qflow.protocol.framing import FramingError


class Settler(Protocol):
    """What settles delivered messages: the receiver they came by
    (:class:`qflow.client.Receiver` is one)."""

    def accept(self, messages: list[ReceivedMessage]) -> None: ...

    def release(self, messages: list[ReceivedMessage]) -> None: ...


class Deliveries:
    """The messages of one message.deliver-run frame: ``count`` stored
    entries back to back in ``blob`` (qflow.protocol.entries), delivery ids
    ``first_id`` on, settled through ``receiver``.

    The entries are scanned once, here; a message's fields are read out of
    the blob when asked for.

    Args:
      receiver: what accepts and releases these messages (a Receiver; None
        where nothing will settle them).
      frame: the decoded message.deliver-run frame.

    Raises:
      FramingError: if the frame is not a well-formed message.deliver-run.
      EntryError: if its entries are not ``count`` well-formed stored entries.
    """

    __slots__ = ("receiver", "first_id", "count", "blob", "offsets")

    def __init__(self, receiver: Settler | None, frame: list[Any]) -> None:
        if len(frame) != 6 or type(frame[3]) is not int or type(frame[4]) is not int or frame[4] < 1 \
                or type(frame[5]) is not bytes:
            raise FramingError(f"malformed message.deliver-run for {frame[2]!r}")
        self.receiver = receiver
        self.first_id = frame[3]
        self.count = frame[4]
        self.blob = frame[5]
        self.offsets = scan_entries(self.blob, self.count)

    @classmethod
    def of_one(cls, receiver: Settler | None, frame: list[Any]) -> Deliveries:
        """A message.deliver frame (from a broker that sends no runs) as a run of one.

        Raises:
          FramingError: if the frame is not a well-formed message.deliver.
        """
        try:
            did, blob = entry_of_deliver(frame)
        except Exception as exc:  # a wrong field count or type: struct and msgpack say which
            raise FramingError(f"malformed message.deliver: {type(exc).__name__}: {exc}") from None
        return cls(receiver, [DELIVER_RUN, frame[1], frame[2], did, 1, blob])


class NoDeliveries:
    """An empty run: where a receiver starts, with nothing left to fetch."""

    first_id = count = 0


class ReceivedMessage:
    """A message a receiver delivered: its body, its place in its queue and
    the fields its sender gave it.

    Its fields are read from the frame that carried it when asked for, not
    copied out for every message; so a message kept alive keeps that frame's
    bytes (up to a frame's size) alive too. To keep a few of many messages
    for long, keep their ``body`` and the fields needed instead.

    ``run`` and ``index`` say where those bytes are: the :class:`Deliveries`
    it arrived in and its place there. The receiver sets them; they are not
    for applications.
    """

    __slots__ = ("run", "index", "_fields")

    def __init__(self, run: Deliveries, index: int) -> None:
        self.run = run
        self.index = index

    @property
    def body(self) -> bytes:
        """The message's body."""
        run = self.run
        j = 2 * self.index
        return run.blob[run.offsets[j + 1]:run.offsets[j + 2]]

    @property
    def delivery_id(self) -> int:
        """The delivery's id on its session: what accepting or releasing it names."""
        return self.run.first_id + self.index

    @property
    def redelivered(self) -> bool:
        """Whether the broker delivered it before (it was released, or its
        consumer went) without its being accepted."""
        run = self.run
        return run.blob[run.offsets[2 * self.index]] == REDELIVERED_YES

    @property
    def sequence(self) -> int:
        """The message's sequence number: its place in its queue (what
        ``start_sequence`` and ``Session.remove_through`` count in)."""
        run = self.run
        return seq_and_size(run.blob, run.offsets[2 * self.index])[0]

    def _decoded(self) -> tuple[str, str, dict[str, Any]]:
        try:
            return self._fields
        except AttributeError:
            run = self.run
            j = 2 * self.index
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            unpacker.feed(run.blob[run.offsets[j] + ENTRY_HEAD_SIZE:run.offsets[j + 1]])
            self._fields = (unpacker.unpack(), unpacker.unpack(), unpacker.unpack() or {})
            return self._fields

    @property
    def exchange(self) -> str:
        """The exchange it was sent to (``""``: the default exchange)."""
        return self._decoded()[0]

    @property
    def routing_key(self) -> str:
        """The routing key it was sent with."""
        return self._decoded()[1]

    @property
    def properties(self) -> dict[str, Any]:
        """Its transfer's properties map (``message_id``, ``durable``,
        ``headers``, ...); ``{}`` when it has none."""
        return self._decoded()[2]

    @property
    def message_id(self) -> str | None:
        """The sender's ``message_id``, or None."""
        return self.properties.get("message_id")

    @property
    def correlation_id(self) -> str | None:
        """The sender's ``correlation_id``, or None."""
        return self.properties.get("correlation_id")

    @property
    def content_type(self) -> str | None:
        """The sender's ``content_type``, or None."""
        return self.properties.get("content_type")

    @property
    def durable(self) -> bool:
        """Whether it is persistent: kept across a broker restart on a durable queue."""
        return bool(self.properties.get("durable", False))

    @property
    def headers(self) -> dict[str, Any]:
        """The sender's application headers (``{}`` when none)."""
        return self.properties.get("headers") or {}

    @property
    def timestamp(self) -> int | None:
        """The sender's ``timestamp`` property: milliseconds since the Unix epoch, or None."""
        return self.properties.get("timestamp")

    def accept(self) -> None:
        """Accept it: the broker removes it from its queue. For a receiver
        with ``accept="explicit"``; as ``receiver.accept([message])``."""
        self.run.receiver.accept([self])

    def release(self) -> None:
        """Release it: the broker puts it back in its place in the queue,
        marked redelivered, for a consumer to take again; as
        ``receiver.release([message])``."""
        self.run.receiver.release([self])


def columns(messages: Sequence[ReceivedMessage]) -> tuple[list[bytes], list[str], list[str], list[dict[str, Any]],
                                                        list[int], list[bool]]:
    """Many messages' fields at once, column by column: (bodies, exchanges,
    routing keys, properties, sequence numbers, redelivered flags). For a
    reader that wants every field of every message (a table, a data frame):
    one decoder for all, and messages that share their exchange, routing key
    and properties (a run sent with send_many) decode them once and share the
    properties dict, which the caller must therefore not change.

    Args:
      messages: received messages, from any receivers.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    bodies: list[bytes] = []
    exchanges: list[str] = []
    keys: list[str] = []
    props: list[dict[str, Any]] = []
    seqs: list[int] = []
    redelivered: list[bool] = []
    last_head = None
    fields: tuple[str, str, dict[str, Any]] = ("", "", {})
    for m in messages:
        run = m.run
        blob = run.blob
        offsets = run.offsets
        j = 2 * m.index
        start = offsets[j]
        end_head = offsets[j + 1]
        bodies.append(blob[end_head:offsets[j + 2]])
        head = blob[start + ENTRY_HEAD_SIZE:end_head]
        if head != last_head:
            before = unpacker.tell()
            unpacker.feed(head)
            fields = (unpacker.unpack(), unpacker.unpack(), unpacker.unpack() or {})
            # What is left of the slice is the body's bin header: drop it.
            unpacker.read_bytes(len(head) - (unpacker.tell() - before))
            last_head = head
        exchanges.append(fields[0])
        keys.append(fields[1])
        props.append(fields[2])
        seqs.append(seq_and_size(blob, start)[0])
        redelivered.append(blob[start] == REDELIVERED_YES)
    return bodies, exchanges, keys, props, seqs, redelivered


def _slices(messages: Sequence[ReceivedMessage]) -> list[tuple[Deliveries, int, int]]:
    """``messages`` as (run, first, end) slices of consecutive messages of one run."""
    if not messages:
        return []
    first, last = messages[0], messages[-1]
    if first.run is last.run and last.index - first.index == len(messages) - 1:  # the usual case: one slice
        return [(first.run, first.index, last.index + 1)]
    out: list[tuple[Deliveries, int, int]] = []
    run, start, end = first.run, first.index, first.index
    for m in messages:
        if m.run is run and m.index == end:
            end += 1
        else:
            out.append((run, start, end))
            run, start, end = m.run, m.index, m.index + 1
    out.append((run, start, end))
    return out


_EVEN_ODD: dict[int, tuple[Any, Any]] = {}


def _even_odd(n: int) -> tuple[Any, Any]:
    """Arrow index arrays 0, 2, ... and 1, 3, ... of ``n`` each (cached: runs repeat their lengths)."""
    pair = _EVEN_ODD.get(n)
    if pair is None:
        import pyarrow as pa

        if len(_EVEN_ODD) > 64:
            _EVEN_ODD.clear()
        pair = _EVEN_ODD[n] = (pa.array(range(0, 2 * n, 2), pa.int32()), pa.array(range(1, 2 * n, 2), pa.int32()))
    return pair


_ARANGE: list[Any] = []


def _numbers(first: int, n: int) -> Any:
    """An Arrow int64 array first, first + 1, ... of ``n`` (from a cached 0, 1, ...:
    converting a range costs as much per number as the rest of a message's columns)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not _ARANGE or len(_ARANGE[0]) < n:
        _ARANGE[:] = [pa.array(range(max(n, 1 << 16)), pa.int64())]
    return pc.add(_ARANGE[0].slice(0, n), pa.scalar(first, pa.int64()))


def arrow_columns(messages: Sequence[ReceivedMessage]) -> tuple[Any, Any, Any, Any, list[tuple[str, str,
                                                                                              dict[str, Any]]]]:
    """:func:`columns` as pyarrow arrays, for a reader that makes Arrow record
    batches (the Spark data source): ``(bodies, sequences, redelivered,
    head_index, heads)``, where message i's exchange, routing key and
    properties are ``heads[head_index[i]]`` (each distinct head decoded once).
    Built from the runs' bytes by Arrow, with no Python work per message for
    messages that arrived in order and share their head (a run sent with
    send_many). Needs pyarrow.

    Args:
      messages: received messages, from any receivers.

    Raises:
      ImportError: pyarrow is not installed.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    bodies, seqs, redelivered, index = [], [], [], []
    heads: list[tuple[str, str, dict[str, Any]]] = []
    known: dict[bytes, int] = {}
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    binary, int32 = pa.binary(), pa.int32()
    for run, i, j in _slices(messages):
        n = j - i
        blob, offsets = run.blob, run.offsets
        # One binary array over the run's bytes whose elements alternate: entry head
        # (with the body's bin header), body, entry head, body...
        both = pa.Array.from_buffers(binary, 2 * n, [None, pa.array(offsets[2 * i:2 * j + 1], int32).buffers()[1],
                                                     pa.py_buffer(blob)])
        even, odd = _even_odd(n)
        bodies.append(both.take(odd))
        entry_heads = both.take(even)
        first, last = seq_and_size(blob, offsets[2 * i])[0], seq_and_size(blob, offsets[2 * j - 2])[0]
        if last - first == n - 1:  # consecutive sequence numbers: the usual case
            seqs.append(_numbers(first, n))
        else:
            seqs.append(pa.array([seq_and_size(blob, offsets[2 * k])[0] for k in range(i, j)], pa.int64()))
        redelivered.append(pc.starts_with(entry_heads, pattern=b"\xc3"))
        # The fields after the entry's head, with the body's bin header (whose length differs
        # only for bodies of other sizes), one per distinct value.
        # (stop given: pyarrow 26's binary_slice without one miscounts its output's size)
        encoded = pc.dictionary_encode(pc.binary_slice(entry_heads, ENTRY_HEAD_SIZE, len(blob) + 1))
        remap = []
        for head in encoded.dictionary.to_pylist():
            k = known.get(head)
            if k is None:
                unpacker.feed(head)
                k = known[head] = len(heads)
                heads.append((unpacker.unpack(), unpacker.unpack(), unpacker.unpack() or {}))
                unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)  # the bin header is left in it
            remap.append(k)
        index.append(pa.array(remap, int32).take(encoded.indices))
    if not bodies:
        return (pa.array([], binary), pa.array([], pa.int64()), pa.array([], pa.bool_()), pa.array([], int32), heads)
    if len(bodies) == 1:
        return bodies[0], seqs[0], redelivered[0], index[0], heads
    return (pa.concat_arrays(bodies), pa.concat_arrays(seqs), pa.concat_arrays(redelivered),
            pa.concat_arrays(index), heads)
