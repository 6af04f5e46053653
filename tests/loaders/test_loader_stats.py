"""``loader.epoch_stats()``: what an epoch cost, checked against the store's own log (the
benchmarks' nginx + latency shim counts every request it served and nginx every body byte): GET
requests and bytes, cache hits, an estimate in dollars and a budget; decode CPU and the wait;
shuffle quality as the epoch ran."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from loader_builders import write_dataset

from lakeshard import storage
from lakeshard.errors import ConfigError, LoaderError
from lakeshard.storage import RequestCounts, RequestStats
from loaders import ShardLoader
from loaders.stats import AZURE_PRICES, GCS_PRICES, STORE_PRICES, PriceTable, prices_for
from tests.helpers.store import RemoteStore, require_nginx, settled_counts, wait_reads_ended

OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 5, "shuffle_window": 20, "num_threads": 2}


def test_prices_make_the_estimate_and_bad_ones_are_refused():
    prices = PriceTable(get_per_1000=0.0004, transfer_per_gb=0.02)
    assert prices.cost(2500, 3 * 2**30) == pytest.approx(2.5 * 0.0004 + 3 * 0.02)
    assert PriceTable(transfer_per_gb=0).cost(1000, 10**12) == pytest.approx(0.0004)
    with pytest.raises(
        ConfigError, match="transfer_per_gb must be a non-negative number of US dollars, got -1"
    ):
        PriceTable(transfer_per_gb=-1)
    for bad, message in [
        (dict(cost_budget=0), "cost_budget must be a positive number"),
        (dict(on_budget="panic"), "on_budget must be one of"),
        (dict(prices={"get": 1}), "prices must be a loaders.stats.PriceTable"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ShardLoader("/nowhere", **bad)


def test_request_counts_add_and_subtract_by_kind():
    stats = RequestStats()
    stats.add(requests=1, retries=0, nbytes=100, seconds=0.5)
    before = stats.counts()
    stats.add(requests=3, retries=2, nbytes=50, seconds=0.25)
    stats.add(requests=1, retries=0, nbytes=0, seconds=0.1, error="PreconditionFailed")
    moved = stats.counts() - before
    assert moved == RequestCounts(4, 2, 2, 50, pytest.approx(0.35), (("PreconditionFailed", 1),))
    assert (moved + before).requests == 5


def test_a_local_epoch_counts_its_rows_decode_cpu_wait_and_shuffle(dataset: Path):
    with ShardLoader(str(dataset), **OPTIONS) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            batches = sum(1 for _ in loader)
            stats = loader.epoch_stats()
            assert (stats.epoch, stats.batches) == (epoch, batches)
            # and, from the second epoch on, the next one's first batches, decoded early
            assert stats.rows_decoded == 40 if epoch == 0 else 40 <= stats.rows_decoded <= 40 + 4 * 8
            assert (stats.requests, stats.bytes_read, stats.cost_usd) == (0, 0, 0.0)
            assert stats.decode_cpu_s > 0 and stats.wait_s > 0
            assert stats.shuffle.rows == 40 and stats.shuffle.rank_correlation < 0.9
    with ShardLoader(str(dataset), **{**OPTIONS, "shuffle": False}) as loader:
        list(loader)
        assert loader.epoch_stats().shuffle.rank_correlation == 1.0


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteStore]:
    """The store serving a 2-shard dataset ``ds`` (120 noisy train rows, row groups of 5)."""
    require_nginx()
    write_dataset(
        tmp_path / "lake" / "ds",
        rows={"train": 120, "validation": 8, "test": 8},
        row_group_rows=5,
        noise=True,
    )
    with RemoteStore(tmp_path / "lake", latency_ms=1, bandwidth=200_000_000) as running:
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        for key, value in running.environ().items():
            monkeypatch.setenv(key, value)
        storage.clear_s3_clients()
        yield running
        storage.clear_s3_clients()


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_the_loader_counts_the_requests_and_bytes_the_store_served(
    store: RemoteStore, tmp_path: Path, cached
):
    opts = {**OPTIONS, "cache_dir": str(tmp_path / "cache")} if cached else OPTIONS
    with ShardLoader(store.uri("ds"), **opts) as loader:
        served = store.traffic()  # the footers, read when the loader was made, are before this
        first = loader.totals()
        per_epoch = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            list(loader)
            per_epoch.append(loader.epoch_stats())
        counted, traffic = settled_counts(loader, store, first.store, served)
    assert counted.requests == traffic.gets > 0
    assert counted.bytes == traffic.body_bytes
    assert counted.retries == 0 and counted.errors == ()
    assert per_epoch[0].requests > 0 and per_epoch[0].read_ms_mean > 0
    assert per_epoch[0].cost_usd == pytest.approx(
        PriceTable().cost(per_epoch[0].requests, per_epoch[0].bytes_read)
    )
    row_groups = 120 // 5
    if cached:  # epoch 0 filled the cache as it read; later epochs read nothing from the store
        assert per_epoch[0].cache_misses == row_groups and per_epoch[0].cache_hits == 0
        for stats in per_epoch[1:]:
            assert (stats.requests, stats.bytes_read, stats.cache_misses) == (0, 0, 0)
            assert stats.cache_hits == row_groups and stats.cache_bytes > 0
    else:
        assert all(s.requests > 0 and s.cache_hits == 0 for s in per_epoch)
        assert sum(s.requests for s in per_epoch) <= counted.requests  # the last read-ahead came after


@pytest.mark.slow
def test_a_cost_budget_warns_once_or_stops_the_epoch(store: RemoteStore, caplog: pytest.LogCaptureFixture):
    dear = PriceTable(get_per_1000=1000.0)  # a dollar a request
    with ShardLoader(store.uri("ds"), prices=dear, cost_budget=5.0, **OPTIONS) as loader:
        with caplog.at_level(logging.WARNING, logger="loaders.shard_loader"):
            list(loader)
        warned = [r.getMessage() for r in caplog.records if "over cost_budget" in r.getMessage()]
        assert len(warned) == 1
        assert "epoch 0 on rank 0 would cost $" in warned[0] and f"reads of {store.uri('ds')}" in warned[0]
    with ShardLoader(store.uri("ds"), prices=dear, cost_budget=5.0, on_budget="stop", **OPTIONS) as loader:
        with pytest.raises(LoaderError, match=r"over cost_budget \$5 .*stopping \(on_budget='stop'\)"):
            list(loader)


def _epoch_costs(uri: str, epochs: int, **opts) -> list[float]:
    """Each epoch's cost as ``epoch_stats()`` reports it once every read it made is in (its reads
    ahead of the next epoch included), without a budget."""
    costs = []
    with ShardLoader(uri, **opts) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            list(loader)
            wait_reads_ended(loader)
            costs.append(loader.epoch_stats().cost_usd)
    return costs


@pytest.mark.slow
@pytest.mark.parametrize("read_concurrency", [2, 8])
def test_a_budget_above_each_epochs_true_cost_never_stops_or_warns(
    store: RemoteStore, caplog: pytest.LogCaptureFixture, read_concurrency: int
):
    """F11: the projection prices the bytes read so far (the read-ahead and the next epoch's first
    reads included), not the batches consumed: 1.2x the dearest epoch's true cost is enough."""
    opts = {**OPTIONS, "read_concurrency": read_concurrency}
    costs = _epoch_costs(store.uri("ds"), 3, **opts)
    assert min(costs) > 0
    with ShardLoader(store.uri("ds"), cost_budget=1.2 * max(costs), on_budget="stop", **opts) as loader:
        with caplog.at_level(logging.WARNING, logger="loaders.stats"):
            for epoch in range(3):
                loader.set_epoch(epoch)
                assert sum(1 for _ in loader) == len(loader) == 15
    assert not [r for r in caplog.records if "cost_budget" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [8, 40])
def test_a_budget_well_under_the_cost_stops_an_epoch_short_ones_too(store: RemoteStore, batch_size: int):
    """F11: a budget at a third of the epoch's cost stops it, an epoch of 3 batches (under the 8
    between checks) too: it is checked at its last batch; the message gives the cost in significant
    digits (F20), not $0.0000."""
    opts = {**OPTIONS, "batch_size": batch_size}
    cost = _epoch_costs(store.uri("ds"), 1, **opts)[0]
    budget = cost / 3
    with ShardLoader(store.uri("ds"), cost_budget=budget, on_budget="stop", **opts) as loader:
        assert len(loader) == 120 // batch_size
        with pytest.raises(LoaderError, match=r"over cost_budget \$[1-9][0-9.]*e-0[5-7] ") as raised:
            list(loader)
    assert "$0.0000" not in str(raised.value)


def test_the_shuffle_figures_count_the_batches_handed_to_decoding_and_grow_with_the_epoch(dataset: Path):
    """F28, F31 (documented in docs/loader.md): during an epoch (or after a break) the shuffle
    figures count the batches read ahead of the loop too, at most prefetch + num_threads + 2 more;
    at its end, the rows yielded; the tally keeps 16 bytes a row of the epoch."""
    opts = {**OPTIONS, "prefetch": 1, "num_threads": 1}
    with ShardLoader(str(dataset), **opts) as loader:
        images, _ = next(iter(loader))  # the iteration ends there: a break
        rows = loader.epoch_stats().shuffle.rows
        assert len(images) <= rows <= (1 + 1 + 2 + 1) * len(images)
        yielded = sum(len(images) for images, _ in loader)
        assert loader.epoch_stats().shuffle.rows == yielded == 40
        held = loader.run.parts.shuffle.nbytes
        assert held == 16 * yielded


@pytest.mark.slow
def test_the_reads_that_open_a_loader_are_in_no_figure(store: RemoteStore):
    """F29 (documented in docs/loader.md): dataset.json and the footers, read when the loader is
    made, are GETs the store served that no counter of the loader has."""
    before = store.traffic()
    with ShardLoader(store.uri("ds"), **OPTIONS) as loader:
        opened = store.traffic() - before
        assert opened.gets >= 1 + 2  # dataset.json, and each of the 2 shards' footers
        assert loader.totals().store.requests == 0 and loader.epoch_stats().requests == 0


def test_the_default_prices_are_the_dataset_s_store_s():
    assert prices_for("gs://b/ds") is GCS_PRICES and prices_for("gcs://b/ds") is GCS_PRICES
    assert prices_for("s3://b/ds") == PriceTable() == prices_for("/a/local/ds")
    assert STORE_PRICES["s3"] == PriceTable() and STORE_PRICES["gs"] is GCS_PRICES
    for uri in ("az://c/ds", "abfs://c/ds", "abfss://c/ds"):  # an alias is its store's scheme
        assert prices_for(uri) is AZURE_PRICES
    assert STORE_PRICES["az"] is AZURE_PRICES
