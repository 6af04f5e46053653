"""Azure faults: a proxy in front of Azurite answers a seeded share of requests with 500, 503
ServerBusy, a dropped connection or a body cut off halfway. The loader reads the same batches as
through a clean link, counting every request the store was sent, retries included; the jobs'
reads of the lake go through the faults and build the same dataset. Permanent errors (403) fail
fast, naming the URI."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lakeshard import storage
from lakeshard.errors import PlatformError
from loaders import ShardLoader
from tests.hardening.faultproxy import FaultProxy
from tests.hardening.helpers import dataset_digest
from tests.hardening.test_s3_faults import FAST_S, _build
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake
from tests.helpers.store import wait_reads_ended

pytestmark = [pytest.mark.azure, pytest.mark.slow]


def _upload_lake(container: str, tmp_path: Path, counts: dict[str, int]) -> str:
    local = tmp_path / "lake"
    write_lake(local, counts)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(f"{container}/raw/{p.relative_to(local).as_posix()}", p.read_bytes())
    return f"{container}/raw"


def _loader(root: str) -> ShardLoader:
    return ShardLoader(root, batch_size=8, shuffle=True, seed=3, num_threads=2, prefetch=2)


def _gets(proxy: FaultProxy, since: int) -> int:
    """Requests for a blob's bytes the proxy got since its ``since``-th request, whatever became
    of them (a listing is a GET of the container, with ``comp=list``)."""
    return sum(r.method == "GET" and "comp=list" not in r.path for r in proxy.log[since:])


def test_the_loader_and_the_jobs_complete_under_transient_azure_faults(
    az_container: str, az_fault_proxy: FaultProxy, local_engine, tmp_path: Path
):
    proxy = az_fault_proxy
    lake = _upload_lake(az_container, tmp_path, {"a": 14, "b": 12, "c": 10})
    clean = f"{az_container}/clean"
    _build(local_engine, lake, clean)
    with _loader(clean) as loader:
        want = list(loader)
    try:
        proxy.reset(mode="faults", rate=0.2, seed=13)
        with _loader(clean) as loader:
            since, first = len(proxy.log), loader.totals().store
            got = list(loader)
            wait_reads_ended(loader)
            counted = loader.totals().store - first
            sent = _gets(proxy, since)
        assert {"500", "503", "cut"} & set(proxy.injected), proxy.injected
        assert counted.requests == sent and counted.retries > 0, (counted, proxy.injected)
        # The lake's reads (the manifest's header reads, the shard job's image reads) only:
        # adlfs's listings and Parquet writes back off as the Azure SDK's default does (15 s).
        proxy.reset(mode="faults", rate=0.15, seed=12, match="/raw/")
        _build(local_engine, lake, f"{az_container}/faulty")
        assert proxy.injected, f"the jobs made {proxy.requests} requests and saw no fault"
    finally:
        proxy.reset(mode="pass")
    assert len(got) == len(want)
    for (gi, gl), (wi, wl) in zip(got, want):
        assert torch.equal(gi, wi) and torch.equal(gl, wl)
    check_dataset(f"{az_container}/faulty")
    assert dataset_digest(f"{az_container}/faulty") == dataset_digest(clean)


def test_a_permanent_azure_error_fails_fast_naming_the_uri(
    az_container: str, az_fault_proxy: FaultProxy, local_engine, tmp_path: Path
):
    lake = _upload_lake(az_container, tmp_path, {"a": 10, "b": 10})
    out = f"{az_container}/ds"
    _build(local_engine, lake, out)
    try:
        az_fault_proxy.reset(mode="deny")
        for what, fn, uri in [
            ("loader", lambda: ShardLoader(out), out),
            ("read", lambda: storage.read_bytes(f"{out}/dataset.json"), f"{out}/dataset.json"),
            ("get", lambda: storage.store_for(out).get(f"{out}/dataset.json"), f"{out}/dataset.json"),
        ]:
            start = time.monotonic()
            with pytest.raises((PlatformError, PermissionError)) as err:
                fn()
            assert time.monotonic() - start < FAST_S, (what, err.value)
            assert uri in str(err.value) and "AuthorizationFailure" in str(err.value), (what, err.value)
    finally:
        az_fault_proxy.reset(mode="pass")
