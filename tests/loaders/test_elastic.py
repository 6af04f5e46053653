"""The arithmetic of elastic resume (:mod:`loaders._internal.elastic`), for every input: the rest of an
epoch dealt to another world size gives every real row of the epoch exactly once, the same
number of batches on every new rank, and, at the same world size, exactly today's batches.

The reference (``_today``) is an uninterrupted epoch computed straight from :mod:`loaders._internal.plan`
and :mod:`loaders._internal.shuffle`, as the loader reads it, not from :mod:`loaders._internal.elastic`."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lakeshard.errors import LoaderError
from loaders._internal.elastic import EpochSettings, Leg, LegPlan, order_of, rows_of
from loaders._internal.plan import num_batches, rank_segments, rows_per_rank, split_pieces
from loaders._internal.shuffle import epoch_order

PROPERTY = settings(max_examples=300, deadline=None)


@st.composite
def epochs(draw) -> tuple[EpochSettings, int, int]:
    """Settings of an epoch (shards of any size, row groups of any size), a world size and a
    per-rank batch size that the loader accepts."""
    shards = draw(st.integers(1, 5))
    shard_rows = tuple(draw(st.lists(st.integers(1, 30), min_size=shards, max_size=shards)))
    groups = {}
    for i, n in enumerate(shard_rows):
        size = draw(st.integers(1, 8))
        groups[i] = [size] * (n // size) + ([n % size] if n % size else [])
    world = draw(st.integers(1, 6))
    batch = draw(st.integers(1, 5))
    s = EpochSettings(
        shard_rows=shard_rows,
        row_groups=groups,
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
        epoch=draw(st.integers(0, 5)),
        window_rows=draw(st.integers(1, 12)),
        drop_last=draw(st.booleans()),
        remainder=draw(st.sampled_from(["pad", "drop"])),
    )
    total = sum(shard_rows)
    assume(s.remainder == "pad" or total >= world)
    q = rows_per_rank(total, world, remainder=s.remainder)
    assume(num_batches(q, batch, drop_last=s.drop_last) > 0)  # else the loader refuses the options
    return s, world, batch


def _starts(s: EpochSettings) -> list[int]:
    return list(np.cumsum([0, *s.shard_rows[:-1]]))


def _today(s: EpochSettings, world: int, rank: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s uninterrupted epoch: (global row ids, pad flags) of the positions it yields."""
    pieces = split_pieces(rank_segments(list(s.shard_rows), world, rank, remainder=s.remainder), s.row_groups)
    order = epoch_order(
        [p.rows for p in pieces],
        shuffle=s.shuffle,
        seed=s.seed,
        epoch=s.epoch,
        rank=rank,
        window_rows=s.window_rows,
    )
    starts = _starts(s)
    ids, pads = [], []
    for w, perm in zip(order.windows, order.perms, strict=True):
        rows = [starts[pieces[p].shard] + r for p in w for r in range(pieces[p].start, pieces[p].stop)]
        flags = [pieces[p].pad for p in w for _ in range(pieces[p].rows)]
        ids += [rows[j] for j in perm]
        pads += [flags[j] for j in perm]
    q = rows_per_rank(sum(s.shard_rows), world, remainder=s.remainder)
    end = num_batches(q, batch, drop_last=True) * batch if s.drop_last else q
    return np.asarray(ids[:end], dtype=np.int64), np.asarray(pads[:end], dtype=bool)


def _real(ids: np.ndarray, pads: np.ndarray) -> Counter:
    return Counter(ids[~pads].tolist())


def _epoch_real_rows(s: EpochSettings, world: int, batch: int) -> Counter:
    out: Counter = Counter()
    for r in range(world):
        out += _real(*_today(s, world, r, batch))
    return out


@st.composite
def resumes(draw, legs: int = 2):
    """An epoch, then ``legs - 1`` resumes, each on a world size that divides the global batch,
    after any number of batches of the leg before."""
    s, world, batch = draw(epochs())
    g = world * batch
    worlds = [world] + [
        draw(st.sampled_from([d for d in range(1, g + 1) if g % d == 0])) for _ in range(legs - 1)
    ]
    return s, worlds, g


def _consume(plan_of, s: EpochSettings, worlds: list[int], g: int, draw_k) -> tuple[LegPlan, Counter]:
    """Run the legs: each consumes ``draw_k(n)`` of its ``n`` batches; the last one runs to the end.
    Returns the last plan and the real rows of every batch consumed before it."""
    legs: list[Leg] = []
    consumed: Counter = Counter()
    for i, w in enumerate(worlds):
        b = g // w
        plan = plan_of(s, [*legs, Leg(w, b, 0)])
        if i == len(worlds) - 1:
            return plan, consumed
        k = draw_k(plan.num_batches(i))
        for r in range(w):
            ids, pads = rows_of(plan.sequence(i, r), _starts(s))
            consumed += _real(ids[: k * b], pads[: k * b])
        legs.append(Leg(w, b, k))
    raise AssertionError("unreachable")


@PROPERTY
@given(resumes(legs=2), st.data())
def test_every_real_row_of_the_epoch_comes_exactly_once_and_every_new_rank_yields_alike(case, data):
    s, worlds, g = case
    plan, consumed = _consume(LegPlan, s, worlds, g, lambda n: data.draw(st.integers(0, n), label="consumed"))
    w2 = worlds[-1]
    resumed: Counter = Counter()
    lengths = set()
    for r in range(w2):
        ids, pads = rows_of(plan.sequence(1, r), _starts(s))
        lengths.add(len(ids))
        resumed += _real(ids, pads)
    assert consumed + resumed == _epoch_real_rows(s, worlds[0], g // worlds[0])
    # Every new rank has the same number of rows, and so of batches; the batches fit them.
    (n,) = lengths
    assert n == plan.end(1)
    b2 = g // w2
    assert plan.num_batches(1) == (n // b2 if s.drop_last else -(-n // b2))
    # The rows left over are dealt whole: fewer than W' padded to even the ranks out, none with
    # drop_last (the rest is whole global batches).
    left = worlds[0] * plan.remaining(0)
    if s.drop_last:
        assert w2 * n == left and n % b2 == 0
    else:
        assert 0 <= w2 * n - left < w2


@PROPERTY
@given(resumes(legs=3), st.data())
def test_a_chained_resume_still_gives_every_real_row_exactly_once(case, data):
    s, worlds, g = case
    plan, consumed = _consume(LegPlan, s, worlds, g, lambda n: data.draw(st.integers(0, n), label="consumed"))
    resumed: Counter = Counter()
    for r in range(worlds[-1]):
        rows = rows_of(plan.sequence(2, r), _starts(s))
        resumed += _real(rows.ids, rows.pads)
    assert consumed + resumed == _epoch_real_rows(s, worlds[0], g // worlds[0])
    assert {len(rows_of(plan.sequence(2, r), _starts(s)).ids) for r in range(worlds[-1])} == {plan.end(2)}


@PROPERTY
@given(epochs(), st.data())
def test_the_same_world_size_gives_exactly_todays_remaining_batches(case, data):
    s, world, batch = case
    nb = num_batches(
        rows_per_rank(sum(s.shard_rows), world, remainder=s.remainder), batch, drop_last=s.drop_last
    )
    k = data.draw(st.integers(0, nb), label="consumed")
    plan = LegPlan(s, [Leg(world, batch, k), Leg(world, batch, 0)])
    assert plan.num_batches(1) == nb - k
    for r in range(world):
        ids, pads = rows_of(plan.sequence(1, r), _starts(s))
        want_ids, want_pads = _today(s, world, r, batch)
        assert ids.tolist() == want_ids[k * batch :].tolist()
        assert pads.tolist() == want_pads[k * batch :].tolist()
        # The first leg is today's epoch itself.
        first = rows_of(plan.sequence(0, r), _starts(s))
        assert first.ids.tolist() == want_ids.tolist() and first.pads.tolist() == want_pads.tolist()


@PROPERTY
@given(resumes(legs=2), st.data())
def test_the_reader_order_selects_the_same_rows(case, data):
    """:func:`order_of` (what the reader reads) holds the sequence's rows, in order, each window
    reading only pieces it takes rows from."""
    s, worlds, g = case
    plan, _ = _consume(LegPlan, s, worlds, g, lambda n: data.draw(st.integers(0, n), label="consumed"))
    starts = _starts(s)
    for r in range(worlds[-1]):
        windows = plan.sequence(1, r)
        pieces, order = order_of(windows)
        assert len(set(pieces)) == len(pieces)
        ids = []
        for w, take in zip(order.windows, order.perms, strict=True):
            rows = np.concatenate(
                [np.arange(pieces[p].start, pieces[p].stop) + starts[pieces[p].shard] for p in w]
            )
            ids += rows[take].tolist()
            offsets = np.cumsum([0] + [pieces[p].rows for p in w])
            used = set((np.searchsorted(offsets, take, side="right") - 1).tolist())
            assert used == set(range(len(w)))  # no piece read for nothing
        assert ids == rows_of(windows, starts).ids.tolist()
        assert order.rows == plan.end(1)


def test_a_leg_that_consumed_more_than_it_has_or_changed_the_global_batch_is_refused():
    s = EpochSettings(
        shard_rows=(10, 10),
        row_groups={0: [5, 5], 1: [5, 5]},
        shuffle=False,
        seed=0,
        epoch=0,
        window_rows=4,
        drop_last=False,
        remainder="pad",
    )
    with pytest.raises(
        LoaderError, match=r"leg 0 \(2 ranks x 3 rows\) has 4 batches per rank, got 5 consumed"
    ):
        LegPlan(s, [Leg(2, 3, 5), Leg(1, 6, 0)])
    with pytest.raises(LoaderError, match=r"leg 1 has global batch 3 x 2 = 6, leg 0 has 8"):
        LegPlan(s, [Leg(2, 4, 1), Leg(3, 2, 0)])
