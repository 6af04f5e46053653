"""The shard plan: which row of a channel goes to which shard, at which position.

Computed once, on the driver, from the rows that survived preprocessing, then used by the
engine to route rows. Equal shards come from this explicit plan, not from ``repartition(N)``
(uneven files) nor from hashing ``idx % N`` (collisions).

Invariants (property-tested for every input):

- every shard has exactly ``rows_per_shard`` rows;
- every kept row appears once; with ``pad``, the repeated rows appear twice or more;
- for every class, its count in any two shards differs by at most one;
- the plan is a function of (keys, labels, seed, channel, num_shards, remainder) only: it does
  not depend on the order rows arrive in, so every engine gets the same plan.

How: classes are laid end to end (label order; within a class, rows ordered by a seeded hash
of their key) and dealt round-robin to the shards. Any contiguous run of a round-robin deal is
spread evenly, and each class is a contiguous run. The remainder ``T mod N`` is settled before
dealing: ``drop`` removes one row from each of the largest classes, ``pad`` repeats one row of
each of the smallest. Within a shard, rows are ordered by a second seeded hash (the shuffle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jobs.errors import ShardError
from jobs.split import unit_hash

__all__ = ["REMAINDER_POLICIES", "ShardPlan", "make_plan"]

REMAINDER_POLICIES = ("drop", "pad")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Row routing for one channel. Arrays are parallel, one entry per output row.

    ``source[i]`` indexes the input rows; output row i goes to shard ``shard[i]`` at position
    ``position[i]``; ``is_pad[i]`` marks a repeated row. ``dropped`` and ``padded`` index the
    input rows that the remainder policy dropped or repeated.
    """

    num_shards: int
    rows_per_shard: int
    source: np.ndarray
    shard: np.ndarray
    position: np.ndarray
    is_pad: np.ndarray
    dropped: np.ndarray
    padded: np.ndarray


def make_plan(keys: Sequence[str], labels: Sequence[int], *, num_shards: int, seed: int,
              channel: str, remainder: str = "drop") -> ShardPlan:
    """Plan ``len(keys)`` rows of ``channel`` into ``num_shards`` equal shards."""
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise ShardError(f"num_shards must be a positive integer, got {num_shards!r}")
    if remainder not in REMAINDER_POLICIES:
        raise ShardError(f"remainder must be one of {', '.join(REMAINDER_POLICIES)}, got {remainder!r}")
    if len(keys) != len(labels):
        raise ShardError(f"keys and labels differ in length: {len(keys)} != {len(labels)}")
    total = len(keys)
    if total == 0:
        raise ShardError(f"channel {channel!r} has no rows to shard")
    if remainder == "drop" and total < num_shards:
        raise ShardError(
            f"channel {channel!r} has {total} rows, fewer than num_shards={num_shards}: "
            "dropping the remainder would leave empty shards; use --remainder pad or fewer shards")

    # Each class's rows in a seeded order that does not depend on input order.
    classes: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        classes.setdefault(int(label), []).append(i)
    for members in classes.values():
        members.sort(key=lambda i: (unit_hash("deal", seed, channel, keys[i]), keys[i]))

    extra = total % num_shards
    dropped: list[int] = []
    pad_of: dict[int, list[int]] = {label: [] for label in classes}
    if extra and remainder == "drop":
        # One row from each of the largest classes (ties: lower label first), round after round.
        for _ in range(extra):
            label = max(classes, key=lambda c: (len(classes[c]), -c))
            dropped.append(classes[label].pop())
    elif extra and remainder == "pad":
        need = num_shards - extra
        order = sorted(classes, key=lambda c: (len(classes[c]), c))
        k = 0
        while need:
            label = order[k % len(order)]
            members = classes[label]
            pad_of[label].append(members[(k // len(order)) % len(members)])
            need -= 1
            k += 1

    source: list[int] = []
    is_pad: list[bool] = []
    for label in sorted(classes):
        source.extend(classes[label])
        is_pad.extend([False] * len(classes[label]))
        source.extend(pad_of[label])
        is_pad.extend([True] * len(pad_of[label]))

    n = len(source)
    src = np.asarray(source, dtype=np.int64)
    pad = np.asarray(is_pad, dtype=bool)
    shard = np.arange(n, dtype=np.int64) % num_shards
    rows_per_shard = n // num_shards

    # Shuffle within each shard: order by a seeded hash of (shard, key, copy number).
    position = np.empty(n, dtype=np.int64)
    copy_no: dict[int, int] = {}
    sort_keys = []
    for i in range(n):
        c = copy_no.get(source[i], 0)
        copy_no[source[i]] = c + 1
        sort_keys.append((unit_hash("shuffle", seed, channel, int(shard[i]), keys[source[i]], c), keys[source[i]], c))
    for s in range(num_shards):
        idx = np.flatnonzero(shard == s)
        order = sorted(range(len(idx)), key=lambda j: sort_keys[idx[j]])
        position[idx[order]] = np.arange(len(idx), dtype=np.int64)

    padded = np.asarray(sorted({source[i] for i in range(n) if is_pad[i]}), dtype=np.int64)
    return ShardPlan(num_shards=num_shards, rows_per_shard=rows_per_shard, source=src, shard=shard,
                     position=position, is_pad=pad, dropped=np.asarray(sorted(dropped), dtype=np.int64),
                     padded=padded)
