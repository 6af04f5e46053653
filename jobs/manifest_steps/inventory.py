"""An S3 Inventory report as the lake's listing (``--inventory``), read on the workers.

S3 Inventory delivers, to a destination bucket::

    <dest-prefix>/<source-bucket>/<config-id>/<YYYY-MM-DDTHH-MMZ>/manifest.json
    <dest-prefix>/<source-bucket>/<config-id>/data/<uuid>.csv.gz   (or .parquet)

``manifest.json`` names the source bucket, the ``fileFormat`` (``CSV``, ``Parquet``; ``ORC`` is
refused), the ``fileSchema`` (CSV: ``"Bucket, Key, Size, LastModifiedDate, ETag, ..."``;
Parquet: a ``message s3.inventory { ... }`` whose columns are ``bucket``, ``key``, ``size``,
``last_modified_date``, ``e_tag``, ...) and the data ``files`` (``key`` in the destination
bucket). CSV files have no header, and their keys are URL-encoded (form encoding: ``+`` is a
space).

:func:`read_inventory` reads and checks the manifest on the driver (a few requests); each data
file is then read by one task (:func:`inventory_rows`), which keeps the current versions of the
objects under ``--input`` and makes the rows a listing makes (labels, hidden and excluded
objects, objects above the label level alike).
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import io
import json
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

import pyarrow.parquet as pq

from jobs.manifest_steps.listing import Skip, StagedRow, _row, reject
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError

__all__ = ["Inventory", "inventory_rows", "read_inventory"]

#: Inventory fields the lake needs, by their Parquet/ORC names (CSV names map onto them).
_NEEDED = ("bucket", "key", "size")
_CSV_NAMES = {
    "Bucket": "bucket",
    "Key": "key",
    "VersionId": "version_id",
    "IsLatest": "is_latest",
    "IsDeleteMarker": "is_delete_marker",
    "Size": "size",
    "LastModifiedDate": "last_modified_date",
    "ETag": "e_tag",
}
_FORMATS = ("CSV", "Parquet")


@dataclass(frozen=True, slots=True)
class Inventory:
    """A checked inventory manifest: where it is, whose objects it lists, and its data files."""

    uri: str
    source_bucket: str
    file_format: str
    columns: tuple[str, ...]
    files: tuple[str, ...]


def _parquet_columns(schema: str) -> list[str]:
    """The column names of a Parquet ``message s3.inventory { required binary key (UTF8); ...}``."""
    body = schema[schema.find("{") + 1 : schema.rfind("}")]
    return [
        m.group(1)
        for field in body.split(";")
        if (m := re.search(r"(\w+)\s*(?:\([^)]*\))?\s*$", field.strip()))
    ]


def _manifest_uri(uri: str) -> str:
    uri = storage.normalize(uri)
    return uri if uri.endswith(".json") else storage.join(uri, "manifest.json")


def _data_uri(manifest_uri: str, key: str, destination: str) -> str:
    """A data file's URI: ``s3://<destination bucket>/<key>``; for a report copied elsewhere
    (another bucket, a local folder), ``data/<name>`` beside the dated folder, as S3 lays it out."""
    if manifest_uri.startswith(f"s3://{destination}/"):
        return f"s3://{destination}/{key}"
    config_folder = posixpath.dirname(posixpath.dirname(manifest_uri))
    return f"{config_folder}/data/{posixpath.basename(key)}"


def read_inventory(uri: str, *, bucket: str) -> Inventory:
    """Read and check the inventory manifest at ``uri`` (``manifest.json`` or its folder) for
    the objects of ``bucket``; raise :class:`ManifestError` naming the URI and what is wrong,
    or :class:`StorageError` if it or a data file it names cannot be read."""
    where = _manifest_uri(uri)
    what = f"--inventory {uri!r}: {where}"
    if not storage.exists(where):
        raise ManifestError(
            f"{what} does not exist (give an S3 Inventory manifest.json or the folder holding it)"
        )
    try:
        manifest = json.loads(storage.read_bytes(where))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ManifestError(
            f"{what} is not an S3 Inventory manifest (a JSON object with sourceBucket, fileFormat, "
            "fileSchema and files)"
        )
    if missing := [
        k
        for k in ("sourceBucket", "destinationBucket", "fileFormat", "fileSchema", "files")
        if k not in manifest
    ]:
        raise ManifestError(f"{what} is not an S3 Inventory manifest: it has no {', '.join(missing)}")
    fmt = manifest["fileFormat"]
    if fmt not in _FORMATS:
        raise ManifestError(
            f"{what}: fileFormat {fmt!r} is not supported (use an inventory in {' or '.join(_FORMATS)})"
        )
    schema = str(manifest["fileSchema"])
    columns = (
        tuple(_CSV_NAMES.get(c.strip(), c.strip()) for c in schema.split(","))
        if fmt == "CSV"
        else tuple(_parquet_columns(schema))
    )
    if lacking := [c for c in _NEEDED if c not in columns]:
        raise ManifestError(f"{what}: fileSchema {schema!r} has no {', '.join(lacking)} field")
    if manifest["sourceBucket"] != bucket:
        raise ManifestError(
            f"{what} lists bucket {manifest['sourceBucket']!r}, not --input's bucket {bucket!r}"
        )
    files = manifest["files"]
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and isinstance(f.get("key"), str) for f in files
    ):
        raise ManifestError(f'{what}: files must be a list of {{"key": ...}} objects, got {files!r:.200}')
    destination = str(manifest["destinationBucket"]).removeprefix("arn:aws:s3:::")
    data = tuple(_data_uri(where, f["key"], destination) for f in files)
    _check_files_exist(what, data)
    return Inventory(uri=where, source_bucket=bucket, file_format=fmt, columns=columns, files=data)


def _check_files_exist(what: str, files: tuple[str, ...]) -> None:
    """Every data file exists: one listing per folder, not one request per file."""
    folders: dict[str, set[str]] = {}
    for f in files:
        folders.setdefault(posixpath.dirname(f), set()).add(f)
    for folder, wanted in folders.items():
        fs, path = storage.filesystem(folder)
        try:
            have = (
                {posixpath.basename(p) for p in fs.ls(path, detail=False, refresh=True)}
                if fs.exists(path)
                else set()
            )
        except Exception as exc:
            raise StorageError(
                f"{what}: cannot list its data folder {folder}: {type(exc).__name__}: {exc}"
            ) from exc
        if gone := sorted(f for f in wanted if posixpath.basename(f) not in have):
            raise ManifestError(f"{what} names {len(gone)} data file(s) that do not exist, e.g. {gone[0]}")


def _records(inventory: Inventory, uri: str) -> Iterator[dict[str, Any]]:
    """The records of one data file, as dicts keyed by the Parquet field names."""
    data = storage.read_bytes(uri)
    if inventory.file_format == "Parquet":
        wanted = [c for c in inventory.columns if c in _CSV_NAMES.values()]
        yield from pq.read_table(io.BytesIO(data), columns=wanted).to_pylist()
        return
    text = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    for n, fields in enumerate(csv.reader(io.StringIO(text.decode("utf-8"))), start=1):
        if len(fields) != len(inventory.columns):
            raise ManifestError(
                f"inventory data file {uri} line {n}: {len(fields)} fields, its manifest's fileSchema "
                f"has {len(inventory.columns)}"
            )
        record: dict[str, Any] = dict(zip(inventory.columns, fields, strict=True))
        record["key"] = unquote_plus(record["key"])
        yield record


def _true(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _modified(value: Any) -> dt.datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _file_rows(uri: str, *, inventory: Inventory, root: str, label_depth: int, skip: Skip) -> list[StagedRow]:
    root = storage.normalize(root)
    root_path = storage.filesystem(root)[1].rstrip("/")
    bucket, _, prefix = root_path.partition("/")
    under = prefix + "/" if prefix else ""
    rows = []
    try:
        records = list(_records(inventory, uri))
    except ManifestError:
        raise
    except Exception as exc:
        raise StorageError(f"cannot read inventory data file {uri}: {type(exc).__name__}: {exc}") from exc
    for rec in records:
        key = rec["key"]
        if rec.get("bucket") != bucket or not key.startswith(under) or key == under:
            continue
        if _true(rec.get("is_delete_marker")) or ("is_latest" in rec and not _true(rec["is_latest"])):
            continue  # not a current object
        info = {
            "name": f"{bucket}/{key}",
            "size": int(rec.get("size") or 0),
            "ETag": rec.get("e_tag") or None,
            "LastModified": _modified(rec.get("last_modified_date")),
        }
        row = _row(root, root_path, info, label_depth, skip)
        depth = row["key"].count("/")
        if row["status"] == "ok" and depth < label_depth:
            reject(
                row,
                f"no label: object is {depth} level(s) below the input prefix, labels are read at depth {label_depth}",
            )
        rows.append(row)
    return rows


def inventory_rows(
    inventory: Inventory, root: str, *, label_depth: int, skip: Skip
) -> Callable[[list[str]], list[StagedRow]]:
    """The task that turns a part of ``inventory.files`` into the rows of the objects under
    ``root`` (one data file read at a time, inside an executor)."""

    def rows_of(files: list[str]) -> list[StagedRow]:
        return [
            r
            for f in files
            for r in _file_rows(f, inventory=inventory, root=root, label_depth=label_depth, skip=skip)
        ]

    return rows_of
