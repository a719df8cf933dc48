"""qflow for Spark: ``format("qflow")`` as a PySpark Python data source.

Install with ``pip install 'qflow[spark]'`` (pyspark >= 4.2 and pyarrow), then::

    from qflow.spark import register
    register(spark)
    spark.read.format("qflow").option("broker", "127.0.0.1:5672").option("queue", "orders").load()

See docs/spark.md for the options, the schema and the delivery guarantees.
"""

try:
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("qflow.spark needs pyspark>=4.2 and pyarrow: pip install 'qflow[spark]'") from exc

from qflow.spark.datasource import (
    COLUMNS,
    FORMAT,
    SCHEMA,
    QflowDataLossError,
    QflowDataSource,
    QflowOptionError,
    register,
    remove_through,
)

__all__ = ["COLUMNS", "FORMAT", "SCHEMA", "QflowDataLossError", "QflowDataSource", "QflowOptionError", "register", "remove_through"]
