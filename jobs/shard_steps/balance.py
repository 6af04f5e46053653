"""The shard plan: which row of a channel goes to which shard, at which position.

Made before preprocessing (the first plan, P0), so that each worker preprocesses its shard's
rows straight into the shard's file. :func:`make_plan` makes it from all the channel's rows at
once: the reference. The shard job makes the same plan without the rows on the driver
(:mod:`jobs.shard_steps.deal`, from class counts and the rejects' slots; property-tested equal).
Rows whose image fails to decode are known only afterwards; the plan made again with them
``rejected`` differs from P0 in few rows, so a repair pass moves only those between files.
Equal shards come from this explicit plan, not from ``repartition(N)`` (uneven files) nor from
hashing ``idx % N`` (collisions).

Invariants (property-tested for every input), with S the rows not rejected:

- every shard has exactly ``rows_per_shard`` rows, at positions ``0 .. rows_per_shard - 1``;
- a rejected row is never placed; every other row is placed once or dropped; ``drop`` drops
  exactly ``S mod N`` rows, ``pad`` adds exactly ``(-S) mod N`` copies of placed rows;
- for every class, its count in any two shards differs by at most one (pad copies count);
- the plan is a function of (keys, labels, rejected keys, seed, channel, num_shards,
  remainder) only: not of the order rows arrive in, so every engine gets the same plan;
- stability: at most ``2·|R| + 2·(N - 1)`` rows not rejected (pad copies included) are in
  another shard, or placed in one plan and dropped in the other, than in P0 (``rejected=None``):
  step 2 below moves at most ``|R|`` rows, step 3 at most ``|R|``, and each plan's remainder
  drops or pads at most ``N - 1``;
- within a shard, rows are ordered by ``(unit_hash("shuffle", seed, channel, shard, key, copy),
  key, copy)``, copy 0 the row itself and 1, 2, … its pad copies in shard order: two rows in
  the same shard in P0 and in the repaired plan keep their relative order.

How, in four steps (N shards):

1. Slots. Classes are laid end to end in label order, within a class in the order of a seeded
   hash of the key, rejected rows included; slot i belongs to shard ``i mod N``. A contiguous
   run of slots is spread over the shards evenly, so each class is balanced.
2. Holes. Rejected rows leave holes. Each class fills its holes with its survivors from beyond
   its first ``s_c`` slots (``s_c`` its survivors), a survivor in the same shard as the hole
   first, then the last into the earliest; the class then holds a contiguous run again. At most
   one row moves per reject.
3. Totals. While the fullest shard a holds two rows more than the emptiest b (lowest index on
   ties), a class with one row more in a than in b exists; the lowest such label moves its row
   in a with the highest slot to b. Each move keeps its class balanced. At most ``|R|`` moves:
   P0's totals are m or m + 1 and rejects only lowered them, by ``|R|`` in all; a shard never
   both gives and takes, and takes only up to m, so no more than it lost.
4. Remainder. Totals now differ by at most one. ``drop``: each shard holding one row more than
   the others drops a row of a class with a row more there than in its emptiest shard (the
   largest class, lower label on ties; its row with the highest slot). ``pad``: each shard
   holding one row fewer, in shard order, gets a copy of a row of a class whose count there is
   its lowest (of those, the class with the fewest rows so far, pad copies counted, lower label
   on ties), and of that class the row with the fewest copies so far (a row already in the
   shard first, then the lowest slot). So pad copies spread over the smallest classes and over
   distinct images before any image is repeated twice. Either keeps every class balanced.

With no rejects, steps 2 and 3 do nothing: P0 is the deal of step 1 with step 4's remainder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from jobs.common.hashing import unit_hash
from lakeshard.errors import ShardError
from lakeshard.settings import check_positive

__all__ = ["REMAINDER_POLICIES", "ShardPlan", "check_options", "check_survivors", "fill_holes", "key_ranks", "make_plan"]

REMAINDER_POLICIES = ("drop", "pad")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Row routing for one channel. Arrays are parallel, one entry per output row, in shard
    order then position order.

    ``source[i]`` indexes the input rows; output row i goes to shard ``shard[i]`` at position
    ``position[i]``; ``is_pad[i]`` marks a repeated row. ``dropped`` indexes the rows, not
    rejected, that the remainder policy left out; ``padded`` the rows it repeated, once per
    pad copy (a row copied twice is listed twice).
    """

    num_shards: int
    rows_per_shard: int
    source: np.ndarray
    shard: np.ndarray
    position: np.ndarray
    is_pad: np.ndarray
    dropped: np.ndarray
    padded: np.ndarray


def make_plan(keys: Sequence[str], labels: Sequence[int], *, num_shards: int, seed: int, channel: str,
              remainder: str = "drop", rejected: Sequence[int] | Sequence[bool] | np.ndarray | None = None,
              ) -> ShardPlan:
    """Plan the rows of ``channel`` that are not ``rejected`` into ``num_shards`` equal shards.

    Args:
        keys: every manifest row of the channel (unique).
        labels: the class of each row.
        rejected: the rows that failed preprocessing, as indices into ``keys`` or as a boolean
            mask of ``len(keys)``; ``None`` (or empty) gives the first plan, P0.
    """
    check_options(num_shards, remainder)
    if len(keys) != len(labels):
        raise ShardError(f"keys and labels differ in length: {len(keys)} != {len(labels)}")
    total = len(keys)
    if total == 0:
        raise ShardError(f"channel {channel!r} has no rows to shard")
    is_rejected = _rejected_mask(rejected, total, channel)
    check_survivors(channel, total, int(is_rejected.sum()), num_shards=num_shards, remainder=remainder)

    key_rank = key_ranks(keys, channel)
    label = np.fromiter((int(x) for x in labels), dtype=np.int64, count=total)
    deal = np.fromiter((unit_hash("deal", seed, channel, k) for k in keys), dtype=np.float64, count=total)

    # 1. Slots: classes end to end in label order, each in its seeded order.
    at_slot = np.lexsort((key_rank, deal, label))
    classes, start, size = np.unique(label[at_slot], return_index=True, return_counts=True)
    cls = np.searchsorted(classes, label)
    kept = size - np.bincount(cls, weights=is_rejected, minlength=len(classes)).astype(np.int64)
    slot = np.empty(total, dtype=np.int64)
    slot[at_slot] = np.arange(total)

    # 2. Holes: each class's survivors onto its first kept[c] slots.
    slot = fill_holes(slot, cls, is_rejected, start, kept, num_shards)
    row_at = np.full(total, -1, dtype=np.int64)
    row_at[slot[~is_rejected]] = np.flatnonzero(~is_rejected)
    shard = np.where(is_rejected, -1, slot % num_shards)
    counts = np.zeros((len(classes), num_shards), dtype=np.int64)
    np.add.at(counts, (cls[~is_rejected], shard[~is_rejected]), 1)

    def last_in(c: int, s: int) -> int:
        """Class c's row in shard s with the highest slot."""
        rows = row_at[start[c]:start[c] + kept[c]]
        return int(rows[np.flatnonzero(shard[rows] == s)[-1]])

    # 3. Totals: from the fullest shard to the emptiest, one row of a class with its extra there.
    totals = counts.sum(axis=0)
    while totals.max() - totals.min() > 1:
        a, b = int(totals.argmax()), int(totals.argmin())
        c = int(np.flatnonzero(counts[:, a] > counts[:, b])[0])
        shard[last_in(c, a)] = b
        counts[c, a] -= 1
        counts[c, b] += 1
        totals[a] -= 1
        totals[b] += 1

    # 4. Remainder.
    low = totals.min()
    dropped: list[int] = []
    pads: list[tuple[int, int]] = []  # (row, shard)
    if remainder == "drop":
        for s in np.flatnonzero(totals > low).tolist():
            extra = np.flatnonzero(counts[:, s] > counts.min(axis=1))
            c = int(extra[np.argmax(kept[extra])])
            row = last_in(c, s)
            dropped.append(row)
            shard[row] = -1
            counts[c, s] -= 1
    elif totals.max() > low:
        copies = np.zeros(total, dtype=np.int64)
        for s in np.flatnonzero(totals == low).tolist():
            fewest = np.flatnonzero((counts[:, s] == counts.min(axis=1)) & (kept > 0))
            c = int(fewest[np.argmin(counts[fewest].sum(axis=1))])  # first of the smallest
            rows = row_at[start[c]:start[c] + kept[c]]
            row = int(rows[np.lexsort((np.arange(len(rows)), shard[rows] != s, copies[rows]))[0]])
            pads.append((row, s))
            copies[row] += 1
            counts[c, s] += 1

    placed = np.flatnonzero(shard >= 0)
    source = np.concatenate([placed, np.asarray([r for r, _ in pads], dtype=np.int64)])
    out_shard = np.concatenate([shard[placed], np.asarray([s for _, s in pads], dtype=np.int64)])
    copy = np.zeros(len(source), dtype=np.int64)
    copies: dict[int, int] = {}
    for i, (row, _) in enumerate(pads, start=len(placed)):
        copies[row] = copy[i] = copies.get(row, 0) + 1
    return _shuffled(keys, key_rank, source, out_shard, copy, num_shards=num_shards, seed=seed,
                     channel=channel, dropped=np.sort(np.asarray(dropped, dtype=np.int64)))


def check_options(num_shards: int, remainder: str) -> None:
    """``num_shards`` and ``remainder`` are values a plan can be made with."""
    check_positive("num_shards", num_shards, error=ShardError)
    if remainder not in REMAINDER_POLICIES:
        raise ShardError(f"remainder must be one of {', '.join(REMAINDER_POLICIES)}, got {remainder!r}")


def check_survivors(channel: str, total: int, num_rejected: int, *, num_shards: int, remainder: str) -> None:
    """A channel of ``total`` rows, ``num_rejected`` of them rejected, can be planned."""
    survivors = total - num_rejected
    if survivors == 0:
        raise ShardError(f"channel {channel!r} has no rows to shard: all {total} were rejected")
    if remainder == "drop" and survivors < num_shards:
        counted = f"{survivors} rows" if not num_rejected else \
            f"{survivors} rows left ({num_rejected} of {total} rejected)"
        raise ShardError(
            f"channel {channel!r} has {counted}, fewer than num_shards={num_shards}: "
            "dropping the remainder would leave empty shards; use --remainder pad or fewer shards")


def _rejected_mask(rejected: Sequence[int] | Sequence[bool] | np.ndarray | None, total: int,
                   channel: str) -> np.ndarray:
    """``rejected`` (indices or a boolean mask) as a boolean mask of ``total`` rows."""
    if rejected is None:
        return np.zeros(total, dtype=bool)
    given = np.asarray(rejected)
    if given.dtype == bool:
        if given.shape != (total,):
            raise ShardError(f"rejected mask for channel {channel!r} has shape {given.shape}, "
                             f"expected ({total},)")
        return given.copy()
    if given.size == 0:
        return np.zeros(total, dtype=bool)
    if given.ndim != 1 or not np.issubdtype(given.dtype, np.integer):
        raise ShardError(f"rejected must be row indices or a boolean mask, got {given.dtype} "
                         f"array of shape {given.shape} for channel {channel!r}")
    bad = given[(given < 0) | (given >= total)]
    if len(bad):
        raise ShardError(f"rejected row index {int(bad[0])} is out of range for channel {channel!r} "
                         f"of {total} rows")
    mask = np.zeros(total, dtype=bool)
    mask[given] = True
    return mask


def key_ranks(keys: Sequence[str], channel: str) -> np.ndarray:
    """Each key's rank in sorted order; keys must be unique (the plan breaks ties by key)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    for i, j in pairwise(order):
        if keys[i] == keys[j]:
            raise ShardError(f"key {keys[i]!r} appears twice in channel {channel!r} (rows {i} and {j})")
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys))
    return rank


def fill_holes(slot: np.ndarray, cls: np.ndarray, is_rejected: np.ndarray, start: np.ndarray,
                kept: np.ndarray, num_shards: int) -> np.ndarray:
    """Step 2: survivors from beyond each class's first ``kept[c]`` slots move into the holes
    rejected rows leave there, same shard first, then the last survivor into the earliest hole."""
    inside = slot - start[cls] < kept[cls]
    holes = np.flatnonzero(is_rejected & inside)
    movers = np.flatnonzero(~is_rejected & ~inside)
    if not len(holes):
        return slot
    group_h = cls[holes] * num_shards + slot[holes] % num_shards
    group_m = cls[movers] * num_shards + slot[movers] % num_shards
    holes = holes[np.lexsort((slot[holes], group_h))]
    movers = movers[np.lexsort((-slot[movers], group_m))]
    group_h, group_m = np.sort(group_h), np.sort(group_m)
    # Rank within the (class, shard) group; the first min(#holes, #movers) of a group pair up.
    rank_h = np.arange(len(holes)) - np.searchsorted(group_h, group_h)
    rank_m = np.arange(len(movers)) - np.searchsorted(group_m, group_m)
    paired_h = rank_h < np.searchsorted(group_m, group_h, side="right") - np.searchsorted(group_m, group_h)
    paired_m = rank_m < np.searchsorted(group_h, group_m, side="right") - np.searchsorted(group_h, group_m)
    # The rest, class by class (each class has as many holes as movers): last into earliest.
    rest_h, rest_m = holes[~paired_h], movers[~paired_m]
    rest_h = rest_h[np.lexsort((slot[rest_h], cls[rest_h]))]
    rest_m = rest_m[np.lexsort((-slot[rest_m], cls[rest_m]))]
    new = slot.copy()
    new[movers[paired_m]] = slot[holes[paired_h]]
    new[rest_m] = slot[rest_h]
    return new


def _shuffled(keys: Sequence[str], key_rank: np.ndarray, source: np.ndarray, shard: np.ndarray,
              copy: np.ndarray, *, num_shards: int, seed: int, channel: str, dropped: np.ndarray) -> ShardPlan:
    """The plan with each shard's rows ranked by ``(unit_hash("shuffle", …), key, copy)``."""
    shuffle = np.fromiter((unit_hash("shuffle", seed, channel, int(s), keys[r], int(k))
                           for r, s, k in zip(source, shard, copy)), dtype=np.float64, count=len(source))
    order = np.lexsort((copy, key_rank[source], shuffle, shard))
    rows_per_shard = len(source) // num_shards
    return ShardPlan(num_shards=num_shards, rows_per_shard=rows_per_shard, source=source[order],
                     shard=shard[order], position=np.arange(len(source), dtype=np.int64) % rows_per_shard,
                     is_pad=copy[order] > 0, dropped=dropped, padded=np.sort(source[copy > 0]))
