from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.common.hashing import unit_hash
from lakeshard.errors import ShardError
from tests.helpers.reference_plan import make_plan


def _rows(class_sizes: list[int]) -> tuple[list[str], list[int]]:
    keys, labels = [], []
    for label, n in enumerate(class_sizes):
        for i in range(n):
            keys.append(f"c{label}/{i:05d}.png")
            labels.append(label)
    return keys, labels


def _assert_invariants(plan, labels, rejected, num_shards, remainder):
    total = len(labels)
    rejected = set(rejected)
    survivors = total - len(rejected)

    # Equal shards, and positions 0..n-1 within each.
    sizes = np.bincount(plan.shard, minlength=num_shards)
    assert sizes.tolist() == [plan.rows_per_shard] * num_shards
    for s in range(num_shards):
        assert sorted(plan.position[plan.shard == s].tolist()) == list(range(plan.rows_per_shard))

    # Every row not rejected is placed once, or dropped; padding repeats rows that are also placed.
    placed = Counter(plan.source[~plan.is_pad].tolist())
    assert all(v == 1 for v in placed.values())
    assert set(placed) | set(plan.dropped.tolist()) == set(range(total)) - rejected
    assert not set(placed) & set(plan.dropped.tolist())
    assert set(plan.source[plan.is_pad].tolist()) == set(plan.padded.tolist()) <= set(placed)
    if remainder == "drop":
        assert len(plan.dropped) == survivors % num_shards and not plan.is_pad.any()
    else:
        assert len(plan.dropped) == 0
        assert int(plan.is_pad.sum()) == (-survivors) % num_shards
        # ``padded`` lists every pad row, and a class repeats an image only once all its
        # images have as many copies: the copies of any two rows of a class differ by at most one.
        assert sorted(plan.padded.tolist()) == sorted(plan.source[plan.is_pad].tolist())
        copies = Counter(plan.padded.tolist())
        for c in set(labels):
            mine = [copies.get(i, 0) for i in placed if labels[i] == c]
            assert not mine or max(mine) - min(mine) <= 1, (c, mine)

    # Each class's count in any two shards differs by at most one (pad copies included).
    per_shard = np.zeros((max(labels) + 1, num_shards), dtype=np.int64)
    np.add.at(per_shard, (np.asarray(labels)[plan.source], plan.shard), 1)
    spread = per_shard.max(axis=1) - per_shard.min(axis=1)
    assert (spread <= 1).all(), per_shard


class _Case(NamedTuple):
    keys: list[str]
    labels: list[int]
    num_shards: int
    remainder: str
    seed: int
    rejected: set[int]


def _plan(case: _Case, rejected: set[int] | None = None):
    """The plan with ``rejected`` (the case's if None), or None after checking that make_plan
    refuses it for the channel (no survivors, or too few to drop)."""
    rejected = case.rejected if rejected is None else rejected
    survivors = len(case.keys) - len(rejected)
    kwargs = dict(
        num_shards=case.num_shards,
        seed=case.seed,
        channel="train",
        remainder=case.remainder,
        rejected=sorted(rejected),
    )
    if survivors == 0 or (case.remainder == "drop" and survivors < case.num_shards):
        with pytest.raises(ShardError, match="'train'"):
            make_plan(case.keys, case.labels, **kwargs)
        return None
    return make_plan(case.keys, case.labels, **kwargs)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=8),
    st.integers(1, 9),
    st.sampled_from(["drop", "pad"]),
    st.integers(0, 1000),
)
def test_plan_invariants_hold_for_every_input(class_sizes, num_shards, remainder, seed):
    keys, labels = _rows(class_sizes)
    if not keys:
        with pytest.raises(ShardError, match="'train' has no rows"):
            make_plan(keys, labels, num_shards=num_shards, seed=seed, channel="train", remainder=remainder)
        return
    plan = _plan(_Case(keys, labels, num_shards, remainder, seed, set()))
    if plan is not None:
        _assert_invariants(plan, labels, [], num_shards, remainder)


@st.composite
def _reject_cases(draw, max_classes=40, max_class_size=14) -> _Case:
    """Many small classes, a shard count, a policy, a seed and a random reject set (sparse or dense)."""
    class_sizes = draw(st.lists(st.integers(0, max_class_size), min_size=1, max_size=max_classes))
    total = sum(class_sizes)
    if total == 0:
        class_sizes = [*class_sizes, 1]
        total = 1
    if draw(st.booleans()):
        rejected = draw(st.sets(st.integers(0, total - 1), max_size=min(total, 12)))
    else:
        fraction = draw(st.floats(0, 1))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        rejected = set(np.flatnonzero(rng.random(total) < fraction).tolist())
    keys, labels = _rows(class_sizes)
    return _Case(
        keys,
        labels,
        draw(st.integers(1, 9)),
        draw(st.sampled_from(["drop", "pad"])),
        draw(st.integers(0, 1000)),
        rejected,
    )


@settings(max_examples=200, deadline=None)
@given(_reject_cases())
def test_plan_invariants_hold_with_rejects(case):
    plan = _plan(case)
    if plan is not None:
        _assert_invariants(plan, case.labels, case.rejected, case.num_shards, case.remainder)


def _moved(p0, pr, rejected) -> int:
    """Rows not rejected whose shard (or being dropped) differs between the plans, plus pad copies
    that are not in the same shard in both (a copy in one plan only counts once, a copy that
    changed shard twice)."""

    def where(plan):
        out = {int(r): int(s) for r, s in zip(plan.source[~plan.is_pad], plan.shard[~plan.is_pad])}
        out.update({int(r): "dropped" for r in plan.dropped})
        return out

    def pads(plan):
        return Counter(zip(plan.source[plan.is_pad].tolist(), plan.shard[plan.is_pad].tolist()))

    a, b = where(p0), where(pr)
    rows = sum(1 for r in set(a) | set(b) if r not in rejected and a.get(r) != b.get(r))
    pads_a, pads_b = pads(p0), pads(pr)
    return rows + sum(((pads_a - pads_b) + (pads_b - pads_a)).values())


@settings(max_examples=200, deadline=None)
@given(_reject_cases())
def test_rejects_move_at_most_two_rows_each_plus_the_remainder(case):
    pr = _plan(case)
    if pr is None:
        return
    p0 = _plan(case, rejected=set())
    moved = _moved(p0, pr, case.rejected)
    assert moved <= 2 * len(case.rejected) + 2 * (case.num_shards - 1)
    # Finer: the remainder accounts for what moves beyond two rows per reject.
    remainder_rows = len(p0.dropped) + len(pr.dropped) + int(p0.is_pad.sum()) + int(pr.is_pad.sum())
    assert moved <= 2 * len(case.rejected) + remainder_rows


def _order_by_spec(plan, keys, seed, channel):
    """Each shard's entries in the documented order: (unit_hash("shuffle", seed, channel, shard, key,
    copy), key, copy), copies of one row numbered 1, 2, ... in shard order."""
    copy_no: Counter[int] = Counter()
    entries = []
    for i in np.lexsort((plan.position, plan.shard)):
        src, shard = int(plan.source[i]), int(plan.shard[i])
        copy = 0
        if plan.is_pad[i]:
            copy_no[src] += 1
            copy = copy_no[src]
        entries.append(
            (shard, unit_hash("shuffle", seed, channel, shard, keys[src], copy), keys[src], copy, i)
        )
    return sorted(entries)


@settings(max_examples=150, deadline=None)
@given(_reject_cases())
def test_positions_follow_the_shuffle_hash_and_survive_repair(case):
    case = case._replace(remainder="pad")  # pad: copies are ranked too
    pr = _plan(case)
    if pr is None:
        return
    p0 = _plan(case, rejected=set())

    for plan in (p0, pr):
        entries = _order_by_spec(plan, case.keys, case.seed, "train")
        for shard in range(case.num_shards):
            mine = [e[-1] for e in entries if e[0] == shard]
            assert plan.position[mine].tolist() == list(range(plan.rows_per_shard))

    # Two rows in the same shard in both plans keep their relative order.
    for shard in range(case.num_shards):

        def originals(plan, shard=shard):
            idx = np.flatnonzero((plan.shard == shard) & ~plan.is_pad)
            return plan.source[idx[np.argsort(plan.position[idx])]].tolist()

        before, after = originals(p0), originals(pr)
        common = set(before) & set(after)
        assert [r for r in before if r in common] == [r for r in after if r in common]


@settings(max_examples=60, deadline=None)
@given(_reject_cases(max_classes=10, max_class_size=20))
def test_plan_does_not_depend_on_input_order_with_rejects(case):
    a = _plan(case)
    if a is None:
        return
    perm = np.random.default_rng(case.seed).permutation(len(case.keys))
    new_index = np.argsort(perm)  # old row i is row new_index[i] of the permuted input
    permuted = case._replace(
        keys=[case.keys[i] for i in perm],
        labels=[case.labels[i] for i in perm],
        rejected={int(new_index[r]) for r in case.rejected},
    )
    b = _plan(permuted)

    assert _placement(a, case.keys) == _placement(b, permuted.keys)
    assert sorted(case.keys[i] for i in a.dropped) == sorted(permuted.keys[i] for i in b.dropped)
    assert sorted(case.keys[i] for i in a.padded) == sorted(permuted.keys[i] for i in b.padded)


def _placement(plan, keys):
    """(key, shard, position, is_pad) of every output row, sorted: a plan as keys see it."""
    return sorted(
        (keys[src], int(sh), int(pos), bool(pad))
        for src, sh, pos, pad in zip(plan.source, plan.shard, plan.position, plan.is_pad)
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=5), st.integers(1, 5), st.integers(0, 99))
def test_plan_does_not_depend_on_input_order(class_sizes, num_shards, seed):
    keys, labels = _rows(class_sizes)
    if len(keys) < num_shards:
        return
    a = make_plan(keys, labels, num_shards=num_shards, seed=seed, channel="train")
    perm = np.random.default_rng(seed).permutation(len(keys))
    b = make_plan(
        [keys[i] for i in perm], [labels[i] for i in perm], num_shards=num_shards, seed=seed, channel="train"
    )
    assert _placement(a, keys) == _placement(b, [keys[i] for i in perm])


def _same(a, b) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("source", "shard", "position", "is_pad", "dropped", "padded")
    ) and (a.num_shards, a.rows_per_shard) == (b.num_shards, b.rows_per_shard)


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_no_rejects_given_any_way_is_the_first_plan(remainder):
    keys, labels = _rows([7, 12, 3, 9])
    kwargs = dict(num_shards=4, seed=5, channel="train", remainder=remainder)
    p0 = make_plan(keys, labels, **kwargs)
    for none in (None, [], (), np.array([], dtype=np.int64), np.zeros(len(keys), dtype=bool)):
        assert _same(p0, make_plan(keys, labels, rejected=none, **kwargs))


def test_rejects_as_indices_or_as_a_mask_give_the_same_plan():
    keys, labels = _rows([7, 12, 3, 9])
    mask = np.zeros(len(keys), dtype=bool)
    mask[[0, 8, 9, 30]] = True
    by_mask = make_plan(keys, labels, num_shards=3, seed=2, channel="train", rejected=mask)
    by_index = make_plan(keys, labels, num_shards=3, seed=2, channel="train", rejected=[30, 8, 0, 9, 8])
    by_list_mask = make_plan(keys, labels, num_shards=3, seed=2, channel="train", rejected=mask.tolist())
    assert _same(by_mask, by_index) and _same(by_mask, by_list_mask)
    assert not {0, 8, 9, 30} & set(by_mask.source.tolist())


def _dealt(class_sizes: list[int], seed: int) -> tuple[list[str], list[int], list[list[int]]]:
    """Rows, and each class's rows in deal order: by (unit_hash("deal", seed, "train", key), key)."""
    keys, labels = _rows(class_sizes)
    order = [
        sorted(
            (i for i, x in enumerate(labels) if x == c),
            key=lambda i: (unit_hash("deal", seed, "train", keys[i]), keys[i]),
        )
        for c in range(len(class_sizes))
    ]
    return keys, labels, order


def _shards(plan, num_shards):
    return [
        sorted((int(r), bool(p)) for r, p, s in zip(plan.source, plan.is_pad, plan.shard) if s == shard)
        for shard in range(num_shards)
    ]


@pytest.mark.parametrize("seed", [0, 7])
def test_remainder_of_the_first_plan_by_hand(seed):
    # Slots a0 a1 a2 b0 b1 -> shards 0 1 0 1 0: shard 0 holds three rows, shard 1 two.
    keys, labels, ((a0, a1, a2), (b0, b1)) = _dealt([3, 2], seed)
    drop = make_plan(keys, labels, num_shards=2, seed=seed, channel="train", remainder="drop")
    # Class A has its extra row in shard 0, B has none: A's row there with the highest slot goes.
    assert _shards(drop, 2) == [sorted([(a0, False), (b1, False)]), sorted([(a1, False), (b0, False)])]
    assert drop.dropped.tolist() == [a2]
    pad = make_plan(keys, labels, num_shards=2, seed=seed, channel="train", remainder="pad")
    # Shard 1 gets a copy: both classes are at their lowest there, B is the smaller, b0 is in shard 1.
    assert _shards(pad, 2) == [
        sorted([(a0, False), (a2, False), (b1, False)]),
        sorted([(a1, False), (b0, False), (b0, True)]),
    ]
    assert pad.padded.tolist() == [b0]


@pytest.mark.parametrize("seed", [0, 3])
def test_one_reject_moves_one_row_by_hand(seed):
    # Slots a0 a1 a2 b0 b1 b2 -> shards 0 1 0 1 0 1; P0 is {a0 a2 b1} {a1 b0 b2}.
    keys, labels, ((a0, a1, a2), (b0, b1, b2)) = _dealt([3, 3], seed)
    p0 = make_plan(keys, labels, num_shards=2, seed=seed, channel="train")
    assert _shards(p0, 2) == [
        sorted([(a0, False), (a2, False), (b1, False)]),
        sorted([(a1, False), (b0, False), (b2, False)]),
    ]
    # a0 rejected: a2 fills its hole (same shard), shard 1 holds one row more; B has its extra
    # there, so its row with the highest slot, b2, is dropped. Only b2 moves.
    drop = make_plan(keys, labels, num_shards=2, seed=seed, channel="train", rejected=[a0])
    assert _shards(drop, 2) == [sorted([(a2, False), (b1, False)]), sorted([(a1, False), (b0, False)])]
    assert drop.dropped.tolist() == [b2]
    # With pad nothing moves: shard 0 gets a copy of a2 (A is the smaller class, a2 is there).
    pad = make_plan(keys, labels, num_shards=2, seed=seed, channel="train", remainder="pad", rejected=[a0])
    assert _shards(pad, 2) == [
        sorted([(a2, False), (a2, True), (b1, False)]),
        sorted([(a1, False), (b0, False), (b2, False)]),
    ]


@pytest.mark.parametrize("seed", [1, 4])
def test_two_rejects_rebalance_the_totals_by_hand(seed):
    # Slots a0 a1 b0 b1 c0 c1 -> shards 0 1 0 1 0 1; P0 is {a0 b0 c0} {a1 b1 c1}.
    keys, labels, ((a0, a1), (b0, b1), (c0, c1)) = _dealt([2, 2, 2], seed)
    # a0 and b0 rejected: a1 and b1 fill their classes' first slots, both in shard 0, which now
    # holds three rows to shard 1's one; A (lowest label with its extra in 0) sends a1 back to 1.
    # Only b1 has moved.
    plan = make_plan(keys, labels, num_shards=2, seed=seed, channel="train", rejected=[b0, a0])
    assert _shards(plan, 2) == [sorted([(b1, False), (c0, False)]), sorted([(a1, False), (c1, False)])]
    assert plan.dropped.tolist() == []


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


def test_plan_says_how_many_were_rejected_when_too_few_are_left():
    keys, labels = _rows([5])
    with pytest.raises(
        ShardError, match=r"'validation' has 2 rows left \(3 of 5 rejected\), fewer than num_shards=4"
    ):
        make_plan(keys, labels, num_shards=4, seed=0, channel="validation", rejected=[0, 1, 2])
    with pytest.raises(ShardError, match="'validation' has no rows to shard: all 5 were rejected"):
        make_plan(
            keys, labels, num_shards=1, seed=0, channel="validation", remainder="pad", rejected=range(5)
        )


@pytest.mark.parametrize(
    ("rejected", "message"),
    [
        ([0, 5], "rejected row index 5 is out of range for channel 'train' of 5 rows"),
        ([-1], "rejected row index -1"),
        (np.zeros(4, dtype=bool), r"rejected mask for channel 'train' has shape \(4,\), expected \(5,\)"),
        ([0.5], "rejected must be row indices or a boolean mask, got float64"),
    ],
)
def test_plan_refuses_bad_rejects_naming_them(rejected, message):
    keys, labels = _rows([5])
    with pytest.raises(ShardError, match=message):
        make_plan(keys, labels, num_shards=1, seed=0, channel="train", rejected=rejected)


def test_plan_refuses_a_key_given_twice():
    with pytest.raises(ShardError, match="key 'a/1' appears twice in channel 'train'"):
        make_plan(["a/1", "a/2", "a/1"], [0, 0, 0], num_shards=1, seed=0, channel="train")


def test_pad_spreads_over_the_smallest_classes_and_distinct_images():
    # Three one-row classes in eight shards: five pad rows. Piling them on the first class gave
    # 6/1/1 (five copies of one image); spread, each class ends with 3, 3 or 2 rows.
    keys, labels = _rows([1, 1, 1])
    plan = make_plan(keys, labels, num_shards=8, seed=0, channel="test", remainder="pad")
    per_class = Counter(labels[i] for i in plan.source.tolist())
    assert sorted(per_class.values()) == [2, 3, 3]
    assert len(plan.padded) == 5
    # Two images in the smallest class, one in the others: the pad goes to the smallest class,
    # to the image that has no copy yet.
    keys, labels = _rows([2, 4, 5])
    plan = make_plan(keys, labels, num_shards=4, seed=0, channel="train", remainder="pad")
    padded = plan.padded.tolist()
    assert [labels[i] for i in padded] == [0] and len(set(padded)) == 1
    # Three one-row classes and a large one in five shards: three pad rows, one per small class
    # (the large class is at its lowest nowhere it could take one without unbalancing itself).
    keys, labels = _rows([1, 1, 1, 9])
    plan = make_plan(keys, labels, num_shards=5, seed=1, channel="train", remainder="pad")
    assert sorted(labels[i] for i in plan.padded.tolist()) == [0, 1, 2]
