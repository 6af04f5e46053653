"""The manifest and shard jobs end to end on the local engine (the engine-free core), and once
through ``spark-submit``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.staging import image_code
from lakeshard import storage
from lakeshard.errors import DatasetError, DatasetExistsError, RejectFractionError, SplitError
from lakeshard.format import ImageSpec, read_dataset_info, shard_rejects_uri, shard_relpath
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.lake import bad_objects, exif_rotated_jpeg, write_lake

REPO = Path(__file__).resolve().parents[2]


def _build(lake: Path | str, out: Path | str, engine, *, num_shards: int = 2, **shard_opts):
    m = manifest_job.run(
        ManifestConfig(
            input=str(lake), output=str(out), seed=7, split_method="stratified", max_reject_fraction=0.5
        ),
        engine,
    )
    s = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=num_shards, image_size=24, image_format="png", **shard_opts),
        engine,
    )
    return m, s


@pytest.fixture()
def messy_lake(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    write_lake(root, {"cat": 23, "dog": 17, "fox": 11})
    for key, data in bad_objects().items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "stray_at_top.png").write_bytes((root / "cat" / "img_00000.png").read_bytes())
    (root / "empty_class").mkdir()
    return root


def test_pipeline_accounts_for_every_object(messy_lake, tmp_path, local_engine):
    out = tmp_path / "ds"
    summary, info = _build(messy_lake, out, local_engine, num_shards=3)
    checked = check_dataset(str(out))
    assert checked == info  # the job returns the model it wrote, field for field

    all_rows = read_channel(str(out), "all")
    listed_on_disk = sorted(str(p.relative_to(messy_lake)) for p in messy_lake.rglob("*") if p.is_file())
    assert sorted(all_rows["key"].to_pylist()) == listed_on_disk

    reasons = dict(zip(all_rows["key"].to_pylist(), all_rows["reason"].to_pylist()))
    assert reasons["cls_a/bad_zero.jpg"].startswith("empty object")
    assert reasons["cls_a/bad_text.jpg"].startswith("not an image")
    assert reasons["cls_a/bad_notes.txt"].startswith("not an image")
    assert reasons["stray_at_top.png"].startswith("no label")
    shard_rejects = read_table(shard_rejects_uri(str(out)))
    bad_decodes = {
        k.rsplit("/", 1)[-1]: r
        for k, r in zip(shard_rejects["key"].to_pylist(), shard_rejects["reason"].to_pylist())
    }
    assert set(bad_decodes) == {"bad_truncated.jpg", "bad_corrupt.png"}
    assert all(r.startswith("cannot decode") for r in bad_decodes.values())
    assert "empty_class" not in json.loads((out / "labels.json").read_text())
    # Every ok_ object of the corpus reached a channel and, unless dropped, a shard.
    assert summary["counts"]["listed"] == len(listed_on_disk)
    in_shards = {u for c in info.channels for t in shard_tables(str(out), c, 3) for u in t["uri"].to_pylist()}
    dropped = {u for e in info.channels.values() for u in e.dropped}
    ok_keys = [k for k in listed_on_disk if "/ok" in k]
    missing = [k for k in ok_keys if f"file://{messy_lake / k}" not in in_shards | dropped]
    assert not missing and len(ok_keys) == 12


def test_exif_rotated_image_is_upright_in_the_shard(tmp_path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 12, "b": 12})
    (lake / "a" / "rotated.jpg").write_bytes(exif_rotated_jpeg())
    out = tmp_path / "ds"
    _, info = _build(lake, out, local_engine, remainder="pad")
    for channel in info.channels:
        for t in shard_tables(str(out), channel, 2):
            for uri, blob in zip(t["uri"].to_pylist(), t["image"].to_pylist()):
                if uri.endswith("rotated.jpg"):
                    arr = np.asarray(Image.open(io.BytesIO(blob)), dtype=float)
                    assert arr[:8].mean() > 200 and arr[-8:].mean() < 60
                    return
    raise AssertionError("rotated.jpg is in no shard")


def test_rerun_refuses_then_overwrite_gives_the_same_dataset(small_lake, tmp_path, local_engine):
    out = tmp_path / "ds"
    _, first = _build(small_lake, out, local_engine, num_shards=2)
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        manifest_job.run(ManifestConfig(input=str(small_lake), output=str(out)), local_engine)
    with pytest.raises(DatasetExistsError, match="--overwrite"):
        shard_job.run(ShardConfig(dataset=str(out), num_shards=2), local_engine)
    again = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=24, image_format="png", overwrite=True),
        local_engine,
    )
    assert replace(again, created_at="") == replace(
        first, created_at=""
    )  # same files, byte for byte (sha256s)


def test_interrupted_run_leaves_no_dataset_and_rerun_completes(small_lake, tmp_path, local_engine):
    clean = tmp_path / "clean"
    _, want = _build(small_lake, clean, local_engine)
    out = tmp_path / "ds"

    def killed_writer(path: Path) -> None:  # what a write killed before its rename leaves
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(storage.temp_sibling(str(path))).write_bytes(b"")

    killed_writer(out / "manifests" / "train" / "part-00000-of-00001.parquet")
    manifest_job.run(
        ManifestConfig(input=str(small_lake), output=str(out), seed=7, split_method="stratified"),
        local_engine,
    )
    assert not list(out.rglob("*.tmp-*"))
    # What a job killed mid-commit leaves: staged files, a half-moved shards folder, no dataset.json.
    shutil.copytree(clean / "shards", out / "_staging" / "shards-dead")
    half_moved = out / shard_relpath("train", 0, 2)
    half_moved.parent.mkdir(parents=True)
    shutil.copy(clean / shard_relpath("train", 0, 2), half_moved)
    killed_writer(out / "dataset.json")
    with pytest.raises(DatasetError, match="no complete dataset"):
        read_dataset_info(str(out))  # what every reader calls first
    got = shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=24, image_format="png"), local_engine
    )
    assert not (out / "_staging").exists()
    assert not list(out.rglob("*.tmp-*"))
    assert [e.shards for e in got.channels.values()] == [e.shards for e in want.channels.values()]


def test_min_per_class_fails_before_any_image_is_fetched(tmp_path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"big": 40, "tiny": 3, "small": 6})
    out = tmp_path / "ds"
    with pytest.raises(SplitError) as err:
        manifest_job.run(
            ManifestConfig(input=str(lake), output=str(out), min_per_class=2, split_method="stratified"),
            local_engine,
        )
    message = str(err.value)
    assert "'tiny' (train=3, validation=0, test=0)" in message
    assert "'small' (train=5, validation=1, test=0)" in message
    assert "'big'" not in message and "--split-method stratified" not in message
    assert not (out / "manifests" / "_manifest.json").exists()


def test_mostly_garbage_lake_fails_loudly(tmp_path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 5})
    for i in range(10):
        (lake / "a" / f"junk{i}.jpg").write_bytes(b"not an image at all")
    with pytest.raises(RejectFractionError, match=r"10 of 15 listed objects .* 10× not an image"):
        manifest_job.run(ManifestConfig(input=str(lake), output=str(tmp_path / "ds")), local_engine)


def test_pad_remainder_repeats_and_records(tmp_path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 21, "b": 10})
    out = tmp_path / "ds"
    _, info = _build(lake, out, local_engine, num_shards=4, remainder="pad")
    check_dataset(str(out))
    train = info.channels["train"]
    tables = shard_tables(str(out), "train", 4)
    pads = [u for t in tables for u, p in zip(t["uri"].to_pylist(), t["is_pad"].to_pylist()) if p]
    assert sorted(set(pads)) == sorted(train.padded)
    manifest_rows = read_channel(str(out), "train").num_rows
    assert manifest_rows % 4 != 0  # the case under test: a remainder to pad
    assert train.rows == 4 * train.rows_per_shard == len(pads) + manifest_rows


@pytest.mark.slow
@pytest.mark.spark
def test_spark_submit_runs_both_jobs(small_lake, tmp_path):
    out = tmp_path / "ds"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    submit = str(Path(sys.executable).parent / "spark-submit")
    # The manifest job keeps the daemon module and worker sockets the user chose; the shard job
    # gets the engine's.
    for conf, daemon, argv in (
        (
            [
                "--conf",
                "spark.python.daemon.module=pyspark.daemon",
                "--conf",
                "spark.python.unix.domain.socket.enabled=false",
            ],
            "pyspark.daemon, reached over TCP",
            [
                "jobs/manifest.py",
                "--input",
                str(small_lake),
                "--output",
                str(out),
                "--conf",
                "conf/manifest.yaml",
                "--split-method",
                "stratified",
            ],
        ),
        (
            [],
            "jobs.common.engines.spark_daemon, reached over Unix sockets",
            ["jobs/shard.py", "--dataset", str(out), "--num-shards", "2", "--image-size", "32"],
        ),
    ):
        proc = subprocess.run(
            [submit, "--master", "local[2]", "--driver-memory", "1g", *conf, *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # (spark-submit passes the Python driver's stderr to its own stdout)
        assert f"master local[2], Python workers started by {daemon}\n" in proc.stdout, proc.stdout[-3000:]
        # Not a terminal: no console progress bar redrawn into the log.
        assert "[Stage " not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    info = check_dataset(str(out))
    # code: the hash of jobs/common/images.py that made the images (what --base checks before reusing them)
    assert info.image == ImageSpec(
        size=32, format="jpeg", quality=90, resize="crop", max_pixels=89478485, code=image_code()
    )
    assert pc.sum(read_channel(str(out), "all")["size"]).as_py() > 0
    # A bad value exits non-zero and names the value.
    proc = subprocess.run(
        [submit, "--master", "local[1]", "jobs/shard.py", "--dataset", str(out), "--num-shards", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        proc.returncode == 2
        and "--num-shards (command line): must be a positive integer, got 0" in proc.stdout + proc.stderr
    )


def _truncated_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()[:400]  # starts like a JPEG (the manifest accepts it), cannot be decoded


def test_a_rejected_image_is_repaired_in_its_shard_without_decoding_twice(tmp_path, local_engine):
    # 41 + 40 rows into 4 shards: the first plan keeps 80 and holds one row of the bigger class
    # "a" spare. The truncated image (in "a") fails to decode; the repair fills its hole with
    # that spare, so exactly one shard file changes and no image is decoded a second time.
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 40, "b": 40})
    (lake / "a" / "broken.jpg").write_bytes(_truncated_jpeg())
    out = tmp_path / "ds"
    manifest_job.run(ManifestConfig(input=str(lake), output=str(out), split="train=1"), local_engine)
    info = shard_job.run(ShardConfig(dataset=str(out), num_shards=4, image_size=24), local_engine)
    check_dataset(str(out))
    rejects = read_table(shard_rejects_uri(str(out)))
    assert rejects["key"].to_pylist() == ["a/broken.jpg"]
    assert info.channels["train"].rows_per_shard == 20 and info.counts.dropped == 0
    assert info.build.preprocessed == 81
    assert info.build.assembled_shards == 1

    # Segmenting the shards (many small tasks, then assembly) writes byte-identical shards.
    segmented = tmp_path / "segmented"
    shutil.copytree(out / "manifests", segmented / "manifests")
    shutil.copy(out / "labels.json", segmented / "labels.json")
    info2 = shard_job.run(
        ShardConfig(dataset=str(segmented), num_shards=4, image_size=24, partitions=16), local_engine
    )
    assert info2.build.assembled_shards == 4 and info2.build.preprocessed == 81
    assert [s.sha256 for s in info2.channels["train"].shards] == [
        s.sha256 for s in info.channels["train"].shards
    ]
