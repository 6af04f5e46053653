"""The columns a shard job carries beyond one class (docs/design/0045-shard-job-labels.md): a
multi-label or boxes manifest's label columns and its kept columns, from the manifest tables
through the plan's order files and preprocessing into the shards
(:func:`~lakeshard.format.label_columns.shard_schema`)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from lakeshard import storage
from lakeshard.format import ManifestInfo, manifest_part_uri
from lakeshard.format.label_columns import BOXES, SINGLE_LABEL, manifest_schema, shard_fields, shard_schema
from lakeshard.format.layout import FORMAT_VERSION, TASK_FORMAT_VERSION

__all__ = ["ShardColumns", "shard_columns"]


@dataclass(frozen=True, slots=True)
class ShardColumns:
    """A dataset's task kind and the kept columns (``--keep-columns``) its manifest carries,
    with their Arrow types; a single-label dataset with none writes :data:`SHARD_SCHEMA`
    exactly."""

    task: str = SINGLE_LABEL
    kept: pa.Schema | None = None

    @property
    def schema(self) -> pa.Schema:
        """The shards' schema."""
        return shard_schema(self.task, self.kept)

    @property
    def carried(self) -> tuple[str, ...]:
        """The manifest columns a row carries to its shard beyond the single-label ones."""
        return tuple(f.name for f in shard_fields(self.task, self.kept))

    @property
    def boxes(self) -> bool:
        """Whether rows have boxes, moved with their image."""
        return self.task == BOXES

    @property
    def format_version(self) -> int:
        """The dataset's format version: 3 for single-label, 4 beyond."""
        return FORMAT_VERSION if self.task == SINGLE_LABEL else TASK_FORMAT_VERSION

    def types(self) -> dict[str, str] | None:
        """``dataset.json``'s ``columns``: each carried column's Arrow type as text; None for a
        single-label dataset."""
        if self.task == SINGLE_LABEL:
            return None
        return {f.name: str(f.type) for f in shard_fields(self.task, self.kept)}


def shard_columns(root: str, marker: ManifestInfo, channel: str) -> ShardColumns:
    """The columns of the manifest at ``root`` (marker ``marker``): its task kind, and the kept
    columns' types from ``channel``'s first table part."""
    task = marker.task_kind
    if task == SINGLE_LABEL:
        return ShardColumns()
    fs, path = storage.filesystem(manifest_part_uri(root, channel, 0, marker.parts))
    schema = pq.read_schema(path, filesystem=fs)
    known = set(manifest_schema(task).names)
    return ShardColumns(task=task, kept=pa.schema([f for f in schema if f.name not in known]) or None)
