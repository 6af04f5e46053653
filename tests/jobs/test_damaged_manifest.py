"""Issue 35: a damaged manifest part (``truncate -s 100 manifests/train/part-*.parquet``) is one
``error:`` line naming the file and what to do, wherever it is read: by the shard job's plan
tasks (on the workers: local and Spark), by the manifest job's ``--base`` join, by a reader
(``read_channel``, the report); no ``ArrowInvalid`` traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format.manifest_table import channel_parts, read_channel
from tests.helpers.lake import write_lake

SPLIT = "train=0.6,validation=0.2,test=0.2"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lake and its manifest (local engine), copied by each test before it damages it."""
    from jobs.common.engines.local_engine import LocalEngine

    root = tmp_path_factory.mktemp("damaged")
    write_lake(root / "lake", {"cat": 10, "dog": 8})
    manifest_job.run(
        ManifestConfig(
            input=str(root / "lake"), output=str(root / "ds"), split=SPLIT, engine="local", seed=1
        ),
        LocalEngine(workers=2),
    )
    return root


def _damage(ds: Path, table: str) -> str:
    """Truncate every part of ``table`` to 100 bytes; return the first part's URI."""
    parts = channel_parts(storage.normalize(str(ds)), table)
    for uri in parts:
        os.truncate(storage.filesystem(uri)[1], 100)
    return parts[0]


def _copy(built: Path, tmp_path: Path) -> Path:
    shutil.copytree(built / "ds", tmp_path / "ds")
    return tmp_path / "ds"


def _one_error_line(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ArrowInvalid" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err[-3000:]
    return lines[0]


def test_a_reader_names_the_damaged_part(built: Path, tmp_path: Path) -> None:
    ds = _copy(built, tmp_path)
    part = _damage(ds, "train")
    with pytest.raises(DatasetError) as err:
        read_channel(storage.normalize(str(ds)), "train")
    assert str(err.value).startswith(f"manifest part {part} is damaged (unreadable as Parquet: ")
    assert "rebuild the manifest" in str(err.value) and "\n" not in str(err.value)


def test_the_shard_job_names_a_damaged_channel_manifest(built: Path, tmp_path: Path, capsys) -> None:
    ds = _copy(built, tmp_path)
    part = _damage(ds, "train")
    assert (
        shard_job.main(["--engine", "local", "--dataset", str(ds), "--num-shards", "1", "--image-size", "16"])
        == 2
    )
    line = _one_error_line(capsys, "jobs/shard.py")
    assert f"manifest part {part} is damaged" in line and "rebuild the manifest (jobs/manifest.py" in line, (
        line
    )


def test_the_manifest_job_names_a_damaged_base(built: Path, tmp_path: Path, capsys) -> None:
    base = _copy(built, tmp_path)
    part = _damage(base, "all")
    code = manifest_job.main(
        [
            "--engine",
            "local",
            "--input",
            str(built / "lake"),
            "--output",
            str(tmp_path / "new"),
            "--base",
            str(base),
            "--split",
            SPLIT,
            "--seed",
            "1",
        ]
    )
    assert code == 2
    line = _one_error_line(capsys, "jobs/manifest.py")
    assert f"--base {storage.normalize(str(base))}: manifest part {part} is damaged" in line, line
    assert "build without --base" in line, line


@pytest.mark.slow
@pytest.mark.spark
def test_spark_workers_name_a_damaged_channel_manifest(built: Path, tmp_path: Path, spark_engine) -> None:
    """On Spark the plan task's error reaches the driver wrapped in Spark's; the job raises it
    as the DatasetError the task raised."""
    ds = _copy(built, tmp_path)
    part = _damage(ds, "validation")
    with pytest.raises(DatasetError) as err:
        shard_job.run(ShardConfig(dataset=str(ds), num_shards=1, image_size=16, engine="spark"), spark_engine)
    assert str(err.value).startswith(f"manifest part {part} is damaged (unreadable as Parquet: "), err.value
