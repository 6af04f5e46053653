"""The shard job's commit on S3: shards are written once into a version folder and
``dataset.json`` makes them the dataset. Counted where the server sees it (the proxy in front
of moto logs every request): no CopyObject of anything, while a reader holding the old
``dataset.json`` keeps reading whole old shards; old versions are listed and removed by
``python -m jobs.versions``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from urllib.parse import unquote

import boto3
import pyarrow.dataset as pads
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs import versions
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.format import DatasetInfo, channel_shards, open_shard, read_dataset_info, shard_version
from lakeshard.format.versions import list_versions
from loaders import ShardLoader
from tests.hardening.faultproxy import FaultProxy, Request
from tests.hardening.helpers import dataset_digest, job_env, run_until
from tests.helpers.checks import check_dataset
from tests.helpers.lake import encode, make_image, write_lake

pytestmark = [pytest.mark.s3]

SHARD = {
    "num_shards": 2,
    "image_size": 16,
    "image_format": "png",
    "remainder": "pad",
    "max_reject_fraction": 0.2,
}


def _s3_lake(bucket: str, tmp_path: Path) -> str:
    """A small lake on S3 with one truncated JPEG: the shard job rejects it and assembles the
    shard it was planned in again (the path that renamed an assembled shard into place)."""
    local = tmp_path / "lake"
    write_lake(local, {"cat": 9, "dog": 8, "fox": 7})
    client = boto3.client("s3")
    name = bucket[len("s3://") :]
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=name, Key=f"raw/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    client.put_object(Bucket=name, Key="raw/cat/truncated.jpg", Body=encode(make_image(5), "JPEG")[:300])
    return f"{bucket}/raw"


def _copies(proxy: FaultProxy) -> list[Request]:
    return [r for r in proxy.log if r.copy_source is not None]


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
    manifest_job.run(
        ManifestConfig(
            input=lake,
            output=out,
            split_method="stratified",
            seed=7,
            split={"train": 0.6, "validation": 0.2, "test": 0.2},
        ),
        local_engine,
    )
    return out


@pytest.mark.slow
def test_the_shard_job_on_s3_copies_nothing_and_keeps_old_versions(
    s3_dataset, fault_proxy, local_engine, capsys
):
    out = s3_dataset
    fault_proxy.reset(mode="pass")
    first = shard_job.run(ShardConfig(dataset=out, **SHARD), local_engine)
    assert first.counts.shard_rejects == 1 and first.build.assembled_shards >= 1
    assert fault_proxy.log, "the proxy saw no request: the job did not go through it"
    assert _copies(fault_proxy) == []
    check_dataset(out)
    v1 = shard_version(first)
    assert v1 is not None and v1.startswith(first.dataset_version + "-")
    assert all(
        s.path.startswith(f"shards/v={v1}/channel=") for c in first.channels.values() for s in c.shards
    )
    put_shards = {
        unquote(r.path)
        for r in fault_proxy.log
        if r.method in ("PUT", "POST") and ".parquet" in r.path and "/shards/" in r.path
    }
    assert put_shards and all(f"/shards/v={v1}/" in p for p in put_shards), sorted(put_shards)[:5]

    # The same dataset again (--overwrite): a new version folder; the old one is not touched.
    fault_proxy.reset(mode="pass")
    second = shard_job.run(ShardConfig(dataset=out, overwrite=True, **SHARD), local_engine)
    assert _copies(fault_proxy) == []
    v2 = shard_version(second)
    assert second.dataset_version == first.dataset_version and v2 != v1
    assert not [r.path for r in fault_proxy.log if r.method == "DELETE" and f"/v={v1}" in unquote(r.path)]
    _read_all(out, first)  # a reader holding the old dataset.json still reads whole shards
    check_dataset(out)

    # As docs/format.md says: the version folder read as one table is the dataset's shard rows,
    # once each; shards/ as one table holds both versions.
    fs, path = storage.filesystem(out)
    rows = sum(c.rows for c in second.channels.values())
    table = pads.dataset(
        f"{path}/shards/v={v2}", filesystem=fs, format="parquet", partitioning="hive"
    ).to_table()
    assert table.num_rows == rows and sorted(set(table.column("channel").to_pylist())) == sorted(
        second.channels
    )
    both = pads.dataset(f"{path}/shards", filesystem=fs, format="parquet", partitioning="hive").to_table()
    assert both.num_rows == 2 * rows and set(both.column("v").to_pylist()) == {v1, v2}

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
    assert [v.name for v in list_versions(out)] == [v2]
    fs, path = storage.filesystem(out)
    assert not fs.find(f"{path}/shards/v={v1}")
    check_dataset(out)
    with ShardLoader(out, channel="train", rank=0, world_size=1, batch_size=4, seed=1) as loader:
        assert sum(len(y) for _, y in loader) == second.channels["train"].rows


@pytest.mark.slow
def test_a_reader_during_an_s3_rebuild_sees_one_whole_version(s3_dataset, fault_proxy, local_engine):
    """While the shard job rebuilds (another image size: another dataset version), a reader
    opening the dataset sees the old version or the new one, each whole, never none; and one
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
                now = read_dataset_info(out)
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
        new = shard_job.run(
            ShardConfig(dataset=out, overwrite=True, **{**SHARD, "image_size": 12}), local_engine
        )
    finally:
        done.set()
        thread.join(timeout=120)
    assert not failures, (failures, seen)
    assert new.dataset_version != old.dataset_version
    assert seen and set(seen) <= {old.dataset_version, new.dataset_version}, seen
    assert seen[0] == old.dataset_version, seen
    _read_all(out, old)
    assert read_dataset_info(out).dataset_version == new.dataset_version


#: The shard job's commit on S3, step by step: (storage function, URI suffix, before/after).
S3_COMMIT_POINTS = [
    ("remove", "/_runs", "before"),  # every segment and receipt written, nothing committed
    ("write_bytes_atomic", "/_rejects.parquet", "after"),  # the version's rejects table written
    ("write_json_atomic", "/_version.json", "after"),  # the version complete, dataset.json still the old one
    ("write_json_atomic", "/dataset.json", "before"),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_s3_commit_killed_at_each_step_reruns_into_the_same_version_folder(s3_dataset, tmp_path):
    """Kill -9 the shard job (an overwrite of an identical dataset) at each step of its S3
    commit: a reader sees the old dataset, whole, every time (never none); each rerun resumes in the same version
    folder (the first one reuses every segment it can); the last leaves the old version and one
    new one."""
    out = s3_dataset
    env, log = job_env(), tmp_path / "shard.log"
    cmd = [
        sys.executable,
        "-m",
        "jobs.shard",
        "--engine",
        "local",
        "--dataset",
        out,
        "--num-shards",
        "2",
        "--image-size",
        "16",
        "--image-format",
        "png",
        "--remainder",
        "pad",
        "--max-reject-fraction",
        "0.2",
        "--overwrite",
    ]
    rc, _ = run_until(cmd, env=env, log=log, kill_after=None)
    assert rc == 0, log.read_text()[-3000:]
    want, old = dataset_digest(out), read_dataset_info(out)
    for func, suffix, when in S3_COMMIT_POINTS:
        before = log.read_text()
        point = [sys.executable, "-m", "tests.hardening.killpoint", f"{func}:{suffix}:{when}", *cmd[2:]]
        rc, _ = run_until(point, env=env, log=log, kill_after=None)
        assert rc == 137, f"{func}:{suffix}:{when} exited {rc}:\n{log.read_text()[-3000:]}"
        assert read_dataset_info(out) == old, (func, suffix, when)
        assert dataset_digest(out) == want, (func, suffix, when)
        _read_all(out, old)
        if suffix == "/_rejects.parquet":  # right after the kill at /_runs
            # every segment but those the assemblies replaced (their receipts were removed)
            reused = 6 - old.build.assembled_shards
            assert f"resuming: {reused} of 6 segments" in log.read_text()[len(before) :], log.read_text()[
                len(before) :
            ]
    rc, _ = run_until(cmd, env=env, log=log, kill_after=None)
    assert rc == 0, log.read_text()[-3000:]
    check_dataset(out)
    assert dataset_digest(out) == want
    found = list_versions(out)
    assert [v.state for v in found] == ["complete", "current"], found
    assert found[0].name == shard_version(old)
