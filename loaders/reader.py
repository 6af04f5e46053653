"""The reader thread's side of a :class:`~loaders.ShardLoader`: windows of row groups in, batch
tasks out.

An epoch's order (:mod:`loaders.shuffle`) cuts the rank's pieces (:mod:`loaders.plan`) into
windows; the reader reads a window's row groups, permutes its rows, and hands every full batch
to the decode threads as a :class:`~loaders.batch.BatchTask`; the rows left over carry into the
next window. Every shard it opens is checked against the ``dataset.json`` the loader started
with (a dataset rebuilt mid-run is refused, not mixed in).

The seam for other readers: :class:`WindowReader` needs the shard URIs, the pieces and
:meth:`WindowReader.read_window`; how the row groups are fetched is its own business.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from lakeshard.errors import DatasetError, LoaderError
from lakeshard.format import DatasetInfo, OpenShard, open_shard
from loaders.arrow_columns import binary_rows, int64_column
from loaders.batch import NULL_LABEL, BatchTask
from loaders.options import LoaderOptions
from loaders.plan import Piece
from loaders.shuffle import EpochOrder, epoch_order

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

    def __len__(self) -> int:
        return len(self.images)

    def take(self, perm: np.ndarray) -> Rows:
        images = self.images
        return Rows([images[j] for j in perm.tolist()], self.labels[perm], self.pads[perm], self.shards[perm], self.rows[perm])

    def slice(self, lo: int, hi: int | None = None) -> Rows:
        return Rows(self.images[lo:hi], self.labels[lo:hi], self.pads[lo:hi], self.shards[lo:hi], self.rows[lo:hi])

    def then(self, other: Rows) -> Rows:
        """These rows followed by ``other``'s."""
        return Rows(
            self.images + other.images,
            *(np.concatenate([a, b]) for a, b in
              zip((self.labels, self.pads, self.shards, self.rows), (other.labels, other.pads, other.shards, other.rows), strict=True)),
        )  # fmt: skip

    def task(self, index: int) -> BatchTask:
        return BatchTask(index, self.images, self.labels, self.pads, self.shards, self.rows)


@dataclass(frozen=True, slots=True)
class _Ahead:
    """The first window of ``epoch``, read before that epoch started (see :meth:`WindowReader.tasks`)."""

    epoch: int
    rows: Rows


class WindowReader:
    """Reads rank ``options.rank``'s pieces of the shards at ``shard_uris`` (of the dataset
    ``info`` describes) window by window, as batch tasks.

    Invariant: ``0 <= start * batch_size <= end <= rows_per_rank`` for every epoch it reads; it
    holds at most one window of encoded rows (plus one read ahead, see :meth:`tasks`).
    """

    def __init__(self, info: DatasetInfo, options: LoaderOptions, *, shard_uris: tuple[str, ...],
                 shard_rows: list[int], pieces: list[Piece], num_batches: int, rows_per_rank: int) -> None:
        self.info = info
        self.options = options
        self.shard_uris = shard_uris
        self._shard_rows = shard_rows
        self.pieces = pieces
        self._num_batches = num_batches
        self._rows_per_rank = rows_per_rank
        self._ahead: _Ahead | None = None  # the next epoch's first window, read in advance
        self.row_groups_read = 0

    def drop_ahead(self, *, unless_epoch: int | None = None) -> None:
        """Free what was read ahead (kept if it is for ``unless_epoch``)."""
        if self._ahead is not None and self._ahead.epoch != unless_epoch:
            self._ahead = None

    def order(self, epoch: int) -> EpochOrder:
        opts = self.options
        return epoch_order(
            [p.rows for p in self.pieces], shuffle=opts.shuffle, seed=opts.seed, epoch=epoch,
            rank=opts.rank, window_rows=opts.shuffle_window,
        )  # fmt: skip

    def tasks(self, epoch: int, start: int, ahead_epoch: int | None = None) -> Iterator[BatchTask]:
        """Batch tasks of ``epoch`` from batch ``start`` on, then the first window of
        ``ahead_epoch`` read ahead (if given); runs on the reader thread."""
        bs = self.options.batch_size
        order = self.order(epoch)
        end = min(self._num_batches * bs, self._rows_per_rank)
        pos = start * bs
        if pos >= end:
            return
        files: dict[int, OpenShard] = {}
        carry: Rows | None = None  # rows read but not yet in a task
        index = start
        ahead, self._ahead = self._ahead, None
        try:
            for w in range(order.window_at(pos), len(order.windows)):
                if ahead is not None and ahead.epoch == epoch and w == 0:
                    read = ahead.rows
                else:
                    read = self.read_window([self.pieces[int(p)] for p in order.windows[w]], files)
                ahead = None
                self.row_groups_read += len(order.windows[w])
                perm = order.perms[w]
                lo = max(pos - int(order.starts[w]), 0)
                hi = min(end - int(order.starts[w]), len(perm))
                window = read.take(perm[lo:hi])
                if carry is not None:
                    window = carry.then(window)
                n, k = len(window), 0
                while n - k >= bs:
                    yield window.slice(k, k + bs).task(index)
                    index, k = index + 1, k + bs
                carry = window.slice(k) if k < n else None
                # The tasks hold their rows now: let each row go once its batch is decoded,
                # instead of keeping the whole window until the next one is read.
                read = window = None
                if int(order.starts[w + 1]) >= end:
                    break
            if carry is not None and len(carry):
                yield carry.task(index)
        finally:
            for f in files.values():
                f.close()
        # Every task of this epoch is handed over (a close() or an error never gets here). While
        # the decode threads finish its last batches, read the first window of the epoch that
        # is expected next, so that it starts decoding at once instead of after a window's read.
        if ahead_epoch is not None:
            self._ahead = self._read_ahead(ahead_epoch)

    def _read_ahead(self, epoch: int) -> _Ahead | None:
        order = self.order(epoch)
        files: dict[int, OpenShard] = {}
        try:
            return _Ahead(epoch, self.read_window([self.pieces[int(p)] for p in order.windows[0]], files))
        except (LoaderError, DatasetError) as exc:  # that epoch reads it again, and raises if it still fails
            log.debug("could not read ahead into epoch %d: %s", epoch, exc)
            return None
        finally:
            for f in files.values():
                f.close()

    def read_window(self, pieces: list[Piece], files: dict[int, OpenShard]) -> Rows:
        """The rows of ``pieces``, in order; opens shards not yet in ``files``, checks them against
        ``dataset.json`` (:meth:`OpenShard.check`) and keeps them there for the caller to close.

        Raises:
            DatasetError: a shard is not the one ``dataset.json`` describes (rebuilt since).
            LoaderError: a row group cannot be read, naming it, its rows and the shard.
        """
        images: list[bytes | None] = []
        labels, pads, shards, rows = [], [], [], []
        for piece in pieces:
            uri = self.shard_uris[piece.shard]
            where = f"row group {piece.row_group} (rows {piece.start}-{piece.stop - 1}) of {uri}"
            if piece.shard not in files:
                try:
                    files[piece.shard] = open_shard(uri)
                except DatasetError as exc:
                    raise LoaderError(f"cannot read {where}: {exc}") from exc
                # The shard dataset.json described when the loader started, not one rebuilt since.
                files[piece.shard].check(self.info, self.options.channel, piece.shard, rows=self._shard_rows[piece.shard])
            pf = files[piece.shard].parquet
            try:
                columns = [c for c in _COLUMNS if c in pf.schema_arrow.names]
                # One thread: the decode threads keep the cores busy; Arrow's pool only adds hand-offs.
                table = pf.read_row_group(piece.row_group, columns=columns, use_threads=False)
            except Exception as exc:
                raise LoaderError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc
            table = table.slice(piece.start - piece.group_start, piece.rows)
            if table.num_rows != piece.rows:
                raise LoaderError(f"{where}: expected {piece.rows} rows, read {table.num_rows} (shard changed?)")
            # Copies: one ``bytes`` per row, the copy made without the GIL (``binary_rows``), so a
            # queued task never pins its whole window's Arrow buffers (zero-copy views did: see
            # docs/design/0006-loader-c-extensions.md).
            images.extend(binary_rows(table.column("image")))
            labels.append(int64_column(table.column("label"), null=NULL_LABEL))  # a bad row
            pad = np.full(piece.rows, piece.pad, dtype=bool)
            if "is_pad" in table.column_names:
                pad |= int64_column(table.column("is_pad"), null=0).astype(bool)
            pads.append(pad)
            shards.append(np.full(piece.rows, piece.shard, dtype=np.int32))
            rows.append(np.arange(piece.start, piece.stop, dtype=np.int64))
        return Rows(images, np.concatenate(labels), np.concatenate(pads), np.concatenate(shards), np.concatenate(rows))
