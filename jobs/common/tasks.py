"""Work items on an engine: how a task travels (compacted), how tasks are packed into the
engine's partitions, and how a task writes a table. Nothing here knows about Spark or Dask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lakeshard import storage

__all__ = ["compact", "each", "pack", "read_rows", "row_group_starts", "write_table"]


def compact(table: pa.Table) -> pa.Table:
    """``table`` with buffers of its own. A task travels pickled, and pickling a slice of an
    Arrow table sends its parent's whole buffers: a 2,000-row segment of a 100,000-row channel
    pickled to 6.9 MB, and the 48 tasks of a 100,000-image shard job filled Spark's default
    1 GiB driver heap (``sc.parallelize`` keeps every task's bytes there)."""
    return table.take(np.arange(table.num_rows))


def pack(items: list[Any], sizes: list[int], bins: int) -> list[list[Any]]:
    """``items`` in at most ``bins`` groups of nearly equal total size (largest first into the
    lightest group), largest group first. An engine task costs tenths of a second to schedule
    here (PySpark), so many small shards share a task rather than each taking one."""
    groups: list[list[Any]] = [[] for _ in range(max(1, min(bins, len(items))))]
    loads = [0] * len(groups)
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
        g = loads.index(min(loads))
        groups[g].append(items[i])
        loads[g] += sizes[i]
    return [g for _, g in sorted(zip(loads, groups, strict=True), key=lambda lg: -lg[0]) if g]


class each:
    """``fn`` on every item of a partition of groups: an engine's ``map_partitions`` function
    (a class, so it pickles by reference)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, groups: list[list[Any]]) -> list[Any]:
        return [self.fn(item) for group in groups for item in group]


def row_group_starts(pf: pq.ParquetFile) -> np.ndarray:
    """The first row of each of ``pf``'s row groups, and its number of rows last."""
    return np.cumsum([0, *(pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups))])


def read_rows(uri: str, offset: int, length: int) -> pa.Table:
    """Rows ``offset`` to ``offset + length`` of the Parquet file ``uri``, reading only the row
    groups that hold them (an order file has a row group per segment: a segment's task reads
    its own, not the whole shard's)."""
    fs, path = storage.filesystem(uri)
    with fs.open(path, "rb") as handle:
        pf = pq.ParquetFile(handle)
        starts = row_group_starts(pf)
        if offset < 0 or length < 0 or offset + length > starts[-1]:
            raise IndexError(f"{uri} has {starts[-1]} rows; asked for rows {offset} to {offset + length}")
        first = int(np.searchsorted(starts, offset, side="right")) - 1
        last = int(np.searchsorted(starts, offset + length, side="left"))
        groups = list(range(first, max(first + 1, last)))
        return pf.read_row_groups(groups).slice(offset - int(starts[first]), length)


def write_table(
    uri: str,
    table: pa.Table,
    *,
    metadata: dict[bytes, bytes] | None = None,
    row_group_size: int | None = None,
) -> None:
    """Write ``table`` as Parquet to ``uri`` atomically (:func:`lakeshard.storage.write_bytes_atomic`)."""
    sink = pa.BufferOutputStream()
    pq.write_table(
        table.replace_schema_metadata(metadata) if metadata else table, sink, row_group_size=row_group_size
    )
    storage.write_bytes_atomic(uri, sink.getvalue().to_pybytes())
