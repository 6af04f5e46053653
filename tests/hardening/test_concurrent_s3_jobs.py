"""Two shard builds of one S3 dataset at once (real ``python -m jobs.shard`` processes against a
real moto server over HTTP): the S3 lock (a conditionally created ``_lock`` object) lets one
build run and refuses the other at once with one ``error:`` line naming it; no traceback, and the
committed dataset is whole after every round (every shard ``dataset.json`` names is there). The
manifest job meets the same lock."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.format import read_dataset_info
from lakeshard.locks import LOCK_NAME
from tests.hardening.helpers import job_env, local_job, one_error_line, run_local_job
from tests.helpers.lake import write_lake
from tests.helpers.locks import held_elsewhere

pytestmark = [pytest.mark.slow, pytest.mark.s3]

_ROUNDS = 8


def _shards_there(ds: str) -> None:
    info = read_dataset_info(ds)
    for name, channel in info.channels.items():
        for shard in channel.shards:
            assert storage.exists(storage.join(ds, shard.path)), f"{name}: {shard.path} was removed"


def _manifest(lake: Path, ds: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_local_job(
        "jobs.manifest", "--input", str(lake), "--output", ds, "--split", "train=1.0", *extra
    )


def test_two_s3_builds_at_once_one_is_refused_in_one_line_and_the_dataset_stays_whole(
    tmp_path: Path, s3_bucket: str
):
    lake = tmp_path / "raw"
    write_lake(lake, {"cat": 6, "dog": 6}, size=(12, 10))
    ds = f"{s3_bucket}/ds"
    made = _manifest(lake, ds)
    assert made.returncode == 0, made.stderr
    refused = 0
    for round_ in range(_ROUNDS):
        procs = [
            subprocess.Popen(
                local_job(
                    "jobs.shard",
                    "--dataset",
                    ds,
                    "--num-shards",
                    "2",
                    "--image-size",
                    str(size),
                    "--overwrite",
                ),
                env=job_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for size in (8, 9 + round_ % 3)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            if proc.returncode == 0:
                assert "Traceback" not in err and "error:" not in err, f"round {round_}: {err}"
                continue
            refused += 1
            line = one_error_line(done, "jobs/shard.py")
            assert line.startswith(f"jobs/shard.py: error: {ds} is busy: shard job is writing it since "), (
                line
            )
        assert any(p.returncode == 0 for p in procs)
        _shards_there(ds)
        assert not storage.exists(f"{ds}/{LOCK_NAME}")  # released by its holder
    # Both builds start together and a build lasts seconds, while the lock is taken before its
    # engine starts: the second is refused in (nearly) every round, not merely in one of 8.
    assert refused >= 1


def test_the_manifest_job_on_s3_is_refused_while_another_job_holds_the_dataset(
    tmp_path: Path, s3_bucket: str
):
    lake = tmp_path / "raw"
    write_lake(lake, {"cat": 2, "dog": 2}, size=(12, 10))
    ds = f"{s3_bucket}/ds"
    with held_elsewhere(ds, exclusive=True) as holder:
        line = one_error_line(_manifest(lake, ds, "--overwrite"), "jobs/manifest.py")
        assert line.startswith(f"jobs/manifest.py: error: {ds} is busy: test job is writing it since "), line
        assert f"(pid {holder.pid} on " in line
    assert not storage.exists(f"{ds}/manifests")  # refused before it wrote anything
    done = _manifest(lake, ds, "--overwrite")
    assert done.returncode == 0, done.stderr  # the holder ended: its lock is gone
