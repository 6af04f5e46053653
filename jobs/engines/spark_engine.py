"""The Spark engine: ``spark-submit`` (local or a cluster) or plain Python (local mode).

Rows travel as Arrow batches (``mapInArrow``) where Spark allows it. Shards are routed with
``repartitionAndSortWithinPartitions`` and a partitioner that is the identity on the plan's
partition number: exactly one shard per task, sorted by position with Spark's spilling sort.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from jobs.engines import WriteFn

__all__ = ["SparkEngine"]

log = logging.getLogger(__name__)

_TYPES = {pa.string(): "string", pa.int64(): "long", pa.int32(): "int", pa.binary(): "binary",
          pa.bool_(): "boolean"}


_FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")


def _ddl(schema: pa.Schema) -> str:
    return ", ".join(f"`{f.name}` {_TYPES[f.type]}" for f in schema)


class SparkEngine:
    name = "spark"

    def __init__(self, *, spark: Any = None, master: str | None = None, app_name: str = "lakeshard",
                 **_: Any) -> None:
        from pyspark.sql import SparkSession

        self._owned = spark is None
        if spark is None:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # Workers run the driver's interpreter (the one with this package installed)
            # unless the user chose another; on a cluster, set PYSPARK_PYTHON to the workers' path.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            builder = SparkSession.builder.master(master) if master else SparkSession.builder
            spark = (builder.appName(app_name)
                     .config("spark.sql.session.timeZone", "UTC")
                     .config("spark.ui.showConsoleProgress", "true")
                     .getOrCreate())
            spark.sparkContext.setLogLevel("WARN")
        # Images are large rows: keep Arrow batches small so a batch is a few MiB, not GiBs.
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "64")
        self.spark = spark
        self.sc = spark.sparkContext
        # Where S3 is (not who: credentials stay with the AWS environment of each worker).
        for name in _FORWARDED_ENV:
            if os.environ.get(name):
                self.sc.environment[name] = os.environ[name]

    @property
    def parallelism(self) -> int:
        return max(1, self.sc.defaultParallelism)

    def map_partitions(self, fn: Callable[[list[Any]], list[Any]], items: Sequence[Any], *,
                       partitions: int) -> list[Any]:
        if not items:
            return []
        rdd = self.sc.parallelize(list(items), max(1, min(partitions, len(items))))
        return rdd.mapPartitions(lambda it: fn(list(it))).collect()

    def preprocess(self, rows: pa.Table, fn: Callable[[pa.RecordBatch], pa.RecordBatch],
                   schema: pa.Schema, *, partitions: int) -> Any:
        from pyspark import StorageLevel

        df = self.spark.createDataFrame(rows).repartition(max(1, partitions))
        staged = df.mapInArrow(lambda batches: (fn(b) for b in batches), _ddl(schema))
        staged = staged.persist(StorageLevel.MEMORY_AND_DISK)
        staged.count()  # materialise once: the plan and the writers read the same result
        return staged

    def collect(self, staged: Any, columns: list[str]) -> pa.Table:
        return staged.select(*columns).toArrow()

    def write_shards(self, staged: Any, plan: pa.Table, fn: WriteFn, *, num_parts: int) -> list[dict[str, Any]]:
        routes: dict[str, list[tuple[int, int, bool]]] = {}
        for uri, part, pos, pad in zip(*(plan[c].to_pylist() for c in ("uri", "part", "position", "is_pad"))):
            routes.setdefault(uri, []).append((part, pos, pad))
        table = self.sc.broadcast(routes)

        def route(row: Any) -> list[tuple[tuple[int, int], dict[str, Any]]]:
            d = row.asDict()
            return [((part, pos), {**d, "is_pad": pad}) for part, pos, pad in table.value.get(d["uri"], ())]

        rdd = (staged.filter(staged.status == "ok").rdd.flatMap(route)
               .repartitionAndSortWithinPartitions(num_parts, partitionFunc=lambda k: k[0]))
        try:
            return rdd.mapPartitionsWithIndex(lambda i, it: [fn(i, it)]).collect()
        finally:
            table.unpersist()

    def release(self, staged: Any) -> None:
        staged.unpersist()

    def close(self) -> None:
        if self._owned:
            self.spark.stop()
