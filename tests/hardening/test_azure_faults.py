"""Azure faults: a proxy in front of Azurite answers a seeded share of requests with 500, 503
ServerBusy, a dropped connection or a body cut off halfway. The loader reads the same batches as
through a clean link, counting every request the store was sent, retries included; the jobs'
reads of the lake go through the faults and build the same dataset, and so do adlfs's own
requests (listings, the Parquet parts' reads and writes). Permanent errors (403, or faults on
every attempt) fail fast, naming the URI."""

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
        # The lake's reads (the manifest's header reads, the shard job's image reads) here;
        # adlfs's own requests below.
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


def test_a_download_cut_off_halfway_is_read_again_and_counted(az_container: str, az_fault_proxy: FaultProxy):
    """A ranged read's body comes in one piece (``_read_body_whole``); cut off halfway, the SDK's
    downloader reads it again: the bytes are whole and both requests are counted."""
    data = bytes(range(256)) * (12 << 10)  # 3 MiB
    uri = f"{az_container}/cut/blob.bin"
    storage.write_bytes_atomic(uri, data)
    stats = storage.RequestStats()
    az_fault_proxy.reset(mode="faults", rate=1.0, streak=1, kinds=("cut",), match="/cut/")
    try:
        got = storage.store_for(uri).read(uri, 1000, 1000 + (2 << 20), stats=stats)
        injected = dict(az_fault_proxy.injected)
    finally:
        az_fault_proxy.reset(mode="pass")
    assert injected == {"cut": 1}, injected
    assert got == data[1000 : 1000 + (2 << 20)]
    counts = stats.counts()
    assert (counts.requests, counts.retries, counts.bytes) == (2, 1, 2 << 20), counts


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


#: adlfs's own requests: the listings (a GET of the container, ``comp=list``) and the Parquet
#: files' reads and writes (the manifest's parts and tables, the shards).
_ADLFS = {"listings": "comp=list", "parquet": ".parquet"}


@pytest.mark.parametrize("which", sorted(_ADLFS))
def test_the_jobs_complete_under_faults_on_adlfs_requests(
    which: str, az_container: str, az_fault_proxy: FaultProxy, local_engine, tmp_path: Path
):
    """adlfs's client retries as the blocking one does (5 attempts, from 0.1 s): a 500, a 503, a
    dropped connection or a cut body on a listing or a Parquet file's request costs a retry, and
    the jobs build the dataset they build over a clean link."""
    proxy = az_fault_proxy
    lake = _upload_lake(az_container, tmp_path, {"a": 14, "b": 12, "c": 10})
    clean = f"{az_container}/clean"
    _build(local_engine, lake, clean)
    try:
        # At most two faults in a row on one request: five attempts always get through (a
        # request failing five times is the test below).
        proxy.reset(mode="faults", rate=0.3, seed=5, match=_ADLFS[which], streak=2)
        start = time.monotonic()
        _build(local_engine, lake, f"{az_container}/faulty")
        took = time.monotonic() - start
        faulted = [r for r in proxy.log if r.fate != "forwarded"]
    finally:
        proxy.reset(mode="pass")
    assert faulted, f"the jobs made {proxy.requests} requests and saw no fault on their {which}"
    assert all(_ADLFS[which] in r.path for r in faulted)
    assert took < 300, took  # retried within seconds each, not the SDK's default 15 s and up
    check_dataset(f"{az_container}/faulty")
    assert dataset_digest(f"{az_container}/faulty") == dataset_digest(clean)


@pytest.mark.parametrize("which", sorted(_ADLFS))
def test_faults_on_every_attempt_of_an_adlfs_request_fail_naming_the_uri(
    which: str, az_container: str, az_fault_proxy: FaultProxy, local_engine, tmp_path: Path
):
    lake = _upload_lake(az_container, tmp_path, {"a": 10, "b": 10})
    out = f"{az_container}/ds"
    try:
        az_fault_proxy.reset(mode="faults", rate=1.0, seed=3, match=_ADLFS[which])
        start = time.monotonic()
        with pytest.raises((PlatformError, OSError)) as err:
            _build(local_engine, lake, out)
        took = time.monotonic() - start
    finally:
        az_fault_proxy.reset(mode="pass")
    assert took < FAST_S, (took, err.value)
    assert f"{az_container}/ds/" in str(err.value), err.value  # the URI of what could not be done
