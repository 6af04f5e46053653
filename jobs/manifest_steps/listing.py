"""Listing the raw lake: ``<prefix>/<class label>/<any sub-path>/<file>``.

Listing scales past one driver: :func:`discover` lists only the levels above the label on the
driver (a few requests), then :func:`list_prefix` lists each class prefix recursively inside
an executor, and :func:`inspect_objects` reads each object's first bytes there too (so a
``.jpg`` that is text is a reject, not a crash later).

An object row is a plain dict with the keys of :data:`lakeshard.format.MANIFEST_SCHEMA`, plus
``content`` (the MD5 of its bytes, once inspected and accepted; never written). A row whose
``status`` is ``skipped`` (hidden, or matched by ``--exclude``: see :class:`Skip`) is counted,
never listed.

Local symbolic links are followed as ``find -L`` does: each object is listed once under the
path the user gave (through the link), a link to one of its own ancestor folders is a reject
(a loop), and so is a dangling link; nothing is dropped and no link fails the job.
"""

from __future__ import annotations

import datetime as dt
import errno
import fnmatch
import hashlib
import io
import logging
import os
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, cast

from PIL import Image

from jobs.common.boxes import TRANSPOSED, orientation
from jobs.common.images import SNIFF_BYTES, UNSUPPORTED_FORMATS
from jobs.common.images import sniff as sniff_format
from jobs.manifest_steps.table_values import BadValue, check_boxes
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError
from lakeshard.format.manifest_table import ManifestRow

__all__ = [
    "HIDDEN_NAMES",
    "Discovered",
    "LabelledRow",
    "LocalEntry",
    "Skip",
    "StagedRow",
    "discover",
    "inspect_objects",
    "list_prefix",
    "reject",
]

log = logging.getLogger(__name__)

_IO_THREADS = 16  # object reads are latency-bound on S3; threads overlap them


#: Names that are never data (besides names starting with '.', such as ``.DS_Store``, macOS's
#: ``._*`` resource forks and ``.ipynb_checkpoints``), compared case-insensitively.
HIDDEN_NAMES = ("__macosx", "thumbs.db", "desktop.ini")


@dataclass(frozen=True, slots=True)
class Skip:
    """Which objects the listing skips (counted as skipped, never listed nor rejected).

    A path component that is hidden (starts with '.', or is one of :data:`HIDDEN_NAMES`)
    skips everything below it unless ``include_hidden``. An ``exclude`` glob with a '/' is
    matched against the whole key (relative to the input), one without against each path
    component (``*.tmp``, ``drafts``).
    """

    exclude: tuple[str, ...] = ()
    include_hidden: bool = False

    def reason(self, key: str) -> str | None:
        """Why ``key`` is skipped (``hidden: ...`` or ``excluded: ...``), or None."""
        parts = key.split("/")
        if not self.include_hidden:
            for part in parts:
                if (part.startswith(".") and part not in (".", "..")) or part.lower() in HIDDEN_NAMES:
                    return f"hidden: {part!r}"
        for pattern in self.exclude:
            if (
                fnmatch.fnmatchcase(key, pattern)
                if "/" in pattern
                else any(fnmatch.fnmatchcase(part, pattern) for part in parts)
            ):
                return f"excluded: --exclude {pattern!r}"
        return None


class StagedRow(ManifestRow, total=False):
    """A manifest row as the manifest job's steps hand it on (a plain dict at run time): the
    manifest columns, then what the passes add (``jobs.manifest_steps.passes.STAGED_SCHEMA``):
    the content hash, whether it is a copy of identical content, the channel ``--labels`` pins
    it to, whether its header read was taken from ``--base`` and its channel there."""

    content: str | None
    duplicate: bool | None
    pin: str | None
    reused: bool | None
    base_channel: str | None


class LabelledRow(StagedRow, total=False):
    """A staged row of a ``multi-label`` or ``boxes`` manifest: the columns the task adds
    (:func:`lakeshard.format.label_columns.task_fields`): the image's classes and their
    indices, its boxes and its size."""

    labels: list[str] | None
    label_indices: list[int] | None
    boxes: list[dict[str, Any]] | None
    image_width: int | None
    image_height: int | None


_NO_SKIP = Skip(include_hidden=True)


def _row(
    root: str, root_path: str, info: dict[str, Any], label_depth: int, skip: Skip = _NO_SKIP
) -> StagedRow:
    """The manifest row of one listed object; its label is the ``label_depth``-th path
    component (0: no path label, as with ``--labels``)."""
    path = info["name"]
    key = path[len(root_path) :].lstrip("/")
    parts = key.split("/")
    store = storage.store_for(root)
    modified = info.get("LastModified") or info.get("last_modified") or info.get("mtime")
    if isinstance(modified, (int, float)):  # a local file's st_mtime
        modified = storage.modified_utc(modified)
    elif isinstance(modified, dt.datetime) and modified.tzinfo is None:
        modified = modified.replace(tzinfo=dt.timezone.utc)
    row: StagedRow = {
        "uri": storage.from_listing(root, path),
        "key": key,
        "label": parts[label_depth - 1] if 0 < label_depth < len(parts) else None,
        "label_index": None,
        "channel": None,
        "size": int(info.get("size") or 0),
        "etag": store.listed_etag(info),
        "last_modified": modified,
        "format": None,
        "status": "ok",
        "reason": None,
        "content": store.listed_md5(info),  # else the header read hashes the bytes
    }
    if any(p in ("", ".", "..") for p in parts):
        reject(row, f"unsafe key {key!r}: empty, '.' or '..' path component")
    elif (why := skip.reason(key)) is not None:
        row["status"], row["reason"] = "skipped", why
    elif info.get("reject"):
        reject(row, info["reject"])
    return row


def reject(row: StagedRow, reason: str) -> StagedRow:
    row["status"] = "rejected"
    row["reason"] = reason
    row["channel"] = None
    row["label_index"] = None
    return row


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class LocalEntry(NamedTuple):
    """An entry of a local folder, symbolic links followed: its full path, its identity if it
    is a folder to walk (None: a file, or an entry that cannot be followed) and its info."""

    path: str
    folder: tuple[int, int] | None
    info: dict[str, Any]


def _local_entry(path: str, name: str, chain: frozenset[tuple[int, int]]) -> LocalEntry:
    """The entry ``name`` of the local folder ``path``, symbolic links followed. ``chain`` holds
    the identities of the folders above: a folder among them is a loop. An entry that cannot be
    listed as a file or a folder gets a ``reject`` reason in its info."""
    full = path.rstrip("/") + "/" + name
    link = os.path.islink(full)
    target = os.readlink(full) if link else None
    info: dict[str, Any] = {"name": full, "size": 0}
    try:
        st = os.stat(full)
    except FileNotFoundError:
        info["reject"] = (
            f"dangling symlink: {name} -> {target!r}, which does not exist"
            if link
            else "cannot read: object disappeared after listing"
        )
        return LocalEntry(full, None, info)
    except OSError as exc:
        loop = exc.errno == errno.ELOOP
        info["reject"] = (
            f"symlink loop: {name} -> {target!r} never resolves"
            if loop
            else f"cannot read: {type(exc).__name__}: {exc.strerror}"
        )
        return LocalEntry(full, None, info)
    info["mtime"] = st.st_mtime
    if stat.S_ISDIR(st.st_mode):
        if _ident(st) in chain:
            info["reject"] = (
                f"symlink loop: {name} -> {target!r} leads back to a folder above it"
                if link
                else "folder loop: leads back to a folder above it"
            )
            return LocalEntry(full, None, info)
        return LocalEntry(full, _ident(st), info)
    if stat.S_ISREG(st.st_mode):
        info["size"] = st.st_size
    else:
        info["reject"] = "not a regular file (a device, socket or pipe)"
    return LocalEntry(full, None, info)


def _local_entries(path: str, chain: frozenset[tuple[int, int]]) -> list[LocalEntry]:
    """:func:`_local_entry` of each entry of the local folder ``path``, sorted by name."""
    return [_local_entry(path, name, chain) for name in sorted(os.listdir(path))]


def _walk_local(path: str, chain: frozenset[tuple[int, int]]) -> list[dict[str, Any]]:
    """Every file below the local folder ``path`` (``find -L``), and every entry that could
    not be followed, as infos."""
    infos = []
    for entry in _local_entries(path, chain):
        if entry.folder is None:
            infos.append(entry.info)
        else:
            infos += _walk_local(entry.path, chain | {entry.folder})
    return infos


class _Entry(NamedTuple):
    """An entry of a folder (local or S3): its path, whether it is a folder, its info."""

    path: str
    is_folder: bool
    info: dict[str, Any]


def _entries(fs: Any, path: str, local: bool) -> list[_Entry]:
    """Each entry of ``path``, sorted by name."""
    if local:
        return [_Entry(e.path, e.folder is not None, e.info) for e in _local_entries(path, frozenset())]
    out, seen = [], set()
    for e in sorted(fs.ls(path, detail=True, refresh=True), key=lambda e: e["name"]):
        folder = e["type"] == "directory"
        name = e["name"].rstrip("/") if folder else e["name"]
        # adlfs lists a folder of Azure's hierarchical namespace twice: its own blob, and the
        # prefix of the blobs in it. One class, not two listed alike.
        if name != path.rstrip("/") and (name, folder) not in seen:
            seen.add((name, folder))
            out.append(_Entry(name, folder, e))
    return out


class Discovered(NamedTuple):
    """What the driver finds above the label level: the class-level prefix URIs, and the
    objects there (rows already rejected: they have no label; or skipped)."""

    prefixes: list[str]
    stray: list[StagedRow]


def discover(root: str, *, label_depth: int = 1, skip: Skip = _NO_SKIP) -> Discovered:
    """List the levels above the label; return the class-level prefixes and the objects found
    above that level.

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
            raise ManifestError(
                f"input {root} is a file; it must be a prefix laid out as <prefix>/<label>/.../<file>"
            )
    except ManifestError:
        raise
    except Exception as exc:  # a 403 included: name the URI and the cause
        raise StorageError(f"cannot list input {root}: {type(exc).__name__}: {exc}") from exc
    local = storage.is_local(root)
    level = [root_path]
    stray: list[StagedRow] = []
    for depth in range(label_depth):
        below: list[str] = []
        for path in level:
            try:
                entries = _entries(fs, path, local)
            except Exception as exc:
                raise StorageError(f"cannot list {storage.from_listing(root, path)}: {exc}") from exc
            for entry in entries:
                if entry.is_folder:
                    below.append(entry.path)
                else:
                    row = _row(root, root_path, entry.info, label_depth, skip)
                    if row["status"] == "ok":
                        reject(
                            row,
                            f"no label: object is {depth} level(s) below the input prefix, "
                            f"labels are read at depth {label_depth}",
                        )
                    stray.append(row)
        level = below
    return Discovered([storage.from_listing(root, p) for p in level], stray)


def _chain(root_path: str, path: str) -> frozenset[tuple[int, int]]:
    """The identities of the local folders from ``root_path`` down to ``path``'s parent."""
    if path.rstrip("/") == root_path.rstrip("/"):
        return frozenset()  # the input itself (a flat lake listed whole): nothing above it
    parts = path[len(root_path) :].strip("/").split("/")
    ancestors = [root_path] + [
        root_path.rstrip("/") + "/" + "/".join(parts[:i]) for i in range(1, len(parts))
    ]
    return frozenset(_ident(os.stat(a)) for a in ancestors)


def _folder_loop(path: str, chain: frozenset[tuple[int, int]]) -> dict[str, Any] | None:
    """The reject info of the local folder ``path`` if it is one of the folders above it (a
    link to an ancestor), else None."""
    if _ident(os.stat(path)) not in chain:
        return None
    target = os.readlink(path) if os.path.islink(path) else path
    return {
        "name": path,
        "size": 0,
        "reject": f"symlink loop: {path.rsplit('/', 1)[-1]} -> {target!r} leads back to a folder above it",
    }


def _list_local(root_path: str, path: str) -> list[dict[str, Any]]:
    """``find -L path``, with the folders from ``root_path`` down to ``path`` as the loop chain."""
    chain = _chain(root_path, path)
    if (loop := _folder_loop(path, chain)) is not None:
        return [loop]
    return _walk_local(path, chain | {_ident(os.stat(path))})


def list_prefix(root: str, prefix: str, *, label_depth: int = 1, skip: Skip = _NO_SKIP) -> list[StagedRow]:
    """Every object below one class prefix (recursive), as manifest rows (skipped ones too,
    with ``status`` ``skipped``)."""
    root = storage.normalize(root)
    fs, root_path = storage.filesystem(root)
    _, path = storage.filesystem(prefix)
    try:
        if storage.is_local(root):
            found = _list_local(root_path, path)
        else:
            found = [info for _, info in sorted(fs.find(path, detail=True, withdirs=False).items())]
    except Exception as exc:
        raise StorageError(f"cannot list {prefix}: {exc}") from exc
    rows = [_row(root, root_path, info, label_depth, skip) for info in found]
    if not rows:
        log.warning("class prefix %s holds no objects; it is not a class", prefix)
    return rows


def _header_size(data: bytes, *, whole: bool) -> tuple[int, int] | None:
    """An image's width and height as displayed (EXIF orientation applied, as the shard job
    applies it: boxes are drawn on the image an annotator sees) from its first bytes, or all of
    them (``whole``). None: not within them (a PNG's ``eXIf`` chunk may follow its pixels), or
    unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if not whole and img.format == "PNG" and "exif" not in img.info:
                return None
            turned = orientation(img, data) in TRANSPOSED
    except Exception:  # Pillow raises many kinds for a cut-off or foreign header
        return None
    return (height, width) if turned else (width, height)


def _image_size(row: LabelledRow, data: bytes) -> LabelledRow:
    """Record the image's width and height from its header (``data``: its first bytes, or
    all of them); the whole object is read when the header is not within ``data``."""
    size = _header_size(data, whole=len(data) >= row["size"])
    if size is None and len(data) < row["size"]:
        whole = storage.read_listed(row["uri"])
        if isinstance(whole, str):
            return cast(LabelledRow, reject(row, whole))
        size = _header_size(whole, whole=True)
    if size is None:
        return cast(
            LabelledRow, reject(row, f"cannot read image size: its {row['format']} header is not readable")
        )
    row["image_width"], row["image_height"] = size
    return row


def place_boxes(rows: Iterable[LabelledRow], *, units: str) -> None:
    """Check each accepted row's boxes against its image's size, in pixels (``units``: how the
    table measured them); a box outside the image rejects the row, naming it."""
    for r in rows:
        if r["status"] != "ok":
            continue
        try:
            r["boxes"] = check_boxes(
                r.get("boxes") or [], r["image_width"] or 0, r["image_height"] or 0, units=units
            )
        except BadValue as exc:
            reject(r, str(exc))


def _inspect(row: StagedRow, sniff: bool = True, sizes: bool = False) -> StagedRow:
    if row["status"] != "ok":
        return row
    if row["size"] == 0:
        if row["etag"] is None:
            row["etag"] = hashlib.md5(b"", usedforsecurity=False).hexdigest()  # what S3 gives
        return reject(row, "empty object (0 bytes)")
    # The content is the MD5 of the bytes: the one the listing states (an S3 ETag but a multipart
    # upload's, a GCS md5Hash, an Azure Content-MD5), so only the header is read; else the whole
    # object is read to hash it (a local file, whose MD5 is also its ETag, as S3 would give).
    if not sniff:  # nothing is read: what the listing states is all that identifies content
        return row
    listed = row.get("content")
    data = storage.read_listed(row["uri"], end=None if listed is None else SNIFF_BYTES)
    if isinstance(data, str):
        return reject(row, data)
    if listed is None:
        row["content"] = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if storage.is_local(row["uri"]):
            row["etag"] = row["content"]
    head = data[:SNIFF_BYTES]
    fmt = sniff_format(head)
    if fmt is None:
        return reject(row, f"not an image: content starts with {head[:8]!r}, no known image signature")
    if fmt in UNSUPPORTED_FORMATS:
        return reject(row, f"unsupported format: {fmt} ({UNSUPPORTED_FORMATS[fmt]})")
    row["format"] = fmt
    return _image_size(cast(LabelledRow, row), data) if sizes else row


def inspect_objects(rows: Iterable[StagedRow], *, sniff: bool = True, sizes: bool = False) -> list[StagedRow]:
    """Read the first bytes of each object (all its bytes, to hash them, where the listing states
    no MD5 of them: a local file, say) and reject what is empty, unreadable or not an image.
    Runs inside an executor. With ``sniff`` off nothing is read: only empty objects (by their
    listed size) are rejected, ``format`` stays None, and a local object gets no ETag (the shard
    job then checks its size only). With ``sizes``, each image's width and height are read from
    its header too. Remote objects are read on :data:`_IO_THREADS` threads (each read waits on
    the network); local files on the task's own thread, as the shard job reads them: a read
    from the page cache costs less than handing it to a thread (docs/performance.md: 0.70x the
    wall time, 0.72x the CPU)."""
    rows = list(rows)
    inspect = partial(_inspect, sniff=sniff, sizes=sizes)
    if len(rows) <= 1 or not sniff or all(storage.is_local(r["uri"]) for r in rows):
        return [inspect(r) for r in rows]
    with ThreadPoolExecutor(max_workers=min(_IO_THREADS, len(rows))) as pool:
        return list(pool.map(inspect, rows))
