"""``ShardLoader``: stream one rank's share of a channel's Parquet shards as torch batches.

```python
loader = ShardLoader("s3://lake/datasets/pets-v1", channel="train", rank=rank, world_size=world,
                     batch_size=64, shuffle=True, seed=7)
for epoch in range(epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:   # uint8 [B, 3, H, W] and int64 [B]
        ...
```

Which rows a rank reads and how many batches it yields: :mod:`loaders._internal.plan`. The order within
an epoch: :mod:`loaders._internal.shuffle`. The threads: :mod:`loaders._internal.pipeline`; remote reads:
:mod:`loaders._internal.fetch`; the shard cache: :mod:`loaders._internal.cache`. The options:
:mod:`loaders.options`. The reader thread (windows of row groups in, batch tasks out):
:mod:`loaders._internal.window_reader`. The files: :mod:`lakeshard.format`.

State (``state_dict()``, :mod:`loaders._internal.state`) is the same on every rank, so rank 0's copy
resumes them all, at this world size or any other (:mod:`loaders._internal.elastic`): at another one the
per-rank batch size must keep the global batch (``world_size * batch_size``) the same, and the
rest of the interrupted epoch is dealt evenly to the new ranks. ``load_state_dict`` refuses a
state saved on another dataset version or with different order settings (``shuffle``, ``seed``,
``drop_last``, ``remainder``, ``shuffle_window``: they would give other rows); ``num_threads``,
``prefetch``, the reads, the cache and the rank may differ.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lakeshard.errors import LoaderError
from loaders._internal.batch_decoding import BatchDecoding, check_decoding, resolve_collate, resolve_transform
from loaders._internal.buffers import BufferPool
from loaders._internal.cache import ShardCache
from loaders._internal.elastic import Leg
from loaders._internal.epoch_reads import EpochPlan
from loaders._internal.facade import Facade, open_prep, runs_for, shutdown
from loaders._internal.fetch import RangeFetcher
from loaders._internal.pipeline import PipelineStats
from loaders._internal.plan import rows_per_rank
from loaders._internal.prep import PrepCluster
from loaders._internal.rank_flow import rank_reader, start_flow
from loaders._internal.run import Flow, Position, Run
from loaders._internal.shuffle_quality import ShuffleTally
from loaders._internal.source import ShardSource
from loaders._internal.state import STATE_FORMAT, check_global_batch, read_state, state_dict
from loaders._internal.window_reader import WindowReader
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
from loaders.stats import CostBudget, LoaderCounters, LoaderStats, PriceTable

__all__ = ["STATE_FORMAT", "LoaderOptions", "ShardLoader", "default_threads"]

log = logging.getLogger(__name__)


class ShardLoader(Facade):
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

    Threads: made on the first iteration and kept across epochs; a ``break``, an error,
    :meth:`close` or garbage collection stops them (a later iteration makes new ones). In a
    ``set_epoch(e); for batch in loader`` loop the epochs run as one stream (NOTE [ A loader's
    flow ] in :mod:`loaders._internal.run`). One thread at a time iterates a loader (NOTE [ One
    iterating thread ]). Remote shards: footers read once, by the constructor; row groups
    fetched as byte ranges, with ``cache_dir`` cached on local disk (docs/loader.md, "Remote
    datasets"). The same seed and epoch give the same batches, local or remote, cached or not.
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        *,
        options: LoaderOptions | None = None,
        # The common options (loaders.options.LoaderOptions); then each group, or its options by name.
        channel: str = DEFAULT, rank: int = DEFAULT, world_size: int = DEFAULT, batch_size: int = DEFAULT,
        shuffle: bool = DEFAULT, seed: int = DEFAULT,
        drop_last: bool = DEFAULT, remainder: str = DEFAULT,
        shuffle_window: int = DEFAULT, num_threads: int | None = DEFAULT, prefetch: int = DEFAULT,
        pin_memory: bool = DEFAULT, skip_bad_rows: bool = DEFAULT,
        reads: RemoteReads | None = None, read_concurrency: int = DEFAULT,
        memory_budget: int | str | None = DEFAULT, cache_dir: str | os.PathLike[str] | None = DEFAULT,
        cache_limit: int | str = DEFAULT,
        decoding: Decoding | None = None, decoder: str = DEFAULT,
        transform: Callable[..., Any] | str | None = DEFAULT,
        collate: Callable[..., Any] | str | None = DEFAULT,
        augment: bool = DEFAULT, crop: int | None = DEFAULT, normalize: Normalize | None = DEFAULT,
        preparation: Preparation | None = None, prep: str | None = DEFAULT, prep_timeout: float = DEFAULT,
        prep_fallback: bool = DEFAULT, prep_security: Any = DEFAULT,
        cost: Cost | None = None, prices: PriceTable | None = DEFAULT, cost_budget: float | None = DEFAULT,
        on_budget: str = DEFAULT,
    ) -> None:  # fmt: skip
        # locals() is the parameters here: the options given, the others DEFAULT.
        self.options = opts = LoaderOptions.given(options, locals())
        self.source = source = ShardSource(dataset, opts.channel)
        self.dataset, self.info = source.dataset, source.info
        self.dataset_version = self.info.dataset_version
        self.num_classes = self.info.num_classes
        self.image_size = self.info.image.size
        check_decoding(opts, self.info, self.dataset)
        if opts.pin_memory and not torch.cuda.is_available():
            log.info("pin_memory=True ignored: CUDA is not available")
        self.shard_uris = source.shard_uris
        self.total_rows = source.total_rows
        name = f"lakeshard-r{opts.rank}"
        self._reader = rank_reader(source, opts, name)
        self.rows_per_rank, self._num_batches = self._reader.rows_per_rank, self._reader.num_batches
        self._position = Position()
        self._resumed: _ResumedEpoch | None = None  # the epoch resumed at another world size, if it is
        self._run: Run | None = None  # the current (or last) iteration
        self.stats, self.counters = PipelineStats(), LoaderCounters(source.requests)
        prices = opts.price_table(self.dataset)  # prices=None: the dataset's store's
        self._budget = CostBudget(
            opts.cost_budget, opts.on_budget, prices, rank=opts.rank, dataset=self.dataset
        )
        # Blocks in use at once: one per decode thread, ``prefetch`` queued, the one the reader
        # holds, the one being handed over and the training loop's previous batch.
        blocks = opts.decode_threads + opts.prefetch + 3
        self._runs = runs_for(opts, [source], self.counters, self._budget, what="loader", kind="ShardLoader")
        self._prep: PrepCluster | None = None
        try:
            self._start_io(blocks, name)
        except BaseException:
            self._runs.stop(final=True)
            raise
        self._decoding = self._batch_decoding_of(BufferPool(keep=blocks))
        # The threads stop when the loader is closed, or garbage-collected unclosed.
        self._finalizer = weakref.finalize(self, shutdown, self._runs, self._prep)

    def _batch_decoding_of(self, buffers: BufferPool) -> BatchDecoding:
        """How this loader's batch tasks are decoded (into ``buffers``)."""
        transform, reference = resolve_transform(self.options)
        return BatchDecoding(
            self.options,
            image_size=self.image_size,
            num_classes=self.num_classes,
            shard_uris=self.shard_uris,
            rank=self.options.rank,
            transform=transform,
            transform_ref=reference,
            buffers=buffers,
            tally=self.counters.tally,
            prep=self._prep,
            task=self.info.task,
            collate=resolve_collate(self.options),
        )

    def _start_io(self, blocks: int, name: str) -> None:
        """Start the remote reads (their budget beside ``blocks`` decoded batches), the shard
        cache and the preparation cluster's client, as the options say."""
        opts, source = self.options, self.source
        fetcher = source.start_reads(concurrency=opts.read_plan.in_flight, name=name)
        if fetcher is not None:
            fetcher.budget = self._reader.ranges.read_budget(
                blocks=blocks, image_size=self.image_size, dataset=self.dataset
            )
            if opts.cache_dir is not None:
                source.open_cache(opts.cache_dir, limit=opts.cache_limit_bytes)
        self._prep = open_prep(opts)

    @property
    def fetcher(self) -> RangeFetcher | None:
        """The ranged reads of remote shards (``None``: every shard is local)."""
        return self.source.fetcher

    @property
    def cache(self) -> ShardCache | None:
        """The shard cache of remote shards (``None``: no ``cache_dir``, or a local dataset)."""
        return self.source.cache

    @property
    def reader(self) -> WindowReader:
        """What this rank reads (its pieces, each epoch's plan, the remote byte ranges) and the
        reader thread's work: windows of row groups in, batch tasks out."""
        return self._reader

    @property
    def batch_decoding(self) -> BatchDecoding:
        """How the decode threads decode a batch task (decoder, transform, reused buffers)."""
        return self._decoding

    @property
    def peak_bytes_held(self) -> int:
        """The most bytes of remote reads held at once (0 for a local dataset); at most the
        reads' share of ``memory_budget``."""
        return self.source.peak_bytes_held

    @property
    def row_groups_read(self) -> int:
        """Row groups read by the current (or last) iteration."""
        return self.counters.reads[0].row_groups

    def plan(self, epoch: int) -> EpochPlan:
        """What this rank reads in epoch ``epoch`` started afresh: its pieces (row groups, or
        parts of them) and their order (no I/O)."""
        return self._reader.plan(epoch)

    # -- epochs and state --------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._resumed is not None:
            return self._resumed.plan.first_index + self._resumed.batches
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields. Keeps a position restored by
        :meth:`load_state_dict` if ``epoch`` is the restored epoch."""
        if self._select(epoch):
            self._resumed = None

    def state_dict(self) -> dict[str, Any]:
        opts = self.options
        resumed = self._resumed
        before = resumed.legs_before if resumed is not None else ()
        first = resumed.plan.first_index if resumed is not None else 0
        legs = [*before, Leg(opts.world_size, opts.batch_size, self._position.consumed - first)]
        return state_dict(
            dataset=self.dataset,
            dataset_version=self.dataset_version,
            channel=opts.channel,
            epoch=self._position.epoch,
            legs=legs,
            order=opts.order_key(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off: the next iteration (after ``set_epoch`` of the saved
        epoch, or none) yields exactly the batches that were still to come. A state saved at
        another world size needs the same global batch; the rest of its epoch is dealt evenly
        to this loader's world size (:mod:`loaders._internal.elastic`) for its next iteration (a later
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
        self._runs.take_over(
            (-1, -1)
        )  # close the flow before the plan: it may add remote shards to the reader
        if len(saved.legs) == 1 and last.world_size == opts.world_size:
            if not 0 <= consumed <= self._num_batches:
                raise LoaderError(f"batches_consumed must be in [0, {self._num_batches}], got {consumed!r}")
        else:
            # The same world size as the last leg continues it; another one starts a new leg.
            before = saved.legs[:-1] if last.world_size == opts.world_size else saved.legs
            current = last if last.world_size == opts.world_size else Leg(opts.world_size, opts.batch_size, 0)
            plan, batches = self._reader.resumed(saved.epoch, before, current)
            resumed = _ResumedEpoch(before, plan, batches)
        self._position.restore(saved.epoch, consumed)
        self._resumed = resumed

    # -- iteration (loaders._internal.run) -------------------------------------------------------------------
    def _begin(self) -> Run:
        """Begin an iteration of the epoch :meth:`set_epoch` selected, from the batch a restored
        state says: out of the running flow if it stands there, else out of a new one."""
        position = self._position
        if self._resumed is not None and position.resumed_used:  # the epoch again: afresh, at this world size
            self._resumed = None
        position.resumed_used = True
        start, position.start = position.start, 0
        position.consumed = start
        epoch, runs = position.epoch, self._runs
        first_iteration = runs.last_epoch is None
        looping = runs.looping(epoch)
        flow = runs.take_over((epoch, start), allowed=self._resumed is None)
        if flow is None:
            flow = self._new_flow(epoch, start, looping=looping, first_iteration=first_iteration)
        parts = flow.parts(epoch)
        plan = self._resumed.plan if self._resumed is not None else None
        first = start - (plan.first_index if plan else 0)
        self.counters.begin(parts.reads)
        self._budget.begin(self._planned_bytes(plan, first))
        if self.fetcher is not None:
            self.fetcher.peak_bytes_held = self.fetcher.held
        self.stats = flow.stream.stats
        self._run = Run(epoch, start, len(self), flow, parts)
        return self._run

    def _new_flow(self, epoch: int, start: int, *, looping: bool, first_iteration: bool) -> Flow:
        """A flow from batch ``start`` of ``epoch`` (NOTE [ A loader's flow ];
        :func:`loaders._internal.rank_flow.start_flow`)."""
        plan = self._resumed.plan if self._resumed is not None else None
        return start_flow(
            self._runs, self._reader, self._decoding, epoch=epoch, start=start, plan=plan,
            looping=looping, first_iteration=first_iteration,
        )  # fmt: skip

    def _take(self, run: Run) -> Any:
        key, batch = self._runs.next_decoded(run)
        if key != (-1, run.epoch, run.consumed):
            raise LoaderError(
                f"loader pipeline out of step: expected batch {run.consumed} of epoch {run.epoch}, got {key}"
            )
        return batch

    # -- statistics (loaders.stats) ----------------------------------------------------------------
    def _planned_bytes(self, plan: EpochPlan | None, first: int) -> int:
        """The remote bytes the iteration reads from batch ``first`` of ``plan`` (default: the
        epoch's own) on (only worked out when there is a cost budget)."""
        if not self._budget.active:
            return 0
        plan = plan or self._reader.plan(self._position.epoch)
        return self._reader.ranges.planned_bytes(plan, self._reader.batches(plan)[first:])

    def epoch_stats(self) -> LoaderStats:
        """What the current (or last) iteration cost on this rank (see :class:`LoaderStats`)."""
        shuffle = self._run.parts.shuffle if self._run is not None else ShuffleTally()
        return LoaderStats.of(
            self.counters.iteration(),
            epoch=self._position.epoch,
            peak_bytes_held=self.peak_bytes_held,
            prices=self._budget.prices,
            shuffle=shuffle.result(),
        )


@dataclass(frozen=True, slots=True)
class _ResumedEpoch:
    """An epoch resumed after a change of world size, in it or in an earlier resume
    (:mod:`loaders._internal.elastic`): its legs before the current one, what this rank reads in the
    current one and the batches it yields there."""

    legs_before: tuple[Leg, ...]
    plan: EpochPlan
    batches: int
