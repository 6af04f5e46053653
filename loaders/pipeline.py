"""The prefetch pipeline: one reader thread, a pool of decode threads, a bounded queue.

Generic over what it reads and decodes: :class:`loaders.ShardLoader` gives it an iterator of
batch tasks (run on the reader thread, where the I/O happens) and a function that decodes one
task (run on the pool). Batches come out in task order whatever the number of threads.

Invariants (see :class:`PipelineStats`): ``0 <= consumed <= decoded <= submitted``, and
``submitted - consumed <= prefetch + 2`` (the queue, the one future the reader holds while it
waits for room, and the one the consumer is waiting on), so decoded batches in memory are
bounded by ``(prefetch + 2) * batch_size`` rows whatever the shard's size.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lakeshard.errors import LoaderError

__all__ = ["Pipeline", "PipelineStats"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: How long a blocked ``get``/``put``/``result`` waits before it re-checks the stop event and
#: the failure slot. Bounds how late an error or a ``close()`` is noticed; not a poll interval
#: (each wait returns as soon as its item arrives).
_WAIT_S = 0.05
#: How long ``close()`` waits for the reader thread (it may be inside one row-group read).
_JOIN_TIMEOUT_S = 30.0

_END = object()  # end-of-stream marker, put by the reader after the last task


@dataclass
class PipelineStats:
    """Counters, each written by one side only (reader: ``submitted``; consumer: ``consumed``;
    decode threads: ``decoded``, under a lock)."""

    submitted: int = 0
    decoded: int = 0
    consumed: int = 0
    max_in_flight: int = 0


# NOTE [ Prefetch shutdown ]
#
# Threads: the consumer (the training loop, calling ``next``), one reader thread running the task
# iterator, and ``num_threads`` decode threads (a ThreadPoolExecutor).
#
# Hand-off: the reader submits each task to the pool *then* puts its Future in ``_queue``
# (maxsize=prefetch), so futures come out in task order; the consumer takes futures from the
# queue and waits on each. After the last task the reader puts ``_END``; the consumer returns
# ``None`` (end of epoch) when it takes ``_END``.
#
# Failure: whichever thread fails first (a read error on the reader, a decode error on a decode
# thread) stores the exception in ``_error`` (first one wins, under ``_lock``) and sets ``_stop``.
# The consumer checks ``_error`` before every wait and after every ``_WAIT_S`` of waiting, so
# the error reaches the training loop within ``_WAIT_S`` of happening, even if the batches
# before it are not decoded yet, and even if the failing batch is several places ahead.
#
# Stop: ``close()`` (called by the consumer on normal end, on ``break`` -- the generator in
# ``ShardLoader.__iter__`` is finalised -- on error, and by ``ShardLoader.close``) runs:
#   1. set ``_stop``. The reader checks it before each task and inside every ``put`` wait, so it
#      exits within ``_WAIT_S`` (or after the row-group read it is in); decode tasks check it
#      between images and return early.
#   2. join the reader thread (bounded by _JOIN_TIMEOUT_S; a reader stuck in I/O is a daemon
#      and is reported, never waited on forever).
#   3. drain ``_queue``, cancelling every future not yet started.
#   4. ``executor.shutdown(wait=True, cancel_futures=True)`` joins every decode thread.
# After close() returns, no thread of this pipeline is alive (tests check threading.enumerate()).
# Nobody ever blocks without a timeout, and nobody sleeps.
class Pipeline(Generic[T, R]):
    def __init__(
        self,
        tasks: Iterator[T],
        decode: Callable[[T, threading.Event], R],
        *,
        num_threads: int,
        prefetch: int,
        name: str = "lakeshard",
    ) -> None:
        self._tasks = tasks
        self._decode = decode
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._current: Future[R] | None = None
        self.stats = PipelineStats()
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=f"{name}-decode")
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    # -- producer side ---------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
        self._stop.set()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_WAIT_S)
                return True
            except queue.Full:
                continue
        return False

    def _decode_task(self, task: T) -> R:
        try:
            result = self._decode(task, self._stop)
        except BaseException as exc:
            self._fail(exc)
            raise
        with self._lock:
            self.stats.decoded += 1
        return result

    def _read(self) -> None:
        try:
            for task in self._tasks:
                if self._stop.is_set():
                    return
                future = self._executor.submit(self._decode_task, task)
                self.stats.submitted += 1
                in_flight = self.stats.submitted - self.stats.consumed
                self.stats.max_in_flight = max(self.stats.max_in_flight, in_flight)
                if not self._put(future):
                    future.cancel()
                    return
            self._put(_END)
        except BaseException as exc:
            self._fail(exc)
        finally:
            close = getattr(self._tasks, "close", None)
            if close is not None:
                try:
                    close()  # a generator: run its finally blocks (closes the shard files)
                except Exception:
                    log.exception("error while closing the task iterator")

    # -- consumer side ---------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def next(self) -> R | None:
        """The next batch, or ``None`` at the end of the stream. Raises the first error of any
        thread."""
        if self._closed:
            raise LoaderError("this epoch's iterator was closed (the loader started another epoch or was closed)")
        while True:
            self._raise_if_failed()
            if self._current is None:
                try:
                    item = self._queue.get(timeout=_WAIT_S)
                except queue.Empty:
                    if not self._reader.is_alive() and self._queue.empty():
                        self._raise_if_failed()
                        raise LoaderError("the reader thread exited without finishing the epoch") from None
                    continue
                if item is _END:
                    return None
                self._current = item
            future = self._current
            try:
                result = future.result(timeout=_WAIT_S)
            except TimeoutError:
                continue
            self._current = None
            # A task that saw ``_stop`` returns None: that is a failure elsewhere (re-raise it)
            # or a close() from another thread, never the end of the stream.
            self._raise_if_failed()
            if result is None:
                raise LoaderError("a decode task was stopped before it finished (the pipeline was closed)")
            self.stats.consumed += 1
            return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._reader.join(timeout=_JOIN_TIMEOUT_S)
        if self._reader.is_alive():
            log.warning("reader thread %s still busy after %.0fs; leaving it (daemon)", self._reader.name, _JOIN_TIMEOUT_S)
        if self._current is not None:
            self._current.cancel()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Future):
                item.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
