"""AMQP 1.0 performatives and the composite types they carry (part 2, 3 and 5 of the spec).

Each is a light class whose fields are named as in the spec (with ``_`` for
``-``) and default as the spec says. ``encode(out)`` appends the described
list (trailing absent fields left out, each field in its spec type, so
``handle=3`` goes out as a uint); :func:`from_described` turns a decoded
:class:`~qflow.protocol.amqp.codec.Described` back into its class, checking
each field's type.

Multiple-symbol fields (capabilities, locales, mechanisms) are tuples of
str in Python, sent as a symbol array. Role is a bool: ``False`` sender,
``True`` receiver (:data:`SENDER`, :data:`RECEIVER`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from .codec import Array, Described, Symbol, Timestamp, UByte, UInt, ULong, UShort, encode

SENDER, RECEIVER = False, True
SETTLE_UNSETTLED, SETTLE_SETTLED, SETTLE_MIXED = 0, 1, 2  # sender-settle-mode
RCV_FIRST, RCV_SECOND = 0, 1  # receiver-settle-mode


class FieldError(ValueError):
    """A performative or composite whose fields break the spec (a mandatory
    field absent, a field of the wrong type). ``condition`` is the AMQP error
    condition a peer should be told."""

    def __init__(self, text: str, condition: str = "amqp:invalid-field") -> None:
        super().__init__(text)
        self.condition = condition


# ---- field types: (encode to the wire type, check and convert what was decoded) --------------------------


def _check_uint(v: Any) -> int:
    if type(v) is not UInt:
        raise TypeError("uint")
    return int(v)


def _check(kind: type, name: str) -> Any:
    def check(v: Any) -> Any:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise TypeError(name)
        return v
    return check


def _syms_in(v: Any) -> tuple[str, ...]:
    if isinstance(v, Symbol):
        return (str(v),)
    if isinstance(v, Array) and all(isinstance(i, str) for i in v.items):
        return tuple(str(i) for i in v.items)
    raise TypeError("symbol or symbol array")


def _syms_out(v: Any) -> Any:
    if isinstance(v, str):
        v = (v,)
    return Array(0xB3, [Symbol(s) for s in v])


def _sym_map_in(v: Any) -> dict:
    if not isinstance(v, dict):
        raise TypeError("map")
    return v


def _sym_map_out(v: dict) -> dict:
    return {Symbol(k) if type(k) is str else k: val for k, val in v.items()}


_TYPES: dict[str, tuple[Any, Any]] = {
    "uint": (UInt, _check_uint),
    "ulong": (ULong, lambda v: int(_check(ULong, "ulong")(v))),
    "ubyte": (UByte, lambda v: int(_check(UByte, "ubyte")(v))),
    "ushort": (UShort, lambda v: int(_check(UShort, "ushort")(v))),
    "bool": (bool, _check(bool, "boolean")),
    "str": (str, _check(str, "string")),
    "sym": (Symbol, lambda v: str(_check(Symbol, "symbol")(v))),
    "syms": (_syms_out, _syms_in),
    "map": (_sym_map_out, _sym_map_in),
    "bin": (bytes, _check(bytes, "binary")),
    "timestamp": (Timestamp, lambda v: int(_check(Timestamp, "timestamp")(v))),
    "any": (lambda v: v, lambda v: v),
}


class Composite:
    """A described list with named fields. Subclasses set CODE and FIELDS
    (name, type, default, mandatory)."""

    CODE: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[tuple[str, str, Any, bool], ...]] = ()
    __slots__ = ()

    def __init__(self, **kwargs: Any) -> None:
        for name, _kind, default, _m in self.FIELDS:
            setattr(self, name, kwargs.pop(name, default))
        if kwargs:
            raise TypeError(f"{self.NAME} has no field {', '.join(kwargs)}")

    def fields(self) -> list[Any]:
        """The fields as the wire list: each in its AMQP type, trailing absent ones left out."""
        values = []
        for name, kind, _d, _m in self.FIELDS:
            v = getattr(self, name)
            if v is None:
                values.append(None)
            elif kind in _TYPES:
                values.append(_TYPES[kind][0](v))
            else:  # a nested composite (or a delivery state / error)
                values.append(v.described() if isinstance(v, Composite) else v)
        while values and values[-1] is None:
            values.pop()
        return values

    def described(self) -> Described:
        return Described(ULong(self.CODE), self.fields())

    def encode(self, out: bytearray | None = None) -> bytearray:
        """The encoded described list, appended to ``out``."""
        return encode(self.described(), out)

    @classmethod
    def from_fields(cls, values: list[Any]) -> Any:
        """Raises: FieldError."""
        if not isinstance(values, list):
            raise FieldError(f"{cls.NAME} is not a list")
        if len(values) > len(cls.FIELDS):
            # Later versions may add fields: extra ones are ignored, as the spec allows.
            values = values[:len(cls.FIELDS)]
        self = cls.__new__(cls)
        for i, (name, kind, default, mandatory) in enumerate(cls.FIELDS):
            v = values[i] if i < len(values) else None
            if v is None:
                if mandatory:
                    raise FieldError(f"{cls.NAME}: mandatory field {name} is absent")
                v = default
            else:
                try:
                    v = _TYPES[kind][1](v) if kind in _TYPES else _COMPOSITE_CHECK[kind](v)
                except TypeError as e:
                    raise FieldError(f"{cls.NAME}: field {name} should be {e}, not {type(v).__name__}") from None
            setattr(self, name, v)
        return self

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and all(getattr(self, f[0]) == getattr(other, f[0]) for f in self.FIELDS)

    def __repr__(self) -> str:
        shown = [f"{f[0]}={getattr(self, f[0])!r}" for f in self.FIELDS if getattr(self, f[0]) != f[2]]
        return f"{type(self).__name__}({', '.join(shown)})"


def composite(name: str, code: int, fields: list[tuple[Any, ...]]) -> type:
    """A :class:`Composite` subclass: ``fields`` are (name, type, default, mandatory), the last two optional."""
    spec = tuple((f[0], f[1], f[2] if len(f) > 2 else None, len(f) > 3 and f[3]) for f in fields)
    return type(name, (Composite,), {"CODE": code, "NAME": name.lower(), "FIELDS": spec,
                                     "__slots__": tuple(f[0] for f in spec), "__module__": __name__})


M = True  # mandatory

Error = composite("Error", 0x1D, [("condition", "sym", None, M), ("description", "str"), ("info", "map")])

# Delivery states and outcomes (part 3.4).
Received = composite("Received", 0x23, [("section_number", "uint", None, M), ("section_offset", "ulong", None, M)])
Accepted = composite("Accepted", 0x24, [])
Rejected = composite("Rejected", 0x25, [("error", "error")])
Released = composite("Released", 0x26, [])
Modified = composite("Modified", 0x27, [("delivery_failed", "bool"), ("undeliverable_here", "bool"),
                                         ("message_annotations", "map")])
# Transactions (part 4) are not supported; their state is recognised so that it can be refused by name.
TransactionalState = composite("TransactionalState", 0x34, [("txn_id", "bin", None, M), ("outcome", "state")])

Source = composite("Source", 0x28, [
    ("address", "str"), ("durable", "uint", 0), ("expiry_policy", "sym", "session-end"), ("timeout", "uint", 0),
    ("dynamic", "bool", False), ("dynamic_node_properties", "map"), ("distribution_mode", "sym"),
    ("filter", "map"), ("default_outcome", "state"), ("outcomes", "syms"), ("capabilities", "syms")])
Target = composite("Target", 0x29, [
    ("address", "str"), ("durable", "uint", 0), ("expiry_policy", "sym", "session-end"), ("timeout", "uint", 0),
    ("dynamic", "bool", False), ("dynamic_node_properties", "map"), ("capabilities", "syms")])
Coordinator = composite("Coordinator", 0x30, [("capabilities", "syms")])

Open = composite("Open", 0x10, [
    ("container_id", "str", None, M), ("hostname", "str"), ("max_frame_size", "uint", 0xFFFFFFFF),
    ("channel_max", "ushort", 0xFFFF), ("idle_time_out", "uint"), ("outgoing_locales", "syms"),
    ("incoming_locales", "syms"), ("offered_capabilities", "syms"), ("desired_capabilities", "syms"),
    ("properties", "map")])
Begin = composite("Begin", 0x11, [
    ("remote_channel", "ushort"), ("next_outgoing_id", "uint", None, M), ("incoming_window", "uint", None, M),
    ("outgoing_window", "uint", None, M), ("handle_max", "uint", 0xFFFFFFFF), ("offered_capabilities", "syms"),
    ("desired_capabilities", "syms"), ("properties", "map")])
Attach = composite("Attach", 0x12, [
    ("name", "str", None, M), ("handle", "uint", None, M), ("role", "bool", None, M),
    ("snd_settle_mode", "ubyte", SETTLE_MIXED), ("rcv_settle_mode", "ubyte", RCV_FIRST), ("source", "source"),
    ("target", "target"), ("unsettled", "map"), ("incomplete_unsettled", "bool", False),
    ("initial_delivery_count", "uint"), ("max_message_size", "ulong"), ("offered_capabilities", "syms"),
    ("desired_capabilities", "syms"), ("properties", "map")])
Flow = composite("Flow", 0x13, [
    ("next_incoming_id", "uint"), ("incoming_window", "uint", None, M), ("next_outgoing_id", "uint", None, M),
    ("outgoing_window", "uint", None, M), ("handle", "uint"), ("delivery_count", "uint"), ("link_credit", "uint"),
    ("available", "uint"), ("drain", "bool", False), ("echo", "bool", False), ("properties", "map")])
Transfer = composite("Transfer", 0x14, [
    ("handle", "uint", None, M), ("delivery_id", "uint"), ("delivery_tag", "bin"), ("message_format", "uint"),
    ("settled", "bool"), ("more", "bool", False), ("rcv_settle_mode", "ubyte"), ("state", "state"),
    ("resume", "bool", False), ("aborted", "bool", False), ("batchable", "bool", False)])
Disposition = composite("Disposition", 0x15, [
    ("role", "bool", None, M), ("first", "uint", None, M), ("last", "uint"), ("settled", "bool", False),
    ("state", "state"), ("batchable", "bool", False)])
Detach = composite("Detach", 0x16, [("handle", "uint", None, M), ("closed", "bool", False), ("error", "error")])
End = composite("End", 0x17, [("error", "error")])
Close = composite("Close", 0x18, [("error", "error")])

SaslMechanisms = composite("SaslMechanisms", 0x40, [("sasl_server_mechanisms", "syms", None, M)])
SaslInit = composite("SaslInit", 0x41, [("mechanism", "sym", None, M), ("initial_response", "bin"),
                                         ("hostname", "str")])
SaslChallenge = composite("SaslChallenge", 0x42, [("challenge", "bin", None, M)])
SaslResponse = composite("SaslResponse", 0x43, [("response", "bin", None, M)])
SaslOutcome = composite("SaslOutcome", 0x44, [("code", "ubyte", None, M), ("additional_data", "bin")])
SASL_OK, SASL_AUTH, SASL_SYS, SASL_SYS_PERM, SASL_SYS_TEMP = 0, 1, 2, 3, 4

PERFORMATIVES: dict[int, type] = {c.CODE: c for c in (Open, Begin, Attach, Flow, Transfer, Disposition, Detach,
                                                      End, Close)}
SASL_FRAMES: dict[int, type] = {c.CODE: c for c in (SaslMechanisms, SaslInit, SaslChallenge, SaslResponse,
                                                    SaslOutcome)}
DELIVERY_STATES: dict[int, type] = {c.CODE: c for c in (Received, Accepted, Rejected, Released, Modified,
                                                        TransactionalState)}
# Symbolic descriptors a peer may use instead of the numeric codes (part 1.5: both forms are valid).
_SYMBOLIC = {
    "amqp:open:list": 0x10, "amqp:begin:list": 0x11, "amqp:attach:list": 0x12, "amqp:flow:list": 0x13,
    "amqp:transfer:list": 0x14, "amqp:disposition:list": 0x15, "amqp:detach:list": 0x16, "amqp:end:list": 0x17,
    "amqp:close:list": 0x18, "amqp:error:list": 0x1D, "amqp:received:list": 0x23, "amqp:accepted:list": 0x24,
    "amqp:rejected:list": 0x25, "amqp:released:list": 0x26, "amqp:modified:list": 0x27, "amqp:source:list": 0x28,
    "amqp:target:list": 0x29, "amqp:coordinator:list": 0x30, "amqp:transactional-state:list": 0x34,
    "amqp:sasl-mechanisms:list": 0x40, "amqp:sasl-init:list": 0x41, "amqp:sasl-challenge:list": 0x42,
    "amqp:sasl-response:list": 0x43, "amqp:sasl-outcome:list": 0x44,
}


def descriptor_code(descriptor: Any) -> int | None:
    """The numeric code of a descriptor given as a ulong or as its symbolic name; None if unknown."""
    if type(descriptor) is ULong:
        return int(descriptor)
    if isinstance(descriptor, Symbol):
        return _SYMBOLIC.get(str(descriptor))
    return None


def from_described(value: Any, table: dict[int, type]) -> Any:
    """The class instance ``value`` (a decoded described list) stands for.

    Raises:
      FieldError: not a described list of one of ``table``'s types
        (condition amqp:decode-error), or its fields break the spec.
    """
    if not isinstance(value, Described):
        raise FieldError(f"a described type was expected, not {type(value).__name__}", "amqp:decode-error")
    code = descriptor_code(value.descriptor)
    cls = table.get(code) if code is not None else None
    if cls is None:
        raise FieldError(f"unexpected descriptor {value.descriptor!r}", "amqp:decode-error")
    return cls.from_fields(value.value)


def _state_in(v: Any) -> Any:
    try:
        return from_described(v, DELIVERY_STATES)
    except FieldError:
        raise TypeError("a delivery state") from None


def _error_in(v: Any) -> Any:
    try:
        return from_described(v, {0x1D: Error})
    except FieldError:
        raise TypeError("an error") from None


def _terminus_in(cls: type, *others: type) -> Any:
    table = {c.CODE: c for c in (cls, *others)}

    def check(v: Any) -> Any:
        try:
            return from_described(v, table)
        except FieldError as e:
            raise TypeError(f"a {cls.NAME} ({e})") from None
    return check


_COMPOSITE_CHECK = {"state": _state_in, "error": _error_in, "source": _terminus_in(Source),
                    "target": _terminus_in(Target, Coordinator)}
