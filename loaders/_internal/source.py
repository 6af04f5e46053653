"""One channel of one dataset, as a rank reads it: ``dataset.json``, its shards' footers, the
reads and the shard cache, opened and closed in one place.

A :class:`ShardSource` is what a loader reads from; how it reads (which rows, in which order,
with how many threads) is the loader's. It holds:

* the dataset as it was when the source was opened (:attr:`info`): every shard it reads must be
  the one ``dataset.json`` described then;
* each shard's row-group sizes, read from its footer on first use and checked against
  ``dataset.json`` (:meth:`row_groups`); a remote shard's footer (with its size and ETag) is kept
  in :attr:`remote` for the ranged reads of every epoch;
* the store of the dataset's URI (:attr:`store`, :func:`lakeshard.storage.store_for`), through
  which every remote read goes;
* the ranged reads of remote shards (:attr:`fetcher`, :mod:`loaders._internal.fetch`), started by
  :meth:`start_reads`; local shards are read on the reader thread;
* the shard cache (:attr:`cache`, :mod:`loaders._internal.cache`), a layer over the store, and the
  verified local copies of remote shards it holds (:attr:`local`), read instead of the store from
  the epoch after they are ready.

:meth:`stop` ends its threads between iterations (a later one starts them again); :meth:`close`
also closes the cache's files.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

from lakeshard import format as contract
from lakeshard import storage
from lakeshard.errors import ConfigError
from lakeshard.storage import RequestCounts
from loaders._internal.cache import CachedShard, ShardCache
from loaders._internal.fetch import RangeFetcher, read_range

__all__ = ["ShardSource"]


class ShardSource:
    """Channel ``channel`` of the dataset at ``dataset`` (a path, ``file://`` or ``s3://`` URI):
    reads ``dataset.json`` now, footers and row groups when asked."""

    def __init__(self, dataset: str | os.PathLike[str], channel: str) -> None:
        if not isinstance(dataset, str | os.PathLike):
            raise ConfigError(f"dataset must be a path or a URI, got {dataset!r}")
        self.dataset = storage.normalize(os.fspath(dataset))
        #: Where the dataset's files are: its shards are read through it.
        self.store = storage.store_for(self.dataset)
        self.channel = channel
        self.info = contract.read_dataset_info(self.dataset)
        shards = contract.channel_shards(self.dataset, self.info, channel)
        self.shard_uris = tuple(uri for uri, _ in shards)
        self.shard_rows = [rows for _, rows in shards]
        self.total_rows = sum(self.shard_rows)
        #: Row-group sizes of each shard whose footer was read (and checked).
        self.groups: dict[int, list[int]] = {}
        #: Remote shards read so far: the footer of each, with its size and ETag.
        self.remote: dict[int, contract.ShardFooter] = {}
        #: Verified local copies of remote shards (shard index -> ``file://`` URI), read instead
        #: of the store from the next epoch on (:meth:`use_local`).
        self.local: dict[int, str] = {}
        self.fetcher: RangeFetcher | None = None
        self.cache: ShardCache | None = None
        self._cached: list[CachedShard] = []

    @property
    def dataset_version(self) -> str:
        return self.info.dataset_version

    @property
    def caching(self) -> bool:
        """Whether remote shards are also kept in a shard cache (reads count hits and misses)."""
        return self.cache is not None

    # -- footers -----------------------------------------------------------------------------------
    def row_groups(self, shard: int) -> list[int]:
        """Row-group sizes of ``shard``, after checking its footer against ``dataset.json``
        (read once; a remote shard's footer is kept in :attr:`remote`)."""
        if shard not in self.groups:
            uri, rows = self.shard_uris[shard], self.shard_rows[shard]
            if self.store.local:
                with contract.open_shard(uri) as f:
                    self.groups[shard] = f.check(self.info, self.channel, shard, rows=rows)
            else:
                footer = contract.read_shard_footer(uri)  # one GET (no HEAD) for most shards
                self.groups[shard] = footer.check(self.info, self.channel, shard, rows=rows)
                self.remote[shard] = footer
        return self.groups[shard]

    def read_footers(self, shards: list[int], *, concurrency: int, name: str) -> dict[int, list[int]]:
        """:meth:`row_groups` of each of ``shards``, up to ``concurrency`` at once: a remote
        footer costs round trips, and a rank of many shards would otherwise pay them in a row."""
        if len(shards) < 2:
            return {s: self.row_groups(s) for s in shards}
        workers = min(len(shards), concurrency)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-footer") as pool:
            return dict(zip(shards, pool.map(self.row_groups, shards), strict=True))

    @property
    def footers(self) -> Mapping[int, list[int]]:
        """Row-group sizes of every shard of the channel, each footer read on first use."""
        return _Footers(self)

    # -- reads -------------------------------------------------------------------------------------
    def start_reads(self, *, concurrency: int, name: str) -> RangeFetcher | None:
        """Start the ranged reads of the remote shards read so far (``None`` if there are none):
        ``concurrency`` reads in flight, their budget set by the caller."""
        if self.remote and self.fetcher is None:
            read = functools.partial(read_range, self.store)
            self.fetcher = RangeFetcher(read, concurrency=concurrency, budget=0, name=name)
            # Its threads too: started behind the first reads, each is a wait (NOTE [ Fetch threads ]).
            self.fetcher.start()
        return self.fetcher

    def open_cache(self, cache_dir: str, *, limit: int) -> ShardCache:
        """The cache of this dataset version's remote shards read so far; copies already there
        (and sound) are used from the first epoch, the others are filled from the reads
        (read-through: each row group read goes into the cache's file) and in the background
        (see :mod:`loaders._internal.cache`)."""
        cache = ShardCache(
            cache_dir, self.store, dataset_version=self.dataset_version, channel=self.channel, limit=limit
        )
        entries = self.info.channel(self.channel).shards
        self._cached = [
            CachedShard(i, self.shard_uris[i], entries[i].bytes, entries[i].sha256)
            for i in sorted(self.remote)
        ]
        for shard in self._cached:
            cache.adopt(shard)
        self.use_local(cache.ready())
        assert self.fetcher is not None  # a cache of remote shards: opened after start_reads
        self.fetcher.on_read = lambda r, data, offer=cache.offer: offer(r.uri, r.start, data)
        self.cache = cache
        return cache

    def use_local(self, copies: dict[int, str]) -> None:
        """Read the shards ``copies`` names (index -> a local ``file://`` URI of the same bytes, as
        :mod:`loaders._internal.cache` verified them) from there, from the next epoch on. Between epochs
        only."""
        self.local.update(copies)

    def epoch_starts(self, *, name: str, expected: dict[int, list[tuple[int, int]]], settle_s: float) -> None:
        """An epoch starts: shards cached since the last one are read from disk now, and the
        cache fills what this epoch's reads will not bring (``expected``: the byte ranges it
        reads, by shard)."""
        cache = self.cache
        if cache is None:
            return
        cache.epoch_ended()  # a fill that waited on the last epoch's reads takes the rest
        if cache.filling():  # it has the bytes and is hashing them: read its file, not the store
            cache.wait(timeout=settle_s)
        self.use_local(cache.ready())
        cache.start(self._cached, name=name, expected=expected)

    def epoch_ended(self) -> None:
        """Every read of the epoch is in: a cache fill takes the rest now."""
        if self.cache is not None:
            self.cache.epoch_ended()

    def fills_cache(self) -> bool:
        """Whether the reads of the epoch running now fill the cache (the next one reads its files)."""
        return self.cache is not None and self.cache.filling()

    # -- figures and shutdown ----------------------------------------------------------------------
    def requests(self) -> RequestCounts:
        """The store requests of this source so far: its reads' and its cache's."""
        store = self.fetcher.requests.counts() if self.fetcher is not None else RequestCounts()
        if self.cache is not None:
            store = store + self.cache.requests.counts()
        return store

    @property
    def peak_bytes_held(self) -> int:
        return self.fetcher.peak_bytes_held if self.fetcher is not None else 0

    def stop(self, *, final: bool = False) -> None:
        """Stop the source's threads (a later epoch starts them again); ``final``: it is gone,
        close its cache's files too."""
        if self.fetcher is not None:
            self.fetcher.close()
        if self.cache is not None:
            self.cache.close() if final else self.cache.stop()


class _Footers(Mapping[int, list[int]]):
    """Row-group sizes of a source's shards, each footer read (and checked) on first use."""

    def __init__(self, source: ShardSource) -> None:
        self._source = source

    def __getitem__(self, shard: int) -> list[int]:
        return self._source.row_groups(shard)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._source.shard_rows)))

    def __len__(self) -> int:
        return len(self._source.shard_rows)
