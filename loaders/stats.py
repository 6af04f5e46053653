"""What an epoch of a loader cost: requests, bytes, cache hits, decode CPU, the training loop's
wait, and an estimate in dollars (``loader.epoch_stats()``).

Each figure is counted where the work happens, cheaply enough to stay on (under 1% of the
loader's CPU per image: docs/performance.md): the store's GETs by the code that sends them
(:class:`lakeshard.storage.RequestStats`, retries and errors included), the shard cache's hits
by the reader thread, decoding by each decode thread (its own CPU time), the wait by the
consumer. The loader keeps totals over its life and reports an iteration's share as the
difference between two snapshots (:meth:`LoaderTotals.__sub__`), so nothing is reset while
threads run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lakeshard import storage
from lakeshard.errors import ConfigError, LoaderError
from lakeshard.storage import RequestCounts

__all__ = [
    "AZURE_PRICES",
    "BUDGET_ACTIONS",
    "BUDGET_EVERY",
    "GCS_PRICES",
    "STORE_PRICES",
    "CostBudget",
    "DecodeTally",
    "LoaderCounters",
    "LoaderStats",
    "LoaderTotals",
    "PriceTable",
    "ReadCount",
    "prices_for",
    "usd",
]

log = logging.getLogger(__name__)

#: What a loader does when an epoch's estimated cost would pass ``cost_budget``.
BUDGET_ACTIONS = ("warn", "stop")
#: The cost budget is checked every this many batches.
BUDGET_EVERY = 8


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Prices to estimate what an epoch's reads cost, in US dollars.

    Defaults: Amazon S3 Standard in us-east-1, from https://aws.amazon.com/s3/pricing/ (as
    published in 2024-2026): GET requests $0.0004 per 1,000, and data transfer out of the region
    to another AWS region $0.02 per GB. Reads from an instance in the bucket's own region
    transfer for free (``transfer_per_gb=0``); to the internet they cost $0.05-0.09 per GB.
    """

    get_per_1000: float = 0.0004
    transfer_per_gb: float = 0.02

    def __post_init__(self) -> None:
        for name in ("get_per_1000", "transfer_per_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"{name} must be a non-negative number of US dollars, got {value!r}")

    def cost(self, requests: int, nbytes: int) -> float:
        """Dollars for ``requests`` GETs that moved ``nbytes`` bytes (a GB is 2**30 bytes, as AWS bills)."""
        return requests / 1000 * self.get_per_1000 + nbytes / 2**30 * self.transfer_per_gb


#: Azure Blob Storage, hot tier, LRS, East US, from https://azure.microsoft.com/en-us/pricing/details/storage/blobs/
#: and https://azure.microsoft.com/en-us/pricing/details/bandwidth/ (as published in 2025-2026):
#: read operations $0.004 per 10,000 ($0.0004 per 1,000), and data transfer between regions
#: within North America $0.02 per GB. In the account's own region transfer is free
#: (``transfer_per_gb=0``); cool and cold tiers cost more per read and add a retrieval fee per GB.
AZURE_PRICES = PriceTable(get_per_1000=0.0004, transfer_per_gb=0.02)

#: Google Cloud Storage, Standard class in a region, from https://cloud.google.com/storage/pricing
#: (as published in 2025-2026): Class B operations (``objects.get``, a read) $0.0004 per 1,000,
#: and data transfer between Google Cloud regions within a continent $0.02 per GB (Google's
#: "network" table; within the bucket's own region it is free, to the internet $0.08-0.12 per GB).
GCS_PRICES = PriceTable(get_per_1000=0.0004, transfer_per_gb=0.02)

#: The default prices of a dataset's reads, by the scheme of its store (``prices=None``; an alias
#: is its store's scheme: ``abfs://`` is ``az``); a store not listed (a local dataset: no
#: requests) is priced as S3.
STORE_PRICES: dict[str, PriceTable] = {"s3": PriceTable(), "gs": GCS_PRICES, "az": AZURE_PRICES}


def prices_for(uri: str) -> PriceTable:
    """The default :class:`PriceTable` of the dataset at ``uri``: its store's in :data:`STORE_PRICES`."""
    return STORE_PRICES.get(storage.scheme(uri), STORE_PRICES["s3"])


@dataclass(slots=True)
class DecodeTally:
    """Rows decoded and the decode threads' CPU seconds (each thread's own, ``time.thread_time``),
    added by the decode threads under a lock."""

    rows: int = 0
    decode_s: float = 0.0
    transform_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rows: int, decode_s: float, transform_s: float) -> None:
        with self._lock:
            self.rows += rows
            self.decode_s += decode_s
            self.transform_s += transform_s

    def snapshot(self) -> tuple[int, float, float]:
        with self._lock:
            return self.rows, self.decode_s, self.transform_s


@dataclass(frozen=True, slots=True)
class LoaderTotals:
    """A loader's counters at one moment, over its life."""

    store: RequestCounts = RequestCounts()
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    rows_decoded: int = 0
    decode_cpu_s: float = 0.0
    transform_cpu_s: float = 0.0
    wait_s: float = 0.0
    batches: int = 0

    def __sub__(self, other: LoaderTotals) -> LoaderTotals:
        return LoaderTotals(
            self.store - other.store,
            *(getattr(self, f) - getattr(other, f) for f in _NUMBERS),
        )

    def __add__(self, other: LoaderTotals) -> LoaderTotals:
        return LoaderTotals(
            self.store + other.store,
            *(getattr(self, f) + getattr(other, f) for f in _NUMBERS),
        )


@dataclass
class ReadCount:
    """Row groups an epoch's task iterator has read; of a remote dataset's, those read from the
    shard cache (``cache_hits``, ``cache_bytes``) and, with a cache, those read from the store
    instead (``cache_misses``)."""

    row_groups: int = 0
    cache_hits: int = 0
    cache_bytes: int = 0
    cache_misses: int = 0

    def totals(self) -> LoaderTotals:
        """The cache figures as loader totals."""
        return LoaderTotals(
            cache_hits=self.cache_hits, cache_misses=self.cache_misses, cache_bytes=self.cache_bytes
        )


class LoaderCounters:
    """One loader's counters (a mixture's: all its sources' together), each fed where its work
    happens: the store's requests by the sources' reads (``requests``), the cache's hits by the
    reader thread (``reads``, one :class:`ReadCount` a source, new each iteration), decoding by
    the decode threads (``tally``), the wait and the batches by the consumer. :meth:`totals` is
    the loader's life so far; :meth:`iteration` the current (or last) iteration's share."""

    def __init__(self, requests: Callable[[], RequestCounts], *, sources: int = 1) -> None:
        self.requests = requests
        self.tally = DecodeTally()
        self.wait_s = 0.0
        self.batches = 0
        self.reads = [ReadCount() for _ in range(sources)]
        self._before = LoaderTotals()  # the cache figures of the iterations before the current one
        self.began = LoaderTotals()

    def begin(self, reads: list[ReadCount]) -> None:
        """An iteration begins, its row groups counted in ``reads`` (an epoch a flow ran on into
        has read some already: they are the iteration's)."""
        self._before = self._before + _cache_figures(self.reads)
        self.reads = reads
        self.began = self.totals() - _cache_figures(reads)

    def totals(self) -> LoaderTotals:
        rows, decode_s, transform_s = self.tally.snapshot()
        return dataclasses.replace(
            self._before + _cache_figures(self.reads),
            store=self.requests(),
            rows_decoded=rows,
            decode_cpu_s=decode_s,
            transform_cpu_s=transform_s,
            wait_s=self.wait_s,
            batches=self.batches,
        )

    def iteration(self) -> LoaderTotals:
        return self.totals() - self.began


def _cache_figures(reads: list[ReadCount]) -> LoaderTotals:
    return sum((r.totals() for r in reads), LoaderTotals())


_NUMBERS = (
    "cache_hits",
    "cache_misses",
    "cache_bytes",
    "rows_decoded",
    "decode_cpu_s",
    "transform_cpu_s",
    "wait_s",
    "batches",
)


@dataclass(frozen=True, slots=True)
class LoaderStats:
    """One iteration of a loader (an epoch, or the rest of one after a resume), on one rank.

    ``requests``, ``retries``, ``bytes_read``: GETs to the store and the bytes they brought
    (the epoch's reads, the next epoch's first reads made during it, and what the cache
    fetched itself); ``errors``: reads that failed, by kind; ``read_s``: their wall time summed
    (``read_ms_mean``: per read). ``cache_*``: row groups read from the local shard cache and
    their bytes, and those read from the store while a cache was set. ``decode_cpu_s`` and
    ``transform_cpu_s``: CPU seconds of the decode threads; ``wait_s``: how long the training
    loop waited for batches; ``peak_bytes_held``: the most bytes of reads held at once (within
    ``memory_budget``); ``cost_usd``: requests and bytes priced by the loader's
    :class:`PriceTable`; ``shuffle``: how far the order was from the stored order
    (:mod:`loaders._internal.shuffle_quality`; ``None`` when not measured).
    """

    epoch: int
    batches: int
    rows_decoded: int
    requests: int
    retries: int
    errors: dict[str, int]
    bytes_read: int
    reads: int
    read_s: float
    cache_hits: int
    cache_misses: int
    cache_bytes: int
    decode_cpu_s: float
    transform_cpu_s: float
    wait_s: float
    peak_bytes_held: int
    cost_usd: float
    shuffle: Any = None

    @property
    def read_ms_mean(self) -> float:
        return 1000 * self.read_s / self.reads if self.reads else 0.0

    @classmethod
    def of(
        cls,
        totals: LoaderTotals,
        *,
        epoch: int,
        peak_bytes_held: int,
        prices: PriceTable,
        shuffle: Any = None,
    ) -> LoaderStats:
        """The stats of an iteration whose counters moved by ``totals``."""
        s = totals.store
        return cls(
            epoch=epoch,
            batches=totals.batches,
            rows_decoded=totals.rows_decoded,
            requests=s.requests,
            retries=s.retries,
            errors=dict(s.errors),
            bytes_read=s.bytes,
            reads=s.reads,
            read_s=s.seconds,
            cache_hits=totals.cache_hits,
            cache_misses=totals.cache_misses,
            cache_bytes=totals.cache_bytes,
            decode_cpu_s=totals.decode_cpu_s,
            transform_cpu_s=totals.transform_cpu_s,
            wait_s=totals.wait_s,
            peak_bytes_held=peak_bytes_held,
            cost_usd=prices.cost(s.requests, s.bytes),
            shuffle=shuffle,
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            k: getattr(self, k)
            for k in (
                "epoch",
                "batches",
                "rows_decoded",
                "requests",
                "retries",
                "errors",
                "bytes_read",
                "reads",
                "read_s",
                "cache_hits",
                "cache_misses",
                "cache_bytes",
                "decode_cpu_s",
                "transform_cpu_s",
                "wait_s",
                "peak_bytes_held",
                "cost_usd",
            )
        }
        out["read_ms_mean"] = self.read_ms_mean
        shuffle = None if self.shuffle is None else self.shuffle.to_json()
        if shuffle is not None:  # strict JSON (metrics.json): a figure that cannot be defined is null
            shuffle = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in shuffle.items()}
        out["shuffle"] = shuffle
        return out


def usd(dollars: float) -> str:
    """``dollars`` with three significant digits (``$0.000163``, ``$1.63e-05``, ``$12.3``): never
    ``$0.0000`` for a cost that is not zero."""
    return f"${dollars:.3g}"


@dataclass(slots=True)
class CostBudget:
    """An epoch's cost budget on one rank (``cost_budget`` dollars, ``None``: none): every
    :data:`BUDGET_EVERY` batches and at the epoch's last batch, the epoch's projected cost is
    compared with it; past it, one WARNING an epoch or, with ``on_budget="stop"``, a
    :class:`LoaderError`.

    The projection is the cost per byte of the reads made so far times the bytes of every remote
    row group the epoch reads (:meth:`begin`), and never less than the cost so far: the reads
    made ahead of the batches consumed (the fetcher's read-ahead, a whole first window) are
    counted with the bytes they brought, not scaled by the batches consumed."""

    budget: float | None
    on_budget: str
    prices: PriceTable
    rank: int
    dataset: str
    warned: bool = False
    planned_bytes: int = 0

    @property
    def active(self) -> bool:
        return self.budget is not None

    def begin(self, planned_bytes: int) -> None:
        """An epoch (or the rest of one) begins that reads ``planned_bytes`` from the store."""
        self.warned, self.planned_bytes = False, planned_bytes

    def check(self, so_far: Callable[[], LoaderTotals], *, epoch: int, consumed: int, batches: int) -> None:
        """After ``consumed`` of the epoch's ``batches``, whose counters so far ``so_far()`` gives
        (called only when the budget is checked)."""
        if self.budget is None or self.warned or (consumed % BUDGET_EVERY and consumed < batches):
            return
        done = so_far()
        cost = self.prices.cost(done.store.requests, done.store.bytes)
        projected = cost
        if done.store.bytes:
            projected = max(cost, cost * self.planned_bytes / done.store.bytes)
        if projected <= self.budget:
            return
        self.warned = True
        message = (
            f"epoch {epoch} on rank {self.rank} would cost {usd(projected)} in reads of {self.dataset}, over "
            f"cost_budget {usd(self.budget)} ({usd(cost)} after {consumed} of {batches} batches: "
            f"{done.store.requests} requests and {done.store.bytes} bytes, the next epoch's first reads "
            f"included; the epoch reads {self.planned_bytes} bytes of row groups); "
            "raise cost_budget, or read from a cache (cache_dir) or a store in the same region"
        )
        if self.on_budget == "stop":
            raise LoaderError(f"{message}; stopping (on_budget='stop')")
        log.warning("%s", message)
