"""S3 faults: a proxy in front of moto answers a seeded 10% of requests with 500, 503 SlowDown,
a dropped connection or a body cut off halfway. Both jobs (each engine) and the loader complete, and what they produce
equals a clean run's. Permanent errors (403, a missing bucket) fail fast, naming the URI."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
import torch

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import PlatformError, StorageError
from lakeshard.format import manifest_marker_uri
from loaders import ShardLoader
from tests.hardening.helpers import dataset_digest
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.s3, pytest.mark.slow]

MANIFEST = {"split_method": "stratified", "seed": 7}
SHARD = {"num_shards": 2, "image_size": 24, "image_format": "png", "remainder": "pad"}
#: A permanent error must fail well inside this (botocore's standard retries of a transient
#: error take a few seconds at most; minutes would mean a permanent error is being retried).
FAST_S = 30


def _upload_lake(bucket: str, tmp_path: Path, counts: dict[str, int]) -> str:
    local = tmp_path / "lake"
    write_lake(local, counts)
    client = boto3.client("s3")
    name = bucket[len("s3://") :]
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=name, Key=f"raw/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    return f"{bucket}/raw"


def _a_key(bucket: str, prefix: str) -> str:
    keys = [
        o["Key"]
        for o in boto3.client("s3").list_objects_v2(Bucket=bucket[len("s3://") :], Prefix=prefix)["Contents"]
    ]
    return keys[len(keys) // 2]


def _overwrite_runs(engine, lake: str, out: str) -> list[tuple[str, Callable[[], object]]]:
    """Both jobs, rebuilding ``out`` from ``lake`` with ``--overwrite``, by name."""
    return [
        (
            "manifest",
            lambda: manifest_job.run(
                ManifestConfig(input=lake, output=out, overwrite=True, **MANIFEST), engine
            ),
        ),
        ("shard", lambda: shard_job.run(ShardConfig(dataset=out, overwrite=True, **SHARD), engine)),
    ]


def _build(engine, lake: str, out: str) -> None:
    manifest_job.run(ManifestConfig(input=lake, output=out, **MANIFEST), engine)
    shard_job.run(ShardConfig(dataset=out, **SHARD), engine)


def _batches(root: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with ShardLoader(
        root,
        channel="train",
        rank=0,
        world_size=1,
        batch_size=8,
        shuffle=True,
        seed=3,
        num_threads=2,
        prefetch=2,
    ) as loader:
        return list(loader)


def _faulty_run(proxy, s3_via, seed: int) -> None:
    proxy.reset(mode="faults", rate=0.1, seed=seed)
    s3_via(proxy.endpoint)


def _assert_faults_were_injected(proxy) -> None:
    assert proxy.requests > 50, proxy.requests
    assert {"500", "503", "drop", "cut"} <= set(proxy.injected), proxy.injected


@pytest.mark.spark
def test_spark_jobs_complete_under_transient_s3_faults(spark, s3_bucket, fault_proxy, s3_via, tmp_path):
    from jobs.common.engines.spark_engine import SparkEngine

    lake = _upload_lake(s3_bucket, tmp_path, {"a": 14, "b": 12, "c": 10})
    clean = f"{s3_bucket}/clean"
    _build(SparkEngine(spark=spark), lake, clean)
    saved = dict(spark.sparkContext.environment)
    try:
        _faulty_run(fault_proxy, s3_via, seed=11)
        _build(SparkEngine(spark=spark), lake, f"{s3_bucket}/faulty")  # its workers get the proxy's endpoint
        _assert_faults_were_injected(fault_proxy)
    finally:
        fault_proxy.reset(mode="pass")
        spark.sparkContext.environment.clear()
        spark.sparkContext.environment.update(saved)
    check_dataset(f"{s3_bucket}/faulty")
    assert dataset_digest(f"{s3_bucket}/faulty") == dataset_digest(clean)


@pytest.mark.dask
def test_dask_jobs_and_loader_complete_under_transient_s3_faults(
    s3_bucket, fault_proxy, s3_via, dask_engine_cli, tmp_path
):
    lake = _upload_lake(s3_bucket, tmp_path, {"a": 14, "b": 12, "c": 10})
    clean = f"{s3_bucket}/clean"
    _build(dask_engine_cli(), lake, clean)
    want = _batches(clean)
    try:
        _faulty_run(fault_proxy, s3_via, seed=12)
        _build(dask_engine_cli(), lake, f"{s3_bucket}/faulty")
        _assert_faults_were_injected(fault_proxy)
        fault_proxy.reset(mode="faults", rate=0.2, seed=13)
        got = _batches(clean)  # the loader, through the faults
        assert fault_proxy.injected, f"the loader made {fault_proxy.requests} requests and saw no fault"
    finally:
        fault_proxy.reset(mode="pass")
    assert len(got) == len(want)
    for (gi, gl), (wi, wl) in zip(got, want):
        assert torch.equal(gi, wi) and torch.equal(gl, wl)
    check_dataset(f"{s3_bucket}/faulty")
    assert dataset_digest(f"{s3_bucket}/faulty") == dataset_digest(clean)


@pytest.mark.dask
def test_permanent_s3_errors_fail_fast_naming_the_uri(
    s3_bucket, fault_proxy, s3_via, dask_engine_cli, tmp_path
):
    lake = _upload_lake(s3_bucket, tmp_path, {"a": 10, "b": 10})
    out = f"{s3_bucket}/ds"
    _build(dask_engine_cli(), lake, out)
    engine = dask_engine_cli()
    missing = "s3://hardening-no-such-bucket"

    def fails_fast(fn, uri: str) -> str:
        start = time.monotonic()
        with pytest.raises((PlatformError, PermissionError, FileNotFoundError)) as err:
            fn()
        elapsed = time.monotonic() - start
        assert elapsed < FAST_S, f"took {elapsed:.1f} s to fail: {err.value}"
        assert uri in str(err.value), f"{type(err.value).__name__}: {err.value} does not name {uri}"
        return str(err.value)

    # A missing bucket: as input, as output, as a dataset to load.
    fails_fast(
        lambda: manifest_job.run(ManifestConfig(input=f"{missing}/raw", output=f"{s3_bucket}/m2"), engine),
        f"{missing}/raw",
    )
    fails_fast(
        lambda: manifest_job.run(ManifestConfig(input=lake, output=f"{missing}/ds", **MANIFEST), engine),
        f"{missing}/ds",
    )
    fails_fast(lambda: ShardLoader(f"{missing}/ds"), f"{missing}/ds")

    try:
        s3_via(fault_proxy.endpoint)
        engine = dask_engine_cli()
        fault_proxy.reset(mode="deny", match="raw")  # the lake only
        message = fails_fast(
            lambda: manifest_job.run(
                ManifestConfig(input=lake, output=f"{s3_bucket}/m3", **MANIFEST), engine
            ),
            lake,
        )
        assert "forbidden" in message.lower(), message
        fault_proxy.reset(mode="deny")  # everything
        for what, fn, uri in [
            (
                "manifest",
                lambda: manifest_job.run(
                    ManifestConfig(input=lake, output=f"{s3_bucket}/m3", **MANIFEST), engine
                ),
                f"{s3_bucket}/m3",
            ),
            ("shard", lambda: shard_job.run(ShardConfig(dataset=out, overwrite=True, **SHARD), engine), out),
            ("loader", lambda: ShardLoader(out), out),
            ("read", lambda: storage.read_bytes(f"{out}/dataset.json"), f"{out}/dataset.json"),
        ]:
            message = fails_fast(fn, uri)
            assert any(w in message.lower() for w in ("403", "denied", "forbidden")), (what, message)

        # One object the jobs may list but not read: both jobs fail, naming it, instead of
        # rejecting it (a dataset must not lose rows to a permission or an outage), and their
        # --overwrite runs leave the dataset they would have replaced readable.
        fault_proxy.reset(mode="pass")
        denied = _a_key(s3_bucket, "raw/b/")
        fault_proxy.reset(mode="deny", match=denied)
        for what, fn in _overwrite_runs(engine, lake, out):
            message = fails_fast(fn, f"{s3_bucket}/{denied}")
            assert message.startswith(f"cannot read {s3_bucket}/{denied}: PermissionError"), (what, message)
            assert fault_proxy.injected["403"] >= 1, (what, fault_proxy.injected)
    finally:
        fault_proxy.reset(mode="pass")
    check_dataset(out)  # the denied runs committed nothing and removed nothing
    assert storage.exists(manifest_marker_uri(out))


@pytest.mark.spark
def test_spark_jobs_fail_naming_an_object_they_cannot_read(spark, s3_bucket, fault_proxy, s3_via, tmp_path):
    """On Spark too, the task's error reaches the caller as itself: ``StorageError`` naming the
    object, not a JVM stack, and the dataset the --overwrite runs would have replaced stays."""
    from jobs.common.engines.spark_engine import SparkEngine

    lake = _upload_lake(s3_bucket, tmp_path, {"a": 10, "b": 10})
    out = f"{s3_bucket}/ds"
    _build(SparkEngine(spark=spark), lake, out)
    denied = _a_key(s3_bucket, "raw/a/")
    saved = dict(spark.sparkContext.environment)
    try:
        s3_via(fault_proxy.endpoint)
        engine = SparkEngine(spark=spark)  # its workers get the proxy's endpoint
        fault_proxy.reset(mode="deny", match=denied)
        for what, fn in _overwrite_runs(engine, lake, out):
            with pytest.raises(StorageError) as err:
                fn()
            assert str(err.value).startswith(f"cannot read {s3_bucket}/{denied}: PermissionError"), (
                what,
                err.value,
            )
            assert fault_proxy.injected["403"] >= 1, (what, fault_proxy.injected)
    finally:
        fault_proxy.reset(mode="pass")
        spark.sparkContext.environment.clear()
        spark.sparkContext.environment.update(saved)
    check_dataset(out)
    assert storage.exists(manifest_marker_uri(out))


def test_a_store_without_conditional_writes_builds_unlocked_with_one_warning(
    s3_bucket, fault_proxy, s3_via, local_engine, tmp_path, caplog
):
    """A store that answers 501 to If-None-Match (no conditional writes): both jobs build the
    dataset without a lock, each saying once that two jobs at once would not be refused, and
    leave no lock object behind."""
    lake = _upload_lake(s3_bucket, tmp_path, {"a": 10, "b": 10})
    out = f"{s3_bucket}/ds"
    try:
        s3_via(fault_proxy.endpoint)
        fault_proxy.reset(mode="unconditional")
        with caplog.at_level("WARNING", logger="lakeshard.locks"):
            _build(local_engine, lake, out)
        assert fault_proxy.injected["501"] >= 2, fault_proxy.injected  # one lock try a job
    finally:
        fault_proxy.reset(mode="pass")
    warned = [r.getMessage() for r in caplog.records if "would not be refused" in r.getMessage()]
    assert len(warned) == 2, warned
    assert warned[0].startswith(f"{out}: cannot write {out}/_lock: the store refused conditional writes"), (
        warned
    )
    check_dataset(out)
    assert not storage.exists(f"{out}/_lock")
