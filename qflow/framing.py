"""Bytes to frames and frames to bytes. No I/O, no trio.

A qflow stream is a protocol header (``PROTOCOL_HEADER``) followed by msgpack
arrays, one per frame. msgpack is self-delimiting, so frames carry no length
prefix: a streaming ``Unpacker`` decodes them as bytes arrive. The negotiated
maximum frame size is enforced with the Unpacker's own limits, so a header
claiming gigabytes is refused before anything is allocated for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

PROTOCOL_HEADER = b"QFLOW\x01\x00"
PROTOCOL_VERSION = (1, 0)
DEFAULT_MAX_FRAME_SIZE = 1024 * 1024
MIN_MAX_FRAME_SIZE = 4096
READ_SIZE = 256 * 1024


class FramingError(Exception):
    """The byte stream is not a valid qflow stream. The connection must close."""

    code = 501


class FrameTooLarge(FramingError):
    code = 506


class FrameDecoder:
    """Feed bytes with :meth:`feed`, iterate frames with :meth:`frames`.

    Every frame is a list whose first item is an int frame code. Anything else
    raises :class:`FramingError`.
    """

    __slots__ = ("_header", "_unpacker", "max_frame_size", "_expect_header")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, expect_header: bool = True) -> None:
        self.max_frame_size = max_frame_size
        self._expect_header = expect_header
        self._header = b""
        self._unpacker = self._new_unpacker(max_frame_size)

    @staticmethod
    def _new_unpacker(max_frame_size: int) -> msgpack.Unpacker:
        # The buffer must hold one partial maximal frame plus one read.
        return msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=False,
            max_buffer_size=max_frame_size + 2 * READ_SIZE,
            max_bin_len=max_frame_size,
            max_str_len=max_frame_size,
            max_array_len=max_frame_size // 2,
            max_map_len=max_frame_size // 4,
            max_ext_len=0,
        )

    def set_max_frame_size(self, max_frame_size: int) -> None:
        """Apply a newly negotiated limit (between frames only)."""
        if max_frame_size == self.max_frame_size:
            return
        self.max_frame_size = max_frame_size
        old = self._unpacker
        self._unpacker = self._new_unpacker(max_frame_size)
        rest = old.read_bytes(max_frame_size + 2 * READ_SIZE)
        if rest:
            self.feed(rest)

    def feed(self, data: bytes) -> None:
        if self._expect_header:
            need = len(PROTOCOL_HEADER) - len(self._header)
            self._header += data[:need]
            data = data[need:]
            if self._header != PROTOCOL_HEADER[: len(self._header)]:
                raise FramingError(
                    f"bad protocol header {self._header!r}: expected {PROTOCOL_HEADER!r} (qflow {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]})"
                )
            if len(self._header) < len(PROTOCOL_HEADER):
                return
            self._expect_header = False
            if not data:
                return
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise FrameTooLarge(f"frame larger than the maximum frame size {self.max_frame_size}") from None

    def frames(self) -> Iterator[list[Any]]:
        unpacker = self._unpacker
        while True:
            try:
                frame = unpacker.unpack()
            except msgpack.OutOfData:
                return
            except ValueError as exc:  # limits exceeded, or malformed data
                if "exceeds max" in str(exc):
                    raise FrameTooLarge(f"frame exceeds the maximum frame size {self.max_frame_size}: {exc}") from None
                raise FramingError(f"malformed frame: {exc}") from None
            except Exception as exc:  # FormatError, StackError, UnicodeDecodeError...
                raise FramingError(f"malformed frame: {type(exc).__name__}: {exc}") from None
            if type(frame) is not list or not frame or type(frame[0]) is not int:
                raise FramingError(f"frame is not an array starting with a frame code: {_short(frame)}")
            yield frame

    @property
    def header_done(self) -> bool:
        return not self._expect_header


class FrameEncoder:
    """Packs frames into one growing buffer; :meth:`take` hands the batch out.

    One reused Packer and one buffer per connection: writes are batched.
    """

    __slots__ = ("_packer", "buffer")

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        self.buffer = bytearray()

    def write(self, frame: list[Any] | tuple[Any, ...]) -> None:
        self.buffer += self._packer.pack(frame)

    def write_header(self) -> None:
        self.buffer += PROTOCOL_HEADER

    def take(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def __len__(self) -> int:
        return len(self.buffer)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."
