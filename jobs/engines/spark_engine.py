"""The Spark engine: ``spark-submit`` (local or a cluster) or plain Python (local mode).

Rows travel as Arrow batches (``mapInArrow``) end to end: images never go through pickled RDD
rows. Shards are routed by a hash repartition on a key chosen so that each shard lands in its
own task (see ``_routing_keys``), then sorted by position with Spark's spilling sort.
"""

from __future__ import annotations

import itertools
import json
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

    def _routing_keys(self, num_parts: int) -> list[int]:
        """For each partition p, an integer whose Spark hash lands in p.

        ``repartition(n, col)`` places a row in ``pmod(hash(col), n)``; giving every row of
        shard p the key found here puts exactly one shard in each task (hashing the shard
        number itself would collide). Found once with Spark's own ``hash``, so it is right
        for whatever version runs.
        """
        from pyspark.sql import functions as F

        keys: dict[int, int] = {}
        span = 64 * num_parts
        while len(keys) < num_parts:
            found = (self.spark.range(span - 64 * num_parts, span)
                     .select("id", F.expr(f"pmod(hash(id), {num_parts})").alias("p")).toArrow())
            for key, part in zip(found["id"].to_pylist(), found["p"].to_pylist()):
                keys.setdefault(part, key)
            span += 64 * num_parts
        return [keys[p] for p in range(num_parts)]

    def write_shards(self, staged: Any, plan: pa.Table, fn: WriteFn, *, num_parts: int) -> list[dict[str, Any]]:
        from pyspark.sql import functions as F

        route = pa.array(self._routing_keys(num_parts), pa.int64()).take(plan["part"])
        plan_df = self.spark.createDataFrame(plan.append_column("route", route))
        rows = (staged.filter(F.col("status") == "ok").drop("status", "reason")
                .join(F.broadcast(plan_df), "uri")
                .repartition(num_parts, "route")
                .sortWithinPartitions("part", "position"))

        def write(batches):
            # Rows arrive sorted by (part, position); a task normally holds one part, but the
            # writer does not rely on it: it starts a new shard file whenever the part changes.
            stream = ((r["part"], r) for b in batches for r in b.to_pylist())
            for part, group in itertools.groupby(stream, key=lambda pr: pr[0]):
                stats = fn(part, (((part, r["position"]), r) for _, r in group))
                yield pa.RecordBatch.from_pylist([{"stats": json.dumps(stats)}])

        out = rows.mapInArrow(write, "stats string").toArrow()
        return [json.loads(s) for s in out["stats"].to_pylist()]

    def release(self, staged: Any) -> None:
        staged.unpersist()

    def close(self) -> None:
        if self._owned:
            self.spark.stop()
