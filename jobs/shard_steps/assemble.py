"""The shard job's second worker step: assemble a shard file from rows already preprocessed
(when rejects changed the plan, or a shard was preprocessed in several segments). Engines run
it as a plain task; nothing here knows about Spark or Dask.

:func:`locate_and_assemble` finds where each of the shard's rows was written (from the
outcomes the preprocessing tasks left beside their receipts), then :func:`assemble_shard`
copies them into the shard's file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.common.tasks import compact, row_group_starts
from jobs.shard_steps.preprocess import DROPPED_FIELD
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import SHARD_SCHEMA
from lakeshard.format.writer import ShardWriter

__all__ = [
    "SOURCE_SCHEMA",
    "AssembleTask",
    "AssembledShard",
    "RepairTask",
    "SegmentFiles",
    "assemble_shard",
    "locate_and_assemble",
]

#: Where each row of an assembled shard comes from, in shard order.
#: ``file`` is dictionary-encoded: a shard of 20,000 rows comes from a handful of segment files, and
#: their paths repeated on every row made a 100,000-image Spark job's assembly tasks 1.9 MB each
#: (over Spark's 1 MB task-size warning).
SOURCE_SCHEMA = pa.schema(
    [("file", pa.dictionary(pa.int32(), pa.string())), ("row", pa.int64()), ("is_pad", pa.bool_())]
)


@dataclass(frozen=True, slots=True)
class AssembleTask:
    """Write ``uri`` from already preprocessed rows: ``sources`` (:data:`SOURCE_SCHEMA`), in order."""

    uri: str
    sources: pa.Table
    metadata: Mapping[str, Any]  #: the footer's values (footer_metadata() makes them strings)
    row_group_bytes: int
    schema: pa.Schema = SHARD_SCHEMA  #: the shards' (``label_columns.shard_schema``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", compact(self.sources))


class _RowGroupCache:
    """Reads rows of preprocessed files a row group at a time, keeping the last few groups:
    an assembled shard reads most rows in order from one or a few files."""

    def __init__(self, columns: list[str], keep: int = 4) -> None:
        self._columns = columns
        self._files: dict[str, tuple[pq.ParquetFile, np.ndarray, Any]] = {}
        self._groups: dict[tuple[str, int], pa.Table] = {}
        self._keep = keep

    def _file(self, uri: str) -> tuple[pq.ParquetFile, np.ndarray]:
        if uri not in self._files:
            fs, path = storage.filesystem(uri)
            handle = fs.open(path, "rb")
            pf = pq.ParquetFile(handle)
            self._files[uri] = (pf, row_group_starts(pf), handle)
        pf, starts, _ = self._files[uri]
        return pf, starts

    def take(self, uri: str, rows: np.ndarray) -> pa.Table:
        """Rows ``rows`` (ascending or not) of ``uri``, in the order asked."""
        pf, starts = self._file(uri)
        groups = np.searchsorted(starts, rows, side="right") - 1
        if len(rows) and (rows.min() < 0 or rows.max() >= starts[-1]):
            raise IndexError(f"{uri} has {starts[-1]} rows; asked for row {int(rows.max())}")
        pieces = []
        for g in np.unique(groups):
            key = (uri, int(g))
            if key not in self._groups:
                if len(self._groups) >= self._keep:
                    self._groups.pop(next(iter(self._groups)))
                self._groups[key] = pf.read_row_group(int(g), columns=self._columns)
            pieces.append(self._groups[key])
        table = pa.concat_tables(pieces)
        offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in pieces])])
        first = {int(g): int(o - starts[g]) for g, o in zip(np.unique(groups), offsets[:-1], strict=True)}
        return table.take(
            pa.array([first[int(g)] + int(r) for g, r in zip(groups, rows, strict=True)], pa.int64())
        )

    def close(self) -> None:
        for _, _, handle in self._files.values():
            handle.close()
        self._files.clear()
        self._groups.clear()


@dataclass(frozen=True, slots=True)
class AssembledShard:
    """A shard file an assembly wrote: its URI and its :attr:`~lakeshard.format.writer.ShardWriter.stats`."""

    uri: str
    stats: dict[str, Any]
    #: a ``boxes`` dataset: boxes the resize dropped from its rows, pad copies not counted, by reason
    dropped_boxes: dict[str, int] = field(default_factory=dict)


def assemble_shard(task: AssembleTask) -> AssembledShard:
    """Write ``task.uri`` from its sources, in order.

    ``task.uri`` must not be a source of any assembly running at the same time: the job
    assembles into new files and moves them into place once every assembly is done.
    """
    sources = task.sources
    cache = _RowGroupCache([n for n in task.schema.names if n != "is_pad"])
    try:
        with ShardWriter(
            task.uri, metadata=task.metadata, row_group_bytes=task.row_group_bytes, schema=task.schema
        ) as writer:
            files = sources["file"].to_pylist()
            rows = sources["row"].to_numpy()
            start = 0
            while start < len(files):  # runs of consecutive rows from the same file
                stop = start + 1
                while stop < len(files) and files[stop] == files[start] and stop - start < 1024:
                    stop += 1
                got = cache.take(files[start], rows[start:stop])
                is_pad = sources["is_pad"].slice(start, stop - start)
                writer.write(
                    got.add_column(task.schema.get_field_index("is_pad"), "is_pad", is_pad).cast(task.schema)
                )
                start = stop
    finally:
        cache.close()
    return AssembledShard(uri=task.uri, stats=writer.stats)


class SegmentFiles(NamedTuple):
    """A preprocessed segment's file and its outcomes file (where it wrote each of its rows)."""

    outcomes: str
    segment: str


@dataclass(frozen=True, slots=True)
class RepairTask:
    """Write ``uri`` with the rows of the order file ``order``, in order, each taken from where
    preprocessing wrote it: ``own`` are the shard's own segments, ``others`` those of the shards
    rows moved in from; a row is taken from its own segments if it is there."""

    uri: str
    order: str
    own: tuple[SegmentFiles, ...]
    others: tuple[SegmentFiles, ...]
    metadata: Mapping[str, Any]  #: the footer's values (footer_metadata() makes them strings)
    row_group_bytes: int
    schema: pa.Schema = SHARD_SCHEMA  #: the shards' (``label_columns.shard_schema``)


def _read(uri: str, columns: list[str], *, only: pa.Array | None = None) -> pa.Table:
    fs, path = storage.filesystem(uri)
    table = pq.read_table(path, filesystem=fs, columns=columns)
    return table if only is None else table.filter(pc.is_in(table["uri"], value_set=only))


def locate_and_assemble(task: RepairTask) -> AssembledShard:
    """Run a :class:`RepairTask`."""
    want = _read(task.order, ["uri", "is_pad"])
    where: dict[str, tuple[str, int]] = {}
    dropped: dict[str, list[str]] = {}  # a boxes dataset's: each row's boxes the resize dropped
    boxes = "boxes" in task.schema.names
    others = want["uri"].unique()
    for group, only in ((task.own, None), (task.others, others)):
        for files in group:
            got = _read(files.outcomes, ["uri", "row", *([DROPPED_FIELD.name] if boxes else [])], only=only)
            why = got[DROPPED_FIELD.name].to_pylist() if boxes else [[]] * got.num_rows
            for uri, row, lost in zip(got["uri"].to_pylist(), got["row"].to_pylist(), why, strict=True):
                if row is not None and uri not in where:
                    where[uri] = (files.segment, row)
                    dropped[uri] = lost
    uris = want["uri"].to_pylist()
    if missing := [u for u in uris if u not in where]:
        raise ShardError(
            f"assembling {task.uri}: {len(missing)} rows were not written by any segment it was "
            f"given, first {missing[:3]}"
        )
    sources = pa.table(
        {"file": [where[u][0] for u in uris], "row": [where[u][1] for u in uris], "is_pad": want["is_pad"]},
        schema=SOURCE_SCHEMA,
    )
    shard = assemble_shard(
        AssembleTask(
            uri=task.uri,
            sources=sources,
            metadata=task.metadata,
            row_group_bytes=task.row_group_bytes,
            schema=task.schema,
        )
    )
    lost = Counter(
        w for u, pad in zip(uris, want["is_pad"].to_pylist(), strict=True) if not pad for w in dropped[u]
    )
    return replace(shard, dropped_boxes=dict(sorted(lost.items())))
