"""Both jobs against a real S3 endpoint: moto's HTTP server on 127.0.0.1, spoken to over HTTP."""

from __future__ import annotations

import logging

import boto3
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError
from lakeshard.format.manifest_table import read_channel
from tests.conftest import S3_ENV
from tests.helpers.checks import check_dataset
from tests.helpers.lake import encode, make_image

pytestmark = [pytest.mark.s3, pytest.mark.spark]


def _upload_lake(bucket: str, endpoint: str) -> dict[str, bytes]:
    client = boto3.client("s3", endpoint_url=endpoint)
    objects = {
        f"raw/{label}/{'sub/' if i % 2 else ''}img {i:03d}.png": encode(make_image(li * 1000 + i), "PNG")
        for li, label in enumerate(["cat", "dog"])
        for i in range(15)
    }
    objects["raw/dog/ünïcødé name.png"] = encode(make_image(99), "PNG")
    objects["raw/dog/photo #1.png"] = encode(make_image(98), "PNG")
    objects["raw/cat/what?+a=b&c%20d.png"] = encode(make_image(97), "PNG")
    objects["raw/dog/readme.jpg"] = b"plain text pretending to be a jpeg"
    objects["raw/cat/truncated.jpg"] = encode(make_image(5), "JPEG")[:300]
    for key, data in objects.items():
        client.put_object(Bucket=bucket[len("s3://") :], Key=key, Body=data)
    return objects


def test_s3_lake_to_s3_dataset(s3_bucket, s3_endpoint, spark_engine, caplog):
    objects = _upload_lake(s3_bucket, s3_endpoint)
    out = f"{s3_bucket}/datasets/pets-v1"
    caplog.set_level(
        logging.INFO
    )  # what the jobs log at their default level (botocore DEBUG shows the key id)
    manifest_job.run(
        ManifestConfig(
            input=f"{s3_bucket}/raw",
            output=out,
            seed=3,
            split_method="stratified",
            split={"train": 0.6, "validation": 0.2, "test": 0.2},
            max_reject_fraction=0.2,
        ),
        spark_engine,
    )
    shard_job.run(
        ShardConfig(dataset=out, num_shards=2, image_size=16, max_reject_fraction=0.2), spark_engine
    )
    info = check_dataset(out)

    all_rows = read_channel(out, "all")
    assert sorted(all_rows["key"].to_pylist()) == sorted(k[len("raw/") :] for k in objects)
    etags = dict(zip(all_rows["key"].to_pylist(), all_rows["etag"].to_pylist()))
    assert all(len(etags[k]) == 32 for k in etags)  # S3's ETag, from the listing
    reasons = dict(zip(all_rows["key"].to_pylist(), all_rows["reason"].to_pylist()))
    assert reasons["dog/readme.jpg"].startswith("not an image")
    for key in ("dog/ünïcødé name.png", "dog/photo #1.png", "cat/what?+a=b&c%20d.png"):
        assert reasons[key] is None, (key, reasons[key])
    assert info.counts.shard_rejects == 1  # the truncated JPEG
    assert info.inputs.lake == f"{s3_bucket}/raw"

    # Credentials never reach an output object or a log line.
    fs, path = storage.filesystem(out)
    secrets = [S3_ENV["AWS_SECRET_ACCESS_KEY"].encode(), S3_ENV["AWS_ACCESS_KEY_ID"].encode()]
    written = fs.find(path)
    assert len(written) >= 12
    for key in written:
        data = fs.cat_file(key)
        assert not any(s in data for s in secrets), key
    assert not any(s.decode() in caplog.text for s in secrets)


def test_missing_bucket_fails_fast_naming_the_uri(s3_endpoint, spark_engine, tmp_path):
    with pytest.raises((ManifestError, StorageError), match="s3://no-such-bucket-here/raw"):
        manifest_job.run(
            ManifestConfig(input="s3://no-such-bucket-here/raw", output=str(tmp_path / "o")), spark_engine
        )


@pytest.mark.timeout(120)
def test_permanent_error_is_not_retried_for_minutes(s3_endpoint, tmp_path, monkeypatch):
    # Wrong credentials against a server that checks none would pass; an unknown endpoint port
    # must fail with the URI, bounded by botocore's retry config, not hang.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises((ManifestError, StorageError), match="s3://some-bucket/raw"):
        storage_check = ManifestConfig(input="s3://some-bucket/raw", output=str(tmp_path / "o"))
        from jobs.manifest_steps.listing import discover

        discover(storage_check.input)
