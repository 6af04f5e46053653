"""The reader thread's side of a :class:`~loaders.ShardLoader`: windows of row groups in, batch
tasks out.

An epoch's order (:mod:`loaders._internal.shuffle`) cuts the rank's pieces (:mod:`loaders._internal.plan`) into
windows; the reader reads a window's row groups, permutes its rows, and hands every full batch
to the decode threads as a :class:`~loaders.batch.BatchTask`; the rows left over carry into the
next window. Every shard it opens is checked against the ``dataset.json`` the loader started
with (a dataset rebuilt mid-run is refused, not mixed in).

What an epoch reads is an :class:`EpochPlan`: by default the rank's own pieces in the order of
:mod:`loaders._internal.shuffle` (:meth:`WindowReader.plan`); for an epoch resumed at another world size,
the windows :mod:`loaders._internal.elastic` deals to this rank, whose pieces may lie in any shard.

The seam for other readers: :class:`WindowReader` needs the shard URIs, the pieces and
:meth:`WindowReader.read_window`; how the row groups are fetched is its own business.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lakeshard.errors import ConfigError, DatasetError, LoaderError
from lakeshard.format import OpenShard, open_shard
from loaders._internal.arrow_columns import binary_rows, int64_column
from loaders._internal.elastic import EpochSettings, Leg, LegPlan, order_of
from loaders._internal.epoch_reads import EpochPlan, RemoteRanges, last_window
from loaders._internal.fetch import ByteRange, RangeFetcher, read_row_group
from loaders._internal.plan import Piece
from loaders._internal.shuffle import EpochOrder, epoch_order
from loaders._internal.source import ShardSource
from loaders.batch import NULL_LABEL, BatchTask
from loaders.options import LoaderOptions
from loaders.stats import ReadCount

__all__ = ["Rows", "WindowReader"]

log = logging.getLogger(__name__)

_COLUMNS = ["image", "label", "is_pad"]


@dataclass(slots=True)
class Rows:
    """Rows in read order, column by column: what a :class:`BatchTask` holds, before its index."""

    images: list[bytes | None]
    labels: np.ndarray
    pads: np.ndarray
    shards: np.ndarray  #: index into the loader's shard URIs
    rows: np.ndarray  #: row number within that shard
    #: The label columns of a multi-label or boxes dataset (``None``: single-label).
    fields: pa.Table | None = None

    def __len__(self) -> int:
        return len(self.images)

    def take(self, perm: np.ndarray) -> Rows:
        images = self.images
        return Rows(
            [images[j] for j in perm.tolist()],
            self.labels[perm],
            self.pads[perm],
            self.shards[perm],
            self.rows[perm],
            None if self.fields is None else self.fields.take(perm),
        )

    def slice(self, lo: int, hi: int | None = None) -> Rows:
        fields = self.fields
        if fields is not None:
            fields = fields.slice(lo, (len(self) if hi is None else hi) - lo)
        return Rows(
            self.images[lo:hi],
            self.labels[lo:hi],
            self.pads[lo:hi],
            self.shards[lo:hi],
            self.rows[lo:hi],
            fields,
        )

    def then(self, other: Rows) -> Rows:
        """These rows followed by ``other``'s."""
        fields = None
        if self.fields is not None and other.fields is not None:
            fields = pa.concat_tables([self.fields, other.fields])
        labels, pads, shards, rows = (
            np.concatenate([a, b])
            for a, b in zip(
                (self.labels, self.pads, self.shards, self.rows),
                (other.labels, other.pads, other.shards, other.rows),
                strict=True,
            )
        )
        return Rows(self.images + other.images, labels, pads, shards, rows, fields)

    def task(self, index: int) -> BatchTask:
        return BatchTask(index, self.images, self.labels, self.pads, self.shards, self.rows, self.fields)


class WindowReader:
    """Reads rank ``options.rank``'s pieces of the shards of ``source`` (of the dataset it
    opened) window by window, as batch tasks.

    Invariant: ``0 <= start * batch_size <= end <= rows_per_rank`` for every epoch it reads; it
    holds at most one window of encoded rows (plus one read ahead, see :meth:`tasks`).
    """

    def __init__(
        self,
        source: ShardSource,
        options: LoaderOptions,
        *,
        pieces: list[Piece],
        num_batches: int,
        rows_per_rank: int,
    ) -> None:
        self.source = source
        self.options = options
        self.pieces = pieces
        self.num_batches, self.rows_per_rank = num_batches, rows_per_rank
        self.ranges = RemoteRanges(source, options, pieces)
        #: The label columns read beside the image (a multi-label or boxes dataset's; none: single-label).
        self.fields = list(source.info.columns or ()) if source.info.task is not None else []
        self.columns = ["image", "is_pad", *self.fields] if self.fields else _COLUMNS

    @property
    def fetcher(self) -> RangeFetcher | None:
        """Reads remote row groups ahead (``None``: every shard is local, read on the reader thread)."""
        return self.source.fetcher

    def batches(self, plan: EpochPlan) -> range:
        """The batches of ``plan``, counted from its position 0."""
        return range(-(-plan.end // self.options.batch_size))

    def order(self, epoch: int) -> EpochOrder:
        opts = self.options
        return epoch_order(
            [p.rows for p in self.pieces],
            shuffle=opts.shuffle,
            seed=opts.seed,
            epoch=epoch,
            rank=opts.rank,
            window_rows=opts.shuffle_window,
        )

    def plan(self, epoch: int) -> EpochPlan:
        """Epoch ``epoch`` started afresh on this rank: its own pieces, in its own order."""
        return EpochPlan(
            self.pieces,
            self.order(epoch),
            min(self.num_batches * self.options.batch_size, self.rows_per_rank),
        )

    def resumed(self, epoch: int, before: tuple[Leg, ...], current: Leg) -> tuple[EpochPlan, int]:
        """What this rank reads in leg ``current`` of ``epoch``, after the legs ``before``
        (:mod:`loaders._internal.elastic`), and the batches it yields there. Reads the footers of the
        shards other ranks read before (once each; a remote one is kept for the ranged reads).

        Raises:
            ConfigError: ``memory_budget`` leaves less than one of those row groups.
        """
        opts = self.options
        legs = [*before, current]
        settings = EpochSettings(
            shard_rows=tuple(self.source.shard_rows),
            row_groups=self.source.footers,
            shuffle=opts.shuffle,
            seed=opts.seed,
            epoch=epoch,
            window_rows=opts.shuffle_window,
            drop_last=opts.drop_last,
            remainder=opts.remainder,
        )
        legs_plan = LegPlan(settings, legs)
        n = len(legs) - 1
        read = order_of(legs_plan.sequence(n, opts.rank))
        fetcher = self.fetcher
        if fetcher is not None:  # room for row groups of other ranks' shards
            largest = self.ranges.max_range_bytes(read.pieces)
            if opts.memory_budget is None:
                fetcher.budget = max(fetcher.budget, opts.read_plan.in_flight * largest)
            elif fetcher.budget < largest:
                raise ConfigError(
                    f"memory_budget {opts.memory_budget} bytes leaves {fetcher.budget} for reads, less than one row "
                    f"group of {largest} bytes of the shards this rank resumes from; raise memory_budget"
                )
        tag = ("legs", tuple((leg.world_size, leg.batch_size, leg.batches) for leg in before))
        plan = EpochPlan(
            read.pieces, read.order, legs_plan.end(n), first_index=legs_plan.batches_before(n), tag=tag
        )
        return plan, legs_plan.num_batches(n)

    def tasks(
        self,
        epoch: int,
        start: int,
        stop: threading.Event,
        ahead: int | None = None,
        plan: EpochPlan | None = None,
        *,
        onward: bool = False,
        reads: ReadCount | None = None,
    ) -> Iterator[BatchTask]:
        """Batch tasks of ``epoch`` (read as ``plan`` says; default: :meth:`plan`) from batch
        ``start`` of the plan on; runs on the reader thread and returns early once ``stop`` is set.
        ``reads`` counts the row groups read.

        Remote row groups are fetched in the order the epoch reads them and, after the last
        one, the first round of epoch ``ahead`` (if given; :meth:`_ahead`), on the fetch
        threads, within the memory budget, so they never delay this epoch's batches. The first
        batch's reads are split in parts (:meth:`RemoteRanges.keys`) unless the epoch comes
        ``onward`` from the one before (the reads it asked ahead are taken as they are)."""
        bs = self.options.batch_size
        plan = plan or self.plan(epoch)
        pos = start * bs
        if pos >= plan.end:
            return
        files: dict[int, OpenShard] = {}
        carry: Rows | None = None  # rows read but not yet in a task
        index = plan.first_index + start
        first, last = plan.order.window_at(pos), last_window(plan)
        fetcher = self.fetcher
        if fetcher is not None:
            waited_from = None if onward else pos
            keys = self.ranges.keys(epoch, plan, range(first, last + 1), waited_from=waited_from)
            fetcher.schedule(keys + self._ahead(epoch, ahead))
        done = False
        try:
            for w in range(first, last + 1):
                window = self._window(epoch, plan, w, pos, files, stop, reads)
                if window is None:
                    return
                if carry is not None:
                    window = carry.then(window)
                n, k = len(window), 0
                while n - k >= bs:
                    yield window.slice(k, k + bs).task(index)
                    index, k = index + 1, k + bs
                carry = window.slice(k) if k < n else None
                # The tasks hold their rows now: let each row go once its batch is decoded,
                # instead of keeping the whole window until the next one is read.
                del window
            if carry is not None and len(carry):
                yield carry.task(index)
            done = True
        finally:
            for f in files.values():
                f.close()
            if not done and fetcher is not None:
                fetcher.drop()  # stopped early or failed: free what was read for later windows

    def _window(
        self,
        epoch: int,
        plan: EpochPlan,
        w: int,
        pos: int,
        files: dict[int, OpenShard],
        stop: threading.Event,
        reads: ReadCount | None,
    ) -> Rows | None:
        """The rows of window ``w`` of ``plan`` in their order, from position ``pos`` of the
        plan on (``None`` if ``stop`` is set meanwhile); ``reads`` counts its row groups."""
        order = plan.order
        indexes = [int(p) for p in order.windows[w]]
        pieces = [plan.pieces[p] for p in indexes]
        read = self.read_window(pieces, files, stop, keys=[(epoch, plan.tag, p) for p in indexes])
        if read is None:
            return None
        if reads is not None:
            reads.row_groups += len(indexes)
            self.ranges.count_cached(pieces, reads)
        perm = order.perms[w]
        lo = max(pos - int(order.starts[w]), 0)
        hi = min(plan.end - int(order.starts[w]), len(perm))
        return read.take(perm[lo:hi])

    def _ahead(self, epoch: int, ahead: int | None) -> list[tuple[tuple[int, Hashable, int], ByteRange]]:
        """The first round of reads of epoch ``ahead`` (none if it is ``None`` or ``epoch``): its
        first batch's, and at least one round of reads in flight, so the epoch after this one
        starts with a round trip's worth read, not only its first batch (from a far store, a row
        group first asked for when its epoch starts is a stall of a whole round trip)."""
        if ahead is None or ahead == epoch:
            return []
        following = self.plan(ahead)
        return self.ranges.keys(ahead, following, range(last_window(following) + 1))[
            : self.ranges.round(following)
        ]

    def read_window(
        self,
        pieces: Sequence[Piece],
        files: dict[int, OpenShard],
        stop: threading.Event,
        *,
        keys: Sequence[Hashable] = (),
    ) -> Rows | None:
        """The rows of ``pieces``, in order (``None`` if ``stop`` is set meanwhile). Remote
        pieces come from the fetcher, piece ``i`` under ``keys[i]`` (as :meth:`tasks` scheduled
        it); local ones are read here: opens shards not yet in ``files``, checks
        them against ``dataset.json`` (:meth:`OpenShard.check`) and keeps them there for the
        caller to close.

        Raises:
            DatasetError: a shard is not the one ``dataset.json`` describes (rebuilt since).
            LoaderError: a row group cannot be read, naming it, its rows and the shard.
        """
        images: list[bytes | None] = []
        labels, pads, shards, rows, fields = [], [], [], [], []
        for i, piece in enumerate(pieces):
            uri = self.source.shard_uris[piece.shard]
            where = f"row group {piece.row_group} (rows {piece.start}-{piece.stop - 1}) of {uri}"
            r = self.ranges.bytes_of(piece)
            if r is not None:
                table = self._fetched(keys[i], piece, r, where, stop)
                if table is None:
                    return None
            else:
                table = self._read_local(piece, files, where)
            table = table.slice(piece.start - piece.group_start, piece.rows)
            if table.num_rows != piece.rows:
                raise LoaderError(
                    f"{where}: expected {piece.rows} rows, read {table.num_rows} (shard changed?)"
                )
            # Copies: one ``bytes`` per row, the copy made without the GIL (``binary_rows``), so a
            # queued task never pins its whole window's Arrow buffers (zero-copy views did: see
            # docs/design/0006-loader-c-extensions.md).
            images.extend(binary_rows(table.column("image")))
            if self.fields:  # ``label`` is null: the label columns say it (decode_batch checks them)
                labels.append(np.zeros(piece.rows, dtype=np.int64))
                fields.append(table.select(self.fields))
            else:
                labels.append(int64_column(table.column("label"), null=NULL_LABEL))  # a bad row
            pad = np.full(piece.rows, piece.pad, dtype=bool)
            if "is_pad" in table.column_names:
                pad |= int64_column(table.column("is_pad"), null=0).astype(bool)
            pads.append(pad)
            shards.append(np.full(piece.rows, piece.shard, dtype=np.int32))
            rows.append(np.arange(piece.start, piece.stop, dtype=np.int64))
        return Rows(
            images,
            np.concatenate(labels),
            np.concatenate(pads),
            np.concatenate(shards),
            np.concatenate(rows),
            pa.concat_tables(fields) if fields else None,
        )

    def _fetched(
        self, key: Hashable, piece: Piece, r: ByteRange, where: str, stop: threading.Event
    ) -> pa.Table | None:
        """``piece``'s row group from the fetcher (scheduled by :meth:`tasks` under ``key``),
        decoded with the footer the loader read once; its bytes are released as soon as they
        are decoded."""
        footer = self.source.remote[piece.shard]
        md = footer.metadata
        fetcher = self.fetcher
        assert fetcher is not None  # a range is read through the fetcher only (_range)
        try:
            data = fetcher.get(key, stop)
            if data is None:
                return None
            # A nested column (boxes) is among the Arrow schema's names, not the Parquet leaves'.
            names = md.schema.to_arrow_schema().names if self.fields else md.schema.names
            columns = [c for c in self.columns if c in names]
            return read_row_group(md, footer.size, piece.row_group, r.start, data, columns)
        except Exception as exc:
            raise LoaderError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc
        finally:
            fetcher.release(key)

    def _read_local(self, piece: Piece, files: dict[int, OpenShard], where: str) -> pa.Table:
        uri = self.source.local.get(piece.shard, self.source.shard_uris[piece.shard])
        if piece.shard not in files:
            try:
                files[piece.shard] = open_shard(uri)
            except DatasetError as exc:
                raise LoaderError(f"cannot read {where}: {exc}") from exc
            # The shard dataset.json described when the loader started, not one rebuilt since.
            source = self.source
            files[piece.shard].check(
                source.info, source.channel, piece.shard, rows=source.shard_rows[piece.shard]
            )
        pf = files[piece.shard].parquet
        try:
            columns = [c for c in self.columns if c in pf.schema_arrow.names]
            # One thread: the decode threads keep the cores busy; Arrow's pool only adds hand-offs.
            return pf.read_row_group(piece.row_group, columns=columns, use_threads=False)
        except Exception as exc:
            raise LoaderError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc
