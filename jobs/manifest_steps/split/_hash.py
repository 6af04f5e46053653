"""The ``hash`` split: a channel per object from ``(seed, key)`` alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jobs.common.hashing import unit_hash

__all__ = ["hash_split"]


def _channel_of(u: float, names: list[str], bounds: list[float]) -> str:
    for name, bound in zip(names, bounds):
        if u < bound:
            return name
    return names[-1]


def hash_split(
    keys: Sequence[str], labels: Sequence[str], fractions: Mapping[str, float], seed: int
) -> list[str]:
    """Channel of each key: ``unit_hash(seed, key)`` falls in the channel's slice of [0, 1).

    ``labels`` is unused: the key already names the class, and a per-object rule is what keeps
    assignments stable while the lake grows.
    """
    names = list(fractions)
    bounds, acc = [], 0.0
    for name in names:
        acc += fractions[name]
        bounds.append(acc)
    return [_channel_of(unit_hash("split", seed, key), names, bounds) for key in keys]
