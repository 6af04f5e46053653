"""Elastic resume: the rest of an interrupted epoch, dealt to another number of ranks. Pure
arithmetic, no I/O.

An epoch runs in *legs*. The first leg is the epoch's fresh start: rank ``r`` of ``W`` reads
positions ``[0, end)`` of its own order (:mod:`loaders._internal.plan`, :mod:`loaders._internal.shuffle`). When the
run is resumed on another number of ranks, a new leg begins: with ``k`` batches of ``b`` rows
consumed in the previous leg on each of its ``W`` ranks, the rows still to come are

    ``R`` = for each old rank ``r = 0..W-1`` in turn, positions ``[k*b, end)`` of its sequence

(an old pad row stays a pad row). ``R`` is dealt contiguously to the ``W'`` new ranks, as
:func:`loaders._internal.plan.rank_segments` deals the row space: ``q' = ceil(len(R) / W')`` and new rank
``r'`` reads ``R[r'*q' : (r'+1)*q']``, wrapping past the end to ``R``'s start, the wrapped rows
marked pad (fewer than ``W'`` of them; none with ``drop_last``, where ``len(R)`` is a multiple
of the global batch). Every new rank then yields ``num_batches(q', b')`` batches. A leg resumed
in turn on yet another world size is dealt the same way from its own sequences.

Invariants (property-tested in ``tests/loaders/test_elastic.py``):

* the global batch ``W * b`` is the same in every leg;
* the real rows of the consumed batches of every leg and of the last leg's whole sequence are
  exactly the real rows of an uninterrupted epoch at the first leg's world size, each once;
* with ``W' = W`` a new leg's sequences are the previous leg's remaining positions, rank by rank.

A rank's sequence is a list of :class:`Window` s: rows of a few pieces (row-group slices) taken
in a given order. A window of a later leg is a part of one window of the first leg (pruned to
the pieces it still needs), so the reader holds at most one old window of encoded rows at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lakeshard.errors import LoaderError
from loaders._internal.plan import Piece, num_batches, rank_segments, rows_per_rank, split_pieces
from loaders._internal.shuffle import EpochOrder, epoch_order

__all__ = ["EpochSettings", "Leg", "LegPlan", "ReadOrder", "SequenceRows", "Window", "order_of", "rows_of"]


@dataclass(frozen=True, slots=True)
class Leg:
    """Part of an epoch run at one world size: ``batches`` batches of ``batch_size`` rows consumed
    on each of ``world_size`` ranks (for the current leg: consumed so far)."""

    world_size: int
    batch_size: int
    batches: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size


@dataclass(frozen=True, slots=True)
class EpochSettings:
    """What decides an epoch's rows and order, whatever the world size."""

    shard_rows: tuple[int, ...]
    #: Row-group sizes of every shard (index -> sizes).
    row_groups: Mapping[int, Sequence[int]]
    shuffle: bool
    seed: int
    epoch: int
    window_rows: int
    drop_last: bool
    remainder: str


@dataclass(frozen=True, slots=True)
class Window:
    """Rows read together: ``take`` indexes the concatenation of ``pieces``' rows."""

    pieces: tuple[Piece, ...]
    take: np.ndarray

    def __len__(self) -> int:
        return len(self.take)


@dataclass(frozen=True, slots=True)
class _Sizes:
    rows_per_rank: int
    batches: int  #: batches per rank in the whole leg
    end: int  #: positions yielded, ``[0, end)``


class LegPlan:
    """The sequences of every leg of one epoch (computed on demand, rank by rank).

    Raises:
        LoaderError: a leg consumed more batches than it has, or the global batch changed.
    """

    def __init__(self, settings: EpochSettings, legs: Sequence[Leg]) -> None:
        if not legs:
            raise LoaderError("an epoch needs at least one leg")
        self.settings = settings
        self.legs = tuple(legs)
        self._sizes: list[_Sizes] = []
        s = settings
        for i, leg in enumerate(self.legs):
            if leg.global_batch != self.legs[0].global_batch:
                raise LoaderError(
                    f"leg {i} has global batch {leg.world_size} x {leg.batch_size} = {leg.global_batch}, "
                    f"leg 0 has {self.legs[0].global_batch}: the global batch must not change within an epoch"
                )
            if i == 0:
                q = rows_per_rank(sum(s.shard_rows), leg.world_size, remainder=s.remainder)
            else:
                q = -(-self.remaining(i - 1) * self.legs[i - 1].world_size // leg.world_size)
            nb = num_batches(q, leg.batch_size, drop_last=s.drop_last)
            self._sizes.append(_Sizes(q, nb, nb * leg.batch_size if s.drop_last else q))
            if not isinstance(leg.batches, int) or not 0 <= leg.batches <= nb:
                raise LoaderError(
                    f"leg {i} ({leg.world_size} ranks x {leg.batch_size} rows) has {nb} batches per rank, "
                    f"got {leg.batches!r} consumed"
                )
        self._cache: dict[tuple[int, int], list[Window]] = {}

    def rows_per_rank(self, leg: int) -> int:
        return self._sizes[leg].rows_per_rank

    def num_batches(self, leg: int) -> int:
        """Batches per rank in leg ``leg``, consumed or not."""
        return self._sizes[leg].batches

    def end(self, leg: int) -> int:
        """Positions each rank yields in leg ``leg``: ``[0, end)``."""
        return self._sizes[leg].end

    def remaining(self, leg: int) -> int:
        """Positions per rank not consumed in leg ``leg`` (the last batch may be short)."""
        return max(self._sizes[leg].end - self.legs[leg].batches * self.legs[leg].batch_size, 0)

    def batches_before(self, leg: int) -> int:
        """Batches (global steps) consumed in the legs before ``leg``."""
        return sum(x.batches for x in self.legs[:leg])

    def sequence(self, leg: int, rank: int) -> list[Window]:
        """Positions ``[0, end(leg))`` of rank ``rank``'s sequence in leg ``leg``."""
        if not 0 <= rank < self.legs[leg].world_size:
            raise LoaderError(f"rank must be in [0, {self.legs[leg].world_size}) in leg {leg}, got {rank!r}")
        key = (leg, rank)
        if key not in self._cache:
            self._cache[key] = self._fresh(rank) if leg == 0 else self._dealt(leg, rank)
        return self._cache[key]

    def _fresh(self, rank: int) -> list[Window]:
        s, w = self.settings, self.legs[0].world_size
        pieces = split_pieces(rank_segments(list(s.shard_rows), w, rank, remainder=s.remainder), s.row_groups)
        order = epoch_order(
            [p.rows for p in pieces],
            shuffle=s.shuffle,
            seed=s.seed,
            epoch=s.epoch,
            rank=rank,
            window_rows=s.window_rows,
        )
        windows = [
            Window(tuple(pieces[int(p)] for p in order.windows[i]), order.perms[i])
            for i in range(len(order.windows))
        ]
        return _cut(windows, 0, self.end(0))

    def _dealt(self, leg: int, rank: int) -> list[Window]:
        prev, m = self.legs[leg - 1], self.remaining(leg - 1)
        n = prev.world_size * m  # len(R)
        q = self.rows_per_rank(leg)
        windows: list[Window] = []
        a, b = rank * q, (rank + 1) * q
        while a < b:  # as rank_segments: past the end of R, wrap to its start as pad
            g = a % n
            run = min(b - a, n - g)
            part = self._remaining_rows(leg - 1, g, g + run)
            windows += [_as_pad(w) for w in part] if a >= n else part
            a += run
        return _cut(windows, 0, self.end(leg))

    def _remaining_rows(self, leg: int, lo: int, hi: int) -> list[Window]:
        """Positions ``[lo, hi)`` of ``R``: the unconsumed positions of leg ``leg``'s ranks, rank by rank."""
        m = self.remaining(leg)
        skip = self.end(leg) - m
        out: list[Window] = []
        for r in range(lo // m, (hi - 1) // m + 1):
            a, b = max(lo, r * m) - r * m, min(hi, (r + 1) * m) - r * m
            out += _cut(self.sequence(leg, r), skip + a, skip + b)
        return out


def _cut(windows: list[Window], lo: int, hi: int) -> list[Window]:
    """Positions ``[lo, hi)`` of a sequence of windows, each window pruned to the pieces it reads."""
    out: list[Window] = []
    start = 0
    for w in windows:
        stop = start + len(w)
        if stop > lo and start < hi:
            a, b = max(lo - start, 0), min(hi - start, len(w))
            out.append(w if (a, b) == (0, len(w)) else _prune(w.pieces, w.take[a:b]))
        start = stop
        if start >= hi:
            break
    return out


def _prune(pieces: tuple[Piece, ...], take: np.ndarray) -> Window:
    """The window of rows ``take`` of ``pieces``, keeping only the pieces they fall in."""
    offsets = np.cumsum([0] + [p.rows for p in pieces])
    which = np.searchsorted(offsets, take, side="right") - 1
    used = np.unique(which)
    new_offsets = np.zeros(len(pieces), dtype=np.int64)
    new_offsets[used] = np.cumsum([0] + [pieces[int(u)].rows for u in used[:-1]])
    return Window(tuple(pieces[int(u)] for u in used), take - offsets[which] + new_offsets[which])


def _as_pad(w: Window) -> Window:
    return Window(tuple(dataclasses.replace(p, pad=True) for p in w.pieces), w.take)


class ReadOrder(NamedTuple):
    """A sequence of windows as the reader reads it: ``order``'s windows index ``pieces``."""

    pieces: list[Piece]
    order: EpochOrder


def order_of(windows: Sequence[Window]) -> ReadOrder:
    """``windows`` as the reader reads an epoch: distinct pieces, and an :class:`EpochOrder`
    whose ``perms`` select (not only permute) rows of each window's pieces."""
    index: dict[Piece, int] = {}
    wins, takes, starts = [], [], [0]
    for w in windows:
        wins.append(np.asarray([index.setdefault(p, len(index)) for p in w.pieces], dtype=np.int64))
        takes.append(np.asarray(w.take, dtype=np.int64))
        starts.append(starts[-1] + len(w))
    return ReadOrder(
        list(index), EpochOrder(windows=wins, perms=takes, starts=np.asarray(starts, dtype=np.int64))
    )


class SequenceRows(NamedTuple):
    """A sequence's rows, position by position: global row ids and pad flags."""

    ids: np.ndarray
    pads: np.ndarray


def rows_of(windows: Sequence[Window], shard_starts: Sequence[int]) -> SequenceRows:
    """The global row ids and pad flags of a sequence, position by position; ``shard_starts[i]``
    is shard ``i``'s first global row."""
    ids, pads = [], []
    for w in windows:
        rows = np.concatenate([np.arange(p.start, p.stop) + shard_starts[p.shard] for p in w.pieces])
        flags = np.concatenate([np.full(p.rows, p.pad) for p in w.pieces])
        ids.append(rows[w.take])
        pads.append(flags[w.take])
    if not ids:
        return SequenceRows(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
    return SequenceRows(np.concatenate(ids), np.concatenate(pads))
