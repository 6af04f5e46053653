"""Cut the shard plan into preprocessing tasks: each shard whole into its file, or in segments
written apart and assembled afterwards. Plain Python on the driver, from the plan's counts: a
task names its rows as a slice of its shard's order file (:mod:`jobs.shard_steps.plan_tasks`), which it
reads on its worker."""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.deal import DROPPED_ROWS_SHARD, Deal
from jobs.shard_steps.preprocess import RowRange, SegmentTask
from jobs.shard_steps.staging import outcomes_uri, receipt_uri, staged_shard, work_uri
from lakeshard.format import SHARD_SCHEMA, channel_dirname

if TYPE_CHECKING:  # the order tasks cut their shards with segment_cuts, below
    from jobs.shard_steps.plan_tasks import ShardOrder

__all__ = ["segment_cuts", "segment_tasks"]


def segment_cuts(rows: int, segment_rows: int) -> tuple[int, ...]:
    """Where a shard of ``rows`` rows is cut into segments of 0.67-1.5x ``segment_rows`` rows:
    ``(0, rows)`` for a shard preprocessed whole."""
    pieces = max(1, round(rows / segment_rows))
    size = math.ceil(rows / pieces)
    return (*(min(j * size, rows) for j in range(pieces)), rows)


def segment_tasks(
    staging: str,
    deal: Deal,
    orders: Mapping[int, ShardOrder],
    cfg: ShardConfig,
    meta: dict[str, Any],
    *,
    segment_rows: int,
    decode_threads: int,
    schema: pa.Schema = SHARD_SCHEMA,
) -> list[SegmentTask]:
    """Preprocessing tasks for the first plan of a channel (``deal``): each shard whole into its
    file, or, if it has more than ``segment_rows`` rows, in segments written apart and assembled
    afterwards. The rows the remainder policy left out are preprocessed too (a task of their
    own), in case rejects change the plan. ``orders`` holds the channel's order files, by shard;
    ``schema`` is the shards' (:func:`~lakeshard.format.label_columns.shard_schema`)."""
    channel = deal.channel

    def task(uri: str, order: ShardOrder, j: int, span: tuple[int, int], shard: int) -> SegmentTask:
        return SegmentTask(
            uri=uri,
            rows=None,
            source=RowRange(order.uri, span[0], span[1] - span[0]),
            digest=order.digests[j],
            reuse_id=order.segments[j],
            spec=cfg.image_spec(),
            threads=cfg.threads,
            receipt=receipt_uri(staging, uri),
            outcomes=outcomes_uri(staging, uri),
            decode_threads=decode_threads,
            row_group_bytes=cfg.row_group_size,
            metadata={**meta, "channel": channel, "shard_index": shard},
            schema=schema,
        )

    tasks = []
    cuts = segment_cuts(deal.rows_per_shard, segment_rows)
    for shard in range(deal.num_shards):
        for j, span in enumerate(pairwise(cuts)):
            uri = (
                staged_shard(staging, channel, shard, cfg.num_shards)
                if len(cuts) == 2
                else work_uri(staging, channel_dirname(channel), f"{shard:05d}-{j:05d}.parquet")
            )
            tasks.append(task(uri, orders[shard], j, span, shard))
    if deal.dropped:
        uri = work_uri(staging, channel_dirname(channel), "spare.parquet")
        tasks.append(task(uri, orders[DROPPED_ROWS_SHARD], 0, (0, len(deal.dropped)), DROPPED_ROWS_SHARD))
    return tasks
