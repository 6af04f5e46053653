"""The ``stratified`` split of images with several labels (iterative stratification): every
image in one channel, each label's images spread as the fractions ask, the same channels for a
seed whatever order the images come in."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.manifest_steps.split import MULTI_LABEL_ALGORITHMS, hash_split, iterative_split

SPLIT = {"train": 0.7, "validation": 0.15, "test": 0.15}


def _images(seed: int, n: int, labels: int) -> tuple[list[str], list[list[str]]]:
    """``n`` images with one to three of ``labels`` labels each, label ``k`` about half as
    often as label ``k - 1`` (a long tail)."""
    rng = random.Random(seed)
    names = [f"l{k}" for k in range(labels)]
    sets = []
    for _ in range(n):
        chosen = {name for k, name in enumerate(names) if rng.random() < 0.6 / 2**k}
        sets.append(sorted(chosen or {rng.choice(names)}))
    return [f"img_{i:05d}.png" for i in range(n)], sets


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(60, 400), st.integers(1, 6))
def test_each_label_is_spread_as_the_fractions_ask(seed: int, n: int, labels: int) -> None:
    keys, sets = _images(seed, n, labels)
    channels = iterative_split(keys, sets, SPLIT, seed)
    assert set(channels) <= set(SPLIT) and len(channels) == n
    for label in {x for s in sets for x in s}:
        got = [c for c, s in zip(channels, sets) if label in s]
        for channel, fraction in SPLIT.items():
            # within two images of the fraction for a label of at least 1/fraction images
            if len(got) * fraction >= 1:
                assert got.count(channel) >= 1, (label, channel, len(got))
            assert abs(got.count(channel) - fraction * len(got)) <= 2 + 0.05 * len(got), (label, channel)
    for channel, fraction in SPLIT.items():  # the images, too
        assert abs(channels.count(channel) - fraction * n) <= 2 + 0.05 * n


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_the_channels_depend_on_the_seed_and_keys_not_the_order(seed: int, rng: random.Random) -> None:
    keys, sets = _images(seed, 120, 4)
    channels = dict(zip(keys, iterative_split(keys, sets, SPLIT, seed)))
    order = list(range(len(keys)))
    rng.shuffle(order)
    shuffled = iterative_split([keys[i] for i in order], [sets[i] for i in order], SPLIT, seed)
    assert dict(zip((keys[i] for i in order), shuffled)) == channels


def test_the_hash_split_of_label_sets_is_the_hash_split_of_the_keys() -> None:
    keys, sets = _images(1, 50, 3)
    assert MULTI_LABEL_ALGORITHMS["hash"](keys, sets, SPLIT, 7) == hash_split(keys, [], SPLIT, 7)
