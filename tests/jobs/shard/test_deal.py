"""The plan from aggregates (:mod:`jobs.shard_steps.deal`) is the reference plan's
(:func:`tests.helpers.reference_plan.make_plan`, from every row): same shards, same rows, same
positions, same pad copies and drops, for every input."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.shard_steps.deal import deal_from_counts
from jobs.shard_steps.deal_rows import class_slots
from lakeshard.errors import ShardError
from tests.helpers.reference_plan import make_plan, plan_of_rows


def _same(a, b) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("source", "shard", "position", "is_pad", "dropped", "padded")
    ) and (a.num_shards, a.rows_per_shard) == (b.num_shards, b.rows_per_shard)


def _slots(keys: list[str], labels: list[int], *, seed: int, channel: str) -> np.ndarray:
    """Each row's slot, computed class by class as the workers do."""
    counts = Counter(labels)
    start, at = {}, 0
    for c in sorted(counts):
        start[c], at = at, at + counts[c]
    slots = np.empty(len(keys), dtype=np.int64)
    for c in counts:
        idx = [i for i, lab in enumerate(labels) if lab == c]
        slots[idx] = class_slots([keys[i] for i in idx], seed=seed, channel=channel, start=start[c])
    return slots


@st.composite
def _cases(draw):
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=12))
    labels_present = draw(st.permutations(range(len(sizes) + 3)))[: len(sizes)]  # gaps in the labels
    keys, labels = [], []
    for label, n in zip(labels_present, sizes):
        for i in range(n):
            keys.append(f"c{label}/{draw(st.integers(0, 10**6))}-{i}.png")
            labels.append(label)
    order = draw(st.permutations(range(len(keys))))  # the rows arrive in any order
    keys, labels = [keys[i] for i in order], [labels[i] for i in order]
    total = len(keys)
    if total and draw(st.booleans()):
        rejected = sorted(draw(st.sets(st.integers(0, total - 1), max_size=total)))
    elif total:
        rng = random.Random(draw(st.integers(0, 2**32)))
        rejected = sorted(i for i in range(total) if rng.random() < draw(st.floats(0, 0.5)))
    else:
        rejected = []
    return (
        keys,
        labels,
        rejected,
        draw(st.integers(1, 9)),
        draw(st.sampled_from(["drop", "pad"])),
        draw(st.integers(0, 1000)),
        draw(st.sampled_from(["train", "validation"])),
    )


@pytest.mark.slow  # 400 examples
@settings(max_examples=400, deadline=None)
@given(_cases())
def test_the_plan_from_counts_is_make_plans_plan(case):
    keys, labels, rejected, num_shards, remainder, seed, channel = case
    kwargs = dict(num_shards=num_shards, seed=seed, channel=channel, remainder=remainder)
    try:
        want = make_plan(keys, labels, rejected=rejected, **kwargs)
    except ShardError as exc:
        if "twice" in str(exc):
            return  # drawn keys collided: not a valid channel
        with pytest.raises(ShardError) as got:
            slots = _slots(keys, labels, seed=seed, channel=channel) if keys else np.empty(0, np.int64)
            deal_from_counts(Counter(labels), rejected=slots[rejected].tolist(), **kwargs)
        assert str(got.value) == str(exc)  # the same refusal, worded the same
        return
    slots = _slots(keys, labels, seed=seed, channel=channel)
    deal = deal_from_counts(Counter(labels), rejected=slots[rejected].tolist(), **kwargs)
    got = plan_of_rows(deal, keys, labels)
    assert _same(got, want), (deal, got, want)
    # The deal is small: one exception per rejected, moved, dropped or padded row.
    assert len(deal.moved) <= 2 * len(rejected) + 2 * num_shards


def test_a_large_channel_plans_from_counts_with_few_exceptions():
    counts = {c: 10_000 + 37 * c for c in range(100)}
    rng = np.random.default_rng(0)
    rejected = rng.choice(sum(counts.values()), size=300, replace=False)
    deal = deal_from_counts(
        counts, num_shards=64, seed=3, channel="train", remainder="pad", rejected=rejected
    )
    survivors = sum(counts.values()) - 300
    assert deal.rows_per_shard * 64 == survivors + (-survivors) % 64
    assert len(deal.pads) == (-survivors) % 64
    assert len(deal.moved) <= 2 * 300 + 2 * 64
    assert set(deal.rejected) == set(rejected.tolist())


def test_rejected_slots_out_of_range_are_refused():
    with pytest.raises(ShardError, match="rejected slot 5 is out of range for channel 'train' of 5 rows"):
        deal_from_counts({0: 5}, num_shards=2, seed=0, channel="train", rejected=[5])
