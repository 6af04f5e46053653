"""The shard job's commit: the staged shards take the old ones' place, then the shard rejects
table, then ``dataset.json`` makes the dataset visible. A reader sees the old dataset, no
dataset, or the new one, never a part (readers trust a dataset only once ``dataset.json`` is
there)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.plan import ShardPlan
from jobs.preprocess import SegmentTask
from jobs.staging import RUNS, staged_shard, staging_root
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import (
    SHARD_REJECTS_SCHEMA,
    DatasetInfo,
    dataset_json_uri,
    shard_rejects_uri,
    shards_uri,
)

__all__ = ["commit", "place_assembled"]


def place_assembled(staging: str, final: dict[tuple[str, int], str], tasks: list[SegmentTask], *,
                    num_shards: int) -> None:
    """Move each shard assembled beside into its place in the staging folder; a segment file it
    replaces loses its receipt (which no longer vouches for it)."""
    moves = {uri: staged_shard(staging, channel, shard, num_shards) for (channel, shard), uri in final.items()}
    moves = {uri: target for uri, target in moves.items() if uri != target}
    replaced = set(moves.values())
    for task in tasks:
        if task.uri in replaced and task.receipt is not None:
            storage.remove(task.receipt)
    for uri, target in moves.items():
        storage.replace(uri, target)


def _check_counts(stats: list[dict[str, Any]], plans: dict[str, ShardPlan], num_shards: int) -> None:
    """The invariant, counted: exactly ``num_shards`` files of equal size per channel."""
    for channel, plan in plans.items():
        got = sorted((s["shard"], s["rows"]) for s in stats if s["channel"] == channel)
        want = [(i, plan.rows_per_shard) for i in range(num_shards)]
        if got != want:
            raise ShardError(f"channel {channel!r}: wrote shards {got}, planned {want}; nothing was committed")


def commit(root: str, staging: str, *, stats: list[dict[str, Any]], plans: dict[str, ShardPlan],
           rejects: pa.Table, info: DatasetInfo) -> None:
    """Check the staged shards, then: invalidate the old dataset, put the new shards in the old
    ones' place, write the shard rejects table, and last ``dataset.json`` (``info``)."""
    _check_counts(stats, plans, info.num_shards)
    storage.remove(storage.join(staging, RUNS), recursive=True)
    storage.remove(dataset_json_uri(root))
    storage.remove(shards_uri(root), recursive=True)
    storage.remove_temporaries(staging)  # a killed client's tasks may still have been writing
    storage.move(staging, shards_uri(root))
    storage.remove(staging_root(root), recursive=True)
    sink = pa.BufferOutputStream()
    pq.write_table(rejects.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA), sink)
    storage.write_bytes_atomic(shard_rejects_uri(root), sink.getvalue().to_pybytes())
    storage.write_json_atomic(dataset_json_uri(root), info.to_json())
