"""A message too large for one frame, joined again. No I/O.

The broker sends a message whose delivery would exceed the negotiated frame
size as message.deliver-part frames (docs/protocol.md): the chunks of one
delivery, in order, with ``more`` false on the last, never interleaved with
another delivery's parts. Joined, they are the message's stored entry, so
the joined message is handed on as a message.deliver-run of one.
"""

from __future__ import annotations

from typing import Any

from qflow.protocol.framing import FrameTooLarge, FramingError
from qflow.protocol.spec import DELIVER_RUN

MAX_JOINED = 256 * 1024 * 1024  # bytes one joined message may reach: a bound on what a broker can make us hold


class PartJoiner:
    """Client: takes message.deliver-part frames; :meth:`add` returns the
    joined message as a message.deliver-run frame of one, after the last part."""

    __slots__ = ("limit", "_key", "_chunks", "_size")

    def __init__(self, limit: int = MAX_JOINED) -> None:
        self.limit = limit
        self._key: tuple[int, str, int] | None = None
        self._chunks: list[bytes] = []
        self._size = 0

    def add(self, frame: list[Any]) -> list[Any] | None:
        """One part ``[21, ch, destination, delivery_id, more, chunk]``: the
        joined deliver-run frame if it was the last, else None. Raises
        FramingError for a malformed part, or one of another delivery before
        the last part of the one begun."""
        if len(frame) != 6 or type(frame[1]) is not int or type(frame[2]) is not str or type(frame[3]) is not int \
                or type(frame[4]) is not bool or type(frame[5]) is not bytes:
            raise FramingError(f"malformed message.deliver-part: {frame!r:.80}")
        key = (frame[1], frame[2], frame[3])
        if self._chunks and key != self._key:
            raise FramingError(f"message.deliver-part of delivery {key[2]} to {key[1]!r} before the last part "
                               f"of delivery {self._key[2]}")
        self._key = key
        self._chunks.append(frame[5])
        self._size += len(frame[5])
        if self._size > self.limit:
            raise FrameTooLarge(f"a message in parts over {self.limit} bytes")
        if frame[4]:
            return None
        blob = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return [DELIVER_RUN, frame[1], frame[2], frame[3], 1, blob]
