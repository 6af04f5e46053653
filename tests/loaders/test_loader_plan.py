"""Property tests of the engine-free arithmetic: rank assignment, batch counts, epoch order."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeshard.errors import ConfigError
from loaders._internal.plan import batch_size_at, num_batches, rank_segments, rows_per_rank, split_pieces
from loaders._internal.shuffle import RAMP, epoch_order

shard_rows_st = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=7).filter(
    lambda r: sum(r) > 0
)


def global_rows(shard_rows, segments):
    starts = np.concatenate([[0], np.cumsum(shard_rows)])
    return [(int(starts[s.shard]) + r, s.pad) for s in segments for r in range(s.start, s.stop)]


@settings(max_examples=150, deadline=None)
@given(shard_rows=shard_rows_st, world=st.integers(1, 9), batch=st.integers(1, 50), drop_last=st.booleans())
def test_every_rank_gets_same_rows_and_batches_pad(shard_rows, world, batch, drop_last):
    total = sum(shard_rows)
    per_rank = [
        global_rows(shard_rows, rank_segments(shard_rows, world, r, remainder="pad")) for r in range(world)
    ]
    sizes = {len(rows) for rows in per_rank}
    assert len(sizes) == 1, sizes
    (q,) = sizes
    assert q == rows_per_rank(total, world, remainder="pad")
    # nothing lost: every row is read exactly once unpadded; padded rows are fewer than world size
    unpadded = Counter(g for rows in per_rank for g, pad in rows if not pad)
    assert sorted(unpadded) == list(range(total))
    assert set(unpadded.values()) == {1}
    padded = sum(1 for rows in per_rank for _, pad in rows if pad)
    assert padded == world * q - total
    assert padded < world or total < world
    # batches: same count on every rank, sizes add up
    nb = num_batches(q, batch, drop_last=drop_last)
    sizes_b = [batch_size_at(i, q, batch, drop_last=drop_last) for i in range(nb)]
    assert all(s == batch for s in sizes_b[:-1])
    if drop_last:
        assert sum(sizes_b) == (q // batch) * batch
    else:
        assert sum(sizes_b) == q


@settings(max_examples=100, deadline=None)
@given(shard_rows=shard_rows_st, world=st.integers(1, 9))
def test_drop_remainder_reads_each_row_at_most_once(shard_rows, world):
    total = sum(shard_rows)
    if total < world:
        with pytest.raises(ConfigError, match="leaves no rows"):
            rank_segments(shard_rows, world, 0, remainder="drop")
        return
    per_rank = [
        global_rows(shard_rows, rank_segments(shard_rows, world, r, remainder="drop")) for r in range(world)
    ]
    assert len({len(rows) for rows in per_rank}) == 1
    seen = [g for rows in per_rank for g, pad in rows]
    assert not any(pad for rows in per_rank for _, pad in rows)
    assert len(seen) == len(set(seen)) == world * (total // world)
    assert total - len(seen) < world


@settings(max_examples=50, deadline=None)
@given(world=st.integers(1, 6), k=st.integers(1, 4), rows=st.integers(1, 30))
def test_equal_shards_multiple_of_world_give_fixed_whole_shards(world, k, rows):
    shard_rows = [rows] * (world * k)
    for r in range(world):
        segs = rank_segments(shard_rows, world, r)
        assert [(s.shard, s.start, s.stop, s.pad) for s in segs] == [
            (shard, 0, rows, False) for shard in range(r * k, (r + 1) * k)
        ]


def test_world_not_dividing_shards_crosses_shard_boundaries():
    # 3 shards of 10 rows over 2 ranks: 15 rows each, rank 0 takes shard 0 and half of shard 1
    r0 = rank_segments([10, 10, 10], 2, 0)
    r1 = rank_segments([10, 10, 10], 2, 1)
    assert [(s.shard, s.start, s.stop) for s in r0] == [(0, 0, 10), (1, 0, 5)]
    assert [(s.shard, s.start, s.stop) for s in r1] == [(1, 5, 10), (2, 0, 10)]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: rank_segments([5], 0, 0), "world_size must be a positive integer, got 0"),
        (lambda: rank_segments([5], 2, 2), r"rank must be in \[0, 2\), got 2"),
        (lambda: rows_per_rank(0, 2), "at least one row, got 0"),
        (lambda: rows_per_rank(4, 2, remainder="wrap"), "remainder must be one of"),
        (lambda: num_batches(4, 0, drop_last=False), "batch_size must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(
    shard_rows=shard_rows_st,
    group=st.integers(1, 12),
    world=st.integers(1, 4),
    window=st.integers(1, 60),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 100),
    shuffle=st.booleans(),
)
def test_epoch_order_is_a_seeded_permutation_within_windows(
    shard_rows, group, world, window, seed, epoch, shuffle
):
    groups = {
        s: [group] * (n // group) + ([n % group] if n % group else []) for s, n in enumerate(shard_rows)
    }
    segs = rank_segments(shard_rows, world, world - 1)
    pieces = split_pieces(segs, groups)
    assert sum(p.rows for p in pieces) == sum(s.rows for s in segs)
    assert all(p.rows <= group for p in pieces)
    sizes = [p.rows for p in pieces]
    order = epoch_order(sizes, shuffle=shuffle, seed=seed, epoch=epoch, rank=0, window_rows=window)
    again = epoch_order(sizes, shuffle=shuffle, seed=seed, epoch=epoch, rank=0, window_rows=window)
    assert order.rows == sum(sizes)
    # every piece in exactly one window; each window's perm is a permutation of its own rows
    assert sorted(int(p) for w in order.windows for p in w) == list(range(len(pieces)))
    for w, perm in zip(order.windows, order.perms, strict=True):
        assert sorted(perm.tolist()) == list(range(sum(sizes[int(p)] for p in w)))
    for i, w in enumerate(order.windows):
        # each window closes at the first piece that brings it to its target: window_rows, but
        # 1/8, 1/4 and 1/2 of it for an epoch's first three windows (the ramp)
        target = max(1, window >> max(0, RAMP - i))
        rows = [sizes[int(p)] for p in w]
        assert sum(rows[:-1]) < target
        if i < len(order.windows) - 1:
            assert sum(rows) >= target
    # deterministic
    assert all(np.array_equal(a, b) for a, b in zip(order.perms, again.perms, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(order.windows, again.windows, strict=True))
    if not shuffle:
        assert [int(p) for w in order.windows for p in w] == list(range(len(pieces)))


def test_epoch_order_changes_with_epoch_and_seed():
    sizes = [10] * 20
    flat = {}
    for seed, epoch in [(7, 0), (7, 1), (8, 0)]:
        o = epoch_order(sizes, shuffle=True, seed=seed, epoch=epoch, rank=0, window_rows=50)
        flat[(seed, epoch)] = [
            (tuple(w.tolist()), tuple(p.tolist())) for w, p in zip(o.windows, o.perms, strict=True)
        ]
    assert flat[(7, 0)] != flat[(7, 1)]
    assert flat[(7, 0)] != flat[(8, 0)]


def test_window_at_maps_positions():
    o = epoch_order([3, 4, 5, 2, 2, 2], shuffle=False, seed=0, epoch=0, rank=0, window_rows=16)
    # targets 2, 4, 8, then 16 rows
    assert o.starts.tolist() == [0, 3, 7, 16, 18]
    assert [o.window_at(p) for p in (0, 2, 3, 6, 7, 15, 16, 17, 18)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_an_epoch_starts_with_small_windows():
    """The first batch waits only for the first window: 1/8 of shuffle_window, not all of it."""
    o = epoch_order([100] * 100, shuffle=True, seed=3, epoch=1, rank=0, window_rows=2048)
    assert [len(w) for w in o.windows[:5]] == [3, 6, 11, 21, 21]
