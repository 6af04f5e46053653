"""Listing the raw lake: ``<prefix>/<class label>/<any sub-path>/<file>``.

Listing scales past one driver: :func:`discover` lists only the levels above the label on the
driver (a few requests), then :func:`list_prefix` lists each class prefix recursively inside
an executor, and :func:`inspect_objects` reads each object's first bytes there too (so a
``.jpg`` that is text is a reject, not a crash later).

An object row is a plain dict with the keys of :data:`lakeshard.format.MANIFEST_SCHEMA`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jobs.images import SNIFF_BYTES, sniff
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError

__all__ = ["discover", "inspect_objects", "list_prefix", "reject"]

log = logging.getLogger(__name__)

_IO_THREADS = 16  # object reads are latency-bound on S3; threads overlap them


def _uri(scheme_root: str, path: str) -> str:
    return ("s3://" if scheme_root.startswith("s3://") else "file://") + path


def _row(root: str, root_path: str, info: dict[str, Any], label_depth: int) -> dict[str, Any]:
    path = info["name"]
    key = path[len(root_path):].lstrip("/")
    parts = key.split("/")
    etag = info.get("ETag") or info.get("etag")
    modified = info.get("LastModified") or info.get("mtime")
    if isinstance(modified, (int, float)):
        modified = dt.datetime.fromtimestamp(modified, tz=dt.timezone.utc)
    elif isinstance(modified, dt.datetime) and modified.tzinfo is None:
        modified = modified.replace(tzinfo=dt.timezone.utc)
    row = {
        "uri": _uri(root, path),
        "key": key,
        "label": parts[label_depth - 1] if len(parts) > label_depth else None,
        "label_index": None,
        "channel": None,
        "size": int(info.get("size") or 0),
        "etag": etag.strip('"') if isinstance(etag, str) else None,
        "last_modified": modified,
        "format": None,
        "status": "ok",
        "reason": None,
    }
    if any(p in ("", ".", "..") for p in parts):
        reject(row, f"unsafe key {key!r}: empty, '.' or '..' path component")
    return row


def reject(row: dict[str, Any], reason: str) -> dict[str, Any]:
    row["status"] = "rejected"
    row["reason"] = reason
    row["channel"] = None
    row["label_index"] = None
    return row


def discover(root: str, *, label_depth: int = 1) -> tuple[list[str], list[dict[str, Any]]]:
    """List the levels above the label; return the class-level prefix URIs and the objects
    found above that level (rows already rejected: they have no label).

    Raises :class:`ManifestError` if ``root`` does not exist or holds nothing.
    """
    if label_depth < 1:
        raise ManifestError(f"label_depth must be >= 1, got {label_depth!r}")
    root = storage.normalize(root)
    fs, root_path = storage.filesystem(root)
    try:
        if not fs.exists(root_path):
            raise ManifestError(f"input {root} does not exist (or holds no objects)")
        if fs.isfile(root_path):
            raise ManifestError(f"input {root} is a file; it must be a prefix laid out as <prefix>/<label>/.../<file>")
    except ManifestError:
        raise
    except Exception as exc:  # a 403 included: name the URI and the cause
        raise StorageError(f"cannot list input {root}: {type(exc).__name__}: {exc}") from exc
    level = [root_path]
    stray: list[dict[str, Any]] = []
    for depth in range(label_depth):
        below: list[str] = []
        for path in level:
            try:
                entries = fs.ls(path, detail=True, refresh=True)
            except Exception as exc:
                raise StorageError(f"cannot list {_uri(root, path)}: {exc}") from exc
            for entry in sorted(entries, key=lambda e: e["name"]):
                if entry["name"].rstrip("/") == path.rstrip("/"):
                    continue
                if entry["type"] == "directory":
                    below.append(entry["name"].rstrip("/"))
                else:
                    row = _row(root, root_path, entry, label_depth)
                    if row["status"] == "ok":
                        reject(row, f"no label: object is {depth} level(s) below the input prefix, "
                                    f"labels are read at depth {label_depth}")
                    stray.append(row)
        level = below
    return [_uri(root, p) for p in level], stray


def list_prefix(root: str, prefix: str, *, label_depth: int = 1) -> list[dict[str, Any]]:
    """Every object below one class prefix (recursive), as manifest rows."""
    root = storage.normalize(root)
    fs, root_path = storage.filesystem(root)
    _, path = storage.filesystem(prefix)
    try:
        found = fs.find(path, detail=True, withdirs=False)
    except Exception as exc:
        raise StorageError(f"cannot list {prefix}: {exc}") from exc
    rows = [_row(root, root_path, info, label_depth) for _, info in sorted(found.items())]
    if not rows:
        log.warning("class prefix %s holds no objects; it is not a class", prefix)
    return rows


def _inspect(row: dict[str, Any]) -> dict[str, Any]:
    if row["status"] != "ok":
        return row
    if row["size"] == 0:
        if row["etag"] is None:
            row["etag"] = hashlib.md5(b"", usedforsecurity=False).hexdigest()  # what S3 gives
        return reject(row, "empty object (0 bytes)")
    s3 = row["uri"].startswith("s3://")
    # Local files carry no ETag: the MD5 of the whole content is what S3 would give.
    data = storage.read_listed(row["uri"], end=SNIFF_BYTES if s3 else None)
    if isinstance(data, str):
        return reject(row, data)
    if not s3:
        row["etag"] = hashlib.md5(data, usedforsecurity=False).hexdigest()
    head = data[:SNIFF_BYTES]
    fmt = sniff(head)
    if fmt is None:
        return reject(row, f"not an image: content starts with {head[:8]!r}, no known image signature")
    row["format"] = fmt
    return row


def inspect_objects(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Read the first bytes of each object (all bytes of a local one, to hash it) and reject
    what is empty, unreadable or not an image. Runs inside an executor."""
    rows = list(rows)
    if len(rows) <= 1:
        return [_inspect(r) for r in rows]
    with ThreadPoolExecutor(max_workers=min(_IO_THREADS, len(rows))) as pool:
        return list(pool.map(_inspect, rows))
