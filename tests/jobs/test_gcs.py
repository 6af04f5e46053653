"""A lake and a dataset on Google Cloud Storage (the emulator of tests/conftest.py, over HTTP):
lake -> manifest -> shards -> the loader on two ranks, every row once, the cache serving epoch 2,
and the emulator's own count of downloads equal to what ``epoch_stats()`` counted; a lake on S3
built into a dataset on GCS by Dask; ``python -m jobs.versions`` on GCS."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.format.manifest_table import read_channel
from lakeshard.format.versions import current_version, list_versions
from loaders import ShardLoader
from loaders.stats import GCS_PRICES
from tests.hardening.helpers import job_env
from tests.helpers.checks import check_dataset, shard_tables
from tests.helpers.lake import encode, make_image

pytestmark = pytest.mark.gcs


def _upload_lake(root: str) -> dict[str, bytes]:
    objects = {
        f"{label}/{'sub/' if i % 2 else ''}img {i:03d}.png": encode(make_image(li * 1000 + i), "PNG")
        for li, label in enumerate(["cat", "dog"])
        for i in range(12)
    }
    objects["dog/photo #1.png"] = encode(make_image(98), "PNG")
    objects["dog/readme.jpg"] = b"plain text pretending to be a jpeg"
    for key, data in objects.items():
        storage.write_bytes_atomic(f"{root}/{key}", data)
    return objects


def _build(lake: str, out: str, engine: Any, *, overwrite: bool = False) -> None:
    manifest_job.run(
        ManifestConfig(
            input=lake,
            output=out,
            overwrite=overwrite,
            seed=3,
            split_method="stratified",
            split={"train": 0.6, "validation": 0.2, "test": 0.2},
            max_reject_fraction=0.2,
        ),
        engine,
    )
    shard_job.run(
        ShardConfig(dataset=out, num_shards=2, image_size=16, image_format="png", max_reject_fraction=0.2),
        engine,
    )


def _key(hwc: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(hwc).tobytes()).hexdigest()


def _stored(root: str) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for table in shard_tables(root, "train", 2):
        for blob, label, pad in zip(*(table[c].to_pylist() for c in ("image", "label", "is_pad"))):
            if not pad:
                out[(_key(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))), label)] += 1
    return out


def _epoch(loader: ShardLoader, epoch: int) -> Counter[tuple[str, int]]:
    loader.set_epoch(epoch)
    out: Counter[tuple[str, int]] = Counter()
    for images, labels in loader:
        for img, label in zip(images.numpy(), labels.tolist()):
            out[(_key(img.transpose(1, 2, 0)), label)] += 1
    return out


def _settled(loader: ShardLoader, emulator: Any, bucket: str, served: int) -> tuple[int, int]:
    """The loader's store requests and the emulator's downloads of ``bucket`` since ``served``,
    once no read is in flight and the cache's downloads are done, and both agree (or at a
    deadline, for the test to fail on)."""
    deadline = time.monotonic() + 60
    while True:
        assert loader.fetcher is not None
        while not loader.fetcher.reads_ended() and time.monotonic() < deadline:
            time.sleep(0.01)
        if loader.cache is not None:
            loader.cache.wait(timeout=60)
        counted = loader.totals().store.requests
        downloads = emulator.downloads().get(bucket, 0) - served
        if counted == downloads or time.monotonic() > deadline:
            return counted, downloads
        time.sleep(0.05)


def test_gcs_lake_to_gcs_dataset_to_the_loader_on_two_ranks(
    gcs_bucket: str, gcs_emulator: Any, local_engine: Any, tmp_path: Path
):
    objects = _upload_lake(f"{gcs_bucket}/raw")
    out = f"{gcs_bucket}/datasets/pets"
    _build(f"{gcs_bucket}/raw", out, local_engine)
    info = check_dataset(out)
    assert info.inputs.lake == f"{gcs_bucket}/raw"
    rows = read_channel(out, "all")
    assert sorted(rows["key"].to_pylist()) == sorted(objects)
    etags = dict(zip(rows["key"].to_pylist(), rows["etag"].to_pylist()))
    fs = storage.store_for(out).filesystem()
    bucket = gcs_bucket[len("gs://") :]
    for key in ("cat/img 000.png", "dog/photo #1.png"):  # the generation, from the listing
        assert etags[key] == str(fs.info(f"{bucket}/raw/{key}")["generation"])
    reasons = dict(zip(rows["key"].to_pylist(), rows["reason"].to_pylist()))
    assert reasons["dog/readme.jpg"].startswith("not an image")

    stored = _stored(out)
    streamed: Counter[tuple[str, int]] = Counter()
    for rank in (0, 1):
        with ShardLoader(
            out,
            rank=rank,
            world_size=2,
            batch_size=4,
            shuffle=True,
            seed=5,
            num_threads=2,
            remainder="drop",
            cache_dir=str(tmp_path / f"cache-{rank}"),
        ) as loader:
            served = gcs_emulator.downloads().get(bucket, 0)  # after the footers
            mine = _epoch(loader, 0)
            streamed += mine
            first = loader.epoch_stats()
            counted, downloads = _settled(loader, gcs_emulator, bucket, served)
            assert counted == downloads > 0 and first.requests > 0 and first.bytes_read > 0
            assert first.cost_usd == pytest.approx(GCS_PRICES.cost(first.requests, first.bytes_read))
            assert loader.cache is not None and loader.cache.downloaded == [rank]
            before = gcs_emulator.downloads().get(bucket, 0)
            again = _epoch(loader, 1)
            second = loader.epoch_stats()
            assert second.cache_hits > 0 and second.cache_misses == 0 and second.requests == 0
            assert gcs_emulator.downloads().get(bucket, 0) == before  # served from the cache
            assert sum(again.values()) == sum(mine.values())
    assert streamed == stored  # every stored row once across the two ranks (remainder dropped)


@pytest.mark.s3
def test_a_lake_on_s3_builds_a_dataset_on_gcs(s3_bucket: str, gcs_bucket: str, dask_engine: Any):
    """On Dask's worker processes, which get where GCS is from the driver (``FORWARDED_ENV``)."""
    objects = _upload_lake(f"{s3_bucket}/raw")
    out = f"{gcs_bucket}/pets"
    _build(f"{s3_bucket}/raw", out, dask_engine)
    info = check_dataset(out)
    assert info.inputs.lake == f"{s3_bucket}/raw"
    rows = read_channel(out, "all")
    assert sorted(rows["key"].to_pylist()) == sorted(objects)
    assert all(len(e) == 32 for e in rows["etag"].to_pylist())  # S3's ETags, on a dataset in GCS
    with ShardLoader(out, batch_size=4, num_threads=2, remainder="drop") as loader:
        batches = [labels for _, labels in loader]
        assert len(batches) == len(loader) > 0


def test_versions_lists_and_prunes_a_dataset_on_gcs(gcs_bucket: str, local_engine: Any):
    _upload_lake(f"{gcs_bucket}/raw")
    out = f"{gcs_bucket}/pets"
    _build(f"{gcs_bucket}/raw", out, local_engine)
    first = current_version(out)
    storage.write_bytes_atomic(f"{gcs_bucket}/raw/cat/extra.png", encode(make_image(4242), "PNG"))
    _build(f"{gcs_bucket}/raw", out, local_engine, overwrite=True)
    second = current_version(out)
    assert first and second and second != first
    assert [v.name for v in list_versions(out)] == [first, second]

    def versions(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "jobs.versions", *args, "--dataset", out],
            env=job_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = versions("list")
    assert first in listed and second in listed
    versions("remove", "--keep", "1")
    listed = versions("list")
    assert second in listed and first not in listed
    assert [v.name for v in list_versions(out)] == [second]
    check_dataset(out)


def test_spark_builds_a_gcs_lake_into_a_gcs_dataset(gcs_bucket: str, spark_engine: Any):
    """On Spark's Python workers, which get where GCS is from the driver (``FORWARDED_ENV``)."""
    objects = _upload_lake(f"{gcs_bucket}/raw")
    out = f"{gcs_bucket}/pets"
    _build(f"{gcs_bucket}/raw", out, spark_engine)
    check_dataset(out)
    assert sorted(read_channel(out, "all")["key"].to_pylist()) == sorted(objects)
