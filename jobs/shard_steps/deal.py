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
list (:func:`deal_from_counts`); the workers compute the slots (:func:`jobs.shard_steps.deal_rows.class_slots`,
over one class's rows at a time) and apply the deal to their rows (:mod:`jobs.shard_steps.deal_rows`).
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from lakeshard.errors import ShardError
from lakeshard.settings import check_positive

__all__ = [
    "DROPPED_ROWS_SHARD",
    "REMAINDER_POLICIES",
    "Deal",
    "check_options",
    "check_survivors",
    "deal_from_counts",
    "fill_holes",
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
    n = num_shards
    labels, start, size = _classes(counts, channel)
    total = int(size.sum())
    rejected_slots = _rejected_slots(rejected, channel, total)
    check_survivors(channel, total, len(rejected_slots), num_shards=n, remainder=remainder)
    cls_of_rejected = np.searchsorted(start, rejected_slots, side="right") - 1
    kept = size - np.bincount(cls_of_rejected, minlength=len(size)).astype(np.int64)
    to_slot = _fill(rejected_slots, start, size, kept, n)
    counts_cs = _below(start + kept, n) - _below(start, n)
    walk = _Walk(n, start, kept)
    totals = _even_totals(counts_cs, walk)
    if remainder == "drop":
        dropped, pads = _drop(counts_cs, totals, kept, walk), []
    else:
        dropped, pads = [], _pad(counts_cs, totals, kept, walk)
    row_at = {p: g for g, p in to_slot.items()}  # new slot -> original slot, where they differ
    rows_out = total - len(rejected_slots) - len(dropped) + len(pads)
    return Deal(
        channel=channel,
        num_shards=n,
        seed=seed,
        rows_per_shard=rows_out // n,
        labels=tuple(labels.tolist()),
        start=tuple(start.tolist()),
        size=tuple(size.tolist()),
        rejected=frozenset(rejected_slots.tolist()),
        moved=_moved(rejected_slots, to_slot, row_at, walk),
        pads=_numbered(pads, row_at),
        dropped=tuple(sorted(row_at.get(p, p) for p in dropped)),
    )


def _classes(counts: Mapping[int, int], channel: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The labels of the classes present, in label order, with each class's first slot and size."""
    present = sorted((int(k), int(v)) for k, v in counts.items() if v)
    if any(v < 0 for _, v in present):
        raise ShardError(f"class counts of channel {channel!r} must not be negative, got {dict(counts)}")
    labels = np.asarray([k for k, _ in present], dtype=np.int64)
    size = np.asarray([v for _, v in present], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64) if len(size) else size
    if int(size.sum()) == 0:
        raise ShardError(f"channel {channel!r} has no rows to shard")
    return labels, start, size


def _rejected_slots(rejected: Iterable[int], channel: str, total: int) -> np.ndarray:
    """The slots ``rejected``, unique and ascending, each checked to be one of the ``total``."""
    slots = np.unique(np.fromiter((int(g) for g in rejected), dtype=np.int64))
    if len(slots) and (slots[0] < 0 or slots[-1] >= total):
        bad = slots[0] if slots[0] < 0 else slots[-1]
        raise ShardError(f"rejected slot {int(bad)} is out of range for channel {channel!r} of {total} rows")
    return slots


def _fill(
    rejected_slots: np.ndarray, start: np.ndarray, size: np.ndarray, kept: np.ndarray, n: int
) -> dict[int, int]:
    """Step 2, on the rejected slots and each class's tail only: the survivors that move into a
    hole, original slot -> new slot."""
    tail = [np.arange(start[c] + kept[c], start[c] + size[c]) for c in range(len(size)) if kept[c] < size[c]]
    involved = np.union1d(rejected_slots, np.concatenate(tail) if tail else np.empty(0, np.int64))
    is_rej = np.isin(involved, rejected_slots)
    cls = np.searchsorted(start, involved, side="right") - 1
    filled = fill_holes(involved.copy(), cls, is_rej, start, kept, n)
    return {int(g): int(p) for g, p, r in zip(involved, filled, is_rej, strict=True) if not r and g != p}


def _below(x: np.ndarray, n: int) -> np.ndarray:
    """For each of ``x``, the slots in ``[0, x)`` congruent to each shard: the counts per (class,
    shard) of each class's run of new slots ``start .. start + kept - 1`` are differences of these."""
    s = np.arange(n)[None, :]
    return np.maximum(0, (x[:, None] - s + n - 1) // n)


def _even_totals(counts_cs: np.ndarray, walk: _Walk) -> np.ndarray:
    """Step 3: rows moved from the fullest shard to the emptiest until the totals differ by at
    most one (``counts_cs`` and ``walk`` updated); the shards' totals."""
    totals = counts_cs.sum(axis=0)
    while totals.max() - totals.min() > 1:
        a, b = int(totals.argmax()), int(totals.argmin())
        c = int(np.flatnonzero(counts_cs[:, a] > counts_cs[:, b])[0])
        walk.set(walk.last_in(c, a), b)
        counts_cs[c, a] -= 1
        counts_cs[c, b] += 1
        totals[a] -= 1
        totals[b] += 1
    return totals


def _drop(counts_cs: np.ndarray, totals: np.ndarray, kept: np.ndarray, walk: _Walk) -> list[int]:
    """Step 4, ``drop``: the new slots of the rows dropped, a row from each shard holding one more."""
    dropped: list[int] = []
    for s in np.flatnonzero(totals > totals.min()).tolist():
        extra = np.flatnonzero(counts_cs[:, s] > counts_cs.min(axis=1))
        c = int(extra[np.argmax(kept[extra])])
        p = walk.last_in(c, s)
        dropped.append(p)
        walk.set(p, -1)
        counts_cs[c, s] -= 1
    return dropped


def _pad(counts_cs: np.ndarray, totals: np.ndarray, kept: np.ndarray, walk: _Walk) -> list[tuple[int, int]]:
    """Step 4, ``pad``: the pad copies as (new slot, shard), one for each shard holding one row fewer."""
    low = totals.min()
    pads: list[tuple[int, int]] = []
    if totals.max() == low:
        return pads
    copies: dict[int, int] = {}
    for s in np.flatnonzero(totals == low).tolist():
        fewest = np.flatnonzero((counts_cs[:, s] == counts_cs.min(axis=1)) & (kept > 0))
        c = int(fewest[np.argmin(counts_cs[fewest].sum(axis=1))])
        p = walk.pad_row(c, s, copies)
        pads.append((p, s))
        copies[p] = copies.get(p, 0) + 1
        counts_cs[c, s] += 1
    return pads


def _moved(
    rejected_slots: np.ndarray, to_slot: Mapping[int, int], row_at: Mapping[int, int], walk: _Walk
) -> dict[int, int]:
    """:attr:`Deal.moved`: the shard of each original slot not in shard ``slot mod N``."""
    n = walk.n
    moved: dict[int, int] = {int(g): -1 for g in rejected_slots}
    for g, p in to_slot.items():
        moved[g] = walk.shard(p)
    for p, s in walk.override.items():
        moved[row_at.get(p, p)] = s
    return {g: s for g, s in moved.items() if s != g % n}


def _numbered(pads: list[tuple[int, int]], row_at: Mapping[int, int]) -> tuple[tuple[int, int, int], ...]:
    """:attr:`Deal.pads`: each pad copy as (original slot, shard, copy), copy 1, 2, … per slot."""
    numbered: list[tuple[int, int, int]] = []
    seen: dict[int, int] = {}
    for p, s in pads:
        g = row_at.get(p, p)
        seen[g] = seen.get(g, 0) + 1
        numbered.append((g, s, seen[g]))
    return tuple(numbered)


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
