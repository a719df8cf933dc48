"""``format("qflow")``: the data source Spark looks up by that name, and
its registration with a SparkSession.

    from qflow.spark import register
    register(spark)
    df = spark.read.format("qflow").option("broker", "127.0.0.1:5672").option("queue", "orders").load()
    df.write.format("qflow").option("queue", "copy").mode("append").save()

The source checks a query's options and schema on the driver and hands
Spark the readers (qflow.spark.reading) and writers (qflow.spark.writing).
"""

from __future__ import annotations

import uuid
from typing import Any

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from qflow.spark.options import QflowOptionError, ReadOptions, WriteOptions
from qflow.spark.reading import QflowBatchReader, QflowStreamReader
from qflow.spark.schema import SCHEMA, check_write_schema
from qflow.spark.writing import QflowBatchWriter, QflowStreamWriter, check_destination

FORMAT = "qflow"


def _append_only(overwrite: bool, streaming: bool) -> None:
    if overwrite:
        if streaming:
            raise QflowOptionError("qflow: a queue cannot be truncated, so outputMode('complete') is not "
                                   "supported; use outputMode('append') (Spark itself refuses 'update' for "
                                   "Python data sources)")
        raise QflowOptionError("qflow: a queue cannot be overwritten; mode('append') is the supported save mode")


class QflowDataSource(DataSource):
    """``format("qflow")``: qflow queues as a Spark source and sink, batch
    and streaming.

    Each of Spark's calls for a reader or a writer parses the query's
    options (``self.options``, as Spark hands them over) and checks them,
    and a write's schema and destination, before any task runs: those
    calls raise QflowOptionError naming what is wrong. A write appends;
    there is no overwrite.
    """

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
        check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowBatchWriter(opts, opts.write_id or uuid.uuid4().hex[:12])

    def streamWriter(self, schema: StructType, overwrite: bool) -> QflowStreamWriter:
        _append_only(overwrite, streaming=True)
        check_write_schema(schema)
        opts = WriteOptions.parse(self.options)
        check_destination(opts)
        return QflowStreamWriter(opts, opts.write_id)


def register(spark: Any) -> None:
    """Make ``format("qflow")`` available in a SparkSession.

    Args:
      spark: the SparkSession.
    """
    spark.dataSource.register(QflowDataSource)
