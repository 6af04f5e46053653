from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.errors import ShardError
from jobs.plan import make_plan


def _rows(class_sizes: list[int]) -> tuple[list[str], list[int]]:
    keys, labels = [], []
    for label, n in enumerate(class_sizes):
        for i in range(n):
            keys.append(f"c{label}/{i:05d}.png")
            labels.append(label)
    return keys, labels


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=8), st.integers(1, 9), st.sampled_from(["drop", "pad"]),
       st.integers(0, 1000))
def test_plan_invariants_hold_for_every_input(class_sizes, num_shards, remainder, seed):
    keys, labels = _rows(class_sizes)
    total = len(keys)
    if total == 0 or (remainder == "drop" and total < num_shards):
        with pytest.raises(ShardError):
            make_plan(keys, labels, num_shards=num_shards, seed=seed, channel="train", remainder=remainder)
        return
    plan = make_plan(keys, labels, num_shards=num_shards, seed=seed, channel="train", remainder=remainder)

    # Equal shards, and positions 0..n-1 within each.
    sizes = np.bincount(plan.shard, minlength=num_shards)
    assert sizes.tolist() == [plan.rows_per_shard] * num_shards
    for s in range(num_shards):
        assert sorted(plan.position[plan.shard == s].tolist()) == list(range(plan.rows_per_shard))

    # Every row is placed once, or dropped; padding repeats rows that are also placed.
    placed = Counter(plan.source[~plan.is_pad].tolist())
    assert all(v == 1 for v in placed.values())
    assert set(placed) | set(plan.dropped.tolist()) == set(range(total))
    assert not set(placed) & set(plan.dropped.tolist())
    assert set(plan.source[plan.is_pad].tolist()) == set(plan.padded.tolist()) <= set(placed)
    if remainder == "drop":
        assert len(plan.dropped) == total % num_shards and not plan.is_pad.any()
    else:
        assert len(plan.dropped) == 0
        assert int(plan.is_pad.sum()) == (-total) % num_shards

    # Each class's count in any two shards differs by at most one.
    for label in set(labels):
        per_shard = [int(np.sum((plan.shard == s) & (np.asarray(labels)[plan.source] == label)))
                     for s in range(num_shards)]
        assert max(per_shard) - min(per_shard) <= 1, (label, per_shard)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=5), st.integers(1, 5), st.integers(0, 99))
def test_plan_does_not_depend_on_input_order(class_sizes, num_shards, seed):
    keys, labels = _rows(class_sizes)
    if len(keys) < num_shards:
        return
    a = make_plan(keys, labels, num_shards=num_shards, seed=seed, channel="train")
    perm = np.random.default_rng(seed).permutation(len(keys))
    b = make_plan([keys[i] for i in perm], [labels[i] for i in perm], num_shards=num_shards, seed=seed,
                  channel="train")

    def placement(plan, ks):
        return sorted((ks[src], int(sh), int(pos)) for src, sh, pos in zip(plan.source, plan.shard, plan.position))

    assert placement(a, keys) == placement(b, [keys[i] for i in perm])


def test_plan_shuffles_within_shards_and_seed_changes_order():
    keys, labels = _rows([50, 50])
    a = make_plan(keys, labels, num_shards=2, seed=1, channel="train")
    b = make_plan(keys, labels, num_shards=2, seed=2, channel="train")
    order_a = [keys[i] for i in a.source[np.lexsort((a.position, a.shard))]]
    order_b = [keys[i] for i in b.source[np.lexsort((b.position, b.shard))]]
    assert order_a != order_b
    first = order_a[:50]
    assert first != sorted(first)  # not in key order: shuffled
    assert len({k.split("/")[0] for k in first[:10]}) == 2  # classes interleaved, not in blocks


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_plan_rejects_bad_num_shards_with_the_value(bad):
    with pytest.raises(ShardError, match=repr(bad).replace(".", r"\.")):
        make_plan(["a/1"], [0], num_shards=bad, seed=0, channel="train")


def test_plan_names_channel_when_too_few_rows_to_drop():
    with pytest.raises(ShardError, match="'validation' has 2 rows, fewer than num_shards=4"):
        make_plan(["a/1", "a/2"], [0, 0], num_shards=4, seed=0, channel="validation")
