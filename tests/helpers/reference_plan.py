"""The reference shard plan: :func:`make_plan` plans a channel from all its rows at once, one
step after another as :mod:`jobs.shard_steps.deal` describes them. The shard job makes the same
plan from class counts, without the rows on the driver (:func:`jobs.shard_steps.deal.deal_from_counts`);
``tests/jobs/shard/test_deal.py`` checks the two are equal row for row, for every input
(:func:`plan_of_rows` applies a deal to the rows), and ``tests/jobs/shard/test_plan.py`` checks
the plan's invariants on this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from jobs.common.hashing import unit_hash
from jobs.shard_steps.deal import Deal, check_options, check_survivors, fill_holes
from jobs.shard_steps.deal_rows import class_slots, key_ranks, order_shard
from lakeshard.errors import ShardError

__all__ = ["ShardPlan", "make_plan", "plan_of_rows"]


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


def make_plan(
    keys: Sequence[str],
    labels: Sequence[int],
    *,
    num_shards: int,
    seed: int,
    channel: str,
    remainder: str = "drop",
    rejected: Sequence[int] | Sequence[bool] | np.ndarray | None = None,
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
        rows = row_at[start[c] : start[c] + kept[c]]
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
            rows = row_at[start[c] : start[c] + kept[c]]
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
    return _shuffled(
        keys,
        key_rank,
        source,
        out_shard,
        copy,
        num_shards=num_shards,
        seed=seed,
        channel=channel,
        dropped=np.sort(np.asarray(dropped, dtype=np.int64)),
    )


def _rejected_mask(
    rejected: Sequence[int] | Sequence[bool] | np.ndarray | None, total: int, channel: str
) -> np.ndarray:
    """``rejected`` (indices or a boolean mask) as a boolean mask of ``total`` rows."""
    if rejected is None:
        return np.zeros(total, dtype=bool)
    given = np.asarray(rejected)
    if given.dtype == bool:
        if given.shape != (total,):
            raise ShardError(
                f"rejected mask for channel {channel!r} has shape {given.shape}, expected ({total},)"
            )
        return given.copy()
    if given.size == 0:
        return np.zeros(total, dtype=bool)
    if given.ndim != 1 or not np.issubdtype(given.dtype, np.integer):
        raise ShardError(
            f"rejected must be row indices or a boolean mask, got {given.dtype} "
            f"array of shape {given.shape} for channel {channel!r}"
        )
    bad = given[(given < 0) | (given >= total)]
    if len(bad):
        raise ShardError(
            f"rejected row index {int(bad[0])} is out of range for channel {channel!r} of {total} rows"
        )
    mask = np.zeros(total, dtype=bool)
    mask[given] = True
    return mask


def _shuffled(
    keys: Sequence[str],
    key_rank: np.ndarray,
    source: np.ndarray,
    shard: np.ndarray,
    copy: np.ndarray,
    *,
    num_shards: int,
    seed: int,
    channel: str,
    dropped: np.ndarray,
) -> ShardPlan:
    """The plan with each shard's rows ranked by ``(unit_hash("shuffle", …), key, copy)``."""
    shuffle = np.fromiter(
        (
            unit_hash("shuffle", seed, channel, int(s), keys[r], int(k))
            for r, s, k in zip(source, shard, copy)
        ),
        dtype=np.float64,
        count=len(source),
    )
    order = np.lexsort((copy, key_rank[source], shuffle, shard))
    rows_per_shard = len(source) // num_shards
    return ShardPlan(
        num_shards=num_shards,
        rows_per_shard=rows_per_shard,
        source=source[order],
        shard=shard[order],
        position=np.arange(len(source), dtype=np.int64) % rows_per_shard,
        is_pad=copy[order] > 0,
        dropped=dropped,
        padded=np.sort(source[copy > 0]),
    )


def plan_of_rows(deal: Deal, keys: list[str], labels: list[int]) -> ShardPlan:
    """The deal applied to a channel's rows, as :func:`make_plan` returns it: the workers' code
    path (:func:`~jobs.shard_steps.deal_rows.class_slots`, :func:`~jobs.shard_steps.deal_rows.order_shard`)
    on one machine."""
    slots = np.empty(len(keys), dtype=np.int64)
    label = np.asarray(labels, dtype=np.int64)
    for c in np.unique(label).tolist():
        idx = np.flatnonzero(label == c)
        slots[idx] = class_slots(
            [keys[i] for i in idx], seed=deal.seed, channel=deal.channel, start=deal.class_start(c)
        )
    rows = pa.table({"key": keys, "slot": slots, "row": np.arange(len(keys))})
    parts = [order_shard(deal, rows, s) for s in range(deal.num_shards)]
    source = np.concatenate([p["row"].to_numpy() for p in parts]).astype(np.int64)
    copy = np.concatenate([p["copy"].to_numpy() for p in parts]).astype(np.int64)
    by_slot = np.empty(len(keys), dtype=np.int64)
    by_slot[slots] = np.arange(len(keys))
    return ShardPlan(
        num_shards=deal.num_shards,
        rows_per_shard=deal.rows_per_shard,
        source=source,
        shard=np.repeat(np.arange(deal.num_shards, dtype=np.int64), deal.rows_per_shard),
        position=np.tile(np.arange(deal.rows_per_shard, dtype=np.int64), deal.num_shards),
        is_pad=copy > 0,
        dropped=np.sort(by_slot[np.asarray(deal.dropped, dtype=np.int64)]),
        padded=np.sort(source[copy > 0]),
    )
