"""How well an epoch was shuffled, measured from the rows the loader actually yielded.

The loader's shuffle (:mod:`loaders._internal.shuffle`) permutes row groups, then rows within windows of
``shuffle_window`` rows, so how thorough it is depends on the window, the row group size and
the batch size. Two figures sum up an epoch (:class:`ShuffleQuality`):

* ``rank_correlation``: the Spearman rank correlation between a row's position in storage and
  its position in the epoch's yield order. 1.0 is the stored order (no shuffle), about 0 a full
  shuffle, negative a reversed order. It says whether rows left their stored order at all:
  the row groups' order, drawn before any window, already brings it near 0 whatever the window.
* ``same_group_share``: the mean, over batches, of the probability that two distinct rows of
  the batch come from the same row group. 1.0 is every batch from one row group; a full
  shuffle over ``G`` equal row groups gives about ``1/G``. It says how correlated the rows of
  one batch are (rows of a row group were written together, and may share a source); it is
  the figure the window moves.

:class:`ShuffleTally` collects the rows batch by batch (cheaply: it only keeps the arrays) and
computes the figures once, in :meth:`ShuffleTally.result`, with numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from loaders.batch import BatchTask

__all__ = ["ShuffleQuality", "ShuffleTally", "tallied"]


@dataclass(frozen=True, slots=True)
class ShuffleQuality:
    """How well one epoch's rows were shuffled.

    Attributes:
        rank_correlation: Spearman rank correlation between storage position and yield
            position over the epoch (rows yielded twice, such as padding, get average ranks):
            1.0 = stored order, about 0 = a full shuffle, negative = reversed. NaN when fewer
            than two distinct positions were yielded (no order to measure).
        same_group_share: the mean over batches of the probability that two distinct rows of
            the batch come from the same row group, ``sum(c * (c - 1)) / (n * (n - 1))`` for a
            batch of ``n`` rows with ``c`` rows of each group: 1.0 = every batch from one row
            group, near ``1 / groups`` for a full shuffle. Batches of one row are skipped;
            NaN when every batch has one row.
        rows: rows yielded (every batch's rows, padding included).
        batches: batches yielded (those of one row included).
    """

    rank_correlation: float
    same_group_share: float
    rows: int
    batches: int

    def to_json(self) -> dict[str, float | int]:
        """The figures by name; a NaN stays NaN (``json.dumps`` writes it as ``NaN``)."""
        return {
            "rank_correlation": self.rank_correlation,
            "same_group_share": self.same_group_share,
            "rows": self.rows,
            "batches": self.batches,
        }


class ShuffleTally:
    """Accumulates, batch by batch, the storage position and row group of each yielded row.

    :meth:`add` may run on one thread while :meth:`result` runs on another: each batch is kept
    as one ``(positions, groups)`` pair, appended in one step, and :meth:`result` computes over
    the batches added so far.
    """

    def __init__(self) -> None:
        self._batches: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, positions: np.ndarray, groups: np.ndarray) -> None:
        """One batch, in yield order: ``positions[i]`` is the yielded row's position in storage
        order (an int64, e.g. a global row index over the rank's shards laid end to end),
        ``groups[i]`` an int64 id of the row group it was stored in (unique across shards).

        Cheap enough for every batch on the training loop's thread: the arrays are kept, not
        copied (do not change them afterwards), and nothing is computed until :meth:`result`.

        Raises:
            ValueError: ``positions`` and ``groups`` are not 1-D arrays of the same length.
        """
        if positions.ndim != 1 or positions.shape != groups.shape:
            raise ValueError(
                "positions and groups must be 1-D arrays of one length, got shapes "
                f"{positions.shape!r} and {groups.shape!r}"
            )
        self._batches.append((positions, groups))

    @property
    def nbytes(self) -> int:
        """The bytes the tally holds (16 a row: its storage position and its row group)."""
        return sum(p.nbytes + g.nbytes for p, g in list(self._batches))

    def result(self) -> ShuffleQuality | None:
        """The epoch's figures (None if no row was added)."""
        batches = list(self._batches)  # a snapshot: add() may go on meanwhile
        rows = sum(len(p) for p, _ in batches)
        if rows == 0:
            return None
        positions = np.concatenate([p for p, _ in batches]).astype(np.int64, copy=False)
        return ShuffleQuality(
            rank_correlation=_rank_correlation(positions),
            same_group_share=_same_group_share([g for _, g in batches]),
            rows=rows,
            batches=len(batches),
        )


#: Positions spanning fewer values than this many times their count are ranked by counting
#: (``np.bincount``); others are first made dense by a sort (``np.unique``).
_DENSE_SPAN = 4


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """The rank of each value (0-based), ties given the mean of their ranks (as
    ``scipy.stats.rankdata(values, method="average") - 1``)."""
    lo = int(values.min())
    if int(values.max()) - lo < _DENSE_SPAN * len(values):
        dense = values - lo  # an epoch's positions: one rank's rows, mostly distinct
    else:
        dense = np.unique(values, return_inverse=True)[1].reshape(-1)
    counts = np.bincount(dense)
    below = np.cumsum(counts) - counts  # values smaller than each
    return (below + 0.5 * (counts - 1))[dense]


def _rank_correlation(positions: np.ndarray) -> float:
    """Spearman's rho between ``positions`` and their index (the yield order): the Pearson
    correlation of their ranks; NaN if the positions are all equal."""
    n = len(positions)
    mean = 0.5 * (n - 1)  # of 0-based ranks, ties or not
    x = _average_ranks(positions) - mean
    y = np.arange(n, dtype=np.float64) - mean
    sxx = float(x @ x)
    if sxx == 0.0:
        return math.nan
    # One square root of the product: the stored (x = y) and reversed (x = -y) orders give
    # exactly 1 and -1.
    rho = float(x @ y) / math.sqrt(sxx * float(y @ y))
    return min(1.0, max(-1.0, rho))


def _same_group_share(groups: list[np.ndarray]) -> float:
    """The mean, over the batches of two rows or more, of the share of ordered pairs of distinct
    rows of the batch (``groups[b]`` the row group of each) that have one row group."""
    by_size: dict[int, list[np.ndarray]] = {}
    for g in groups:
        if len(g) >= 2:
            by_size.setdefault(len(g), []).append(g)
    if not by_size:
        return math.nan
    total, batches = 0.0, 0
    for n, same_size in by_size.items():
        rows = np.sort(np.stack(same_size), axis=1)  # a batch a row: equal groups side by side
        # A row's earlier equal neighbours, k - (start of its run), summed over the row, are
        # sum(c * (c - 1)) / 2 over its groups.
        k = np.arange(n)
        run_start = np.zeros(rows.shape, dtype=np.int64)
        run_start[:, 1:] = np.where(rows[:, 1:] != rows[:, :-1], k[1:], 0)
        np.maximum.accumulate(run_start, axis=1, out=run_start)
        pairs = 2 * (k - run_start).sum(axis=1)
        total += float((pairs / (n * (n - 1))).sum())
        batches += len(rows)
    return total / batches


def tallied(
    tasks: Iterator[BatchTask], shuffle: ShuffleTally, shard_rows: list[int], groups: Mapping[int, list[int]]
) -> Iterator[BatchTask]:
    """``tasks``, each one's rows (storage position, row group) added to ``shuffle`` as the
    reader thread makes it (``shard_rows``: the rows of each shard; ``groups``: the rows of each
    row group of a shard)."""
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
