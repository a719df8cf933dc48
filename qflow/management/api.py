"""The management HTTP API and the Prometheus metrics: a thin view over the live broker.

Two layers, as h11 itself is built:

* ``ManagementApi`` is sans-I/O: ``handle(method, target, body)`` routes one
  request and returns a ``Response``. It reads the broker's live objects on
  every request and keeps no copy of their state (the only thing it owns is
  its start time), so what it shows is what the broker has at that moment.
  It calls the broker synchronously, which is safe because it runs on the
  broker's trio thread and never awaits in between; after a change it calls
  ``Broker.flush`` so completions and deliveries the change caused go out.
* ``ManagementServer`` wraps it with h11 on trio: one task per connection,
  keep-alive, bounded head size, header count and body size, a deadline for
  each request (slowloris), and a bounded number of connections.

Routes (JSON in and out; names in paths are percent-decoded, so any queue name
is addressable, ``/`` as ``%2F``)::

    GET    /api/queues                 GET|PUT|PATCH|DELETE /api/queues/{name}
    POST   /api/queues/{name}/purge    GET /api/exchanges    GET|PUT|DELETE /api/exchanges/{name}
    GET|POST|DELETE /api/bindings      GET /api/connections  GET /api/broker    GET /metrics

Errors are ``{"error": "..."}`` with a 4xx status: 400 bad input, 404 missing,
405 wrong method, 409 conflict (a broker precondition, a lock, a declare that
differs from what exists), 408/413/431 for requests the server will not read.
Bad input never yields a 500; a 500 means a bug in qflow, and is logged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes, urlsplit

import h11
import trio

from qflow import __version__
from qflow import protocol as P
from qflow.broker import Broker, BrokerSession
from qflow.broker.queue import Queue
from qflow.protocol import CommandError

log = logging.getLogger("qflow.management")

DEFAULT_PORT = 8672
DEFAULT_TIMEOUT = 10.0  # seconds for a whole request to arrive, and for an idle keep-alive connection
MAX_BODY = 1 << 20  # bytes of request body
MAX_HEAD = 16 * 1024  # bytes of request line plus headers (h11's own default)
MAX_TARGET = 8 * 1024  # bytes of request target: a name is at most 255 bytes, 765 percent-encoded
MAX_HEADERS = 64
MAX_CONNECTIONS = 64
MAX_QUERY_FIELDS = 16
MAX_JSON_DEPTH = 32
READ_SIZE = 64 * 1024

# Broker command errors as HTTP statuses. 405 (locked), 406 (precondition
# failed) and 530 (not allowed: an exchange of another type, a built-in) all
# mean "the request is fine but the broker's state forbids it": a conflict.
_STATUS_BY_CODE = {
    P.NOT_FOUND: 404,
    P.RESOURCE_LOCKED: 409,
    P.PRECONDITION_FAILED: 409,
    P.ILLEGAL_STATE: 409,
    P.NOT_ALLOWED: 409,
    P.RESOURCE_LIMIT_EXCEEDED: 409,
    P.INVALID_ARGUMENT: 400,
}

JSON_TYPE = "application/json"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiError(Exception):
    """A request the API refuses: ``status`` and a message for the operator."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = JSON_TYPE
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_response(status: int, value: Any) -> Response:
    return Response(status, json.dumps(value, ensure_ascii=False, allow_nan=False).encode() + b"\n")


def error_response(status: int, message: str, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, json.dumps({"error": message}, ensure_ascii=False).encode() + b"\n",
                    headers=headers or [])


def iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- input validation -----------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is ``{}``. Raises ApiError(400)."""
    if not body.strip():
        return {}
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not UTF-8") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints longer than Python will parse
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if type(value) is not dict:
        raise ApiError(400, f"request body must be a JSON object, not {_json_type(value)}")
    _check_value(value, "request body", 0)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _check_value(value: Any, where: str, depth: int) -> None:
    """Everything the broker may later send on the wire (msgpack) or log must
    survive that: strings without lone surrogates, 64-bit integers, finite floats."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"{where}: nested more than {MAX_JSON_DEPTH} levels")
    t = type(value)
    if t is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where}: string is not valid Unicode (lone surrogate)") from None
    elif t is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise ApiError(400, f"{where}: integer {value} does not fit in 64 bits")
    elif t is float:
        if not math.isfinite(value):
            raise ApiError(400, f"{where}: number out of range")
    elif t is list:
        for item in value:
            _check_value(item, where, depth + 1)
    elif t is dict:
        for key, item in value.items():
            _check_value(key, where, depth + 1)
            _check_value(item, f"{where}: {key!r}" if depth == 0 else where, depth + 1)


def _fields(body: dict[str, Any], allowed: Iterable[str]) -> dict[str, Any]:
    allowed = tuple(allowed)
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; expected {', '.join(allowed)}")
    return body


def _get(body: dict[str, Any], key: str, kind: type, default: Any = None, required: bool = False) -> Any:
    if key not in body:
        if required:
            raise ApiError(400, f"field {key!r} is required")
        return default
    value = body[key]
    if type(value) is not kind:
        raise ApiError(400, f"field {key!r} must be {_json_type(kind())}, not {_json_type(value)}")
    return value


_TRUE = frozenset({"", "1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _flag(query: dict[str, str], key: str) -> bool:
    value = query.get(key)
    if value is None:
        return False
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ApiError(400, f"query parameter {key!r} must be true or false, not {value!r}")


def _jsonable(value: Any) -> Any:
    """Arguments declared over the protocol may hold msgpack values JSON lacks
    (bytes, non-string keys, NaN): show them rather than fail the request."""
    t = type(value)
    if t in (str, int, bool) or value is None:
        return value
    if t is float:
        return value if math.isfinite(value) else str(value)
    if t is bytes:
        return value.decode("utf-8", "backslashreplace")
    if t in (list, tuple):
        return [_jsonable(v) for v in value]
    if t is dict:
        return {k if type(k) is str else str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    return repr(value)


# -- routing ----------------------------------------------------------------------

# (method, path segments with "{}" for a name, handler name). The one place that
# says which URL does what.
_ROUTES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("GET", ("api", "queues"), "list_queues"),
    ("GET", ("api", "queues", "{}"), "get_queue"),
    ("PUT", ("api", "queues", "{}"), "put_queue"),
    ("PATCH", ("api", "queues", "{}"), "patch_queue"),
    ("DELETE", ("api", "queues", "{}"), "delete_queue"),
    ("POST", ("api", "queues", "{}", "purge"), "purge_queue"),
    ("GET", ("api", "exchanges"), "list_exchanges"),
    ("GET", ("api", "exchanges", "{}"), "get_exchange"),
    ("PUT", ("api", "exchanges", "{}"), "put_exchange"),
    ("DELETE", ("api", "exchanges", "{}"), "delete_exchange"),
    ("GET", ("api", "bindings"), "list_bindings"),
    ("POST", ("api", "bindings"), "add_binding"),
    ("DELETE", ("api", "bindings"), "delete_binding"),
    ("GET", ("api", "connections"), "list_connections"),
    ("GET", ("api", "broker"), "get_broker"),
    ("GET", ("metrics",), "metrics"),
    ("GET", ("api",), "index"),
    ("GET", (), "index"),
)


def _split_target(target: bytes) -> tuple[list[str], dict[str, str]]:
    """Path segments (percent-decoded, UTF-8) and query parameters. Segments are
    split before decoding, so ``%2F`` stays inside a name."""
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise ApiError(400, "request target is not ASCII; percent-encode names") from None
    if not text.startswith("/"):
        if text == "*":
            raise ApiError(400, "request target '*' is not supported")
        parts = urlsplit(text)  # absolute-form, as a proxy would send
        if not parts.scheme or not parts.path.startswith("/"):
            raise ApiError(400, f"bad request target {text[:100]!r}")
        text = parts.path + ("?" + parts.query if parts.query else "")
    path, _, query_text = text.partition("?")
    raw = path.split("/")[1:]
    if len(raw) > 1 and raw[-1] == "":
        raw.pop()  # "/api/queues/" is "/api/queues": no queue is named "" (names are 1 to 255 bytes)
    elif raw == [""]:
        raw = []
    try:
        segments = [unquote_to_bytes(s).decode("utf-8") for s in raw]
    except UnicodeDecodeError:
        raise ApiError(400, "a percent-decoded path segment is not UTF-8") from None
    try:
        pairs = parse_qsl(query_text, keep_blank_values=True, errors="strict", max_num_fields=MAX_QUERY_FIELDS)
    except UnicodeDecodeError:
        raise ApiError(400, "a percent-decoded query parameter is not UTF-8") from None
    except ValueError as exc:
        raise ApiError(400, f"bad query string: {exc}") from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key in query:
            raise ApiError(400, f"query parameter {key!r} given twice")
        query[key] = value
    return segments, query


def _match(segments: list[str]) -> tuple[dict[str, str], list[str]]:
    """{method: handler} and the name parameters for the routes matching ``segments``."""
    methods: dict[str, str] = {}
    params: list[str] = []
    for method, pattern, handler in _ROUTES:
        if len(pattern) != len(segments):
            continue
        names = []
        for want, got in zip(pattern, segments, strict=True):
            if want == "{}":
                names.append(got)
            elif want != got:
                break
        else:
            methods.setdefault(method, handler)
            params = names
    return methods, params


class ManagementApi:
    """Routes management requests to the live broker. No I/O.

    ``server`` is the protocol server (anything with ``connections``, each
    having ``peer``, ``name``, ``sessions`` and ``connected_at`` in trio time);
    ``options`` are the daemon's settings to report under ``/api/broker``.
    """

    def __init__(self, broker: Broker, server: Any = None, options: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.broker = broker
        self.server = server
        self.options = dict(options or {})
        self._clock = clock
        self.started_at = clock()

    # -- entry point ----------------------------------------------------------
    def handle(self, method: str, target: bytes, body: bytes = b"") -> Response:
        """Answer one request. Never raises: refusals become 4xx responses."""
        try:
            segments, query = _split_target(target)
            methods, params = _match(segments)
            if not methods:
                raise ApiError(404, f"no such resource: /{'/'.join(segments)[:200]}")
            lookup = "GET" if method == "HEAD" else method
            handler = methods.get(lookup)
            if handler is None:
                allowed = sorted(set(methods) | ({"HEAD"} if "GET" in methods else set()))
                raise ApiError(405, f"method {method} not allowed here; allowed: {', '.join(allowed)}",
                               [("allow", ", ".join(allowed))])
            return getattr(self, handler)(*params, query=query, body=body)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        except CommandError as exc:
            return error_response(_STATUS_BY_CODE.get(exc.code, 400), exc.text)
        except Exception:
            log.exception("management request %s %r failed", method, target[:200])
            return error_response(500, "internal error in qflow (logged by the broker)")

    def _no_query(self, query: dict[str, str], allowed: Iterable[str] = ()) -> None:
        unknown = sorted(set(query) - set(allowed))
        if unknown:
            raise ApiError(400, f"unknown query parameter(s): {', '.join(unknown)}")

    def _no_body(self, body: bytes) -> None:
        if body.strip():
            raise ApiError(400, "this request takes no body")

    # -- queues ---------------------------------------------------------------
    def queue_view(self, q: Queue) -> dict[str, Any]:
        stats = self.broker.queue_stats(q)
        stats["arguments"] = _jsonable(stats["arguments"])
        stats["heldSessionCount"] = len(q.flow.held_sessions)
        return stats

    def _queue(self, name: str) -> Queue:
        q = self.broker.queues.get(name)
        if q is None:
            raise ApiError(404, f"queue {name!r} not found")
        return q

    def list_queues(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        return json_response(200, [self.queue_view(q) for _, q in sorted(self.broker.queues.items())])

    def get_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        return json_response(200, self.queue_view(self._queue(name)))

    def put_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """Declare: 201 created, 200 when it exists with the same settings, 409 when they differ."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("durable", "autoDelete", "arguments"))
        durable = _get(fields, "durable", bool, False)
        auto_delete = _get(fields, "autoDelete", bool, False)
        arguments = _get(fields, "arguments", dict, {})
        q = self.broker.queues.get(name)
        if q is not None:
            differs = [f"{key}: has {json.dumps(have)}, asked {json.dumps(want)}" for key, have, want in (
                ("durable", q.durable, durable), ("autoDelete", q.auto_delete, auto_delete),
                ("exclusive", q.exclusive, False), ("arguments", _jsonable(q.arguments), arguments),
            ) if have != want]
            if differs:
                raise ApiError(409, f"queue {name!r} already exists with other settings ({'; '.join(differs)})")
            return json_response(200, self.queue_view(q))
        q, _created = self.broker.declare_queue(name, durable, False, auto_delete, arguments)
        self.broker.flush()
        return json_response(201, self.queue_view(q))

    def patch_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """Change a live queue's limits and flow thresholds, validated as a declare."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("arguments",))
        arguments = _get(fields, "arguments", dict, required=True)
        q = self._queue(name)
        self.broker.modify_queue(q, arguments)
        self.broker.flush()  # a resume releases held transfers: their completions go out now
        return json_response(200, self.queue_view(q))

    def delete_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query, ("if_empty", "if_unused"))
        self._no_body(body)
        self._queue(name)
        messages = self.broker.delete_queue(name, _flag(query, "if_empty"), _flag(query, "if_unused"))
        self.broker.flush()
        return json_response(200, {"queue": name, "deleted": True, "messages": messages})

    def purge_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        self._no_body(body)
        self._queue(name)
        messages = self.broker.purge_queue(name)
        self.broker.flush()
        return json_response(200, {"queue": name, "purged": messages})

    # -- exchanges and bindings -----------------------------------------------
    def _exchange_view(self, name: str) -> dict[str, Any]:
        ex = self.broker.exchanges[name]
        return {"name": ex.name, "type": ex.type, "durable": ex.durable, "bindingCount": ex.binding_count}

    def list_exchanges(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        return json_response(200, [self._exchange_view(name) for name in sorted(self.broker.exchanges)])

    def get_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        if name not in self.broker.exchanges:
            raise ApiError(404, f"exchange {name!r} not found")
        return json_response(200, self._exchange_view(name))

    def put_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("type", "durable"))
        type_ = _get(fields, "type", str, required=True)
        durable = _get(fields, "durable", bool, False)
        created = self.broker.declare_exchange(name, type_, durable)
        return json_response(201 if created else 200, self._exchange_view(name))

    def delete_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query, ("if_unused",))
        self._no_body(body)
        self.broker.delete_exchange(name, _flag(query, "if_unused"))
        return json_response(200, {"exchange": name, "deleted": True})

    def list_bindings(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        return json_response(200, self.broker.bindings())

    def _binding(self, query: dict[str, str], body: bytes) -> tuple[str, str, str]:
        # DELETE bodies are unusual enough that some clients cannot send one:
        # the query string may carry the same three fields instead.
        if query and not body.strip():
            self._no_query(query, ("exchange", "queue", "key"))
            fields: dict[str, Any] = dict(query)
        else:
            self._no_query(query)
            fields = _fields(parse_json_object(body), ("exchange", "queue", "key"))
        return (_get(fields, "exchange", str, required=True), _get(fields, "queue", str, required=True),
                _get(fields, "key", str, ""))

    def add_binding(self, *, query: dict[str, str], body: bytes) -> Response:
        exchange, queue, key = self._binding(query, body)
        changed = self.broker.bind(exchange, queue, key)
        return json_response(201 if changed else 200, {"exchange": exchange, "queue": queue, "key": key})

    def delete_binding(self, *, query: dict[str, str], body: bytes) -> Response:
        exchange, queue, key = self._binding(query, body)
        if not self.broker.bind(exchange, queue, key, unbind=True):
            raise ApiError(404, f"exchange.unbind: queue {queue!r} is not bound to exchange {exchange!r} "
                                f"with key {key!r}")
        return json_response(200, {"exchange": exchange, "queue": queue, "key": key, "deleted": True})

    # -- connections, broker, metrics -------------------------------------------
    def _connections(self) -> list[Any]:
        conns = getattr(self.server, "connections", None) or ()
        return sorted(conns, key=lambda c: c.connected_at)

    def session_view(self, ssn: BrokerSession, now: float) -> dict[str, Any]:
        incomplete, held = _incomplete_and_held(ssn)
        held_by = []
        for q in self.broker.queues.values():
            if ssn in q.flow.held_sessions:
                since = ssn.held_since.get(q.name)
                held_by.append({"queue": q.name, "since": iso(since) if since else None,
                                "heldSeconds": round(now - since, 3) if since else None})
        held_by.sort(key=lambda h: h["heldSeconds"] or 0, reverse=True)
        return {
            "channel": ssn.channel, "name": ssn.name, "senderCapacity": ssn.capacity,
            "incompleteCommands": incomplete, "heldTransfers": held,
            "unackedDeliveries": ssn.unacked_count, "consumers": sorted(ssn.consumers),
            "flowStopped": bool(held_by), "heldBy": held_by,
        }

    def list_connections(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        now = self._clock()
        trio_now = _trio_now()
        out = []
        for conn in self._connections():
            age = max(0.0, trio_now - conn.connected_at) if trio_now is not None else 0.0
            out.append({
                "name": conn.name, "peer": conn.peer, "connectedAt": iso(now - age),
                "connectedSeconds": round(age, 3),
                "sessions": [self.session_view(s, now) for _, s in sorted(conn.sessions.items())],
            })
        return json_response(200, out)

    def get_broker(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        b = self.broker
        d = b.defaults
        options = {
            **self.options,
            "defaultFlowStopThreshold": d.stop_pct, "defaultFlowResumeThreshold": d.resume_pct,
            "defaultQueueLimit": d.queue_limit, "accounting": b.acct.name,
        }
        totals = {"queues": len(b.queues), "exchanges": len(b.exchanges), "bindings": len(b.bindings()),
                  "connections": len(self._connections()), "sessions": len(b.sessions),
                  "msgDepth": 0, "byteDepth": 0, "msgTotalEnqueues": 0, "msgTotalDequeues": 0,
                  "byteTotalEnqueues": 0, "byteTotalDequeues": 0, "heldTransfers": 0, "flowStoppedQueues": 0,
                  "heldSessions": len({s for q in b.queues.values() for s in q.flow.held_sessions})}
        for q in b.queues.values():
            _count, _nbytes, flow_on, _stopped, held = b.acct.stats(q.slot)
            totals["msgDepth"] += q.count
            totals["byteDepth"] += q.nbytes
            totals["msgTotalEnqueues"] += q.total_enqueues
            totals["msgTotalDequeues"] += q.total_dequeues
            totals["byteTotalEnqueues"] += q.byte_total_enqueues
            totals["byteTotalDequeues"] += q.byte_total_dequeues
            totals["heldTransfers"] += held
            totals["flowStoppedQueues"] += bool(flow_on)
        return json_response(200, {
            "name": "qflowd", "version": __version__, "startedAt": iso(self.started_at),
            "uptimeSeconds": round(self._clock() - self.started_at, 3), "options": options, "totals": totals,
        })

    def index(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        seen: dict[str, list[str]] = {}
        for method, pattern, _ in _ROUTES:
            if pattern:
                seen.setdefault("/" + "/".join("{name}" if s == "{}" else s for s in pattern), []).append(method)
        return json_response(200, {"name": "qflowd", "version": __version__,
                                   "endpoints": [f"{' '.join(m)} {p}" for p, m in seen.items()]})

    def metrics(self, *, query: dict[str, str], body: bytes) -> Response:
        self._no_query(query)
        return Response(200, render_metrics(self.broker, self._connections(), self._clock() - self.started_at)
                        .encode(), METRICS_TYPE)


def _trio_now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # used outside trio (unit tests of the sans-I/O layer)
        return None


def _incomplete_and_held(ssn: BrokerSession) -> tuple[int, int]:
    """(incomplete commands, held transfers) of a session.

    Between input batches (which is whenever this runs: the broker flushes
    before any await) every command is complete except transfers held by flow
    control and execution.syncs waiting behind them. Both are read from the
    session's IncomingCommands, not copied, so the view cannot drift.
    """
    commands = ssn.commands
    incomplete = commands.incomplete_count()
    return incomplete, max(0, incomplete - commands.waiting_syncs)


# -- Prometheus text exposition (format 0.0.4), hand-written --------------------


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# (metric, type, help, value from queue_stats). Counter names end in _total.
_QUEUE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("qflow_queue_depth_messages", "gauge", "Messages on the queue, delivered-unacknowledged included (msgDepth).",
     "msgDepth"),
    ("qflow_queue_depth_bytes", "gauge", "Bytes of message bodies on the queue (byteDepth).", "byteDepth"),
    ("qflow_queue_flow_stopped", "gauge", "1 while the queue's producer flow control is active (flowStopped).",
     "flowStopped"),
    ("qflow_queue_flow_stops_total", "counter", "Times flow control became active (flowStoppedCount).",
     "flowStoppedCount"),
    ("qflow_queue_held_transfers", "gauge", "Transfers whose completion the queue holds (heldTransfers).",
     "heldTransfers"),
    ("qflow_queue_held_sessions", "gauge", "Sessions currently held by the queue's flow control.",
     "heldSessionCount"),
    ("qflow_queue_flow_stop_count", "gauge", "Flow stop threshold in messages, 0 = none (flowStopCount).",
     "flowStopCount"),
    ("qflow_queue_flow_resume_count", "gauge", "Flow resume threshold in messages (flowResumeCount).",
     "flowResumeCount"),
    ("qflow_queue_flow_stop_size", "gauge", "Flow stop threshold in bytes, 0 = none (flowStopSize).",
     "flowStopSize"),
    ("qflow_queue_flow_resume_size", "gauge", "Flow resume threshold in bytes (flowResumeSize).", "flowResumeSize"),
    ("qflow_queue_messages_enqueued_total", "counter", "Messages enqueued (msgTotalEnqueues).", "msgTotalEnqueues"),
    ("qflow_queue_messages_dequeued_total", "counter", "Messages dequeued (msgTotalDequeues).", "msgTotalDequeues"),
    ("qflow_queue_bytes_enqueued_total", "counter", "Bytes enqueued (byteTotalEnqueues).", "byteTotalEnqueues"),
    ("qflow_queue_bytes_dequeued_total", "counter", "Bytes dequeued (byteTotalDequeues).", "byteTotalDequeues"),
    ("qflow_queue_consumers", "gauge", "Subscriptions on the queue (consumerCount).", "consumerCount"),
    ("qflow_queue_discards_ring_total", "counter", "Messages a ring policy discarded (discardsRing).",
     "discardsRing"),
    ("qflow_queue_discards_overflow_total", "counter", "Transfers refused because the queue was full "
     "(discardsOverflow).", "discardsOverflow"),
)


def render_metrics(broker: Broker, connections: list[Any], uptime: float) -> str:
    """Every metric family, with one sample per queue labelled ``queue``."""
    out: list[str] = []

    def family(name: str, type_: str, help_: str, samples: Iterable[tuple[str, Any]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {type_}")
        for labels, value in samples:
            out.append(f"{name}{labels} {int(value) if type(value) is bool else value}")

    family("qflow_uptime_seconds", "gauge", "Seconds since the broker started.", [("", round(uptime, 3))])
    family("qflow_connections", "gauge", "Open protocol connections.", [("", len(connections))])
    family("qflow_sessions", "gauge", "Attached sessions.", [("", len(broker.sessions))])
    family("qflow_queues", "gauge", "Declared queues.", [("", len(broker.queues))])
    stats = []
    for name, q in sorted(broker.queues.items()):
        s = broker.queue_stats(q)
        s["heldSessionCount"] = len(q.flow.held_sessions)
        stats.append((f'{{queue="{_label(name)}"}}', s))
    for metric, type_, help_, key in _QUEUE_METRICS:
        family(metric, type_, help_, [(labels, s[key]) for labels, s in stats])
    return "\n".join(out) + "\n"


# -- the HTTP server: h11 on trio ------------------------------------------------


class _Reject(Exception):
    """Stop reading this request: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ManagementServer:
    """Serves a ManagementApi over HTTP/1.1.

    Guarantees: a request must arrive whole within ``timeout`` seconds of the
    previous response (else 408, or a silent close if nothing of it came);
    heads over 16 KiB (431), targets over 8 KiB (414), more than 64 headers (431) or bodies over 1 MiB
    (413) are refused without reading further; at most ``max_connections``
    at once (503 beyond). A faulty request closes its own connection only.
    """

    def __init__(self, api: ManagementApi, *, timeout: float = DEFAULT_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.api = api
        self.timeout = timeout
        self.max_connections = max_connections
        self.active = 0

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            if self.active >= self.max_connections:
                await self._send_raw(stream, error_response(503, "too many management connections"))
                return
            self.active += 1
            try:
                await self._connection(stream)
            finally:
                self.active -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away: nothing to answer
        except Exception:
            log.exception("management connection failed")
        finally:
            await trio.aclose_forcefully(stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        while True:
            received = [False]  # did any byte of this request arrive?
            request = None
            with trio.move_on_after(self.timeout) as scope:
                try:
                    request = await self._read_request(conn, stream, received)
                except _Reject as exc:
                    await self._respond(conn, stream, error_response(exc.status, exc.message), close=True)
                    await self._linger(stream)
                    return
            if scope.cancelled_caught:
                if received[0] or conn.trailing_data[0] or conn.their_state is not h11.IDLE:
                    await self._respond(conn, stream, error_response(
                        408, f"request not received in full within {self.timeout:g} seconds"), close=True)
                return  # an idle keep-alive connection simply closes
            if request is None:
                return
            method, target, body = request
            response = self.api.handle(method, target, body)
            with trio.move_on_after(self.timeout) as scope:
                await self._respond(conn, stream, response, head=method == "HEAD")
            if scope.cancelled_caught or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _read_request(self, conn: h11.Connection, stream: trio.SocketStream,
                            received: list[bool]) -> tuple[str, bytes, bytes] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Reject(exc.error_status_hint, f"malformed HTTP request: {exc}") from None
            if event is h11.NEED_DATA:
                if request is not None and conn.they_are_waiting_for_100_continue:
                    await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                data = await stream.receive_some(READ_SIZE)
                if data:
                    received[0] = True
                conn.receive_data(data)
            elif type(event) is h11.Request:
                request = event
                if event.http_version not in (b"1.0", b"1.1"):
                    raise _Reject(505, f"HTTP/{event.http_version.decode('ascii', 'replace')} is not supported; "
                                       "use HTTP/1.1")
                if len(event.target) > MAX_TARGET:
                    raise _Reject(414, f"request target longer than {MAX_TARGET} bytes")
                if len(event.headers) > MAX_HEADERS:
                    raise _Reject(431, f"more than {MAX_HEADERS} header fields")
                # h11 bounds a head only while it is incomplete; one that arrived whole in a single
                # read may be longer, so measure it (near enough: line ends and separators count 4).
                if sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD:
                    raise _Reject(431, f"request header fields longer than {MAX_HEAD} bytes")
                length = next((v for k, v in event.headers if k == b"content-length"), None)
                if length is not None and int(length) > MAX_BODY:  # h11 has checked it is digits
                    raise _Reject(413, f"request body of {int(length)} bytes exceeds the limit of {MAX_BODY}")
            elif type(event) is h11.Data:
                body += event.data
                if len(body) > MAX_BODY:
                    raise _Reject(413, f"request body exceeds the limit of {MAX_BODY} bytes")
            elif type(event) is h11.EndOfMessage:
                assert request is not None
                return request.method.decode("ascii", "replace"), bytes(request.target), bytes(body)
            elif type(event) is h11.ConnectionClosed:
                return None
            else:  # PAUSED cannot happen before EndOfMessage; anything else ends the connection
                return None

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, response: Response, *,
                       close: bool = False, head: bool = False) -> None:
        headers = _headers(response, close)
        try:
            data = conn.send(h11.Response(status_code=response.status, headers=headers,
                                          reason=_reason(response.status)))
            if not head:
                data += conn.send(h11.Data(data=response.body))
            data += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            # h11 will not frame a response here (say, after a half-sent one): nothing sane to add.
            return
        await stream.send_all(data)

    async def _send_raw(self, stream: trio.SocketStream, response: Response) -> None:
        head = f"HTTP/1.1 {response.status} {_reason(response.status).decode()}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in _headers(response, True)) + "\r\n"
        with trio.move_on_after(self.timeout):
            await stream.send_all(head.encode() + response.body)
            await self._linger(stream)

    async def _linger(self, stream: trio.SocketStream) -> None:
        """Half-close and drain a little, so a client still sending the body
        we refused reads our answer instead of a connection reset."""
        try:
            await stream.send_eof()
            with trio.move_on_after(min(self.timeout, 2.0)):
                drained = 0
                while drained < 4 * MAX_BODY:
                    data = await stream.receive_some(READ_SIZE)
                    if not data:
                        break
                    drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def _headers(response: Response, close: bool) -> list[tuple[str, str]]:
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               ("server", f"qflowd/{__version__}"), ("cache-control", "no-store"), *response.headers]
    if close:
        headers.append(("connection", "close"))
    return headers


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
