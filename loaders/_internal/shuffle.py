"""The order in which one rank sees its rows in one epoch: pure, seeded, no I/O.

Algorithm (a windowed block shuffle, like mosaicml/streaming's ``py1b``):

1. The rank's pieces (row-group slices, :class:`loaders._internal.plan.Piece`) are permuted.
2. Consecutive pieces of that order are grouped into *windows* of at least ``window_rows`` rows
   (a piece never spans two windows, so each row group is read once per epoch), except that
   the first windows of an epoch ramp up: at least ``window_rows / 8``, ``/ 4``, ``/ 2`` rows,
   then ``window_rows`` (:data:`RAMP`).
3. The rows of each window are permuted.

The ramp is for the first batch: it waits for its whole window to be read, and from a remote
store a full window is tens of megabytes. The price is a less thorough shuffle of an epoch's
first ``window_rows * 7 / 8`` rows (drawn from fewer row groups), which matters little because
the shard job already wrote each shard's rows in a shuffled order.

The reader holds one window of encoded rows at a time, so memory is bounded by
``window_rows`` (plus one row group) whatever the shard's size, and resuming at position ``p``
starts reading at the window that holds ``p``. The random generator is seeded by
``(seed, epoch, rank)`` only, so the order does not depend on the number of threads, on timing,
or on where a previous run stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lakeshard.errors import ConfigError

__all__ = ["RAMP", "EpochOrder", "epoch_order"]

#: Window ``i`` of an epoch (``i < RAMP``) holds at least ``window_rows >> (RAMP - i)`` rows.
RAMP = 3


@dataclass(frozen=True)
class EpochOrder:
    """Windows in read order.

    ``windows[w]`` lists piece indices; ``perms[w]`` is a permutation of the window's rows
    (indices into the concatenation of its pieces' rows, in ``windows[w]`` order); position
    ``starts[w] + j`` of the epoch is row ``perms[w][j]`` of window ``w``.
    """

    windows: list[np.ndarray]
    perms: list[np.ndarray]
    starts: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.starts[-1])

    def window_at(self, position: int) -> int:
        """The window holding epoch position ``position`` (``len(windows)`` at the end)."""
        if not 0 <= position <= self.rows:
            raise IndexError(f"position must be in [0, {self.rows}], got {position!r}")
        return (
            int(np.searchsorted(self.starts, position, side="right")) - 1
            if position < self.rows
            else len(self.windows)
        )


def epoch_order(
    piece_rows: Sequence[int], *, shuffle: bool, seed: int, epoch: int, rank: int, window_rows: int
) -> EpochOrder:
    """The row order of one epoch for pieces with ``piece_rows`` rows each."""
    if window_rows < 1:
        raise ConfigError(f"shuffle_window must be a positive number of rows, got {window_rows!r}")
    for name, value in (("seed", seed), ("epoch", epoch), ("rank", rank)):
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, rank]))
    sizes = np.asarray(piece_rows, dtype=np.int64)
    order = rng.permutation(len(sizes)) if shuffle else np.arange(len(sizes))

    windows: list[np.ndarray] = []
    perms: list[np.ndarray] = []
    starts = [0]
    current: list[int] = []
    rows = 0
    for p in order:
        current.append(int(p))
        rows += int(sizes[p])
        if rows >= max(1, window_rows >> max(0, RAMP - len(windows))):
            windows.append(np.asarray(current, dtype=np.int64))
            starts.append(starts[-1] + rows)
            current, rows = [], 0
    if current:
        windows.append(np.asarray(current, dtype=np.int64))
        starts.append(starts[-1] + rows)
    for w in windows:
        n = int(sizes[w].sum())
        perms.append(rng.permutation(n) if shuffle else np.arange(n))
    return EpochOrder(windows, perms, np.asarray(starts, dtype=np.int64))
