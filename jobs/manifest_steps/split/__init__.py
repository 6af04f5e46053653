"""Channel assignment: which objects go to train, validation and test.

Two algorithms, chosen with ``--split-method``:

``hash`` (default)
    Each object's channel is a function of ``(seed, key)`` alone, so a lake that grows never
    moves an object that was already assigned. The requested fractions hold within every class
    in expectation (binomially: a class of n objects gets n*f ± sqrt(n*f*(1-f)) in a channel of
    fraction f); the manifest job reports the fractions it achieved.
``stratified``
    Exact per-class counts (largest remainder). Stable for every class that did not change;
    when a class grows, objects near a channel boundary of that class may move. Use it for
    small, fixed datasets. For images with several labels (``multi-label``, ``boxes``):
    iterative stratification (:func:`iterative_split`), each label's images spread as the
    fractions ask, rarest label first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from jobs.manifest_steps.split._hash import hash_split
from jobs.manifest_steps.split._iterative import iterative_split
from jobs.manifest_steps.split._stratified import class_quotas, stratified_split

__all__ = [
    "ALGORITHMS",
    "MULTI_LABEL_ALGORITHMS",
    "MultiLabelSplitFn",
    "SplitFn",
    "class_quotas",
    "hash_split",
    "iterative_split",
    "stratified_split",
]

#: ``fn(keys, labels, fractions, seed) -> channel name per key``
SplitFn = Callable[[Sequence[str], Sequence[str], Mapping[str, float], int], list[str]]
#: ``fn(keys, label_sets, fractions, seed) -> channel name per key``: images with several labels
MultiLabelSplitFn = Callable[[Sequence[str], Sequence[Sequence[str]], Mapping[str, float], int], list[str]]

ALGORITHMS: dict[str, SplitFn] = {"hash": hash_split, "stratified": stratified_split}


def _hash_sets(
    keys: Sequence[str], label_sets: Sequence[Sequence[str]], fractions: Mapping[str, float], seed: int
) -> list[str]:
    return hash_split(keys, [], fractions, seed)


#: The same names as :data:`ALGORITHMS`, for images with a set of labels each.
MULTI_LABEL_ALGORITHMS: dict[str, MultiLabelSplitFn] = {"hash": _hash_sets, "stratified": iterative_split}
