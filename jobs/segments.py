"""Cut the shard plan into preprocessing tasks: each shard whole into its file, or in segments
written apart and assembled afterwards. Plain Python on the driver."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa

from jobs.plan import ShardPlan
from jobs.preprocess import SEGMENT_SCHEMA, SegmentTask
from jobs.settings import ShardConfig
from jobs.staging import RUNS, receipt_uri, staged_shard
from lakeshard import storage
from lakeshard.format import channel_dirname

__all__ = ["rows_by_shard", "segment_tasks"]


def rows_by_shard(rows: pa.Table, plan: ShardPlan) -> list[pa.Table]:
    """Each shard's rows in position order (:data:`SEGMENT_SCHEMA`)."""
    order = np.lexsort((plan.position, plan.shard))
    source = pa.array(plan.source[order], pa.int64())
    table = pa.table({"uri": rows["uri"].take(source), "key": rows["key"].take(source),
                      "label_index": rows["label_index"].take(source),
                      "is_pad": pa.array(plan.is_pad[order], pa.bool_()),
                      "size": rows["size"].take(source), "etag": rows["etag"].take(source)}, schema=SEGMENT_SCHEMA)
    cuts = np.searchsorted(plan.shard[order], np.arange(plan.num_shards + 1))
    return [table.slice(int(a), int(b - a)) for a, b in pairwise(cuts)]


def segment_tasks(staging: str, ordered: dict[str, pa.Table], plans: dict[str, ShardPlan], cfg: ShardConfig,
                  meta: dict[str, Any], *, segment_rows: int, decode_threads: int) -> list[SegmentTask]:
    """Preprocessing tasks for the first plan: each shard whole into its file, or, if it has more
    than ``segment_rows`` rows, in segments written apart and assembled afterwards. The rows the
    remainder policy left out are preprocessed too (a spare task per channel), in case rejects
    change the plan."""
    tasks = []

    def task(uri: str, rows: pa.Table, channel: str, shard: int) -> SegmentTask:
        return SegmentTask(uri=uri, rows=rows, spec=cfg.image_spec(), threads=cfg.threads,
                           receipt=receipt_uri(staging, uri), decode_threads=decode_threads,
                           row_group_bytes=cfg.row_group_size, metadata={**meta, "channel": channel, "shard_index": shard})

    for channel, plan in plans.items():
        rows = ordered[channel]
        for shard, mine in enumerate(rows_by_shard(rows, plan)):
            pieces = max(1, round(mine.num_rows / segment_rows))  # segments of 0.67-1.5x segment_rows
            if pieces == 1:
                tasks.append(task(staged_shard(staging, channel, shard, cfg.num_shards), mine, channel, shard))
                continue
            size = math.ceil(mine.num_rows / pieces)
            for j in range(pieces):
                uri = storage.join(staging, RUNS, channel_dirname(channel), f"{shard:05d}-{j:05d}.parquet")
                tasks.append(task(uri, mine.slice(j * size, size), channel, shard))
        if len(plan.dropped):
            spare = rows.take(pa.array(plan.dropped, pa.int64()))
            spare = pa.table({"uri": spare["uri"], "key": spare["key"], "label_index": spare["label_index"],
                              "is_pad": pa.array([False] * spare.num_rows), "size": spare["size"],
                              "etag": spare["etag"]}, schema=SEGMENT_SCHEMA)
            tasks.append(task(storage.join(staging, RUNS, channel_dirname(channel), "spare.parquet"), spare, channel, -1))
    return tasks
