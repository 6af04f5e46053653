"""Kill -9 each job at seeded random points (and at each step of the shard job's commit), then
run it again: a reader never sees a partial dataset, and the final dataset equals an
uninterrupted run's.

Attempts are chained: each attempt runs on whatever the previous killed one left behind (the
jobs run with ``--overwrite``, so an attempt after a completed one is an overwrite, itself
killable). Kill delays are uniform in ``[0, D]``, ``D`` being a clean run's measured duration.
The whole process group dies (the Python driver, Spark's JVM and its Python workers); with
Dask, the killed client's tasks may still run on the shared worker while the next attempt
starts, as they would on a real cluster.
"""

from __future__ import annotations

import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format import manifest_marker_uri, read_dataset_info
from tests.hardening.helpers import dataset_digest, job_env, manifest_digest, run_until
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: Kills per job and engine: every Spark attempt pays a JVM's start, so Spark's loops kill fewer
#: times (the points are seeded and uniform over a run either way).
KILLS = {"dask": 10, "spark": 5}
SEED = 20_240_611
MANIFEST_ARGS = ["--split-method", "stratified", "--seed", "7", "--overwrite"]
SHARD_ARGS = [
    "--num-shards",
    "3",
    "--image-size",
    "24",
    "--image-format",
    "png",
    "--remainder",
    "pad",
    "--overwrite",
]
#: local[1], no UI, and a JVM tuned for short runs (C1 only): the kills pay Spark's start-up.
SPARK_ENV = {
    "PYSPARK_SUBMIT_ARGS": "--master local[1] --conf spark.ui.enabled=false "
    "--driver-java-options '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' pyspark-shell"
}


def _manifest_cmd(engine: list[str], lake: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.manifest",
        *engine,
        "--input",
        str(lake),
        "--output",
        str(out),
        *MANIFEST_ARGS,
    ]


def _shard_cmd(engine: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "jobs.shard", *engine, "--dataset", str(out), *SHARD_ARGS]


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _reader_check(out: Path, *, dataset: dict[str, Any] | None, manifest: dict[str, Any]) -> str:
    """What a reader sees now: nothing (``DatasetError``) or a complete dataset equal to the
    reference. The manifest's own marker gates its files the same way. Returns which."""
    root = str(out)
    if storage.exists(manifest_marker_uri(root)):
        assert manifest_digest(root) == manifest, f"{root}: manifest marker present, manifests differ"
    try:
        read_dataset_info(root)
    except DatasetError:
        return "none"
    assert dataset is not None, f"{root}: the manifest job alone made a dataset.json appear"
    check_dataset(root, decode_images=False)
    assert dataset_digest(root) == dataset, f"{root}: a visible dataset differs from the reference"
    return "complete"


def _kill_loop(
    cmd: list[str],
    env: dict[str, str],
    out: Path,
    log: Path,
    duration: float,
    rng: random.Random,
    *,
    kills_wanted: int,
    dataset: dict[str, Any] | None,
    manifest: dict[str, Any],
) -> list[tuple[float, Any, str]]:
    history: list[tuple[float, Any, str]] = []
    kills = 0
    while kills < kills_wanted:
        assert len(history) < 3 * kills_wanted, f"only {kills} kills in {len(history)} attempts: {history}"
        delay = rng.uniform(0, duration)
        rc, _ = run_until(cmd, env=env, log=log, kill_after=delay)
        if rc is None:
            kills += 1
        else:
            assert rc == 0, f"attempt exited {rc}:\n{_tail(log)}"
        history.append((round(delay, 2), rc, _reader_check(out, dataset=dataset, manifest=manifest)))
    rc, _ = run_until(cmd, env=env, log=log, kill_after=None)
    assert rc == 0, f"the rerun after {kills} kills exited {rc}:\n{_tail(log)}\nattempts: {history}"
    return history


def _reference(
    engine: list[str], env: dict[str, str], lake: Path, ref: Path, log: Path
) -> tuple[float, float]:
    rc, dm = run_until(_manifest_cmd(engine, lake, ref), env=env, log=log, kill_after=None)
    assert rc == 0, _tail(log)
    rc, ds = run_until(_shard_cmd(engine, ref), env=env, log=log, kill_after=None)
    assert rc == 0, _tail(log)
    check_dataset(str(ref))
    return dm, ds


def _with_manifest_of(ref: Path, out: Path) -> Path:
    """``out`` holding ``ref``'s manifest only (what the shard job starts from)."""
    shutil.copytree(ref / "manifests", out / "manifests")
    shutil.copy(ref / "labels.json", out / "labels.json")
    return out


def _both_loops(engine: list[str], env: dict[str, str], tmp_path: Path, *, parallel: bool) -> dict[str, Any]:
    kills = KILLS[engine[1]]
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 30, "b": 24, "c": 18})
    ref = tmp_path / "ref"
    dm, ds = _reference(engine, env, lake, ref, tmp_path / "reference.log")
    want_dataset, want_manifest = dataset_digest(str(ref)), manifest_digest(str(ref))
    m_out, s_out = tmp_path / "m", _with_manifest_of(ref, tmp_path / "s")

    def manifest_loop():
        return _kill_loop(
            _manifest_cmd(engine, lake, m_out),
            env,
            m_out,
            tmp_path / "manifest.log",
            dm,
            random.Random(SEED),
            kills_wanted=kills,
            dataset=None,
            manifest=want_manifest,
        )

    def shard_loop():
        return _kill_loop(
            _shard_cmd(engine, s_out),
            env,
            s_out,
            tmp_path / "shard.log",
            ds,
            random.Random(SEED + 1),
            kills_wanted=kills,
            dataset=want_dataset,
            manifest=want_manifest,
        )

    if parallel:  # two process trees at once: the wall time of one loop, not two
        with ThreadPoolExecutor(2) as pool:
            fm, fs = pool.submit(manifest_loop), pool.submit(shard_loop)
            histories = {"manifest": fm.result(), "shard": fs.result()}
    else:
        histories = {"manifest": manifest_loop(), "shard": shard_loop()}
    assert manifest_digest(str(m_out)) == want_manifest
    check_dataset(str(s_out))
    assert dataset_digest(str(s_out)) == want_dataset
    assert not (s_out / "_staging").exists()
    return histories


@pytest.mark.dask
@pytest.mark.timeout(600)
def test_dask_jobs_killed_at_random_points_rerun_to_the_same_dataset(dask_cluster, tmp_path: Path):
    engine = ["--engine", "dask", "--scheduler", dask_cluster.address]
    histories = _both_loops(engine, job_env(), tmp_path, parallel=True)
    for job, history in histories.items():
        assert sum(rc is None for _, rc, _ in history) >= KILLS["dask"], (job, history)


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_spark_jobs_killed_at_random_points_rerun_to_the_same_dataset(tmp_path: Path):
    histories = _both_loops(["--engine", "spark"], job_env(**SPARK_ENV), tmp_path, parallel=True)
    for job, history in histories.items():
        assert sum(rc is None for _, rc, _ in history) >= KILLS["spark"], (job, history)


#: The shard job's commit, step by step: (storage function, URI suffix, before/after).
COMMIT_POINTS = [
    ("remove", "/dataset.json", "after"),  # the commit invalidated the old dataset
    ("replace", "/rejects/shards.parquet", "after"),  # the workers' shard rejects in place, no dataset.json
    ("remove", "/shards", "before"),  # staging complete, old shards still in place
    ("remove", "/shards", "after"),  # old shards gone, new ones still staged
    ("move", "", "after"),  # new shards in place, staging root left over
    ("remove", "/_staging", "after"),  # staging cleaned, no dataset.json
    ("write_json_atomic", "/dataset.json", "before"),
]


@pytest.mark.dask
@pytest.mark.timeout(600)
def test_shard_job_killed_at_each_commit_step_reruns_to_the_same_dataset(dask_cluster, tmp_path: Path):
    engine = ["--engine", "dask", "--scheduler", dask_cluster.address]
    env = job_env()
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 30, "b": 24, "c": 18})
    ref = tmp_path / "ref"
    _reference(engine, env, lake, ref, tmp_path / "reference.log")
    want_dataset, want_manifest = dataset_digest(str(ref)), manifest_digest(str(ref))
    out = tmp_path / "ds"
    shutil.copytree(ref, out)  # a complete dataset: every attempt is an overwrite
    log = tmp_path / "commit.log"
    died = []
    for func, suffix, when in COMMIT_POINTS:
        cmd = [
            sys.executable,
            "-m",
            "tests.hardening.killpoint",
            f"{func}:{suffix}:{when}",
            "jobs.shard",
            *engine,
            "--dataset",
            str(out),
            *SHARD_ARGS,
        ]
        rc, _ = run_until(cmd, env=env, log=log, kill_after=None)
        assert rc == 137, f"{func}:{suffix}:{when} exited {rc}, expected to die there:\n{_tail(log)}"
        died.append((func, suffix, when))
        assert _reader_check(out, dataset=want_dataset, manifest=want_manifest) == "none", (
            func,
            suffix,
            when,
        )
    rc, _ = run_until(_shard_cmd(engine, out), env=env, log=log, kill_after=None)
    assert rc == 0, _tail(log)
    check_dataset(str(out))
    assert dataset_digest(str(out)) == want_dataset
    assert not (out / "_staging").exists()
    assert len(died) == len(COMMIT_POINTS)
