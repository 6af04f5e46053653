"""The ``stratified`` split: exact per-class counts by largest remainder."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from jobs.common.hashing import unit_hash

__all__ = ["class_quotas", "stratified_split"]


def class_quotas(n: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` into integer counts proportional to ``fractions`` (largest remainder;
    ties go to the channel listed first). The counts add up to ``n``."""
    exact = {name: n * f for name, f in fractions.items()}
    quotas = {name: int(v) for name, v in exact.items()}
    left = n - sum(quotas.values())
    order = sorted(fractions, key=lambda name: (-(exact[name] - quotas[name]), list(fractions).index(name)))
    for name in order[:left]:
        quotas[name] += 1
    return quotas


def stratified_split(
    keys: Sequence[str], labels: Sequence[str], fractions: Mapping[str, float], seed: int
) -> list[str]:
    """Within each class, order objects by ``unit_hash(seed, key)`` and cut the order at the
    class's quotas."""
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, label in enumerate(labels):
        by_class[label].append(i)
    out = [""] * len(keys)
    for members in by_class.values():
        members.sort(key=lambda i: (unit_hash("split", seed, keys[i]), keys[i]))
        quotas = class_quotas(len(members), fractions)
        pos = 0
        for name, count in quotas.items():
            for i in members[pos : pos + count]:
                out[i] = name
            pos += count
    return out
