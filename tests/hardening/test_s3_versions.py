"""The shard job's commit on S3: shards are written once into a version folder and
``dataset.json`` makes them the dataset. Counted where the server sees it (the proxy in front
of moto logs every request): no CopyObject of anything, while a reader holding the old
``dataset.json`` keeps reading whole old shards; old versions are listed and removed by
``python -m jobs.versions``."""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import unquote

import boto3
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs import versions
from jobs.settings import ManifestConfig, ShardConfig
from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format import DatasetInfo, channel_shards, open_shard, read_dataset_info, shard_version
from loaders import ShardLoader
from tests.helpers.checks import check_dataset
from tests.helpers.lake import encode, make_image, write_lake

pytestmark = [pytest.mark.s3]

SHARD = {"num_shards": 2, "image_size": 16, "image_format": "png", "remainder": "pad", "max_reject_fraction": 0.2}


def _s3_lake(bucket: str, tmp_path: Path) -> str:
    """A small lake on S3 with one truncated JPEG: the shard job rejects it and assembles the
    shard it was planned in again (the path that renamed an assembled shard into place)."""
    local = tmp_path / "lake"
    write_lake(local, {"cat": 9, "dog": 8, "fox": 7})
    client = boto3.client("s3")
    name = bucket[len("s3://"):]
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=name, Key=f"raw/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    client.put_object(Bucket=name, Key="raw/cat/truncated.jpg", Body=encode(make_image(5), "JPEG")[:300])
    return f"{bucket}/raw"


def _copies(proxy) -> list[tuple[str, str, str | None]]:
    return [r for r in proxy.log if r[2] is not None]


def _read_all(root: str, info: DatasetInfo) -> None:
    """Open every shard ``info`` names and check it against ``info`` (footer, rows)."""
    for channel in info.channels:
        for i, (uri, rows) in enumerate(channel_shards(root, info, channel)):
            with open_shard(uri) as shard:
                shard.check(info, channel, i, rows=rows)
                shard.parquet.read_row_group(0, columns=["label"])


@pytest.fixture()
def s3_dataset(s3_bucket, fault_proxy, s3_via, local_engine, tmp_path):
    """A manifest on S3, spoken to through the counting proxy (every request passes)."""
    fault_proxy.reset(mode="pass")
    s3_via(fault_proxy.endpoint)
    lake = _s3_lake(s3_bucket, tmp_path)
    out = f"{s3_bucket}/datasets/pets"
    manifest_job.run(ManifestConfig(input=lake, output=out, split_method="stratified", seed=7,
                                    split={"train": 0.6, "validation": 0.2, "test": 0.2}), local_engine)
    return out


def test_the_shard_job_on_s3_copies_nothing_and_keeps_old_versions(s3_dataset, fault_proxy, local_engine, capsys):
    out = s3_dataset
    fault_proxy.reset(mode="pass")
    first = shard_job.run(ShardConfig(dataset=out, **SHARD), local_engine)
    assert first.counts.shard_rejects == 1 and first.build.assembled_shards >= 1
    assert fault_proxy.log, "the proxy saw no request: the job did not go through it"
    assert _copies(fault_proxy) == []
    check_dataset(out)
    v1 = shard_version(first)
    assert v1 is not None and v1.startswith(first.dataset_version + "-")
    assert all(s.path.startswith(f"shards/v={v1}/channel=") for c in first.channels.values() for s in c.shards)
    put_shards = {unquote(p) for m, p, _ in fault_proxy.log if m in ("PUT", "POST") and ".parquet" in p and "/shards/" in p}
    assert put_shards and all(f"/shards/v={v1}/" in p for p in put_shards), sorted(put_shards)[:5]

    # The same dataset again (--overwrite): a new version folder; the old one is not touched.
    fault_proxy.reset(mode="pass")
    second = shard_job.run(ShardConfig(dataset=out, overwrite=True, **SHARD), local_engine)
    assert _copies(fault_proxy) == []
    v2 = shard_version(second)
    assert second.dataset_version == first.dataset_version and v2 != v1
    assert not [p for m, p, _ in fault_proxy.log if m == "DELETE" and f"/v={v1}" in unquote(p)]
    _read_all(out, first)  # a reader holding the old dataset.json still reads whole shards
    check_dataset(out)

    assert versions.main(["list", "--dataset", out]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in listed] == [[v1, "complete"], [v2, "current"]], listed

    assert versions.main(["remove", "--dataset", out, "--keep", "1", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(f"would remove {v1}  complete")
    assert storage.exists(f"{out}/shards/v={v1}/_version.json")

    assert versions.main(["remove", "--dataset", out, "--version", v2]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jobs/versions.py: error: --version ") and "is the current version" in err
    assert versions.main(["remove", "--dataset", out, "--version", "0123456789abcdef-01234567"]) == 2
    assert "has no such version" in capsys.readouterr().err
    assert versions.main(["remove", "--dataset", out, "--keep", "0"]) == 2
    assert "--keep must be an integer >= 1" in capsys.readouterr().err

    assert versions.main(["remove", "--dataset", out, "--keep", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"removed {v1}  complete")
    assert [v.name for v in versions.list_versions(out)] == [v2]
    fs, path = storage.filesystem(out)
    assert not fs.find(f"{path}/shards/v={v1}")
    check_dataset(out)
    with ShardLoader(out, channel="train", rank=0, world_size=1, batch_size=4, seed=1) as loader:
        assert sum(len(y) for _, y in loader) == second.channels["train"].rows


def test_a_reader_during_an_s3_rebuild_sees_one_whole_version(s3_dataset, fault_proxy, local_engine):
    """While the shard job rebuilds (another image size: another dataset version), a reader
    opening the dataset sees the old version or the new one, each whole, or none; and one
    that opened the old version before keeps reading it to the end."""
    out = s3_dataset
    old = shard_job.run(ShardConfig(dataset=out, **SHARD), local_engine)
    seen: list[str] = []
    failures: list[BaseException] = []
    done, first = threading.Event(), threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                _read_all(out, old)
                try:
                    now = read_dataset_info(out)
                except DatasetError:
                    seen.append("none")
                    continue
                _read_all(out, now)
                seen.append(now.dataset_version)
                first.set()
            except BaseException as exc:
                failures.append(exc)
                return

    thread = threading.Thread(target=reader, name="rebuild-reader")
    thread.start()
    assert first.wait(timeout=60), (failures, seen)
    try:
        new = shard_job.run(ShardConfig(dataset=out, overwrite=True, **{**SHARD, "image_size": 12}), local_engine)
    finally:
        done.set()
        thread.join(timeout=120)
    assert not failures, (failures, seen)
    assert new.dataset_version != old.dataset_version
    assert seen and set(seen) <= {old.dataset_version, new.dataset_version, "none"}, seen
    assert seen[0] == old.dataset_version, seen
    _read_all(out, old)
    assert read_dataset_info(out).dataset_version == new.dataset_version
