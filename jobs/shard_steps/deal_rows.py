"""A :class:`~jobs.shard_steps.deal.Deal` applied to rows, on the workers: each row's slot
(:func:`class_slots`), its shard (:func:`route`) and each shard's rows in position order, pad
copies included (:func:`order_shard`). The driver never holds the rows
(:mod:`jobs.shard_steps.deal`)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.common.hashing import unit_hashes
from jobs.shard_steps.deal import Deal
from lakeshard.errors import ShardError

__all__ = ["class_slots", "key_ranks", "order_shard", "route"]


def class_slots(keys: pa.Array | list[str], *, seed: int, channel: str, start: int) -> np.ndarray:
    """The slots of one class's rows (``keys``, unique, in any order): ``start`` plus each
    row's rank by ``(unit_hash("deal", seed, channel, key), key)``."""
    keys = keys.to_pylist() if isinstance(keys, (pa.Array, pa.ChunkedArray)) else list(keys)
    deal = unit_hashes(("deal", seed, channel), keys)
    at = np.lexsort((key_ranks(keys, channel), deal))
    slot = np.empty(len(keys), dtype=np.int64)
    slot[at] = start + np.arange(len(keys), dtype=np.int64)
    return slot


def route(deal: Deal, slots: np.ndarray) -> np.ndarray:
    """The shard of each row (by slot); -1 for a row not placed (rejected or dropped)."""
    shard = slots % deal.num_shards
    if deal.moved:
        moved = np.fromiter(deal.moved, dtype=np.int64, count=len(deal.moved))
        to = np.fromiter(deal.moved.values(), dtype=np.int64, count=len(deal.moved))
        order = np.argsort(moved)
        i = np.searchsorted(moved[order], slots)
        hit = (i < len(moved)) & (moved[order][np.minimum(i, len(moved) - 1)] == slots)
        shard = np.where(hit, to[order][np.minimum(i, len(moved) - 1)], shard)
    return shard


def order_shard(deal: Deal, rows: pa.Table, shard: int) -> pa.Table:
    """Shard ``shard``'s rows in position order, pad copies included, with ``is_pad`` and
    ``copy`` columns. ``rows`` (a ``key`` and a ``slot`` column, any others carried along) must
    hold every row the deal places in the shard, and may hold others."""
    slots = rows["slot"].to_numpy()
    mine = rows.filter(pa.array(route(deal, slots) == shard))
    copies = [(g, k) for g, s, k in deal.pads if s == shard]
    if copies:
        at = {g: i for i, g in enumerate(rows["slot"].to_pylist())}
        missing = [g for g, _ in copies if g not in at]
        if missing:
            raise ShardError(
                f"channel {deal.channel!r} shard {shard}: the rows at slots {missing[:5]} to pad from "
                "were not given"
            )
        extra = rows.take(pa.array([at[g] for g, _ in copies], pa.int64()))
        table = pa.concat_tables([mine, extra])
        copy = np.concatenate(
            [np.zeros(mine.num_rows, np.int64), np.asarray([k for _, k in copies], np.int64)]
        )
    else:
        table, copy = mine, np.zeros(mine.num_rows, np.int64)
    keys = table["key"].to_pylist()
    shuffle = unit_hashes(("shuffle", deal.seed, deal.channel, shard), keys, copy.tolist())
    key_rank = pc.rank(table["key"], sort_keys="ascending", tiebreaker="min").to_numpy() if keys else copy
    order = np.lexsort((copy, key_rank, shuffle))
    table = table.append_column("is_pad", pa.array(copy > 0)).append_column("copy", pa.array(copy))
    if table.num_rows != deal.rows_per_shard:
        raise ShardError(
            f"channel {deal.channel!r} shard {shard}: {table.num_rows} rows, planned {deal.rows_per_shard}"
        )
    return table.take(pa.array(order, pa.int64()))


def key_ranks(keys: Sequence[str], channel: str) -> np.ndarray:
    """Each key's rank in sorted order; keys must be unique (the plan breaks ties by key)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    for i, j in pairwise(order):
        if keys[i] == keys[j]:
            raise ShardError(f"key {keys[i]!r} appears twice in channel {channel!r} (rows {i} and {j})")
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys))
    return rank
