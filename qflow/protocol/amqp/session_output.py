"""What the broker tells AMQP 1.0 links, as 1.0 frames: the second kind of
session output (qflow.protocol.session_output is the first). No I/O.

The broker model does not change for 1.0. It tells a session what happened
through the session's output: completions, refusals, flow notices and
deliveries. Two outputs turn that into 1.0 frames, written through the
connection core (:class:`.connection.Connection`):

* :class:`SendingLinkOutput`, for the broker's session of one link a peer
  sends on. A transfer's completion is its settlement: ``accepted`` and
  settled once every holder of its completion has let go (a stopped queue,
  the memory alarm, the store until it is on disk), ``rejected`` with the
  broker's refusal. The same holders withhold the link's credit: while any
  of them holds one of the link's transfers, no credit is granted; once
  none does, the link gets its window back, less what is still incomplete.
* :class:`ReceivingSessionOutput`, for the broker's session of the links of
  one 1.0 session that a peer receives on: deliveries, as transfers.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from qflow.protocol.entries import Entry, seq_and_size

from .connection import Connection
from .entries import amqp_payload, native_extension, stored_forms
from .frames import ACCEPTED_STATE, TRANSFER_OVERHEAD
from .performatives import Error, Rejected

# The AMQP error condition of each broker refusal (qflow.protocol.spec codes; 530, NOT_ALLOWED, is what
# the ACL refuses with).
_CONDITIONS = {404: "amqp:not-found", 405: "amqp:resource-locked", 406: "amqp:precondition-failed",
               408: "amqp:resource-deleted", 409: "amqp:illegal-state", 501: "amqp:decode-error",
               503: "amqp:invalid-field", 506: "amqp:resource-limit-exceeded", 530: "amqp:unauthorized-access",
               540: "amqp:not-implemented", 541: "amqp:internal-error", 542: "amqp:invalid-field"}

_tag = struct.Struct(">Q").pack
_NATIVE = native_extension()
_frames: FrameWriter | None = None  # set below when the extension is built


def condition_of(code: int) -> str:
    """The AMQP error condition for a broker refusal ``code``."""
    return _CONDITIONS.get(code, "amqp:internal-error")


def rejected_state(code: int, text: str) -> bytes:
    """The encoded ``rejected`` outcome for a broker refusal."""
    return bytes(Rejected(error=Error(condition=condition_of(code), description=text)).encode())


def _nothing() -> None:
    pass


class OutputRoom:
    """The bytes of deliveries one connection has written and its peer not
    yet read: what ``room()`` is measured against (the glue takes them off
    as it sends)."""

    __slots__ = ("limit", "queued", "sending")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0  # written since the glue last took the output
        self.sending = 0  # taken by the glue and not yet sent


class SendingLinkOutput:
    """The output of the broker's session for one link a peer sends on.

    Args:
      core: the connection core.
      channel, handle: the link's.
      window: the most transfers the link may have incomplete or in credit at once.
      incomplete: the number of the link's transfers not complete yet (the
        broker session's ``commands.incomplete_count``).
      wake: called when there is output to send.
    """

    __slots__ = ("core", "channel", "handle", "window", "incomplete", "wake", "unsettled", "refused", "holders",
                 "closed")

    def __init__(self, core: Connection, channel: int, handle: int, window: int, incomplete: Callable[[], int],
                 wake: Callable[[], None] = _nothing) -> None:
        self.core = core
        self.channel = channel
        self.handle = handle
        self.window = window
        self.incomplete = incomplete
        self.wake = wake
        self.unsettled: dict[int, int] = {}  # command id -> delivery-id, of the deliveries awaiting their outcome
        self.refused: dict[int, bytes] = {}  # command id -> its rejected outcome
        self.holders: dict[str, None] = {}  # who holds one of its transfers now (queues, named holders)
        self.closed = False

    def received(self, command_id: int, delivery_id: int) -> None:
        """Transfer ``command_id`` of the broker's session was the unsettled delivery ``delivery_id``."""
        self.unsettled[command_id] = delivery_id

    def completed(self, report: list[int]) -> None:
        """The broker completed the commands of ``report`` (wire ranges): their
        deliveries are settled, accepted or rejected, by ranges of consecutive
        delivery-ids with one outcome."""
        if self.closed:
            return
        unsettled, refused = self.unsettled, self.refused
        core, channel = self.core, self.channel
        first = last = -1
        state = ACCEPTED_STATE
        for i in range(0, len(report), 2):
            for cid in range(report[i], report[i + 1] + 1):
                did = unsettled.pop(cid, None)
                outcome = refused.pop(cid, ACCEPTED_STATE) if refused else ACCEPTED_STATE
                if did is None:  # pre-settled: no outcome to send
                    continue
                if first >= 0 and did == last + 1 and outcome is state:
                    last = did
                    continue
                if first >= 0:
                    core.disposition(channel, first, last, settled=True, state=state)
                first = last = did
                state = outcome
        if first >= 0:
            core.disposition(channel, first, last, settled=True, state=state)
        self.top_up()

    def top_up(self) -> None:
        """Grant credit up to the window, less the transfers still incomplete,
        unless something holds one of the link's transfers now. Sent only when
        it gives back at least a quarter of the window, or when the peer has none."""
        if self.holders or self.closed:
            return
        credit = self.window - self.incomplete()
        current = self.core.link_credit(self.channel, self.handle)
        if credit > current and (current <= 0 or credit - current >= self.window // 4):
            self.core.flow(self.channel, self.handle, credit)
            self.wake()

    def exception(self, command_id: int, code: int, text: str) -> None:
        """The broker refused transfer ``command_id``: it is settled as rejected."""
        self.refused[command_id] = rejected_state(code, text)

    def flow_notice(self, name: str, held: bool, holder: bool = False) -> None:
        """``name`` now holds one of the link's transfers, or no longer any."""
        if held:
            self.holders[name] = None
        else:
            self.holders.pop(name, None)
            if not self.holders:
                self.top_up()

    def result(self, command_id: int, value: Any) -> None:
        """A link's transfers have no results."""

    def room(self) -> int:
        return 1 << 30  # nothing is delivered to a sending link


class FrameWriter:
    """Transfer frames for a batch of stored 1.0 messages, written in C
    (native/amqp_transfers.h, ``qa_write_transfers``); the other way of
    :meth:`ReceivingSessionOutput.deliveries` (``amqp_payload`` and
    :meth:`.Connection.transfer_many`) is its Python twin."""

    __slots__ = ("_out", "_written", "_consumed")

    CAPACITY = 1 << 20

    def __init__(self) -> None:
        ffi = _NATIVE[0]
        self._out = ffi.new("uint8_t[]", self.CAPACITY)
        self._written = ffi.new("size_t *")
        self._consumed = ffi.new("size_t *")

    def write(self, core: Connection, channel: int, handle: int, first_tag: int, batch: list[Entry], settled: bool,
              queued: int) -> tuple[int, int]:
        """Send the longest head of ``batch`` it takes as transfers on the link
        (their tags ``first_tag``, ``first_tag`` + 1 ...); returns how many, and
        ``queued`` plus their payloads' bytes."""
        ffi, lib = _NATIVE
        blob = b"".join(batch)
        plain, durable = stored_forms()
        n = lib.qa_write_transfers(ffi.from_buffer(blob), len(blob), plain, len(plain), durable, len(durable),
                                   channel, handle, core.next_delivery_id(channel), first_tag, settled,
                                   core.peer_max_frame_size, self._out, self.CAPACITY, self._written, self._consumed)
        if n:
            written = self._written[0]
            core.transfers_written(channel, handle, n, ffi.buffer(self._out, written)[:])
            queued += written - 41 * n  # the payloads' bytes, as the other way counts them
        return n, queued


class ReceivingSessionOutput:
    """The output of the broker's session for the links of one 1.0 session
    that a peer receives on.

    A consumer's destination is its link's handle, as a string (``str(handle)``).
    The broker numbers its deliveries on the session; the 1.0 delivery-ids
    are the core's, kept beside them for the deliveries awaiting an outcome.
    """

    __slots__ = ("core", "channel", "room_left", "wake", "presettled", "delivery_ids", "failures")

    def __init__(self, core: Connection, channel: int, room: OutputRoom, wake: Callable[[], None] = _nothing) -> None:
        self.core = core
        self.channel = channel
        self.room_left = room
        self.wake = wake
        self.presettled: dict[str, bool] = {}  # destination -> whether its deliveries go settled
        # destination -> its queue's delivery failures by sequence number (Queue.delivery_failures)
        self.failures: dict[str, dict[int, int]] = {}
        # 1.0 delivery-id -> (the broker's delivery id, the destination), of those awaiting an outcome
        self.delivery_ids: dict[int, tuple[int, str]] = {}

    def deliveries(self, destination: str) -> Callable[[int, list[Entry], int], None]:
        """The writer of the link ``destination``: ``write(first_id, entries,
        size)`` sends ``entries`` as transfers (the broker's delivery ids
        first_id, first_id+1, ...)."""
        core, channel, handle = self.core, self.channel, int(destination)
        settled = self.presettled.get(destination, False)
        delivery_ids = self.delivery_ids
        room = self.room_left
        failures = self.failures.get(destination, {})

        def write(did: int, batch: list[Entry], size: int) -> None:
            if not failures and _frames is not None:
                # 1.0 messages as they were stored: their frames written in C, in one go. Any other entry
                # (redelivered, a qflow message to map...) ends the run and goes the way below.
                taken, room.queued = _frames.write(core, channel, handle, did, batch, settled, room.queued)
                if taken:
                    if not settled:
                        first = (core.next_delivery_id(channel) - taken) & 0xFFFFFFFF
                        for i in range(taken):
                            delivery_ids[(first + i) & 0xFFFFFFFF] = (did + i, destination)
                    if taken == len(batch):
                        return
                    did += taken
                    batch = batch[taken:]
            if failures:
                payloads = [amqp_payload(e, failures.get(seq_and_size(e)[0], 0)) for e in batch]
            else:
                payloads = [amqp_payload(e) for e in batch]
            tags = [_tag(did + i) for i in range(len(batch))]
            room.queued += sum(map(len, payloads))
            fits = core.peer_max_frame_size - TRANSFER_OVERHEAD - 32
            if max(map(len, payloads)) <= fits:
                first = core.transfer_many(channel, handle, payloads, tags, settled=settled)
                if not settled:
                    for i in range(len(batch)):
                        delivery_ids[(first + i) & 0xFFFFFFFF] = (did + i, destination)
                return
            for i, (payload, tag) in enumerate(zip(payloads, tags, strict=True)):
                amqp_id = core.transfer(channel, handle, payload, delivery_tag=tag, settled=settled)
                if not settled:
                    delivery_ids[amqp_id] = (did + i, destination)

        return write

    def take(self, first: int, last: int) -> list[int]:
        """The broker's delivery ids of the 1.0 deliveries ``first``..``last``
        awaiting an outcome (forgotten now: the peer gave it)."""
        ids = self.delivery_ids
        if not ids:
            return []
        span = (last - first) & 0xFFFFFFFF
        if span < len(ids):  # walk the range
            keys = [(first + i) & 0xFFFFFFFF for i in range(span + 1)]
        else:  # a range wider than what is kept: walk what is kept
            keys = sorted((k for k in ids if (k - first) & 0xFFFFFFFF <= span), key=lambda k: (k - first) & 0xFFFFFFFF)
        taken = []
        for key in keys:
            held = ids.pop(key, None)
            if held is not None:
                taken.append(held[0])
        return taken

    def forget(self, destination: str) -> list[int]:
        """The broker's delivery ids of ``destination``'s deliveries awaiting an
        outcome (its link is gone: they go back to their queues)."""
        ids = self.delivery_ids
        gone = [amqp_id for amqp_id, (_, dest) in ids.items() if dest == destination]
        return [ids.pop(amqp_id)[0] for amqp_id in gone]

    def room(self) -> int:
        """Bytes of deliveries the connection takes before its peer reads more."""
        r = self.room_left
        return r.limit - r.queued - r.sending

    def completed(self, report: list[int]) -> None:
        """A receiving session sends no commands: nothing to settle."""

    def exception(self, command_id: int, code: int, text: str) -> None:
        """A receiving session sends no commands."""

    def result(self, command_id: int, value: Any) -> None:
        """A receiving session sends no commands."""

    def flow_notice(self, name: str, held: bool, holder: bool = False) -> None:
        """A receiving session has no transfers to hold."""


if _NATIVE is not None:
    _frames = FrameWriter()
