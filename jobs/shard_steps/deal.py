"""The shard plan: which row of a channel goes to which shard, at which position; made on the
driver from class counts alone, a :class:`Deal`.

Made before preprocessing (the first plan, P0), so that each worker preprocesses its shard's
rows straight into the shard's file. Rows whose image fails to decode are known only
afterwards; the plan made again with them ``rejected`` differs from P0 in few rows, so a repair
pass moves only those between files. Equal shards come from this explicit plan, not from
``repartition(N)`` (uneven files) nor from hashing ``idx % N`` (collisions).

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

**From counts.** The plan is a function of (per-class row counts, the slots of the rejected
rows, seed, channel, num_shards, remainder) plus one per-row quantity, each row's *slot*: its
class's start (the rows of the classes with lower labels) plus its rank within its class by
``(deal hash, key)``. The driver computes a :class:`Deal` from the counts and the (small) reject
list (:func:`deal_from_counts`); the workers compute the slots (:func:`class_slots`, over one
class's rows at a time) and apply the deal to their rows (:func:`route`, :func:`order_shard`).
``tests/helpers/reference_plan.py`` makes the plan step by step from every row of a channel,
the reference ``tests/jobs/shard/test_deal.py`` checks the deal against, row for row, for every
input: same shards, same rows, same positions, same pad copies.

A :class:`Deal` is small: classes × shards counts plus an exception per row that is not in the
shard its slot gives (``slot mod N``): rows rejected, moved by the repair or dropped by the
remainder policy, and pad copies. That is O(classes × N + rejects + N), never O(rows).

How the steps work on slots alone:

1. Slots: class c holds slots ``start[c] .. start[c] + size[c] - 1``; slot g is in shard g mod N.
2. Holes: only the rejected slots and the last ``rejects(c)`` slots of each class take part
   (:func:`fill_holes` on just those); a mover takes its hole's slot.
3. Totals and 4. Remainder: per (class, shard) counts are arithmetic on each class's slot run;
   "the row of class c in shard s with the highest slot" is found by walking down the slots
   congruent to s, skipping the few rows that moved, and the rows moved into s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.common.hashing import unit_hashes
from lakeshard.errors import ShardError
from lakeshard.settings import check_positive

__all__ = [
    "DROPPED_ROWS_SHARD",
    "REMAINDER_POLICIES",
    "Deal",
    "check_options",
    "check_survivors",
    "class_slots",
    "deal_from_counts",
    "fill_holes",
    "key_ranks",
    "order_shard",
    "route",
]

#: What ``--remainder`` does with the rows beyond a multiple of ``num_shards`` (step 4).
REMAINDER_POLICIES = ("drop", "pad")

#: The shard index of the first plan's dropped rows (those the remainder policy leaves out), the
#: shard :meth:`Deal.shard_of` gives a row it does not place. The shard job preprocesses them
#: all the same, from an order file and in a segment of their own under this index, in case
#: rejects change the plan and it places some of them after all.
DROPPED_ROWS_SHARD = -1


@dataclass(frozen=True, slots=True)
class Deal:
    """One channel's plan, without its rows.

    A row with slot g goes to shard ``moved.get(g, g % num_shards)`` (-1: not placed, rejected
    or dropped); ``pads`` lists the pad copies as (slot, shard, copy), copy 1, 2, … per slot.
    ``labels``, ``start`` and ``size`` describe the classes present, in label order.
    """

    channel: str
    num_shards: int
    seed: int
    rows_per_shard: int
    labels: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]
    rejected: frozenset[int] = frozenset()
    moved: Mapping[int, int] = field(default_factory=dict)
    pads: tuple[tuple[int, int, int], ...] = ()
    dropped: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.size)

    @property
    def padded(self) -> tuple[int, ...]:
        """The slots of the padded rows, once per pad copy, ascending."""
        return tuple(sorted(g for g, _, _ in self.pads))

    @property
    def exceptions(self) -> frozenset[int]:
        """The slots not simply in shard ``slot mod N``: moved, rejected, dropped or padded."""
        return frozenset(self.moved) | {g for g, _, _ in self.pads}

    def shard_of(self, slot: int) -> int:
        return self.moved.get(slot, slot % self.num_shards)

    def class_start(self, label: int) -> int:
        """The first slot of class ``label``."""
        i = self.labels.index(label)
        return self.start[i]


def deal_from_counts(
    counts: Mapping[int, int],
    *,
    num_shards: int,
    seed: int,
    channel: str,
    remainder: str = "drop",
    rejected: Iterable[int] = (),
) -> Deal:
    """The plan of a channel whose class ``label`` has ``counts[label]`` rows, with the rows at
    slots ``rejected`` left out: the four steps above, from counts alone."""
    check_options(num_shards, remainder)
    present = sorted((int(k), int(v)) for k, v in counts.items() if v)
    if any(v < 0 for _, v in present):
        raise ShardError(f"class counts of channel {channel!r} must not be negative, got {dict(counts)}")
    n = num_shards
    labels = np.asarray([k for k, _ in present], dtype=np.int64)
    size = np.asarray([v for _, v in present], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64) if len(size) else size
    total = int(size.sum())
    if total == 0:
        raise ShardError(f"channel {channel!r} has no rows to shard")
    rejected_slots = np.unique(np.fromiter((int(g) for g in rejected), dtype=np.int64))
    if len(rejected_slots) and (rejected_slots[0] < 0 or rejected_slots[-1] >= total):
        bad = rejected_slots[0] if rejected_slots[0] < 0 else rejected_slots[-1]
        raise ShardError(f"rejected slot {int(bad)} is out of range for channel {channel!r} of {total} rows")
    check_survivors(channel, total, len(rejected_slots), num_shards=n, remainder=remainder)
    survivors = total - len(rejected_slots)

    cls_of_rejected = np.searchsorted(start, rejected_slots, side="right") - 1
    kept = size - np.bincount(cls_of_rejected, minlength=len(size)).astype(np.int64)

    # 2. Holes, on the rejected slots and each class's tail only.
    tail = [np.arange(start[c] + kept[c], start[c] + size[c]) for c in range(len(size)) if kept[c] < size[c]]
    involved = np.union1d(rejected_slots, np.concatenate(tail) if tail else np.empty(0, np.int64))
    is_rej = np.isin(involved, rejected_slots)
    cls = np.searchsorted(start, involved, side="right") - 1
    filled = fill_holes(involved.copy(), cls, is_rej, start, kept, n)
    to_slot = {int(g): int(p) for g, p, r in zip(involved, filled, is_rej, strict=True) if not r and g != p}
    row_at = {p: g for g, p in to_slot.items()}  # new slot -> original slot, where they differ

    # Counts per (class, shard) of each class's run of new slots start .. start + kept - 1.
    def below(x: np.ndarray) -> np.ndarray:  # slots in [0, x) congruent to each shard
        s = np.arange(n)[None, :]
        return np.maximum(0, (x[:, None] - s + n - 1) // n)

    counts_cs = below(start + kept) - below(start)
    walk = _Walk(n, start, kept)

    # 3. Totals.
    totals = counts_cs.sum(axis=0)
    while totals.max() - totals.min() > 1:
        a, b = int(totals.argmax()), int(totals.argmin())
        c = int(np.flatnonzero(counts_cs[:, a] > counts_cs[:, b])[0])
        walk.set(walk.last_in(c, a), b)
        counts_cs[c, a] -= 1
        counts_cs[c, b] += 1
        totals[a] -= 1
        totals[b] += 1

    # 4. Remainder.
    low = totals.min()
    dropped: list[int] = []
    pads: list[tuple[int, int]] = []  # (new slot, shard)
    if remainder == "drop":
        for s in np.flatnonzero(totals > low).tolist():
            extra = np.flatnonzero(counts_cs[:, s] > counts_cs.min(axis=1))
            c = int(extra[np.argmax(kept[extra])])
            p = walk.last_in(c, s)
            dropped.append(p)
            walk.set(p, -1)
            counts_cs[c, s] -= 1
    elif totals.max() > low:
        copies: dict[int, int] = {}
        for s in np.flatnonzero(totals == low).tolist():
            fewest = np.flatnonzero((counts_cs[:, s] == counts_cs.min(axis=1)) & (kept > 0))
            c = int(fewest[np.argmin(counts_cs[fewest].sum(axis=1))])
            p = walk.pad_row(c, s, copies)
            pads.append((p, s))
            copies[p] = copies.get(p, 0) + 1
            counts_cs[c, s] += 1

    def original(p: int) -> int:
        return row_at.get(p, p)

    moved: dict[int, int] = {int(g): -1 for g in rejected_slots}
    for g, p in to_slot.items():
        moved[g] = walk.shard(p)
    for p, s in walk.override.items():
        moved[original(p)] = s
    moved = {g: s for g, s in moved.items() if s != g % n}
    numbered: list[tuple[int, int, int]] = []
    seen: dict[int, int] = {}
    for p, s in pads:
        g = original(p)
        seen[g] = seen.get(g, 0) + 1
        numbered.append((g, s, seen[g]))
    rows_out = survivors - len(dropped) + len(pads)
    return Deal(
        channel=channel,
        num_shards=n,
        seed=seed,
        rows_per_shard=rows_out // n,
        labels=tuple(labels.tolist()),
        start=tuple(start.tolist()),
        size=tuple(size.tolist()),
        rejected=frozenset(rejected_slots.tolist()),
        moved=moved,
        pads=tuple(numbered),
        dropped=tuple(sorted(original(p) for p in dropped)),
    )


class _Walk:
    """Each class's run of (new) slots ``start .. start + kept - 1``, slot p in shard p mod N
    unless ``override`` says otherwise: finds a class's highest or lowest row in a shard
    by walking the slots congruent to it, skipping the few overridden ones."""

    def __init__(self, n: int, start: np.ndarray, kept: np.ndarray) -> None:
        self.n, self.start, self.kept = n, start, kept
        self.override: dict[int, int] = {}
        self.into: dict[int, set[int]] = {}

    def shard(self, p: int) -> int:
        return self.override.get(p, p % self.n)

    def set(self, p: int, s: int) -> None:
        old = self.override.get(p)
        if old is not None:
            self.into[old].discard(p)
        self.override[p] = s
        self.into.setdefault(s, set()).add(p)

    def _range(self, c: int) -> tuple[int, int]:
        return int(self.start[c]), int(self.start[c] + self.kept[c])

    def last_in(self, c: int, s: int) -> int:
        """Class c's row in shard s with the highest slot."""
        a, b = self._range(c)
        p = b - 1 - ((b - 1 - s) % self.n)
        while p >= a and p in self.override:
            p -= self.n
        best = p if p >= a else -1
        for q in self.into.get(s, ()):
            if a <= q < b and q > best:
                best = q
        if best < 0:
            raise ShardError(f"plan: class {c} has no row in shard {s}")  # the counts say it has
        return best

    def _first(self, c: int, s: int | None, skip: Mapping[int, int]) -> int | None:
        """Class c's lowest slot in shard s (any shard if None) that ``skip`` does not hold."""
        a, b = self._range(c)
        if s is None:
            p = a
            while p < b and p in skip:
                p += 1
            return p if p < b else None
        p = a + ((s - a) % self.n)
        while p < b and (p in self.override or p in skip):
            p += self.n
        best = p if p < b else None
        for q in self.into.get(s, ()):
            if a <= q < b and q not in skip and (best is None or q < best):
                best = q
        return best

    def pad_row(self, c: int, s: int, copies: Mapping[int, int]) -> int:
        """The row of class c a pad in shard s copies: the fewest copies so far, then a row in
        shard s, then the lowest slot (step 4's order)."""
        a, b = self._range(c)
        mine = {p: k for p, k in copies.items() if a <= p < b}
        if len(mine) < b - a:  # some row has no copy yet
            found = self._first(c, s, mine)
            if found is None:
                found = self._first(c, None, mine)
            assert found is not None  # a row without a copy is a slot _first() can give
            return found
        fewest = min(mine.values())
        candidates = sorted(p for p, k in mine.items() if k == fewest)
        in_s = [p for p in candidates if self.shard(p) == s]
        return (in_s or candidates)[0]


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
        counted = (
            f"{survivors} rows"
            if not num_rejected
            else f"{survivors} rows left ({num_rejected} of {total} rejected)"
        )
        raise ShardError(
            f"channel {channel!r} has {counted}, fewer than num_shards={num_shards}: "
            "dropping the remainder would leave empty shards; use --remainder pad or fewer shards"
        )


def key_ranks(keys: Sequence[str], channel: str) -> np.ndarray:
    """Each key's rank in sorted order; keys must be unique (the plan breaks ties by key)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    for i, j in pairwise(order):
        if keys[i] == keys[j]:
            raise ShardError(f"key {keys[i]!r} appears twice in channel {channel!r} (rows {i} and {j})")
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = np.arange(len(keys))
    return rank


def fill_holes(
    slot: np.ndarray,
    cls: np.ndarray,
    is_rejected: np.ndarray,
    start: np.ndarray,
    kept: np.ndarray,
    num_shards: int,
) -> np.ndarray:
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
