"""The ``stratified`` split of images with several labels: iterative stratification.

Sechidis, Tsoumakas and Vlahavas, "On the Stratification of Multi-Label Data" (ECML PKDD
2011), algorithm 1, with its random choices replaced by the seeded order of the keys.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from jobs.common.hashing import unit_hash

__all__ = ["iterative_split"]


def _best(scores: Mapping[str, float], totals: Mapping[str, float], names: list[str]) -> str:
    """The channel wanting most of a label, then most images, then the first listed."""
    return max(names, key=lambda c: (scores[c], totals[c], -names.index(c)))


def iterative_split(
    keys: Sequence[str], label_sets: Sequence[Sequence[str]], fractions: Mapping[str, float], seed: int
) -> list[str]:
    """Channel of each key. Each channel wants ``fraction * n`` of the images and of each
    label's images; the label with fewest images left is dealt first, each of its images (in
    the order of ``unit_hash(seed, key)``) to the channel that still wants most of that label;
    an image dealt lowers what its channel wants of each of its labels. Images with no label
    go last, to the channel that wants most images.

    Deterministic for a seed: the same keys and labels give the same channels, whatever order
    they come in."""
    names = list(fractions)
    order = sorted(range(len(keys)), key=lambda i: (unit_hash("split", seed, keys[i]), keys[i]))
    by_label: dict[str, list[int]] = defaultdict(list)
    for i in order:
        for label in set(label_sets[i]):
            by_label[label].append(i)
    wants = {label: {c: len(ix) * fractions[c] for c in names} for label, ix in by_label.items()}
    totals = {c: len(keys) * fractions[c] for c in names}
    left = {label: len(ix) for label, ix in by_label.items()}
    out: list[str | None] = [None] * len(keys)

    def deal(i: int, channel: str) -> None:
        out[i] = channel
        totals[channel] -= 1
        for label in set(label_sets[i]):
            wants[label][channel] -= 1
            left[label] -= 1

    while any(left.values()):
        label = min((n, name) for name, n in left.items() if n)[1]
        for i in by_label[label]:
            if out[i] is None:
                deal(i, _best(wants[label], totals, names))
    for i in order:
        if out[i] is None:
            deal(i, _best(totals, totals, names))
    return [c or names[0] for c in out]
