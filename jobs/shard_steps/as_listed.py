"""Read an image as the manifest listed it: an object replaced between the manifest job and
the shard job is a counted reject, never silently stored.

The manifest records each object's ``size``, ``etag`` and ``last_modified``: S3's ETag, or for
a local file the MD5 of its content (:mod:`jobs.manifest_steps.listing` computes it as it inspects the file;
with ``--no-sniff`` a local file has none). A read compares them with what it got: the length
of the bytes, and for S3 the ETag of the very response that carried them (no second request, no
race between a check and the read); for a local file the MD5 of the bytes read, or, without
one, the file's modification time once it is read (a file replaced before the read has the new
one).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os

from lakeshard import storage
from lakeshard.errors import StorageError

__all__ = ["CHANGED", "read_as_listed"]

#: The start of the reject reason of an object that is not what the manifest listed.
CHANGED = "changed since the manifest was built"


def _read(uri: str) -> tuple[bytes, str | None] | str:
    """The object's bytes and its ETag (None for a local file), or :data:`storage.GONE`."""
    if storage.is_local(uri):
        data = storage.read_listed(uri)
        return data if isinstance(data, str) else (data, None)
    try:
        got = storage.store_for(uri).get(uri)  # the ETag of the very answer that carried the bytes
        return got.data, got.etag
    except FileNotFoundError:
        return storage.GONE
    except Exception as exc:
        raise StorageError(f"cannot read {uri}: {type(exc).__name__}: {exc}") from exc


def read_as_listed(
    uri: str, *, size: int | None, etag: str | None, modified: dt.datetime | None = None
) -> bytes | str:
    """The bytes of ``uri``, or a reject reason: :data:`storage.GONE`, or ``changed since the
    manifest was built: size 123 -> 456`` (or ``etag a -> b``, ``modified ... -> ...``) when the
    object is not the one the manifest listed. ``size``, ``etag`` or ``modified`` None skips that
    comparison; ``modified`` is compared only for a local file without ``etag``. Errors of the
    platform raise (see :func:`lakeshard.storage.read_listed`)."""
    got = _read(uri)
    if isinstance(got, str):
        return got
    data, served_etag = got
    if size is not None and len(data) != size:
        return f"{CHANGED}: size {size} -> {len(data)}"
    if etag is not None:
        local = storage.is_local(uri)  # a local file has no ETag: the MD5 of its bytes is what S3 gives
        now = hashlib.md5(data, usedforsecurity=False).hexdigest() if local else served_etag
        if now is not None and now != etag:
            return f"{CHANGED}: etag {etag} -> {now}"
    elif modified is not None and storage.is_local(uri):
        now_modified = _local_mtime(uri)
        if now_modified is None:
            return storage.GONE
        if now_modified != modified:
            return f"{CHANGED}: modified {modified.isoformat()} -> {now_modified.isoformat()}"
    return data


def _local_mtime(uri: str) -> dt.datetime | None:
    """A local file's modification time at the microsecond the manifest stores, or None if it is gone."""
    try:
        return storage.modified_utc(os.stat(storage.filesystem(uri)[1]))
    except FileNotFoundError:
        return None
