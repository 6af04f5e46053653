"""ShuffleTally: its figures on hand-made orders, against a naive reference, and on what a real
ShardLoader yields with the shuffle off, with windows of growing size, and as a full shuffle."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loader_builders import ids_of, write_dataset

from loaders import ShardLoader
from loaders._internal.shuffle_quality import ShuffleQuality, ShuffleTally

# The loader tests' dataset: 2 shards of 300 train rows, row groups of 10 rows (60 in all), read
# by one rank in batches of 10, so that unshuffled batches are exactly its row groups.
SHARDS, PER_SHARD, GROUP_ROWS, BATCH = 2, 300, 10, 10
ROWS = SHARDS * PER_SHARD
#: same_group_share of a full shuffle: the chance that another row of the batch is in one's group.
FULL_SHUFFLE_SHARE = (GROUP_ROWS - 1) / (ROWS - 1)


def tally(batches: list[tuple[list[int], list[int]]]) -> ShuffleQuality | None:
    t = ShuffleTally()
    for positions, groups in batches:
        t.add(np.asarray(positions, dtype=np.int64), np.asarray(groups, dtype=np.int64))
    return t.result()


# -- hand-made orders --------------------------------------------------------------------------------


def test_an_empty_tally_has_no_result():
    assert ShuffleTally().result() is None
    assert tally([([], [])]) is None


def test_stored_order_correlates_one_and_reversed_order_minus_one():
    positions = list(range(1000))
    stored = tally([(positions[i : i + 7], [0] * len(positions[i : i + 7])) for i in range(0, 1000, 7)])
    reversed_ = tally([(positions[::-1], [0] * 1000)])
    assert stored is not None and stored.rank_correlation == 1.0
    assert reversed_ is not None and reversed_.rank_correlation == -1.0


def test_repeated_rows_get_average_ranks():
    # Positions 0, 1, 1, 2 (a padded row yielded twice): ranks 0, 1.5, 1.5, 3 against 0, 1, 2, 3;
    # centred: (-1.5, 0, 0, 1.5) and (-1.5, -0.5, 0.5, 1.5), so rho = 4.5 / sqrt(4.5 * 5).
    q = tally([([0, 1], [0, 0]), ([1, 2], [0, 0])])
    assert q is not None and q.rank_correlation == pytest.approx(3 / math.sqrt(10), abs=1e-12)


def test_same_group_share_by_hand():
    # Groups (7, 7, 9): 2 ordered pairs of 3 * 2 share a group -> 1/3. Groups (1, 2, 3, 4): none
    # -> 0. A batch of one row is skipped. Groups (5, 5, 5, 5, 6, 6): (4*3 + 2*1) / (6*5) = 14/30.
    q = tally(
        [
            ([0, 1, 2], [7, 7, 9]),
            ([3, 4, 5, 6], [1, 2, 3, 4]),
            ([7], [8]),
            ([8, 9, 10, 11, 12, 13], [5, 5, 5, 5, 6, 6]),
        ]
    )
    assert q is not None
    assert q.same_group_share == pytest.approx((1 / 3 + 0 + 14 / 30) / 3, abs=1e-12)
    assert (q.rows, q.batches) == (14, 4)
    assert q.to_json() == {
        "rank_correlation": q.rank_correlation,
        "same_group_share": q.same_group_share,
        "rows": 14,
        "batches": 4,
    }


def test_figures_without_an_order_to_measure_are_nan():
    one_row = tally([([5], [0])])
    assert one_row is not None and math.isnan(one_row.rank_correlation)
    assert math.isnan(one_row.same_group_share) and (one_row.rows, one_row.batches) == (1, 1)
    single_rows = tally([([i], [i]) for i in range(5)])
    assert single_rows is not None and math.isnan(single_rows.same_group_share)
    assert single_rows.rank_correlation == 1.0


def test_add_refuses_arrays_of_different_lengths():
    with pytest.raises(ValueError, match=r"\(3,\) and \(2,\)"):
        ShuffleTally().add(np.arange(3), np.arange(2))
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        ShuffleTally().add(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64))


def _reference(batches: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """Both figures straight from their definitions, a row at a time."""
    positions = [p for ps, _ in batches for p in ps]
    n = len(positions)
    ranks = [sum(q < p for q in positions) + (sum(q == p for q in positions) - 1) / 2 for p in positions]
    mx, my = sum(ranks) / n, (n - 1) / 2
    sxy = sum((r - mx) * (i - my) for i, r in enumerate(ranks))
    sxx = sum((r - mx) ** 2 for r in ranks)
    syy = sum((i - my) ** 2 for i in range(n))
    rho = sxy / math.sqrt(sxx * syy) if sxx > 0 else math.nan
    shares = [
        sum(c * (c - 1) for c in Counter(gs).values()) / (len(gs) * (len(gs) - 1))
        for _, gs in batches
        if len(gs) >= 2
    ]
    return rho, (sum(shares) / len(shares) if shares else math.nan)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.integers(-3, 3)), min_size=1, max_size=9),
        min_size=1,
        max_size=12,
    ),
    st.booleans(),
)
def test_figures_match_their_definitions(rows, sparse):
    # Positions from a small range (many repeats), or far apart (ranked through a sort).
    scale = 10**12 if sparse else 1
    batches = [([p * scale for p, _ in batch], [g for _, g in batch]) for batch in rows]
    q = tally(batches)
    rho, share = _reference(batches)
    assert q is not None and (q.rows, q.batches) == (sum(map(len, rows)), len(rows))
    for got, want in ((q.rank_correlation, rho), (q.same_group_share, share)):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9)


# -- a real loader ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shuffle-quality")
    write_dataset(
        root,
        rows={"train": ROWS, "validation": 0, "test": 0},
        num_shards=SHARDS,
        row_group_rows=GROUP_ROWS,
    )
    return root


def epoch_quality(root: Path, **options) -> ShuffleQuality:
    """One epoch of a rank-0-of-1 loader, tallied from the sample ids of its batches: with
    ``write_dataset``'s layout the id of row j of shard s is its storage position s*300 + j."""
    t = ShuffleTally()
    with ShardLoader(str(root), channel="train", batch_size=BATCH, seed=1, **options) as loader:
        for images, _ in loader:
            positions = np.asarray(ids_of(images), dtype=np.int64)
            shard, row = positions // PER_SHARD, positions % PER_SHARD
            t.add(positions, shard * (PER_SHARD // GROUP_ROWS) + row // GROUP_ROWS)
    q = t.result()
    assert q is not None and (q.rows, q.batches) == (ROWS, ROWS // BATCH)
    return q


def test_unshuffled_loader_yields_stored_order_one_row_group_a_batch(shards):
    q = epoch_quality(shards, shuffle=False)
    assert q.rank_correlation == 1.0
    assert q.same_group_share == 1.0


def test_a_window_holding_every_row_is_a_full_shuffle(shards):
    # The first window of an epoch holds shuffle_window / 8 rows (loaders._internal.shuffle.RAMP): only a
    # window of 8 times the rank's rows shuffles them all together.
    q = epoch_quality(shards, shuffle=True, shuffle_window=8 * ROWS)
    assert abs(q.rank_correlation) < 0.2
    assert q.same_group_share == pytest.approx(FULL_SHUFFLE_SHARE, abs=0.01)


def test_bigger_windows_put_fewer_rows_of_one_row_group_in_a_batch(shards):
    shares = []
    for window in (2 * GROUP_ROWS, 10 * GROUP_ROWS, ROWS, 8 * ROWS):
        q = epoch_quality(shards, shuffle=True, shuffle_window=window)
        # The row groups' order, drawn before any window, already takes rows far from their place.
        assert abs(q.rank_correlation) < 0.2
        shares.append(q.same_group_share)
    assert 1.0 > shares[0] > shares[1] > shares[2] > shares[3] > 0.0
    # A window of two row groups: a batch holds rows of about two (share near 1/2).
    assert shares[0] == pytest.approx(0.5, abs=0.1)
