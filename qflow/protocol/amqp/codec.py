"""The AMQP 1.0 type system (OASIS AMQP 1.0, part 1): encode and decode, sans I/O.

Python values stand for AMQP values as follows. A plain Python type stands for
the AMQP type a peer most often means by it; a wrapper class keeps the exact
AMQP type where a plain value would lose it, so that a decoded value encodes
back to the same type:

==========================  ===========================================
AMQP                        Python
==========================  ===========================================
null                        ``None``
boolean                     ``bool``
ubyte, ushort, uint, ulong  :class:`UByte`, :class:`UShort`, :class:`UInt`, :class:`ULong`
byte, short, int            :class:`Byte`, :class:`Short`, :class:`Int`
long                        ``int`` (a plain int encodes as long)
float, double               :class:`Float`, ``float``
decimal32/64/128            :class:`Decimal32`, :class:`Decimal64`, :class:`Decimal128` (raw bytes)
char                        :class:`Char`
timestamp                   :class:`Timestamp` (milliseconds since the Unix epoch)
uuid                        ``uuid.UUID``
binary                      ``bytes``
string                      ``str``
symbol                      :class:`Symbol`
list                        ``list``
map                         ``dict``
array                       :class:`Array` (element constructor kept)
described                   :class:`Described`
==========================  ===========================================

The encoder picks the smallest encoding of each value (``uint0``,
``smalluint``, ``list0``, ``sym8``, ...), as the usual AMQP libraries do.

Decoding is meant for input from anyone. Every length and count is checked
against the bytes actually present before anything is built, so what a
decoded value costs is bounded by a small multiple of its encoded size
(nothing is allocated for a count that the bytes cannot hold); nesting is
bounded by :data:`MAX_DEPTH`. Every failure is a :class:`DecodeError` that
says what was wrong and at which offset.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

MAX_DEPTH = 32  # containers and descriptors nested deeper than this are refused


class DecodeError(ValueError):
    """Bytes that are not a valid AMQP encoding. ``offset`` is where in the
    decoded buffer the fault was found."""

    def __init__(self, what: str, offset: int) -> None:
        super().__init__(f"{what} (at offset {offset})")
        self.what = what
        self.offset = offset


class EncodeError(ValueError):
    """A Python value that has no AMQP encoding (wrong type, out of range)."""


# ---- wrapper types -----------------------------------------------------------------------------------------


class _Ranged(int):
    LOW = 0
    HIGH = 0
    __slots__ = ()

    def __new__(cls, value: int = 0) -> Any:
        if not cls.LOW <= value <= cls.HIGH:
            raise EncodeError(f"{cls.__name__} out of range: {value}")
        return int.__new__(cls, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class UByte(_Ranged):
    """AMQP ubyte (0..255)."""
    LOW, HIGH = 0, 0xFF


class UShort(_Ranged):
    """AMQP ushort (0..65535)."""
    LOW, HIGH = 0, 0xFFFF


class UInt(_Ranged):
    """AMQP uint (0..2**32-1)."""
    LOW, HIGH = 0, 0xFFFFFFFF


class ULong(_Ranged):
    """AMQP ulong (0..2**64-1)."""
    LOW, HIGH = 0, 0xFFFFFFFFFFFFFFFF


class Byte(_Ranged):
    """AMQP byte (-128..127)."""
    LOW, HIGH = -0x80, 0x7F


class Short(_Ranged):
    """AMQP short (-32768..32767)."""
    LOW, HIGH = -0x8000, 0x7FFF


class Int(_Ranged):
    """AMQP int (32-bit signed)."""
    LOW, HIGH = -0x80000000, 0x7FFFFFFF


class Timestamp(_Ranged):
    """AMQP timestamp: milliseconds since the Unix epoch (64-bit signed)."""
    LOW, HIGH = -0x8000000000000000, 0x7FFFFFFFFFFFFFFF


class Float(float):
    """AMQP float (IEEE 754 binary32); a plain float is a double."""
    __slots__ = ()

    def __repr__(self) -> str:
        return f"Float({float(self)!r})"


class Symbol(str):
    """AMQP symbol: an ASCII name (a plain str is a UTF-8 string)."""
    __slots__ = ()

    def __repr__(self) -> str:
        return f"Symbol({str(self)!r})"


class Char(str):
    """AMQP char: one Unicode code point (UTF-32BE on the wire)."""
    __slots__ = ()

    def __new__(cls, value: str) -> Char:
        if len(value) != 1:
            raise EncodeError(f"a char is one code point, not {value!r}")
        return str.__new__(cls, value)


class _Decimal(bytes):
    SIZE = 0
    __slots__ = ()

    def __new__(cls, value: bytes) -> Any:
        if len(value) != cls.SIZE:
            raise EncodeError(f"{cls.__name__} takes {cls.SIZE} bytes, not {len(value)}")
        return bytes.__new__(cls, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({bytes(self)!r})"


class Decimal32(_Decimal):
    """AMQP decimal32, kept as its 4 raw bytes (IEEE 754 decimal, not interpreted)."""
    SIZE = 4


class Decimal64(_Decimal):
    """AMQP decimal64, kept as its 8 raw bytes."""
    SIZE = 8


class Decimal128(_Decimal):
    """AMQP decimal128, kept as its 16 raw bytes."""
    SIZE = 16


class Described:
    """A described value: a descriptor (usually a :class:`ULong` code or a
    :class:`Symbol` name) and the value it describes."""

    __slots__ = ("descriptor", "value")

    def __init__(self, descriptor: Any, value: Any) -> None:
        self.descriptor = descriptor
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Described) and type(self.descriptor) is type(other.descriptor)
                and self.descriptor == other.descriptor and self.value == other.value)

    def __hash__(self) -> int:
        return hash((self.descriptor, _hashable(self.value)))

    def __repr__(self) -> str:
        return f"Described({self.descriptor!r}, {self.value!r})"


class Array:
    """An AMQP array: items that share one element constructor.

    ``code`` is the element type's format code (for instance 0xa3 for
    symbols; the encoder uses the widest fixed form of a type, as the spec
    requires for arrays: sym32, str32, vbin32, list32, map32, array32, uint,
    ulong, int, long). ``descriptor`` is set for an array of described values
    (whose items are then the bare values, without :class:`Described`).
    """

    __slots__ = ("code", "items", "descriptor")

    def __init__(self, code: int, items: list[Any], descriptor: Any = None) -> None:
        self.code = _ARRAY_WIDE.get(code, code)
        self.items = items
        self.descriptor = descriptor

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Array) and self.code == other.code and self.items == other.items
                and self.descriptor == other.descriptor)

    def __hash__(self) -> int:
        return hash((self.code, tuple(_hashable(i) for i in self.items)))

    def __repr__(self) -> str:
        d = f", descriptor={self.descriptor!r}" if self.descriptor is not None else ""
        return f"Array(0x{self.code:02x}, {self.items!r}{d})"


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((_hashable(k), _hashable(v)) for k, v in value.items())
    return value


# ---- format codes ------------------------------------------------------------------------------------------

NULL, TRUE, FALSE, UINT0, ULONG0, LIST0 = 0x40, 0x41, 0x42, 0x43, 0x44, 0x45
BOOLEAN, UBYTE, BYTE, SMALLUINT, SMALLULONG, SMALLINT, SMALLLONG = 0x56, 0x50, 0x51, 0x52, 0x53, 0x54, 0x55
USHORT, SHORT = 0x60, 0x61
UINT, INT, FLOAT, CHAR, DECIMAL32 = 0x70, 0x71, 0x72, 0x73, 0x74
ULONG, LONG, DOUBLE, TIMESTAMP, DECIMAL64 = 0x80, 0x81, 0x82, 0x83, 0x84
DECIMAL128, UUID = 0x94, 0x98
VBIN8, STR8, SYM8, VBIN32, STR32, SYM32 = 0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xB3
LIST8, MAP8, LIST32, MAP32, ARRAY8, ARRAY32 = 0xC0, 0xC1, 0xD0, 0xD1, 0xE0, 0xF0
DESCRIBED = 0x00

# The compact forms have a fixed-width twin that arrays use.
_ARRAY_WIDE = {TRUE: BOOLEAN, FALSE: BOOLEAN, UINT0: UINT, SMALLUINT: UINT, ULONG0: ULONG, SMALLULONG: ULONG,
               SMALLINT: INT, SMALLLONG: LONG, VBIN8: VBIN32, STR8: STR32, SYM8: SYM32, LIST0: LIST32,
               LIST8: LIST32, MAP8: MAP32, ARRAY8: ARRAY32}

_B = struct.Struct(">B")
_b = struct.Struct(">b")
_H = struct.Struct(">H")
_h = struct.Struct(">h")
_I = struct.Struct(">I")
_i = struct.Struct(">i")
_Q = struct.Struct(">Q")
_q = struct.Struct(">q")
_f = struct.Struct(">f")
_d = struct.Struct(">d")
_BB = struct.Struct(">BB")
_II = struct.Struct(">II")

# Fixed-width types: code -> (width, decode from bytes at offset).
_u8, _s8 = _B.unpack_from, _b.unpack_from
_FIXED: dict[int, tuple[int, Any]] = {
    UBYTE: (1, lambda b, o: UByte(_u8(b, o)[0])),
    BYTE: (1, lambda b, o: Byte(_s8(b, o)[0])),
    SMALLUINT: (1, lambda b, o: UInt(_u8(b, o)[0])),
    SMALLULONG: (1, lambda b, o: ULong(_u8(b, o)[0])),
    SMALLINT: (1, lambda b, o: Int(_s8(b, o)[0])),
    SMALLLONG: (1, lambda b, o: _s8(b, o)[0]),
    USHORT: (2, lambda b, o: UShort(_H.unpack_from(b, o)[0])),
    SHORT: (2, lambda b, o: Short(_h.unpack_from(b, o)[0])),
    UINT: (4, lambda b, o: UInt(_I.unpack_from(b, o)[0])),
    INT: (4, lambda b, o: Int(_i.unpack_from(b, o)[0])),
    FLOAT: (4, lambda b, o: Float(_f.unpack_from(b, o)[0])),
    DECIMAL32: (4, lambda b, o: Decimal32(bytes(b[o:o + 4]))),
    ULONG: (8, lambda b, o: ULong(_Q.unpack_from(b, o)[0])),
    LONG: (8, lambda b, o: _q.unpack_from(b, o)[0]),
    DOUBLE: (8, lambda b, o: _d.unpack_from(b, o)[0]),
    TIMESTAMP: (8, lambda b, o: Timestamp(_q.unpack_from(b, o)[0])),
    DECIMAL64: (8, lambda b, o: Decimal64(bytes(b[o:o + 8]))),
    DECIMAL128: (16, lambda b, o: Decimal128(bytes(b[o:o + 16]))),
    UUID: (16, lambda b, o: uuid.UUID(bytes=bytes(b[o:o + 16]))),
}
_CONSTANTS = {NULL: None, TRUE: True, FALSE: False, UINT0: UInt(0), ULONG0: ULong(0)}


def _char(b: Any, o: int) -> Char:
    cp = _I.unpack_from(b, o)[0]
    if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
        raise DecodeError(f"char U+{cp:X} is not a Unicode scalar value", o)
    return Char(chr(cp))


def _boolean(b: Any, o: int) -> bool:
    v = b[o]
    if v > 1:
        raise DecodeError(f"boolean byte 0x{v:02x} is neither 0 nor 1", o)
    return v == 1


_FIXED[CHAR] = (4, _char)
_FIXED[BOOLEAN] = (1, _boolean)

_VARIABLE = {VBIN8: 1, STR8: 1, SYM8: 1, VBIN32: 4, STR32: 4, SYM32: 4}
_COMPOUND = {LIST8: 1, MAP8: 1, LIST32: 4, MAP32: 4}
_ARRAYS = {ARRAY8: 1, ARRAY32: 4}


# ---- decoding ----------------------------------------------------------------------------------------------


class Decoder:
    """Decodes AMQP values from ``buf[start:end]``.

    Args:
      buf: bytes, bytearray or memoryview.
      start, end: the span to read (``end`` defaults to the buffer's end).
    """

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: Any, start: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = start
        self.end = len(buf) if end is None else end

    def at_end(self) -> bool:
        return self.pos >= self.end

    def value(self) -> Any:
        """The next value, and the position moved past it.

        Raises:
          DecodeError: the bytes are not one complete valid value.
        """
        return self._value(self.end, 0)

    def _need(self, n: int, end: int, what: str) -> None:
        if n < 0 or self.pos + n > end:
            raise DecodeError(f"{what} needs {n} bytes, {end - self.pos} left", self.pos)

    def _value(self, end: int, depth: int) -> Any:
        buf = self.buf
        pos = self.pos
        if pos >= end:
            raise DecodeError("value expected, no bytes left", pos)
        code = buf[pos]
        self.pos = pos + 1
        if code == DESCRIBED:
            if depth >= MAX_DEPTH:
                raise DecodeError(f"nesting deeper than {MAX_DEPTH}", pos)
            descriptor = self._value(end, depth + 1)
            return Described(descriptor, self._value(end, depth + 1))
        return self._body(code, end, depth, pos)

    def _body(self, code: int, end: int, depth: int, at: int) -> Any:
        buf = self.buf
        if code in _CONSTANTS:
            return _CONSTANTS[code]
        if code == LIST0:
            return []
        fixed = _FIXED.get(code)
        if fixed is not None:
            width, read = fixed
            self._need(width, end, f"type 0x{code:02x}")
            pos = self.pos
            self.pos = pos + width
            return read(buf, pos)
        width = _VARIABLE.get(code)
        if width is not None:
            n = self._length(width, end, code)
            pos = self.pos
            self.pos = pos + n
            raw = bytes(buf[pos:pos + n])
            if code == VBIN8 or code == VBIN32:
                return raw
            if code == STR8 or code == STR32:
                try:
                    return raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DecodeError(f"string is not UTF-8: {e.reason}", pos + e.start) from None
            try:
                return Symbol(raw.decode("ascii"))
            except UnicodeDecodeError as e:
                raise DecodeError("symbol is not ASCII", pos + e.start) from None
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH}", at)
        width = _COMPOUND.get(code)
        if width is not None:
            size = self._length(width, end, code)
            inner_end = self.pos + size
            count = self._count(width, inner_end, code)
            items = []
            for _ in range(count):
                items.append(self._value(inner_end, depth + 1))
            if self.pos != inner_end:
                raise DecodeError(f"0x{code:02x} holds {inner_end - self.pos} bytes past its {count} items",
                                  self.pos)
            if code == LIST8 or code == LIST32:
                return items
            if count % 2:
                raise DecodeError(f"map has an odd count {count}", at)
            result = {}
            for i in range(0, count, 2):
                key = items[i]
                try:
                    result[key] = items[i + 1]
                except TypeError:
                    raise DecodeError(f"map key of unhashable type {type(key).__name__}", at) from None
            return result
        width = _ARRAYS.get(code)
        if width is not None:
            return self._array(code, width, end, depth)
        raise DecodeError(f"unknown format code 0x{code:02x}", at)

    def _length(self, width: int, end: int, code: int) -> int:
        self._need(width, end, f"length of 0x{code:02x}")
        pos = self.pos
        n = self.buf[pos] if width == 1 else _I.unpack_from(self.buf, pos)[0]
        self.pos = pos + width
        if self.pos + n > end:
            raise DecodeError(f"0x{code:02x} announces {n} bytes, {end - self.pos} left", pos)
        return n

    def _count(self, width: int, end: int, code: int) -> int:
        self._need(width, end, f"count of 0x{code:02x}")
        pos = self.pos
        n = self.buf[pos] if width == 1 else _I.unpack_from(self.buf, pos)[0]
        self.pos = pos + width
        # Every item takes at least one byte: a count the bytes cannot hold is refused before a loop starts.
        if n > end - self.pos:
            raise DecodeError(f"0x{code:02x} announces {n} items in {end - self.pos} bytes", pos)
        return n

    def _array(self, code0: int, width: int, end: int, depth: int) -> Array:
        at = self.pos
        size = self._length(width, end, code0)
        inner_end = self.pos + size
        count_at = self.pos
        self._need(width, inner_end, "array count")
        count = self.buf[count_at] if width == 1 else _I.unpack_from(self.buf, count_at)[0]
        self.pos = count_at + width
        descriptor = None
        self._need(1, inner_end, "array element constructor")
        code = self.buf[self.pos]
        self.pos += 1
        if code == DESCRIBED:
            descriptor = self._value(inner_end, depth + 1)
            self._need(1, inner_end, "array element constructor")
            code = self.buf[self.pos]
            self.pos += 1
        if code in _ARRAYS and depth + 1 >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH}", at)
        # Zero-width elements (null, true, uint0, ...) cost nothing on the wire: an array may not claim more
        # items than it has bytes, whatever their type, so that a few bytes never decode to a huge list.
        if count > size:
            raise DecodeError(f"array announces {count} items in {size} bytes", count_at)
        items = []
        for _ in range(count):
            items.append(self._body(code, inner_end, depth + 1, self.pos))
        if self.pos != inner_end:
            raise DecodeError(f"array holds {inner_end - self.pos} bytes past its {count} items", self.pos)
        return Array(code, items, descriptor)


def decode(buf: Any, start: int = 0, end: int | None = None) -> Any:
    """The one value that ``buf[start:end]`` holds.

    Raises:
      DecodeError: not exactly one valid value.
    """
    d = Decoder(buf, start, end)
    value = d.value()
    if d.pos != d.end:
        raise DecodeError(f"{d.end - d.pos} bytes after the value", d.pos)
    return value


def decode_all(buf: Any, start: int = 0, end: int | None = None) -> list[Any]:
    """Every value in ``buf[start:end]``, back to back."""
    d = Decoder(buf, start, end)
    out = []
    while not d.at_end():
        out.append(d.value())
    return out


# ---- encoding ----------------------------------------------------------------------------------------------


def _uint_bytes(code_small: int, code_zero: int, code_wide: int, fmt: struct.Struct, v: int) -> bytes:
    if v == 0:
        return bytes((code_zero,))
    if v < 256:
        return bytes((code_small, v))
    return bytes((code_wide,)) + fmt.pack(v)


def encode(value: Any, out: bytearray | None = None) -> bytearray:
    """``value``'s AMQP encoding, appended to ``out`` (a new bytearray if None).

    Raises:
      EncodeError: a value with no AMQP type, or out of its type's range.
    """
    if out is None:
        out = bytearray()
    _encode(value, out)
    return out


def _encode(value: Any, out: bytearray) -> None:
    t = type(value)
    enc = _ENCODERS.get(t)
    if enc is None:
        for base, e in _ENCODERS.items():
            if isinstance(value, base) and base is not bool:
                enc = e
                break
        else:
            raise EncodeError(f"no AMQP type for {t.__name__}")
    enc(value, out)


def _enc_none(v: Any, out: bytearray) -> None:
    out.append(NULL)


def _enc_bool(v: bool, out: bytearray) -> None:
    out.append(TRUE if v else FALSE)


def _enc_long(v: int, out: bytearray) -> None:
    if -128 <= v <= 127:
        out += _BB.pack(SMALLLONG, v & 0xFF)
    elif -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        out.append(LONG)
        out += _q.pack(v)
    else:
        raise EncodeError(f"int {v} does not fit an AMQP long (use ULong for a ulong)")


def _enc_int(v: int, out: bytearray) -> None:
    if -128 <= v <= 127:
        out += _BB.pack(SMALLINT, v & 0xFF)
    else:
        out.append(INT)
        out += _i.pack(v)


def _enc_uint(v: int, out: bytearray) -> None:
    out += _uint_bytes(SMALLUINT, UINT0, UINT, _I, v)


def _enc_ulong(v: int, out: bytearray) -> None:
    out += _uint_bytes(SMALLULONG, ULONG0, ULONG, _Q, v)


def _enc_ubyte(v: int, out: bytearray) -> None:
    out += _BB.pack(UBYTE, v)


def _enc_ushort(v: int, out: bytearray) -> None:
    out.append(USHORT)
    out += _H.pack(v)


def _enc_byte(v: int, out: bytearray) -> None:
    out += _BB.pack(BYTE, v & 0xFF)


def _enc_short(v: int, out: bytearray) -> None:
    out.append(SHORT)
    out += _h.pack(v)


def _enc_timestamp(v: int, out: bytearray) -> None:
    out.append(TIMESTAMP)
    out += _q.pack(v)


def _enc_double(v: float, out: bytearray) -> None:
    out.append(DOUBLE)
    out += _d.pack(v)


def _enc_float(v: float, out: bytearray) -> None:
    out.append(FLOAT)
    out += _f.pack(v)


def _enc_char(v: str, out: bytearray) -> None:
    out.append(CHAR)
    out += _I.pack(ord(v))


def _enc_decimal(code: int) -> Any:
    def enc(v: bytes, out: bytearray) -> None:
        out.append(code)
        out += v
    return enc


def _enc_uuid(v: uuid.UUID, out: bytearray) -> None:
    out.append(UUID)
    out += v.bytes


def _variable(code8: int, code32: int, raw: bytes, out: bytearray) -> None:
    n = len(raw)
    if n < 256:
        out += _BB.pack(code8, n)
    else:
        out.append(code32)
        out += _I.pack(n)
    out += raw


def _enc_binary(v: bytes, out: bytearray) -> None:
    _variable(VBIN8, VBIN32, v, out)


def _enc_str(v: str, out: bytearray) -> None:
    _variable(STR8, STR32, v.encode("utf-8"), out)


def _enc_symbol(v: str, out: bytearray) -> None:
    try:
        raw = v.encode("ascii")
    except UnicodeEncodeError:
        raise EncodeError(f"symbol {v!r} is not ASCII") from None
    _variable(SYM8, SYM32, raw, out)


def _compound(code8: int, code32: int, count: int, body: bytearray, out: bytearray) -> None:
    if len(body) < 255 and count < 256:
        out += _BB.pack(code8, len(body) + 1)
        out.append(count)
    else:
        out.append(code32)
        out += _II.pack(len(body) + 4, count)
    out += body


def _enc_list(v: list, out: bytearray) -> None:
    if not v:
        out.append(LIST0)
        return
    body = bytearray()
    for item in v:
        _encode(item, body)
    _compound(LIST8, LIST32, len(v), body, out)


def _enc_map(v: dict, out: bytearray) -> None:
    body = bytearray()
    for key, item in v.items():
        _encode(key, body)
        _encode(item, body)
    _compound(MAP8, MAP32, 2 * len(v), body, out)


def _enc_described(v: Described, out: bytearray) -> None:
    out.append(DESCRIBED)
    _encode(v.descriptor, out)
    _encode(v.value, out)


# An array element's body (no constructor), in the array's fixed element encoding.
def _element(code: int, item: Any, out: bytearray) -> None:
    if code == NULL:
        if item is not None:
            raise EncodeError("an array of nulls holds only None")
        return
    if code == BOOLEAN:
        out.append(1 if item else 0)
    elif code in (VBIN32, STR32, SYM32):
        raw = item if code == VBIN32 else item.encode("utf-8" if code == STR32 else "ascii")
        out += _I.pack(len(raw))
        out += raw
    elif code in (LIST32, MAP32, ARRAY32):
        tmp = bytearray()
        if code == LIST32:
            _enc_list32(item, tmp)
        elif code == MAP32:
            _enc_map32(item, tmp)
        else:
            _enc_array(item, tmp, wide=True)
        out += tmp[1:]
    elif code in _FIXED:
        tmp = bytearray()
        _ELEMENT_FIXED[code](item, tmp)
        out += tmp[1:]
    else:
        raise EncodeError(f"no array element encoding for code 0x{code:02x}")


def _enc_list32(v: list, out: bytearray) -> None:
    body = bytearray()
    for item in v:
        _encode(item, body)
    out.append(LIST32)
    out += _II.pack(len(body) + 4, len(v))
    out += body


def _enc_map32(v: dict, out: bytearray) -> None:
    body = bytearray()
    for key, item in v.items():
        _encode(key, body)
        _encode(item, body)
    out.append(MAP32)
    out += _II.pack(len(body) + 4, 2 * len(v))
    out += body


def _wide_uint(code: int, fmt: struct.Struct) -> Any:
    def enc(v: int, out: bytearray) -> None:
        out.append(code)
        out += fmt.pack(v)
    return enc


_ELEMENT_FIXED: dict[int, Any] = {
    UBYTE: _enc_ubyte, BYTE: _enc_byte, USHORT: _enc_ushort, SHORT: _enc_short,
    UINT: _wide_uint(UINT, _I), ULONG: _wide_uint(ULONG, _Q), INT: _wide_uint(INT, _i), LONG: _wide_uint(LONG, _q),
    FLOAT: _enc_float, DOUBLE: _enc_double, CHAR: _enc_char, TIMESTAMP: _enc_timestamp, UUID: _enc_uuid,
    DECIMAL32: _enc_decimal(DECIMAL32), DECIMAL64: _enc_decimal(DECIMAL64), DECIMAL128: _enc_decimal(DECIMAL128),
}


def _enc_array(v: Array, out: bytearray, wide: bool = False) -> None:
    body = bytearray()
    if v.descriptor is not None:
        body.append(DESCRIBED)
        _encode(v.descriptor, body)
    body.append(v.code)
    for item in v.items:
        _element(v.code, item, body)
    count = len(v.items)
    if not wide and len(body) < 255 and count < 256:
        out += _BB.pack(ARRAY8, len(body) + 1)
        out.append(count)
    else:
        out.append(ARRAY32)
        out += _II.pack(len(body) + 4, count)
    out += body


_ENCODERS: dict[type, Any] = {
    type(None): _enc_none, bool: _enc_bool, int: _enc_long, float: _enc_double, str: _enc_str, bytes: _enc_binary,
    bytearray: _enc_binary, memoryview: lambda v, out: _enc_binary(bytes(v), out),
    list: _enc_list, tuple: lambda v, out: _enc_list(list(v), out), dict: _enc_map,
    UByte: _enc_ubyte, UShort: _enc_ushort, UInt: _enc_uint, ULong: _enc_ulong, Byte: _enc_byte, Short: _enc_short,
    Int: _enc_int, Timestamp: _enc_timestamp, Float: _enc_float, Char: _enc_char, Symbol: _enc_symbol,
    Decimal32: _enc_decimal(DECIMAL32), Decimal64: _enc_decimal(DECIMAL64), Decimal128: _enc_decimal(DECIMAL128),
    uuid.UUID: _enc_uuid, Described: _enc_described, Array: _enc_array,
}


# ---- skipping ----------------------------------------------------------------------------------------------

_WIDTHS = {code: width for code, (width, _r) in _FIXED.items()}
for _c in _CONSTANTS:
    _WIDTHS[_c] = 0
_WIDTHS[LIST0] = 0


def skip(buf: Any, pos: int, end: int, _depth: int = 0) -> int:
    """Where the value at ``buf[pos]`` ends, found from its constructor and
    length fields alone: nothing inside a list, map or array is looked at.

    Raises:
      DecodeError: the value is truncated or its format code unknown.
    """
    depth = _depth
    while True:
        if pos >= end:
            raise DecodeError("value expected, no bytes left", pos)
        code = buf[pos]
        if code != DESCRIBED:
            break
        depth += 1
        if depth > MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH}", pos)
        pos = skip(buf, pos + 1, end, depth)  # the descriptor; the described value follows it
    width = _WIDTHS.get(code)
    if width is not None:
        n = width
        pos += 1
    elif code in _VARIABLE or code in _COMPOUND or code in _ARRAYS:
        w = 1 if code < 0xB0 or (0xC0 <= code < 0xD0) or code == ARRAY8 else 4
        if pos + 1 + w > end:
            raise DecodeError(f"length of 0x{code:02x} needs {w} bytes, {end - pos - 1} left", pos + 1)
        n = buf[pos + 1] if w == 1 else _I.unpack_from(buf, pos + 1)[0]
        pos += 1 + w
    else:
        raise DecodeError(f"unknown format code 0x{code:02x}", pos)
    if pos + n > end:
        raise DecodeError(f"0x{code:02x} announces {n} bytes, {end - pos} left", pos)
    return pos + n
