"""Frame codes, command schemas and validation. No I/O.

Every frame is a msgpack array ``[code, ...]``. Connection controls carry no
channel; everything else carries the session's channel number second.
Commands (codes >= ``FIRST_COMMAND``) are numbered implicitly per session,
0, 1, 2, ... in the order the client sends them, as in AMQP 0-10. The schema
table below is the one place that says what each command carries; the broker
and the client both check against it. See docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

# -- connection controls ------------------------------------------------------
OPEN = 0  # [0, {mechanism, response, name, heartbeat, max_frame_size, deliver_runs}]
OPEN_OK = 1  # [1, {heartbeat, max_frame_size, broker, user, sasl}]
CLOSE = 2  # [2, code, text]
HEARTBEAT = 3  # [3]
SASL_CHALLENGE = 4  # [4, challenge: bin]: the broker's next SASL message (SCRAM's server-first)
SASL_RESPONSE = 5  # [5, response: bin]: the client's answer (SCRAM's client-final)

# -- session controls and broker-to-client session frames ---------------------
ATTACH = 10  # [10, ch, name]
ATTACHED = 11  # [11, ch]
DETACH = 12  # [12, ch]
DETACHED = 13  # [13, ch, code, text]
COMPLETED = 14  # [14, ch, ranges]: newly completed command ids
FLUSH = 15  # [15, ch]: ask for an immediate completion report
RESULT = 16  # [16, ch, command_id, value]
EXCEPTION = 17  # [17, ch, command_id, code, text]
DELIVER = 18  # [18, ch, destination, delivery_id, redelivered, sequence, size, exchange, routing_key, props, body]
FLOW_NOTICE = 19  # [19, ch, name, held(, true)]: this session's transfers are (no longer) held by queue NAME,
# or, with a fifth field true, by the broker-wide holder NAME (the memory alarm, the store's disk quota)
# [20, ch, destination, first_delivery_id, count, entries]: COUNT deliveries at once, to a connection that
# asked for them (connection.open's deliver_runs); entries is bin, see qflow.protocol.entries
DELIVER_RUN = 20
# [21, ch, destination, delivery_id, more, chunk]: one message too large for a frame, in parts: the chunks of
# one delivery id, in order, joined, are its stored entry as in a deliver-run's entries; more is false on the last
DELIVER_PART = 21

# -- commands: each consumes one command id -----------------------------------
FIRST_COMMAND = 30
TRANSFER = 30
QUEUE_DECLARE = 31
QUEUE_DELETE = 32
QUEUE_PURGE = 33
QUEUE_QUERY = 34
EXCHANGE_DECLARE = 35
EXCHANGE_DELETE = 36
EXCHANGE_BIND = 37
EXCHANGE_UNBIND = 38
SUBSCRIBE = 39
FLOW = 40
ACCEPT = 41
RELEASE = 42
CANCEL = 43
SYNC = 44
SENDER_CAPACITY = 45
QUEUE_MODIFY = 46
QUEUE_REMOVE_THROUGH = 47
QUEUE_AVAILABLE = 48
QUEUE_REMOVE_SEQUENCES = 49
QUEUE_LIST = 50

ACCEPT_EXPLICIT = 0
ACCEPT_NONE = 1
ACQUIRE_PRE_ACQUIRED = 0
ACQUIRE_NOT_ACQUIRED = 1  # browse: deliver without removing
UNLIMITED = -1

# -- error codes (AMQP 0-10 execution and connection codes) -------------------
NOT_FOUND = 404
RESOURCE_LOCKED = 405
PRECONDITION_FAILED = 406
RESOURCE_DELETED = 408
ILLEGAL_STATE = 409
COMMAND_INVALID = 503
RESOURCE_LIMIT_EXCEEDED = 506
NOT_ALLOWED = 530
NOT_IMPLEMENTED = 540
INTERNAL_ERROR = 541
INVALID_ARGUMENT = 542
CONNECTION_FORCED = 320
FRAMING_ERROR = 501
NORMAL = 200

PROPERTY_KEYS = frozenset({"message_id", "correlation_id", "content_type", "durable", "headers", "timestamp",
                           "ttl", "expiration", "priority"})
# The properties the broker acts on when a message arrives (an expiry, a priority level):
# check_properties says whether a message has any, so that one without costs nothing more.
TIMED_KEYS = frozenset({"ttl", "expiration"})
MAX_PRIORITY = 9

_S, _B, _I, _M, _Y, _L, _N = "str", "bool", "int", "map", "bytes", "list", "str?"
_CHECK = {
    _S: lambda v: type(v) is str,
    _B: lambda v: type(v) is bool,
    _I: lambda v: type(v) is int,
    _M: lambda v: type(v) is dict,
    _Y: lambda v: type(v) is bytes,
    _L: lambda v: type(v) is list,
    _N: lambda v: v is None or type(v) is str,
}

# name, fields (name, type): the wire layout after [code, channel]
COMMANDS: dict[int, tuple[str, tuple[tuple[str, str], ...]]] = {
    TRANSFER: ("message.transfer", (("exchange", _S), ("routing_key", _S), ("properties", "props"), ("body", _Y))),
    QUEUE_DECLARE: ("queue.declare", (("queue", _S), ("durable", _B), ("exclusive", _B), ("auto_delete", _B),
                                      ("arguments", _M), ("passive", _B))),
    QUEUE_DELETE: ("queue.delete", (("queue", _S), ("if_empty", _B), ("if_unused", _B))),
    QUEUE_PURGE: ("queue.purge", (("queue", _S),)),
    QUEUE_QUERY: ("queue.query", (("queue", _S),)),
    EXCHANGE_DECLARE: ("exchange.declare", (("exchange", _S), ("type", _S), ("durable", _B), ("passive", _B))),
    EXCHANGE_DELETE: ("exchange.delete", (("exchange", _S), ("if_unused", _B))),
    EXCHANGE_BIND: ("exchange.bind", (("exchange", _S), ("queue", _S), ("binding_key", _S))),
    EXCHANGE_UNBIND: ("exchange.unbind", (("exchange", _S), ("queue", _S), ("binding_key", _S))),
    SUBSCRIBE: ("message.subscribe", (("queue", _S), ("destination", _S), ("accept_mode", _I),
                                      ("acquire_mode", _I), ("start_sequence", _I))),
    FLOW: ("message.flow", (("destination", _S), ("messages", _I), ("bytes", _I))),
    ACCEPT: ("message.accept", (("transfers", _L),)),
    RELEASE: ("message.release", (("transfers", _L),)),
    CANCEL: ("message.cancel", (("destination", _S),)),
    SYNC: ("execution.sync", ()),
    SENDER_CAPACITY: ("session.sender-capacity", (("capacity", _I),)),
    QUEUE_MODIFY: ("queue.modify", (("queue", _S), ("arguments", _M))),
    QUEUE_REMOVE_THROUGH: ("queue.remove-through", (("queue", _S), ("sequence", _I))),
    QUEUE_AVAILABLE: ("queue.available", (("queue", _S), ("after", _I), ("limit", _I))),
    QUEUE_REMOVE_SEQUENCES: ("queue.remove-sequences", (("queue", _S), ("incarnation", _S), ("sequences", _L))),
    QUEUE_LIST: ("queue.list", ()),
}
# Trailing fields a sender may leave out, with their defaults (added in later versions).
OPTIONAL_FIELDS: dict[int, tuple[Any, ...]] = {SUBSCRIBE: (0,)}
COMMAND_NAMES = {code: name for code, (name, _) in COMMANDS.items()}


class CommandError(Exception):
    """A command cannot be executed; it fails alone (execution.exception)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


def command_name(code: Any) -> str:
    return COMMAND_NAMES.get(code, f"command {code!r}")


_TEXT, _FLAG, _TIME, _MAP, _MSEC, _PRIO = range(6)
# Each property's kind; the text ones, the usual, are tested first.
_PROPERTY_KINDS = {"message_id": _TEXT, "correlation_id": _TEXT, "content_type": _TEXT, "durable": _FLAG,
                   "timestamp": _TIME, "headers": _MAP, "ttl": _MSEC, "expiration": _MSEC, "priority": _PRIO}


def check_properties(props: Any) -> bool:
    """Check a message's properties (a map or nil).

    Returns:
      Whether the broker has something to do with them when the message
      arrives: a ``ttl``, an ``expiration`` or a ``priority`` is present
      (a message with none of them costs nothing more for their existence).

    Raises:
      CommandError: INVALID_ARGUMENT, naming the property at fault.
    """
    if props is None:
        return False
    if type(props) is not dict:
        raise CommandError(INVALID_ARGUMENT, "message.transfer: properties must be a map or nil")
    acts = False
    kinds = _PROPERTY_KINDS
    for key, value in props.items():
        kind = kinds.get(key) if type(key) is str else None
        if kind is _TEXT:
            if value is not None and type(value) is not str:
                raise CommandError(INVALID_ARGUMENT, f"message.transfer: property {key!r} must be a string")
        elif kind is None:
            raise CommandError(INVALID_ARGUMENT, f"message.transfer: unknown property {key!r}")
        elif kind is _FLAG:
            if type(value) is not bool:
                raise CommandError(INVALID_ARGUMENT, "message.transfer: property 'durable' must be a bool")
        elif kind is _TIME:
            if type(value) is not int or not 0 <= value < 1 << 63:
                raise CommandError(INVALID_ARGUMENT, "message.transfer: property 'timestamp' must be an integer "
                                                     "(milliseconds since the Unix epoch, 0 or more)")
        elif kind is _MAP:
            if type(value) is not dict or any(type(k) is not str for k in value):
                raise CommandError(INVALID_ARGUMENT, "message.transfer: property 'headers' must be a map with string keys")
        elif kind is _MSEC:
            if type(value) is not int or not 0 <= value < 1 << 63:
                raise CommandError(INVALID_ARGUMENT, f"message.transfer: property {key!r} must be an integer "
                                                     f"of milliseconds, 0 or more, not {value!r}")
            acts = True
        else:
            if type(value) is not int or not 0 <= value <= MAX_PRIORITY:
                raise CommandError(INVALID_ARGUMENT, f"message.transfer: property 'priority' must be an integer "
                                                     f"from 0 to {MAX_PRIORITY}, not {value!r}")
            acts = True
    return acts


def parse_command(frame: list[Any]) -> list[Any]:
    """Check a command frame against its schema; return its fields.

    Raises CommandError naming the command and the field at fault.
    """
    code = frame[0]
    spec = COMMANDS.get(code)
    if spec is None:
        raise CommandError(NOT_IMPLEMENTED, f"unknown command code {code}")
    name, fields = spec
    args = frame[2:]
    optional = OPTIONAL_FIELDS.get(code)
    if optional and len(fields) - len(optional) <= len(args) < len(fields):
        args = args + list(optional[len(args) - len(fields):])
    if len(args) != len(fields):
        raise CommandError(
            INVALID_ARGUMENT, f"{name}: expected {len(fields)} fields ({', '.join(f for f, _ in fields)}), got {len(args)}"
        )
    for (field, kind), value in zip(fields, args, strict=True):
        if kind == "props":
            check_properties(value)
        elif not _CHECK[kind](value):
            raise CommandError(INVALID_ARGUMENT, f"{name}: field {field!r} must be {kind}, got {type(value).__name__}")
    return args
