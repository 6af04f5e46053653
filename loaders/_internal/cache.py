"""A local cache of remote shards, shared by every rank and process on a machine: a layer over
the store the shards are in (a :class:`lakeshard.storage.Store`), from which it reads what it
does not hold.

Layout: ``<cache_dir>/<dataset_version>/<channel>/<index>-<sha256>.parquet``: keyed by the
dataset version (a rebuilt dataset never finds its predecessor's files) and by the shard's
sha256 from ``dataset.json``. A file there is trusted only after its size and sha256 match
``dataset.json`` (checked once per loader, and by the process that wrote it before it renamed
it into place); one that does not is deleted and fetched again.

Writes: whole shards, filled on the cache's own thread while the first epoch streams its ranged
reads, **from those reads** (read-through): each row group the epoch fetches is also written at
its offset into the shard's temp file (:meth:`ShardCache.offer`, called by the fetch threads), the
cache thread downloads at once only what the epoch will not read (the footer, the magic, row
groups of no piece of this rank) and, once the epoch has read what it said it would
(``expected``) or has ended (:meth:`ShardCache.epoch_ended`), whatever is still missing; so epoch
1 reads each byte of a shard once, not once for the epoch and once for the cache. The writer
holds ``fcntl.flock`` on ``<file>.lock`` (one process fills a shard, the others wait for it,
then verify and use its file), writes ``<file>.tmp-<pid>-<hex>``, checks size and sha256,
``fsync``s and renames it into place: no reader sees a torn file. A writer killed mid-write
leaves a temp file, never trusted (its name is not a shard's) and deleted by the next holder of
the shard's lock.

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
from typing import BinaryIO

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


def _mismatch(shard: CachedShard, path: Path) -> str | None:
    """Why the file at ``path`` is not ``shard`` (its size, else its sha256), or ``None``."""
    size = path.stat().st_size
    if size != shard.bytes:
        return f"{size} bytes, dataset.json says {shard.bytes}"
    digest = _sha256(path)
    if digest == shard.sha256:
        return None
    return f"sha256 {digest}, dataset.json says {shard.sha256}"


def _open_lock(path: Path) -> BinaryIO:
    """``<path>.lock``, opened for ``flock``; :class:`_CannotWrite` if the folder cannot be written."""
    try:
        return open(path.with_name(path.name + ".lock"), "a+b")
    except OSError as exc:
        if exc.errno in _CANNOT_WRITE:
            raise _CannotWrite(exc.strerror) from exc
        raise


def _flock(lock: BinaryIO, stop: threading.Event) -> bool:
    """Take ``lock`` exclusively, waiting for another process holding it; ``False`` if ``stop``
    was set first."""
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if stop.wait(_WAIT_S):
            return False


def _evict(root: Path, limit: int, *, keep: set[Path]) -> None:
    """Delete least recently used shard files (any version) under ``root``, but those in ``keep``,
    until the cache fits ``limit``."""
    files = []
    for p in root.glob("*/*/*.parquet"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= limit:
            break
        if p in keep:
            continue
        log.info("cache over %d bytes: evicting %s", limit, p)
        p.unlink(missing_ok=True)
        total -= size


class ShardCache:
    """The cache folder for one dataset version and channel of ``root`` (see the module doc)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        store: storage.Store,
        *,
        dataset_version: str,
        channel: str,
        limit: int,
    ) -> None:
        self.root = Path(root)
        #: Where the shards are: what the cache downloads, it reads from there.
        self.store = store
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
        #: Read-through (see the module doc): the temp file being filled, by shard URI.
        self._filling: dict[str, _Filling] = {}
        #: The byte ranges the current epoch reads, by shard URI (:meth:`start`).
        self._expected: dict[str, list[tuple[int, int]]] = {}
        self._epoch_over = threading.Event()
        #: Bytes of shards written from the epoch's reads, and downloaded by the cache itself.
        self.bytes_offered = 0
        self.bytes_downloaded = 0
        #: The GETs of what the cache fetched itself (the gaps the epochs' reads left).
        self.requests = storage.RequestStats()

    def path(self, shard: CachedShard) -> Path:
        return self.folder / f"{shard.index:05d}-{shard.sha256}.parquet"

    def ready(self) -> dict[int, str]:
        """``file://`` URIs of the verified local copies, by shard index: each the file this
        cache keeps open (``/proc/self/fd/N``), so it is read even if another process evicts it."""
        with self._lock:
            return {i: f"file:///proc/self/fd/{fd}" for i, fd in self._fds.items()}

    def start(
        self,
        shards: list[CachedShard],
        *,
        name: str,
        expected: dict[int, list[tuple[int, int]]] | None = None,
    ) -> None:
        """Fill the shards not ready yet, one after another, on a thread named ``{name}-cache``
        (unless one is running). ``expected``: by shard index, the byte ranges the epoch starting
        now will read (and :meth:`offer`), which the fill then takes from those reads. A failed
        download is logged and left to the remote reads; a folder that cannot be written gets no
        download (one WARNING says so)."""
        with self._lock:
            todo = [s for s in shards if s.index not in self._ready]
            writable = self.read_only is None
            if writable and todo and (self._thread is None or not self._thread.is_alive()):
                self._expected = {s.uri: sorted((expected or {}).get(s.index, [])) for s in todo}
                self._epoch_over = threading.Event()
                self._stop = stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._fill_all, args=(todo, len(shards), stop), name=f"{name}-cache", daemon=True
                )
                self._thread.start()
        if todo and not writable:
            self._warn_read_only(len(shards))

    def filling(self) -> bool:
        """Whether a fill is under way: the shards it fills will be read from disk next epoch."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def offer(self, uri: str, start: int, data: bytes) -> None:
        """Bytes ``[start, start + len(data))`` of the remote shard at ``uri``, just read by the
        epoch: written into that shard's temp file if it is being filled (read-through);
        otherwise nothing. Runs on a fetch thread; never raises (a failed write leaves the range
        to the cache's own download)."""
        with self._lock:
            filling = self._filling.get(uri)
        if filling is None:
            return
        try:
            filling.write(start, data)
        except OSError as exc:
            log.debug(
                "cache: cannot write bytes %d-%d of %s from the epoch's read: %s",
                start,
                start + len(data),
                uri,
                exc,
            )
            return
        self.bytes_offered += len(data)

    def epoch_ended(self) -> None:
        """The epoch the fill was waiting on is over (or stopped): download what it did not read."""
        self._epoch_over.set()

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
        self._epoch_over.set()
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
        with _open_lock(path) as lock:
            if not _flock(lock, stop):
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
        reason = _mismatch(shard, path)
        if reason is None:
            return True
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
        """Fill ``path`` (under its lock): the bytes the epoch will not read at once, the epoch's
        reads as they come (:meth:`offer`), then any gap; verify; rename into place."""
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        expected = self._expected.get(shard.uri, [])
        try:
            with open(tmp, "w+b") as dst:
                dst.truncate(shard.bytes)
                filling = _Filling(dst.fileno())
                with self._lock:
                    self._filling[shard.uri] = filling
                try:
                    if not self._fetch_gaps(shard, filling, _gaps([(0, shard.bytes)], expected), stop):
                        return False
                    while not filling.covers(expected, shard.bytes) and not self._epoch_over.is_set():
                        if stop.wait(_WAIT_S):
                            return False
                finally:
                    with self._lock:
                        self._filling.pop(shard.uri, None)
                if not self._fetch_gaps(shard, filling, filling.gaps(shard.bytes), stop):
                    return False
                dst.flush()
                os.fsync(dst.fileno())
            size, digest = tmp.stat().st_size, _sha256(tmp)
            if size != shard.bytes or digest != shard.sha256:
                raise LoaderError(
                    f"downloaded {shard.uri} into the cache: {size} bytes, sha256 {digest}; "
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
        with self._lock:
            mine = set(self._ready.values())
        _evict(self.root, self.limit, keep=mine)
        return True

    def _fetch_gaps(
        self, shard: CachedShard, filling: _Filling, gaps: list[tuple[int, int]], stop: threading.Event
    ) -> bool:
        """Download ``gaps`` of ``shard`` into ``filling``, in parts of at most ``_CHUNK`` bytes,
        ``_PARTS`` at a time, through the store the fetch threads read (design/0030: a far
        store's bandwidth is per connection). ``False`` if ``stop`` came first."""
        parts = [(s, min(s + _CHUNK, hi)) for lo, hi in gaps for s in range(lo, hi, _CHUNK)]
        if not parts:
            return True
        name = f"{threading.current_thread().name}-part"
        with ThreadPoolExecutor(_PARTS, thread_name_prefix=name) as pool:
            for i in range(0, len(parts), _PARTS):
                if stop.is_set():
                    return False
                batch = parts[i : i + _PARTS]
                for (lo, _), chunk in zip(
                    batch,
                    pool.map(lambda r: self.store.read(shard.uri, *r, stats=self.requests), batch),
                    strict=True,
                ):
                    filling.write(lo, chunk)
                    self.bytes_downloaded += len(chunk)
        return True


class _Filling:
    """A shard's temp file being filled, and which of its bytes are in (written with ``pwrite``
    by the fetch threads and the cache thread alike)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._have: list[tuple[int, int]] = []  # sorted, disjoint, merged

    def write(self, start: int, data: bytes) -> None:
        os.pwrite(self._fd, data, start)
        with self._lock:
            self._have = _merge([*self._have, (start, start + len(data))])

    def gaps(self, size: int) -> list[tuple[int, int]]:
        with self._lock:
            return _gaps([(0, size)], self._have)

    def covers(self, ranges: list[tuple[int, int]], size: int) -> bool:
        with self._lock:
            return not _gaps([(lo, min(hi, size)) for lo, hi in ranges], self._have)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, with overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _gaps(want: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``want`` that ``have`` does not cover, in order."""
    have = _merge(have)
    out = []
    for lo, hi in _merge(want):
        for a, b in have:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out
