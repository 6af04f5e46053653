"""What an epoch reads on a rank: its plan (:class:`EpochPlan`) and, for remote shards, the byte
ranges of its row groups (:class:`RemoteRanges`): the fetch keys of its windows, the bytes the
reads may hold, the bytes an epoch reads from the store, what the cache takes from those reads."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

from lakeshard.errors import ConfigError
from loaders._internal.fetch import ByteRange, RangeFetcher, row_group_range
from loaders._internal.plan import Piece
from loaders._internal.shuffle import EpochOrder
from loaders._internal.source import ShardSource
from loaders.options import LoaderOptions
from loaders.stats import ReadCount

__all__ = ["EpochPlan", "RemoteRanges", "batch_windows", "last_window"]


@dataclass(frozen=True)
class EpochPlan:
    """What one epoch reads on this rank: ``order`` (windows of indices into ``pieces``; its
    ``perms`` select the rows of each window, in order) and the positions it yields, ``[0, end)``.

    ``first_index`` is the batch index of position 0 (the batches of an epoch's earlier legs, see
    :mod:`loaders._internal.elastic`); ``tag`` tells plans of one epoch apart in the fetcher's keys."""

    pieces: Sequence[Piece]
    order: EpochOrder
    end: int
    first_index: int = 0
    tag: Hashable = "fresh"


class RemoteRanges:
    """The remote byte ranges of a rank's ``pieces`` of ``source``'s shards (those read through
    the fetcher: remote and not cached yet), each worked out once."""

    def __init__(self, source: ShardSource, options: LoaderOptions, pieces: list[Piece]) -> None:
        self.source, self.options, self.pieces = source, options, pieces
        self._bytes: dict[tuple[int, int], ByteRange] = {}  # (shard, row group) -> its bytes (remote)

    @property
    def fetcher(self) -> RangeFetcher | None:
        return self.source.fetcher

    def bytes_of(self, piece: Piece) -> ByteRange | None:
        """The bytes of ``piece``'s row group when it is read through the fetcher, else ``None``."""
        if self.fetcher is None or piece.shard not in self.source.remote or piece.shard in self.source.local:
            return None
        key = (piece.shard, piece.row_group)
        if key not in self._bytes:
            footer = self.source.remote[piece.shard]
            lo, hi = row_group_range(footer.metadata, piece.row_group)
            self._bytes[key] = ByteRange(self.source.shard_uris[piece.shard], lo, hi, footer.etag)
        return self._bytes[key]

    def count_cached(self, pieces: Sequence[Piece], reads: ReadCount) -> None:
        """Count the row groups of a remote dataset that ``pieces`` read from the shard cache
        (hits, and their bytes) or from the store (misses, when there is a cache)."""
        if not self.source.caching or self.fetcher is None:
            return
        for piece in pieces:
            if piece.shard not in self.source.remote:
                continue
            if piece.shard in self.source.local:
                lo, hi = row_group_range(self.source.remote[piece.shard].metadata, piece.row_group)
                reads.cache_hits += 1
                reads.cache_bytes += hi - lo
            else:
                reads.cache_misses += 1

    def remote_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """By remote shard (read through the fetcher), the byte ranges of the row groups an epoch
        of this rank reads: what the shard cache can take from those reads."""
        out: dict[int, set[tuple[int, int]]] = {}
        for piece in self.pieces:
            r = self.bytes_of(piece)
            if r is not None:
                out.setdefault(piece.shard, set()).add((r.start, r.end))
        return {shard: sorted(ranges) for shard, ranges in out.items()}

    def max_range_bytes(self, pieces: Sequence[Piece] | None = None) -> int:
        """The largest remote row group of ``pieces`` (default: this rank's own)."""
        ranges = (self.bytes_of(p) for p in (self.pieces if pieces is None else pieces))
        return max((r.size for r in ranges if r is not None), default=0)

    def read_budget(self, *, blocks: int, image_size: int, dataset: str) -> int:
        """The bytes the remote reads may hold: what ``memory_budget`` leaves beside ``blocks``
        decoded batches, or by default ``ReadPlan.in_flight`` row groups and one shuffle window.

        Raises:
            ConfigError: ``memory_budget`` leaves less than one row group.
        """
        opts = self.options
        side = opts.crop or image_size
        decoded = blocks * opts.batch_size * 3 * side * side * (4 if opts.normalize else 1)
        largest = self.max_range_bytes()
        budget = opts.memory_budget_bytes
        if budget is None:
            return opts.read_plan.in_flight * largest + self.window_bytes()
        if budget - decoded < largest:
            raise ConfigError(
                f"memory_budget {budget} bytes is too small: the decoded batches take {decoded} "
                f"({blocks} blocks of {opts.batch_size} images) and one row group of {dataset} up to {largest}"
            )
        return budget - decoded

    def planned_bytes(self, plan: EpochPlan, batches: Iterable[int]) -> int:
        """The bytes of the remote row groups that ``batches`` of ``plan`` (counted from its
        position 0) read from the store, each window once (local and cached shards: 0): what a
        cost budget projects an epoch's cost over."""
        bs = self.options.batch_size
        windows: set[int] = set()
        for k in batches:
            windows.update(batch_windows(plan, k * bs, bs))
        ranges = (self.bytes_of(plan.pieces[int(p)]) for w in windows for p in plan.order.windows[w])
        return sum(r.size for r in ranges if r is not None)

    def window_bytes(self) -> int:
        """At most the remote bytes of one shuffle window of this rank's pieces (at the densest
        row group's bytes per row): a fetch budget this much above the reads in flight lets the
        next window be read while this one is decoded."""
        per_row = 0.0
        for piece in self.pieces:
            r = self.bytes_of(piece)
            if r is not None:
                md = self.source.remote[piece.shard].metadata
                per_row = max(per_row, r.size / max(1, md.row_group(piece.row_group).num_rows))
        return int(per_row * self.options.shuffle_window) + self.max_range_bytes()

    def keys(
        self, epoch: int, plan: EpochPlan, windows: range, *, waited_from: int | None = None
    ) -> list[tuple[tuple[int, Hashable, int], ByteRange]]:
        """The fetches of ``windows`` of ``epoch``, in order: keys ``(epoch, plan tag, piece index)``.
        ``waited_from``: the epoch starts now, at row ``waited_from`` of ``plan`` (0, or where a
        restored state resumes it), so its first batch waits for the reads of its row groups
        (unless they were read ahead): those are fetched in ``ReadPlan.first_batch_parts`` parts
        at once (of at least 1 MiB each), over as many connections."""
        waited = (
            range(0) if waited_from is None else batch_windows(plan, waited_from, self.options.batch_size)
        )
        keyed = (
            (w, int(p), self.bytes_of(plan.pieces[int(p)])) for w in windows for p in plan.order.windows[w]
        )
        return [
            (
                (epoch, plan.tag, p),
                replace(r, parts=self.options.read_plan.first_batch_parts) if w in waited else r,
            )
            for w, p, r in keyed
            if r is not None
        ]

    def round(self, plan: EpochPlan) -> int:
        """How many of ``plan``'s first reads one round is: its first batch's, and at least
        ``ReadPlan.read_ahead``."""
        needed = sum(len(plan.order.windows[w]) for w in batch_windows(plan, 0, self.options.batch_size))
        return max(needed, self.options.read_plan.read_ahead)


def batch_windows(plan: EpochPlan, pos: int, batch_size: int) -> range:
    """The windows of ``plan`` the batch starting at its row ``pos`` takes rows from."""
    if pos >= plan.end:
        return range(0)
    return range(plan.order.window_at(pos), plan.order.window_at(min(pos + batch_size, plan.end) - 1) + 1)


def last_window(plan: EpochPlan) -> int:
    """The last window ``plan`` reads (the one holding its position ``end - 1``; -1 if none)."""
    return plan.order.window_at(plan.end - 1) if plan.end > 0 else -1
