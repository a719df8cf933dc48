"""qflow as a PySpark Python data source (pyspark >= 4.2): batch and streaming, read and write.

    from qflow.spark import register
    register(spark)
    df = spark.read.format("qflow").option("broker", "127.0.0.1:5672").option("queue", "orders").load()
    df.write.format("qflow").option("queue", "copy").mode("append").save()

Reading browses: it delivers copies of exactly the sequence numbers a batch
planned and takes nothing, so a Spark task that fails and runs again reads
the same messages. One source may read several queues (a comma list, or
``queuePattern``); its streaming offsets are, per queue, the incarnation,
the sequence planned through and the set a batch reads; ``commit(end)``
(which Spark calls once a micro-batch is durable downstream) removes exactly
those with ``queue.remove-sequences``, which releases held producers exactly
as consuming does. Delivery is at least once.

Writing sends with a capacity window, so broker flow control throttles the
Spark task, which then simply waits; the task returns only when every
transfer is complete. Each message gets a deterministic id,
``BATCH-PARTITION-ROW``, so a consumer can drop the duplicates a retried task
sends, and a ``timestamp`` property.

Everything held by the classes here pickles: each conversation with the
broker, the driver's or a task's inside ``read``/``write``, is a short
``trio.run`` whose connection is opened with ``qflow.open_connection`` in that
program's own nursery and closed before it returns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue as _queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampType,
)

import qflow
from qflow.client.address import AddressError, parse_address
from qflow.client.message import arrow_columns
from qflow.protocol.ranges import RangeSet

try:  # pyspark >= 4.2: admission control and Trigger.AvailableNow for Python sources
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - pyspark 4.0/4.1
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

log = logging.getLogger("qflow.spark")

FORMAT = "qflow"
# A header's value, typed: exactly one field is set (all null for a null value).
# Lists and maps (msgpack allows them) come as JSON text in ``json``.
HEADER_VALUE = "struct<`string`:string,`long`:bigint,`double`:double,`boolean`:boolean,`binary`:binary,`json`:string>"
HEADER_FIELDS = ("string", "long", "double", "boolean", "binary", "json")
SCHEMA = ("body binary, routing_key string, exchange string, message_id string, correlation_id string, "
          f"content_type string, headers map<string,{HEADER_VALUE}>, sequence long, redelivered boolean, "
          "queue string, timestamp timestamp")
COLUMNS = ("body", "routing_key", "exchange", "message_id", "correlation_id", "content_type", "headers",
           "sequence", "redelivered", "queue", "timestamp")

# Columns a written DataFrame may carry: these set the message; the rest are
# ignored, so that what was read can be written back unchanged.
WRITE_COLUMNS = ("body", "routing_key", "message_id", "correlation_id", "content_type", "headers", "timestamp")
IGNORED_WRITE_COLUMNS = ("exchange", "sequence", "redelivered", "queue")

DEFAULT_BROKER = "127.0.0.1:5672"
DEFAULT_CAPACITY = 1000
MAX_PARTITIONS = 8  # default split of a range: one partition per ...
MESSAGES_PER_PARTITION = 10_000  # ... this many messages, at most MAX_PARTITIONS

# Local properties Spark sets on every task of a streaming micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


class QflowOptionError(ValueError):
    """A qflow data source option is missing or malformed."""


# -- options --------------------------------------------------------------------
def _lower(options: Mapping[str, str], known: frozenset[str]) -> dict[str, str]:
    """The options with lower-cased keys (Spark hands them over so; lowered
    again in case a caller builds the source directly). An option this side
    does not know is refused, naming it: a misspelt option must not be
    silently ignored (those Spark itself may set, such as ``path``, are let through)."""
    opts = {str(k).lower(): str(v) for k, v in dict(options).items()}
    unknown = sorted(k for k in set(opts) - known - _SPARK_OPTIONS if not k.startswith("__"))
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
                                    "startingoffsets",
                                    "endingoffsets", "failondataloss", "consume"}
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
        if isinstance(self.ending, dict):
            value = self.ending.get(queue, "latest")
            return None if value == "latest" else int(value)
        return self.ending

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        opts = _lower(options, READ_OPTIONS)
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
        return self.queue if self.queue else f"{self.exchange}/{self.routing_key}"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
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


def _check_write_schema(schema: StructType) -> None:
    names = [f.name for f in schema.fields]
    by_name = dict(zip(names, schema.fields, strict=True))
    if "body" not in by_name:
        raise QflowOptionError(f"qflow: the DataFrame to write needs a 'body' column (binary or string); "
                               f"it has {names}")
    unknown = [n for n in names if n not in WRITE_COLUMNS + IGNORED_WRITE_COLUMNS]
    if unknown:
        raise QflowOptionError(f"qflow: cannot write columns {unknown}: a message is written from 'body' and "
                               f"optional {list(WRITE_COLUMNS[1:])} (select or rename the columns first)")
    if not isinstance(by_name["body"].dataType, (BinaryType, StringType)):
        raise QflowOptionError(f"qflow: column 'body' must be binary or string, not "
                               f"{by_name['body'].dataType.simpleString()}")
    for name in ("routing_key", "message_id", "correlation_id", "content_type"):
        if name in by_name and not isinstance(by_name[name].dataType, StringType):
            raise QflowOptionError(f"qflow: column {name!r} must be a string, not "
                                   f"{by_name[name].dataType.simpleString()}")
    if "headers" in by_name:
        t = by_name["headers"].dataType
        if not (isinstance(t, MapType) and isinstance(t.keyType, StringType) and _header_type_ok(t.valueType)):
            raise QflowOptionError(f"qflow: column 'headers' must be a map with string keys and values of one "
                                   f"type (string, an integer type, float, double, boolean or binary) or the "
                                   f"typed struct qflow reads ({HEADER_VALUE}), not {t.simpleString()}")
    if "timestamp" in by_name and not isinstance(by_name["timestamp"].dataType, (TimestampType, LongType)):
        raise QflowOptionError(f"qflow: column 'timestamp' must be a timestamp (or a long: milliseconds since "
                               f"the epoch), not {by_name['timestamp'].dataType.simpleString()}")


_HEADER_PRIMITIVES = (StringType, ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType, BooleanType,
                      BinaryType)


def _header_type_ok(t: Any) -> bool:
    if isinstance(t, _HEADER_PRIMITIVES):
        return True
    return isinstance(t, StructType) and {f.name for f in t.fields} <= set(HEADER_FIELDS) and bool(t.fields)


@asynccontextmanager
async def open_session(endpoint: Endpoint) -> AsyncIterator[qflow.Session]:
    """A session on a connection of its own to the broker at ``endpoint``,
    for the ``async with`` block.

    The connection's tasks run in a nursery of the calling task and end
    with the block, which closes the connection. Opening it, and attaching
    the session, may each take ``endpoint.connect_timeout`` seconds; what
    the block does takes as long as it takes.

    Args:
      endpoint: the broker, the credentials and the TLS files.

    Raises:
      ConnectionError: if the broker cannot be reached, or does not answer
        within the timeout, naming the option to look at.
      QflowOptionError: if a TLS file cannot be read or used.
      qflow.ConnectionClosed: if the broker refuses the connection
        (qflow.TlsError: the TLS handshake fails).
      trio.TooSlowError: if the session is not attached in time.
    """
    credentials = endpoint.connect_options()
    opened = False
    try:
        with trio.CancelScope(deadline=trio.current_time() + endpoint.connect_timeout) as opening:
            async with qflow.open_connection(endpoint.host, endpoint.port, name="qflow.spark",
                                             **credentials) as conn:
                opened = True
                opening.deadline = math.inf  # the timeout is the opening's, not the block's
                with trio.fail_after(endpoint.connect_timeout):
                    ssn = await conn.session()
                yield ssn
    except OSError as exc:
        if opened:  # the block's own
            raise
        raise ConnectionError(f"qflow: cannot connect to the broker at {endpoint.host}:{endpoint.port} "
                              f"(option broker): {exc}") from None
    if opening.cancelled_caught:
        raise ConnectionError(f"qflow: no answer from the broker at {endpoint.host}:{endpoint.port} "
                              f"within {endpoint.connect_timeout:g} s (option connectTimeout)")


def on_session(endpoint: Endpoint, fn: Any, *args: Any) -> Any:
    """Run ``await fn(endpoint, session, *args)`` as one trio program, on a
    session of its own (:func:`open_session`).

    Args:
      endpoint: the broker to talk to.
      fn: an async function taking the endpoint, the session and ``args``.
      *args: passed on to ``fn``.

    Returns:
      What ``fn`` returns.

    Raises:
      What :func:`open_session` raises, and what ``fn`` raises.
    """
    async def conversation() -> Any:
        async with open_session(endpoint) as ssn:
            return await fn(endpoint, ssn, *args)

    return trio.run(conversation)


async def _remove_through(endpoint: Endpoint, ssn: qflow.Session, queue: str, sequence: int) -> int:
    with trio.fail_after(endpoint.connect_timeout):
        return await ssn.remove_through(queue, sequence)


def remove_through(broker: str, queue: str, sequence: int, connect_timeout: float = 10.0,
                   username: str | None = None, password: str | None = None) -> int:
    """Remove every available message of ``queue`` with a sequence number up
    to and including ``sequence`` (what a job that read them commits)."""
    host, port = parse_broker(broker)
    endpoint = Endpoint(host, port, connect_timeout, username, password)
    return on_session(endpoint, _remove_through, queue, int(sequence))


# -- reading ----------------------------------------------------------------------
class QflowDataLossError(RuntimeError):
    """Messages a read planned, or should have planned, are gone (option failOnDataLoss)."""


def describe(sequences: RangeSet) -> str:
    """``5..7, 9``: a set of sequence numbers as a person reads it."""
    parts = [f"{a}" if a == b else f"{a}..{b}" for a, b in sequences.ranges()]
    if len(parts) > 8:
        parts = parts[:8] + [f"... ({len(sequences)} in all)"]
    return ", ".join(parts)


def data_loss(opts: ReadOptions, queue: str, what: str) -> None:
    """Fail the read (failOnDataLoss=true, the default) or log the loss and go on."""
    text = f"qflow: data loss on queue {queue!r}: {what}"
    if opts.fail_on_data_loss:
        raise QflowDataLossError(text + ". Set option failOnDataLoss=false to log such losses and go on.")
    log.warning("%s; going on (failOnDataLoss=false)", text)


class SequenceSet(InputPartition):
    """Exactly these sequence numbers (a flat range list) of one incarnation of a queue."""

    def __init__(self, index: int, incarnation: str, sequences: list[int], queue: str = "") -> None:
        self.index = index
        self.incarnation = incarnation
        self.sequences = sequences
        self.queue = queue

    def __repr__(self) -> str:
        return f"SequenceSet({self.index}, {self.queue!r}, {describe(RangeSet.from_wire(self.sequences))})"


def split_sequences(sequences: RangeSet, parts: int | None, per_part: int = MESSAGES_PER_PARTITION) -> list[RangeSet]:
    """Split ``sequences`` into ``parts`` sets of consecutive members, as even as
    can be (default: one per ``per_part`` members, at most MAX_PARTITIONS)."""
    n = len(sequences)
    if n == 0:
        return []
    if parts is None:
        parts = min(MAX_PARTITIONS, math.ceil(n / per_part))
    parts = max(1, min(parts, n))
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    out: list[RangeSet] = []
    current = RangeSet()
    room = sizes[0]
    for first, last in sequences.ranges():
        while first <= last:
            take = min(room, last - first + 1)
            current.add_range(first, first + take - 1)
            first += take
            room -= take
            if room == 0:
                out.append(current)
                current = RangeSet()
                room = sizes[len(out)] if len(out) < parts else 0
    return out


POLL = 0.2  # seconds a reading task waits for its next message before asking the broker what is left
# Rows per Arrow batch a reading task hands to Spark: the first batch is small, so
# that the first rows come soon; each next one is 4 times larger, up to BATCH_ROWS
# (Spark's cost per batch is a fifth of the rows' at 4096 rows of 64 bytes, measured
# with a source of pre-built batches) ...
FIRST_BATCH_ROWS = 1024
BATCH_ROWS = 32768
BATCH_BYTES = 4 << 20  # ... or fewer, once their bodies reach this many bytes
READ_CAPACITY = 2000  # a reading task's credit window (messages in flight to it)


class _Columns:
    """One Arrow batch's worth of messages, as the Arrow arrays
    qflow.client.message.arrow_columns makes of each fetch."""

    __slots__ = ("chunks", "nbytes", "queue", "rows")

    def __init__(self, queue: str) -> None:
        self.chunks: list[tuple] = []
        self.nbytes = 0
        self.rows = 0
        self.queue = queue

    def __len__(self) -> int:
        return self.rows

    def add(self, messages: list[qflow.ReceivedMessage]) -> None:
        if not messages:
            return
        chunk = arrow_columns(messages)
        self.chunks.append(chunk)
        self.nbytes += chunk[0].nbytes
        self.rows += len(chunk[0])

    def batch(self, indices: list[int] | None) -> Any:
        import pyarrow as pa

        types = _arrow_types()
        which = range(len(COLUMNS)) if indices is None else indices
        columns = []
        for i in which:
            if i == QUEUE_COLUMN:  # one value for the whole batch: the queue it was read from
                columns.append(pa.repeat(pa.scalar(self.queue, types[i]), self.rows))
                continue
            parts = [_column(i, chunk, types[i]) for chunk in self.chunks]
            columns.append(parts[0] if len(parts) == 1 else pa.concat_arrays(parts))
        return pa.RecordBatch.from_arrays(columns, names=[COLUMNS[i] for i in which])


def _column(i: int, chunk: tuple, type_: Any) -> Any:
    """Column ``i`` (of COLUMNS) of one arrow_columns chunk."""
    import pyarrow as pa

    bodies, seqs, redelivered, index, heads = chunk
    if i == 0:
        return bodies
    if i == 7:
        return seqs
    if i == 8:
        return redelivered
    values = pa.array([_FROM_HEAD[i](h) for h in heads], type_)
    if len(heads) > 1:
        return values.take(index)
    return pa.repeat(values[0], len(index)) if values[0].is_valid else pa.nulls(len(index), type_)


def _timestamp(props: dict) -> int | None:
    """The message's time in milliseconds: its ``timestamp`` property, else
    the ``ts`` header qflow-send --timestamp yes (as qpid-send) puts in,
    nanoseconds since the epoch."""
    stamp = props.get("timestamp")
    if stamp is None:
        headers = props.get("headers")
        ts = headers.get("ts") if headers else None
        if type(ts) is int and ts >= 0:
            return ts // 1_000_000
    return stamp


QUEUE_COLUMN = COLUMNS.index("queue")
TIMESTAMP_COLUMN = COLUMNS.index("timestamp")
_INT64 = range(-(1 << 63), 1 << 63)


def _timestamp_us(props: dict) -> int | None:
    """The message's time as Spark's timestamp column holds it (microseconds, UTC)."""
    ms = _timestamp(props)
    return None if ms is None else ms * 1000


# Where each column comes from: a message's own array (body, sequence, redelivered), the
# queue read (_Columns.batch), or the message's head: (exchange, routing key, properties).
_FROM_HEAD = {1: lambda h: h[1], 2: lambda h: h[0], 3: lambda h: h[2].get("message_id"),
              4: lambda h: h[2].get("correlation_id"), 5: lambda h: h[2].get("content_type"),
              6: lambda h: _typed_headers(h[2].get("headers")), TIMESTAMP_COLUMN: lambda h: _timestamp_us(h[2])}


def header_value(value: Any) -> dict[str, Any] | None:
    """A header's value as the ``headers`` column's struct: the field named by
    its type is set. None stays null; lists and maps, and integers beyond
    64 bits, are JSON text."""
    if value is None:
        return None
    if isinstance(value, bool):
        return {"boolean": value}
    if isinstance(value, int):
        return {"long": value} if value in _INT64 else {"json": str(value)}
    if isinstance(value, float):
        return {"double": value}
    if isinstance(value, str):
        return {"string": value}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"binary": bytes(value)}
    return {"json": json.dumps(value, default=lambda v: bytes(v).hex() if isinstance(v, (bytes, bytearray))
                               else str(v))}


def _typed_headers(headers: dict | None) -> list[tuple[str, dict[str, Any] | None]] | None:
    if not headers:
        return None
    return [(str(k), header_value(v)) for k, v in headers.items()]


def _arrow_types() -> tuple:
    import pyarrow as pa

    s = pa.string()
    value = pa.struct([("string", s), ("long", pa.int64()), ("double", pa.float64()), ("boolean", pa.bool_()),
                       ("binary", pa.binary()), ("json", s)])
    return (pa.binary(), s, s, s, s, s, pa.map_(s, value), pa.int64(), pa.bool_(), s, pa.timestamp("us", tz="UTC"))


def _minus(a: RangeSet, b: RangeSet) -> RangeSet:
    """The numbers of ``a`` not in ``b``, range by range (a batch plans
    hundreds of thousands of numbers: never one by one)."""
    out = RangeSet()
    theirs = list(b.ranges())
    j = 0
    for first, last in a.ranges():
        while j < len(theirs) and theirs[j][1] < first:
            j += 1
        at = first
        k = j
        while k < len(theirs) and theirs[k][0] <= last:
            if theirs[k][0] > at:
                out.add_range(at, theirs[k][0] - 1)
            at = max(at, theirs[k][1] + 1)
            k += 1
        if at <= last:
            out.add_range(at, last)
    return out


def _intersect(a: RangeSet, b: RangeSet) -> RangeSet:
    """The numbers in both ``a`` and ``b``, range by range."""
    return _minus(a, _minus(a, b))


async def _browse_wanted(opts: ReadOptions, ssn: qflow.Session, queue: str, incarnation: str, wanted: RangeSet,
                         emit: Any) -> RangeSet:
    """Browse exactly the messages numbered in ``wanted`` of ``incarnation`` of
    ``queue``, handing them to ``emit`` in batches. Returns the wanted numbers that are gone."""
    with trio.fail_after(opts.endpoint.connect_timeout):
        head = await ssn.available(queue, 0, 0)
    if head["incarnation"] != incarnation:
        return wanted
    pending = wanted
    gone = RangeSet()
    rows = FIRST_BATCH_ROWS
    while pending:
        ranges = list(pending.ranges())
        n = len(ranges)
        start, last = ranges[0][0], ranges[-1][1]
        with trio.fail_after(opts.endpoint.connect_timeout):
            receiver = await ssn.receiver(queue, browse=True, start_sequence=start,
                                          capacity=max(1, min(len(pending), READ_CAPACITY)))
        # A cursor over the wanted numbers: the browser delivers in sequence
        # order, so each message is compared with the next wanted number only.
        ri = 0
        nxt, hi = ranges[0]
        skipped = RangeSet()  # wanted numbers the browser went past: gone, or held by another consumer
        cols = _Columns(queue)
        while ri < n:
            try:
                delivered = await receiver.fetch_many(timeout=POLL)
            except qflow.Empty:
                break
            first_seq, last_seq = delivered[0].sequence, delivered[-1].sequence
            if first_seq == nxt and last_seq <= hi and last_seq - first_seq == len(delivered) - 1:
                # The usual case: all of them, the next wanted numbers in a row.
                cols.add(delivered)
                nxt = last_seq + 1
                if nxt > hi:
                    ri += 1
                    if ri < n:
                        nxt, hi = ranges[ri]
                if len(cols) >= rows or cols.nbytes >= BATCH_BYTES:
                    await emit(cols)
                    cols = _Columns(queue)
                    rows = min(4 * rows, BATCH_ROWS)
                continue
            taken: list[qflow.ReceivedMessage] = []
            for m in delivered:
                seq = m.sequence
                if seq < nxt:
                    continue
                while seq > hi:
                    skipped.add_range(nxt, hi)
                    ri += 1
                    if ri == n:
                        break
                    nxt, hi = ranges[ri]
                if ri == n:
                    break
                if seq < nxt:
                    continue
                if seq > nxt:
                    skipped.add_range(nxt, seq - 1)
                taken.append(m)
                nxt = seq + 1
                if nxt > hi:
                    ri += 1
                    if ri == n:
                        break
                    nxt, hi = ranges[ri]
            cols.add(taken)
            if len(cols) >= rows or cols.nbytes >= BATCH_BYTES:
                await emit(cols)
                cols = _Columns(queue)
                rows = min(4 * rows, BATCH_ROWS)
        if len(cols):
            await emit(cols)
        if ri < n:  # nothing more came: the rest of the wanted numbers are not here (yet)
            skipped.add_range(nxt, hi)
            for r in ranges[ri + 1:]:
                skipped.add_range(*r)
        with trio.fail_after(opts.endpoint.connect_timeout):
            await receiver.close()
        if not skipped:
            break
        # Ask which of them are still there. A message another consumer held
        # while the browser passed and has since released is behind the
        # browser's cursor: browse again from the first such one. The others are gone.
        with trio.fail_after(opts.endpoint.connect_timeout):
            now = await ssn.available(queue, start - 1, last - start + 1)
        if now["incarnation"] != incarnation:
            gone.update(skipped)
            break
        pending = _intersect(skipped, now["sequences"])
        gone.update(_minus(skipped, now["sequences"]))
    return gone


async def _read_task(opts: ReadOptions, queue: str, incarnation: str, sequences: RangeSet,
                     indices: list[int] | None, put: Any) -> None:
    """A reading task's one connection: every message numbered in ``sequences``,
    as Arrow batches handed to ``put`` (blocking, in a thread: memory stays
    bounded by what Spark has not taken yet)."""
    async def emit(cols: _Columns) -> None:
        await trio.to_thread.run_sync(put, cols.batch(indices))

    async with open_session(opts.endpoint) as ssn:
        try:
            gone = await _browse_wanted(opts, ssn, queue, incarnation, sequences, emit)
        except qflow.NotFound:  # the queue was deleted under the read
            gone = sequences
    if gone:
        data_loss(opts, queue, f"sequences {describe(gone)}, planned for this read, are no longer in the queue "
                               f"(overwritten by a ring queue, removed or taken by another consumer, or the "
                               f"queue was deleted: incarnation {incarnation})")


_DONE = object()


def read_sequences(opts: ReadOptions, queue_name: str, incarnation: str, sequences: RangeSet,
                   indices: list[int] | None = None) -> Iterator[Any]:
    """Every message numbered in ``sequences`` (of ``incarnation`` of queue
    ``queue_name``), as Arrow record batches. One connection for the whole
    task, run by a thread of its own: at most two batches wait for Spark to
    take them. A planned message that is gone is data loss (failOnDataLoss)."""
    if not sequences:
        return
    handoff: _queue.Queue = _queue.Queue(maxsize=2)
    stop = threading.Event()

    def hand_over(item: Any) -> bool:
        """Put ``item`` in the hand-off; False if Spark stopped taking items first."""
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.5)  # a timeout, so that a stop is seen while Spark takes nothing
                return True
            except _queue.Full:
                continue
        return False

    def put(item: Any) -> None:
        if not hand_over(item):
            raise _Stopped()

    def run() -> None:
        try:
            _profiled(f"read-{queue_name}", trio.run, _read_task, opts, queue_name, incarnation, sequences, indices,
                      put)
            result: Any = _DONE
        except _Stopped:
            return
        except BaseException as exc:  # handed to the task's thread, which raises it
            result = exc
        hand_over(result)

    thread = threading.Thread(target=run, name=f"qflow-read-{queue_name}", daemon=True)
    thread.start()
    try:
        while True:
            item = handoff.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=opts.endpoint.connect_timeout + 5)


PROFILE_ENV = "QFLOW_SPARK_PROFILE"


def _profiled(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; with $QFLOW_SPARK_PROFILE set to a directory, under
    cProfile, its stats written there (``NAME-PID-TIME.prof``, for pstats): where a
    task's time goes, measured inside Spark's Python worker. Once per task."""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        return fn(*args)
    import cProfile

    profile = cProfile.Profile()
    started = time.perf_counter()
    try:
        return profile.runcall(fn, *args)
    finally:
        path = os.path.join(directory, f"{name}-{os.getpid()}-{started:.6f}.prof")
        profile.dump_stats(path)
        log.warning("qflow: %s took %.3f s; profile in %s", name, time.perf_counter() - started, path)


class _Stopped(Exception):
    """Spark stopped taking a task's rows (a limit, a failure): the reader thread ends."""


def _indices(schema: StructType) -> list[int] | None:
    names = [f.name.lower() for f in schema.fields]
    if tuple(names) == COLUMNS:
        return None
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise QflowOptionError(f"qflow: unknown columns {unknown} in the read schema; qflow provides {SCHEMA}")
    return [COLUMNS.index(n) for n in names]


async def _available_many(endpoint: Endpoint, ssn: qflow.Session, asks: list[tuple[str, int, int]]) -> list[dict]:
    out = []
    for queue, after, limit in asks:
        try:
            with trio.fail_after(endpoint.connect_timeout):
                out.append(await ssn.available(queue, after, limit))
        except qflow.NotFound:
            raise QflowOptionError(f"qflow: queue {queue!r} does not exist on the broker at "
                                   f"{endpoint.host}:{endpoint.port} (declare it first)") from None
    return out


def available(endpoint: Endpoint, queue: str, after: int, limit: int) -> dict[str, Any]:
    """The broker's ``queue.available``: which messages a read may plan."""
    return on_session(endpoint, _available_many, [(queue, after, limit)])[0]


async def _list_queues(endpoint: Endpoint, ssn: qflow.Session) -> list[str]:
    with trio.fail_after(endpoint.connect_timeout):
        return await ssn.list_queues()


def resolve_queues(opts: ReadOptions) -> list[str]:
    """The queues a read is of now: the ``queue`` list, or the broker's queues
    whose whole name ``queuePattern`` matches (in name order)."""
    if opts.queues:
        return list(opts.queues)
    return sorted(q for q in on_session(opts.endpoint, _list_queues) if opts.matches(q))


def _partitions(opts: ReadOptions, queue: str, incarnation: str, sequences: RangeSet,
                first_index: int = 0) -> list[SequenceSet]:
    return [SequenceSet(first_index + i, incarnation, part.to_wire(), queue)
            for i, part in enumerate(split_sequences(sequences, opts.num_partitions))]


class QflowBatchReader(DataSourceReader):
    """Reads exactly the messages available when the query is planned, by browsing."""

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        self.opts = opts
        self.indices = _indices(schema)

    def partitions(self) -> list[SequenceSet]:
        opts = self.opts
        queues = resolve_queues(opts)
        asks = []
        for q in queues:
            starting = opts.starting_for(q)
            if starting == "latest":
                raise QflowOptionError(f"qflow option 'startingOffsets' cannot be latest for a batch read (it "
                                       f"would read nothing of queue {q!r}); use earliest or a sequence number")
            asks.append((q, starting - 1 if isinstance(starting, int) else 0, -1))
        out: list[SequenceSet] = []
        for q, a in zip(queues, on_session(opts.endpoint, _available_many, asks), strict=True):
            sequences = a["sequences"]
            ending = opts.ending_for(q)
            if ending is not None:
                sequences = RangeSet((f, min(b, ending - 1)) for f, b in sequences.ranges() if f < ending)
            out += _partitions(opts, q, a["incarnation"], sequences, len(out))
        return out or [SequenceSet(0, "", [], "")]

    def read(self, partition: SequenceSet) -> Iterator[tuple]:
        yield from read_sequences(self.opts, partition.queue, partition.incarnation,
                                  RangeSet.from_wire(partition.sequences), self.indices)


def offset(incarnation: str, sequence: int, read: RangeSet | None = None) -> dict:
    """One queue's part of a streaming offset: every message of ``incarnation``
    numbered through ``sequence`` has been planned; ``read`` is exactly what
    the batch that ends here reads of it (and what its commit removes)."""
    return {"incarnation": incarnation, "sequence": sequence, "read": read.to_wire() if read else []}


def _shares(total: int, n: int) -> list[int]:
    """``total`` split over ``n`` queues as evenly as can be."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


class QflowStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are ``{queue: offset(...)}``. A batch reads exactly the numbers
    in each queue's ``read``; commit removes exactly those."""

    def __init__(self, opts: ReadOptions, schema: StructType) -> None:
        self.opts = opts
        self.indices = _indices(schema)
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow: the last sequence to read, per queue
        self._last: dict | None = None  # for pyspark < 4.2, which passes no start
        self._initial: dict | None = None
        self._latest: dict[str, dict] = {}  # each queue as the last plan saw it, for Spark's progress reports
        self._planned = False  # whether partitions() ran in this reader (this driver) yet

    def _offsets(self, value: dict) -> dict[str, dict]:
        """An offset as {queue: part}; a one-queue offset of an earlier
        version (one part, no queue names) is the ``queue`` option's."""
        if "sequence" in value and isinstance(value.get("sequence"), int):
            return {self.opts.queues[0] if self.opts.queues else "": value}
        return value

    def _starting_part(self, queue: str, a: dict) -> dict:
        starting = self.opts.starting_for(queue)
        if starting == "latest":
            through = a["lastSequence"]
        elif starting == "earliest":
            through = a["firstSequence"] - 1
        else:  # a sequence number: the first to read
            through = int(starting) - 1
        return offset(a["incarnation"], through)

    def initialOffset(self) -> dict:
        # Spark may ask again until the first batch is planned: "latest" must
        # stay the point the query started at, or messages sent in between
        # would be skipped.
        if self._initial is None:
            queues = resolve_queues(self.opts)
            heads = on_session(self.opts.endpoint, _available_many, [(q, 0, 0) for q in queues])
            self._initial = {q: self._starting_part(q, a) for q, a in zip(queues, heads, strict=True)}
        return self._initial

    def prepareForTriggerAvailableNow(self) -> None:
        queues = resolve_queues(self.opts)
        heads = on_session(self.opts.endpoint, _available_many, [(q, 0, 0) for q in queues])
        self._target = {q: a["lastSequence"] for q, a in zip(queues, heads, strict=True)}

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        if start is None:  # pyspark < 4.2: no start, no limit
            start = self._last or self.initialOffset()
            max_rows = self.opts.max_per_trigger
        else:
            max_rows = getattr(limit, "max_rows", None) if limit is not None else None
        end = self.plan(start, max_rows)
        self._last = end
        return end

    def plan(self, start: dict, max_rows: int | None) -> dict:
        """The next batch's end offset after ``start``: the first ``max_rows``
        (or all) available messages of each queue (``max_rows`` shared among
        the queues), up to the AvailableNow target."""
        return on_session(self.opts.endpoint, self._plan, self._offsets(start), max_rows)

    async def _plan(self, endpoint: Endpoint, ssn: qflow.Session, start: dict[str, dict],
                    max_rows: int | None) -> dict:
        opts = self.opts
        if opts.queues:
            queues = list(opts.queues)
        else:
            with trio.fail_after(endpoint.connect_timeout):
                queues = sorted(q for q in await ssn.list_queues() if opts.matches(q))
            for gone in sorted(set(start) - set(queues)):
                # A pattern's queue that was deleted: its unread messages (if
                # any) went with it; it is dropped from the offsets.
                log.warning("qflow: queue %r (matched by queuePattern %r) is gone; no longer read", gone,
                            opts.pattern)
        parts = {q: start[q] for q in queues if q in start}
        new = [q for q in queues if q not in start]
        if new:  # a queue the pattern found since the last batch: it starts as startingOffsets says
            heads = await _available_many(endpoint, ssn, [(q, 0, 0) for q in new])
            parts.update((q, self._starting_part(q, h)) for q, h in zip(new, heads, strict=True))
        asks = [(q, int(parts[q]["sequence"]), -1) for q in queues]
        if max_rows is None:
            found = await _available_many(endpoint, ssn, asks)
        else:
            # Admission control over several queues: each queue gets an even
            # share; what a queue leaves unused goes to the others.
            found = await _available_many(endpoint, ssn, [(q, after, share) for (q, after, _), share in
                                                          zip(asks, _shares(max_rows, len(asks)), strict=True)])
            left = max_rows - sum(len(a["sequences"]) for a in found)
            for (q, _, _), a in zip(asks, found, strict=True):
                if left <= 0:
                    break
                if not a["sequences"]:
                    continue
                last = max(b for _, b in a["sequences"].ranges())
                if last >= a["lastSequence"]:
                    continue
                more = (await _available_many(endpoint, ssn, [(q, last, left)]))[0]
                if more["incarnation"] == a["incarnation"]:
                    a["sequences"].update(more["sequences"])
                    left -= len(more["sequences"])
        end: dict[str, dict] = {}
        self._latest = {}
        for (q, _, _), a in zip(asks, found, strict=True):
            end[q] = await self._plan_queue(endpoint, ssn, q, parts[q], a, max_rows)
            self._latest[q] = {"incarnation": a["incarnation"], "sequence": a["lastSequence"]}
        if end == start:
            return start
        return end

    async def _plan_queue(self, endpoint: Endpoint, ssn: qflow.Session, queue: str, start: dict, a: dict,
                          max_rows: int | None) -> dict:
        opts = self.opts
        after = int(start["sequence"])
        incarnation = start.get("incarnation")
        if incarnation is not None and a["incarnation"] != incarnation:
            data_loss(opts, queue, f"the queue is not the one the query's offsets are of (incarnation "
                                   f"{incarnation}, read through sequence {after}): it was deleted and declared "
                                   f"again, or the broker restarted (incarnation {a['incarnation']} now); messages "
                                   f"of the old queue that the query had not read are lost")
            after = 0  # going on: read the new queue from its first message
            limit = -1 if max_rows is None else max(1, len(a["sequences"]))
            a = (await _available_many(endpoint, ssn, [(queue, after, limit)]))[0]
        sequences = a["sequences"]
        target = None if self._target is None else self._target.get(queue, after)
        limit_to = a["lastSequence"] if target is None else min(a["lastSequence"], target)
        if target is not None and sequences and max(b for _, b in sequences.ranges()) > limit_to:
            sequences = RangeSet(r for r in ((f, min(b, limit_to)) for f, b in sequences.ranges()) if r[0] <= r[1])
        if sequences:
            through = max(b for _, b in sequences.ranges())
        else:
            # Nothing to read: but messages numbered after ``after`` that are not
            # available are gone (or held by another consumer) all the same.
            through = max(limit_to, after)
        missing = RangeSet()
        if through > after:
            missing = _minus(RangeSet([(after + 1, through)]), sequences)
        if missing:
            data_loss(opts, queue, f"sequences {describe(missing)} after the query's offset {after} are not in "
                                   f"the queue (overwritten by a ring queue, or removed or taken by another "
                                   f"consumer)")
        # Nothing new gives a part with an empty ``read``. If the batch that
        # ended at ``start`` still holds messages, that differs from it: Spark
        # then plans an empty batch, which commits the one before (Spark commits
        # a batch only when it plans the next). Its producers may be held by
        # exactly those messages; without this the query would wait forever.
        return offset(a["incarnation"], through, sequences)

    def reportLatestOffset(self) -> dict | None:
        """Per queue: its last sequence number when the batch was planned, and
        the lag, how many numbers past the batch's end were not planned yet
        (shown as the source's ``latestOffset`` in the query's progress)."""
        if not self._latest or self._last is None:
            return None
        last = self._offsets(self._last)
        return {q: {**latest, "lag": max(0, latest["sequence"] - int(last[q]["sequence"]))}
                for q, latest in self._latest.items() if q in last}

    def partitions(self, start: dict, end: dict) -> list[SequenceSet]:
        if not self._planned:
            self._planned = True
            if start:
                # Spark runs a batch only after the one before it is committed, and tells the source
                # so (commit) while it plans the batch after that. A driver that died between the two
                # left that batch's messages in the queue, before every offset this query will read
                # again: its first batch here removes them (removing is idempotent).
                self.commit(start)
        out: list[SequenceSet] = []
        start_parts = self._offsets(start) if start else {}
        for q, part in sorted(self._offsets(end).items()):
            incarnation = part.get("incarnation")
            if incarnation is None:  # an offset from before incarnations: read what is there
                after = int(start_parts.get(q, {}).get("sequence", 0))
                a = available(self.opts.endpoint, q, after, -1)
                sequences = RangeSet((f, min(b, int(part["sequence"]))) for f, b in a["sequences"].ranges()
                                     if f <= int(part["sequence"]))
                out += _partitions(self.opts, q, a["incarnation"], sequences, len(out))
            else:
                out += _partitions(self.opts, q, incarnation, RangeSet.from_wire(part.get("read", [])), len(out))
        return out

    def read(self, partition: SequenceSet) -> Iterator[Any]:
        return read_sequences(self.opts, partition.queue, partition.incarnation,
                              RangeSet.from_wire(partition.sequences), self.indices)

    def commit(self, end: dict) -> None:
        parts = {q: p for q, p in self._offsets(end).items() if p.get("read") and p.get("incarnation")}
        if parts:
            on_session(self.opts.endpoint, _commit, parts)

    def stop(self) -> None:
        pass


async def _commit(endpoint: Endpoint, ssn: qflow.Session, parts: dict[str, dict]) -> None:
    for queue, part in parts.items():
        read = RangeSet.from_wire(part["read"])
        try:
            with trio.fail_after(endpoint.connect_timeout):
                removed = await ssn.remove_sequences(queue, part["incarnation"], read)
        except (qflow.PreconditionFailed, qflow.NotFound) as exc:
            # The queue those numbers belong to is gone: nothing of another one is removed.
            log.warning("qflow: commit of queue %r sequences %s removed nothing: %s", queue, describe(read), exc)
            continue
        log.info("qflow: committed queue %r sequences %s (%d removed)", queue, describe(read), removed)


# -- writing ----------------------------------------------------------------------
@dataclass
class QflowCommitMessage(WriterCommitMessage):
    partition: int
    messages: int
    id_prefix: str


def _task() -> tuple[int, str | None, str | None]:
    """(partition id, streaming batch id, streaming query id) of the running task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, None, None
    return ctx.partitionId(), ctx.getLocalProperty(BATCH_ID_PROPERTY), ctx.getLocalProperty(QUERY_ID_PROPERTY)


def _body_column(column: Any) -> list[bytes]:
    import pyarrow as pa

    values = column.to_pylist()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return [b"" if v is None else v.encode() for v in values]
    return [b"" if v is None else v for v in values]


def _header_from_struct(value: dict[str, Any] | None) -> Any:
    """The value a typed header struct (as qflow reads it) carries: its one field that is set."""
    if value is None:
        return None
    for name in HEADER_FIELDS:
        v = value.get(name)
        if v is not None:
            return json.loads(v) if name == "json" else v
    return None


def _headers_column(column: Any) -> list[dict[str, Any] | None]:
    import pyarrow as pa

    # A map column comes out of Arrow as lists of (key, value) pairs; each
    # value keeps its type (a long stays an integer, binary stays bytes).
    rows = column.to_pylist()
    if pa.types.is_struct(column.type.item_type):
        return [{str(k): _header_from_struct(v) for k, v in pairs} or None if pairs else None for pairs in rows]
    return [{str(k): v for k, v in pairs} or None if pairs else None for pairs in rows]


def _timestamp_column(column: Any, now: int) -> list[int]:
    """Milliseconds since the epoch; a null is ``now``, the time of the send."""
    import pyarrow as pa

    if pa.types.is_timestamp(column.type):
        per_ms = {"s": 0.001, "ms": 1, "us": 1000, "ns": 1_000_000}[column.type.unit]
        return [now if v is None else int(v // per_ms) for v in column.cast(pa.int64()).to_pylist()]
    return [now if v is None else int(v) for v in column.to_pylist()]


async def _send_batches(endpoint: Endpoint, ssn: qflow.Session, opts: WriteOptions, batches: Iterable[Any],
                        id_prefix: str) -> int:
    """Send every row of ``batches`` (Arrow record batches) as a message
    through ``ssn``, each with its row's ``message_id`` or ``ID_PREFIX-ROW``;
    return when the broker has completed them all, with how many there were."""
    # A queue is its own routing key: a routing_key column (say, carried over
    # from a read) must not send the messages elsewhere.
    keyed = not opts.queue
    sender = ssn.sender(opts.address, capacity=opts.capacity, flow_timeout=opts.send_timeout,
                        durable=opts.durable)
    send = sender.send_with
    durable = opts.durable
    n = 0
    for batch in batches:
        # Columns are looked up once per batch, never per row; a column
        # that is null throughout (say, carried over from a read) sets nothing.
        names = batch.schema.names
        bodies = _body_column(batch.column(names.index("body")))
        rows = len(bodies)
        if not rows:
            continue
        column = {name: batch.column(i) for i, name in enumerate(names)
                  if name == "body" or batch.column(i).null_count < rows}
        if "message_id" in column:
            ids = [mid or f"{id_prefix}-{n + i}" for i, mid in enumerate(column["message_id"].to_pylist())]
        else:
            ids = [f"{id_prefix}-{i}" for i in range(n, n + rows)]
        # Every message carries the time it was sent (or its row's
        # timestamp): what a reader's timestamp column shows.
        now = int(time.time() * 1000)
        shared: dict[str, Any] = {"timestamp": now}
        per_row: dict[str, list] = {}
        if "timestamp" in column:
            per_row["timestamp"] = _timestamp_column(column["timestamp"], now)
        if keyed and "routing_key" in column:
            per_row["routing_key"] = column["routing_key"].to_pylist()
        for name in ("correlation_id", "content_type"):
            if name in column:
                per_row[name] = column[name].to_pylist()
        if "headers" in column:
            per_row["headers"] = _headers_column(column["headers"])
        # A value the same in every row is the batch's: the run's shared properties.
        for name in [name for name, values in per_row.items() if values.count(values[0]) == rows]:
            value = per_row.pop(name)[0]
            if value or name in ("timestamp", "routing_key"):
                shared[name] = value
        if not per_row:
            # One run of transfers, an id each (the map's first key) and the rest
            # shared: the broker takes it whole (native/transfers.h).
            await sender.send_many(bodies, message_ids=ids, **shared)
        else:
            # Some property differs per row: one message at a time (docs/spark.md says so).
            keys = per_row.pop("routing_key", None)
            base = {k: v for k, v in shared.items() if k != "routing_key"}
            if durable:
                base["durable"] = True
            key = shared.get("routing_key")
            for i, body in enumerate(bodies):
                props = {"message_id": ids[i], **base}
                for name, values in per_row.items():
                    if values[i] or name == "timestamp":
                        props[name] = values[i]
                await send(body, props, routing_key=key if keys is None else keys[i])
        n += rows
    with trio.fail_after(opts.send_timeout or math.inf):
        await sender.sync()
    return n


async def _check_destination(endpoint: Endpoint, ssn: qflow.Session, opts: WriteOptions) -> None:
    with trio.fail_after(endpoint.connect_timeout):
        if opts.queue:
            await ssn.query_queue(opts.queue)
        else:
            await ssn.declare_exchange(opts.exchange, passive=True)


def check_destination(opts: WriteOptions) -> None:
    try:
        on_session(opts.endpoint, _check_destination, opts)
    except qflow.NotFound:
        what = f"queue {opts.queue!r}" if opts.queue else f"exchange {opts.exchange!r}"
        raise QflowOptionError(f"qflow: {what} does not exist on the broker at {opts.endpoint.host}:"
                               f"{opts.endpoint.port} (declare it first)") from None


class _Writer:
    def __init__(self, opts: WriteOptions, write_id: str | None) -> None:
        self.opts = opts
        self.write_id = write_id

    def _batch(self) -> tuple[int, str]:
        """(partition, the BATCH part of the ids): the write id of a batch
        write; QUERY-ID-BATCH-ID for a micro-batch, the same when it is replayed."""
        partition, batch_id, query_id = _task()
        if self.write_id is not None:
            return partition, self.write_id
        if batch_id is not None:
            return partition, f"{query_id}-{batch_id}" if query_id else batch_id
        return partition, "0"

    def write(self, iterator: Iterator[Any]) -> QflowCommitMessage:
        partition, batch = self._batch()
        prefix = f"{batch}-{partition}"
        n = _profiled(f"write-{self.opts.address}", on_session, self.opts.endpoint, _send_batches, self.opts,
                      iterator, prefix)
        return QflowCommitMessage(partition, n, prefix)

    @staticmethod
    def _total(messages: list[QflowCommitMessage | None]) -> int:
        return sum(m.messages for m in messages if m is not None)


class QflowBatchWriter(_Writer, DataSourceArrowWriter):
    def commit(self, messages: list[QflowCommitMessage | None]) -> None:
        log.info("qflow: wrote %d messages to %s (write id %s)", self._total(messages), self.opts.address,
                 self.write_id)

    def abort(self, messages: list[QflowCommitMessage | None]) -> None:
        log.warning("qflow: write %s to %s failed; %d messages that completed tasks sent stay on the broker "
                    "(their ids start with %r: drop duplicates by message id)", self.write_id, self.opts.address,
                    self._total(messages), self.write_id)


class QflowStreamWriter(_Writer, DataSourceStreamArrowWriter):
    def commit(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.info("qflow: batch %d: wrote %d messages to %s", batchId, self._total(messages), self.opts.address)

    def abort(self, messages: list[QflowCommitMessage | None], batchId: int) -> None:
        log.warning("qflow: batch %d to %s failed after %d messages were sent; its retry sends the same "
                    "message ids", batchId, self.opts.address, self._total(messages))


# -- the data source ---------------------------------------------------------------
def _append_only(overwrite: bool, streaming: bool) -> None:
    if overwrite:
        if streaming:
            raise QflowOptionError("qflow: a queue cannot be truncated, so outputMode('complete') is not "
                                   "supported; use outputMode('append') (Spark itself refuses 'update' for "
                                   "Python data sources)")
        raise QflowOptionError("qflow: a queue cannot be overwritten; mode('append') is the supported save mode")


class QflowDataSource(DataSource):
    """``format("qflow")``: a qflow queue as a Spark source and sink."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> QflowBatchReader:
        opts = ReadOptions.parse(self.options)
        if opts.starting == "latest":
            raise QflowOptionError("qflow option 'startingOffsets' cannot be latest for a batch read (it would read "
                                   "nothing); use earliest or a sequence number")
        return QflowBatchReader(opts, schema)

    def streamReader(self, schema: StructType) -> QflowStreamReader:
        opts = ReadOptions.parse(self.options)
        if opts.ending is not None:
            raise QflowOptionError("qflow option 'endingOffsets' is for batch reads; a streaming read goes on")
        return QflowStreamReader(opts, schema)

    def writer(self, schema: StructType, overwrite: bool) -> QflowBatchWriter:
        _append_only(overwrite, streaming=False)
        _check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowBatchWriter(opts, opts.write_id or uuid.uuid4().hex[:12])

    def streamWriter(self, schema: StructType, overwrite: bool) -> QflowStreamWriter:
        _append_only(overwrite, streaming=True)
        _check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowStreamWriter(opts, opts.write_id)


def register(spark: Any) -> None:
    """Make ``format("qflow")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(QflowDataSource)
