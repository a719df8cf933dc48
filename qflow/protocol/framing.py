"""Bytes to frames and frames to bytes. No I/O, no trio.

A qflow stream is a protocol header (``PROTOCOL_HEADER``) followed by msgpack
arrays, one per frame. msgpack is self-delimiting, so frames carry no length
prefix: a streaming ``Unpacker`` decodes them as bytes arrive. The negotiated
maximum frame size is enforced with the Unpacker's own limits, so a header
claiming gigabytes is refused before anything is allocated for it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import msgpack

PROTOCOL_HEADER = b"QFLOW\x01\x00"
PROTOCOL_VERSION = (1, 0)
DEFAULT_MAX_FRAME_SIZE = 1024 * 1024
MIN_MAX_FRAME_SIZE = 4096
READ_SIZE = 256 * 1024
INITIAL_BUFFER = 16 * 1024  # a decoder's first buffer; it grows with the reads
# Bytes of an unfinished frame past which the decoder holds them once. Below
# it they are in both its own chunks and the Unpacker's buffer (cheap, and
# the common case of a frame cut by a read). Past it, one of the two goes:
# * usually the chunks: the Unpacker's buffer is the one copy, though it may
#   cost up to twice the bytes (it doubles as it grows);
# * with ``FrameDecoder.hold_exact`` (qflowd sets it while many bytes are
#   held in unfinished frames: qflow.server.input_budget), the Unpacker: a
#   fresh one is fed nothing until the frame's shortest completion has come
#   (FrameDecoder._completion), the chunks being the exact copy meanwhile;
#   then it gets them in one piece. That costs a copy and a parse more per
#   large frame, so it is not the usual way. Once per frame: one still
#   incomplete then (it was longer than its shortest completion) stays in
#   the Unpacker.
KEEP_PENDING = 64 * 1024
# An array's head claims its elements before they come: msgpack's Unpacker
# makes a list of that many slots (8 bytes each) as soon as it reads the head,
# and keeps the lists of an unfinished frame until the frame is done. 1,000
# nested array16 heads claiming 65,535 elements each are 3 KB of input and
# hundreds of MB of lists. So a guarded decoder (qflowd's) has its Unpacker
# take arrays of up to CLAIMED_ARRAY_LEN elements as they come: the lists of
# an unfinished frame then cost at most MAX_NESTING x CLAIMED_ARRAY_LEN x 8
# bytes (512 KiB, half of what a half-sent frame of the default maximum size
# holds). A frame with a longer array is decoded once all its bytes have come,
# when every element it claims is backed by a byte (FrameDecoder._take_whole).
CLAIMED_ARRAY_LEN = 64
MAX_NESTING = 1024  # msgpack's Unpacker refuses containers nested deeper (its StackError)


class FramingError(Exception):
    """The byte stream is not a valid qflow stream. The connection must close."""

    code = 501


class FrameTooLarge(FramingError):
    code = 506


class FrameDecoder:
    """Feed bytes with :meth:`feed`, iterate frames with :meth:`frames`.

    Every frame is a list whose first item is an int frame code. Anything else
    raises :class:`FramingError`. A frame larger than ``max_frame_size`` raises
    :class:`FrameTooLarge`, whether it arrives in one feed or in many: the bytes
    of the frame being decoded are counted, so the memory held for one frame is
    bounded by the limit. An incomplete frame that cannot fit whatever follows
    (a bin/str header claiming gigabytes) is refused as soon as its header is in.
    """

    __slots__ = ("_header", "_unpacker", "max_frame_size", "_expect_header", "_base", "_defer_until", "_deferred_at", "hold_exact",
                 "_chunks", "_chunks_start", "_fed", "_frame_start", "frame_begin", "frame_end", "_probed",
                 "_array_len", "_whole", "_ready")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, expect_header: bool = True,
                 guard_claims: bool = False) -> None:
        """``guard_claims``: decode a frame holding an array of more than
        CLAIMED_ARRAY_LEN elements only once it is whole (see there): for input
        from untrusted peers (qflowd's)."""
        self.max_frame_size = max_frame_size
        self._expect_header = expect_header
        self._header = b""
        self._array_len = CLAIMED_ARRAY_LEN if guard_claims else None
        self._whole: msgpack.Unpacker | None = None  # while a frame is held until whole: its skipping probe
        self._ready: tuple[list[Any], int] | None = None  # a frame decoded whole, and where it ends
        self._unpacker = self._new_unpacker(max_frame_size)
        self._base = 0  # where the current unpacker's stream starts in the whole stream
        self._defer_until = 0  # while not 0: bytes are held, not fed, until _fed reaches it
        self._deferred_at = -1  # where (in the whole stream) the frame last held so starts: once a frame
        self.hold_exact = False  # see KEEP_PENDING
        self._reset_offsets()

    def _reset_offsets(self) -> None:
        # Offsets are in the current unpacker's stream (its tell()).
        self._chunks: list[bytes] = []  # fed chunks holding the bytes from _frame_start on
        self._chunks_start = 0  # offset of _chunks[0]
        self._fed = 0  # bytes fed to the unpacker
        self._frame_start = 0  # where the frame being decoded starts
        # The frame last yielded spans [frame_begin, frame_end) in this stream (see last_chunk).
        self.frame_begin = self.frame_end = 0
        self._probed = -1  # stop offset last checked by _cannot_fit

    def _new_unpacker(self, max_frame_size: int) -> msgpack.Unpacker:
        # The buffer must hold one partial maximal frame plus one read.
        array_len = max_frame_size // 2 if self._array_len is None else self._array_len
        return msgpack.Unpacker(
            # The buffer starts small and grows to what the reads need: an idle
            # connection costs kilobytes, not msgpack's default 1 MiB.
            read_size=INITIAL_BUFFER,
            raw=False,
            use_list=True,
            strict_map_key=False,
            max_buffer_size=max_frame_size + 2 * READ_SIZE,
            max_bin_len=max_frame_size,
            max_str_len=max_frame_size,
            max_array_len=array_len,
            max_map_len=max_frame_size // 4,
            max_ext_len=0,
        )

    def set_max_frame_size(self, max_frame_size: int) -> None:
        """Apply a newly negotiated limit (between frames only).

        Bytes already fed and not yet decoded are kept, including the start of
        a frame not yet complete, and a :meth:`frames` iteration in progress
        goes on with them.
        """
        if max_frame_size == self.max_frame_size:
            return
        self.max_frame_size = max_frame_size
        rest = self._pending()
        self._unpacker = self._new_unpacker(max_frame_size)
        self._base += self._frame_start
        self._reset_offsets()
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
        if not data:
            return
        if type(data) is not bytes:
            data = bytes(data)
        chunks = self._chunks
        while chunks and self._chunks_start + len(chunks[0]) <= self._frame_start:
            self._chunks_start += len(chunks.pop(0))
        chunks.append(data)
        self._fed += len(data)
        if self._whole is not None:  # a frame with a long array, held until whole
            self._feed_whole(data)
            return
        if self._defer_until:  # a large frame's bytes, held until it can be complete
            if self._fed < self._defer_until:
                return
            self._defer_until = 0
            data = b"".join(chunks)  # the frame in one piece: it lies in the last chunk (see last_chunk)
            self._chunks = [data]
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise FrameTooLarge(f"frame larger than the maximum frame size {self.max_frame_size}") from None

    def frames(self) -> Iterator[list[Any]]:
        if self._defer_until or self._whole is not None:  # holding a frame's bytes: it is not complete yet
            return
        while True:
            if self._ready is not None:  # a frame with a long array, decoded whole
                frame, end = self._ready
                self._ready = None
                self.frame_begin = self._frame_start
                self._frame_start = self.frame_end = end
                if type(frame) is not list or not frame or type(frame[0]) is not int:
                    raise FramingError(f"frame is not an array starting with a frame code: {_short(frame)}")
                yield frame
                continue
            unpacker = self._unpacker  # set_max_frame_size may replace it between frames
            limit = self.max_frame_size
            tell = unpacker.tell
            try:
                for frame in unpacker:  # C-level iteration: the per-message path
                    start = self._frame_start  # skip() may have moved it since the last frame
                    end = tell()
                    if end - start > limit:
                        raise FrameTooLarge(f"frame of {end - start} bytes exceeds the maximum frame size {limit}")
                    self.frame_begin = start
                    self._frame_start = self.frame_end = end
                    if type(frame) is not list or not frame or type(frame[0]) is not int:
                        raise FramingError(f"frame is not an array starting with a frame code: {_short(frame)}")
                    yield frame
                    if self._unpacker is not unpacker:
                        break
                else:
                    self._check_incomplete()
                    if self._fed - self._frame_start > KEEP_PENDING:
                        self._hold_once()
                    return
            except FramingError:
                raise
            except msgpack.StackError:
                raise FramingError(f"malformed frame: containers nested more than {MAX_NESTING} deep") from None
            except msgpack.FormatError:
                raise FramingError("malformed frame: not msgpack (a type byte msgpack does not define, 0xc1)") from None
            except ValueError as exc:  # limits exceeded, or malformed data
                if self._array_len is not None and "exceeds max_array_len" in str(exc):
                    if self._take_whole():
                        continue
                    return
                if "exceeds max" in str(exc):
                    raise FrameTooLarge(f"frame exceeds the maximum frame size {limit}: {exc}") from None
                raise FramingError(f"malformed frame: {exc}") from None
            except Exception as exc:  # FormatError, StackError, UnicodeDecodeError...
                raise FramingError(f"malformed frame: {type(exc).__name__}: {exc}") from None

    @property
    def pending(self) -> int:
        """Bytes fed and not yet taken as whole frames: the input this
        decoder holds (an unfinished frame, or frames waiting behind a long command).
        A frame held until whole counts twice: its probe keeps a copy."""
        held = self._fed - self._frame_start
        return held if self._whole is None else 2 * held

    def _take_whole(self) -> bool:
        """The Unpacker met an array longer than it takes as it comes (it
        stopped there, its state cleared). If the frame is whole in the bytes
        fed, it is decoded at once (``_ready``, True); else it is held until
        whole, unless what it claims already takes it past the maximum size."""
        start = self._frame_start
        if start < self._chunks_start:  # its start is no longer kept (see KEEP_PENDING)
            raise FrameTooLarge(f"an array of more than {CLAIMED_ARRAY_LEN} elements more than {KEEP_PENDING} "
                                f"bytes into a frame that came over several reads (send long arrays first)")
        last, base = self.last_chunk()
        # The rest of the read, without a copy when the frame starts in its last chunk (the usual case).
        rest = memoryview(last)[start - base:] if start >= base else memoryview(self._pending())
        rest = rest[:self.max_frame_size]
        probe = self._new_unpacker(self.max_frame_size)  # skip() builds nothing: its claims cost nothing
        fed, window, whole = 0, 4096, False  # most such frames are small: a growing window, not the whole read
        while not whole:
            probe.feed(rest[fed:window])
            fed = min(window, len(rest))
            try:
                probe.skip()
                whole = True
            except msgpack.OutOfData:
                if fed >= len(rest):
                    break
                window *= 4
            except msgpack.StackError:
                raise FramingError(f"malformed frame: containers nested more than {MAX_NESTING} deep") from None
            except Exception as exc:
                raise FramingError(f"malformed frame: {type(exc).__name__}: {exc}") from None
        if whole:
            end = probe.tell()
            frame = self._decode_whole(rest[:end])
            rest.release()
            unpacker = self._unpacker
            unpacker.read_bytes(start + end - unpacker.tell())  # past the frame: on with the next one
            self._ready = (frame, start + end)
            return True
        rest = bytes(rest)
        self._completion(rest)  # FrameTooLarge if its claims cannot fit
        # Held until whole: a fresh Unpacker gets the frame then (_feed_whole).
        self._base += start
        self._unpacker = self._new_unpacker(self.max_frame_size)
        self._reset_offsets()
        self._chunks = [rest]
        self._fed = len(rest)
        self._whole = probe
        return False

    def _feed_whole(self, data: bytes) -> None:
        """More bytes of a frame held until whole (see _take_whole)."""
        probe = self._whole
        if self._fed > self.max_frame_size:
            data = memoryview(data)[:max(0, self.max_frame_size - (self._fed - len(data)))]
        probe.feed(data)
        try:
            probe.skip()
        except msgpack.OutOfData:
            if self._fed > self.max_frame_size:
                raise FrameTooLarge(f"incomplete frame of {self._fed} bytes exceeds the maximum frame size "
                                    f"{self.max_frame_size}") from None
            return
        except msgpack.StackError:
            raise FramingError(f"malformed frame: containers nested more than {MAX_NESTING} deep") from None
        except Exception as exc:
            raise FramingError(f"malformed frame: {type(exc).__name__}: {exc}") from None
        end = probe.tell()
        self._whole = None
        whole = b"".join(self._chunks)
        self._chunks = [whole]
        frame = self._decode_whole(whole[:end])
        self._unpacker.feed(whole)
        self._unpacker.skip()  # the frame just decoded: the Unpacker goes on after it
        self._ready = (frame, end)

    def _decode_whole(self, data: bytes) -> Any:
        """A whole frame, with arrays as long as its bytes allow."""
        try:
            return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False, max_ext_len=0)
        except Exception as exc:
            raise FramingError(f"malformed frame: {type(exc).__name__}: {exc}") from None

    def _hold_once(self) -> None:
        """The unfinished frame is past KEEP_PENDING: keep one copy (see there)."""
        if self.hold_exact and self._frame_start >= self._chunks_start \
                and self._base + self._frame_start != self._deferred_at:
            rest = self._pending()
            need = self._completion(rest)
            if need is not None:  # held in the chunks alone until need bytes have come
                self._base += self._frame_start
                self._deferred_at = self._base
                self._unpacker = self._new_unpacker(self.max_frame_size)
                self._reset_offsets()
                self._chunks = [rest]
                self._fed = len(rest)
                self._defer_until = need
                return
        self._chunks = []
        self._chunks_start = self._fed

    def _completion(self, data: bytes) -> int | None:
        """The length of the shortest frame that starts with ``data`` (see
        _cannot_fit: zeros complete any prefix soonest); FrameTooLarge if it
        exceeds the limit; None if it cannot be told."""
        probe = self._new_unpacker(self.max_frame_size)
        probe.feed(data)
        room = self.max_frame_size - len(data)
        try:
            probe.skip()
        except msgpack.OutOfData:
            # The usual case: it waits inside a long bin/str whose header ends where it stopped.
            # Its zeros go in at once (the parse below checks what they complete, whatever it was).
            stop = probe.tell()
            for width, types in _LENGTH_HEADERS:
                if stop - width - 1 >= 0 and data[stop - width - 1] in types:
                    length = int.from_bytes(data[stop - width:stop], "big")
                    n = min(room, stop + length - len(data))
                    if n > 0:
                        probe.feed(_zeros(n))
                        room -= n
                    break
        except Exception:  # noqa: S110 - complete or malformed: the loop below tells
            pass
        while True:
            try:
                probe.skip()
                return probe.tell()
            except msgpack.OutOfData:
                if room <= 0:
                    raise FrameTooLarge(f"incomplete frame declares more than the maximum frame size "
                                        f"{self.max_frame_size}") from None
                n = min(room, len(_ZEROS))
                probe.feed(_ZEROS[:n])
                room -= n
            except ValueError as exc:
                if "exceeds max" in str(exc):
                    raise FrameTooLarge(f"incomplete frame exceeds the maximum frame size {self.max_frame_size}: "
                                        f"{exc}") from None
                return None
            except Exception:  # malformed: frames() reports it once the bytes are in
                return None

    def position(self) -> int:
        """The stream offset where the next frame starts (see last_chunk)."""
        return self._frame_start

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` bytes, which the caller has taken as whole
        frames straight from :meth:`last_chunk` (the broker's transfer runs).
        Between frames only."""
        self._unpacker.read_bytes(n)
        self._frame_start += n
        self.frame_begin = self.frame_end = self._frame_start

    def last_chunk(self) -> tuple[bytes, int]:
        """The chunk fed last and the stream offset of its first byte: a frame
        with ``frame_begin`` >= that offset lies wholly in it."""
        last = self._chunks[-1] if self._chunks else b""
        return last, self._fed - len(last)

    def frame_tail(self, head: bytes) -> bytes | None:
        """The encoded bytes of the frame last yielded that follow ``head``, if
        the frame begins with exactly ``head`` (else None: the sender encoded
        its start differently, or the frame came over reads holding more than
        ``KEEP_PENDING`` and only the Unpacker kept its bytes: the broker
        encodes it again). Lets the broker keep a message as it came."""
        begin, end = self.frame_begin, self.frame_end
        if begin < self._chunks_start:  # a large frame over several reads: its start is no longer kept
            return None
        last, base = self.last_chunk()
        if begin >= base:  # the usual case: the frame is in the last chunk fed
            i = begin - base
            return last[i + len(head):end - base] if last.startswith(head, i) else None
        raw = self._bytes(begin, end)
        return raw[len(head):] if raw.startswith(head) else None

    def _check_incomplete(self) -> None:
        """Refuse the incomplete frame if it is already, or must become, too large."""
        size = self._fed - self._frame_start
        if size > self.max_frame_size:
            raise FrameTooLarge(f"incomplete frame of {size} bytes exceeds the maximum frame size {self.max_frame_size}")
        stop = self._unpacker.tell()  # where the unpacker waits for more: after a bin/str/ext header if any
        if size and stop != self._probed:
            self._probed = stop
            if self._may_claim_too_much(stop) and self._cannot_fit():
                raise FrameTooLarge(f"incomplete frame declares more than the maximum frame size {self.max_frame_size}")

    def _may_claim_too_much(self, stop: int) -> bool:
        """Cheap filter: do the bytes just before ``stop`` look like a bin/str/ext
        header whose length takes the frame past the limit? (They may be data
        that only looks so; :meth:`_cannot_fit` decides.)"""
        start = max(stop - 5, self._frame_start, self._chunks_start)
        window = self._bytes(start, min(stop + 4, self._fed))
        # A 16-bit length cannot take a frame this far from the limit past it: look for 32-bit ones only.
        headers = _HEADERS_32 if stop - self._frame_start + 65538 <= self.max_frame_size else _HEADERS_ANY
        if headers.search(window, 0, stop - start) is None:  # the usual case, at C speed
            return False
        for i in range(min(stop - start, len(window))):
            width = _LONG_RAW_HEADERS.get(window[i])
            if width:
                length = int.from_bytes(window[i + 1:i + 1 + width].ljust(width, b"\0"), "big")
                if start + i + 1 + width + length - self._frame_start > self.max_frame_size:
                    return True
        return False

    def _cannot_fit(self) -> bool:
        """True if the incomplete frame exceeds the limit whatever bytes follow.

        Zero bytes are the shortest continuation of any msgpack prefix (a zero
        completes a pending element, and makes a pending length smallest), so
        the frame fits iff it completes within the limit when padded with them.
        Past ``KEEP_PENDING`` the frame's start is no longer kept: it is taken
        to fit, and refused by its size once its bytes pass the limit.
        """
        if self._frame_start < self._chunks_start:
            return False
        probe = self._new_unpacker(self.max_frame_size)
        data = self._pending()
        probe.feed(data)
        room = self.max_frame_size - len(data)
        while True:
            try:
                probe.skip()  # builds nothing: what the frame's arrays claim costs nothing here
                return False
            except msgpack.OutOfData:
                if room <= 0:
                    return True
                n = min(room, len(_ZEROS))
                probe.feed(_ZEROS[:n])
                room -= n
            except ValueError as exc:
                return "exceeds max" in str(exc)
            except Exception:  # malformed: frames() reports it once the bytes are in
                return False

    def _bytes(self, start: int, end: int) -> bytes:
        """The fed bytes at offsets [start, end), start >= _chunks_start."""
        last = self._chunks[-1] if self._chunks else b""
        base = self._fed - len(last)
        if start >= base:  # the usual case: all in the last chunk fed
            return last[start - base:end - base]
        out = []
        pos = self._chunks_start
        for chunk in self._chunks:
            nxt = pos + len(chunk)
            if nxt > start and pos < end:
                out.append(chunk[max(start - pos, 0): end - pos])
            pos = nxt
        return b"".join(out)

    def _pending(self) -> bytes:
        """Every byte fed since the end of the last complete frame."""
        return self._bytes(self._frame_start, self._fed)

    @property
    def header_done(self) -> bool:
        return not self._expect_header


# Type bytes of bin, str and ext headers with 16- and 32-bit lengths, to the
# width of their length field; shorter ones cannot exceed MIN_MAX_FRAME_SIZE.
_LONG_RAW_HEADERS = {0xC5: 2, 0xDA: 2, 0xC8: 2, 0xC6: 4, 0xDB: 4, 0xC9: 4}
_HEADERS_ANY = re.compile(b"[\xc5\xc6\xc8\xc9\xda\xdb]")
_HEADERS_32 = re.compile(b"[\xc6\xc9\xdb]")
_ZEROS = memoryview(bytes(64 * 1024))
# (width of the length, the header bytes with that width) of bin, str and ext types
_LENGTH_HEADERS = ((4, b"\xc6\xdb\xc9"), (2, b"\xc5\xda\xc8"), (1, b"\xc4\xd9\xc7"))


def _zeros(n: int) -> bytes | memoryview:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


class FrameEncoder:
    """Gathers encoded frames; :meth:`take` hands the batch out as one bytes.

    ``parts`` is a list of encoded pieces, joined once at :meth:`take` (one
    list for the encoder's life: a sender keeps a reference to it). Code on
    the per-message path (the broker's deliveries, the client's transfers)
    appends pieces it encoded itself straight to it, and :meth:`write` packs
    any other frame after them, so order is kept. A list, not a growing
    bytearray: a bytearray grown by a few hundred KiB a batch is copied over
    and over as it grows; the join copies each byte once.

    The broker's deliveries, and :meth:`write` (every other frame: results,
    completions, flow notices, connection control), count what they add in
    ``queued``; the glue counts in ``sending`` what it took and has not yet
    written. Deliveries stop while the two together reach ``limit`` (see
    ``SessionOutput.room``): that is how a connection that stops reading
    stops receiving, its messages waiting in their queues. Past ``limit``
    the server also stops taking the connection's commands
    (``ConnectionPump.output_full``), so replies cannot pile up either.
    """

    __slots__ = ("parts", "_pack", "queued", "sending", "limit")

    def __init__(self, limit: int = sys.maxsize) -> None:
        self.parts: list[bytes] = []
        # A small first buffer (msgpack's default is 256 KiB): it grows to the largest frame packed.
        self._pack = msgpack.Packer(use_bin_type=True, buf_size=INITIAL_BUFFER).pack
        self.queued = 0  # bytes of frames in parts
        self.sending = 0  # bytes taken and not yet written (the glue keeps it)
        self.limit = limit  # most bytes of deliveries queued or being sent (unbounded unless the glue says)

    def write(self, frame: Any) -> None:
        data = self._pack(frame)
        self.parts.append(data)
        self.queued += len(data)  # control frames count in the output bound too

    def write_header(self) -> None:
        self.parts.append(PROTOCOL_HEADER)

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        self.queued = 0
        return data

    def __len__(self) -> int:
        """Bytes gathered (a sum over the pieces: test ``parts`` for emptiness instead)."""
        return sum(map(len, self.parts))


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."
