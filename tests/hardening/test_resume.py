"""A shard job killed while it preprocesses resumes on the rerun: the segments it finished are
reused (not decoded again), and the dataset equals an uninterrupted run's; ``--no-resume``
starts over."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from lakeshard import storage
from tests.hardening.helpers import dataset_digest, job_env, run_until
from tests.hardening.test_kill_rerun import SPARK_ENV
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHARD_ARGS = [
    "--num-shards",
    "3",
    "--image-size",
    "24",
    "--image-format",
    "png",
    "--remainder",
    "pad",
    "--partitions",
    "12",
]


def _receipts(out: Path) -> list[Path]:
    return sorted(out.glob("_staging/shards-*/_runs/receipts/**/*.parquet"))


def _build(out: Path) -> dict:
    return json.loads((out / "dataset.json").read_text())["build"]


@pytest.mark.parametrize(
    "engine", [pytest.param("dask", marks=pytest.mark.dask), pytest.param("spark", marks=pytest.mark.spark)]
)
@pytest.mark.timeout(600)
def test_a_killed_shard_job_reuses_the_segments_it_finished(engine, request, tmp_path: Path):
    if engine == "dask":
        cluster = request.getfixturevalue("dask_cluster")
        flags, env = ["--engine", "dask", "--scheduler", cluster.address], job_env()
    else:
        flags, env = ["--engine", "spark"], job_env(**SPARK_ENV)
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 60, "b": 45, "c": 36}, size=(320, 240))
    ref = tmp_path / "ref"
    log = tmp_path / "jobs.log"
    # The manifest and the uninterrupted reference by the local engine (every engine builds the
    # same dataset, tests/jobs/engines): the engine under test runs the killed and resumed jobs.
    local = ["--engine", "local"]
    manifest = [
        sys.executable,
        "-m",
        "jobs.manifest",
        *local,
        "--input",
        str(lake),
        "--output",
        str(ref),
        "--split-method",
        "stratified",
        "--seed",
        "7",
    ]
    assert run_until(manifest, env=env, log=log, kill_after=None)[0] == 0, log.read_text()[-3000:]
    out = tmp_path / "ds"
    shutil.copytree(ref, out)
    shard = [sys.executable, "-m", "jobs.shard", *flags, *SHARD_ARGS]
    reference = [sys.executable, "-m", "jobs.shard", *local, *SHARD_ARGS, "--dataset", str(ref)]
    assert run_until(reference, env=env, log=log, kill_after=None)[0] == 0, log.read_text()[-3000:]
    want = dataset_digest(str(ref))
    total = _build(ref)["preprocessed"]
    assert _build(ref)["reused_segments"] == 0

    # Killed as soon as a first segment is finished (its receipt written), long before the end.
    rc, _ = run_until(
        [*shard, "--dataset", str(out)],
        env=env,
        log=log,
        kill_after=240,
        kill_when=lambda: len(_receipts(out)) >= 1,
    )
    assert rc is None, f"the job ended (rc={rc}) before it could be killed:\n{log.read_text()[-3000:]}"
    finished = len(_receipts(out))
    assert 1 <= finished < 12 + 3 and not (out / "dataset.json").exists()
    # A writer killed between opening its temporary file and renaming it leaves the temporary in
    # the staging folder the rerun resumes (as a kill in test_kill_rerun once did): it must not
    # be moved into the dataset with the shards.
    (staging,) = out.glob("_staging/shards-*")
    (staging / "train").mkdir(exist_ok=True)
    Path(storage.temp_sibling(str(staging / "train" / "part-00000-of-00003.parquet"))).write_bytes(b"")

    assert run_until([*shard, "--dataset", str(out)], env=env, log=log, kill_after=None)[0] == 0, (
        log.read_text()[-3000:]
    )
    build = _build(out)
    assert build["reused_segments"] >= finished  # (a killed Dask client's running tasks may finish later)
    assert 0 <= build["preprocessed"] < total
    assert "resuming:" in log.read_text()
    check_dataset(str(out))
    assert dataset_digest(str(out)) == want
    assert not (out / "_staging").exists()
    assert not list(out.rglob("*.tmp-*"))

    if engine == "spark":
        return  # --no-resume is the driver's choice of staging folder, the same for every engine
    # --no-resume: the same kill, then a rerun that decodes everything again.
    rc, _ = run_until(
        [*shard, "--dataset", str(out), "--overwrite"],
        env=env,
        log=log,
        kill_after=240,
        kill_when=lambda: len(_receipts(out)) >= 1,
    )
    assert rc is None, log.read_text()[-3000:]
    assert (
        run_until(
            [*shard, "--dataset", str(out), "--overwrite", "--no-resume"], env=env, log=log, kill_after=None
        )[0]
        == 0
    ), log.read_text()[-3000:]
    assert _build(out)["reused_segments"] == 0 and _build(out)["preprocessed"] == total
    assert dataset_digest(str(out)) == want
