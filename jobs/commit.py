"""The shard job's commit: the shard rejects table and the staged shards take the old ones'
place, then ``dataset.json`` makes the dataset visible. A reader sees the old dataset, no
dataset, or the new one, never a part (readers trust a dataset only once ``dataset.json`` is
there)."""

from __future__ import annotations

from typing import Any

from jobs.deal import Deal
from jobs.preprocess import SegmentTask
from jobs.staging import RUNS, staged_shard, staging_root
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import DatasetInfo, dataset_json_uri, shard_rejects_uri, shards_uri

__all__ = ["commit", "place_assembled", "staged_rejects"]


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


def _check_counts(stats: list[dict[str, Any]], plans: dict[str, Deal], num_shards: int) -> None:
    """The invariant, counted: exactly ``num_shards`` files of equal size per channel."""
    for channel, plan in plans.items():
        got = sorted((s["shard"], s["rows"]) for s in stats if s["channel"] == channel)
        want = [(i, plan.rows_per_shard) for i in range(num_shards)]
        if got != want:
            raise ShardError(f"channel {channel!r}: wrote shards {got}, planned {want}; nothing was committed")


def staged_rejects(staging: str) -> str:
    """The folder below which the workers write the shard rejects table before the commit
    (:func:`~lakeshard.format.shard_rejects_uri` of it)."""
    return storage.join(staging, RUNS, "table")


def commit(root: str, staging: str, *, stats: list[dict[str, Any]], plans: dict[str, Deal], info: DatasetInfo) -> None:
    """Check the staged shards, then: invalidate the old dataset, put the shard rejects table
    the workers wrote and the new shards in the old ones' place, and last write ``dataset.json``
    (``info``)."""
    _check_counts(stats, plans, info.num_shards)
    storage.remove(dataset_json_uri(root))
    storage.replace(shard_rejects_uri(staged_rejects(staging)), shard_rejects_uri(root))
    storage.remove(storage.join(staging, RUNS), recursive=True)
    storage.remove(shards_uri(root), recursive=True)
    storage.remove_temporaries(staging)  # a killed client's tasks may still have been writing
    storage.move(staging, shards_uri(root))
    storage.remove(staging_root(root), recursive=True)
    storage.write_json_atomic(dataset_json_uri(root), info.to_json())
