"""The manifest's rows, read where they are needed: the one place the jobs read manifest rows
(the shard job reads one channel's rows, or one group of its classes, inside an engine task).

Layout read: ``manifests/<channel>.parquet`` (:func:`lakeshard.format.manifests_uri`), the rows
filtered on ``label`` as they are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from lakeshard import storage
from lakeshard.errors import ManifestError
from lakeshard.format import manifests_uri

__all__ = ["read_channel_rows"]


def read_channel_rows(root: str, channel: str, *, labels: Sequence[str] | None = None,
                      columns: Sequence[str] | None = None) -> pa.Table:
    """The manifest rows of ``channel`` of the dataset at ``root``: all of them, or those whose
    ``label`` is one of ``labels``; all columns, or ``columns``. Row order is not specified."""
    uri = manifests_uri(root, f"{channel}.parquet")
    fs, path = storage.filesystem(uri)
    try:
        dataset = ds.dataset(path, filesystem=fs, format="parquet")
    except FileNotFoundError as exc:
        raise ManifestError(f"channel {channel!r} has no manifest table at {uri}: {exc}") from exc
    where = None if labels is None else pc.field("label").isin(pa.array(list(labels), pa.string()))
    return dataset.to_table(columns=None if columns is None else list(columns), filter=where)
