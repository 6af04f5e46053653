"""The mixture plan (``loaders._internal.mixing``), property-tested: exact shares, equal ranks, every
position once across legs, and batches close to the asked proportions."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeshard.errors import ConfigError, LoaderError
from loaders._internal.elastic import Leg
from loaders._internal.mixing import (
    REST_PASS,
    MixPlan,
    deal,
    epoch_samples,
    epoch_spans,
    interleave,
    locate,
    shares,
)

weights_st = st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=1, max_size=4)


@given(weights=weights_st, total=st.integers(0, 10_000))
def test_shares_are_within_one_row_of_exact_and_sum_to_the_total(weights, total):
    parts = shares(weights, total)
    assert sum(parts) == total
    for w, n in zip(weights, parts, strict=True):
        assert abs(n - w / sum(weights) * total) < 1


@given(
    counts=st.lists(st.integers(0, 300), min_size=1, max_size=4).filter(lambda c: sum(c) > 0), data=st.data()
)
def test_every_run_of_the_interleaving_holds_each_source_close_to_its_share(counts, data):
    """Within one row with two sources; within ``(k + 1) / 2`` rows with ``k``."""
    order = interleave(counts)
    bound = _bound(len(counts))
    n = sum(counts)
    assert Counter(order.tolist()) == {s: c for s, c in enumerate(counts) if c}
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    got = np.bincount(order[lo:hi], minlength=len(counts))
    for s, c in enumerate(counts):
        assert abs(got[s] - (hi - lo) * c / n) <= bound + 1e-9, (s, lo, hi)


def _bound(sources: int) -> float:
    return 1.0 if sources <= 2 else (sources + 1) / 2


@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=4), world=st.integers(1, 8))
def test_deal_gives_every_rank_the_same_total_and_each_position_once(lengths, world):
    total = sum(lengths)
    lengths[0] += (-total) % world  # a multiple of the world size, as every leg's rest is
    remaining = [[(100 * s, 100 * s + n)] if n else [] for s, n in enumerate(lengths)]
    ranks = deal(remaining, world)
    assert len({sum(r.counts) for r in ranks}) == 1
    for s, n in enumerate(lengths):
        per_rank = [r.counts[s] for r in ranks]
        assert max(per_rank) - min(per_rank) <= 1
        got = [x for r in ranks for a, b in r.spans[s] for x in range(a, b)]
        assert got == list(range(100 * s, 100 * s + n))  # rank after rank, in order


def test_deal_refuses_a_total_the_ranks_cannot_share():
    with pytest.raises(LoaderError, match="7 samples cannot be dealt evenly to 2 ranks"):
        deal([[(0, 7)]], 2)


def _positions(plan: MixPlan, leg: int, rank: int, lo: int, hi: int) -> Counter:
    """(source, stream position) of positions ``[lo, hi)`` of a rank's sequence in a leg."""
    share = plan.share(leg, rank)
    taken_before = share.taken(lo)
    out: Counter = Counter()
    for s in range(len(share.spans)):
        flat = [x for a, b in share.spans[s] for x in range(a, b)]
        n = int(np.sum(share.order[lo:hi] == s))
        out.update((s, x) for x in flat[taken_before[s] : taken_before[s] + n])
    return out


@settings(max_examples=60, deadline=None)
@given(
    weights=weights_st,
    rows=st.lists(st.integers(1, 50), min_size=4, max_size=4),
    epoch=st.integers(0, 5),
    g=st.sampled_from([12, 24, 36]),
    batches=st.integers(1, 6),
    data=st.data(),
)
def test_every_position_of_an_epoch_is_read_once_across_legs(weights, rows, epoch, g, batches, data):
    """Legs at world sizes dividing the global batch: what each leg consumed plus the last leg's
    whole sequences are the epoch's positions of every source, each once, and every rank of a
    leg has the same number of batches."""
    per_source = shares(weights, g * batches)
    sizes = data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=3))
    legs: list[Leg] = []
    done = 0
    for i, w in enumerate(sizes):
        last = i == len(sizes) - 1
        k = 0 if last else data.draw(st.integers(0, batches - done))
        legs.append(Leg(w, g // w, k))
        done += k
    rows = rows[: len(weights)]
    plan = MixPlan(per_source, rows, epoch, legs)
    seen: Counter = Counter()
    for i, leg in enumerate(legs):
        last = i == len(legs) - 1
        n = plan.num_batches(i)
        assert n == batches - plan.batches_before(i)
        for r in range(leg.world_size):
            assert sum(plan.share(i, r).counts) == n * leg.batch_size
            stop = n * leg.batch_size if last else leg.batches * leg.batch_size
            seen += _positions(plan, i, r, 0, stop)
    want = Counter(
        (s, x)
        for s, n in enumerate(per_source)
        for a, b in epoch_spans(n, rows[s], epoch)
        for x in range(a, b)
    )
    assert seen == want


@given(
    weights=weights_st, world=st.sampled_from([1, 2, 4]), batch=st.integers(1, 40), batches=st.integers(1, 8)
)
def test_each_batch_holds_each_source_close_to_its_weight(weights, world, batch, batches):
    """Within the interleaving's bound of the rank's own share, and one row more of ``batch *
    weight`` (the rank's share of a source is within a row of the epoch's)."""
    total = world * batch * batches
    per_source = shares(weights, total)
    plan = MixPlan(per_source, [7] * len(weights), 0, [Leg(world, batch, 0)])
    for r in range(world):
        share = plan.share(0, r)
        n = sum(share.counts)
        for j in range(batches):
            got = np.bincount(share.order[j * batch : (j + 1) * batch], minlength=len(weights))
            for s, w in enumerate(weights):
                assert abs(got[s] - batch * share.counts[s] / n) <= _bound(len(weights)) + 1e-9
                assert abs(got[s] - batch * w / sum(weights)) <= _bound(len(weights)) + 1


@given(n=st.integers(0, 200), rows=st.integers(1, 60), epochs=st.integers(1, 8))
def test_a_source_gives_its_share_fairly_epoch_after_epoch(n, rows, epochs):
    """A larger source: consecutive runs of its passes, every row before any repeats. A smaller
    one: each row ``k`` or ``k + 1`` times an epoch (``n = k * rows + m``), and over epochs no
    row more than once more than any other."""
    k, m = divmod(n, rows)
    seen: list[tuple[int, int]] = []
    total: Counter = Counter()
    for e in range(epochs):
        rows_of = [locate(x, rows) for a, b in epoch_spans(n, rows, e) for x in range(a, b)]
        assert len(rows_of) == n
        per_row = Counter(r for _, r in rows_of)
        if k:
            assert set(per_row.values()) <= {k, k + 1} and len(per_row) == rows
        else:
            assert set(per_row.values()) <= {1} or e * m % rows + m > rows  # a run crossing passes
        seen += rows_of
        total.update(per_row)
        assert max(total.values(), default=0) - min(total.get(r, 0) for r in range(rows)) <= 1
    if k == 0:
        assert seen == [divmod(x, rows) for x in range(epochs * m)]


def test_epochs_take_consecutive_runs_of_each_stream():
    plan0 = MixPlan([6, 2], [100, 10], 0, [Leg(2, 4, 0)])
    plan1 = MixPlan([6, 2], [100, 10], 1, [Leg(2, 4, 0)])
    assert plan0.share(0, 0).spans == (((0, 3),), ((0, 1),))
    assert plan0.share(0, 1).spans == (((3, 6),), ((1, 2),))
    assert plan1.share(0, 0).spans == (((6, 9),), ((2, 3),))
    plan = MixPlan([12, 24], [5, 10], 1, [Leg(2, 18, 0)])  # 2 passes + 2 rest rows; 2 passes + 4 rest
    dealt = [[span for r in range(2) for span in plan.share(0, r).spans[s]] for s in range(2)]
    assert dealt == [
        [(10, 16), (16, 20), (REST_PASS * 5 + 2, REST_PASS * 5 + 4)],
        [(20, 32), (32, 40), (REST_PASS * 10 + 4, REST_PASS * 10 + 8)],
    ]


def test_the_plan_refuses_another_global_batch_and_too_many_batches():
    with pytest.raises(LoaderError, match="global batch must not change"):
        MixPlan([8, 8], [5, 5], 0, [Leg(2, 4, 1), Leg(4, 4, 0)])
    with pytest.raises(LoaderError, match="leg 0 has 2 batches per rank, got 3 consumed"):
        MixPlan([8, 8], [5, 5], 0, [Leg(2, 4, 3)])


def test_samples_per_epoch_rounds_down_to_whole_global_batches():
    assert epoch_samples(100, 24) == 96
    with pytest.raises(ConfigError, match="samples_per_epoch 20 is less than one global batch"):
        epoch_samples(20, 24)
