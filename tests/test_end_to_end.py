"""The product end to end: a raw lake -> the real jobs -> ShardLoader on every rank.

Samples are identified by the hash of their decoded pixels, so the check does not trust any
bookkeeping of the loader: what comes out of the loader must be exactly what the shard job
stored, each sample once across ranks, with its label.
"""

from __future__ import annotations

import hashlib
import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.format import DatasetInfo
from loaders import ShardLoader
from tests.helpers.checks import check_dataset, shard_tables
from tests.helpers.lake import encode, make_image


def _pixels_key(hwc: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(hwc).tobytes()).hexdigest()


def _stored(root: str, channel: str, num_shards: int) -> Counter:
    out: Counter = Counter()
    for table in shard_tables(root, channel, num_shards):
        for blob, label, pad in zip(
            table["image"].to_pylist(), table["label"].to_pylist(), table["is_pad"].to_pylist()
        ):
            if not pad:
                out[(_pixels_key(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))), label)] += 1
    return out


def _streamed(root: str, channel: str, world_size: int, *, epoch: int = 0) -> Counter:
    out: Counter = Counter()
    for rank in range(world_size):
        with ShardLoader(
            root,
            channel=channel,
            rank=rank,
            world_size=world_size,
            batch_size=4,
            shuffle=True,
            seed=5,
            num_threads=2,
            prefetch=2,
            remainder="drop",
        ) as loader:
            loader.set_epoch(epoch)
            batches = 0
            for images, labels in loader:
                batches += 1
                assert images.dtype.is_floating_point is False and images.shape[1] == 3
                for img, label in zip(images.numpy(), labels.tolist()):
                    out[(_pixels_key(img.transpose(1, 2, 0)), label)] += 1
            assert batches == len(loader)
    return out


def _build(lake: str, out: str, engine, num_shards: int) -> DatasetInfo:
    manifest_job.run(ManifestConfig(input=lake, output=out, seed=1, split_method="stratified"), engine)
    return shard_job.run(
        ShardConfig(dataset=out, num_shards=num_shards, image_size=16, image_format="png"), engine
    )


def test_local_lake_streams_every_sample_once_per_epoch(small_lake, tmp_path, local_engine):
    root = str(tmp_path / "ds")
    info = _build(str(small_lake), root, local_engine, num_shards=2)
    check_dataset(root)
    for channel in ("train", "validation"):
        stored = _stored(root, channel, 2)
        assert sum(stored.values()) == info.channels[channel].rows
        assert _streamed(root, channel, world_size=2) == stored
    assert _streamed(root, "train", world_size=2, epoch=1) == _stored(root, "train", 2)


@pytest.mark.s3
@pytest.mark.spark
def test_s3_dataset_streams_into_the_loader(s3_bucket, s3_endpoint, spark_engine):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for label in ("a", "b"):
        for i in range(20):
            client.put_object(
                Bucket=s3_bucket[5:],
                Key=f"raw/{label}/{i}.png",
                Body=encode(make_image(i + (100 if label == "b" else 0)), "PNG"),
            )
    root = f"{s3_bucket}/ds"
    _build(f"{s3_bucket}/raw", root, spark_engine, num_shards=2)
    assert _streamed(root, "train", world_size=2) == _stored(root, "train", 2)
