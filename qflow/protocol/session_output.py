"""What a broker session says to its peer, written as qflow frames. No I/O.

The broker's model (qflow.broker) decides *what* a session is told:
deliveries of stored entries, command results, exceptions, completed command
ranges, flow notices. This class decides *how*: it encodes each as a qflow
frame into the connection's encoder, and ``wake()`` tells the connection that
there is output. The model calls only the methods below, so a second wire
protocol would hand the broker an object with the same methods and the
broker would not change.

The per-message path is :meth:`SessionOutput.deliveries`: a subscription's
writer takes a batch of stored entries and appends, per entry, the
subscription's cached head and the entry itself (message.deliver), or one
head per frame-sized run of entries (message.deliver-run). The entries are
copied once, when the encoder joins its parts. No frame is larger than the
connection's negotiated frame size: a message that does not fit in one goes
out in message.deliver-part frames, which the client joins.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from qflow.protocol.encodings import deliver_packer, deliver_part_packer, deliver_run_packer
from qflow.protocol.entries import Entry
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameEncoder
from qflow.protocol.spec import COMPLETED, EXCEPTION, FLOW_NOTICE, RESULT

DeliveryWriter = Callable[[int, list[Entry], int], None]


def _nothing() -> None:
    pass


class SessionOutput:
    """One session's output on a qflow connection: frames on ``channel`` into
    ``encoder`` (a fresh one if none, as tests and benchmarks use), ``wake``
    called once per batch that wrote some. ``deliver_runs`` and
    ``max_frame_size`` are what the connection negotiated."""

    __slots__ = ("channel", "encoder", "wake", "deliver_runs", "max_frame_size")

    def __init__(self, channel: int, encoder: FrameEncoder | None = None, wake: Callable[[], None] = _nothing,
                 deliver_runs: bool = False, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.channel = channel
        self.encoder = encoder if encoder is not None else FrameEncoder()
        self.wake = wake
        self.deliver_runs = deliver_runs
        self.max_frame_size = max_frame_size

    def result(self, command_id: int, value: Any) -> None:
        self.encoder.write([RESULT, self.channel, command_id, value])

    def exception(self, command_id: int, code: int, text: str) -> None:
        self.encoder.write([EXCEPTION, self.channel, command_id, code, text])

    def completed(self, report: list[int]) -> None:
        """session.completed with ``report``, the incoming commands' bookkeeping
        (qflow.protocol.commands.IncomingCommands.take_report)."""
        self.encoder.write([COMPLETED, self.channel, report])

    def flow_notice(self, name: str, held: bool, holder: bool = False) -> None:
        """Queue ``name`` (``holder``: the broker-wide holder ``name``) now holds,
        or no longer holds, one of this session's transfers."""
        self.encoder.write([FLOW_NOTICE, self.channel, name, held, True] if holder
                           else [FLOW_NOTICE, self.channel, name, held])

    def take(self) -> bytes:
        """Everything written so far (the encoder's parts, joined)."""
        return self.encoder.take()

    def room(self) -> int:
        """Bytes of deliveries the connection takes before its peer reads
        more: the broker delivers while this is positive (at least one
        message, then up to this many bytes), and holds the rest in the queue."""
        e = self.encoder
        return e.limit - e.queued - e.sending

    def deliveries(self, destination: str) -> DeliveryWriter:
        """The writer of the subscription ``destination``: ``write(first_id,
        entries, size)`` delivers ``entries`` (``size`` bytes in all) with
        delivery ids first_id, first_id+1, ... A message too large for one
        frame goes out in message.deliver-part frames."""
        encoder = self.encoder
        parts = encoder.parts
        part_head, part_size = deliver_part_packer(self.channel, destination)
        part_cap = self.max_frame_size - part_size

        def write_parts(did: int, e: Entry) -> None:
            """One message over as many message.deliver-part frames as it needs."""
            last = len(e) - part_cap
            for i in range(0, len(e), part_cap):
                chunk = e[i:i + part_cap]
                parts.append(part_head(0xCF, did, 0xC3 if i < last else 0xC2, 0xC6, len(chunk)))
                parts.append(chunk)

        if not self.deliver_runs:
            head = deliver_packer(self.channel, destination)
            cap = self.max_frame_size - len(head(0xCF, 0))

            def write(did: int, batch: list[Entry], size: int) -> None:
                encoder.queued += size
                for e in batch:
                    if len(e) <= cap:
                        parts.append(head(0xCF, did))
                        parts.append(e)
                    else:
                        write_parts(did, e)
                    did += 1

            return write
        run_head, size = deliver_run_packer(self.channel, destination)
        cap = self.max_frame_size - size

        def write_runs(did: int, batch: list[Entry], size: int) -> None:
            """As few message.deliver-run frames as the frame size allows."""
            encoder.queued += size
            if size <= cap:
                parts.append(run_head(0xCF, did, 0xCE, len(batch), 0xC6, size))
                parts.extend(batch)
                return
            # A frame takes entries while they fit in cap: one bisection per
            # frame, not a Python step per message.
            ends = [*accumulate(map(len, batch))]
            n = len(ends)
            first = base = 0
            while first < n:
                i = bisect_right(ends, base + cap, first)
                if i == first:  # an entry larger than a frame goes in parts
                    write_parts(did + first, batch[first])
                    i = first + 1
                else:
                    parts.append(run_head(0xCF, did + first, 0xCE, i - first, 0xC6, ends[i - 1] - base))
                    parts.extend(batch[first:i])
                first, base = i, ends[i - 1]

        return write_runs
