"""``ShardLoader``: stream one rank's share of a channel's Parquet shards as torch batches.

```python
loader = ShardLoader("s3://lake/datasets/pets-v1", channel="train", rank=rank, world_size=world,
                     batch_size=64, shuffle=True, seed=7)
for epoch in range(epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:   # uint8 [B, 3, H, W] and int64 [B]
        ...
```

Which rows a rank reads and how many batches it yields: :mod:`loaders.plan`. The order within
an epoch: :mod:`loaders.shuffle`. The threads: :mod:`loaders.pipeline`; remote reads:
:mod:`loaders.fetch`; the shard cache: :mod:`loaders.cache`. The options:
:mod:`loaders.options`. The reader thread (windows of row groups in, batch tasks out):
:mod:`loaders.window_reader`. The files: :mod:`lakeshard.format`.

State (``state_dict()``, :mod:`loaders.state`) is the same on every rank, so rank 0's copy
resumes them all, at this world size or any other (:mod:`loaders.elastic`): at another one the
per-rank batch size must keep the global batch (``world_size * batch_size``) the same, and the
rest of the interrupted epoch is dealt evenly to the new ranks. ``load_state_dict`` refuses a
state saved on another dataset version or with different order settings (``shuffle``, ``seed``,
``drop_last``, ``remainder``, ``shuffle_window``: they would give other rows); ``num_threads``,
``prefetch``, the reads, the cache and the rank may differ.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lakeshard.errors import ConfigError, LoaderError
from loaders.batch import BatchTask, SkippedRow
from loaders.batch_decoding import BatchDecoding, resolve_transform
from loaders.buffers import BufferPool
from loaders.cache import ShardCache
from loaders.dataset import ShardDataset
from loaders.elastic import EpochSettings, Leg, LegPlan, order_of
from loaders.fetch import RangeFetcher
from loaders.options import (
    DEFAULT,
    Cost,
    Decoding,
    LoaderOptions,
    Normalize,
    Preparation,
    RemoteReads,
    default_threads,
)
from loaders.pipeline import Epoch, Pipeline, PipelineStats
from loaders.plan import num_batches, rank_segments, rows_per_rank, split_pieces
from loaders.prep import PrepCluster
from loaders.shuffle_quality import ShuffleTally
from loaders.source import ShardSource
from loaders.state import STATE_FORMAT, check_global_batch, read_state, state_dict
from loaders.stats import CostBudget, LoaderCounters, LoaderStats, LoaderTotals, PriceTable, ReadCount
from loaders.window_reader import EpochPlan, WindowReader

__all__ = ["STATE_FORMAT", "LoaderOptions", "ShardLoader", "default_threads"]

log = logging.getLogger(__name__)


class ShardLoader:
    """Stream rank ``rank``'s share of channel ``channel`` of the dataset at ``dataset`` (a
    local path, ``file://`` or ``s3://`` URI) as ``(images, labels)`` batches.

    Args:
        dataset: the dataset root (the folder holding ``dataset.json``): a path (``str`` or
            :class:`os.PathLike`), a ``file://`` or an ``s3://`` URI.
        options: every option at once (a :class:`~loaders.options.LoaderOptions`); or the
            options as keywords, each by its name (``channel="train", batch_size=64,
            cache_dir=...``) or in its group (``reads=RemoteReads(cache_dir=...)``): the
            options table (:mod:`loaders.options`) says what each does and its default. An
            option left out is the library's default.

    The dataset is read as it was when the loader was made: every shard it opens, now or in a
    later epoch, must be the one that ``dataset.json`` described then (its footer names the
    dataset version); a dataset rebuilt since raises :class:`DatasetError` naming both versions
    (a remote shard replaced since fails its next ranged read: :class:`LoaderError`).

    ``len(loader)`` is the number of batches per epoch, the same on every rank, and every rank
    yields exactly that many. Rows labelled :data:`PAD_LABEL` must not count (CrossEntropyLoss
    ignores them by default). In an epoch resumed at another world size, ``len(loader)`` is the
    batches consumed before the resume plus the batches each rank yields after it (the same on
    every new rank), so an epoch still runs from ``state_dict()["batches_consumed"]`` to
    ``len(loader)``.

    Threads: made on the first iteration and kept across epochs (an epoch is a new order, not
    a new pipeline); a ``break`` out of an epoch, an error, :meth:`close` or the loader's
    garbage collection stops them all, and a later iteration makes new ones. One thread at a
    time iterates a loader: another thread's iteration meanwhile raises :class:`LoaderError`
    (NOTE [ One iterating thread ]).

    Remote shards (``s3://``): each footer is read once, by the constructor; each epoch fetches
    its row groups as byte ranges, ``read_concurrency`` at a time within ``memory_budget``
    (:mod:`loaders.fetch`), in the order it reads them, followed by the windows of the first
    batch of the epoch expected next (``epoch + 1``, unless the last two iterations ran other steps: none after
    the same epoch twice). With ``cache_dir`` the shards are also cached on local disk
    (:mod:`loaders.cache`) and read from there from the next epoch on. Batches do not depend on
    any of this: the same seed and epoch give the same batches, local or remote, cached or not.
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        *,
        options: LoaderOptions | None = None,
        channel: str = DEFAULT,
        rank: int = DEFAULT,
        world_size: int = DEFAULT,
        batch_size: int = DEFAULT,
        shuffle: bool = DEFAULT,
        seed: int = DEFAULT,
        drop_last: bool = DEFAULT,
        remainder: str = DEFAULT,
        shuffle_window: int = DEFAULT,
        num_threads: int | None = DEFAULT,
        prefetch: int = DEFAULT,
        pin_memory: bool = DEFAULT,
        skip_bad_rows: bool = DEFAULT,
        reads: RemoteReads | None = None,
        decoding: Decoding | None = None,
        preparation: Preparation | None = None,
        cost: Cost | None = None,
        read_concurrency: int = DEFAULT,
        memory_budget: int | str | None = DEFAULT,
        cache_dir: str | os.PathLike[str] | None = DEFAULT,
        cache_limit: int | str = DEFAULT,
        decoder: str = DEFAULT,
        transform: Callable[..., Any] | str | None = DEFAULT,
        augment: bool = DEFAULT,
        crop: int | None = DEFAULT,
        normalize: Normalize | None = DEFAULT,
        prep: str | None = DEFAULT,
        prep_timeout: float = DEFAULT,
        prep_fallback: bool = DEFAULT,
        prep_security: Any = DEFAULT,
        prices: PriceTable | None = DEFAULT,
        cost_budget: float | None = DEFAULT,
        on_budget: str = DEFAULT,
    ) -> None:
        # locals() is the parameters here: the options given, the others DEFAULT.
        self.options = opts = LoaderOptions.given(options, locals())
        self.source = source = ShardSource(dataset, opts.channel)
        self.dataset, self.info = source.dataset, source.info
        self.dataset_version = self.info.dataset_version
        self.num_classes = self.info.num_classes
        self.image_size = self.info.image.size
        if opts.crop is not None and opts.crop > self.image_size:
            raise ConfigError(f"crop must be at most the image size {self.image_size}, got {opts.crop!r}")
        if opts.pin_memory and not torch.cuda.is_available():
            log.info("pin_memory=True ignored: CUDA is not available")

        self.shard_uris = source.shard_uris
        self.total_rows = source.total_rows
        self.rows_per_rank = rows_per_rank(self.total_rows, opts.world_size, remainder=opts.remainder)
        segments = rank_segments(source.shard_rows, opts.world_size, opts.rank, remainder=opts.remainder)
        # Footers are read once per loader: a remote shard's is kept (with its size and ETag) for the
        # ranged reads of every epoch.
        name = f"lakeshard-r{opts.rank}"
        groups = source.read_footers(
            sorted({seg.shard for seg in segments}), concurrency=opts.read_plan.footer_threads, name=name
        )
        self._num_batches = num_batches(self.rows_per_rank, opts.batch_size, drop_last=opts.drop_last)
        if self._num_batches == 0:
            raise ConfigError(
                f"batch_size {opts.batch_size} with drop_last=True leaves no batch: each of {opts.world_size} "
                f"ranks reads {self.rows_per_rank} rows of channel {opts.channel!r} of {self.dataset}"
            )
        self._reader = WindowReader(
            source,
            opts,
            pieces=split_pieces(segments, groups),
            num_batches=self._num_batches,
            rows_per_rank=self.rows_per_rank,
        )

        self._epoch = 0
        self._next_start = 0  # the batch the next iteration starts at (set by load_state_dict)
        self._consumed = 0  # batches of self._epoch consumed so far (by every leg)
        self._resumed: _ResumedEpoch | None = None  # self._epoch resumed at another world size, if it is
        self._resumed_used = False  # an iteration has started from self._resumed
        self._running: Epoch[BatchTask, Any] | None = None
        self._started_early: _EpochStartedEarly | None = None  # the next epoch, started before its iteration
        self._last_iter_epoch: int | None = None  # the epoch the last iteration ran
        self._lock = threading.Lock()
        self._owner: _Owner | None = None  # the iteration running (or last started) and its thread
        self.skipped_rows: list[SkippedRow] = []
        # Counters (loaders.stats): over the loader's life, and where the current iteration began.
        self.counters = LoaderCounters(source.requests)
        self._shuffle = ShuffleTally()
        self._budget = CostBudget(
            opts.cost_budget, opts.on_budget, opts.price_table, rank=opts.rank, dataset=self.dataset
        )
        # Blocks in use at once: one per decode thread, ``prefetch`` queued, the one the reader
        # holds, the one being handed over and the training loop's previous batch.
        blocks = opts.decode_threads + opts.prefetch + 3
        self._buffers = BufferPool(keep=blocks)
        self.stats = PipelineStats()
        self._prep: PrepCluster | None = None
        self._pipeline: Pipeline[BatchTask, Any] = Pipeline(
            num_threads=opts.decode_threads, prefetch=opts.prefetch, name=name
        )
        try:
            fetcher = source.start_reads(concurrency=opts.read_plan.in_flight, name=name)
            if fetcher is not None:
                fetcher.budget = self._reader.read_budget(
                    blocks=blocks, image_size=self.image_size, dataset=self.dataset
                )
                if opts.cache_dir is not None:
                    source.open_cache(opts.cache_dir, limit=opts.cache_limit_bytes)
            if opts.prep is not None:
                self._prep = PrepCluster(
                    opts.prep,
                    timeout_s=opts.prep_timeout,
                    fallback=opts.prep_fallback,
                    security=opts.prep_security,
                )
        except BaseException:
            _shutdown(self._pipeline, source, True)
            raise
        transform, reference = resolve_transform(opts)
        self._decoding = BatchDecoding(
            opts,
            image_size=self.image_size,
            num_classes=self.num_classes,
            shard_uris=self.shard_uris,
            rank=opts.rank,
            transform=transform,
            transform_ref=reference,
            buffers=self._buffers,
            tally=self.counters.tally,
            prep=self._prep,
        )
        # The threads stop when the loader is closed, or garbage-collected unclosed.
        self._finalizer = weakref.finalize(self, _shutdown, self._pipeline, source, True, self._prep)

    @property
    def fetcher(self) -> RangeFetcher | None:
        """The ranged reads of remote shards (``None``: every shard is local)."""
        return self.source.fetcher

    @property
    def cache(self) -> ShardCache | None:
        """The shard cache of remote shards (``None``: no ``cache_dir``, or a local dataset)."""
        return self.source.cache

    @property
    def peak_bytes_held(self) -> int:
        """The most bytes of remote reads held at once (0 for a local dataset); at most the
        reads' share of ``memory_budget``."""
        return self.source.peak_bytes_held

    @property
    def row_groups_read(self) -> int:
        """Row groups read by the current (or last) iteration."""
        return self.counters.reads[0].row_groups

    # -- epochs and state --------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._resumed is not None:
            return self._resumed.plan.first_index + self._resumed.batches
        return self._num_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields. Keeps a position restored by
        :meth:`load_state_dict` if ``epoch`` is the restored epoch."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self._epoch:
            self._epoch, self._next_start, self._consumed = epoch, 0, 0
            self._resumed = None

    def state_dict(self) -> dict[str, Any]:
        opts = self.options
        resumed = self._resumed
        before = resumed.legs_before if resumed is not None else ()
        first = resumed.plan.first_index if resumed is not None else 0
        legs = [*before, Leg(opts.world_size, opts.batch_size, self._consumed - first)]
        return state_dict(
            dataset=self.dataset,
            dataset_version=self.dataset_version,
            channel=opts.channel,
            epoch=self._epoch,
            legs=legs,
            order=opts.order_key(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off: the next iteration (after ``set_epoch`` of the saved
        epoch, or none) yields exactly the batches that were still to come. A state saved at
        another world size needs the same global batch; the rest of its epoch is dealt evenly
        to this loader's world size (:mod:`loaders.elastic`) for its next iteration (a later
        iteration of the same epoch starts it afresh, as after a same-size resume).

        Raises:
            DatasetError: the state was saved on another dataset version.
            LoaderError: not a loader state, other order settings, or another global batch
                (naming the batch size or the world sizes that would keep it).
        """
        opts = self.options
        saved = read_state(
            state,
            dataset=self.dataset,
            dataset_version=self.dataset_version,
            channel=opts.channel,
            order=opts.order_key(),
            rows_per_rank=lambda w: rows_per_rank(self.total_rows, w, remainder=opts.remainder),
        )
        last = saved.legs[-1]
        check_global_batch(last, world_size=opts.world_size, batch_size=opts.batch_size)
        consumed = saved.batches_consumed
        resumed = None
        self._stop_pipeline()  # before the plan: it may add remote shards to the reader
        if len(saved.legs) == 1 and last.world_size == opts.world_size:
            if not 0 <= consumed <= self._num_batches:
                raise LoaderError(f"batches_consumed must be in [0, {self._num_batches}], got {consumed!r}")
        else:
            # The same world size as the last leg continues it; another one starts a new leg.
            before = saved.legs[:-1] if last.world_size == opts.world_size else saved.legs
            current = last if last.world_size == opts.world_size else Leg(opts.world_size, opts.batch_size, 0)
            resumed = self._resume_leg(saved.epoch, before, current)
        self._epoch, self._next_start, self._consumed = saved.epoch, consumed, consumed
        self._resumed, self._resumed_used = resumed, False

    def _resume_leg(self, epoch: int, before: tuple[Leg, ...], current: Leg) -> _ResumedEpoch:
        """What this rank reads in leg ``current`` of ``epoch``, after the legs ``before``, and its
        batches. Reads the footers of the shards other ranks read before (once each; a remote one
        is kept for the ranged reads)."""
        opts = self.options
        legs = [*before, current]
        settings = EpochSettings(
            shard_rows=tuple(self.source.shard_rows),
            row_groups=self.source.footers,
            shuffle=opts.shuffle,
            seed=opts.seed,
            epoch=epoch,
            window_rows=opts.shuffle_window,
            drop_last=opts.drop_last,
            remainder=opts.remainder,
        )
        legs_plan = LegPlan(settings, legs)
        n = len(legs) - 1
        read = order_of(legs_plan.sequence(n, opts.rank))
        if self.fetcher is not None:
            self._fit_budget(self.fetcher, self._reader.max_range_bytes(read.pieces))
        tag = ("legs", tuple((leg.world_size, leg.batch_size, leg.batches) for leg in before))
        plan = EpochPlan(
            read.pieces, read.order, legs_plan.end(n), first_index=legs_plan.batches_before(n), tag=tag
        )
        return _ResumedEpoch(before, plan, legs_plan.num_batches(n))

    def _fit_budget(self, fetcher: RangeFetcher, largest: int) -> None:
        """Let the fetcher's budget hold row groups of ``largest`` bytes (other ranks' shards)."""
        opts = self.options
        if opts.memory_budget is None:
            fetcher.budget = max(fetcher.budget, opts.read_plan.in_flight * largest)
        elif fetcher.budget < largest:
            raise ConfigError(
                f"memory_budget {opts.memory_budget} bytes leaves {fetcher.budget} for reads, less than one row group "
                f"of {largest} bytes of the shards this rank resumes from; raise memory_budget"
            )

    # -- iteration ---------------------------------------------------------------------------------
    # NOTE [ One iterating thread ]
    #
    # A loader yields its batches to one thread at a time. ``_run`` claims the loader (``_owner``:
    # its thread and a token of its own) at its first ``next()``, under ``_lock``, and gives it
    # back when it ends (its last batch, a ``break``, an error) if the claim is still its own.
    # Another iteration on the same thread replaces the claim, and its ``__iter__`` closes the
    # running epoch (whose iterator then raises LoaderError, as it always has); an iteration on
    # another thread while a live thread holds the claim raises LoaderError at once, in
    # ``__iter__`` or at its first ``next()``, and touches nothing of the running epoch.
    # ``close()`` drops the claim (a thread that holds an unfinished iterator gets LoaderError on
    # its next ``next()``: its epoch is closed). A claim whose thread has exited is void.
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Not the epoch started early: the new iteration may be it.
        self._stop_running(caller=threading.current_thread())
        return self._run()

    def _check_owner(self, caller: threading.Thread) -> None:
        """Raise :class:`LoaderError` if a live thread other than ``caller`` iterates this loader
        (under ``_lock``; NOTE [ One iterating thread ])."""
        owner = self._owner
        if owner is not None and owner.thread is not caller and owner.thread.is_alive():
            raise LoaderError(
                f"this loader is being iterated by thread {owner.thread.name!r}, so thread "
                f"{caller.name!r} cannot iterate it: a ShardLoader yields its batches to one thread at a "
                f"time. Finish or break out of that loop (or call close()) first, or make one loader per "
                f"thread"
            )

    def _start(self) -> Epoch[BatchTask, Any]:
        """Start the epoch :meth:`set_epoch` selected, from the batch a restored state says: the
        one started early, if it is that epoch from its first batch, else a new one."""
        if self.cache is not None:  # shards cached since the last epoch are read from disk now
            self.source.epoch_starts(
                name=f"lakeshard-r{self.options.rank}",
                expected=self._reader.remote_ranges(),
                settle_s=_SETTLE_S,
            )
        start, self._next_start = self._next_start, 0
        if self._resumed is not None and self._resumed_used:  # the epoch again: afresh, at this world size
            self._resumed = None
        self._resumed_used = True
        self._consumed = start
        # The epoch expected next, whose first batch's windows are fetched after this epoch's reads
        # (remote shards): epoch + 1 on the first iteration and after a step of one (the
        # set_epoch(epoch + 1) loop). The same epoch again (a validation loader) or a jump reads
        # nothing ahead. Once the loop has made a step of one, the expected epoch is also started
        # early (its first batches decoded while this one's last are consumed); not on a first
        # iteration, which may be a loader's only one.
        looping = self._last_iter_epoch is not None and self._epoch - self._last_iter_epoch == 1
        ahead = self._epoch + 1 if looping or self._last_iter_epoch is None else None
        if self.source.fills_cache():
            ahead = None  # this epoch's reads fill the cache: the next one reads its files, not the store
        self._last_iter_epoch = self._epoch
        early, self._started_early = self._started_early, None
        if (
            early is not None
            and early.epoch == self._epoch
            and start == 0
            and self._resumed is None
            and self._pipeline.promote(early.run)
        ):
            early.promoted.set()
            self._begin(early.reads, early.shuffle, self._planned_bytes(None, 0))
            epoch, self.skipped_rows = early.run, early.skipped
        else:
            if early is not None:
                early.run.close()
            self.skipped_rows = []
            plan = self._resumed.plan if self._resumed is not None else None
            first = start - (plan.first_index if plan else 0)
            self._begin(ReadCount(), ShuffleTally(), self._planned_bytes(plan, first))
            stop = threading.Event()
            tasks = self._reader.tasks(self._epoch, first, stop, ahead, plan, reads=self.counters.reads[0])
            tasks = _tallied(tasks, self._shuffle, self.source.shard_rows, self.source.groups)
            epoch = self._pipeline.start(
                tasks, self._decoding.for_epoch(self._epoch, self.skipped_rows), stop=stop
            )
        if looping and self._resumed is None:
            self._started_early = self._start_early(self._epoch + 1)
        with self._lock:
            self._running = epoch
        self.stats = epoch.stats
        return epoch

    def _start_early(self, epoch: int) -> _EpochStartedEarly:
        """Epoch ``epoch`` from its first batch, to run after the current one (see
        :meth:`loaders.pipeline.Pipeline.start_next`): its first batches are decoded while this
        one's last are consumed, from row groups already read; it reads more once it is promoted
        to the current epoch."""
        skipped: list[SkippedRow] = []
        reads, stop, promoted, shuffle = ReadCount(), threading.Event(), threading.Event(), ShuffleTally()
        tasks = self._reader.tasks(epoch, 0, stop, epoch + 1, promoted=promoted, reads=reads)
        run = self._pipeline.start_next(
            _tallied(tasks, shuffle, self.source.shard_rows, self.source.groups),
            self._decoding.for_epoch(epoch, skipped),
            stop=stop,
        )
        return _EpochStartedEarly(epoch, run, promoted, skipped, reads, shuffle)

    def _run(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The epoch starts at the first next(), not at iter(): a set_epoch() between the two
        # counts (PyTorch Lightning calls iter() on a resumed run before on_train_epoch_start).
        me = _Owner(threading.current_thread())
        with self._lock:
            self._check_owner(me.thread)
            self._owner = me
        try:
            epoch = self._start()
        except BaseException:
            self._release(me)
            raise
        finished = False
        try:
            while True:
                asked = time.perf_counter()
                batch = epoch.next()
                self.counters.wait_s += time.perf_counter() - asked
                if batch is None:
                    break
                self._consumed += 1
                self.counters.batches += 1
                self._budget.check(
                    self.counters.iteration,
                    epoch=self._epoch,
                    consumed=self._consumed,
                    batches=len(self),
                )
                yield batch
            finished = True
            self.source.epoch_ended()  # every read of the epoch is in: a cache fill takes the rest now
        finally:
            epoch.close()
            with self._lock:
                current = self._running is epoch
                if current:
                    self._running = None
            self._release(me)
            # An epoch run to its end keeps the threads for the next one; a break (or an error)
            # out of the loop that is still this loader's latest epoch stops them all.
            if current and not finished:
                _shutdown(self._pipeline, self.source)
            if self.skipped_rows:
                log.warning(
                    "skipped %d bad rows of channel %r in epoch %d (rank %d)",
                    len(self.skipped_rows),
                    self.options.channel,
                    self._epoch,
                    self.options.rank,
                )

    # -- statistics (loaders.stats) ----------------------------------------------------------------
    def _planned_bytes(self, plan: EpochPlan | None, first: int) -> int:
        """The remote bytes the iteration reads from batch ``first`` of ``plan`` (default: the
        epoch's own) on (only worked out when there is a cost budget)."""
        if not self._budget.active:
            return 0
        plan = plan or self._reader.plan(self._epoch)
        return self._reader.planned_bytes(plan, self._reader.batches(plan)[first:])

    def _begin(self, reads: ReadCount, shuffle: ShuffleTally, planned_bytes: int) -> None:
        """An iteration begins: its counters start from the loader's totals now; it reads
        ``planned_bytes`` from the store."""
        self.counters.begin([reads])
        self._shuffle = shuffle
        self._budget.begin(planned_bytes)
        if self.fetcher is not None:
            self.fetcher.peak_bytes_held = self.fetcher.held

    def totals(self) -> LoaderTotals:
        """The loader's counters over its life so far."""
        return self.counters.totals()

    def epoch_stats(self) -> LoaderStats:
        """What the current (or last) iteration cost on this rank (see :class:`LoaderStats`)."""
        return LoaderStats.of(
            self.counters.iteration(),
            epoch=self._epoch,
            peak_bytes_held=self.peak_bytes_held,
            prices=self.options.price_table,
            shuffle=self._shuffle.result(),
        )

    def close(self) -> None:
        """Stop every thread of the loader and wait for them (a later iteration makes new ones,
        on any thread)."""
        self._stop_pipeline()
        _shutdown(self._pipeline, self.source)
        if self._prep is not None:  # its client's threads too; the next epoch connects again
            self._prep.close()
        with self._lock:
            self._owner = None

    def _release(self, claim: _Owner) -> None:
        """End ``claim`` on the loader if it is still the current one."""
        with self._lock:
            if self._owner is claim:
                self._owner = None

    def _stop_running(self, *, caller: threading.Thread | None = None) -> None:
        """Close the running epoch; with ``caller``, only if no other thread iterates the loader."""
        with self._lock:
            if caller is not None:
                self._check_owner(caller)
            running, self._running = self._running, None
        if running is not None:
            running.close()

    def _stop_pipeline(self) -> None:
        """Stop the running epoch and the one started early."""
        self._stop_running()
        early, self._started_early = self._started_early, None
        if early is not None:
            early.run.close()

    def as_dataset(self) -> ShardDataset:
        """This loader as a :class:`torch.utils.data.IterableDataset` (see :mod:`loaders.dataset`):
        for ``DataLoader(ds, batch_size=None)`` (``num_workers=0``) or a Lightning
        ``train_dataloader()``."""
        return ShardDataset(self)

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tallied(
    tasks: Iterator[BatchTask], shuffle: ShuffleTally, shard_rows: list[int], groups: Mapping[int, list[int]]
) -> Iterator[BatchTask]:
    """``tasks``, each one's rows (storage position, row group) added to ``shuffle`` as the
    reader thread makes it. A function, not a method: the reader thread runs it, and a method
    would keep the loader alive from that thread (its threads stop when it is collected)."""
    starts = np.cumsum([0, *shard_rows])
    group_of: dict[int, np.ndarray] = {}  # shard -> the global row group of each of its rows

    def groups_of(shard: int, rows: np.ndarray) -> np.ndarray:
        if shard not in group_of:
            sizes = groups[shard]
            group_of[shard] = starts[shard] + np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
        return group_of[shard][rows]

    for task in tasks:
        shards, rows = task.shards, task.rows
        lo, hi = int(shards.min()), int(shards.max())  # most batches come from one shard
        if lo == hi:
            found = groups_of(lo, rows)
        else:
            found = np.empty(len(rows), dtype=np.int64)
            for shard in range(lo, hi + 1):
                at = shards == shard
                if at.any():
                    found[at] = groups_of(shard, rows[at])
        shuffle.add(starts[shards] + rows, found)
        yield task


#: How long an epoch's start waits for the cache to finish the file the last epoch filled (its
#: sha256 over the shard) before it reads the shard from the store instead.
_SETTLE_S = 5.0


def _shutdown(
    pipeline: Pipeline[BatchTask, Any],
    source: ShardSource,
    final: bool = False,
    prep: PrepCluster | None = None,
) -> None:
    """Stop every thread of a loader (a later epoch makes new ones); ``final``: it is gone, close
    its cache files and its preparation cluster's client too."""
    pipeline.close()
    source.stop(final=final)
    if final and prep is not None:
        prep.close()


@dataclass(frozen=True, eq=False)
class _Owner:
    """An iteration's claim on its loader (NOTE [ One iterating thread ]); compared by identity."""

    thread: threading.Thread


@dataclass(frozen=True)
class _EpochStartedEarly:
    """An epoch started before its iteration (:meth:`ShardLoader._start_early`): its pipeline
    epoch, the event set once the loader makes it the current epoch (from then on it reads more
    than what was read ahead for it), and its bad rows and reads."""

    epoch: int
    run: Epoch[BatchTask, Any]
    promoted: threading.Event
    skipped: list[SkippedRow]
    reads: ReadCount
    shuffle: ShuffleTally


@dataclass(frozen=True, slots=True)
class _ResumedEpoch:
    """An epoch resumed after a change of world size, in it or in an earlier resume
    (:mod:`loaders.elastic`): its legs before the current one, what this rank reads in the
    current one and the batches it yields there."""

    legs_before: tuple[Leg, ...]
    plan: EpochPlan
    batches: int
