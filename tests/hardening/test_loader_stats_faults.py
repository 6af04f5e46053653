"""The loader's request counts under faults: a proxy in front of moto fails a seeded 20% of the
requests (500, 503 SlowDown, a dropped connection, a body cut off); every retry the loader made
is a request the proxy saw, and ``epoch_stats()`` counts them all."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lakeshard import storage
from loaders import ShardLoader
from tests.helpers.store import upload, wait_reads_ended
from tests.loaders.loader_builders import write_dataset

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_every_retry_is_counted_as_the_proxy_saw_it(s3_bucket, fault_proxy, s3_via, tmp_path: Path):
    local = tmp_path / "ds"
    write_dataset(local, rows={"train": 120, "validation": 8, "test": 8}, row_group_rows=5, noise=True)
    remote = upload(local, s3_bucket)
    fault_proxy.reset(mode="pass")
    s3_via(fault_proxy.endpoint)
    storage.clear_s3_clients()
    try:
        with ShardLoader(
            remote, batch_size=8, shuffle=True, seed=2, read_concurrency=2, num_threads=2
        ) as loader:
            fault_proxy.reset(mode="faults", rate=0.2, seed=5)  # after the footers, read when it was made
            before = loader.totals().store
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                list(loader)
                epochs.append(loader.epoch_stats())
            wait_reads_ended(loader)
            counted = loader.totals().store - before
            seen = [r for r in fault_proxy.log if r.method == "GET"]
    finally:
        fault_proxy.reset(mode="pass")
        storage.clear_s3_clients()
    fates = Counter(str(r.fate) for r in seen)
    assert fates.keys() - {"forwarded"}, f"no fault was injected in {len(seen)} GETs"
    assert counted.requests == len(seen)
    assert counted.retries == len(seen) - fates["forwarded"]  # each fault cost one request more
    assert counted.errors == ()
    assert sum(s.retries for s in epochs) <= counted.retries and epochs[0].retries > 0
