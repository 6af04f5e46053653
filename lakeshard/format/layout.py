"""The dataset on disk: the contract between the jobs that write it and the loaders that read it.

```
<out>/
  manifests/all/part-00000-of-00002.parquet
                                 every listed object, status ok or rejected, in parts
  manifests/<channel>/part-00000-of-00002.parquet
                                 accepted rows of one channel
  manifests/rejects/part-00000-of-00002.parquet
                                 objects the manifest job could not use, with the reason
  manifests/sagemaker/<channel>/part-00000-of-00002.jsonl
                                 a channel's objects as SageMaker augmented-manifest lines
  manifests/_manifest.json       written last by the manifest job: its commit marker (``parts``)
  labels.json                    label name -> index
  shards/channel=<channel>/part-00000-of-00004.parquet
                                 Hive-style channel folders: shards/ read as one table has a
                                 channel column (pandas, pyarrow, Dask, Spark); local datasets
  shards/v=<version>/channel=<channel>/part-00000-of-00004.parquet
                                 on S3: each build writes its own version folder once, and
                                 dataset.json names the one that is the dataset
  rejects/shards.parquet         images the shard job could not decode, with the reason
                                 (on S3: shards/v=<version>/_rejects.parquet)
  report.html                    a self-contained report of the dataset
  dataset.json                   written last, atomically: the dataset is complete
```

A reader trusts a dataset only when ``dataset.json`` exists; everything else may be mid-write.
A reader opens the shard files ``dataset.json`` names (:func:`check_shard_path` says which
paths it may name), never a listing of ``shards/``.
The specification of every file, column and field: ``docs/format.md``.
"""

from __future__ import annotations

import re

import pyarrow as pa

from lakeshard import storage

__all__ = [
    "CHANNELS",
    "FORMAT_VERSION",
    "MANIFEST_SCHEMA",
    "READ_VERSIONS",
    "SHARD_REJECTS_SCHEMA",
    "SHARD_SCHEMA",
    "STORED_IMAGE_SIGNATURES",
    "TASK_FORMAT_VERSION",
    "VERSION_MARKER",
    "channel_dirname",
    "check_shard_path",
    "dataset_json_uri",
    "labels_uri",
    "manifest_marker_uri",
    "manifest_part_uri",
    "manifest_rejects_uri",
    "manifest_table_uri",
    "manifests_uri",
    "part_name",
    "sagemaker_part_uri",
    "shard_name",
    "shard_rejects_relpath",
    "shard_rejects_uri",
    "shard_relpath",
    "shard_uri",
    "shards_folder_uri",
    "shards_uri",
    "stored_image_format",
    "version_dirname",
    "version_marker_uri",
    "versions_uri",
]

#: Version 3: the manifest tables are folders of parts (``manifests/<table>/part-*.parquet``),
#: written by the workers, one class's rows in one part; ``dataset.json`` names each shard's
#: file, in ``shards/channel=<c>/`` (local) or a version folder ``shards/v=<version>/channel=<c>/``
#: (S3). Version 2: one file per manifest table, Hive-style channel folders
#: (``shards/channel=train/``), shard rejects in ``rejects/shards.parquet``. Readers refuse any
#: other version (see docs/format.md).
FORMAT_VERSION = 3
#: The format version of a manifest or dataset whose task is not ``single-label``
#: (:mod:`lakeshard.format.label_columns`): its rows carry label columns beyond one class, which a
#: reader of version 3 would take for single-label rows, so it must refuse them. A single-label
#: manifest or dataset keeps :data:`FORMAT_VERSION`, byte for byte.
TASK_FORMAT_VERSION = 4
#: The format versions this code reads.
READ_VERSIONS = (FORMAT_VERSION, TASK_FORMAT_VERSION)

#: In a version folder: written when the build's shards are complete, before ``dataset.json``
#: names them (a copy of that ``dataset.json``). A version folder without it is a build in
#: progress or a killed build's leftover.
VERSION_MARKER = "_version.json"

#: Channel names in their canonical order (the split's order).
CHANNELS = ("train", "validation", "test")

#: One row per listed object. ``status`` is ``ok`` or ``rejected``; a rejected row has a
#: ``reason`` and may have no label or channel.
MANIFEST_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("key", pa.string()),
        ("label", pa.string()),
        ("label_index", pa.int64()),
        ("channel", pa.string()),
        ("size", pa.int64()),
        ("etag", pa.string()),
        ("last_modified", pa.timestamp("us", tz="UTC")),
        ("format", pa.string()),
        ("status", pa.string()),
        ("reason", pa.string()),
    ]
)

#: One row per training sample. ``image`` holds the encoded (JPEG or PNG) bytes of an RGB
#: image already resized to the dataset's image size; ``is_pad`` marks a row repeated by the
#: ``pad`` remainder policy.
SHARD_SCHEMA = pa.schema(
    [
        ("image", pa.binary()),
        ("label", pa.int64()),
        ("uri", pa.string()),
        ("key", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("is_pad", pa.bool_()),
    ]
)

#: The shard job's rejects: manifest rows whose image could not be used.
SHARD_REJECTS_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("key", pa.string()),
        ("label", pa.string()),
        ("channel", pa.string()),
        ("reason", pa.string()),
    ]
)


#: The encodings the ``image`` column of a shard may hold (``dataset.json``'s ``image.format``),
#: each with the bytes every such image starts with.
STORED_IMAGE_SIGNATURES = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


def stored_image_format(data: bytes | memoryview) -> str | None:
    """``"jpeg"`` or ``"png"`` by the first bytes of ``data``, or None for anything else."""
    for name, magic in STORED_IMAGE_SIGNATURES.items():
        if bytes(data[: len(magic)]) == magic:
            return name
    return None


def manifests_uri(root: str, name: str | None = None) -> str:
    return storage.join(root, "manifests", name) if name else storage.join(root, "manifests")


def manifest_marker_uri(root: str) -> str:
    return manifests_uri(root, "_manifest.json")


def labels_uri(root: str) -> str:
    return storage.join(root, "labels.json")


def dataset_json_uri(root: str) -> str:
    return storage.join(root, "dataset.json")


def shards_uri(root: str, channel: str | None = None) -> str:
    return storage.join(root, "shards", channel_dirname(channel)) if channel else storage.join(root, "shards")


def channel_dirname(channel: str) -> str:
    """The folder, below ``shards/``, that holds one channel's shard files: ``channel=train``
    (Hive partitioning, so readers of ``shards/`` as one table get a ``channel`` column)."""
    return f"channel={channel}"


def shard_relpath(channel: str, index: int, count: int) -> str:
    """A shard's path relative to the dataset root in the local layout (``shards/channel=<c>/``)."""
    return f"shards/{channel_dirname(channel)}/{shard_name(index, count)}"


def version_dirname(version: str) -> str:
    """The folder, below ``shards/``, of one build's shards on S3: ``v=<version>``."""
    if not _VERSION.fullmatch(version):
        raise ValueError(f"a shard version must match {_VERSION.pattern}, got {version!r}")
    return f"v={version}"


def versions_uri(root: str, version: str | None = None) -> str:
    """``<root>/shards`` (the parent of every version folder), or version ``version``'s folder."""
    return storage.join(root, "shards", version_dirname(version)) if version else storage.join(root, "shards")


def version_marker_uri(root: str, version: str) -> str:
    """Version ``version``'s completion marker (:data:`VERSION_MARKER`)."""
    return storage.join(versions_uri(root, version), VERSION_MARKER)


_VERSION = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8}")
_SHARD_PATH = re.compile(
    r"shards/(?:v=(?P<version>[^/]+)/)?channel=(?P<channel>[^/]+)/"
    r"part-(?P<index>\d{5})-of-(?P<count>\d{5})(?:\.assembled)?\.parquet"
)


def check_shard_path(path: str, channel: str, index: int, count: int) -> str | None:
    """Check a shard path ``dataset.json`` lists (relative to the dataset root) for shard
    ``index`` of ``count`` of ``channel``; return its version (None in the local layout).

    The path is ``shards/[v=<version>/]channel=<channel>/part-<i>-of-<n>[.assembled].parquet``
    (``.assembled``: a shard the shard job assembled again after rejects, on S3 where it is not
    renamed).

    Raises:
        ValueError: any other path (the message says what was expected).
    """
    match = _SHARD_PATH.fullmatch(path)
    want = f"shards/[v=<version>/]{channel_dirname(channel)}/{shard_name(index, count)}"
    if (
        match is None
        or match["channel"] != channel
        or int(match["index"]) != index
        or int(match["count"]) != count
        or (match["version"] is not None and not _VERSION.fullmatch(match["version"]))
    ):
        raise ValueError(f"shard path {path!r} is not {want}")
    return match["version"]


def shard_rejects_relpath(version: str | None = None) -> str:
    """The shard job's rejects table, relative to the dataset root (as ``dataset.json``'s
    ``rejects_path`` names it): ``rejects/shards.parquet`` in the local layout, outside
    ``shards/`` so ``shards/`` read as one table holds shard rows only; in version ``version``'s
    folder on S3 (``_rejects.parquet``: table readers skip ``_`` files), so it changes with the
    shards when ``dataset.json`` does."""
    return f"shards/{version_dirname(version)}/_rejects.parquet" if version else "rejects/shards.parquet"


def shard_rejects_uri(root: str, version: str | None = None) -> str:
    """The shard job's rejects table of the dataset at ``root`` (see :func:`shard_rejects_relpath`)."""
    return storage.join(root, shard_rejects_relpath(version))


def manifest_table_uri(root: str, table: str) -> str:
    """The folder of one manifest table's parts: ``table`` is a channel, ``all`` or ``rejects``.
    Nothing but that table's part files is in it, so the folder reads as one table."""
    return manifests_uri(root, table)


def manifest_part_uri(root: str, table: str, index: int, count: int) -> str:
    """Part ``index`` of ``count`` of a manifest table (``count`` is ``_manifest.json``'s ``parts``)."""
    return storage.join(manifest_table_uri(root, table), part_name(index, count))


def sagemaker_part_uri(root: str, channel: str, index: int, count: int) -> str:
    """Part ``index`` of ``count`` of a channel's SageMaker augmented manifest (JSON Lines)."""
    return storage.join(manifests_uri(root, "sagemaker"), channel, part_name(index, count, ext="jsonl"))


def manifest_rejects_uri(root: str) -> str:
    """The manifest job's rejects table (a folder of parts): listed objects it could not use."""
    return manifest_table_uri(root, "rejects")


def part_name(index: int, count: int, *, ext: str = "parquet") -> str:
    """``part-00001-of-00004.parquet``: the file of part ``index`` of ``count``."""
    if not 0 <= index < count:
        raise ValueError(f"part index must be in [0, {count}), got {index!r}")
    return f"part-{index:05d}-of-{count:05d}.{ext}"


def shard_name(index: int, count: int, *, assembled: bool = False) -> str:
    """``part-00001-of-00004.parquet``: the file of shard ``index`` of ``count``
    (``part-00001-of-00004.assembled.parquet`` for one assembled again after rejects, which on S3
    stays under that name)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index!r}")
    name = part_name(index, count)
    return name.replace(".parquet", ".assembled.parquet") if assembled else name


def shard_uri(root: str, channel: str, index: int, count: int) -> str:
    """A shard's URI in the dataset at ``root``, in the local layout."""
    return shards_folder_uri(shards_uri(root), channel, index, count)


def shards_folder_uri(folder: str, channel: str, index: int, count: int) -> str:
    """A shard's URI below ``folder``, a folder laid out as ``shards/`` is (the shard job's
    staging folder, which the commit moves to ``shards/``, or a version folder)."""
    return storage.join(folder, channel_dirname(channel), shard_name(index, count))
