from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.common.hashing import unit_hash, unit_hashes
from jobs.manifest_steps.split import ALGORITHMS, hash_split, stratified_split
from jobs.manifest_steps.split._stratified import class_quotas

FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}


def _lake(counts: dict[str, int]) -> tuple[list[str], list[str]]:
    keys = [f"{label}/sub/{i:06d}.jpg" for label, n in counts.items() for i in range(n)]
    return keys, [k.split("/")[0] for k in keys]


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_growing_lake_never_moves_assigned_objects_of_unchanged_classes(method):
    keys, labels = _lake({"cat": 300, "dog": 200})
    before = dict(zip(keys, ALGORITHMS[method](keys, labels, FRACTIONS, 7)))
    # A new class appears: nothing of the old classes may move, whichever method.
    more_keys, more_labels = _lake({"cat": 300, "dog": 200, "emu": 50})
    after = dict(zip(more_keys, ALGORITHMS[method](more_keys, more_labels, FRACTIONS, 7)))
    assert all(after[k] == before[k] for k in keys)


def test_hash_split_is_stable_when_a_class_grows():
    keys, labels = _lake({"cat": 500})
    before = dict(zip(keys, hash_split(keys, labels, FRACTIONS, 3)))
    grown_keys, grown_labels = _lake({"cat": 900})
    after = dict(zip(grown_keys, hash_split(grown_keys, grown_labels, FRACTIONS, 3)))
    assert all(after[k] == before[k] for k in keys)


def test_hash_split_is_stratified_within_binomial_bounds():
    counts = {"a": 4000, "b": 2500, "c": 1000}
    keys, labels = _lake(counts)
    got = Counter(zip(labels, hash_split(keys, labels, FRACTIONS, 11)))
    for label, n in counts.items():
        for channel, f in FRACTIONS.items():
            sd = math.sqrt(n * f * (1 - f))
            assert abs(got[label, channel] - n * f) < 4.5 * sd, (label, channel, got[label, channel])


def test_hash_split_depends_on_seed_and_key_only():
    keys, labels = _lake({"a": 200, "b": 200})
    a = hash_split(keys, labels, FRACTIONS, 5)
    shuffled = list(reversed(keys))
    b = dict(zip(shuffled, hash_split(shuffled, list(reversed(labels)), FRACTIONS, 5)))
    assert [b[k] for k in keys] == a
    assert hash_split(keys, labels, FRACTIONS, 6) != a


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 80), min_size=1, max_size=6),
    st.integers(0, 10**6),
)
def test_stratified_split_gives_exact_quotas_per_class(counts, seed):
    keys, labels = _lake(counts)
    got = Counter(zip(labels, stratified_split(keys, labels, FRACTIONS, seed)))
    for label, n in counts.items():
        per_channel = [got[label, c] for c in FRACTIONS]
        assert sum(per_channel) == n
        for c, k in zip(FRACTIONS, per_channel):
            assert abs(k - n * FRACTIONS[c]) < 1, (label, c, k, n)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.floats(0.01, 1), min_size=1, max_size=5))
def test_class_quotas_add_up_and_round_correctly(n, weights):
    total = sum(weights)
    fractions = {f"c{i}": w / total for i, w in enumerate(weights)}
    quotas = class_quotas(n, fractions)
    assert sum(quotas.values()) == n
    assert all(abs(quotas[c] - n * f) < 1 for c, f in fractions.items())


@pytest.mark.slow  # 100,000 keys hashed one by one
def test_unit_hashes_are_unit_hash_bit_for_bit() -> None:
    # Many keys: random printable and non-ASCII text, separators, a lone surrogate, the empty key.
    rng = np.random.default_rng(7)
    alphabet = [*"abcXYZ019/._- ", "é", "ß", "猫", "🐈", "\x1f", "\udc80"]
    keys = [
        "",
        "\x1f",
        "cat/1.jpg",
        *("".join(rng.choice(alphabet, size=rng.integers(1, 40))) for _ in range(50_000)),
    ]
    keys += [f"class_{i % 997:04d}/img_{i:010d}.png" for i in range(50_000)]
    for head in (("deal", 0, "train"), ("deal", 2**32 - 1, "validation"), ("shuffle", 7, "train", 3)):
        got = unit_hashes(head, keys)
        want = np.array([unit_hash(*head, k) for k in keys])
        assert got.dtype == np.float64 and np.array_equal(got, want), head
    copies = rng.integers(0, 4, len(keys)).tolist()
    head = ("shuffle", 11, "test", 2)
    assert np.array_equal(
        unit_hashes(head, keys, copies), [unit_hash(*head, k, c) for k, c in zip(keys, copies)]
    )
    assert unit_hashes(head, []).shape == (0,)
