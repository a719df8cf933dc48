"""Delivered messages: the runs they arrive in, and each message as the
receiver hands it out, read from its run's bytes when asked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from qflow.protocol import DELIVER_RUN
from qflow.protocol.encodings import entry_of_deliver
from qflow.protocol.entries import ENTRY_HEAD_SIZE, REDELIVERED_YES, scan_entries, seq_and_size
from qflow.protocol.framing import FramingError

if TYPE_CHECKING:
    from qflow.client.receiver import Receiver


class _Deliveries:
    """The messages of one message.deliver-run frame: ``count`` stored entries
    back to back in ``blob`` (qflow.protocol.entries), delivery ids ``first_id`` on.
    Scanned once; a message's fields are read out of the blob when asked for."""

    __slots__ = ("receiver", "first_id", "count", "blob", "offsets")

    def __init__(self, receiver: Receiver, frame: list[Any]) -> None:
        if len(frame) != 6 or type(frame[3]) is not int or type(frame[4]) is not int or frame[4] < 1 \
                or type(frame[5]) is not bytes:
            raise FramingError(f"malformed message.deliver-run for {frame[2]!r}")
        self.receiver = receiver
        self.first_id = frame[3]
        self.count = frame[4]
        self.blob = frame[5]
        self.offsets = scan_entries(self.blob, self.count)

    @classmethod
    def of_one(cls, receiver: Receiver, frame: list[Any]) -> _Deliveries:
        """A message.deliver frame (a broker that sends no runs) as a run of one."""
        try:
            did, blob = entry_of_deliver(frame)
        except Exception as exc:  # a wrong field count or type: struct and msgpack say which
            raise FramingError(f"malformed message.deliver: {type(exc).__name__}: {exc}") from None
        return cls(receiver, [DELIVER_RUN, frame[1], frame[2], did, 1, blob])


class _NoDeliveries:
    """Where a receiver starts: a run with nothing left in it."""

    first_id = count = 0


class ReceivedMessage:
    """A delivered message. Its fields are read from the frame that carried it
    when asked for, not copied out for every message; so a message kept alive
    keeps that frame's bytes (up to a frame's size) alive too."""

    __slots__ = ("_run", "_i", "_fields")

    def __init__(self, run: _Deliveries, i: int) -> None:
        self._run = run
        self._i = i

    @property
    def body(self) -> bytes:
        run = self._run
        j = 2 * self._i
        return run.blob[run.offsets[j + 1]:run.offsets[j + 2]]

    @property
    def delivery_id(self) -> int:
        return self._run.first_id + self._i

    @property
    def redelivered(self) -> bool:
        run = self._run
        return run.blob[run.offsets[2 * self._i]] == REDELIVERED_YES

    @property
    def sequence(self) -> int:
        """The message's place in its queue."""
        run = self._run
        return seq_and_size(run.blob, run.offsets[2 * self._i])[0]

    def _decoded(self) -> tuple[str, str, dict[str, Any]]:
        try:
            return self._fields
        except AttributeError:
            run = self._run
            j = 2 * self._i
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            unpacker.feed(run.blob[run.offsets[j] + ENTRY_HEAD_SIZE:run.offsets[j + 1]])
            self._fields = (unpacker.unpack(), unpacker.unpack(), unpacker.unpack() or {})
            return self._fields

    @property
    def exchange(self) -> str:
        return self._decoded()[0]

    @property
    def routing_key(self) -> str:
        return self._decoded()[1]

    @property
    def properties(self) -> dict[str, Any]:
        return self._decoded()[2]

    @property
    def message_id(self) -> str | None:
        return self.properties.get("message_id")

    @property
    def correlation_id(self) -> str | None:
        return self.properties.get("correlation_id")

    @property
    def content_type(self) -> str | None:
        return self.properties.get("content_type")

    @property
    def durable(self) -> bool:
        return bool(self.properties.get("durable", False))

    @property
    def headers(self) -> dict[str, Any]:
        return self.properties.get("headers") or {}

    @property
    def timestamp(self) -> int | None:
        """The sender's ``timestamp`` property: milliseconds since the Unix epoch, or None."""
        return self.properties.get("timestamp")

    def accept(self) -> None:
        self._run.receiver.accept([self])

    def release(self) -> None:
        self._run.receiver.release([self])


def columns(messages: Sequence[ReceivedMessage]) -> tuple[list[bytes], list[str], list[str], list[dict[str, Any]],
                                                        list[int], list[bool]]:
    """Many messages' fields at once, column by column: (bodies, exchanges,
    routing keys, properties, sequence numbers, redelivered flags). For a
    reader that wants every field of every message (a table, a data frame):
    one decoder for all, and messages that share their exchange, routing key
    and properties (a run sent with send_many) decode them once and share the
    properties dict, which the caller must therefore not change."""
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
        run = m._run
        blob = run.blob
        offsets = run.offsets
        j = 2 * m._i
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
