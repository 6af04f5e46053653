"""``MixedLoader``: stream several datasets at once, each giving an exact share of every epoch.

```python
loader = MixedLoader([("s3://lake/datasets/pets-v3", 0.7), ("s3://lake/datasets/pets-hard", 0.3)],
                     channel="train", rank=rank, world_size=world, batch_size=64,
                     samples_per_epoch=100_000, shuffle=True, seed=7)
for epoch in range(epochs):
    loader.set_epoch(epoch)
    for images, labels in loader:   # labels in the union of the sources' label names
        ...
```

Which positions of which source each rank reads, and the order: :mod:`loaders._internal.mixing`. Each
source is a :class:`~loaders._internal.source.ShardSource` (its footers, reads and cache) cut into the
batches a world-size-1 loader of it would yield, decoded and transformed as that loader would;
all sources go through one pipeline (one reader thread, one pool of decode threads:
:mod:`loaders._internal.mix_pipeline`), and a batch is the rows the plan gives this rank from each source,
source after source. So the rows, their order and their augmentation draws depend only on
``(seed, epoch)`` and the legs of the epoch, never on which rank reads them or how fast.

State (``state_dict()``) is the same on every rank and resumes them all, at this world size or
another that keeps the global batch (``world_size * batch_size``), like a single dataset's:
the rest of an interrupted epoch is dealt evenly to the new ranks (:class:`~loaders._internal.mixing.MixPlan`).
``load_state_dict`` refuses a state saved with another list of sources, other weights, another
``samples_per_epoch``, other order settings, or on a source rebuilt since (naming it).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lakeshard.errors import ConfigError, DatasetError, LoaderError
from lakeshard.storage import RequestCounts
from loaders._internal.batch_decoding import BatchDecoding, check_decoding, resolve_collate
from loaders._internal.buffers import BufferPool
from loaders._internal.elastic import Leg
from loaders._internal.facade import Facade, open_prep, runs_for, shutdown
from loaders._internal.mix_inputs import (
    LABEL_POLICIES,
    alike,
    check_every_source_has_rows,
    label_space,
    normalised,
    parse_sources,
    positive_samples,
    relabelling,
    same_dataset,
    same_size,
)
from loaders._internal.mix_pipeline import (
    Assembler,
    MixSource,
    Need,
    mixture_batches,
    needs,
    relabelled,
    source_batches,
)
from loaders._internal.mix_sources import open_mix_sources
from loaders._internal.mix_state import MIX_ORDER, MixIdentity, mix_state_dict, read_mix_state
from loaders._internal.mixing import MixPlan, epoch_samples, shares
from loaders._internal.prep import PrepCluster
from loaders._internal.rank_flow import SETTLE_S
from loaders._internal.run import Flow, Keyed, Position, Run
from loaders._internal.source import ShardSource
from loaders.decode import NO_DECODER
from loaders.named_batch import Batch
from loaders.options import DEFAULT, Cost, Decoding, LoaderOptions, Normalize, Preparation, RemoteReads
from loaders.shard_loader import ShardLoader
from loaders.stats import CostBudget, LoaderCounters, LoaderStats, PriceTable

__all__ = ["LABEL_POLICIES", "Concatenated", "MixedLoader", "parse_sources", "relabelling", "same_dataset"]

log = logging.getLogger(__name__)


class MixedLoader(Facade):
    """Stream rank ``rank``'s share of a mixture of datasets as ``(images, labels)`` batches
    (``from loaders import MixedLoader``); a mixture of multi-label or boxes datasets (all of one
    task kind, with the same label columns) as :class:`~loaders.Batch` es (or what ``collate``
    makes of them, after the rows of the sources are joined), their classes in the label space.

    Args:
        sources: the datasets: URIs, each weighing its rows in ``channel``, or ``(URI, weight)``
            pairs (positive weights, normalised to sum to 1).
        samples_per_epoch: samples of an epoch over all ranks (default: the rows of every source
            in ``channel``), rounded down to a whole number of global batches
            (``world_size * batch_size``); :attr:`samples_per_epoch` is the number used.
        labels: ``"union"`` (default: one label space of every source's label names, sorted) or
            ``"same"`` (refuse sources whose label names differ).
        options: the options of :class:`~loaders.ShardLoader` (``channel``, ``rank``,
            ``world_size``, ``batch_size``, ``shuffle``, ``seed``, threads, reads, cache,
            transform), all at once or as keywords, as ``ShardLoader`` takes them. The sources share ``num_threads`` decode threads; ``memory_budget`` is
            shared out among the sources by weight; ``cost_budget`` is one budget for the
            whole mixture on this rank. ``drop_last`` and ``remainder`` do not apply: every
            batch is full. A ``transform`` must keep each batch's rows (a mixture takes each
            source's rows by position).

    Each epoch holds ``shares(weights, samples_per_epoch)`` rows of each source (each within one
    row of its exact share); each batch of a rank holds each source within one row of that
    rank's share of the epoch (:mod:`loaders._internal.mixing`), the rows of one source together.
    ``len(loader)`` is the same on every rank; :attr:`source_rows` counts the rows this rank's
    current (or last) iteration took from each source (:attr:`per_source`: what an epoch takes
    over all ranks).
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], float]],
        *,
        samples_per_epoch: int | None = None,
        labels: str = "union",
        options: LoaderOptions | None = None,
        # The common options (loaders.options.LoaderOptions); then each group, or its options by name.
        channel: str = DEFAULT, rank: int = DEFAULT, world_size: int = DEFAULT, batch_size: int = DEFAULT,
        shuffle: bool = DEFAULT, seed: int = DEFAULT,
        drop_last: None = DEFAULT, remainder: None = DEFAULT,  # refused: a mixture's batches are whole
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
        parsed = parse_sources(sources)
        if labels not in LABEL_POLICIES:
            raise ConfigError(f"labels must be one of {LABEL_POLICIES}, got {labels!r}")
        # locals() is the parameters here (and parsed): the options given, the others DEFAULT.
        self.options = opts = _mixture_options(options, locals())
        if opts.decoder == NO_DECODER:
            raise ConfigError(
                'decoder="none" is not supported for a mixture yet: decode on the CPU, or load one dataset'
            )
        if samples_per_epoch is not None:
            samples_per_epoch = positive_samples(samples_per_epoch)
        self._opened: list[ShardSource] = []
        self._prep: PrepCluster | None = None
        self.counters = LoaderCounters(
            lambda: sum((src.requests() for src in self._opened), RequestCounts()), sources=len(parsed)
        )
        try:
            self._open(parsed, samples_per_epoch, labels)
        except BaseException:
            _stop_sources(self._opened, self._prep)
            raise
        prices = opts.price_table(self.sources[0])  # prices=None: the first source's store's
        self._budget = CostBudget(
            opts.cost_budget, opts.on_budget, prices, rank=opts.rank, dataset=self.dataset
        )
        self._runs = runs_for(
            opts, self._opened, self.counters, self._budget, what="mixture", kind="MixedLoader"
        )
        self._finalizer = weakref.finalize(self, shutdown, self._runs, self._prep)
        self._position = Position()
        self._legs_before: tuple[Leg, ...] = ()  # of the epoch, before the current leg (a resume)
        self._run: Run | None = None  # the current (or last) iteration
        self.source_rows = [0] * len(self._mix)

    def _open(
        self, parsed: list[tuple[str, float | None]], samples_per_epoch: int | None, policy: str
    ) -> None:
        opts = self.options
        for uri, _ in parsed:
            self._opened.append(ShardSource(uri, opts.channel))
        for (uri, _), src in zip(parsed, self._opened, strict=True):
            if src.total_rows == 0:
                raise DatasetError(f"source {uri} has no rows in channel {opts.channel!r}")
        self._rows = [src.total_rows for src in self._opened]
        raw = [w if w is not None else float(n) for (_, w), n in zip(parsed, self._rows, strict=True)]
        self.weights = normalised(raw)
        alike(self._opened)
        for src in self._opened:
            check_decoding(opts, src.info, src.dataset)
        #: The sources' task kind (``None``: single-label), whose batches are :class:`~loaders.Batch` es.
        self.task = self._opened[0].info.task
        self._collate = resolve_collate(opts) if self.task is not None else None
        self.image_size = same_size(self._opened, opts.crop)
        self.labels, luts = label_space(self._opened, policy)
        self.num_classes = len(self.labels)
        self.sources = tuple(src.dataset for src in self._opened)
        self.source_versions = tuple(src.dataset_version for src in self._opened)
        #: The sources' versions, joined: what changes whenever one of them is rebuilt.
        self.dataset_version = "+".join(self.source_versions)
        self.dataset = (
            "mix(" + ", ".join(f"{u}:{w:g}" for u, w in zip(self.sources, self.weights, strict=True)) + ")"
        )
        self.requested_samples = sum(self._rows) if samples_per_epoch is None else samples_per_epoch
        self.samples_per_epoch = epoch_samples(self.requested_samples, opts.world_size * opts.batch_size)
        if self.samples_per_epoch != self.requested_samples:
            log.info(
                "mixture: samples_per_epoch %d rounded down to %d (whole global batches of %d)",
                self.requested_samples,
                self.samples_per_epoch,
                opts.world_size * opts.batch_size,
            )
        self.per_source = shares(self.weights, self.samples_per_epoch)
        check_every_source_has_rows(parsed, self.weights, self.per_source, self.samples_per_epoch)
        if opts.pin_memory and not torch.cuda.is_available():
            log.info("pin_memory=True ignored: CUDA is not available")
        self._prep = open_prep(opts)
        self._open_sources(luts)

    def _open_sources(self, luts: list[torch.Tensor | None]) -> None:
        """Each source's reader (its reads and cache started) and decoding; the decoding of
        whole mixture batches where rows decode alone (:mod:`loaders._internal.mix_sources`)."""
        self._mix, self._direct = open_mix_sources(
            self._opened, luts, self.weights, self.options, tally=self.counters.tally, prep=self._prep,
            num_classes=self.num_classes, image_size=self.image_size,
        )  # fmt: skip
        self._join_buffers = BufferPool(keep=3)  # the yielded batch, the loop's previous one, one spare

    # -- epochs and state --------------------------------------------------------------------------
    def _plan(self) -> MixPlan:
        opts = self.options
        current = Leg(opts.world_size, opts.batch_size, 0)
        return MixPlan(self.per_source, self._rows, self._position.epoch, [*self._legs_before, current])

    def __len__(self) -> int:
        plan = self._plan()
        return plan.batches_before(len(plan.legs) - 1) + plan.num_batches(len(plan.legs) - 1)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields (keeps a restored position in that epoch)."""
        if self._select(epoch):
            self._legs_before = ()

    def state_dict(self) -> dict[str, Any]:
        opts = self.options
        first = sum(leg.batches for leg in self._legs_before)
        legs = [*self._legs_before, Leg(opts.world_size, opts.batch_size, self._position.consumed - first)]
        return mix_state_dict(self._identity(), epoch=self._position.epoch, legs=legs)

    def _identity(self) -> MixIdentity:
        opts = self.options
        return MixIdentity(
            sources=self.sources,
            versions=self.source_versions,
            weights=tuple(self.weights),
            channel=opts.channel,
            samples_per_epoch=self.samples_per_epoch,
            order={k: opts.order_key()[k] for k in MIX_ORDER},
            per_source=tuple(self.per_source),
            rows=tuple(self._rows),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` left off (see the module docstring and
        :func:`loaders._internal.mix_state.read_mix_state`, which says what is refused)."""
        opts = self.options
        saved = read_mix_state(
            state, self._identity(), world_size=opts.world_size, batch_size=opts.batch_size
        )
        self._legs_before = saved.legs_before
        self._position.restore(saved.epoch, saved.consumed)

    # -- iteration (loaders._internal.run) -------------------------------------------------------------------
    def _begin(self) -> Run:
        """Begin an iteration of the selected epoch: out of the running flow if it stands at its
        first batch, else out of a new one (NOTE [ A loader's flow ] in loaders/_internal/run.py)."""
        position, opts = self._position, self.options
        if self._legs_before and position.resumed_used:  # the epoch again: afresh, at this world size
            self._legs_before = ()
            position.start = 0
        position.resumed_used = True
        start, position.start = position.start, 0
        position.consumed = start
        epoch = position.epoch
        looping = self._runs.looping(epoch)
        flow = self._runs.take_over((epoch, start), allowed=not self._legs_before)
        if flow is None:
            flow = self._new_flow(epoch, start, looping=looping)
        plan = self._plan()
        leg = len(plan.legs) - 1
        walk = _walk(plan, leg, opts.rank, start - plan.batches_before(leg), opts.batch_size, self._rows)
        parts = flow.parts(epoch)
        self.counters.begin(parts.reads)
        self.source_rows = [0] * len(self._mix)
        self._budget.begin(self._planned_bytes(walk()) if self._budget.active else 0)
        for src in self._opened:
            if src.fetcher is not None:
                src.fetcher.peak_bytes_held = src.fetcher.held
        side = (walk(), Assembler(self._mix, self._join_buffers, num_classes=self.num_classes))
        self._run = Run(epoch, start, len(self), flow, parts, side)
        return self._run

    def _take(self, run: Run) -> Any:
        """The next batch of ``run``: the next needs of its walk, out of its flow."""
        wanted, assembler = run.side
        batch_needs = next(wanted)
        consumed = run.consumed
        if self._direct is not None:
            key, batch = self._runs.next_decoded(run)
            if key != (-1, run.epoch, consumed):
                raise LoaderError(f"mixture pipeline out of step: expected batch {consumed}, got {key}")
            taken = _taken(batch_needs, len(self._mix))
        else:
            batch, taken = assembler.batch(batch_needs, lambda: self._runs.next_decoded(run))
        for s, n in enumerate(taken):
            self.source_rows[s] += n
        if self._collate is not None and isinstance(batch, Batch):
            return self._collate(batch.images, batch)
        return batch

    def _new_flow(self, epoch: int, start: int, *, looping: bool) -> Flow:
        """A flow from batch ``start`` of ``epoch`` (NOTE [ A loader's flow ])."""
        for i, mix in enumerate(self._mix):  # shards cached since the last epoch are read from disk now
            if mix.source.cache is not None:
                mix.source.epoch_starts(
                    name=f"lakeshard-r{self.options.rank}-s{i}",
                    expected=mix.reader.ranges.remote_ranges(),
                    settle_s=SETTLE_S,
                )
        opts = self.options
        plan = self._plan()
        leg = len(plan.legs) - 1
        flow = Flow(
            at=(epoch, start), onward=looping and not self._runs.fills_cache(), sources=len(self._mix)
        )
        stop = threading.Event()
        tasks = _flow_tasks(
            self._mix,
            self._direct,
            flow,
            stop,
            epoch=epoch,
            walk=_walk(plan, leg, opts.rank, start - plan.batches_before(leg), opts.batch_size, self._rows),
            first_index=start,
            next_walk=functools.partial(
                _fresh_walk, self.per_source, self._rows, opts.world_size, opts.rank, opts.batch_size
            ),
        )
        return self._runs.start(flow, tasks, stop)

    @property
    def shard_sources(self) -> tuple[ShardSource, ...]:
        """Each source's :class:`~loaders._internal.source.ShardSource` (its dataset, reads and cache), in
        the order of the sources."""
        return tuple(self._opened)

    # -- statistics (loaders.stats) ----------------------------------------------------------------
    def _planned_bytes(self, wanted: Iterator[list[Need]]) -> int:
        """The remote bytes of the source batches ``wanted`` needs (what a cost budget projects
        the iteration's cost over)."""
        batches: dict[tuple[int, int], set[int]] = {}
        for batch_needs in wanted:
            for need in batch_needs:
                batches.setdefault((need.source, need.pas), set()).add(need.batch)
        return sum(
            self._mix[s].reader.ranges.planned_bytes(self._mix[s].reader.plan(pas), ks)
            for (s, pas), ks in batches.items()
        )

    @property
    def peak_bytes_held(self) -> int:
        """The most bytes of remote reads held at once, over the sources (0 for local ones)."""
        return sum(src.peak_bytes_held for src in self._opened)

    def epoch_stats(self) -> LoaderStats:
        """What the current (or last) iteration cost on this rank, over all sources (see
        :class:`~loaders.stats.LoaderStats`; ``shuffle`` is not measured)."""
        return LoaderStats.of(
            self.counters.iteration(),
            epoch=self._position.epoch,
            peak_bytes_held=self.peak_bytes_held,
            prices=self._budget.prices,
        )


def _mixture_options(options: LoaderOptions | None, keywords: dict[str, Any]) -> LoaderOptions:
    """A mixture's options (:meth:`LoaderOptions.given`); ``drop_last`` and ``remainder`` refused."""
    refused = [k for k in ("drop_last", "remainder") if keywords[k] is not DEFAULT]
    if options is not None:
        set_there = (("drop_last", options.drop_last), ("remainder", options.remainder != "pad"))
        refused += [k for k, bad in set_there if bad]
    if refused:
        raise ConfigError(
            f"{refused[0]} does not apply to a mixture: every epoch is whole batches, on every rank",
            option=refused[0],
        )
    return LoaderOptions.given(options, keywords)


def _walk(
    plan: MixPlan, leg: int, rank: int, first: int, batch_size: int, rows: Sequence[int]
) -> functools.partial[Iterator[list[Need]]]:
    """The needs of ``rank``'s batches ``first`` on in ``leg`` of ``plan`` (a new walk each call)."""
    share = plan.share(leg, rank)
    return functools.partial(
        needs,
        share,
        first=first,
        last=plan.num_batches(leg),
        batch_size=batch_size,
        taken=share.taken(first * batch_size),
        rows=rows,
    )


def _fresh_walk(
    per_source: Sequence[int], rows: Sequence[int], world_size: int, rank: int, batch_size: int, epoch: int
) -> functools.partial[Iterator[list[Need]]]:
    """The needs of epoch ``epoch`` from its first batch, at this world size."""
    plan = MixPlan(per_source, rows, epoch, [Leg(world_size, batch_size, 0)])
    return _walk(plan, 0, rank, 0, batch_size, rows)


def _flow_tasks(
    sources: Sequence[MixSource],
    direct: BatchDecoding | None,
    flow: Flow,
    stop: threading.Event,
    *,
    epoch: int,
    walk: functools.partial[Iterator[list[Need]]],
    first_index: int,
    next_walk: Callable[[int], functools.partial[Iterator[list[Need]]]],
) -> Iterator[Keyed]:
    """The tasks of a flow, epoch after epoch (runs on the reader thread; a function, not a
    method: it must not keep the loader alive from that thread)."""
    while True:
        parts = flow.parts(epoch)
        if direct is not None:
            decode = direct.for_epoch(epoch, parts.skipped)
            yield from mixture_batches(
                sources, walk(), stop, reads=parts.reads, epoch=epoch, first_index=first_index, decode=decode
            )
        else:
            yield from source_batches(sources, walk(), stop, reads=parts.reads, skipped=parts.skipped)
        if not flow.onward or stop.is_set():
            return
        epoch, walk, first_index = epoch + 1, next_walk(epoch + 1), 0


def _taken(batch_needs: list[Need], sources: int) -> list[int]:
    """The rows of each source a batch's needs take."""
    taken = [0] * sources
    for need in batch_needs:
        taken[need.source] += need.hi - need.lo
    return taken


def _stop_sources(sources: Sequence[ShardSource], prep: PrepCluster | None) -> None:
    """Stop the sources' reads for good, and the preparation cluster's client."""
    for src in sources:
        src.stop(final=True)
    if prep is not None:
        prep.close()


class Concatenated:
    """Several loaders of one channel read one after another, their labels mapped into one label
    space (``labels``: name -> index): how a trainer evaluates on the validation channels of the
    datasets it mixes. Every rank yields as many batches as any other (each loader does)."""

    def __init__(self, loaders: Sequence[ShardLoader], labels: dict[str, int]) -> None:
        self.loaders = list(loaders)
        self._luts = [relabelling(ld.info.labels, labels) for ld in self.loaders]
        self._num_classes = len(labels)

    def __iter__(self) -> Iterator[Any]:
        """Each loader's batches: ``(images, labels)``, or a multi-label or boxes dataset's
        :class:`~loaders.Batch` es, in the label space."""
        for ld, lut in zip(self.loaders, self._luts, strict=True):
            for batch in ld:
                if isinstance(batch, Batch):
                    yield batch.in_classes(lut, self._num_classes)
                else:
                    images, labels = batch
                    yield images, relabelled(labels, lut)

    def __len__(self) -> int:
        return sum(len(ld) for ld in self.loaders)

    def close(self) -> None:
        for ld in self.loaders:
            ld.close()
