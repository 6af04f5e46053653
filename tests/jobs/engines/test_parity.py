"""Same lake, same seed: the Dask and local engines write the dataset Spark writes, row for row."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lakeshard import storage
from lakeshard.format import (
    channel_shards,
    read_dataset_info,
    rejects_uri,
    shard_relpath,
    shard_version,
)
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import check_dataset, read_table
from tests.helpers.lake import bad_objects
from tests.jobs.engines.compare import assert_same_dataset
from tests.jobs.engines.conftest import build_dataset

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.dask]


def test_dask_writes_the_dataset_spark_writes(
    spark_reference: str, dask_engine, mixed_lake: str, tmp_path: Path
) -> None:
    out = build_dataset(dask_engine, mixed_lake, str(tmp_path / "ds"))
    info = assert_same_dataset(spark_reference, out)
    check_dataset(out)
    # Every bad object was counted somewhere (manifest or shard rejects), nothing else was.
    root = storage.normalize(out)
    rejected = (
        read_channel(root, "rejects")["key"].to_pylist()
        + read_table(rejects_uri(root, read_dataset_info(root)))["key"].to_pylist()
    )
    assert sorted(rejected) == sorted(k for k in bad_objects() if "/bad_" in k)
    assert info.counts.padded > 0  # some rows were routed twice
    assert read_dataset_info(root).engine == "dask"


def test_local_writes_the_dataset_spark_writes(
    spark_reference: str, local_engine, mixed_lake: str, tmp_path: Path
) -> None:
    out = build_dataset(local_engine, mixed_lake, str(tmp_path / "ds"))
    assert_same_dataset(spark_reference, out)
    assert read_dataset_info(storage.normalize(out)).engine == "local"


def test_the_comparison_sees_a_reordered_shard(spark_reference: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(storage.filesystem(spark_reference)[1], copy)
    part = copy / shard_relpath("train", 1, 3)
    table = pq.read_table(part)
    pq.write_table(table.take([*range(1, table.num_rows), 0]), part)
    with pytest.raises(AssertionError, match="part 1"):
        assert_same_dataset(spark_reference, str(copy))


@pytest.mark.s3
def test_dask_on_s3_writes_the_same_shards(
    spark_reference: str, dask_engine, mixed_lake: str, s3_bucket: str
) -> None:
    fs, bucket = storage.filesystem(s3_bucket)
    fs.put(mixed_lake, f"{bucket}/raw", recursive=True)
    out = build_dataset(dask_engine, f"{s3_bucket}/raw", f"{s3_bucket}/ds")
    check_dataset(out)
    ref = storage.normalize(spark_reference)
    assert storage.read_json(storage.join(out, "labels.json")) == storage.read_json(
        storage.join(ref, "labels.json")
    )
    # The split and plan depend on keys only: the same keys land in the same places, with the
    # same image bytes; only the URIs' scheme differs (and S3's ETag is the same MD5).
    for name in ("train", "validation", "test", "rejects"):
        # A local empty object is rejected before it is hashed: its ETag is S3's only.
        cols = ["key", "label", "label_index", "channel", "size", "status", "reason"] + ["etag"] * (
            name != "rejects"
        )
        a, b = (read_channel(r, name, columns=cols) for r in (ref, out))
        assert a.to_pylist() == b.to_pylist(), name
    # The S3 dataset's shards are in a version folder (no copy on S3); each is where dataset.json says.
    info, info_s3 = read_dataset_info(ref), read_dataset_info(out)
    assert shard_version(info) is None and shard_version(info_s3) is not None
    for channel in info.channels:
        for (ref_uri, _), (uri, _) in zip(
            channel_shards(ref, info, channel), channel_shards(out, info_s3, channel), strict=True
        ):
            a, b = (read_table(u).drop_columns(["uri"]) for u in (ref_uri, uri))
            assert a.equals(b), uri
    assert all(u.startswith(f"{s3_bucket}/raw/") for u in read_table(uri)["uri"].to_pylist())
