"""``python -m jobs.build``: both jobs in one command on one engine, writing the dataset the two
commands write, its options checked before any work and the dataset locked between the jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs import build
from lakeshard import storage
from tests.helpers.lake import bad_objects, write_lake
from tests.jobs.engines.compare import assert_same_dataset

REPO = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, "--engine", "local", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture()
def lake(tmp_path: Path) -> Path:
    """Two classes of small JPEGs, an object the manifest job rejects and one the shard job rejects."""
    root = tmp_path / "raw"
    write_lake(root, {"cat": 14, "dog": 11}, size=(60, 44), fmt="JPEG")
    bad = bad_objects()
    (root / "cat" / "notes.jpg").write_bytes(bad["cls_a/bad_text.jpg"])
    (root / "dog" / "broken.jpg").write_bytes(bad["cls_a/bad_truncated.jpg"])
    return root


def test_one_command_writes_the_dataset_the_two_jobs_write(lake: Path, tmp_path: Path) -> None:
    options = ["--seed", "11", "--max-reject-fraction", "0.2", "--split-method", "stratified"]
    images = ["--num-shards", "2", "--image-size", "24", "--remainder", "pad"]
    one, two = tmp_path / "one", tmp_path / "two"
    done = _run("jobs.build", "--input", str(lake), "--output", str(one), *options, *images)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("manifest: 27 listed, 26 accepted, 1 rejected, 2 classes"), done.stdout
    assert lines[1].startswith("shards: ") and ", 1 rejected, version " in lines[1], done.stdout
    # The local engine is started once for both jobs.
    assert done.stderr.count("local engine: ") == 1, done.stderr[-3000:]
    for module, args in (
        ("jobs.manifest", ["--input", str(lake), "--output", str(two), *options]),
        ("jobs.shard", ["--dataset", str(two), *images]),
    ):
        proc = _run(module, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    info = assert_same_dataset(storage.normalize(str(two)), storage.normalize(str(one)))
    assert info.counts.shard_rejects == 1 and info.engine == "local"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-shards", "0"], "--num-shards (command line): must be a positive integer, got 0"),
        (["--quality", "101"], "--quality (command line)"),
        (["--split", "train=0.5,test=0.2"], "add up to 1"),
        (["--channels", "train,holdout"], "--channels names ['holdout']"),
        (["--base", "{tmp}/nothing-here"], "--base"),
    ],
)
def test_a_bad_option_of_either_job_is_named_before_the_lake_is_read(
    lake: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "ds"
    proc = _run(
        "jobs.build", "--input", str(lake), "--output", str(out), *(a.format(tmp=tmp_path) for a in args)
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("jobs/build.py: error: ") and message in proc.stderr, proc.stderr
    assert "local engine" not in proc.stderr  # refused before the engine started
    assert not (out / "manifests").exists()


@pytest.mark.parametrize("flag", ["--dataset", "--plan-only"])
def test_the_shard_jobs_own_options_this_command_sets_are_not_taken(
    lake: Path, tmp_path: Path, flag: str
) -> None:
    proc = _run("jobs.build", "--input", str(lake), "--output", str(tmp_path / "ds"), flag, str(tmp_path))
    assert proc.returncode == 2 and f"unrecognized arguments: {flag}" in proc.stderr, proc.stderr


def test_the_dataset_is_locked_from_the_first_check_to_the_commit(lake: Path, tmp_path: Path) -> None:
    """While the command holds the dataset (its ``prepare`` entered: the lock is taken before
    the manifest job starts and released after the shard job), a shard job started by another
    process is refused in one line naming the build."""
    out = tmp_path / "ds"
    cfg = build.BuildConfig(input=str(lake), output=str(out), engine="local")
    with build.prepare(cfg):
        proc = _run("jobs.shard", "--dataset", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "build job is writing it since" in proc.stderr, proc.stderr
    assert _run("jobs.shard", "--dataset", str(out)).stderr.count("no complete manifest") == 1  # released


def test_its_options_come_from_a_yaml_file_naming_the_file_in_errors(lake: Path, tmp_path: Path) -> None:
    conf = tmp_path / "build.yaml"
    conf.write_text("num_shards: 3\nimage_size: 20\nsplit: {train: 1.0}\nmin_per_class: 2\nnum_shard: 2\n")
    proc = _run("jobs.build", "--conf", str(conf), "--input", str(lake), "--output", str(tmp_path / "ds"))
    assert proc.returncode == 2 and "num_shard" in proc.stderr and str(conf) in proc.stderr, proc.stderr
    conf.write_text("num_shards: 3\nimage_size: 20\nsplit: {train: 1.0}\nmax_reject_fraction: 0.2\n")
    proc = _run("jobs.build", "--conf", str(conf), "--input", str(lake), "--output", str(tmp_path / "ds"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train=8×3" in proc.stdout, proc.stdout
