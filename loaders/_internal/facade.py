"""What :class:`~loaders.ShardLoader` and :class:`~loaders.MixedLoader` share: the face users
iterate (epochs, iteration, counters, ``close``, the DataLoader view), over the run state of
:mod:`loaders._internal.run`. Each loader says how an iteration begins and how it takes a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lakeshard.errors import ConfigError
from loaders._internal.pipeline import Pipeline
from loaders._internal.prep import PrepCluster
from loaders._internal.run import Iterations, Keyed, Position, Run
from loaders._internal.source import ShardSource
from loaders.batch import SkippedRow
from loaders.dataset import ShardDataset
from loaders.options import LoaderOptions
from loaders.stats import CostBudget, LoaderCounters, LoaderTotals

__all__ = ["Facade", "open_prep", "runs_for", "shutdown"]


class Facade:
    """The shared face of a loader: its position (:class:`~loaders._internal.run.Position`), its
    iterations (:class:`~loaders._internal.run.Iterations`), the current (or last) run, its counters and
    its preparation cluster's client."""

    _runs: Iterations
    _position: Position
    _run: Run | None
    _prep: PrepCluster | None
    counters: LoaderCounters

    @property
    def epoch(self) -> int:
        return self._position.epoch

    def _select(self, epoch: int) -> bool:
        """Select ``epoch`` for the next iteration; ``True`` if it is another one than before."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {epoch!r}")
        return self._position.select(epoch)

    @property
    def run(self) -> Run | None:
        """The current (or last) iteration (:class:`loaders._internal.run.Run`): its epoch, the batches
        it took, its epoch's reads, bad rows and shuffle tally; ``None`` before the first."""
        return self._run

    @property
    def prep(self) -> PrepCluster | None:
        """The client of the preparation cluster (``prep=``; ``None``: decoding on this
        process's threads), with its counts of batches decoded there and here."""
        return self._prep

    @property
    def skipped_rows(self) -> list[SkippedRow]:
        """The bad rows the current (or last) iteration skipped (``skip_bad_rows``)."""
        return self._run.parts.skipped if self._run is not None else []

    def __iter__(self) -> Any:
        self._runs.check_thread()
        return self._runs.iterate(self._begin, self._take, self._position)

    def _begin(self) -> Run:
        raise NotImplementedError

    def _take(self, run: Run) -> Any:
        raise NotImplementedError

    def totals(self) -> LoaderTotals:
        """The counters over the loader's life so far (a mixture's: every source's together)."""
        return self.counters.totals()

    def close(self) -> None:
        """Stop every thread of the loader and wait for them (a later iteration makes new ones,
        on any thread)."""
        self._runs.close()
        if self._prep is not None:  # its client's threads too; the next epoch connects again
            self._prep.close()

    def as_dataset(self) -> ShardDataset:
        """This loader as a :class:`torch.utils.data.IterableDataset` (see :mod:`loaders.dataset`):
        for ``DataLoader(ds, batch_size=None)`` (``num_workers=0``) or a Lightning
        ``train_dataloader()``."""
        return ShardDataset(self)  # type: ignore[arg-type]

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def runs_for(
    options: LoaderOptions,
    sources: Sequence[ShardSource],
    counters: LoaderCounters,
    budget: CostBudget,
    *,
    what: str,
    kind: str,
) -> Iterations:
    """A loader's iterations over one pipeline (``options.decode_threads`` decode threads,
    ``options.prefetch`` batches ahead; threads named ``lakeshard-r{rank}-...``), reading
    ``sources``."""
    pipeline: Pipeline[Keyed, Any] = Pipeline(
        num_threads=options.decode_threads, prefetch=options.prefetch, name=f"lakeshard-r{options.rank}"
    )
    return Iterations(
        pipeline, sources, counters, budget, what=what, kind=kind, where=(options.channel, options.rank)
    )


def open_prep(options: LoaderOptions) -> PrepCluster | None:
    """The client of the preparation cluster the options name (``None``: decode on this
    process's threads)."""
    if options.prep is None:
        return None
    return PrepCluster(
        options.prep,
        timeout_s=options.prep_timeout,
        fallback=options.prep_fallback,
        security=options.prep_security,
    )


def shutdown(runs: Iterations, prep: PrepCluster | None) -> None:
    """Stop every thread of a loader that is gone (its finalizer): close its cache files and its
    preparation cluster's client too."""
    runs.stop(final=True)
    if prep is not None:
        prep.close()
