"""The data source's columns: the schema a read gives, the columns a write
takes, their Arrow types, and the checks of a query's schema against them.

A message is a row: its body, its routing, its properties, its headers
(each value typed, see :data:`HEADER_VALUE`), where it was read and when it
was sent. docs/spark.md, "Schema", describes each column.
"""

from __future__ import annotations

from typing import Any

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

from qflow.spark.options import QflowOptionError

# A header's value, typed: exactly one field is set (all null for a null value).
# Lists and maps (msgpack allows them) come as JSON text in ``json``.
HEADER_VALUE = "struct<`string`:string,`long`:bigint,`double`:double,`boolean`:boolean,`binary`:binary,`json`:string>"
HEADER_FIELDS = ("string", "long", "double", "boolean", "binary", "json")
SCHEMA = ("body binary, routing_key string, exchange string, message_id string, correlation_id string, "
          f"content_type string, headers map<string,{HEADER_VALUE}>, sequence long, redelivered boolean, "
          "queue string, timestamp timestamp")
COLUMNS = ("body", "routing_key", "exchange", "message_id", "correlation_id", "content_type", "headers",
           "sequence", "redelivered", "queue", "timestamp")
QUEUE_COLUMN = COLUMNS.index("queue")
TIMESTAMP_COLUMN = COLUMNS.index("timestamp")

# Columns a written DataFrame may carry: these set the message; the rest are
# ignored, so that what was read can be written back unchanged.
WRITE_COLUMNS = ("body", "routing_key", "message_id", "correlation_id", "content_type", "headers", "timestamp")
IGNORED_WRITE_COLUMNS = ("exchange", "sequence", "redelivered", "queue")


def arrow_types() -> tuple:
    """The Arrow type of each column of :data:`COLUMNS`, in order: what a
    reading task's record batches are made of."""
    import pyarrow as pa

    s = pa.string()
    value = pa.struct([("string", s), ("long", pa.int64()), ("double", pa.float64()), ("boolean", pa.bool_()),
                       ("binary", pa.binary()), ("json", s)])
    return (pa.binary(), s, s, s, s, s, pa.map_(s, value), pa.int64(), pa.bool_(), s, pa.timestamp("us", tz="UTC"))


def read_indices(schema: StructType) -> list[int] | None:
    """Which columns a read gives, for the schema Spark asks for.

    Args:
      schema: the read's schema: some of :data:`COLUMNS` (any case), in any order.

    Returns:
      The index in :data:`COLUMNS` of each of the schema's columns; None for
      all of them in their own order.

    Raises:
      QflowOptionError: naming the columns qflow does not provide.
    """
    names = [f.name.lower() for f in schema.fields]
    if tuple(names) == COLUMNS:
        return None
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise QflowOptionError(f"qflow: unknown columns {unknown} in the read schema; qflow provides {SCHEMA}")
    return [COLUMNS.index(n) for n in names]


def check_write_schema(schema: StructType) -> None:
    """Refuse a DataFrame that cannot be written as messages, before any task runs.

    It needs a ``body`` (binary or string); it may carry the other
    :data:`WRITE_COLUMNS`, each of its type, and the
    :data:`IGNORED_WRITE_COLUMNS` a read gives; nothing else.

    Args:
      schema: the schema of the DataFrame to write.

    Raises:
      QflowOptionError: naming the column and what it must be.
    """
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
