"""The local store: a path or a ``file://`` URI, read with ``open`` and written under a temporary
name renamed into place.

A local file has no ETag of its own; this store gives the MD5 of its bytes, which is what S3
gives an object written in one PUT, wherever a call reads or writes the whole file anyway
(:meth:`LocalStore.get`, the conditional writes); :meth:`LocalStore.read_tail` gives none.
The conditional writes hold ``flock`` on the file's folder, so of two processes on one
filesystem one comes first whole.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec

from lakeshard.errors import StorageError
from lakeshard.storage._store import Blob, RequestStats, Store, Tail, split_scheme

__all__ = ["LocalStore", "temp_sibling"]

log = logging.getLogger(__name__)

_PREFIX = "file://"
_TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")


def temp_sibling(path: str) -> str:
    """A unique temporary name next to ``path``, to write to and then ``os.replace`` onto it."""
    return f"{path}.tmp-{uuid.uuid4().hex}"


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class LocalStore(Store):
    """Files of this machine: ``file:///abs/path`` (a plain or relative path, ``~`` and
    ``file:relative`` are made absolute)."""

    scheme = "file"
    local = True

    def normalize(self, uri: str) -> str:
        name, rest = split_scheme(uri)
        path = rest.removeprefix("//") if name == "file" else uri  # file:///abs -> /abs; file:rel -> rel
        return _PREFIX + os.path.abspath(os.path.expanduser(path))

    def path(self, uri: str) -> str:
        return uri[len(_PREFIX) :] if uri.startswith(_PREFIX + "/") else self.normalize(uri)[len(_PREFIX) :]

    def filesystem(self) -> Any:
        return fsspec.filesystem("file")

    # -- reads --------------------------------------------------------------------------------------
    def read(
        self,
        uri: str,
        start: int = 0,
        end: int | None = None,
        *,
        if_match: str | None = None,
        stats: RequestStats | None = None,
    ) -> bytes:
        """See :meth:`Store.read`. With ``open``: half the cost of fsspec's ``cat_file``, which
        counts when the shard job reads a lake of small images on a shared disk. ``if_match``
        hashes the whole file first; ``stats`` counts one request a read."""
        began = time.perf_counter()
        try:
            with open(self.path(uri), "rb") as f:
                if if_match is not None:
                    whole = f.read()
                    if (now := _md5(whole)) != if_match:
                        raise OSError(
                            errno.EINVAL, f"{uri}: its MD5 is {now}, not {if_match} (precondition failed)"
                        )
                    data = whole[start:end]
                else:
                    if start:  # a whole read never seeks: a pipe or a device reads as a file does
                        f.seek(start)
                    data = f.read() if end is None else f.read(max(0, end - start))
        except Exception as exc:
            if stats is not None:
                stats.add(
                    requests=1,
                    retries=0,
                    nbytes=0,
                    seconds=time.perf_counter() - began,
                    error=type(exc).__name__,
                )
            raise
        if stats is not None:
            stats.add(requests=1, retries=0, nbytes=len(data), seconds=time.perf_counter() - began)
        return data

    def read_tail(self, uri: str, n: int) -> Tail:
        if n < 1:
            raise ValueError(f"n must be a positive number of bytes, got {n!r}")
        with open(self.path(uri), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - n))
            return Tail(f.read(), size, None)

    def get(self, uri: str) -> Blob:
        with open(self.path(uri), "rb") as f:
            data = f.read()
            written = os.fstat(f.fileno()).st_mtime
        return Blob(data, _md5(data), max(0.0, time.time() - written))

    # -- writes -------------------------------------------------------------------------------------
    def write_atomic(self, uri: str, data: bytes, *, durable: bool = True) -> None:
        """See :meth:`Store.write_atomic`: a temporary sibling, fsync (unless not ``durable``: a
        job's scratch file that a rerun writes again), then ``os.replace``."""
        path = self.path(uri)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._replace_with(path, data, durable=durable)
        except Exception as exc:
            raise StorageError(f"cannot write {uri}: {exc}") from exc

    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        """See :meth:`Store.create_if_absent`: ``O_CREAT | O_EXCL``; the ETag is the MD5 of ``data``."""
        path = self.path(uri)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with _folder_locked(path):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        except FileExistsError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot create {uri}: {exc.strerror or exc}") from exc
        return _md5(data)

    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        path = self.path(uri)
        try:
            with _folder_locked(path):
                if _md5_of(path) != etag:
                    return None
                self._replace_with(path, data, durable=True)
        except OSError as exc:
            raise StorageError(f"cannot write {uri}: {exc}") from exc
        return _md5(data)

    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        path = self.path(uri)
        try:
            with _folder_locked(path):
                if _md5_of(path) != etag:
                    return False
                os.remove(path)
        except OSError as exc:
            raise StorageError(f"cannot delete {uri}: {exc}") from exc
        return True

    def rename(self, src: str, dst: str) -> None:
        """See :meth:`Store.rename`: one ``os.replace`` (the folders above ``dst`` are made)."""
        dst_path = self.path(dst)
        try:
            os.makedirs(os.path.dirname(dst_path), exist_ok=True)
            os.replace(self.path(src), dst_path)
        except Exception as exc:
            raise StorageError(f"cannot move {src} to {dst}: {exc}") from exc

    def remove_temporaries(self, uri: str) -> list[str]:
        """Delete the temporary files (:func:`temp_sibling`) under the folder ``uri``: what
        writers killed before their rename left behind, never a complete file. Return their
        paths."""
        fs, path = self.filesystem(), self.path(uri)
        try:
            found = [p for p in fs.find(path) if _TEMP_NAME.search(p)]
            for p in found:
                try:
                    fs.rm_file(p)
                except FileNotFoundError:  # its writer (a killed run's task, still alive) renamed it
                    pass
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise StorageError(f"cannot clean temporary files under {uri}: {exc}") from exc
        if found:
            log.info("removed %d temporary files left by killed writers under %s", len(found), uri)
        return found

    @staticmethod
    def _replace_with(path: str, data: bytes, *, durable: bool) -> None:
        tmp = temp_sibling(path)
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)


def _md5_of(path: str) -> str | None:
    """The MD5 of the file at ``path``, or None if there is none."""
    try:
        with open(path, "rb") as f:
            return _md5(f.read())
    except FileNotFoundError:
        return None


@contextmanager
def _folder_locked(path: str) -> Iterator[None]:
    """``flock`` on the folder of ``path`` while the block runs: the conditional writes of every
    process of this filesystem, one at a time."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock
