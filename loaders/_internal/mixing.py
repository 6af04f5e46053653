"""Which rows of which source each rank reads in an epoch of a mixture, and in what order: pure
arithmetic, no I/O (the loader: :mod:`loaders.mixed_loader`).

The policy
----------
Each source ``s`` of ``T_s`` rows is read in *passes*: pass ``p`` is the source's own epoch
``p`` at world size 1 (all its rows, each once, in its seeded shuffled order). A position ``x``
of a source is row ``x mod T_s`` of pass ``x // T_s``.

An epoch of the mixture holds ``S`` samples (``samples_per_epoch`` rounded down to a whole
number of global batches, so every rank yields the same number of full batches in every leg).
Source ``s`` contributes exactly ``N_s`` of them (:func:`shares`: the largest-remainder rounding
of ``weight_s * S``, so ``|N_s - weight_s * S| < 1`` and ``sum N_s = S``), the positions
:func:`epoch_spans` gives:

* a source larger than its share (``N_s < T_s``) is read as an endless stream, pass after
  pass, and epoch ``e`` takes its positions ``[e * N_s, (e + 1) * N_s)``: the next part of the
  source each epoch, every row seen before any repeats;
* a smaller one (``N_s = k * T_s + m``, ``k >= 1``) gives ``k`` whole passes an epoch (passes
  ``e*k .. e*k + k - 1``) and ``m`` rows of its *rest*: pass :data:`REST_PASS` read round and
  round, positions ``[e*m, (e+1)*m)`` of that cycle. Every row comes ``k`` or ``k + 1`` times
  an epoch, and the extra rows go round the source, each before any comes again.

Each leg of an epoch (see :mod:`loaders._internal.elastic`: the epoch's fresh start, then one per resume
at another world size) deals what is left of every source to its ranks (:func:`deal`): each
rank takes a contiguous run of each source's remaining positions, and the runs are sized so
that every rank gets the same number of samples (a source's counts differ by at most one
between ranks). A rank's samples are then interleaved (:func:`interleave`) so that every prefix
of its sequence holds each source close to its share: a batch of ``B`` rows holds within one
row of ``B * n_s / n`` rows of source ``s`` with two sources (``n_s`` of the rank's ``n``),
within ``(k + 1) / 2`` rows with ``k`` (property-tested in ``tests/loaders/test_mixing.py``).

Resuming after ``k`` batches of a leg: a rank has consumed, of each source, the positions the
first ``k * B`` entries of its interleaving give to that source; the rest, rank after rank, is
what the next leg deals. The global batch never changes within an epoch, so what is left is a
whole number of global batches at any world size that divides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lakeshard.errors import ConfigError, LoaderError
from loaders._internal.elastic import Leg

__all__ = [
    "REST_PASS",
    "MixPlan",
    "RankShare",
    "Span",
    "deal",
    "epoch_samples",
    "epoch_spans",
    "interleave",
    "locate",
    "shares",
]

#: A run of stream positions ``[start, stop)`` of one source.
Span = tuple[int, int]


def shares(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` (positive) by largest remainder: each part is
    within one of its exact share, and the parts sum to ``total``. Ties go to the earlier
    source."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    parts = np.floor(exact).astype(np.int64)
    left = total - int(parts.sum())
    order = np.argsort(-(exact - parts), kind="stable")
    parts[order[:left]] += 1
    return [int(p) for p in parts]


def epoch_samples(samples_per_epoch: int, global_batch: int) -> int:
    """``samples_per_epoch`` rounded down to whole global batches.

    Raises:
        ConfigError: fewer samples than one global batch.
    """
    whole = samples_per_epoch // global_batch * global_batch
    if whole == 0:
        raise ConfigError(
            f"samples_per_epoch {samples_per_epoch} is less than one global batch ({global_batch} = world_size x "
            "batch_size): an epoch of the mixture would hold no batch"
        )
    return whole


def interleave(counts: Sequence[int]) -> np.ndarray:
    """The source of each position of a sequence holding ``counts[s]`` rows of source ``s``: the
    ``j``-th row of source ``s`` goes at ``(j + 1/2) * n / counts[s]`` (stride scheduling), so any
    run of ``L`` positions holds within one row of ``L * counts[s] / n`` rows of ``s`` with two
    sources, within ``(k + 1) / 2`` with ``k``."""
    n = int(sum(counts))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    keys = np.concatenate([(np.arange(c) + 0.5) * (n / c) for c in counts if c])
    which = np.concatenate([np.full(c, s, dtype=np.int64) for s, c in enumerate(counts) if c])
    return which[np.argsort(keys, kind="stable")]


#: The pass a smaller source's extra rows go round (whole passes of epochs are numbered below it).
REST_PASS = 1 << 30


def epoch_spans(n: int, rows: int, epoch: int) -> list[Span]:
    """The positions epoch ``epoch`` takes of a source of ``rows`` rows that gives ``n`` an
    epoch (positions from ``REST_PASS * rows`` on are the rest cycle: :func:`locate`)."""
    k, m = divmod(n, rows)
    if k == 0:
        return [(epoch * m, (epoch + 1) * m)] if m else []
    spans = [(epoch * k * rows, (epoch + 1) * k * rows)]
    if m:
        base = REST_PASS * rows
        spans.append((base + epoch * m, base + (epoch + 1) * m))
    return spans


def locate(position: int, rows: int) -> tuple[int, int]:
    """The pass and the row in it of a source's ``position`` (see :func:`epoch_spans`)."""
    if position < REST_PASS * rows:
        return divmod(position, rows)
    return REST_PASS, (position - REST_PASS * rows) % rows


def _length(spans: Sequence[Span]) -> int:
    return sum(b - a for a, b in spans)


def _cut(spans: Sequence[Span], lo: int, hi: int) -> list[Span]:
    """Positions ``[lo, hi)`` of the concatenation of ``spans``."""
    out: list[Span] = []
    start = 0
    for a, b in spans:
        n = b - a
        x, y = max(lo - start, 0), min(hi - start, n)
        if x < y:
            out.append((a + x, a + y))
        start += n
        if start >= hi:
            break
    return out


@dataclass(frozen=True, slots=True)
class RankShare:
    """What one rank reads in one leg: ``spans[s]``, the runs of source ``s``'s stream, and
    ``order``, the source of each of its positions."""

    spans: tuple[tuple[Span, ...], ...]
    order: np.ndarray

    @property
    def counts(self) -> list[int]:
        return [_length(s) for s in self.spans]

    def taken(self, positions: int) -> list[int]:
        """Rows of each source among the first ``positions`` positions."""
        return np.bincount(self.order[:positions], minlength=len(self.spans)).tolist()


def deal(remaining: Sequence[Sequence[Span]], world_size: int) -> list[RankShare]:
    """``remaining[s]`` (source ``s``'s positions still to read, in order) dealt to
    ``world_size`` ranks: rank ``r`` takes the ``r``-th contiguous run of each source, sized
    ``len // world_size`` plus one for ``len % world_size`` of the ranks, those extra rows going
    round the ranks from source to source so that every rank gets the same total.

    Raises:
        LoaderError: the total is not a multiple of ``world_size``.
    """
    lengths = [_length(s) for s in remaining]
    total = sum(lengths)
    if total % world_size:
        raise LoaderError(f"{total} samples cannot be dealt evenly to {world_size} ranks")
    counts = [[n // world_size] * world_size for n in lengths]
    turn = 0
    for s, n in enumerate(lengths):
        for i in range(n % world_size):
            counts[s][(turn + i) % world_size] += 1
        turn = (turn + n % world_size) % world_size
    out = []
    starts = [0] * len(remaining)
    for r in range(world_size):
        spans = []
        for s, runs in enumerate(remaining):
            spans.append(tuple(_cut(runs, starts[s], starts[s] + counts[s][r])))
            starts[s] += counts[s][r]
        out.append(RankShare(tuple(spans), interleave([counts[s][r] for s in range(len(remaining))])))
    return out


class MixPlan:
    """The shares of every rank in every leg of epoch ``epoch`` of a mixture whose sources of
    ``rows[s]`` rows give ``per_source[s]`` samples an epoch; ``legs`` as in :mod:`loaders._internal.elastic` (the last one's
    ``batches`` so far).

    Raises:
        LoaderError: the global batch changed, or a leg consumed more batches than it has.
    """

    def __init__(
        self, per_source: Sequence[int], rows: Sequence[int], epoch: int, legs: Sequence[Leg]
    ) -> None:
        self.per_source = list(per_source)
        self.legs = tuple(legs)
        total = sum(self.per_source)
        g = self.legs[0].global_batch
        if total % g:
            raise LoaderError(f"an epoch of {total} samples is not a whole number of global batches of {g}")
        remaining = [epoch_spans(n, t, epoch) for n, t in zip(self.per_source, rows, strict=True)]
        self.batches_total = total // g
        self._shares: list[list[RankShare]] = []
        for i, leg in enumerate(self.legs):
            if leg.global_batch != g:
                raise LoaderError(
                    f"leg {i} has global batch {leg.world_size} x {leg.batch_size} = {leg.global_batch}, "
                    f"leg 0 has {g}: the global batch must not change within an epoch"
                )
            ranks = deal(remaining, leg.world_size)
            self._shares.append(ranks)
            left = self.batches_total - self.batches_before(i)
            if not 0 <= leg.batches <= left:
                raise LoaderError(f"leg {i} has {left} batches per rank, got {leg.batches!r} consumed")
            used = [r.taken(leg.batches * leg.batch_size) for r in ranks]
            remaining = [
                [
                    span
                    for r, share in enumerate(ranks)
                    for span in _cut(share.spans[s], used[r][s], share.counts[s])
                ]
                for s in range(len(self.per_source))
            ]

    def batches_before(self, leg: int) -> int:
        """Batches (global steps) consumed in the legs before ``leg``."""
        return sum(x.batches for x in self.legs[:leg])

    def share(self, leg: int, rank: int) -> RankShare:
        """What rank ``rank`` reads in leg ``leg`` (its consumed batches included)."""
        ranks = self._shares[leg]
        if not 0 <= rank < len(ranks):
            raise LoaderError(f"rank must be in [0, {len(ranks)}) in leg {leg}, got {rank!r}")
        return ranks[rank]

    def num_batches(self, leg: int) -> int:
        """Batches each rank yields in leg ``leg``, consumed or not."""
        return self.batches_total - self.batches_before(leg)
