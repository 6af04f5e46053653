"""A store of this process's memory, ``mem://bucket/key``: the smallest :class:`Store` there is,
on fsspec's memory filesystem. What a new store (GCS, Azure) plugs in through
:func:`lakeshard.storage.register_store`; the registry and contract tests use it."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import fsspec

from lakeshard.errors import StorageError
from lakeshard.storage import Blob, RequestStats, Store, Tail

__all__ = ["MemStore"]


class MemStore(Store):
    """Objects in fsspec's memory filesystem (one a process), at ``/<bucket>/<key>``; ETags are
    the MD5 of the bytes; the conditional writes hold one lock."""

    scheme = "mem"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written: dict[str, float] = {}  # path -> when it was last written

    def normalize(self, uri: str) -> str:
        rest = uri.partition(":")[2]
        bucket, _, key = rest.removeprefix("//").partition("/")
        if not rest.startswith("//") or not bucket:
            raise StorageError(f"mem URI {uri!r} names no bucket")
        key = key.strip("/")
        return f"mem://{bucket}/{key}" if key else f"mem://{bucket}"

    def path(self, uri: str) -> str:
        return "/" + (uri if uri.startswith("mem://") else self.normalize(uri))[len("mem://") :]

    def uri(self, path: str) -> str:
        return "mem://" + path.lstrip("/")

    def filesystem(self) -> Any:
        return fsspec.filesystem("memory")

    def read(
        self,
        uri: str,
        start: int = 0,
        end: int | None = None,
        *,
        if_match: str | None = None,
        stats: RequestStats | None = None,
    ) -> bytes:
        try:
            data = self._bytes(uri)
            if if_match is not None and _md5(data) != if_match:
                raise OSError(f"{uri}: precondition failed (If-Match {if_match})")
        except OSError as exc:
            if stats is not None:
                stats.add(requests=1, retries=0, nbytes=0, seconds=0.0, error=type(exc).__name__)
            raise
        if stats is not None:
            stats.add(requests=1, retries=0, nbytes=len(data[start:end]), seconds=0.0)
        return data[start:end]

    def read_tail(self, uri: str, n: int) -> Tail:
        data = self._bytes(uri)
        return Tail(data[-n:], len(data), _md5(data))

    def get(self, uri: str) -> Blob:
        data = self._bytes(uri)
        return Blob(data, _md5(data), time.time() - self._written.get(self.path(uri), time.time()))

    def write_atomic(self, uri: str, data: bytes, *, durable: bool = True) -> None:
        with self._lock:
            self._put(uri, data)

    def create_if_absent(self, uri: str, data: bytes) -> str | None:
        with self._lock:
            if self.filesystem().exists(self.path(uri)):
                return None
            return self._put(uri, data)

    def replace_if_unchanged(self, uri: str, data: bytes, etag: str) -> str | None:
        with self._lock:
            if self._etag(uri) != etag:
                return None
            return self._put(uri, data)

    def remove_if_unchanged(self, uri: str, etag: str) -> bool:
        with self._lock:
            if self._etag(uri) != etag:
                return False
            self.filesystem().rm_file(self.path(uri))
            return True

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"cannot move {src} to {dst}: only local files are renamed")

    def _bytes(self, uri: str) -> bytes:
        return bytes(self.filesystem().cat_file(self.path(uri)))

    def _etag(self, uri: str) -> str | None:
        try:
            return _md5(self._bytes(uri))
        except FileNotFoundError:
            return None

    def _put(self, uri: str, data: bytes) -> str:
        self.filesystem().pipe_file(self.path(uri), data)
        self._written[self.path(uri)] = time.time()
        return _md5(data)


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
