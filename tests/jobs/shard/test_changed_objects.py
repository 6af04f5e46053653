"""An object replaced between the manifest job and the shard job is a counted reject with its
reason (what changed, from what to what), never stored silently: local files and S3."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.format import DatasetInfo, read_dataset_info, rejects_uri
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.lake import encode, make_image, write_lake


def _rejects(out: str) -> dict[str, str]:
    table = read_table(rejects_uri(out, read_dataset_info(out)))
    return dict(zip(table["key"].to_pylist(), table["reason"].to_pylist(), strict=True))


def _stored_uris(out: str, info: DatasetInfo) -> set[str]:
    return {
        u for c in info.channels for t in shard_tables(out, c, info.num_shards) for u in t["uri"].to_pylist()
    }


def test_a_local_file_replaced_after_the_manifest_is_rejected_with_the_change(tmp_path: Path, local_engine):
    lake = tmp_path / "raw"
    paths = {p.relative_to(lake).as_posix(): p for p in write_lake(lake, {"a": 20, "b": 20})}
    out = tmp_path / "ds"
    manifest_job.run(ManifestConfig(input=str(lake), output=str(out), split="train=1"), local_engine)
    bigger, same_size = sorted(paths)[3], sorted(paths)[25]
    old_size = paths[bigger].stat().st_size
    paths[bigger].write_bytes(encode(make_image(777, size=(64, 64)), "PNG"))  # another image, another size
    data = bytearray(paths[same_size].read_bytes())
    data[-20] ^= 0xFF  # same length, other content
    paths[same_size].write_bytes(bytes(data))

    info = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=16, max_reject_fraction=0.2), local_engine
    )
    check_dataset(str(out))
    reasons = _rejects(str(out))
    assert set(reasons) == {bigger, same_size}
    assert reasons[bigger] == (
        f"changed since the manifest was built: size {old_size} -> {paths[bigger].stat().st_size}"
    )
    assert reasons[same_size].startswith("changed since the manifest was built: etag ")
    assert info.counts.shard_rejects == 2
    assert not {f"file://{paths[k]}" for k in reasons} & _stored_uris(str(out), info)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("engine_name", ["local", pytest.param("spark", marks=pytest.mark.spark)])
def test_an_s3_object_replaced_after_the_manifest_is_rejected_with_the_change(
    engine_name: str, s3_bucket: str, s3_endpoint: str, request: pytest.FixtureRequest
):
    engine = request.getfixturevalue(f"{engine_name}_engine")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = s3_bucket[len("s3://") :]
    for label in ("a", "b"):
        for i in range(10):
            client.put_object(
                Bucket=bucket,
                Key=f"raw/{label}/{i:02d}.png",
                Body=encode(make_image(i + 50 * len(label)), "PNG"),
            )
    out = f"{s3_bucket}/ds"
    manifest_job.run(ManifestConfig(input=f"{s3_bucket}/raw", output=out, split="train=1"), engine)
    old = client.head_object(Bucket=bucket, Key="raw/a/03.png")
    client.put_object(Bucket=bucket, Key="raw/a/03.png", Body=encode(make_image(999, size=(64, 64)), "PNG"))
    new = client.head_object(Bucket=bucket, Key="raw/a/03.png")
    same = client.get_object(Bucket=bucket, Key="raw/b/05.png")["Body"].read()
    client.put_object(
        Bucket=bucket, Key="raw/b/05.png", Body=same[:-20] + bytes(b ^ 0xFF for b in same[-20:])
    )

    info = shard_job.run(
        ShardConfig(dataset=out, num_shards=2, image_size=16, max_reject_fraction=0.2), engine
    )
    reasons = _rejects(out)
    assert set(reasons) == {"a/03.png", "b/05.png"}
    assert reasons["a/03.png"] == (
        f"changed since the manifest was built: size {old['ContentLength']} -> {new['ContentLength']}"
    )
    assert reasons["b/05.png"].startswith("changed since the manifest was built: etag ")
    assert info.counts.shard_rejects == 2
    assert not {f"{s3_bucket}/raw/{k}" for k in reasons} & _stored_uris(out, info)
