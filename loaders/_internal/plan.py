"""Which rows each rank reads, and how many batches it yields: pure arithmetic, no I/O.

The rank policy
---------------
The shards of one channel are laid end to end in shard-index order, giving one global row space
``[0, total)``. Rank ``r`` of ``W`` reads the contiguous range ``[r*q, (r+1)*q)`` of it, where
``q`` (:func:`rows_per_rank`) is the same on every rank:

* ``remainder="pad"`` (the default): ``q = ceil(total / W)``. The last ranks run past the end
  of the row space and wrap around to its start (as ``torch.utils.data.DistributedSampler``
  does); the wrapped rows are marked *pad* and the loader labels them
  :data:`loaders.PAD_LABEL` so losses and accuracies ignore them. Fewer than ``W`` rows are
  padded, and no row is lost.
* ``remainder="drop"``: ``q = floor(total / W)``; the last ``total mod W`` rows of the last shard
  are read by no rank.

Consequences, all property-tested in ``tests/loaders/test_loader_plan.py``:

* ``W`` shards of equal size: rank ``r`` reads exactly shard ``r``.
* ``k*W`` equal shards: rank ``r`` reads exactly the fixed subset ``[r*k, (r+1)*k)``.
* Any other shard count: ranks read row ranges that cross shard boundaries, and still get the
  same number of rows.
* Every rank yields the same number of batches (:func:`num_batches`), so DDP never waits on a
  rank that has run out of data.

Batches: with ``drop_last=False`` the last batch of an epoch is short (``q mod batch_size``
rows) on *every* rank alike, so batch shapes agree across ranks at every step and nothing is
padded inside a batch; with ``drop_last=True`` the short batch is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lakeshard.errors import ConfigError
from lakeshard.settings import check_positive

__all__ = [
    "RANK_REMAINDER_POLICIES",
    "Piece",
    "Segment",
    "batch_size_at",
    "num_batches",
    "rank_segments",
    "rows_per_rank",
    "split_pieces",
]

#: What a rank does with the rows beyond a multiple of the world size (the ``remainder``
#: loader option; not the shard job's ``--remainder``, which pads or drops rows beyond a
#: multiple of ``num_shards`` when the shards are written).
RANK_REMAINDER_POLICIES = ("pad", "drop")


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, stop)`` of shard ``shard``; ``pad`` marks rows repeated to even out ranks."""

    shard: int
    start: int
    stop: int
    pad: bool = False

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Piece:
    """The unit the reader reads: rows ``[start, stop)`` (shard row numbers) of one row group."""

    shard: int
    row_group: int
    start: int
    stop: int
    pad: bool
    #: Shard row number of the row group's first row.
    group_start: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _check_world(world_size: int, rank: int) -> None:
    check_positive("world_size", world_size, error=ConfigError)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")


def rows_per_rank(total_rows: int, world_size: int, *, remainder: str = "pad") -> int:
    """The number of rows every rank reads per epoch (the same on every rank)."""
    _check_world(world_size, 0)
    if remainder not in RANK_REMAINDER_POLICIES:
        raise ConfigError(f"remainder must be one of {RANK_REMAINDER_POLICIES}, got {remainder!r}")
    if total_rows < 1:
        raise ConfigError(f"a channel needs at least one row, got {total_rows!r}")
    if remainder == "pad":
        return -(-total_rows // world_size)
    q = total_rows // world_size
    if q == 0:
        raise ConfigError(
            f'remainder="drop" leaves no rows: {total_rows} rows cannot be split over world_size={world_size} ranks'
        )
    return q


def rank_segments(
    shard_rows: Sequence[int], world_size: int, rank: int, *, remainder: str = "pad"
) -> list[Segment]:
    """The rows rank ``rank`` of ``world_size`` reads, as segments in global row order."""
    _check_world(world_size, rank)
    for i, n in enumerate(shard_rows):
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"shard {i} row count must be a non-negative integer, got {n!r}")
    total = sum(shard_rows)
    q = rows_per_rank(total, world_size, remainder=remainder)
    starts = [0]
    for n in shard_rows:
        starts.append(starts[-1] + n)

    segments: list[Segment] = []
    a, b = rank * q, (rank + 1) * q
    while a < b:
        g = a % total
        run = min(b - a, total - g)
        pad = a >= total
        lo, hi = g, g + run
        for shard, n in enumerate(shard_rows):
            s0, s1 = starts[shard], starts[shard] + n
            if s1 <= lo or s0 >= hi or n == 0:
                continue
            segments.append(Segment(shard, max(lo, s0) - s0, min(hi, s1) - s0, pad))
        a += run
    return segments


def num_batches(rows: int, batch_size: int, *, drop_last: bool) -> int:
    """Batches per epoch for a rank reading ``rows`` rows."""
    check_positive("batch_size", batch_size, error=ConfigError)
    if rows < 0:
        raise ConfigError(f"rows must be non-negative, got {rows!r}")
    return rows // batch_size if drop_last else -(-rows // batch_size)


def batch_size_at(index: int, rows: int, batch_size: int, *, drop_last: bool) -> int:
    """The size of batch ``index`` of an epoch (only the last one can be short)."""
    n = num_batches(rows, batch_size, drop_last=drop_last)
    if not 0 <= index < n:
        raise IndexError(f"batch index must be in [0, {n}), got {index!r}")
    return min(batch_size, rows - index * batch_size)


def split_pieces(segments: Sequence[Segment], row_group_rows: Mapping[int, Sequence[int]]) -> list[Piece]:
    """Cut segments at row-group boundaries. ``row_group_rows[shard]`` lists the row count of
    each row group of that shard."""
    pieces: list[Piece] = []
    for seg in segments:
        groups = row_group_rows[seg.shard]
        g_start = 0
        for g, n in enumerate(groups):
            g_stop = g_start + n
            lo, hi = max(seg.start, g_start), min(seg.stop, g_stop)
            if lo < hi:
                pieces.append(Piece(seg.shard, g, lo, hi, seg.pad, g_start))
            g_start = g_stop
        if seg.stop > g_start:
            raise ConfigError(
                f"segment rows [{seg.start}, {seg.stop}) of shard {seg.shard} run past its {g_start} rows"
            )
    return pieces
