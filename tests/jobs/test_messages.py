"""Issue 35, messages: an ``--exclude`` that skips everything says so with counts; an invalid
option names the flag the user typed and where its value came from (the command line or the
``--conf`` file), for every job and the trainer; ``jobs.versions`` on a dataset or bucket that
does not exist is an error, not an empty list."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs import versions
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.errors import ConfigError
from lakeshard.settings import resolve
from loaders.train.config import parse_args as train_args
from tests.helpers.lake import write_lake


def _manifest_main(lake, out, *extra: str) -> int:
    """``jobs.manifest`` on the local engine, as a user types it."""
    return manifest_job.main(["--engine", "local", "--input", str(lake), "--output", str(out), *extra])


def _last_error(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith(f"{prog}: error: "), lines[-5:]
    return lines[-1][len(f"{prog}: error: ") :]


# -- --exclude -------------------------------------------------------------------------------


def test_an_exclude_that_skips_everything_says_so_with_counts(tmp_path: Path, capsys) -> None:
    write_lake(tmp_path / "lake", {"cat": 4, "dog": 3})
    (tmp_path / "lake" / "cat" / ".DS_Store").write_bytes(b"x")
    code = _manifest_main(str(tmp_path / "lake"), str(tmp_path / "ds"), "--exclude", "*.png")
    assert code == 2
    err = _last_error(capsys, "jobs/manifest.py")
    assert "no objects found" not in err
    assert f"all 8 objects found under file://{tmp_path}/lake were skipped" in err, err
    assert "7 excluded by --exclude '*.png'" in err and "1 hidden" in err, err


def test_an_exclude_that_skips_every_object_of_a_labels_table_lake(tmp_path: Path, capsys) -> None:
    write_lake(tmp_path / "lake", {"a": 3}, nested=False)
    table = tmp_path / "labels.csv"
    table.write_text("key,label\n" + "".join(f"a/img_{i:05d}.png,x{i}\n" for i in range(3)))
    code = _manifest_main(tmp_path / "lake", tmp_path / "ds", "--labels", str(table), "--exclude", "*")
    assert code == 2
    err = _last_error(capsys, "jobs/manifest.py")
    assert "all 3 objects found under" in err and "3 excluded by --exclude '*'" in err, err


# -- options named as typed --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-image-pixels", "0"], "--max-image-pixels (command line): must be positive, got 0"),
        (["--num-shards", "0"], "--num-shards (command line): must be a positive integer, got 0"),
        (["--image-size", "4"], "--image-size (command line): must be an integer in [8, 8192], got 4"),
        (["--quality", "101"], "--quality (command line): must be in [1, 100], got 101"),
        (["--row-group-size", "0"], "--row-group-size (command line): must be positive, got 0"),
        (["--threads", "-1"], "--threads (command line): must be a non-negative integer, got -1"),
    ],
)
def test_shard_options_are_named_as_typed(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    assert shard_job.main(["--engine", "local", "--dataset", str(tmp_path / "ds"), *argv]) == 2
    err = _last_error(capsys, "jobs/shard.py")
    assert err == message, err


def test_a_bad_value_from_the_conf_file_names_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "shard.yaml"
    conf.write_text("dataset: /d\nmax_image_pixels: -5\n")
    with pytest.raises(ConfigError) as err:
        resolve(ShardConfig, shard_job.parser().parse_args(["--conf", str(conf)]))
    assert str(err.value) == f"--max-image-pixels (--conf {conf}): must be positive, got -5"
    conf.write_text("input: /a\noutput: /b\nrows_per_part: 0\n")
    with pytest.raises(ConfigError) as err:
        resolve(ManifestConfig, manifest_job.parser().parse_args(["--conf", str(conf)]))
    assert str(err.value) == f"--rows-per-part (--conf {conf}): must be a positive integer, got 0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-per-class", "-1"], "--min-per-class (command line): must be a non-negative integer, got -1"),
        (
            ["--max-reject-fraction", "1.5"],
            "--max-reject-fraction (command line): must be in [0, 1], got 1.5",
        ),
        (["--label-depth", "0"], "--label-depth (command line): must be a positive integer, got 0"),
    ],
)
def test_manifest_options_are_named_as_typed(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    assert _manifest_main(str(tmp_path), str(tmp_path / "o"), *argv) == 2
    assert _last_error(capsys, "jobs/manifest.py") == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "--epochs (command line): must be a positive integer, got 0"),
        (["--gamma", "2"], "--gamma (command line): must be in (0, 1], got 2.0"),
        (["--lr", "0"], "--lr (command line): must be positive, got 0.0"),
        (["--cache-limit", "lots"], "--cache-limit (command line): a size must look like"),
    ],
)
def test_trainer_options_are_named_as_typed(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        train_args(["--dataset", "/d", *argv])
    assert str(err.value).startswith(message), err.value


# -- jobs.versions -------------------------------------------------------------------------------


def test_versions_of_a_missing_dataset_is_an_error(tmp_path: Path, capsys) -> None:
    assert versions.main(["list", "--dataset", str(tmp_path / "nothing")]) == 2
    err = _last_error(capsys, "jobs/versions.py")
    assert err == f"--dataset file://{tmp_path}/nothing does not exist", err
    assert versions.main(["remove", "--dataset", str(tmp_path / "nothing"), "--keep", "1"]) == 2
    assert "does not exist" in _last_error(capsys, "jobs/versions.py")


@pytest.mark.s3
def test_versions_of_a_missing_bucket_or_dataset_on_s3_is_an_error(s3_bucket: str, capsys) -> None:
    assert versions.main(["list", "--dataset", "s3://nobucket-here/x"]) == 2
    err = _last_error(capsys, "jobs/versions.py")
    assert "bucket 'nobucket-here' does not exist" in err, err
    assert versions.main(["list", "--dataset", f"{s3_bucket}/no-dataset"]) == 2
    assert _last_error(capsys, "jobs/versions.py") == f"--dataset {s3_bucket}/no-dataset does not exist"
