"""qflow for Spark: ``format("qflow")`` as a PySpark Python data source.

Install with ``pip install 'qflow[spark]'`` (pyspark >= 4.2 and pyarrow), then::

    from qflow.spark import register
    register(spark)
    spark.read.format("qflow").option("broker", "127.0.0.1:5672").option("queue", "orders").load()

See docs/spark.md for the options, the schema and the delivery guarantees.

One module per concern:
``source`` (the data source, ``register``), ``options`` (what a query's
options say), ``schema`` (the columns), ``connection`` (each conversation
with the broker, on a connection of its own), ``reading`` (the readers:
planning, offsets, commits), ``browsing`` (a reading task), ``sequences``
(sets of sequence numbers), ``writing`` (the writers).
"""

try:
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("qflow.spark needs pyspark>=4.2 and pyarrow: pip install 'qflow[spark]'") from exc

from qflow.spark.browsing import QflowDataLossError
from qflow.spark.options import QflowOptionError
from qflow.spark.reading import remove_through
from qflow.spark.schema import COLUMNS, SCHEMA
from qflow.spark.source import FORMAT, QflowDataSource, register

__all__ = ["COLUMNS", "FORMAT", "SCHEMA", "QflowDataLossError", "QflowDataSource", "QflowOptionError", "register", "remove_through"]
