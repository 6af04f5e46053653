"""The prefetch pipeline: one reader thread, a pool of decode threads, a bounded queue per stream.

Generic over what it reads and decodes: a loader gives it a stream of batch tasks (an iterator
run on the reader thread, where the I/O happens; one epoch or several in a row, see
:mod:`loaders._internal.run`) and a function that decodes one task (run on the pool). Batches come out in
task order whatever the number of threads. The threads are made once (on the first stream) and
live until :meth:`Pipeline.close`: an epoch is a new iterator of tasks (:meth:`Pipeline.start`),
not a new pipeline.

Invariants, per stream (see :class:`PipelineStats`): ``0 <= consumed <= decoded <= submitted``, and
``submitted - consumed <= prefetch + 2`` (the queue, the one future the reader holds while it
waits for room, and the one the consumer is waiting on), so decoded batches in memory are
bounded by ``(prefetch + 2) * batch_size`` rows whatever the shard's size.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lakeshard.errors import LoaderError

__all__ = ["Pipeline", "PipelineStats", "Stream"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: How long a blocked ``get``/slot/``result`` waits before it re-checks the stop event and
#: the failure slot. Bounds how late an error or a ``close()`` is noticed; not a poll interval
#: (each wait returns as soon as its item arrives).
_WAIT_S = 0.05
#: How long ``close()`` waits for the reader thread (it may be inside one row-group read).
_JOIN_TIMEOUT_S = 30.0

_END = object()  # end-of-stream marker, put by the reader after the last task
_CLOSED = "this epoch's iterator was closed (the loader started another epoch or was closed)"


@dataclass
class PipelineStats:
    """A stream's counters, each written by one side only (reader: ``submitted``; consumer:
    ``consumed``; decode threads: ``decoded``, under a lock)."""

    submitted: int = 0
    decoded: int = 0
    consumed: int = 0
    max_in_flight: int = 0

    @property
    def outstanding(self) -> int:
        """Batches submitted and not yet consumed."""
        return self.submitted - self.consumed


# NOTE [ Prefetch shutdown ]
#
# Threads: the consumer (the training loop, calling ``Stream.next``), one reader thread, and
# ``num_threads`` decode threads (a ThreadPoolExecutor); all made on the first ``start`` and kept
# until ``Pipeline.close``.
#
# Streams: ``start`` stops the stream before it and puts a ``Stream`` (its task iterator, its own
# queue, stop event and error slot) in ``_jobs``; the reader thread takes one at a time and runs
# it. For each task it submits it to the pool *then* puts its Future in the stream's queue (at
# most ``prefetch`` of them: a slot of ``slots`` each, which the consumer gives back as it takes
# one), so futures come out in task order; after the last task it puts ``_END``. A stream may
# hold several epochs one after another (the loader's flow, NOTE [ A loader's flow ] in
# run.py): the pipeline does not know where one ends.
#
# Failure: whichever thread fails first (a read error on the reader, a decode error on a decode
# thread) stores the exception in the stream's ``error`` (first one wins, under its lock) and
# sets its ``stop``. The consumer checks ``error`` before every wait and after every ``_WAIT_S``
# of waiting, so the error reaches the training loop within ``_WAIT_S``. The threads live on:
# the next stream starts clean.
#
# Stop a stream: ``Stream.close()`` (called by the loader when an iteration ends without its flow
# going on, on ``break`` -- the loader's generator is finalised --, on error, by ``start`` and by
# ``Pipeline.close``): sets the stream's ``stop`` (the reader checks it before each task and in
# every wait for a slot; decode tasks check it between images), waits for the reader to leave
# the stream (``finished``, bounded by _JOIN_TIMEOUT_S) and cancels every queued future. A
# consumer waiting in ``Stream.next`` on another thread meanwhile sees ``_closed`` (or its future
# cancelled) within ``_WAIT_S`` and raises LoaderError: nothing will be queued for it any more.
#
# Stop the pipeline: ``Pipeline.close()`` (the loader's ``close``, or its finalizer when it is
# garbage-collected) closes the running stream, sets ``_closed``, joins the reader thread (it
# waits on ``_jobs`` with a timeout and sees ``_closed``), then
# ``executor.shutdown(wait=True, cancel_futures=True)`` joins every decode thread. After it
# returns no thread of this pipeline is alive (tests check threading.enumerate()). Nobody ever
# blocks without a timeout, and nobody sleeps.
class Stream(Generic[T, R]):
    """One stream of batches out of a :class:`Pipeline`."""

    def __init__(
        self,
        pipeline: Pipeline[T, R],
        tasks: Iterator[T],
        decode: Callable[[T, threading.Event], R],
        stop: threading.Event,
    ) -> None:
        self._pipeline = pipeline
        self.tasks = tasks
        self.decode = decode
        self.stop = stop
        # ``prefetch`` futures (a slot each) and the end marker, which needs no slot: the reader
        # leaves a stream once its last task is queued, not once the queue has room again.
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=pipeline.prefetch + 1)
        self.slots = threading.Semaphore(pipeline.prefetch)
        self.started = threading.Event()  # set by the reader thread when it takes this stream
        self.finished = threading.Event()  # set by the reader thread when it leaves this stream
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._closed = False
        self._current: Future[R] | None = None
        self.stats = PipelineStats()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
        self.stop.set()

    def decoded(self) -> None:
        with self._lock:
            self.stats.decoded += 1

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def next(self) -> R | None:
        """The next batch, or ``None`` at the end of the stream. Raises the first error of any
        thread."""
        while True:
            if self._closed:  # also while waiting: another thread may close it (NOTE [ Prefetch shutdown ])
                raise LoaderError(_CLOSED)
            self._raise_if_failed()
            if self._current is None:
                try:
                    item = self.queue.get(timeout=_WAIT_S)
                except queue.Empty:
                    if not self._pipeline.reader_alive() and self.queue.empty():
                        self._raise_if_failed()
                        raise LoaderError("the reader thread exited without finishing the epoch") from None
                    continue
                if item is _END:
                    return None
                self.slots.release()
                self._current = item
            future = self._current
            try:
                result = future.result(timeout=_WAIT_S)
            except TimeoutError:
                continue
            except CancelledError:  # by a close() on another thread
                raise LoaderError(_CLOSED) from None
            self._current = None
            # A task that saw ``stop`` returns None: that is a failure elsewhere (re-raise it)
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
        self.stop.set()
        if (
            self.started.is_set()
            and not self.finished.wait(timeout=_JOIN_TIMEOUT_S)
            and self._pipeline.reader_alive()
        ):
            log.warning("reader thread still busy with a stopped stream after %.0fs", _JOIN_TIMEOUT_S)
        if self._current is not None:
            self._current.cancel()
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Future):
                item.cancel()
        # The error's traceback holds the training loop's frames (the loader's): the long-lived
        # threads must not keep them alive, or a loader dropped unclosed is never collected.
        self.error = None
        self._pipeline.forget(self)


class Pipeline(Generic[T, R]):
    """Threads named ``{name}-reader`` and ``{name}-decode_*``, made on the first :meth:`start`
    and stopped by :meth:`close` (a later :meth:`start` makes new ones)."""

    def __init__(self, *, num_threads: int, prefetch: int, name: str = "lakeshard") -> None:
        self.num_threads = num_threads
        self.prefetch = prefetch
        self.name = name
        self._jobs: queue.Queue[Stream[T, R]] = queue.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._current: Stream[T, R] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._reader: threading.Thread | None = None

    def reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def start(
        self,
        tasks: Iterator[T],
        decode: Callable[[T, threading.Event], R],
        *,
        stop: threading.Event | None = None,
    ) -> Stream[T, R]:
        """Stop the running stream (if any) and start one that decodes ``tasks`` with ``decode``
        (``decode(task, stop)``, on the pool; returns ``None`` if it saw ``stop``); ``stop`` (set
        when this stream stops) is the one the task iterator watches."""
        stream: Stream[T, R] = Stream(self, tasks, decode, stop if stop is not None else threading.Event())
        with self._lock:
            previous, self._current = self._current, stream
            self._ensure_threads()
        if previous is not None:
            previous.close()
        self._jobs.put(stream)
        return stream

    def _ensure_threads(self) -> None:
        """Make the threads (under ``_lock``) if there are none."""
        if self._reader is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix=f"{self.name}-decode"
            )
            self._closed = threading.Event()
            self._reader = threading.Thread(
                target=self._loop, args=(self._closed,), name=f"{self.name}-reader", daemon=True
            )
            self._reader.start()

    def forget(self, stream: Stream[T, R]) -> None:
        with self._lock:
            if self._current is stream:
                self._current = None

    def close(self) -> None:
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            current.close()
        self._closed.set()
        if self._reader is not None:
            self._reader.join(timeout=_JOIN_TIMEOUT_S)
            if self._reader.is_alive():
                log.warning(
                    "reader thread %s still busy after %.0fs; leaving it (daemon)",
                    self._reader.name,
                    _JOIN_TIMEOUT_S,
                )
        while True:  # streams started but never run
            try:
                self._jobs.get_nowait().finished.set()
            except queue.Empty:
                break
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._reader = self._executor = None  # a later start() makes new threads

    # -- the reader thread -----------------------------------------------------------------------
    def _loop(self, closed: threading.Event) -> None:
        while not closed.is_set():
            try:
                stream = self._jobs.get(timeout=_WAIT_S)
            except queue.Empty:
                continue
            stream.started.set()
            try:
                self._run(stream)
            finally:
                stream.finished.set()
                del stream  # hold nothing of a finished stream while waiting for the next

    def _slot(self, stream: Stream[T, R]) -> bool:
        """Wait for room in ``stream``'s queue for one more future; ``False`` if it stopped first."""
        while not stream.stop.is_set():
            if stream.slots.acquire(timeout=_WAIT_S):
                return True
        return False

    def _decode_task(self, stream: Stream[T, R], task: T) -> R:
        try:
            result = stream.decode(task, stream.stop)
        except BaseException as exc:
            stream.fail(exc)
            raise
        stream.decoded()
        return result

    def _run(self, stream: Stream[T, R]) -> None:
        stats = stream.stats
        if stream.stop.is_set():  # stopped before its turn
            return
        try:
            for task in stream.tasks:
                if stream.stop.is_set():
                    return
                assert self._executor is not None  # made by _ensure_threads before any stream runs
                future = self._executor.submit(self._decode_task, stream, task)
                stats.submitted += 1
                stats.max_in_flight = max(stats.max_in_flight, stats.outstanding)
                if not self._slot(stream):
                    future.cancel()
                    return
                stream.queue.put_nowait(future)
            stream.queue.put_nowait(_END)  # never full: the futures in it hold at most prefetch slots
        except BaseException as exc:
            stream.fail(exc)
        finally:
            close = getattr(stream.tasks, "close", None)
            if close is not None:
                try:
                    close()  # a generator: run its finally blocks (closes the shard files)
                except Exception:
                    log.exception("error while closing the task iterator")
