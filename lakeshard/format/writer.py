"""The shard writer (rows of :data:`~lakeshard.format.SHARD_SCHEMA`, or a multi-label or boxes
dataset's :func:`~lakeshard.format.label_columns.shard_schema`, into one Parquet file,
with the footer keys readers check, :mod:`lakeshard.format.footer`) and the shard rejects' writer."""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lakeshard import storage
from lakeshard.format.footer import footer_metadata
from lakeshard.format.layout import SHARD_REJECTS_SCHEMA, SHARD_SCHEMA, shard_rejects_uri

__all__ = ["ShardWriter", "write_shard_rejects"]


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes what passes through to ``sink``."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._sink.write(view)
        self.sha256.update(view)
        self.bytes += view.nbytes
        return view.nbytes


class ShardWriter:
    """Writes :data:`SHARD_SCHEMA` rows (or ``schema``'s: a multi-label or boxes dataset's
    :func:`~lakeshard.format.label_columns.shard_schema`) to one Parquet file, hashing it as it
    goes.

    A row group closes right after the row that brings its images to ``row_group_bytes``, so
    row groups depend only on the rows, not on how they were handed in: a shard written in one
    go and one assembled from pieces are the same bytes. The image column is stored
    uncompressed and without dictionary encoding (JPEG bytes do not compress, and a dictionary
    only slows reading). ``stats`` (after closing): rows, bytes, sha256, row groups and
    per-label counts (rows of each ``label``; with ``label_indices``, rows holding each label).
    ``row_group_rows`` (optional) also closes a row group once it holds that
    many rows, whichever of the two comes first.
    """

    def __init__(
        self,
        uri: str,
        *,
        metadata: Mapping[str, Any],
        row_group_bytes: int,
        row_group_rows: int | None = None,
        schema: pa.Schema = SHARD_SCHEMA,
    ) -> None:
        self._schema = schema.with_metadata(footer_metadata(metadata))
        self._label_column = "label_indices" if "label_indices" in schema.names else "label"
        self._row_group_bytes = row_group_bytes
        self._row_group_rows = row_group_rows
        self._fs, self._path = storage.filesystem(uri)
        self._local = storage.is_local(uri)
        self._pending: list[pa.Table] = []
        self._pending_bytes = self._pending_rows = 0
        self._labels: dict[int, int] = {}
        self._rows = self._row_groups = 0
        self.stats: dict[str, Any] = {}

    def __enter__(self) -> ShardWriter:
        self._fs.makedirs(posixpath.dirname(self._path), exist_ok=True)  # a no-op on S3
        # A local file is written under a temporary name and renamed once complete, so a writer
        # never truncates a complete file: a task of a killed attempt that a Dask worker still
        # finishes must not cut short the file a later attempt wrote (or a commit moved into the
        # dataset). S3 shows an object only once its upload is complete.
        self._final = self._path
        if self._local:
            self._path = storage.temp_sibling(self._final)
        self._raw = self._fs.open(self._path, "wb")
        self._sink = _HashingWriter(self._raw)
        self._writer = pq.ParquetWriter(
            self._sink,
            self._schema,
            compression={**dict.fromkeys(self._schema.names, "SNAPPY"), "image": "NONE"},
            use_dictionary=["label", "height", "width", "is_pad"],
            write_statistics=["label", "height", "width", "is_pad"],
        )
        return self

    def write(self, table: pa.Table) -> None:
        """Append ``table``'s rows (of the writer's schema)."""
        import pyarrow.compute as pc  # here, not at the top: the loader imports this package (~0.1 s)

        if not table.num_rows:
            return
        labels = table[self._label_column]
        if self._label_column == "label_indices":
            labels = pc.list_flatten(labels)
        for label, count in zip(*np.unique(labels.to_numpy(), return_counts=True), strict=True):
            self._labels[int(label)] = self._labels.get(int(label), 0) + int(count)
        self._rows += table.num_rows
        sizes = pc.binary_length(table["image"]).to_numpy(zero_copy_only=False)
        start = 0
        while start < table.num_rows:
            # Cut right after the row whose image reaches the row-group size.
            need = self._row_group_bytes - self._pending_bytes
            cum = np.cumsum(sizes[start:])
            reach = int(np.searchsorted(cum, need))  # first row with cum >= need
            if self._row_group_rows is not None:
                reach = min(reach, self._row_group_rows - self._pending_rows - 1)
            if reach >= len(cum):
                self._pending.append(table.slice(start))
                self._pending_bytes += int(cum[-1])
                self._pending_rows += len(cum)
                return
            self._pending.append(table.slice(start, reach + 1))
            self._flush()
            start += reach + 1

    def _flush(self) -> None:
        if self._pending:
            group = pa.concat_tables(self._pending)
            self._writer.write_table(group, row_group_size=group.num_rows)
            self._row_groups += 1
            self._pending, self._pending_bytes, self._pending_rows = [], 0, 0

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self._flush()
            self._writer.close()
        finally:
            self._raw.close()
            if self._local:
                if exc_type is None:
                    os.replace(self._path, self._final)
                else:
                    with suppress(OSError):
                        os.remove(self._path)
        self.stats = {
            "rows": self._rows,
            "bytes": self._sink.bytes,
            "sha256": self._sink.sha256.hexdigest(),
            "row_groups": self._row_groups,
            "label_counts": {str(k): v for k, v in sorted(self._labels.items())},
        }


def write_shard_rejects(root: str, rejects: pa.Table, *, relpath: str | None = None) -> str:
    """Write the shard job's rejects (:data:`SHARD_REJECTS_SCHEMA` columns, other columns
    dropped) atomically to ``relpath`` below ``root`` (default:
    :func:`~lakeshard.format.layout.shard_rejects_uri`, the local layout's); return its URI."""
    uri = storage.join(root, relpath) if relpath else shard_rejects_uri(root)
    table = rejects.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(uri, sink.getvalue().to_pybytes())
    return uri
