"""Reading the manifest tables the manifest job wrote (``docs/format.md``, "Manifest tables").

Each table (a channel, ``all`` or ``rejects``) is a folder of ``parts`` Parquet files, ``parts``
read from ``manifests/_manifest.json``; every class's rows are in one part,
:func:`label_part` says which. Each part is sorted by key; the parts together are not.

Read a whole table with :func:`read_channel` (a notebook, a report, a test), or one part per
task with :func:`read_channel_rows` (the workers of a job that must not gather every row).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, TypedDict

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lakeshard import storage
from lakeshard.errors import DatasetError, StorageError
from lakeshard.format.layout import MANIFEST_SCHEMA, manifest_part_uri, sagemaker_part_uri
from lakeshard.format.manifest_info import read_manifest_info

__all__ = [
    "ManifestRow",
    "channel_parts",
    "hash_bucket",
    "iter_parts",
    "label_part",
    "manifest_parts",
    "read_channel",
    "read_channel_rows",
    "read_part",
    "sagemaker_parts",
    "table_rows",
    "write_part",
]


class ManifestRow(TypedDict):
    """One row of a manifest table, as the manifest job's steps hand it on (a plain dict at
    run time): the columns of :data:`~lakeshard.format.layout.MANIFEST_SCHEMA`.

    ``label``, ``channel`` and ``reason`` are ``str | None`` as the status says (an accepted
    row has a label and, once split, a channel; a rejected or skipped one a reason); they are
    typed ``Any`` because the steps rely on that invariant, which a type cannot state."""

    uri: str
    key: str  #: below the lake prefix
    label: Any  #: str | None
    label_index: int | None
    channel: Any  #: str | None: None unless accepted
    size: int
    etag: str | None
    last_modified: datetime | None
    format: str | None  #: the sniffed image format (None: not read)
    status: str  #: ``ok``, ``rejected`` or ``skipped``
    reason: Any  #: str | None: why it was rejected or skipped


def hash_bucket(text: str, buckets: int) -> int:
    """A bucket in ``[0, buckets)`` that depends only on ``text`` (stable across processes)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % buckets


def label_part(label: str | None, parts: int) -> int:
    """The part that holds every row of ``label`` (rows without a label: the part of ``""``)."""
    return hash_bucket(label or "", parts)


def manifest_parts(root: str) -> int:
    """How many parts each manifest table of the dataset at ``root`` has (``_manifest.json``)."""
    return read_manifest_info(root).parts


def channel_parts(root: str, channel: str) -> list[str]:
    """The URIs of every part of one table (``channel``: a channel, ``all`` or ``rejects``)."""
    count = manifest_parts(root)
    return [manifest_part_uri(root, channel, i, count) for i in range(count)]


def sagemaker_parts(root: str, channel: str) -> list[str]:
    """The URIs of every part of a channel's SageMaker augmented manifest (JSON Lines: one
    ``{"source-ref": "<uri>"}`` per object; concatenated in part order they are the channel's
    manifest)."""
    count = manifest_parts(root)
    return [sagemaker_part_uri(root, channel, i, count) for i in range(count)]


def read_part(uri: str, columns: Sequence[str] | None = None) -> pa.Table:
    """One part file.

    Raises :class:`DatasetError` naming ``uri`` if it is missing or damaged (not a Parquet
    file: truncated, overwritten), one line (a worker's error reaches the driver as its text),
    and :class:`StorageError` if it cannot be read (access denied, an endpoint that fails)."""
    fs, path = storage.filesystem(uri)
    try:
        return pq.read_table(path, filesystem=fs, columns=list(columns) if columns is not None else None)
    except FileNotFoundError:
        raise DatasetError(
            f"manifest part {uri} is missing: the manifest is incomplete; rebuild it"
        ) from None
    except pa.ArrowException as exc:  # ArrowInvalid: no Parquet magic bytes, a footer or page cut off
        raise DatasetError(_damage(uri, exc)) from None
    except OSError as exc:
        if any(s in str(exc) for s in _DAMAGE):
            raise DatasetError(_damage(uri, exc)) from None
        raise StorageError(f"cannot read manifest part {uri}: {type(exc).__name__}: {exc}") from exc


#: What PyArrow's ``OSError`` says of a Parquet file whose bytes are damaged inside (not of a
#: file it cannot reach).
_DAMAGE = ("deserialize thrift", "Unexpected end of stream", "Parquet", "Corrupt")


def _damage(uri: str, exc: Exception) -> str:
    """One line: the part, PyArrow's first sentence about it, and what to do."""
    text = re.sub(r"Could not open Parquet input source '[^']*': ", "", " ".join(str(exc).split()))
    cause = text.split(". ")[0].rstrip(".")
    return (
        f"manifest part {uri} is damaged (unreadable as Parquet: {cause}): rebuild the manifest "
        "(jobs/manifest.py --overwrite) and the datasets built on it"
    )


def write_part(uri: str, table: pa.Table, *, durable: bool = True) -> None:
    """Write one part file whole (atomically: a killed writer leaves no part behind); not
    ``durable``: not fsynced (a job's staged rows, which a rerun stages anew)."""
    sink = io.BytesIO()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(uri, sink.getvalue(), durable=durable)


#: Timestamp units a column of UTC times is turned into ``datetime`` values from (by step).
_STEPS = {"s": timedelta(seconds=1), "ms": timedelta(milliseconds=1), "us": timedelta(microseconds=1)}


def _values(column: pa.ChunkedArray) -> list[Any]:
    """``column.to_pylist()``. A UTC timestamp (s, ms or µs) is the epoch plus a ``timedelta``
    here, with the ``tzinfo`` PyArrow gives, instead of PyArrow's conversion of each value
    through its time zone, which costs far more per value (design/0030)."""
    kind = column.type
    if not (pa.types.is_timestamp(kind) and kind.tz == "UTC" and kind.unit in _STEPS):
        return column.to_pylist()
    epoch, step = pa.scalar(0, kind).as_py(), _STEPS[kind.unit]
    return [None if v is None else epoch + step * v for v in column.cast(pa.int64()).to_pylist()]


def table_rows(table: pa.Table) -> list[dict[str, Any]]:
    """``table.to_pylist()``: a dict per row, the same values (and ``tzinfo`` objects)."""
    names = table.column_names
    if not names:
        return [{} for _ in range(table.num_rows)]
    return [
        dict(zip(names, values, strict=True))
        for values in zip(*(_values(table[n]) for n in names), strict=True)
    ]


def iter_parts(root: str, channel: str, *, columns: Sequence[str] | None = None) -> Iterator[pa.Table]:
    """Each part of one table in part order (one part in memory at a time)."""
    for uri in channel_parts(root, channel):
        yield read_part(uri, columns)


def read_channel(root: str, channel: str, *, columns: Sequence[str] | None = None) -> pa.Table:
    """A whole table (``channel``: a channel, ``all`` or ``rejects``), parts in part order."""
    tables = list(iter_parts(root, channel, columns=columns))
    schema = MANIFEST_SCHEMA if columns is None else pa.schema([MANIFEST_SCHEMA.field(c) for c in columns])
    return pa.concat_tables(tables) if tables else schema.empty_table()


def read_channel_rows(
    root: str,
    channel: str,
    *,
    labels: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
    part: int | None = None,
) -> pa.Table:
    """Rows of a table inside a worker: those whose ``label`` is one of ``labels`` (read from
    the parts that hold those classes only), or part ``part`` of :func:`manifest_parts`, or
    with neither the whole table; all columns, or ``columns``. Row order is not specified."""
    if labels is not None:
        n = manifest_parts(root)
        read = None if columns is None else list(dict.fromkeys([*columns, "label"]))  # the filter needs label
        schema = MANIFEST_SCHEMA if read is None else pa.schema([MANIFEST_SCHEMA.field(c) for c in read])
        tables = [
            read_part(manifest_part_uri(root, channel, p, n), read)
            for p in sorted({label_part(label, n) for label in labels})
        ]
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        table = table.filter(pc.is_in(table["label"], value_set=pa.array(sorted(set(labels)), pa.string())))
        return table if columns is None else table.select(list(columns))
    if part is None:
        return read_channel(root, channel, columns=columns)
    return read_part(manifest_part_uri(root, channel, part, manifest_parts(root)), columns)
