"""What the jobs, the format and the trainer do with a URI, each a call to the store of that URI
(:func:`lakeshard.storage.store_for`): no function here looks at a scheme."""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any

from lakeshard.errors import StorageError
from lakeshard.storage._registry import normalize, store_for

__all__ = [
    "GONE",
    "cat",
    "create_if_absent",
    "exists",
    "modified_utc",
    "move",
    "read_bytes",
    "read_json",
    "read_listed",
    "remove",
    "remove_if_unchanged",
    "remove_temporaries",
    "replace",
    "replace_if_unchanged",
    "write_bytes_atomic",
    "write_json_atomic",
]

#: The reject reason of a listed object that is gone when a job reads it.
GONE = "cannot read: object disappeared after listing"


def modified_utc(st: os.stat_result | float) -> dt.datetime:
    """A local file's modification time (its stat, or ``st_mtime``) as the manifest stores it:
    UTC, rounded to the microsecond as every listing of a local file rounds it (fsspec's
    ``info`` and the lake listing give ``st_mtime``, a float of seconds)."""
    seconds = st if isinstance(st, (int, float)) else st.st_mtime
    return dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)


def exists(uri: str) -> bool:
    uri = normalize(uri)
    return store_for(uri).exists(uri)


def cat(uri: str, *, end: int | None = None) -> bytes:
    """The bytes of the object or file at ``uri`` (a canonical URI, as listings give them), or
    its first ``end`` bytes, in one request (:meth:`Store.read`); raises what the store raises
    (``FileNotFoundError`` when it is gone)."""
    return store_for(uri).read(uri, 0, end)


def read_listed(uri: str, *, end: int | None = None) -> bytes | str:
    """The bytes of an object a listing found (see :func:`cat`), or :data:`GONE` if it is no
    longer there: the only read error that is a fact about the object, and a reject.

    Any other error (access denied, an archived object, an endpoint that still fails after
    botocore's retries) raises ``StorageError`` naming the URI: the cause is the platform, not
    the image, and a dataset must not silently depend on the weather. A rerun after the cause is
    fixed resumes where the job stopped."""
    try:
        return cat(uri, end=end)
    except FileNotFoundError:
        return GONE
    except Exception as exc:
        raise StorageError(f"cannot read {uri}: {type(exc).__name__}: {exc}") from exc


def read_bytes(uri: str) -> bytes:
    """The bytes of a small file (JSON, a marker) at ``uri``, in one request."""
    uri = normalize(uri)
    try:
        return cat(uri)
    except FileNotFoundError as exc:
        raise StorageError(f"{uri} does not exist") from exc
    except Exception as exc:
        raise StorageError(f"cannot read {uri}: {exc}") from exc


def read_json(uri: str) -> Any:
    data = read_bytes(uri)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise StorageError(f"{uri} is not valid JSON: {exc}") from exc


def write_bytes_atomic(uri: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` so that readers see the old object or the new one, never a part
    (:meth:`Store.write_atomic`: locally a temporary sibling, fsync unless not ``durable``, then
    ``os.replace``; on S3 one PUT, which S3 makes visible whole)."""
    uri = normalize(uri)
    store_for(uri).write_atomic(uri, data, durable=durable)


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


def create_if_absent(uri: str, data: bytes) -> str | None:
    """Create the object or file ``uri`` holding ``data`` unless something is there already, in
    one step no other writer can come between: the new object's ETag (locally the MD5 of
    ``data``, which is what S3 gives a single PUT) if this call created it, None if it was
    there. On S3 a PUT with ``If-None-Match: *`` (the store answers 412 when the key exists);
    locally ``O_CREAT | O_EXCL``.

    Raises:
        StorageError: the store refused the condition itself (an S3-compatible store without
            conditional writes answers 501 NotImplemented), or the write failed.
    """
    uri = normalize(uri)
    return store_for(uri).create_if_absent(uri, data)


def replace_if_unchanged(uri: str, data: bytes, etag: str) -> str | None:
    """Write ``data`` over ``uri`` only if its ETag is still ``etag`` (S3: ``If-Match``): the new
    ETag, or None if the object changed or is gone since."""
    uri = normalize(uri)
    return store_for(uri).replace_if_unchanged(uri, data, etag)


def remove_if_unchanged(uri: str, etag: str) -> bool:
    """Delete ``uri`` only if its ETag is still ``etag`` (S3: ``If-Match``): whether it was
    deleted (False: it changed or is gone)."""
    uri = normalize(uri)
    return store_for(uri).remove_if_unchanged(uri, etag)


def remove(uri: str, *, recursive: bool = False) -> None:
    """Delete ``uri`` if it exists (a folder with ``recursive=True``)."""
    uri = normalize(uri)
    store_for(uri).remove(uri, recursive=recursive)


def replace(src: str, dst: str) -> None:
    """Rename ``src`` (a file or a folder) onto ``dst``: one ``os.replace``, atomic. Local
    filesystems only: S3 has no rename (a move there is a copy of every byte), so writers on S3
    write each object once where it stays (``docs/design/0012-versioned-shards.md``).

    Raises:
        StorageError: a URI that is not local, or the rename failed (naming both URIs).
    """
    src, dst = normalize(src), normalize(dst)
    store = store_for(src)
    if store_for(dst) is not store:
        raise StorageError(
            f"cannot move {src} to {dst}: only local files are renamed (a move between stores "
            "copies every byte; write the object where it stays)"
        )
    store.rename(src, dst)


def move(src: str, dst: str) -> None:
    """Move the local folder ``src`` to ``dst`` (which must not exist): one ``os.replace``,
    atomic (see :func:`replace`)."""
    replace(src, dst)


def remove_temporaries(uri: str) -> list[str]:
    """Delete the temporary files (:func:`lakeshard.storage.temp_sibling`) under the folder
    ``uri``: what writers killed before their rename left behind, never a complete file. Return
    their paths.

    Each job calls it on its output before it writes, and the shard job again on its staging
    folder just before the commit moves that folder into the dataset. (S3 writes have no
    temporaries: an object appears whole when its upload completes.)"""
    uri = normalize(uri)
    return store_for(uri).remove_temporaries(uri)
