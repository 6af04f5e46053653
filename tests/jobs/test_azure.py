"""Both jobs and the loader against Azure Blob Storage: Azurite's blob service on 127.0.0.1,
spoken to over HTTP (tests/helpers/azurite.py). A lake on ``az://`` becomes a dataset there; two
ranks read every row once, the second epoch from the shard cache; the loader's count of
requests is Azurite's own (its debug log). Then a lake on S3 becomes a dataset on Azure."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import PlatformError, StorageError
from lakeshard.format import channel_shards
from lakeshard.format.manifest_table import read_channel
from loaders import ShardLoader
from loaders.stats import AZURE_PRICES
from tests.helpers.azurite import Azurite
from tests.helpers.checks import check_dataset
from tests.helpers.lake import encode, make_image
from tests.helpers.store import wait_reads_ended

pytestmark = pytest.mark.azure

_SPLIT = {"train": 0.6, "validation": 0.2, "test": 0.2}


def _lake() -> dict[str, bytes]:
    objects = {
        f"raw/{label}/{'sub/' if i % 2 else ''}img {i:03d}.png": encode(make_image(li * 1000 + i), "PNG")
        for li, label in enumerate(["cat", "dog"])
        for i in range(15)
    }
    objects["raw/dog/photo #1.png"] = encode(make_image(98), "PNG")
    objects["raw/dog/readme.jpg"] = b"plain text pretending to be a jpeg"
    return objects


def _upload(root: str, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        storage.write_bytes_atomic(f"{root}/{key}", data)


def _build(lake: str, out: str, engine) -> None:
    manifest_job.run(
        ManifestConfig(input=lake, output=out, seed=3, split=_SPLIT, max_reject_fraction=0.2), engine
    )
    shard_job.run(ShardConfig(dataset=out, num_shards=2, image_size=16, max_reject_fraction=0.2), engine)


def _digests(loader: ShardLoader) -> list[str]:
    return [hashlib.sha256(img.numpy().tobytes()).hexdigest() for images, _ in loader for img in images]


def _settled(loader: ShardLoader, server: Azurite, first, served: int, timeout_s: float = 30.0):
    """The loader's store requests since ``first`` and Azurite's downloads since ``served``,
    read once no read is in flight and both agree, or at the deadline (for the test to fail on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wait_reads_ended(loader)
        if loader.cache is not None:
            loader.cache.wait(timeout=10)
        counted, downloads = loader.totals().store - first, server.downloads() - served
        if counted.requests == downloads or time.monotonic() > deadline:
            return counted, downloads
        time.sleep(0.05)


def test_azurites_count_holds_every_download_answered_before_it(az_container: str, azurite: Azurite):
    """Azurite writes its debug log behind its answers (read straight after a download, the file
    lacked that download's line 15 times in 200 here): the count the tests compare with the
    loader's is read only once the log holds every request answered before it."""
    from lakeshard.storage import azure_client

    container = azure_client().get_container_client(az_container.split("://", 1)[1])
    container.upload_blob("one", b"x" * 1000)
    before = azurite.downloads()
    counts = []
    for _ in range(100):
        container.download_blob("one").readall()
        counts.append(azurite.downloads() - before)
    assert counts == list(range(1, 101))


def test_an_azure_lake_to_an_azure_dataset_read_by_two_ranks(
    az_container: str, azurite: Azurite, local_engine, tmp_path: Path
):
    objects = _lake()
    _upload(az_container, objects)
    out = f"{az_container}/datasets/pets"
    _build(f"{az_container}/raw", out, local_engine)
    info = check_dataset(out)
    rows = read_channel(out, "all")
    assert sorted(rows["key"].to_pylist()) == sorted(k[len("raw/") :] for k in objects)
    reasons = dict(zip(rows["key"].to_pylist(), rows["reason"].to_pylist()))
    assert reasons["dog/readme.jpg"].startswith("not an image") and reasons["dog/photo #1.png"] is None
    assert info.inputs.lake == f"{az_container}/raw"
    etags = [e for e in rows["etag"].to_pylist() if e]
    assert etags and all(e.startswith("0x") for e in etags)  # Azure's own ETags, from the listing

    train = sum(rows for _, rows in channel_shards(out, info, "train"))
    seen: dict[int, list[str]] = {0: [], 1: []}
    for rank in (0, 1):
        opts = {"batch_size": 1, "shuffle": True, "seed": 5, "num_threads": 2}
        with ShardLoader(
            out, rank=rank, world_size=2, cache_dir=str(tmp_path / f"cache{rank}"), **opts
        ) as loader:
            served, first = azurite.downloads(), loader.totals().store
            per_epoch = []
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                got = _digests(loader)
                per_epoch.append(loader.epoch_stats())
                seen[epoch] += got
            counted, downloads = _settled(loader, azurite, first, served)
            assert loader.options.price_table(out) is AZURE_PRICES  # prices=None: Azure's table
        assert counted.requests == downloads > 0  # Azurite's own count of downloads
        first_epoch = per_epoch[0]
        assert first_epoch.cost_usd == pytest.approx(
            AZURE_PRICES.cost(first_epoch.requests, first_epoch.bytes_read)
        )
        assert per_epoch[0].requests > 0 and per_epoch[0].cache_hits == 0
        assert per_epoch[1].requests == 0 and per_epoch[1].cache_hits > 0  # epoch 2: the cache
    for epoch in (0, 1):  # every row once, over the two ranks
        assert len(seen[epoch]) == len(set(seen[epoch])) == train > 0
    assert sorted(seen[0]) == sorted(seen[1])


@pytest.mark.s3
def test_an_s3_lake_to_an_azure_dataset(s3_bucket: str, az_container: str, local_engine):
    objects = _lake()
    _upload(s3_bucket, objects)
    out = f"{az_container}/pets"
    _build(f"{s3_bucket}/raw", out, local_engine)
    info = check_dataset(out)
    assert info.inputs.lake == f"{s3_bucket}/raw"
    with ShardLoader(out, batch_size=4) as loader:
        assert sum(len(labels) for _, labels in loader) > 0


def test_a_missing_container_fails_naming_the_uri(az_container: str, local_engine):
    """The output's container is never created: the lock's first write fails naming the URI
    (not a busy dataset), and so does a lake in a missing container."""
    _upload(az_container, _lake())
    with pytest.raises(
        StorageError, match=r"^cannot write az://no-such-container/ds/_lock: .*ContainerNotFound"
    ):
        manifest_job.run(
            ManifestConfig(input=f"{az_container}/raw", output="az://no-such-container/ds"), local_engine
        )
    with pytest.raises(PlatformError, match="az://no-such-container/raw"):
        manifest_job.run(
            ManifestConfig(input="az://no-such-container/raw", output=f"{az_container}/o"), local_engine
        )


def test_spark_builds_an_azure_lake_into_an_azure_dataset(spark_engine, az_container: str):
    """On the Python workers of the tests' Spark session, started before Azurite's settings (the
    session fixture comes first): each task gets the driver's store environment."""
    objects = _lake()
    _upload(az_container, objects)
    out = f"{az_container}/pets"
    _build(f"{az_container}/raw", out, spark_engine)
    check_dataset(out)
    assert sorted(read_channel(out, "all")["key"].to_pylist()) == sorted(k[len("raw/") :] for k in objects)


@pytest.mark.dask
@pytest.mark.slow  # a Dask cluster of its own: its workers start with the Azure environment
def test_dask_and_the_local_engine_build_the_same_azure_dataset(az_container: str, local_engine):
    from jobs.common.engines.dask_engine import DaskEngine
    from tests.hardening.helpers import dataset_digest

    _upload(az_container, _lake())
    _build(f"{az_container}/raw", f"{az_container}/local", local_engine)
    engine = DaskEngine(n_workers=2)
    try:
        _build(f"{az_container}/raw", f"{az_container}/dask", engine)
    finally:
        engine.close()
    check_dataset(f"{az_container}/dask")
    assert dataset_digest(f"{az_container}/dask") == dataset_digest(f"{az_container}/local")
