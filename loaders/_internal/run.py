"""A loader's iterations: each ``iter()`` is a :class:`Run` over the loader's :class:`Flow`.

Shared by :class:`~loaders.ShardLoader` and :class:`~loaders.MixedLoader`. The loader holds its
options, its plan and where the next iteration starts (:class:`Position`); the run state lives
here: the flow of epochs through the pipeline (the reader's side), the thread iterating and the
batches each run has taken (the consumer's side). A loader says how to start a flow and how to
take one batch out of it; :class:`Iterations` does the rest (NOTE [ A loader's flow ],
NOTE [ One iterating thread ]).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lakeshard.errors import LoaderError
from loaders._internal.pipeline import Pipeline, Stream
from loaders._internal.shuffle_quality import ShuffleTally
from loaders._internal.source import ShardSource
from loaders.batch import BatchTask, SkippedRow
from loaders.stats import CostBudget, LoaderCounters, ReadCount

__all__ = ["EpochParts", "Flow", "Iterations", "Keyed", "Position", "Run", "decode_keyed"]

log = logging.getLogger(__name__)


class Keyed(NamedTuple):
    """A task for the decode threads: its key (``(source, epoch or pass, batch)``; ``source`` is
    -1 for a loader's own batches), the task and what decodes it (its epoch's decoding)."""

    key: tuple[int, int, int]
    task: BatchTask
    decode: Callable[[BatchTask, threading.Event], Any]


def decode_keyed(item: Keyed, stop: threading.Event) -> tuple[tuple[int, int, int], Any] | None:
    """Decode one task (on a decode thread): its key and its batch (``None`` if stopped)."""
    batch = item.decode(item.task, stop)
    return None if batch is None else (item.key, batch)


@dataclass
class EpochParts:
    """What one epoch of a flow counts apart: its reads (one a source), bad rows and shuffle."""

    reads: list[ReadCount]
    skipped: list[SkippedRow] = field(default_factory=list)
    shuffle: ShuffleTally = field(default_factory=ShuffleTally)


# NOTE [ A loader's flow ]
#
# A loader's epochs run as one stream through its pipeline (a "flow"): the reader thread walks
# epoch e from the batch the iteration starts at, then, when the flow goes ``onward``, each next
# epoch from its first batch, at this world size. The consumer takes exactly the epoch's batches
# and leaves the rest in the flow, so the next epoch's first batches are read and decoded while
# this one's last are consumed (the pipeline's queue bounds how far ahead: ``prefetch + 2``
# batches, whichever epoch they belong to). An iteration takes the flow over only where it
# stands: the next epoch, from its first batch, not resumed at another world size; anything
# else (a jump, the same epoch again, a restored state, an iteration while another one is under
# way) closes it and starts another (the older iteration's iterator then raises LoaderError; its
# end touches nothing of the new one). A flow goes onward only once the loop has made a step of
# one epoch (a first iteration may be the loader's only one) and while no shard cache is being
# filled (the next epoch then reads the cache's files). Each epoch of a flow counts its reads,
# bad rows and shuffle apart (``Flow.parts``): made by whichever side asks first.
@dataclass(eq=False)
class Flow:
    """A loader's epochs as one stream through its pipeline (NOTE [ A loader's flow ]):
    ``stream`` (the pipeline's), ``at`` (the epoch and batch its consumer takes next), whether
    it goes on into the next epochs, and each epoch's parts."""

    at: tuple[int, int]
    onward: bool
    sources: int = 1
    stream: Stream[Any, Any] = field(init=False)
    idle: bool = False  # between two epochs: the last iteration ended, the next may take it over
    _parts: dict[int, EpochParts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def parts(self, epoch: int) -> EpochParts:
        """Epoch ``epoch``'s parts; earlier epochs' are dropped."""
        with self._lock:
            for old in [e for e in self._parts if e < epoch - 1]:
                del self._parts[old]
            if epoch not in self._parts:
                self._parts[epoch] = EpochParts([ReadCount() for _ in range(self.sources)])
            return self._parts[epoch]


@dataclass
class Position:
    """Where a loader stands: the epoch :meth:`set_epoch` selected, the batch its next iteration
    starts at (a restored state's), the batches of the epoch consumed so far, and whether an
    iteration has started from a restored position (a later one starts the epoch afresh)."""

    epoch: int = 0
    start: int = 0
    consumed: int = 0
    resumed_used: bool = False

    def select(self, epoch: int) -> bool:
        """Select ``epoch``; ``True`` if it is another one (its position starts at 0)."""
        if epoch == self.epoch:
            return False
        self.epoch, self.start, self.consumed = epoch, 0, 0
        return True

    def restore(self, epoch: int, consumed: int) -> None:
        self.epoch, self.start, self.consumed = epoch, consumed, consumed
        self.resumed_used = False


@dataclass(eq=False)
class Run:
    """One iteration: the batches of ``epoch`` from ``consumed`` (the next one it takes) up to
    ``end`` out of ``flow``; its epoch's parts; what else the loader's consumer side walks
    (``side``: a mixture's needs and the batch in hand)."""

    epoch: int
    consumed: int
    end: int
    flow: Flow
    parts: EpochParts
    side: Any = None


@dataclass(frozen=True, eq=False)
class _Claim:
    """An iteration's claim on its loader (NOTE [ One iterating thread ]); compared by identity."""

    thread: threading.Thread


# NOTE [ One iterating thread ]
#
# A loader yields its batches to one thread at a time. An iteration claims the loader (its
# thread and a token of its own) at its first ``next()``, under ``_lock``, and gives it back when
# it ends (its last batch, a ``break``, an error) if the claim is still its own. Another
# iteration on the same thread replaces the claim, and its ``iter()`` closes the flow of the
# iteration under way (whose iterator then raises LoaderError); an iteration on another thread
# while a live thread holds the claim raises LoaderError at once, in ``iter()`` or at its first
# ``next()``, and touches nothing of the running one. ``close()`` drops the claim (a thread that
# holds an unfinished iterator gets LoaderError on its next ``next()``: its stream is closed). A
# claim whose thread has exited is void.
class Iterations:
    """A loader's run state between its iterations: the flow running through ``pipeline``, the
    claim of the thread iterating, the epoch the last iteration ran. ``what``/``kind`` name the
    loader in messages (``"loader"``/``"ShardLoader"``), ``where`` its channel and rank."""

    def __init__(
        self,
        pipeline: Pipeline[Any, Any],
        sources: Sequence[ShardSource],
        counters: LoaderCounters,
        budget: CostBudget,
        *,
        what: str,
        kind: str,
        where: tuple[str, int],
    ) -> None:
        self.pipeline, self.sources, self.counters, self.budget = pipeline, sources, counters, budget
        self.what, self.kind, self.where = what, kind, where
        self.flow: Flow | None = None
        self.last_epoch: int | None = None  # the epoch the last iteration ran
        self._claim: _Claim | None = None
        self._lock = threading.Lock()

    def looping(self, epoch: int) -> bool:
        """Whether an iteration of ``epoch`` is a step of one from the last one (then its flow
        goes onward); remembers ``epoch`` as the last."""
        looping = self.last_epoch is not None and epoch - self.last_epoch == 1
        self.last_epoch = epoch
        return looping

    def fills_cache(self) -> bool:
        return any(src.fills_cache() for src in self.sources)

    def take_over(self, at: tuple[int, int], *, allowed: bool = True) -> Flow | None:
        """The flow if it stands idle at ``at`` (and ``allowed``), taken over; else ``None``,
        the flow closed (NOTE [ A loader's flow ])."""
        flow = self.flow
        if flow is not None and flow.idle and flow.at == at and allowed:
            flow.idle = False
            return flow
        self.drop()
        return None

    def drop(self) -> None:
        """Close the flow (its threads live on for the next)."""
        flow, self.flow = self.flow, None
        if flow is not None:
            flow.stream.close()

    def start(
        self,
        flow: Flow,
        tasks: Iterator[Keyed],
        stop: threading.Event,
    ) -> Flow:
        """Run ``tasks`` (which watch ``stop``) through the pipeline as ``flow``."""
        flow.stream = self.pipeline.start(tasks, decode_keyed, stop=stop)
        self.flow = flow
        return flow

    def iterate(
        self, begin: Callable[[], Run], take: Callable[[Run], Any], position: Position
    ) -> Iterator[Any]:
        """An iteration (a generator): claims the loader at its first ``next()``, ``begin()``s a
        run, yields ``take(run)`` until the run's end, and ends it."""
        claim = _Claim(threading.current_thread())
        with self._lock:
            self._check(claim.thread)
            self._claim = claim
        try:
            run = begin()
        except BaseException:
            self._release(claim)
            raise
        finished = False
        counters, budget = self.counters, self.budget
        try:
            while run.consumed < run.end:
                asked = time.perf_counter()
                batch = take(run)
                counters.wait_s += time.perf_counter() - asked
                run.consumed += 1
                position.consumed += 1
                counters.batches += 1
                budget.check(counters.iteration, epoch=run.epoch, consumed=position.consumed, batches=run.end)
                yield batch
            finished = True
            for src in self.sources:
                src.epoch_ended()  # every read of the epoch is in: a cache fill takes the rest now
        finally:
            self._end(run, claim, finished)

    def _end(self, run: Run, claim: _Claim, finished: bool) -> None:
        flow = run.flow
        current = self.flow is flow  # not replaced by a later iteration meanwhile
        if finished and flow.onward and current:  # it runs on into the next epoch
            flow.at, flow.idle = (run.epoch + 1, 0), True
        else:
            flow.stream.close()
            if current:
                self.flow = None
        self._release(claim)
        if (
            current and not finished
        ):  # a break or an error: stop every thread (a later iteration makes new ones)
            self.stop()
        if run.parts.skipped:
            log.warning(
                "skipped %d bad rows of channel %r in epoch %d (rank %d)",
                len(run.parts.skipped),
                self.where[0],
                run.epoch,
                self.where[1],
            )

    def next_decoded(self, run: Run) -> Any:
        """The next decoded item of ``run``'s flow (an error if the flow ended before the plan)."""
        item = run.flow.stream.next()
        if item is None:
            raise LoaderError(
                f"the {self.what}'s pipeline ended before its plan (a source gave fewer batches)"
            )
        return item

    def check_thread(self) -> None:
        """At ``iter()``: refuse another live thread's iteration; close the flow of an iteration
        under way (NOTE [ One iterating thread ])."""
        with self._lock:
            self._check(threading.current_thread())
        if self.flow is not None and not self.flow.idle:
            self.drop()

    def _check(self, caller: threading.Thread) -> None:
        claim = self._claim
        if claim is not None and claim.thread is not caller and claim.thread.is_alive():
            raise LoaderError(
                f"this {self.what} is being iterated by thread {claim.thread.name!r}, so thread "
                f"{caller.name!r} cannot iterate it: a {self.kind} yields its batches to one thread at a "
                f"time. Finish or break out of that loop (or call close()) first, or make one loader per "
                f"thread"
            )

    def _release(self, claim: _Claim) -> None:
        with self._lock:
            if self._claim is claim:
                self._claim = None

    def stop(self, *, final: bool = False) -> None:
        """Stop every thread (a later iteration makes new ones); ``final``: the loader is gone,
        close its cache files too."""
        self.pipeline.close()
        for src in self.sources:
            src.stop(final=final)
        self.flow = None

    def close(self) -> None:
        """Stop every thread and drop the claim."""
        self.stop()
        with self._lock:
            self._claim = None
