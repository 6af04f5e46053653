"""Cut the shard plan into preprocessing tasks: each shard whole into its file, or in segments
written apart and assembled afterwards. Plain Python on the driver, from the plan's counts: a
task names its rows as a slice of its shard's order file (:mod:`jobs.shard_steps.plan_tasks`), which it
reads on its worker."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.deal import Deal
from jobs.shard_steps.preprocess import SegmentTask
from jobs.shard_steps.staging import RUNS, outcomes_uri, receipt_uri, staged_shard
from lakeshard import storage
from lakeshard.format import channel_dirname

__all__ = ["SPARE", "order_uri", "segment_cuts", "segment_tasks"]

#: The shard index of a channel's spare rows (those the remainder policy drops).
SPARE = -1


def segment_cuts(rows: int, segment_rows: int) -> tuple[int, ...]:
    """Where a shard of ``rows`` rows is cut into segments of 0.67-1.5x ``segment_rows`` rows:
    ``(0, rows)`` for a shard preprocessed whole."""
    pieces = max(1, round(rows / segment_rows))
    size = math.ceil(rows / pieces)
    return (*(min(j * size, rows) for j in range(pieces)), rows)


def order_uri(staging: str, plan: str, channel: str, shard: int) -> str:
    """The order file of ``shard`` (or the spare rows) of ``channel`` in plan ``plan``."""
    name = "spare.parquet" if shard == SPARE else f"{shard:05d}.parquet"
    return storage.join(staging, RUNS, f"order-{plan}", channel_dirname(channel), name)


def segment_tasks(staging: str, deals: dict[str, Deal], orders: dict[tuple[str, int], dict[str, Any]],
                  cfg: ShardConfig, meta: dict[str, Any], *, segment_rows: int,
                  decode_threads: int) -> list[SegmentTask]:
    """Preprocessing tasks for the first plan: each shard whole into its file, or, if it has more
    than ``segment_rows`` rows, in segments written apart and assembled afterwards. The rows the
    remainder policy left out are preprocessed too (a spare task per channel), in case rejects
    change the plan. ``orders`` holds each order task's result by (channel, shard)."""
    tasks = []

    def task(uri: str, order: dict[str, Any], j: int, span: tuple[int, int], channel: str, shard: int) -> SegmentTask:
        return SegmentTask(uri=uri, rows=None, source=(order["uri"], span[0], span[1] - span[0]),
                           digest=order["digests"][j], reuse_id=order["segments"][j], spec=cfg.image_spec(), threads=cfg.threads,
                           receipt=receipt_uri(staging, uri), outcomes=outcomes_uri(staging, uri),
                           decode_threads=decode_threads,
                           row_group_bytes=cfg.row_group_size, metadata={**meta, "channel": channel, "shard_index": shard})

    for channel, deal in deals.items():
        cuts = segment_cuts(deal.rows_per_shard, segment_rows)
        for shard in range(deal.num_shards):
            order = orders[(channel, shard)]
            for j, span in enumerate(pairwise(cuts)):
                uri = staged_shard(staging, channel, shard, cfg.num_shards) if len(cuts) == 2 else \
                    storage.join(staging, RUNS, channel_dirname(channel), f"{shard:05d}-{j:05d}.parquet")
                tasks.append(task(uri, order, j, span, channel, shard))
        if deal.dropped:
            uri = storage.join(staging, RUNS, channel_dirname(channel), "spare.parquet")
            tasks.append(task(uri, orders[(channel, SPARE)], 0, (0, len(deal.dropped)), channel, SPARE))
    return tasks
