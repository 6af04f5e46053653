"""Concurrent ranged reads of remote row groups, bounded by a byte budget.

The reader thread tells a :class:`RangeFetcher` which byte ranges an epoch needs, in the order
it needs them (:meth:`RangeFetcher.schedule`); the fetcher keeps up to ``concurrency`` of them
in flight on its own threads, as many as fit in ``budget`` bytes, and the reader takes each one
(:meth:`RangeFetcher.get`) and lets it go (:meth:`RangeFetcher.release`) once its rows are copied
out. A row group's column chunks are one contiguous byte range, so a row group is one request;
:func:`read_row_group` decodes it from those bytes and the footer read once per loader.

Invariant: ``0 <= held <= budget`` at every moment (``held``: the bytes of every range
submitted and not yet released or dropped; ``peak_bytes_held`` records its high-water mark),
whatever the shard's size; a single range larger than ``budget`` is refused on schedule.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from lakeshard import storage
from lakeshard.errors import ConfigError, LoaderError

__all__ = ["ByteRange", "RangeFetcher", "read_range", "read_row_group", "row_group_range"]

log = logging.getLogger(__name__)

#: How long a blocked ``get`` waits before it re-checks the stop event (not a poll interval:
#: the wait returns as soon as the read is done).
_WAIT_S = 0.05
#: Keys kept in ``RangeFetcher.submitted`` and ``RangeFetcher.waited``.
_LOG_KEYS = 4096
#: How long :func:`_started_pool` waits for its threads to be running.
_START_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of the object at ``uri``, whose ETag (if known) must still be ``etag``."""

    uri: str
    start: int
    end: int
    etag: str | None = None
    #: Fetch in at least this many parts (each of at least :data:`_MIN_PART_BYTES`), at once:
    #: for a read a batch waits on, whose latency matters more than its requests.
    parts: int = 1

    @property
    def size(self) -> int:
        return self.end - self.start


def row_group_range(md: pq.FileMetaData, group: int) -> tuple[int, int]:
    """``(start, end)``: the bytes of row group ``group``'s column chunks (one contiguous run)."""
    rg = md.row_group(group)
    start, end = None, 0
    for i in range(rg.num_columns):
        col = rg.column(i)
        first = (
            col.dictionary_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset
            else col.data_page_offset
        )
        start = first if start is None else min(start, first)
        end = max(end, first + col.total_compressed_size)
    if start is None:
        raise LoaderError(f"row group {group} has no column chunks")
    return start, end


class _RangeFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``[start, start + len(data))`` is known:
    what Parquet reads for one row group when it is given the footer's metadata. Reads are
    views of ``data``, not copies (Arrow takes any buffer)."""

    def __init__(self, size: int, start: int, data: bytes) -> None:
        super().__init__()
        self._size, self._start, self._data, self._pos = size, start, memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> memoryview:
        n = self._size - self._pos if n is None or n < 0 else n
        lo = self._pos - self._start
        if lo < 0 or lo + n > len(self._data):
            raise OSError(
                f"read of bytes {self._pos}-{self._pos + n} outside the fetched range "
                f"{self._start}-{self._start + len(self._data)}"
            )
        self._pos += n
        return self._data[lo : lo + n]

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]  # typeshed's Buffer is not writable
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def read_row_group(
    md: pq.FileMetaData, size: int, group: int, start: int, data: bytes, columns: list[str]
) -> pa.Table:
    """Row group ``group`` of a file of ``size`` bytes whose footer is ``md``, decoded from
    ``data``, the file's bytes from ``start`` on (:func:`row_group_range`)."""
    pf = pq.ParquetFile(_RangeFile(size, start, data), metadata=md)
    return pf.read_row_group(group, columns=columns, use_threads=False)


# NOTE [ Fetch threads ]
#
# Who calls what: the reader thread calls ``schedule``, ``get``, ``release`` and ``drop``; the
# fetch threads (a ThreadPoolExecutor of ``concurrency``) run ``read``, which reads the other
# parts of a range in several (``ByteRange.parts``) on the part threads (up to ``concurrency *
# (concurrency - 1)``; a part read never waits on anything but its own request, so a fetch
# thread waiting on parts queued behind other ranges' parts cannot deadlock); ``close`` is
# called by the pipeline's owner once, after the reader thread has stopped.
#
# The fetch threads and ``concurrency`` part threads are started (:func:`_started_pool`) by
# ``start`` (the loader's constructor) or else by the first ``schedule``, before any read is
# submitted: a thread started while the threads before it prepare requests waits for the GIL
# they hold (a millisecond or more each), and the reads an epoch's first batch waits on went
# out last.
#
# Admission: ``_pump`` (under ``_lock``) submits the next scheduled range while fewer than
# ``concurrency`` reads are running and ``held + size <= budget``; it runs after ``schedule``,
# ``release``, ``drop`` and when a read finishes (its done-callback), so a freed slot or freed
# bytes are used at once. Bytes count from submission until ``release``/``drop`` (a dropped read
# that is still running keeps its bytes until it ends, then frees them).
#
# Errors: a read's exception is kept in its Future and raised by ``get`` for that key only; a
# range read ahead and never needed (a failed read ahead included) is dropped silently.
class RangeFetcher:
    """Reads byte ranges on ``concurrency`` threads named ``{name}-fetch``, in schedule order,
    holding at most ``budget`` bytes."""

    def __init__(
        self,
        read: Callable[[ByteRange, Executor | None, storage.RequestStats], bytes],
        *,
        concurrency: int,
        budget: int,
        name: str,
    ) -> None:
        self._read = read
        self.concurrency = concurrency
        self.budget = budget
        self._lock = threading.RLock()  # a cancel() runs the done-callback at once
        self._pending: deque[tuple[Hashable, ByteRange]] = deque()
        self._futures: dict[Hashable, Future[bytes]] = {}
        self._sizes: dict[Future[bytes], int] = {}  # the bytes each admitted read holds
        self._running = 0
        self.held = 0
        self.peak_bytes_held = 0
        self.bytes_read = 0
        #: Every GET of the reads, counted as they are sent (retries and errors included).
        self.requests = storage.RequestStats()
        #: The last keys submitted for reading, read (successfully) and waited on by ``get``
        #: (a ``get`` that found its read not yet ended), oldest first (bounded).
        self.submitted: deque[Hashable] = deque(maxlen=_LOG_KEYS)
        self.completed: deque[Hashable] = deque(maxlen=_LOG_KEYS)
        self.waited: deque[Hashable] = deque(maxlen=_LOG_KEYS)
        self._name = name
        #: Called with each range and its bytes once read, on the fetch thread that read it (the
        #: shard cache's read-through: :meth:`loaders._internal.cache.ShardCache.offer`); must not raise.
        self.on_read: Callable[[ByteRange, bytes], None] | None = None
        # Made by start() or the first schedule(), again after close().
        self._executor: ThreadPoolExecutor | None = None
        self._parts: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start the fetch and part threads now rather than on the first :meth:`schedule`."""
        with self._lock:
            self._start_locked()

    def schedule(self, ranges: Sequence[tuple[Hashable, ByteRange]]) -> None:
        """Read ``ranges`` next, in this order. Reads already made or under way for a key in
        ``ranges`` are kept; every other one is dropped."""
        for _, r in ranges:
            if r.size > self.budget:
                raise ConfigError(
                    f"memory_budget leaves {self.budget} bytes for reads, less than one row group "
                    f"of {r.size} bytes ({r.uri}); raise memory_budget"
                )
        keep = {k for k, _ in ranges}
        with self._lock:
            self._start_locked()
            for key in [k for k in self._futures if k not in keep]:
                self._drop_locked(key)
            self._pending = deque((k, r) for k, r in ranges if k not in self._futures)
            self._pump_locked()

    def get(self, key: Hashable, stop: threading.Event) -> bytes | None:
        """The bytes of ``key`` (scheduled), waiting for them; ``None`` if ``stop`` is set first.
        Raises what the read raised. ``waited`` records the call unless the read had ended."""
        with self._lock:
            future = self._futures.get(key)
        if future is None or not future.done():
            self.waited.append(key)
        while True:  # not admitted yet: it is, once the ranges before it are released
            with self._lock:
                future = self._futures.get(key)
                if future is None and not any(k == key for k, _ in self._pending):
                    raise LoaderError(f"internal: range {key!r} was never scheduled")
            if future is not None:
                break
            if stop.wait(_WAIT_S):
                return None
        while True:
            try:
                return future.result(timeout=_WAIT_S)
            except TimeoutError:
                if stop.is_set():
                    return None

    def reads_ended(self) -> bool:
        """Whether every read submitted has ended (well) and none is running. Asked under the
        lock, which the end of a read holds until it has submitted the reads it made room for:
        when this holds, nothing more is submitted until the fetcher is asked to (a
        ``schedule``, ``release`` or ``drop``)."""
        with self._lock:
            return set(self.submitted) <= set(self.completed) and not self._running

    def release(self, key: Hashable) -> None:
        """``key``'s bytes are no longer needed: free them and admit the next reads."""
        with self._lock:
            future = self._futures.pop(key, None)
            if future is not None and (future.cancel() or future.done()):
                self._free_locked(future)
            self._pump_locked()

    def drop(self) -> None:
        """Forget everything scheduled (an epoch stopped early)."""
        with self._lock:
            self._pending.clear()
            for key in list(self._futures):
                self._drop_locked(key)

    def close(self) -> None:
        """Drop everything and stop the fetch threads (a later :meth:`schedule` makes new ones)."""
        self.drop()
        with self._lock:
            pools, self._executor, self._parts = (self._executor, self._parts), None, None
        for pool in pools:  # the fetch threads first: they wait on their parts
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    # -- internals (under _lock) ---------------------------------------------------------------------
    def _drop_locked(self, key: Hashable) -> None:
        future = self._futures.pop(key)
        if future.cancel() or future.done():
            self._free_locked(future)
        # else: still running; its done-callback frees its bytes

    def _free_locked(self, future: Future[bytes]) -> None:
        size = self._sizes.pop(future, None)
        if size is not None:
            self.held -= size

    def _pump_locked(self) -> None:
        while self._pending and self._running < self.concurrency:
            key, r = self._pending[0]
            if self.held and self.held + r.size > self.budget:
                return
            self._pending.popleft()
            self.held += r.size
            self.peak_bytes_held = max(self.peak_bytes_held, self.held)
            self._running += 1
            assert self._executor is not None  # started by schedule(), the only source of _pending
            future = self._executor.submit(self._run, r)
            self.submitted.append(key)
            self._sizes[future] = r.size
            self._futures[key] = future
            future.add_done_callback(functools.partial(self._done, key))

    def _start_locked(self) -> None:
        if self._executor is None:
            self._executor = _started_pool(self.concurrency, f"{self._name}-fetch")
            # Every read in flight may be in parts (an epoch's first batch: record 0030), the
            # parts beyond the first at once: up to concurrency * (concurrency - 1), the first
            # round of them started now.
            self._parts = _started_pool(
                self.concurrency, f"{self._name}-part", max_workers=self.concurrency * (self.concurrency - 1)
            )

    def _run(self, r: ByteRange) -> bytes:
        data = self._read(r, self._parts, self.requests)
        if len(data) != r.size:
            raise LoaderError(
                f"read bytes {r.start}-{r.end} of {r.uri}: got {len(data)} bytes, expected {r.size} (file changed?)"
            )
        if self.on_read is not None:
            self.on_read(r, data)
        return data

    def _done(self, key: Hashable, future: Future[bytes]) -> None:
        with self._lock:
            self._running -= 1
            if not future.cancelled() and future.exception() is None:
                self.bytes_read += len(future.result())
                self.completed.append(key)
            if self._futures.get(key) is not future:  # dropped or released while it ran
                self._free_locked(future)
            self._pump_locked()


#: A row group of at least twice this many bytes is fetched in parts (equal, each at least this
#: size), at once on threads of their own: a large row group arrives over several connections. A
#: smaller one is one GET: a full part and a sliver cost the client twice its per-request CPU
#: and a second copy of the bytes (the join), for no bandwidth gained.
_PART_BYTES = 4 << 20
#: The smallest part of a range asked for in several (``ByteRange.parts``): below it, a part's
#: request costs more than its bytes save.
_MIN_PART_BYTES = 1 << 20


def _parts(start: int, end: int, at_least: int = 1) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``max(size // _PART_BYTES, min(at_least, size //
    _MIN_PART_BYTES), 1)`` parts of equal size (the last one up to ``parts - 1`` bytes shorter),
    in order."""
    size = end - start
    n = max(size // _PART_BYTES, min(at_least, size // _MIN_PART_BYTES), 1)
    step = max(1, -(-size // n))
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def read_range(
    store: storage.Store,
    r: ByteRange,
    pool: Executor | None = None,
    stats: storage.RequestStats | None = None,
) -> bytes:
    """The bytes of ``r`` from ``store``, each request asking for ``If-Match: <the ETag of the
    shard the loader checked>``: an object replaced since fails the read, never gives other
    bytes. Blocking, on the calling fetch thread (:meth:`lakeshard.storage.Store.read`); a range
    in several parts has the first read here and the others on ``pool`` (default: threads of
    their own, named ``<this thread's name>-part``), at once as far as it has threads."""
    parts = _parts(r.start, r.end, r.parts)
    if len(parts) == 1:
        return store.read(r.uri, r.start, r.end, if_match=r.etag, stats=stats)
    with contextlib.ExitStack() as stack:
        if pool is None:
            name = f"{threading.current_thread().name}-part"
            pool = stack.enter_context(ThreadPoolExecutor(len(parts) - 1, thread_name_prefix=name))
        rest = [pool.submit(store.read, r.uri, lo, hi, if_match=r.etag, stats=stats) for lo, hi in parts[1:]]
        try:
            first = store.read(r.uri, *parts[0], if_match=r.etag, stats=stats)
            return b"".join([first, *(f.result() for f in rest)])
        finally:
            for f in rest:  # on an error, the parts not yet begun are not read
                f.cancel()


def _started_pool(n: int, name: str, *, max_workers: int | None = None) -> ThreadPoolExecutor:
    """A pool of up to ``max_workers`` (default ``n``) threads named ``{name}_<i>``, ``n`` of them
    running when it is returned (a ThreadPoolExecutor otherwise starts one per task submitted
    while the others are busy, up to ``max_workers``, as it still does beyond ``n``): each of
    ``n`` tasks waits at a barrier for the others. If a thread is slow to start, the barrier
    breaks after :data:`_START_TIMEOUT_S` and the pool starts the rest later, as it would."""
    pool = ThreadPoolExecutor(max_workers=max(n, max_workers or n), thread_name_prefix=name)
    barrier = threading.Barrier(n)
    for task in [pool.submit(barrier.wait, _START_TIMEOUT_S) for _ in range(n)]:
        task.exception()  # a BrokenBarrierError: fewer threads for now, not an error
    return pool
