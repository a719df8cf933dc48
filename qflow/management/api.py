"""The management JSON API: request in, view or change, response out. No I/O.

``ManagementApi.handle(method, target, body)`` routes one request and returns
a ``Response``, sans-I/O as h11 itself is built; ``http.ManagementServer``
carries it over HTTP. This module owns what the routes mean: which URL does
what, the validation of paths, query strings and JSON bodies, and how broker
refusals become HTTP statuses. What a GET shows is a view from ``views``, the
same one ``/metrics`` renders; the API keeps no copy of the broker's state
(the only thing it owns is its start time). It calls the broker synchronously,
which is safe because it runs on the broker's trio thread and never awaits in
between; after a change it calls ``Broker.flush`` so completions and
deliveries the change caused go out.

Routes (JSON in and out; names in paths are percent-decoded, so any queue name
is addressable, ``/`` as ``%2F``)::

    GET    /api/queues                 GET|PUT|PATCH|DELETE /api/queues/{name}
    POST   /api/queues/{name}/purge    GET /api/exchanges    GET|PUT|DELETE /api/exchanges/{name}
    GET|POST|DELETE /api/bindings      GET /api/connections  DELETE /api/connections/{peer}
    GET    /api/broker                 GET /metrics
    POST   /api/acl/reload             GET /api (this list)
    GET    /  and  /console/{file}     the web console (qflow.management.console)
    GET    /api/events                 the console's live feed: server-sent events (qflow.management.events)

With an ACL (--acl-file), every request is checked as the client command
that does the same would be, for the user of its HTTP Basic credentials
("anonymous" without): GET of a queue or exchange is ``access`` on it (the
lists show only what the user may access), PUT ``create``, PATCH ``update``,
DELETE ``delete``, purge ``purge``, POST/DELETE of a binding
``bind``/``unbind``, GET /api/broker and /metrics ``access broker``, and the
reload ``update broker``. /api/connections shows other users' connections
only to a user allowed ``access broker``. A denial is a 403. The console's
page and files are the same for everyone (no data in them); its event
stream is filtered as the routes it mirrors are, snapshot by snapshot.

Errors are ``{"error": "..."}`` with a 4xx status: 400 bad input, 404 missing,
405 wrong method, 409 conflict (a broker precondition, a lock, a declare that
differs from what exists), and 503 when the durable store cannot record a
change (nothing is changed then); the server adds 408/413/414/431 for requests it
will not read. Bad input never yields a 500; a 500 means a bug in qflow, and
is logged.
"""

from __future__ import annotations

import json
import logging
import math
import time
import weakref
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes, urlsplit

import trio

from qflow import __version__
from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.acl import AclDenied, queue_request
from qflow.broker.arguments import refuse_unsupported
from qflow.broker.queue import Queue
from qflow.management.console import SECURITY_HEADERS, asset
from qflow.management.events import EventStream, Feed
from qflow.management.metrics import CONTENT_TYPE as METRICS_TYPE
from qflow.management.metrics import OPENMETRICS_TYPE, render_metrics, wants_openmetrics
from qflow.management.views import (
    binding_views,
    broker_view,
    connection_views,
    exchange_view,
    exchange_views,
    iso,
    jsonable,
    live_connections,
    queue_view,
    queue_views,
    subscription_views,
)
from qflow.protocol import CommandError
from qflow.protocol.names import name_problem, printable

log = logging.getLogger("qflow.management")

LOG_LEVELS = ("debug", "info", "warning", "error")  # as qflowd --log-level names them

MAX_QUERY_FIELDS = 16
# Queues viewed in one step of a console snapshot (events.Feed): about 12 ms of the broker's
# time each; everyone else is served between two.
SNAPSHOT_STEP = 500
MAX_JSON_DEPTH = 32

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
    P.INTERNAL_ERROR: 503,  # the store cannot record a durable change (qflow.store.definitions): not the request's fault
}

JSON_TYPE = "application/json"


class ApiError(Exception):
    """A request the API refuses: ``status`` and a message for the operator."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class Pending:
    """A response whose work is done in steps of bounded size (qflow.broker.broker.SLICE):
    :meth:`step` runs one, ends the broker's batch, and gives the Response after the last."""

    __slots__ = ("broker", "steps", "answer", "answered")

    def __init__(self, broker: Broker, steps: Any, answer: Callable[[int], Response]) -> None:
        self.broker = broker
        self.steps = steps
        self.answer = answer
        self.answered: Callable[[Response], None] | None = None  # told the Response (the change's log line)

    def step(self) -> Response | None:
        """Run one step and end the broker's batch; the Response after the last step, else None."""
        try:
            next(self.steps)
        except StopIteration as stop:
            response = self.answer(stop.value)
            if self.answered is not None:
                self.answered(response)
            return response
        finally:
            self.broker.flush()  # a dequeue may release held transfers: their completions go out now
        return None


@dataclass
class Response:
    """One answer: status, body and its content type, and any extra headers (say, ``allow``)."""

    status: int
    body: bytes
    content_type: str = JSON_TYPE
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_response(status: int, value: Any) -> Response:
    """``value`` as a JSON response (UTF-8, no NaN: views never hold one)."""
    return Response(status, json.dumps(value, ensure_ascii=False, allow_nan=False).encode() + b"\n")


def error_response(status: int, message: str, headers: list[tuple[str, str]] | None = None) -> Response:
    """The ``{"error": message}`` body every refusal has."""
    return Response(status, json.dumps({"error": message}, ensure_ascii=False).encode() + b"\n",
                    headers=headers or [])


# -- input validation -----------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is ``{}``.

    Raises:
      ApiError: 400, saying what is wrong, for a body that is not UTF-8 JSON
        holding one object (NaN and Infinity refused).
    """
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


def _check_new_name(kind: str, name: str) -> None:
    """A name for a new queue or exchange (qflow.protocol.names); 400 naming it.
    Names the broker holds already, recovered from older data, stay usable."""
    problem = name_problem(name)
    if problem is not None:
        raise ApiError(400, f"{kind} name {name[:300]!r}: {problem}")


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
    ("DELETE", ("api", "connections", "{}"), "delete_connection"),
    ("GET", ("api", "subscriptions"), "list_subscriptions"),
    ("GET", ("api", "broker"), "get_broker"),
    ("POST", ("api", "acl", "reload"), "reload_acl"),
    ("GET", ("api", "broker", "log-level"), "get_log_level"),
    ("PUT", ("api", "broker", "log-level"), "put_log_level"),
    ("GET", ("metrics",), "metrics"),
    ("GET", ("api", "events"), "events"),
    ("GET", ("api",), "index"),
    ("GET", (), "console"),
    ("GET", ("console", "{}"), "console_asset"),
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
    """The management API: each request routed to the live broker. No I/O.

    One method a route (``_ROUTES``), taking the NAME of its path (if it has
    one), ``query`` (the query parameters) and ``body`` (the request body);
    :meth:`handle` finds it, and turns what it raises (ApiError, the ACL's
    refusal, the broker's CommandError) into the response that says why.

    Args:
      broker: the broker it reads and changes.
      server: the protocol server (anything with ``connections``, each having
        ``peer``, ``name``, ``sessions`` and ``connected_at`` in trio time).
      options: the daemon's settings, reported under ``/api/broker``.
      clock: the wall clock (tests give their own).
      store: the durable message store (anything with ``stats()``, as
        qflow.store.message_store.MessageStore); None without a data directory.
      memory: the memory alarm (qflow.broker.memory_alarm.MemoryAlarm); None: none.
      reload_acl: reads the ACL file again and puts it in force, returning
        what to report (it raises ValueError, saying why, for a file it
        refuses); None: no ACL file.
    """

    def __init__(self, broker: Broker, server: Any = None, options: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.time, store: Any = None, memory: Any = None,
                 reload_acl: Callable[[], dict[str, Any]] | None = None) -> None:
        self.broker = broker
        self.reload = reload_acl
        # Who asks, for the ACL: set by handle() for each request (synchronous: one request at a time).
        self.user = "anonymous"
        self.accept = ""  # the request's Accept header: /metrics serves OpenMetrics if it asks for it
        self.server = server
        self.store = store
        self.memory = memory
        self.options = dict(options or {})
        self._clock = clock
        self.started_at = clock()
        # user -> the console feed their streams share, while one of them holds it
        self._feeds: weakref.WeakValueDictionary[str, Feed] = weakref.WeakValueDictionary()

    # -- entry point ----------------------------------------------------------
    def handle(self, method: str, target: bytes, body: bytes = b"", user: str = "anonymous",
               peer: str = "", accept: str = "") -> Response | EventStream:
        """Answer one request of ``user`` (checked against the ACL, if any).
        Never raises: refusals become 4xx responses. ``GET /api/events`` is
        answered with an EventStream, whose events the server writes. A change (any method but
        GET and HEAD) is logged at info with who asked (``peer``, the HTTP
        client's address, and ``user``) and whether it was made or refused.

        Args:
          method: the HTTP method (HEAD is answered as GET).
          target: the request target, path and query, as it arrived.
          body: the request body.
          user: the authenticated user (``anonymous`` without ``--auth``).
          peer: the HTTP client's address, for the log.
          accept: the request's Accept header (``/metrics`` heeds it).
        """
        response = self.handle_in_steps(method, target, body, user, peer, accept)
        while type(response) is Pending:
            response = response.step() or response
        return response

    def handle_in_steps(self, method: str, target: bytes, body: bytes = b"", user: str = "anonymous",
                        peer: str = "", accept: str = "") -> Response | Pending | EventStream:
        """As :meth:`handle`, but a purge or delete of a deep queue gives a
        :class:`Pending` whose steps the server runs, serving others between;
        the change is logged once its response is known."""
        self.user = user
        self.accept = accept
        response = self._handle(method, target, body)
        if type(response) is Pending:
            response.answered = lambda done: self._log_change(method, target, body, user, peer, done)
        else:
            self._log_change(method, target, body, user, peer, response)
        return response

    @staticmethod
    def _log_change(method: str, target: bytes, body: bytes, user: str, peer: str, response: Response) -> None:
        if method not in ("GET", "HEAD"):
            outcome = "done" if response.status < 400 else "refused"
            detail = body.decode("utf-8", "backslashreplace").strip()
            if response.status >= 400:
                try:
                    detail = json.loads(response.body).get("error", "")
                except (ValueError, AttributeError):
                    pass
            log.info("management change by %s (user '%s'): %s %s %s (%d)%s", peer or "?", printable(user), method,
                     printable(target.decode("ascii", "backslashreplace")[:300]), outcome, response.status,
                     f": {printable(detail[:300])}" if detail else "")

    def _handle(self, method: str, target: bytes, body: bytes) -> Response | Pending | EventStream:
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
        except AclDenied as exc:
            return error_response(403, exc.text)
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

    # -- access control -------------------------------------------------------
    def _allow(self, action: str, obj: str, request: dict[str, Any]) -> None:
        self.broker.authorize(self.user, action, obj, request)

    def _may(self, action: str, obj: str, request: dict[str, Any]) -> bool:
        acl = self.broker.acl
        return acl is None or acl.may(self.user, action, obj, request)

    def reload_acl(self, *, query: dict[str, str], body: bytes) -> Response:
        """Read the ACL file again; a file it refuses (400, naming the line) leaves the old rules in force."""
        self._no_query(query)
        self._no_body(body)
        self._allow("update", "broker", {})
        if self.reload is None:
            raise ApiError(409, "this broker has no ACL file to reload (start qflowd with --acl-file FILE)")
        try:
            report = self.reload()
        except ValueError as exc:
            raise ApiError(400, f"ACL not reloaded, the old rules stay in force: {exc}") from None
        return json_response(200, report)

    # -- queues ---------------------------------------------------------------
    def _queue(self, name: str) -> Queue:
        q = self.broker.queues.get(name)
        if q is None:
            raise ApiError(404, f"queue {name!r} not found")
        return q

    def list_queues(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/queues: every queue's view that this user may access."""
        self._no_query(query)
        views = queue_views(self.broker)
        if self.broker.acl is not None:
            views = [v for v in views if self._may("access", "queue", {"name": v["name"]})]
        return json_response(200, views)

    def get_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/queues/NAME: the queue's view (404 if there is none)."""
        self._no_query(query)
        self._allow("access", "queue", {"name": name})
        return json_response(200, queue_view(self.broker, self._queue(name)))

    def put_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """Declare: 201 created, 200 when it exists with the same settings, 409 when they differ."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("durable", "autoDelete", "arguments"))
        durable = _get(fields, "durable", bool, False)
        auto_delete = _get(fields, "autoDelete", bool, False)
        arguments = _get(fields, "arguments", dict, {})
        refuse_unsupported(f"queue.declare {name!r}", "queue", arguments)  # an existing queue's too
        self._allow("create", "queue", queue_request(name, arguments, durable=durable, autodelete=auto_delete,
                                                     exclusive=False))
        q = self.broker.queues.get(name)
        if q is None:
            _check_new_name("queue", name)
        if q is not None:
            differs = [f"{key}: has {json.dumps(have)}, asked {json.dumps(want)}" for key, have, want in (
                ("durable", q.durable, durable), ("autoDelete", q.auto_delete, auto_delete),
                ("exclusive", q.exclusive, False), ("arguments", jsonable(q.arguments), arguments),
            ) if have != want]
            if differs:
                raise ApiError(409, f"queue {name!r} already exists with other settings ({'; '.join(differs)})")
            return json_response(200, queue_view(self.broker, q))
        q, _created = self.broker.declare_queue(name, durable, False, auto_delete, arguments)
        self.broker.flush()
        return json_response(201, queue_view(self.broker, q))

    def patch_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """Change a live queue's limits and flow thresholds, validated as a declare."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("arguments",))
        arguments = _get(fields, "arguments", dict, required=True)
        self._allow("update", "queue", queue_request(name, arguments))
        q = self._queue(name)
        self.broker.modify_queue(q, arguments)
        self.broker.flush()  # a resume releases held transfers: their completions go out now
        return json_response(200, queue_view(self.broker, q))

    def delete_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Pending:
        """DELETE /api/queues/NAME[?if_empty&if_unused]: delete it, its messages let go of in steps."""
        self._no_query(query, ("if_empty", "if_unused"))
        self._no_body(body)
        self._allow("delete", "queue", {"name": name})
        self._queue(name)
        steps = self.broker.delete_queue_steps(name, _flag(query, "if_empty"), _flag(query, "if_unused"))
        return Pending(self.broker, steps,
                       lambda messages: json_response(200, {"queue": name, "deleted": True, "messages": messages}))

    def purge_queue(self, name: str, *, query: dict[str, str], body: bytes) -> Pending:
        """POST /api/queues/NAME/purge: remove the messages available now, in steps."""
        self._no_query(query)
        self._no_body(body)
        self._allow("purge", "queue", {"name": name})
        self._queue(name)
        return Pending(self.broker, self.broker.purge_steps(name),
                       lambda messages: json_response(200, {"queue": name, "purged": messages}))

    # -- exchanges and bindings -----------------------------------------------
    def list_exchanges(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/exchanges: every exchange's view that this user may access."""
        self._no_query(query)
        views = exchange_views(self.broker)
        if self.broker.acl is not None:
            views = [v for v in views if self._may("access", "exchange", {"name": v["name"] or "amq.default"})]
        return json_response(200, views)

    def get_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/exchanges/NAME: the exchange's view (404 if there is none)."""
        self._no_query(query)
        self._allow("access", "exchange", {"name": name or "amq.default"})
        ex = self.broker.exchanges.get(name)
        if ex is None:
            raise ApiError(404, f"exchange {name!r} not found")
        return json_response(200, exchange_view(ex))

    def put_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """PUT /api/exchanges/NAME ``{"type", "durable"}``: declare it; 201 created, 200 if it existed."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("type", "durable", "arguments"))
        type_ = _get(fields, "type", str, required=True)
        durable = _get(fields, "durable", bool, False)
        arguments = _get(fields, "arguments", dict, {})
        # Those another broker acts on and qflow does not are refused by name, as for queues.
        refuse_unsupported(f"exchange.declare {name!r}", "exchange", arguments)
        if name not in self.broker.exchanges:
            _check_new_name("exchange", name)
        self._allow("create", "exchange", {"name": name, "type": type_, "durable": durable})
        created = self.broker.declare_exchange(name, type_, durable, arguments=arguments)
        return json_response(201 if created else 200, exchange_view(self.broker.exchanges[name]))

    def delete_exchange(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """DELETE /api/exchanges/NAME[?if_unused]: delete it and its bindings."""
        self._no_query(query, ("if_unused",))
        self._no_body(body)
        self._allow("delete", "exchange", {"name": name})
        self.broker.delete_exchange(name, _flag(query, "if_unused"))
        return json_response(200, {"exchange": name, "deleted": True})

    def list_bindings(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/bindings: every binding of an exchange this user may access."""
        self._no_query(query)
        views = binding_views(self.broker)
        if self.broker.acl is not None:
            views = [v for v in views if self._may("access", "exchange", {"name": v["exchange"]})]
        return json_response(200, views)

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
        """POST /api/bindings ``{"exchange", "queue", "key"}``: bind; 201 if new, 200 if it existed."""
        exchange, queue, key = self._binding(query, body)
        self._allow("bind", "exchange", {"name": exchange, "queuename": queue, "routingkey": key})
        changed = self.broker.bind(exchange, queue, key)
        return json_response(201 if changed else 200, {"exchange": exchange, "queue": queue, "key": key})

    def delete_binding(self, *, query: dict[str, str], body: bytes) -> Response:
        """DELETE /api/bindings (fields in the body or the query): unbind; 404 if not bound."""
        exchange, queue, key = self._binding(query, body)
        self._allow("unbind", "exchange", {"name": exchange, "queuename": queue, "routingkey": key})
        if not self.broker.bind(exchange, queue, key, unbind=True):
            raise ApiError(404, f"exchange.unbind: queue {queue!r} is not bound to exchange {exchange!r} "
                                f"with key {key!r}")
        return json_response(200, {"exchange": exchange, "queue": queue, "key": key, "deleted": True})

    # -- connections, broker, metrics -------------------------------------------
    def list_connections(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/connections: the protocol connections (only the user's own without ``access broker``)."""
        self._no_query(query)
        views = connection_views(self.broker, self.server, self._clock(), _trio_now())
        if not self._may("access", "broker", {}):  # isolation: one's own connections only
            views = [v for v in views if v["user"] == self.user]
        return json_response(200, views)

    def delete_connection(self, peer: str, *, query: dict[str, str], body: bytes) -> Response:
        """Close the protocol connection whose ``peer`` (its client's address, as /api/connections
        shows it) is given: the client gets connection.close 320 naming who closed it. Needs
        ``update broker``; logged as every change is."""
        self._no_query(query)
        self._no_body(body)
        self._allow("update", "broker", {})
        conn = next((c for c in live_connections(self.server) if c.peer == peer), None)
        if conn is None:
            raise ApiError(404, f"connection {peer!r} not found (GET /api/connections names them by peer)")
        conn.close_by_operator(f"closed by an operator (user '{printable(self.user)}', management API)")
        return json_response(200, {"connection": peer, "closed": True})

    def list_subscriptions(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/subscriptions: the subscriptions (only the user's own without ``access broker``)."""
        self._no_query(query)
        views = subscription_views(self.server)
        if not self._may("access", "broker", {}):  # isolation, as for connections: one's own only
            views = [v for v in views if v["user"] == self.user]
        return json_response(200, views)

    def broker_view(self, queues: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``views.broker_view`` with this API's server, options and start time."""
        return broker_view(self.broker, self.server, self.options, self.started_at, self._clock(), queues,
                           self.store, self.memory)

    def get_broker(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/broker: the broker's view (options, totals, store, memory alarm)."""
        self._no_query(query)
        self._allow("access", "broker", {})
        return json_response(200, self.broker_view())

    def get_log_level(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api/broker/log-level: the broker's log level now."""
        self._no_query(query)
        self._allow("access", "broker", {})
        return json_response(200, {"level": logging.getLevelName(logging.getLogger().level).lower()})

    def put_log_level(self, *, query: dict[str, str], body: bytes) -> Response:
        """Change the broker's log level at run time (qflowd --log-level's names): ``{"level": "debug"}``."""
        self._no_query(query)
        fields = _fields(parse_json_object(body), ("level",))
        level = _get(fields, "level", str, required=True)
        if level.lower() not in LOG_LEVELS:
            raise ApiError(400, f"field 'level' must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
        self._allow("update", "broker", {})  # as qpidd's setLogLevel and reloading the ACL
        logging.getLogger().setLevel(level.upper())
        return json_response(200, {"level": level.lower()})

    def index(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /api: the API's name, version and endpoints."""
        self._no_query(query)
        seen: dict[str, list[str]] = {}
        for method, pattern, _ in _ROUTES:
            if pattern:
                seen.setdefault("/" + "/".join("{name}" if s == "{}" else s for s in pattern), []).append(method)
        return json_response(200, {"name": "qflowd", "version": __version__,
                                   "endpoints": [f"{' '.join(m)} {p}" for p, m in seen.items()]})

    # -- the web console ------------------------------------------------------------
    def console(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /: the web console's page."""
        self._no_query(query)
        return self.console_asset("index.html", query=query, body=body)

    def console_asset(self, name: str, *, query: dict[str, str], body: bytes) -> Response:
        """GET /console/NAME: one of the web console's files (404 if there is none)."""
        self._no_query(query)
        found = asset(name)
        if found is None:
            raise ApiError(404, f"no such console file: {name[:100]!r}")
        content, media_type = found
        return Response(200, content, media_type, list(SECURITY_HEADERS))

    def events(self, *, query: dict[str, str], body: bytes) -> EventStream:
        """The console's feed: a snapshot of :meth:`snapshot` for this user every half second
        (or less often on a large broker), shared by all this user's streams."""
        self._no_query(query)
        user = self.user
        feed = self._feeds.get(user)
        if feed is None:
            feed = self._feeds[user] = Feed(lambda: self.snapshot_steps(user), time.monotonic)
        return EventStream(feed)

    def snapshot(self, user: str) -> dict[str, Any]:
        """:meth:`snapshot_steps` all at once, as one dict."""
        steps = self.snapshot_steps(user)
        queues: list[dict[str, Any]] = []
        while True:
            try:
                queues.extend(next(steps))
            except StopIteration as stop:
                return {**stop.value, "queues": queues}

    def snapshot_steps(self, user: str) -> Generator[list[dict[str, Any]], None, dict[str, Any]]:
        """What the console shows, as ``user`` may see it, in steps: yields the queues'
        views (as /api/queues) SNAPSHOT_STEP queues at a time, then returns the
        connections (as /api/connections) and, if allowed ``access broker``, the broker's
        version, uptime and totals (as /api/broker), with the time and the user. Others
        may be served between two steps: a queue deleted meanwhile is left out."""
        names = sorted(self.broker.queues)
        self.user = user
        may_see_broker = self._may("access", "broker", {})
        acl = self.broker.acl is not None
        everything: list[dict[str, Any]] = []  # every queue's view, for the broker's totals
        for first in range(0, len(names), SNAPSHOT_STEP):
            self.user = user  # another request may have run since the last step
            shown = []
            for name in names[first:first + SNAPSHOT_STEP]:
                q = self.broker.queues.get(name)
                if q is None:
                    continue
                visible = not acl or self._may("access", "queue", {"name": name})
                if visible or may_see_broker:
                    view = queue_view(self.broker, q)
                    everything.append(view)
                    if visible:
                        shown.append(view)
            yield shown
        self.user = user
        connections = connection_views(self.broker, self.server, self._clock(), _trio_now())
        broker = None
        if may_see_broker:
            full = self.broker_view(everything)
            broker = {key: full[key] for key in ("name", "version", "startedAt", "uptimeSeconds", "totals")}
        else:
            connections = [v for v in connections if v["user"] == user]
        return {"time": iso(self._clock()), "user": user, "broker": broker, "connections": connections}

    def metrics(self, *, query: dict[str, str], body: bytes) -> Response:
        """GET /metrics: the Prometheus metrics, OpenMetrics if the Accept header asks for it."""
        self._no_query(query)
        self._allow("access", "broker", {})
        queues = queue_views(self.broker)  # built once: the totals and the per-queue samples share them
        openmetrics = wants_openmetrics(self.accept)
        text = render_metrics(self.broker_view(queues), queues, exchange_views(self.broker), openmetrics=openmetrics)
        return Response(200, text.encode(), OPENMETRICS_TYPE if openmetrics else METRICS_TYPE)


def _trio_now() -> float | None:
    """Trio's clock, which connections' ``connected_at`` is measured on."""
    try:
        return trio.current_time()
    except RuntimeError:  # used outside trio (unit tests of the sans-I/O layer)
        return None


