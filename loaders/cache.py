"""A local cache of remote shards, shared by every rank and process on a machine.

Layout: ``<cache_dir>/<dataset_version>/<channel>/<index>-<sha256>.parquet``: keyed by the
dataset version (a rebuilt dataset never finds its predecessor's files) and by the shard's
sha256 from ``dataset.json``. A file there is trusted only after its size and sha256 match
``dataset.json`` (checked once per loader, and by the process that wrote it before it renamed
it into place); one that does not is deleted and fetched again.

Writes: whole shards, downloaded on the cache's own thread while the first epoch streams its
ranged reads. The writer holds ``fcntl.flock`` on ``<file>.lock`` (one process downloads a shard,
the others wait for it, then verify and use its file), writes ``<file>.tmp-<pid>-<hex>``, checks
size and sha256, ``fsync``s and renames it into place: no reader sees a torn file. A writer
killed mid-write leaves a temp file, never trusted (its name is not a shard's) and deleted by the
next holder of the shard's lock.

Eviction: after each download, least recently used shard files (modification time, touched on
every use) go until the cache is within ``limit`` bytes; files this loader uses are kept open, so
another process evicting one does not break a read (POSIX keeps an unlinked open file).

A folder that cannot be written (a read-only mount, no permission, a full disk or quota) is
used read-only: the shards it holds are verified and read from it, untouched (no LRU mark, a
bad copy is skipped, not deleted), and the others are read remotely, every epoch, after one
WARNING naming the folder and the reason (:attr:`ShardCache.read_only`). Found when the cache is
made, or by the first download that fails so; no download is tried after that. A ``cache_dir``
that is not a folder at all (a file in the way) is a :class:`LoaderError`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lakeshard import storage
from lakeshard.errors import LoaderError

__all__ = ["CachedShard", "ShardCache"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
#: Parts of a shard downloaded at once.
_PARTS = 8
#: How long a wait for another process's lock waits before it re-checks the stop event.
_WAIT_S = 0.1
#: Errors of a folder that cannot be written (any other error of a write is the shard's).
_CANNOT_WRITE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})


class _CannotWrite(Exception):
    """The cache folder cannot be written; the message says why (``strerror``)."""


@dataclass(frozen=True, slots=True)
class CachedShard:
    """A remote shard as the cache knows it: where it comes from and what it must hold."""

    index: int
    uri: str
    bytes: int
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class ShardCache:
    """The cache folder for one dataset version and channel of ``root`` (see the module doc)."""

    def __init__(
        self, root: str | os.PathLike[str], *, dataset_version: str, channel: str, limit: int
    ) -> None:
        self.root = Path(root)
        self.folder = self.root / dataset_version / channel
        self.channel = channel
        self.limit = limit
        #: Why the folder cannot be written (``"Read-only file system"``), or ``None``: then
        #: nothing is downloaded into it (see the module doc).
        self.read_only: str | None = None
        self._warned = False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.folder):  # can we write? (unnamed: nothing left behind)
                pass
        except OSError as exc:
            if exc.errno not in _CANNOT_WRITE:
                raise LoaderError(f"cache_dir {str(root)!r} cannot be used: {exc}") from exc
            self.read_only = exc.strerror or str(exc)
        self._lock = threading.Lock()
        self._ready: dict[int, Path] = {}  # verified files
        self._fds: dict[int, int] = {}  # kept open while the loader lives
        self.downloaded: list[int] = []  # shards this process downloaded
        self.dropped: list[tuple[int, str]] = []  # (shard, reason) of cache files found bad
        self.errors: list[tuple[int, str]] = []  # (shard, error) of downloads that failed
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def path(self, shard: CachedShard) -> Path:
        return self.folder / f"{shard.index:05d}-{shard.sha256}.parquet"

    def ready(self) -> dict[int, str]:
        """``file://`` URIs of the verified local copies, by shard index: each the file this
        cache keeps open (``/proc/self/fd/N``), so it is read even if another process evicts it."""
        with self._lock:
            return {i: f"file:///proc/self/fd/{fd}" for i, fd in self._fds.items()}

    def start(self, shards: list[CachedShard], *, name: str) -> None:
        """Fill the shards not ready yet, one after another, on a thread named ``{name}-cache``
        (unless one is running). A failed download is logged and left to the remote reads; a
        folder that cannot be written gets no download (one WARNING says so)."""
        with self._lock:
            todo = [s for s in shards if s.index not in self._ready]
            writable = self.read_only is None
            if writable and todo and (self._thread is None or not self._thread.is_alive()):
                self._stop = stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._fill_all, args=(todo, len(shards), stop), name=f"{name}-cache", daemon=True
                )
                self._thread.start()
        if todo and not writable:
            self._warn_read_only(len(shards))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the fill thread to finish; ``True`` if it has (or none runs)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stop(self) -> None:
        """Stop the fill thread (a download under way is abandoned, its temp file deleted)."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join()

    def _fill_all(self, shards: list[CachedShard], total: int, stop: threading.Event) -> None:
        """Fill ``shards`` (of the ``total`` this loader wants) in turn, until ``stop``."""
        for shard in shards:
            if stop.is_set():
                return
            try:
                self.fill(shard, stop)
            except _CannotWrite as exc:
                self.read_only = str(exc)
                self._warn_read_only(total)
                return
            except Exception as exc:
                log.warning("cannot cache %s in %s (reading it remotely): %s", shard.uri, self.folder, exc)
                self.errors.append((shard.index, f"{type(exc).__name__}: {exc}"))

    def _warn_read_only(self, total: int) -> None:
        """The one WARNING of a folder that cannot be written; ``total``: the shards this loader
        wants from it."""
        with self._lock:
            warned, self._warned = self._warned, True
            held = len(self._ready)
        if not warned:
            log.warning(
                "cache_dir %s cannot be written (%s): %d of %d shards of channel %r are read from it, "
                "the other %d remotely, every epoch",
                self.root,
                self.read_only,
                held,
                total,
                self.channel,
                total - held,
            )

    def adopt(self, shard: CachedShard) -> bool:
        """Use the cached copy of ``shard`` if there is one that checks out (deleting one that
        does not); ``True`` if it is ready."""
        path = self.path(shard)
        if not path.exists():
            return False
        if not self._verify(shard, path):
            if self.read_only is None:
                path.unlink(missing_ok=True)
            return False
        self._mark_ready(shard.index, path)
        return True

    def fill(self, shard: CachedShard, stop: threading.Event) -> bool:
        """Make the cached copy of ``shard``: wait for another process writing it, or download it
        (under the shard's lock). ``False`` if ``stop`` was set first."""
        path = self.path(shard)
        try:
            lock = open(path.with_name(path.name + ".lock"), "a+b")  # closed by the with below
        except OSError as exc:
            if exc.errno in _CANNOT_WRITE:
                raise _CannotWrite(exc.strerror) from exc
            raise
        with lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if stop.wait(_WAIT_S):
                    return False
            try:
                for stale in path.parent.glob(path.name + ".tmp-*"):  # a killed writer's
                    log.info("removing %s, left by a writer that did not finish", stale)
                    stale.unlink(missing_ok=True)
                if self.adopt(shard):  # another process wrote it meanwhile
                    return True
                return self._download(shard, path, stop)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        self.stop()
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    # -- internals -------------------------------------------------------------------------------
    def _verify(self, shard: CachedShard, path: Path) -> bool:
        size = path.stat().st_size
        if size != shard.bytes:
            reason = f"{size} bytes, dataset.json says {shard.bytes}"
        else:
            digest = _sha256(path)
            if digest == shard.sha256:
                return True
            reason = f"sha256 {digest}, dataset.json says {shard.sha256}"
        log.warning("dropping cached copy %s of %s: %s", path, shard.uri, reason)
        self.dropped.append((shard.index, reason))
        return False

    def _mark_ready(self, index: int, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        if self.read_only is None:
            try:
                os.utime(path)  # recently used: evicted last
            except OSError as exc:  # another user's file, say: it is still read
                log.debug("cannot mark %s as used: %s", path, exc)
        with self._lock:
            old = self._fds.pop(index, None)
            self._fds[index], self._ready[index] = fd, path
        if old is not None:
            os.close(old)

    def _download(self, shard: CachedShard, path: Path, stop: threading.Event) -> bool:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        remote = storage.s3_path(shard.uri)
        h = hashlib.sha256()
        try:
            # Parts of _CHUNK bytes, _PARTS at a time, through the blocking client the fetch
            # threads use (design/0030): a far store's bandwidth is per connection.
            part = f"{threading.current_thread().name}-part"
            with open(tmp, "wb") as dst, ThreadPoolExecutor(_PARTS, thread_name_prefix=part) as pool:
                starts = list(range(0, shard.bytes, _CHUNK))
                for i in range(0, len(starts), _PARTS):
                    if stop.is_set():
                        return False
                    parts = pool.map(
                        lambda s: storage.s3_read_range(remote, s, min(s + _CHUNK, shard.bytes)),
                        starts[i : i + _PARTS],
                    )
                    for chunk in parts:
                        h.update(chunk)
                        dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            size = tmp.stat().st_size
            if size != shard.bytes or h.hexdigest() != shard.sha256:
                raise LoaderError(
                    f"downloaded {shard.uri} into the cache: {size} bytes, sha256 {h.hexdigest()}; "
                    f"dataset.json says {shard.bytes} bytes, sha256 {shard.sha256} (changed since?)"
                )
            os.rename(tmp, path)
        except OSError as exc:
            # A full disk or quota (the lock file was written, so the folder is writable): not
            # this shard's fault. Remote read errors are never ENOSPC/EDQUOT.
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _CannotWrite(exc.strerror) from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self.downloaded.append(shard.index)
        self._mark_ready(shard.index, path)
        self._evict()
        return True

    def _evict(self) -> None:
        """Delete least recently used shard files (any version) until the cache fits ``limit``."""
        with self._lock:
            mine = set(self._ready.values())
        files = []
        for p in self.root.glob("*/*/*.parquet"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.limit:
                break
            if p in mine:
                continue
            log.info("cache over %d bytes: evicting %s", self.limit, p)
            p.unlink(missing_ok=True)
            total -= size
