"""The shard job's commit on Azure, as on S3 (tests/hardening/test_s3_versions.py): shards are
written once into a version folder and ``dataset.json`` makes them the dataset; counted where
the store sees it (the proxy in front of Azurite logs every request): no Copy Blob of anything,
a reader of the old ``dataset.json`` still reads whole old shards, and old versions are listed
and removed by ``python -m jobs.versions``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.format import shard_version
from lakeshard.format.versions import list_versions
from loaders import ShardLoader
from tests.hardening.faultproxy import FaultProxy
from tests.hardening.helpers import REPO, job_env
from tests.hardening.test_s3_versions import SHARD, _read_all
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.azure, pytest.mark.slow]


def _versions(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m jobs.versions`` in a process of its own (the environment names the proxy)."""
    return subprocess.run(
        [sys.executable, "-m", "jobs.versions", *args],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_shard_job_on_azure_copies_nothing_and_versions_lists_and_removes_old_versions(
    az_container: str, az_fault_proxy: FaultProxy, local_engine, tmp_path: Path
):
    proxy = az_fault_proxy
    local = tmp_path / "lake"
    write_lake(local, {"cat": 9, "dog": 8, "fox": 7})
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(
                f"{az_container}/raw/{p.relative_to(local).as_posix()}", p.read_bytes()
            )
    out = f"{az_container}/datasets/pets"
    manifest_job.run(
        ManifestConfig(input=f"{az_container}/raw", output=out, split_method="stratified", seed=7),
        local_engine,
    )
    proxy.reset(mode="pass")
    first = shard_job.run(ShardConfig(dataset=out, **SHARD), local_engine)
    second = shard_job.run(ShardConfig(dataset=out, overwrite=True, **SHARD), local_engine)
    assert proxy.log, "the proxy saw no request: the jobs did not go through it"
    assert [r for r in proxy.log if r.copy_source is not None] == []
    v1, v2 = shard_version(first), shard_version(second)
    assert v1 is not None and v2 is not None and v1 != v2
    _read_all(out, first)  # a reader holding the old dataset.json still reads whole shards
    check_dataset(out)

    listed = _versions("list", "--dataset", out)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()] == [[v1, "complete"], [v2, "current"]]
    refused = _versions("remove", "--dataset", out, "--version", v2)
    assert refused.returncode == 2 and "is the current version" in refused.stderr
    removed = _versions("remove", "--dataset", out, "--keep", "1")
    assert removed.returncode == 0 and removed.stdout.startswith(f"removed {v1}  complete"), removed
    assert [v.name for v in list_versions(out)] == [v2]
    fs, path = storage.filesystem(out)
    assert not fs.find(f"{path}/shards/v={v1}")
    check_dataset(out)
    with ShardLoader(out, channel="train", batch_size=4, seed=1) as loader:
        assert sum(len(y) for _, y in loader) == second.channels["train"].rows
