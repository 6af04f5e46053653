"""GCS faults: the fault proxy in front of the GCS emulator answers a seeded share of requests
with 500, 503 (GCS's JSON error bodies), a dropped connection or a body cut off halfway. The
store's reads ride them out, counting each attempt as a request, as many as the store saw; the
loader's batches over them are a clean read's; the manifest job completes; a permanent 403
fails at once, naming the URI."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs import manifest as manifest_job
from jobs.manifest_steps.config import ManifestConfig
from lakeshard import storage
from lakeshard.format.manifest_table import read_channel
from lakeshard.storage import RequestStats
from loaders import ShardLoader
from tests.hardening.faultproxy import FaultProxy
from tests.helpers.lake import write_lake

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loaders"))
from loader_builders import ids_of, write_dataset

pytestmark = pytest.mark.gcs

OPTIONS = {"batch_size": 8, "shuffle": True, "seed": 5, "shuffle_window": 40, "num_threads": 2}


@pytest.fixture()
def gcs_proxy(gcs_emulator: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """The fault proxy in front of the emulator, the store's clients pointed at it."""
    proxy = FaultProxy(gcs_emulator.endpoint, dialect="gcs").start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


def _put_folder(local: Path, root: str) -> str:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(f"{root}/{p.relative_to(local).as_posix()}", p.read_bytes())
    return root


def _media_gets(proxy: FaultProxy) -> int:
    return sum(1 for r in proxy.log if r.method == "GET" and "alt=media" in r.path)


def test_reads_ride_out_transient_faults_and_count_every_attempt(gcs_bucket: str, gcs_proxy: FaultProxy):
    data = bytes(range(256)) * 64
    uri = f"{gcs_bucket}/blob"
    storage.write_bytes_atomic(uri, data)
    store, stats = storage.store_for(uri), RequestStats()
    gcs_proxy.reset(mode="faults", rate=0.3, seed=4)
    for start in range(0, len(data), 1000):
        assert store.read(uri, start, start + 1000, stats=stats) == data[start : start + 1000]
    assert store.read_tail(uri, 100).data == data[-100:]
    counts = stats.counts()
    assert counts.retries > 0 and set(gcs_proxy.injected) >= {"500", "503", "cut"}
    assert (
        counts.requests == _media_gets(gcs_proxy) - 1
    )  # every attempt the store saw (the tail's not counted)
    assert counts.requests == counts.reads + counts.retries and counts.errors == ()


@pytest.mark.slow
def test_the_loader_s_batches_over_faults_are_a_clean_read_s(
    gcs_bucket: str, gcs_proxy: FaultProxy, tmp_path: Path
):
    local = tmp_path / "ds"
    write_dataset(
        local, rows={"train": 80, "validation": 8, "test": 8}, num_shards=2, row_group_rows=5, noise=True
    )
    remote = _put_folder(local, f"{gcs_bucket}/ds")

    def epochs(loader: ShardLoader) -> list[list[int]]:
        out = []
        for e in (0, 1):
            loader.set_epoch(e)
            out.append([i for images, _ in loader for i in ids_of(images)])
        return out

    with ShardLoader(str(local), **OPTIONS) as plain:
        expected = epochs(plain)
    gcs_proxy.reset(mode="faults", rate=0.15, seed=2)
    with ShardLoader(remote, read_concurrency=8, cache_dir=str(tmp_path / "cache"), **OPTIONS) as loader:
        assert epochs(loader) == expected
        assert loader.totals().store.retries > 0
    assert gcs_proxy.injected


@pytest.mark.slow
def test_the_manifest_job_completes_under_faults(
    gcs_bucket: str, gcs_proxy: FaultProxy, tmp_path: Path, local_engine: Any
):
    local = tmp_path / "lake"
    write_lake(local, {"cat": 12, "dog": 12})
    lake = _put_folder(local, f"{gcs_bucket}/raw")
    gcs_proxy.reset(mode="faults", rate=0.1, seed=3)
    out = f"{gcs_bucket}/ds"
    manifest_job.run(ManifestConfig(input=lake, output=out, seed=7, split_method="stratified"), local_engine)
    gcs_proxy.reset(mode="pass")
    assert len(read_channel(out, "all")) == 24 and gcs_proxy.requests > 0


def test_a_permanent_error_fails_at_once_naming_the_uri(gcs_bucket: str, gcs_proxy: FaultProxy):
    uri = f"{gcs_bucket}/blob"
    storage.write_bytes_atomic(uri, b"x" * 100)
    gcs_proxy.reset(mode="deny")
    stats, began = RequestStats(), time.monotonic()
    with pytest.raises(PermissionError, match=f"{uri}: 403"):
        storage.store_for(uri).read(uri, 0, 10, stats=stats)
    assert time.monotonic() - began < 30 and stats.counts().requests == 1 == _media_gets(gcs_proxy)
