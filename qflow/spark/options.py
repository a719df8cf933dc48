"""The data source's options: what Spark hands over as strings, checked and
typed once, on the driver, before anything runs.

An option that is missing, malformed, or not one this side knows (a
misspelling, a writer's option given to a reader) is a QflowOptionError
naming it; docs/spark.md, "Options", lists them. What the options say
pickles: Spark ships it to every task, which opens its own connection with
it (qflow.spark.connection).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import qflow
from qflow.client.address import AddressError, parse_address

DEFAULT_BROKER = "127.0.0.1:5672"
DEFAULT_CAPACITY = 1000


class QflowOptionError(ValueError):
    """A qflow data source option is missing or malformed."""


def _lower(options: Mapping[str, str], known: frozenset[str], refused: frozenset[str] = frozenset()) -> dict[str, str]:
    """The options with lower-cased keys (Spark hands them over so; lowered
    again in case a caller builds the source directly). An option this side
    does not know is refused, naming it: a misspelt option must not be
    silently ignored (those Spark itself may set, such as ``path``, are let through).
    The ``refused`` ones are let through to a refusal of their own, and not
    listed among the options here."""
    opts = {str(k).lower(): str(v) for k, v in dict(options).items()}
    unknown = sorted(k for k in set(opts) - known - refused - _SPARK_OPTIONS if not k.startswith("__"))
    if unknown:
        raise QflowOptionError(f"qflow: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                               f"(options here: {', '.join(sorted(known))})")
    return opts


# Spark's own options, which it hands on to a source or sink (DataStreamWriter's queryName and
# checkpointLocation, the path of load()/save()); and "__"-prefixed ones are Spark's internals.
_SPARK_OPTIONS = frozenset({"path", "paths", "checkpointlocation", "queryname"})
_ENDPOINT_OPTIONS = frozenset({"broker", "connecttimeout", "username", "password", "ssl", "sslcafile",
                               "sslcertfile", "sslkeyfile"})
READ_OPTIONS = _ENDPOINT_OPTIONS | {"queue", "queuepattern", "numpartitions", "maxmessagespertrigger",
                                    "startingoffsets", "endingoffsets", "failondataloss"}
# Known, and refused with the reason: consume=true would lose data (see ReadOptions.parse).
REFUSED_READ_OPTIONS = frozenset({"consume"})
WRITE_OPTIONS = _ENDPOINT_OPTIONS | {"queue", "exchange", "routingkey", "capacity", "sendtimeout", "writeid",
                                     "durable"}


# What each AddressError.problem of option 'broker' says.
_BROKER_PROBLEMS = {
    "empty": "qflow option 'broker' is empty: use host:port, e.g. 127.0.0.1:5672",
    "brackets": "qflow option 'broker' {value!r} is not [address]:port",
    "ipv6": "qflow option 'broker' {value!r}: write an IPv6 address as [address]:port",
    "no host": "qflow option 'broker' {value!r} has no host",
    "host": "qflow option 'broker' {value!r}: {host!r} is not a host name or address",
    "port": "qflow option 'broker' {value!r}: port {port!r} is not a number",
    "range": "qflow option 'broker' {value!r}: port must be 1..65535",
}


def parse_broker(value: str) -> tuple[str, int]:
    """The host and port of option ``broker``.

    ``host:port``, ``[v6-address]:port`` or ``host`` (port 5672), as
    :func:`qflow.client.address.parse_address` reads them; a host is needed.

    Args:
      value: the option's value.

    Raises:
      QflowOptionError: naming the option, its value and what is wrong.
    """
    try:
        return parse_address(value)
    except AddressError as exc:
        raise QflowOptionError(_BROKER_PROBLEMS[exc.problem].format(value=value, host=exc.host, port=exc.port)
                               ) from None


def _int(opts: dict[str, str], key: str, name: str, default: int | None, minimum: int) -> int | None:
    if key not in opts:
        return default
    try:
        value = int(opts[key].strip())
    except ValueError:
        raise QflowOptionError(f"qflow option '{name}' must be an integer, not {opts[key]!r}") from None
    if value < minimum:
        raise QflowOptionError(f"qflow option '{name}' must be at least {minimum}, not {value}")
    return value


def _float(opts: dict[str, str], key: str, name: str, default: float | None) -> float | None:
    if key not in opts:
        return default
    text = opts[key].strip().lower()
    if text in ("", "none", "inf", "infinite", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise QflowOptionError(f"qflow option '{name}' must be a number of seconds, not {opts[key]!r}") from None
    if not value > 0 or math.isinf(value):
        return None
    return value


def _bool(opts: dict[str, str], key: str, name: str, default: bool) -> bool:
    if key not in opts:
        return default
    text = opts[key].strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise QflowOptionError(f"qflow option '{name}' must be true or false, not {opts[key]!r}")


@dataclass(frozen=True)
class Endpoint:
    """Where the broker is and how to authenticate to it: the options every
    side takes (``broker``, ``connectTimeout``, the credentials and TLS).

    It holds file names, not an SSL context, and so pickles; the password
    never appears in its repr (a plan, a log).
    """

    host: str
    port: int
    connect_timeout: float
    username: str | None = None  # with password: SCRAM-SHA-256, for a broker with --auth yes
    password: str | None = field(default=None, repr=False)  # never in a plan or a log
    # TLS (option ssl=true): the files are paths that every executor reads when it connects (an
    # SSLContext does not pickle). A client certificate without a username authenticates as its CN.
    ssl: bool = False
    ssl_ca_file: str | None = None  # CA certificates (PEM) of the broker's certificate; None: the system's
    ssl_cert_file: str | None = None  # this client's certificate (PEM), for mutual TLS
    ssl_key_file: str | None = None  # its key, if not in ssl_cert_file

    @classmethod
    def parse(cls, opts: dict[str, str]) -> Endpoint:
        """The endpoint that options (names in lower case) give.

        Raises:
          QflowOptionError: naming an option that is malformed, or one given
            without the option it goes with.
        """
        host, port = parse_broker(opts.get("broker", DEFAULT_BROKER))
        timeout = _float(opts, "connecttimeout", "connectTimeout", 10.0) or 10.0
        username, password = opts.get("username"), opts.get("password")
        if (username is None) != (password is None):
            raise QflowOptionError("qflow options 'username' and 'password' go together: give both or neither")
        if username is not None and not username:
            raise QflowOptionError("qflow option 'username' is empty")
        tls = _bool(opts, "ssl", "ssl", False)
        files = {key: opts.get(key.lower()) for key in ("sslCaFile", "sslCertFile", "sslKeyFile")}
        given = [key for key, value in files.items() if value is not None]
        if given and not tls:
            raise QflowOptionError(f"qflow option '{given[0]}' is for TLS: add option ssl=true (and the broker's "
                                   "TLS port, qflowd --ssl-port, in option broker)")
        if files["sslKeyFile"] is not None and files["sslCertFile"] is None:
            raise QflowOptionError("qflow option 'sslKeyFile' goes with option 'sslCertFile'")
        return cls(host, port, timeout, username, password, tls, files["sslCaFile"], files["sslCertFile"],
                   files["sslKeyFile"])

    def connect_options(self) -> dict[str, Any]:
        """The keyword arguments of qflow.open_connection for this endpoint:
        credentials, the TLS context (the files read now), the SASL mechanism.

        Raises:
          QflowOptionError: if a TLS file cannot be read or used.
        """
        options: dict[str, Any] = {} if self.username is None else {"username": self.username,
                                                                   "password": self.password}
        if self.ssl:
            try:
                options["ssl_context"] = qflow.tls_context(self.ssl_ca_file, self.ssl_cert_file, self.ssl_key_file)
            except OSError as exc:  # ssl.SSLError included
                raise QflowOptionError(f"qflow options sslCaFile/sslCertFile/sslKeyFile: cannot load "
                                       f"{getattr(exc, 'filename', None) or 'a file'}: "
                                       f"{getattr(exc, 'strerror', None) or exc}") from None
            if self.username is None and self.ssl_cert_file is not None:
                options["mechanism"] = "EXTERNAL"
        return options


def _sequence(text: str, name: str, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise QflowOptionError(f"qflow option '{name}' must be {words} or a sequence number (or, per queue, a "
                               f"JSON object), not {text!r}") from None
    if value < 1:
        raise QflowOptionError(f"qflow option '{name}': sequence numbers start at 1, not {value}")
    return value


# Kafka's per-partition JSON offsets: -2 is earliest, -1 latest.
_KAFKA_WORDS = {-2: "earliest", -1: "latest"}


def _per_queue(text: str, name: str, allowed: tuple[str, ...]) -> dict[str, str | int]:
    """``{"q1": 17, "q2": "earliest", "q3": -1}``: a JSON object of queue name
    to a sequence number or one of ``allowed`` (as a word, or Kafka's -2/-1)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise QflowOptionError(f"qflow option '{name}' is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise QflowOptionError(f"qflow option '{name}': a JSON object of queue name to offset, not {text!r}")
    words = " or ".join(allowed)
    out: dict[str, str | int] = {}
    for queue_name, v in value.items():
        if isinstance(v, int) and not isinstance(v, bool) and v in _KAFKA_WORDS:
            v = _KAFKA_WORDS[v]
        if isinstance(v, str) and v.strip().lower() in allowed:
            out[queue_name] = v.strip().lower()
        elif isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            out[queue_name] = v
        else:
            kafka = ", ".join(f"{k} ({w})" for k, w in _KAFKA_WORDS.items() if w in allowed)
            raise QflowOptionError(f"qflow option '{name}': queue {queue_name!r} has {v!r}; give a sequence number "
                                   f"(1 or more), {words}" + (f", or {kafka}" if kafka else ""))
    return out


@dataclass(frozen=True)
class ReadOptions:
    """A read's options: which queues, where each starts (and, for a batch
    read, ends), how a batch is split, and what a loss does."""

    endpoint: Endpoint
    queues: tuple[str, ...]  # the queues named by option 'queue' (empty with a pattern)
    pattern: str | None  # option 'queuePattern': a regular expression the whole queue name matches
    num_partitions: int | None
    max_per_trigger: int | None
    # "earliest", "latest", or the first sequence number to read; or those per queue
    starting: str | int | dict[str, str | int]
    # batch reads: read sequence numbers below this one (None: all there at planning); or per queue
    ending: int | None | dict[str, str | int]
    fail_on_data_loss: bool

    @property
    def queue(self) -> str:
        """What the read is of, for messages: the queue list or the pattern."""
        return ",".join(self.queues) if self.queues else f"/{self.pattern}/"

    def matches(self, name: str) -> bool:
        """Whether queue ``name`` is one this read is of."""
        if self.queues:
            return name in self.queues
        return re.fullmatch(self.pattern or "", name) is not None

    def starting_for(self, queue: str) -> str | int:
        """Where reading ``queue`` starts when its offsets have none: a queue a
        pattern finds later starts at its earliest message, as Kafka's new partitions do."""
        if isinstance(self.starting, dict):
            return self.starting.get(queue, "earliest")
        return self.starting

    def ending_for(self, queue: str) -> int | None:
        """The sequence number a batch read of ``queue`` stops below; None: it reads all there is."""
        if isinstance(self.ending, dict):
            value = self.ending.get(queue, "latest")
            return None if value == "latest" else int(value)
        return self.ending

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        """A read's options, from Spark's (names in any case).

        Raises:
          QflowOptionError: naming an option that is missing, malformed,
            unknown to a reader, or at odds with another.
        """
        opts = _lower(options, READ_OPTIONS, REFUSED_READ_OPTIONS)
        queues: tuple[str, ...] = ()
        if opts.get("queue", "").strip():
            names = [q.strip() for q in opts["queue"].split(",")]
            if not all(names) or len(set(names)) != len(names):
                raise QflowOptionError(f"qflow option 'queue' {opts['queue']!r}: give a queue name or a comma "
                                       f"list of them, each once, none empty")
            queues = tuple(names)
        pattern = opts.get("queuepattern")
        if pattern is not None:
            if queues:
                raise QflowOptionError("qflow: give either option 'queue' or option 'queuePattern', not both")
            if not pattern.strip():
                raise QflowOptionError("qflow option 'queuePattern' is empty")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QflowOptionError(f"qflow option 'queuePattern' {pattern!r} is not a regular "
                                       f"expression: {exc}") from None
        elif not queues:
            raise QflowOptionError("qflow: reading needs option 'queue' (the queue to read, or a comma list) "
                                   "or 'queuePattern' (a regular expression of queue names)")
        several = len(queues) != 1
        starting: str | int | dict[str, str | int] = opts.get("startingoffsets", "earliest").strip()
        if starting.startswith("{"):
            starting = _per_queue(starting, "startingOffsets", ("earliest", "latest"))
        elif starting.lower() in ("earliest", "latest"):
            starting = starting.lower()
        else:
            starting = _sequence(starting, "startingOffsets", "earliest, latest")
        ending: str | int | None | dict[str, str | int] = opts.get("endingoffsets", "latest").strip()
        if ending.startswith("{"):
            ending = _per_queue(ending, "endingOffsets", ("latest",))
        elif ending.lower() == "latest":
            ending = None
        else:
            ending = _sequence(ending, "endingOffsets", "latest")
        for name, value in (("startingOffsets", starting), ("endingOffsets", ending)):
            if several and isinstance(value, int):
                raise QflowOptionError(f"qflow option '{name}': a sequence number is of one queue; with several "
                                       f"queues or a pattern give a JSON object, e.g. {{\"orders\": 17}}")
            if isinstance(value, dict):
                for queue in value:
                    if queues and queue not in queues:
                        raise QflowOptionError(f"qflow option '{name}' names queue {queue!r}, which is not "
                                               f"among the queues read ({', '.join(queues)})")
                    if pattern is not None and re.fullmatch(pattern, queue) is None:
                        raise QflowOptionError(f"qflow option '{name}' names queue {queue!r}, which "
                                               f"queuePattern {pattern!r} does not match")
        if _bool(opts, "consume", "consume", False):
            raise QflowOptionError(
                "qflow option 'consume' is not supported: Spark's batch reader has no commit, so a job that failed "
                "after reading would lose what it removed. Read with spark.readStream and "
                "trigger(availableNow=True) instead: each micro-batch is removed once Spark has committed it")
        return cls(
            endpoint=Endpoint.parse(opts),
            queues=queues,
            pattern=pattern,
            num_partitions=_int(opts, "numpartitions", "numPartitions", None, 1),
            max_per_trigger=_int(opts, "maxmessagespertrigger", "maxMessagesPerTrigger", None, 1),
            starting=starting,
            ending=ending,
            fail_on_data_loss=_bool(opts, "failondataloss", "failOnDataLoss", True),
        )


@dataclass(frozen=True)
class WriteOptions:
    """A write's options: where its messages go (a queue, or an exchange and
    its routing key) and how each task sends them."""

    endpoint: Endpoint
    queue: str
    exchange: str
    routing_key: str
    capacity: int
    send_timeout: float | None
    write_id: str | None
    durable: bool

    @property
    def address(self) -> str:
        """Where the messages go, for messages to people: the queue, or EXCHANGE/ROUTING_KEY."""
        return self.queue if self.queue else f"{self.exchange}/{self.routing_key}"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        """A write's options, from Spark's (names in any case).

        Raises:
          QflowOptionError: naming the option: no destination or two, a
            malformed value, or an option that is not a writer's.
        """
        opts = _lower(options, WRITE_OPTIONS)
        queue = opts.get("queue", "").strip()
        exchange = opts.get("exchange", "").strip()
        routing_key = opts.get("routingkey", "")
        if queue and exchange:
            raise QflowOptionError("qflow: give either option 'queue' or option 'exchange' (with 'routingKey'), "
                                   "not both")
        if not queue and not exchange:
            raise QflowOptionError("qflow: writing needs option 'queue', or 'exchange' (with 'routingKey' or a "
                                   "routing_key column)")
        if queue and routing_key:
            raise QflowOptionError("qflow option 'routingKey' goes with 'exchange'; a 'queue' is its own key")
        if "/" in exchange:
            raise QflowOptionError(f"qflow option 'exchange' {exchange!r} must not contain '/'")
        return cls(
            endpoint=Endpoint.parse(opts),
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            capacity=_int(opts, "capacity", "capacity", DEFAULT_CAPACITY, 1),
            send_timeout=_float(opts, "sendtimeout", "sendTimeout", None),
            write_id=opts.get("writeid") or None,
            durable=_bool(opts, "durable", "durable", False),
        )

