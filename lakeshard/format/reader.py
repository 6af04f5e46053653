"""The shard opener: where a channel's shards are, and each one opened and checked against
``dataset.json`` (:class:`~lakeshard.format.info.DatasetInfo`) before a row is trusted.

```python
info = read_dataset_info(root)
shards = channel_shards(root, info, "train")            # [(uri, rows), ...] in shard order
with open_shard(shards[0][0]) as shard:
    groups = shard.check(info, "train", 0, rows=shards[0][1])   # row-group sizes
    table = shard.parquet.read_row_group(0, columns=["image", "label"])
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format.footer import check_footer, read_footer
from lakeshard.format.info import DatasetInfo
from lakeshard.format.layout import check_shard_path, dataset_json_uri, shard_rejects_relpath

__all__ = [
    "REQUIRED_COLUMNS",
    "OpenShard",
    "ShardFooter",
    "channel_shards",
    "expected_footer",
    "open_shard",
    "read_shard_footer",
    "rejects_uri",
    "shard_version",
]

#: Columns a reader needs; the others of ``SHARD_SCHEMA`` may be absent from another writer's shards.
REQUIRED_COLUMNS = ("image", "label")

_LOCAL = pafs.LocalFileSystem()


@dataclass
class OpenShard:
    """An open shard file: its Parquet reader and the ``lakeshard.*`` keys of its footer."""

    uri: str
    parquet: pq.ParquetFile
    footer: dict[str, str]
    _file: Any = field(repr=False)

    def check(self, info: DatasetInfo, channel: str, index: int, *, rows: int | None = None) -> list[int]:
        """Check the footer against ``info`` (:func:`expected_footer`), the row count against
        ``rows`` and the required columns; return the row-group sizes.

        Raises:
            DatasetError: naming the shard, what it holds and what was expected.
        """
        return _check(self.uri, self.parquet.metadata, self.footer, info, channel, index, rows=rows)

    def size(self) -> int:
        """The file's size in bytes."""
        size = self._file.size
        return int(size() if callable(size) else size)

    def etag(self) -> str | None:
        """The object's ETag (S3), ``None`` for a local file."""
        details = getattr(self._file, "details", None)
        return details.get("ETag") if isinstance(details, dict) else None

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> OpenShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ShardFooter:
    """A shard's Parquet footer, its size and ETag, read without opening the file for reading
    (:func:`read_shard_footer`): what a reader that fetches row groups by byte range needs."""

    uri: str
    metadata: pq.FileMetaData
    size: int
    etag: str | None  #: unquoted (S3's); ``None`` for a local file

    @property
    def footer(self) -> dict[str, str]:
        """The ``lakeshard.*`` keys of the footer (:func:`~lakeshard.format.footer.read_footer`)."""
        return read_footer(self.metadata.metadata)

    def check(self, info: DatasetInfo, channel: str, index: int, *, rows: int | None = None) -> list[int]:
        """:meth:`OpenShard.check`, on this footer."""
        return _check(self.uri, self.metadata, self.footer, info, channel, index, rows=rows)


#: A remote shard's first request asks for this many bytes of its end: the whole footer of a shard
#: of a few hundred row groups (each row group's metadata is well under 1 kB with SHARD_SCHEMA), in
#: one GET; a longer footer costs a second GET.
_TAIL_BYTES = 256 << 10
#: Parquet's last 8 bytes: the footer's length (4, little-endian) and the magic.
_MAGIC = b"PAR1"


def read_shard_footer(uri: str) -> ShardFooter:
    """The footer of the shard at ``uri``, its size and ETag.

    An object store: one GET of the object's last 256 KiB (:meth:`lakeshard.storage.Store.read_tail`:
    a suffix range, whose answer carries the size and the ETag, so no HEAD is sent), and a
    second one, for the object the first one read (``If-Match``), only if the footer is longer.
    A local file: :func:`open_shard`'s reader.

    Raises:
        DatasetError: the object cannot be read or is not Parquet (names the shard and the cause).
    """
    store = storage.store_for(uri)
    if store.local:
        with open_shard(uri) as shard:
            return ShardFooter(uri, shard.parquet.metadata, shard.size(), shard.etag())
    try:
        got = store.read_tail(uri, _TAIL_BYTES)
        tail, size, etag = got.data, got.size, got.etag
        if size < 12 or tail[-4:] != _MAGIC:
            raise DatasetError(f"{size} bytes that do not end in Parquet's magic {_MAGIC!r}")
        need = int.from_bytes(tail[-8:-4], "little") + 8
        if need > size - 4:
            raise DatasetError(f"its footer claims {need - 8} bytes, more than the {size}-byte file holds")
        if need > len(tail):
            rest = store.read(uri, size - need, size - len(tail), if_match=etag)
            tail = rest + tail
        metadata = pq.read_metadata(pa.BufferReader(tail[len(tail) - need :]))
    except Exception as exc:
        raise DatasetError(f"cannot open shard {uri}: {exc}") from exc
    return ShardFooter(uri, metadata, size, etag)


def open_shard(uri: str) -> OpenShard:
    """Open the shard at ``uri``: a local one with Arrow's own file, read on the calling thread
    (in C++ without the GIL, and without a hand-off to Arrow's I/O threads, which fsspec's
    Python file would add); the rest through
    fsspec, with Arrow's pre-buffering (coalesced range requests).

    Raises:
        DatasetError: the file cannot be opened or is not Parquet (names the shard and the cause).
    """
    local = storage.is_local(uri)
    try:
        fs, path = storage.filesystem(uri)
        f = _LOCAL.open_input_file(path) if local else fs.open(path, "rb")
    except Exception as exc:
        raise DatasetError(f"cannot open shard {uri}: {exc}") from exc
    try:
        pf = pq.ParquetFile(f, pre_buffer=not local)
        return OpenShard(uri, pf, read_footer(pf.metadata.metadata), f)
    except Exception as exc:
        f.close()
        raise DatasetError(f"cannot open shard {uri}: {exc}") from exc
    except BaseException:
        f.close()
        raise


def _check(
    uri: str,
    md: pq.FileMetaData,
    footer: dict[str, str],
    info: DatasetInfo,
    channel: str,
    index: int,
    *,
    rows: int | None,
) -> list[int]:
    check_footer(uri, footer, expected_footer(info, channel, index))
    if rows is not None and md.num_rows != rows:
        raise DatasetError(f"shard {uri} has {md.num_rows} rows, dataset.json says {rows}")
    names = set(md.schema.to_arrow_schema().names)
    for col in REQUIRED_COLUMNS:
        if col not in names:
            raise DatasetError(f"shard {uri} has no {col!r} column (columns: {sorted(names)})")
    return [md.row_group(g).num_rows for g in range(md.num_row_groups)]


def expected_footer(info: DatasetInfo, channel: str, index: int) -> dict[str, str]:
    """The footer shard ``index`` of ``channel`` carries in the dataset ``info`` describes."""
    return {
        "dataset_version": info.dataset_version,
        "channel": channel,
        "shard_index": str(index),
        "num_shards": str(info.num_shards),
        "format_version": str(info.format_version),
        "image_format": info.image.format,
        "image_size": str(info.image.size),
    }


def channel_shards(root: str, info: DatasetInfo, channel: str) -> list[tuple[str, int]]:
    """``(uri, rows)`` of every shard of ``channel``, in shard order: the files ``dataset.json``
    names (in the local layout or one version folder, :func:`~lakeshard.format.layout.check_shard_path`).

    Raises:
        DatasetError: the channel is missing, lists another number of shards than
            ``num_shards``, lists a shard at a path the layout does not allow, or shards of
            several version folders.
    """
    where = dataset_json_uri(root)
    entry = info.channel(channel, source=where)
    if len(entry.shards) != info.num_shards:
        raise DatasetError(
            f"{where} lists {len(entry.shards)} {channel} shards, expected num_shards={info.num_shards}"
        )
    shard_version(info, source=where)  # every path allowed, every channel in one folder
    return [(storage.join(root, shard.path), shard.rows) for shard in entry.shards]


def rejects_uri(root: str, info: DatasetInfo) -> str:
    """The shard rejects table of the dataset at ``root``: where ``info`` (its ``dataset.json``)
    names it, beside its shards (:func:`~lakeshard.format.layout.shard_rejects_relpath`).

    Raises:
        DatasetError: ``rejects_path`` is another path.
    """
    want = shard_rejects_relpath(shard_version(info))
    if info.rejects_path != want:
        raise DatasetError(
            f"{dataset_json_uri(root)}: rejects_path is {info.rejects_path!r}, expected {want!r}"
        )
    return storage.join(root, info.rejects_path)


def shard_version(info: DatasetInfo, *, source: str = "dataset.json") -> str | None:
    """The version folder (``shards/v=<version>/``) every shard of ``info`` is in; None for the
    local layout.

    Raises:
        DatasetError: a path the layout does not allow, or shards in several version folders.
    """
    found = set()
    for name, entry in info.channels.items():
        for i, shard in enumerate(entry.shards):
            try:
                found.add(check_shard_path(shard.path, name, i, info.num_shards))
            except ValueError as exc:
                raise DatasetError(f"{source}: {name} shard {i}: {exc}") from None
    if len(found) > 1:
        raise DatasetError(f"{source} names shards in several version folders: {sorted(map(str, found))}")
    return found.pop() if found else None
