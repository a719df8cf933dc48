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
copied once, when the encoder joins its parts.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from qflow.protocol.encodings import deliver_packer, deliver_run_packer
from qflow.protocol.entries import Entry
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, FrameEncoder
from qflow.protocol.spec import COMPLETED, EXCEPTION, FLOW_NOTICE, RESULT

DeliveryWriter = Callable[[int, list[Entry]], None]


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

    def flow_notice(self, queue: str, held: bool) -> None:
        """``queue`` now holds (or no longer holds) one of this session's transfers."""
        self.encoder.write([FLOW_NOTICE, self.channel, queue, held])

    def take(self) -> bytes:
        """Everything written so far (the encoder's parts, joined)."""
        return self.encoder.take()

    def deliveries(self, destination: str) -> DeliveryWriter:
        """The writer of the subscription ``destination``: ``write(first_id,
        entries)`` delivers ``entries`` with delivery ids first_id, first_id+1, ..."""
        parts = self.encoder.parts
        if not self.deliver_runs:
            head = deliver_packer(self.channel, destination)

            def write(did: int, batch: list[Entry]) -> None:
                for e in batch:
                    parts.append(head(0xCF, did))
                    parts.append(e)
                    did += 1

            return write
        run_head, size = deliver_run_packer(self.channel, destination)
        cap = self.max_frame_size - size

        def write_runs(did: int, batch: list[Entry]) -> None:
            """As few message.deliver-run frames as the frame size allows."""
            size = sum(map(len, batch))
            if size <= cap:
                parts.append(run_head(0xCF, did, 0xCE, len(batch), 0xC6, size))
                parts.extend(batch)
                return
            # A frame takes entries while they fit in cap, and at least one: one
            # bisection per frame, not a Python step per message.
            ends = [*accumulate(map(len, batch))]
            n = len(ends)
            first = base = 0
            while first < n:
                i = bisect_right(ends, base + cap, first)
                if i == first:  # an entry larger than cap goes alone
                    i = first + 1
                parts.append(run_head(0xCF, did + first, 0xCE, i - first, 0xC6, ends[i - 1] - base))
                parts.extend(batch[first:i])
                first, base = i, ends[i - 1]

        return write_runs
