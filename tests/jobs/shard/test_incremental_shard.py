"""Incremental shard builds (``--base``): a grown lake built on a previous dataset equals a
build from scratch, row for row and byte for byte, and decodes only the new and changed
objects (and the base's rows it does not hold: those it dropped); a base that cannot be
reused is refused, naming it and what differs. Every engine, local files and S3."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import DatasetError, ShardError
from lakeshard.format import DatasetInfo, labels_uri, read_manifest_info, write_manifest_info
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.incremental import CountingEngine
from tests.helpers.lake import encode, make_image, write_lake

#: A lake of 48 small images in three classes; grown by 5 (about 10%), 3 removed, 1 changed.
_COUNTS = {"cat": 20, "dog": 16, "fox": 12}
_MANIFEST = {"split": "train=0.7,validation=0.3", "seed": 3}


def _build(engine: Any, lake: str, out: str, *, base: str | None = None, **shard: Any) -> DatasetInfo:
    manifest_job.run(
        ManifestConfig(input=lake, output=out, engine=engine.name, base=base, **_MANIFEST), engine
    )
    opts = {"num_shards": 2, "image_size": 16, **shard}
    return shard_job.run(ShardConfig(dataset=out, engine=engine.name, base=base, **opts), engine)


def _grow_local(lake: Path) -> tuple[set[str], set[str]]:
    """Add 5 objects, remove 3 and rewrite 1 (new bytes, so a new ETag); return the keys of the
    added and changed objects, and of the removed ones."""
    keys = sorted(p.relative_to(lake).as_posix() for p in lake.rglob("*.png"))
    added = set()
    for i in range(5):
        key = f"{sorted(_COUNTS)[i % 3]}/new_{i:02d}.png"
        (lake / key).write_bytes(encode(make_image(5000 + i), "PNG"))
        added.add(key)
    removed = {keys[2], keys[21], keys[40]}
    for key in removed:
        (lake / key).unlink()
    changed = keys[10]
    (lake / changed).write_bytes(encode(make_image(9999), "PNG"))
    return added | {changed}, removed


def _compare(b: str, c: str, info_b: DatasetInfo, info_c: DatasetInfo) -> None:
    """B and C are the same dataset: labels, every manifest table, every shard row (every
    column, the image bytes included) and every shard file's bytes."""
    assert storage.read_bytes(labels_uri(b)) == storage.read_bytes(labels_uri(c))
    for table in [*info_c.channels, "all", "rejects"]:
        assert read_channel(b, table).equals(read_channel(c, table)), table
    assert info_b.dataset_version == info_c.dataset_version
    assert info_b.counts == info_c.counts
    for channel, entry in info_c.channels.items():
        tb, tc = shard_tables(b, channel, info_c.num_shards), shard_tables(c, channel, info_c.num_shards)
        for i, (x, y) in enumerate(zip(tb, tc, strict=True)):
            assert x.num_rows == y.num_rows > 0
            assert x.equals(y), (channel, i)
            assert x["image"].to_pylist() == y["image"].to_pylist()
        assert [s.sha256 for s in info_b.channels[channel].shards] == [s.sha256 for s in entry.shards]
        assert info_b.channels[channel].dropped == entry.dropped
        assert info_b.channels[channel].padded == entry.padded
    assert read_table(storage.join(b, info_b.rejects_path)).equals(
        read_table(storage.join(c, info_c.rejects_path))
    )


def _decoded_in_b(info_a: DatasetInfo, fresh: set[str], removed: set[str], lake: str) -> int:
    """Rows B must decode (the drop policy, no pads): the new and changed objects, and the rows A
    dropped (A's shards do not hold them) that are still in the lake unchanged; every other row
    of B's manifest is in A's shards."""
    dropped = {u[len(lake) + 1 :] for e in info_a.channels.values() for u in e.dropped}
    return len(fresh) + len(dropped - removed - fresh)


def _check_incremental(info_a: DatasetInfo, info_b: DatasetInfo, info_c: DatasetInfo, a: str) -> None:
    assert info_b.build.base is not None
    assert (info_b.build.base.root, info_b.build.base.dataset_version) == (
        storage.normalize(a),
        info_a.dataset_version,
    )
    assert info_c.build.base is None and info_c.build.reused == 0
    # Every row preprocessed from scratch in C was either decoded or taken from A in B.
    assert info_b.build.reused + info_b.build.preprocessed == info_c.build.preprocessed
    assert info_b.build.reused > 0


@pytest.mark.parametrize(
    "engine_name",
    [
        "local",
        pytest.param("spark", marks=[pytest.mark.spark, pytest.mark.slow]),
        pytest.param("dask", marks=pytest.mark.dask),
    ],
)
def test_a_grown_lake_built_on_its_last_dataset_equals_a_build_from_scratch(
    engine_name: str, tmp_path: Path, request: pytest.FixtureRequest
):
    engine = request.getfixturevalue(f"{engine_name}_engine")
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    info_a = _build(engine, str(lake), a)
    fresh, removed = _grow_local(lake)

    info_b = _build(engine, str(lake), b, base=a)
    info_c = _build(engine, str(lake), c)
    check_dataset(b)
    _compare(b, c, info_b, info_c)
    _check_incremental(info_a, info_b, info_c, a)
    assert info_b.build.preprocessed == _decoded_in_b(info_a, fresh, removed, f"file://{lake}")
    assert info_b.build.reused == info_c.build.preprocessed - info_b.build.preprocessed
    report_b, report_c = (Path(d, "report.html").read_text() for d in (b, c))
    assert "Incremental build" not in report_c
    assert "Incremental build" in report_b
    assert f"<td>reused from the base&#x27;s shards</td><td>{info_b.build.reused}</td>" in report_b
    assert f"<td>left the lake</td><td>{len(removed)}</td>" in report_b


def test_pad_copies_and_rejects_are_taken_alike(tmp_path: Path, local_engine):
    """The pad policy (rows copied, in A and in B) and an object A rejected (it is decoded,
    and rejected, again): B still equals C."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    (lake / "dog" / "broken.png").write_bytes(encode(make_image(1), "PNG")[:60])
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    opts = {"remainder": "pad", "num_shards": 3, "max_reject_fraction": 0.2}
    info_a = _build(local_engine, str(lake), a, **opts)
    assert info_a.counts.padded and info_a.counts.shard_rejects == 1
    _grow_local(lake)
    info_b = _build(local_engine, str(lake), b, base=a, **opts)
    info_c = _build(local_engine, str(lake), c, **opts)
    assert info_c.counts.padded and info_c.counts.shard_rejects == 1
    _compare(b, c, info_b, info_c)
    _check_incremental(info_a, info_b, info_c, a)


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_name",
    ["local", pytest.param("spark", marks=pytest.mark.spark), pytest.param("dask", marks=pytest.mark.dask)],
)
def test_a_grown_s3_lake_built_on_its_last_dataset_equals_a_build_from_scratch(
    engine_name: str, s3_bucket: str, s3_endpoint: str, request: pytest.FixtureRequest
):
    engine = request.getfixturevalue(f"{engine_name}_engine")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = s3_bucket[len("s3://") :]
    keys = []
    for li, (label, n) in enumerate(sorted(_COUNTS.items())):
        for i in range(n):
            keys.append(f"{label}/{i:03d}.png")
            client.put_object(
                Bucket=bucket, Key=f"raw/{keys[-1]}", Body=encode(make_image(li * 1000 + i), "PNG")
            )
    lake = f"{s3_bucket}/raw"
    a, b, c = (f"{s3_bucket}/{name}" for name in ("a", "b", "c"))
    info_a = _build(engine, lake, a)
    fresh = {f"{sorted(_COUNTS)[i % 3]}/new_{i:02d}.png" for i in range(5)}
    for i, key in enumerate(sorted(fresh)):
        client.put_object(Bucket=bucket, Key=f"raw/{key}", Body=encode(make_image(7000 + i), "PNG"))
    removed = {keys[3], keys[30]}
    for key in removed:
        client.delete_object(Bucket=bucket, Key=f"raw/{key}")
    client.put_object(Bucket=bucket, Key=f"raw/{keys[12]}", Body=encode(make_image(8888), "PNG"))
    fresh.add(keys[12])

    info_b = _build(engine, lake, b, base=a)
    info_c = _build(engine, lake, c)
    _compare(b, c, info_b, info_c)
    _check_incremental(info_a, info_b, info_c, a)
    assert info_b.build.preprocessed == _decoded_in_b(info_a, fresh, removed, lake)


@pytest.fixture()
def base_and_grown(tmp_path: Path, local_engine) -> tuple[Path, Path, Path]:
    """A dataset A (image size 16) of a lake, and the manifest of the grown lake at B."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a, b = tmp_path / "a", tmp_path / "b"
    _build(local_engine, str(lake), str(a))
    _grow_local(lake)
    manifest_job.run(ManifestConfig(input=str(lake), output=str(b), **_MANIFEST), local_engine)
    return lake, a, b


@pytest.mark.parametrize(
    "option, value, field, then, now",
    [
        ("image_size", 24, "image.size", "16", "24"),
        ("resize", "pad", "image.resize", "'crop'", "'pad'"),
        ("image_format", "png", "image.format", "'jpeg'", "'png'"),
        ("quality", 80, "image.quality", "90", "80"),
        ("max_image_pixels", 10_000, "image.max_pixels", "89478485", "10000"),
    ],
)
def test_a_base_built_with_other_image_options_is_refused_naming_the_option(
    base_and_grown: tuple[Path, Path, Path], option: str, value: Any, field: str, then: str, now: str
):
    _, a, b = base_and_grown
    cfg = ShardConfig(
        dataset=str(b), num_shards=2, base=str(a), engine="local", **{"image_size": 16, option: value}
    )
    with pytest.raises(ShardError) as err:
        shard_job.check_shard_inputs(cfg)
    assert f"--base file://{a} was built with {field} {then}, this build has {field} {now}" in str(err.value)
    assert not (b / "dataset.json").exists()


@pytest.mark.parametrize(
    "parent, name, field",
    [
        ("image", "code", "image.code"),
        ("versions", "pillow", "versions.pillow"),
        ("versions", "numpy", "versions.numpy"),
    ],
)
def test_a_base_made_by_other_preprocessing_code_or_libraries_is_refused(
    base_and_grown: tuple[Path, Path, Path], local_engine, parent: str, name: str, field: str
):
    _, a, b = base_and_grown
    info = json.loads((a / "dataset.json").read_text())
    now = info[parent][name]
    assert now  # the build records it
    info[parent][name] = "0.0-other"
    (a / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(
        ShardError, match=rf"was built with {field} '0.0-other', this build has {field} '{now}'"
    ):
        shard_job.run(ShardConfig(dataset=str(b), num_shards=2, image_size=16, base=str(a)), local_engine)


def test_an_incomplete_base_is_refused_naming_it(base_and_grown: tuple[Path, Path, Path], tmp_path: Path):
    _, a, b = base_and_grown

    def refused(base: Path, message: str) -> None:
        with pytest.raises(DatasetError) as err:
            shard_job.check_shard_inputs(
                ShardConfig(dataset=str(b), num_shards=2, image_size=16, base=str(base))
            )
        assert f"--base file://{base}" in str(err.value) and message in str(err.value), str(err.value)

    only_manifest = tmp_path / "only-manifest"  # the shard job never committed
    shutil.copytree(a / "manifests", only_manifest / "manifests")
    refused(only_manifest, "is not a complete dataset")
    refused(tmp_path / "nothing", "is not a complete dataset")

    missing = tmp_path / "missing-shard"
    shutil.copytree(a, missing)
    shard = next((missing / "shards").rglob("part-00001-of-00002.parquet"))
    shard.unlink()
    refused(missing, f"is incomplete: its shard file://{shard} is missing")

    remanifested = tmp_path / "remanifested"  # the manifest rebuilt on another lake after the shards
    shutil.copytree(a, remanifested)
    marker = read_manifest_info(str(remanifested))
    write_manifest_info(str(remanifested), replace(marker, fingerprint="another"))
    refused(remanifested, "is not the one its shards were built from")


def test_base_is_an_option_of_the_command_line_and_the_conf_file(tmp_path: Path):
    from lakeshard.settings import resolve

    conf = tmp_path / "s.yaml"
    conf.write_text("dataset: /d\nbase: s3://lake/datasets/v1\n")
    assert resolve(ShardConfig, conf=str(conf)).base == "s3://lake/datasets/v1"
    args = shard_job.parser().parse_args(["--dataset", "/d", "--base", "/old"])
    assert args.base == "/old"
    assert resolve(ShardConfig, {"dataset": "/d"}, conf="conf/shard.yaml").base is None


def test_a_base_is_refused_by_the_command_line_before_an_engine_starts(
    base_and_grown: tuple[Path, Path, Path],
):
    import subprocess
    import sys

    _, a, b = base_and_grown
    probe = (
        "import sys; from jobs import shard; rc = shard.main(sys.argv[1:]); "
        "print('RC', rc, sorted(m for m in ('pyspark', 'distributed') if m in sys.modules))"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            probe,
            "--engine",
            "spark",
            "--dataset",
            str(b),
            "--base",
            str(a),
            "--num-shards",
            "2",
            "--image-size",
            "32",
        ],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "RC 2 []", proc.stdout + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jobs/shard.py: error: --base file://{a} was built with image.size 16, this build has image.size 32: "
        "its images are not the ones this build makes; build without --base, or with the base's options"
    )


def test_a_dataset_resharded_in_place_on_itself_decodes_nothing(tmp_path: Path, local_engine):
    """Other shard counts, seed and remainder policy change no stored image: the dataset rebuilt
    over itself (``--overwrite --base`` itself) takes every image from its old shards and is
    the dataset a build from scratch makes."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a, c = str(tmp_path / "a"), str(tmp_path / "c")
    first = _build(local_engine, str(lake), a, remainder="pad", num_shards=2)
    opts = {"remainder": "pad", "num_shards": 3, "seed": 11}
    info_b = shard_job.run(
        ShardConfig(dataset=a, image_size=16, base=a, overwrite=True, **opts), local_engine
    )
    info_c = _build(local_engine, str(lake), c, **opts)
    check_dataset(a)
    _compare(a, c, info_b, info_c)
    assert (info_b.build.preprocessed, info_b.build.reused) == (0, info_c.build.preprocessed)
    assert info_b.build.base is not None and info_b.build.base.dataset_version == first.dataset_version


def test_a_base_that_does_not_record_its_preprocessing_code_is_refused(
    base_and_grown: tuple[Path, Path, Path],
):
    _, a, b = base_and_grown
    info = json.loads((a / "dataset.json").read_text())
    del info["image"]["code"]  # as an older lakeshard wrote it
    (a / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(
        ShardError,
        match=r"was built with image.code None, this build has image.code '[0-9a-f]{16}'.*"
        r"does not record it, it was built by an older lakeshard",
    ):
        shard_job.check_shard_inputs(ShardConfig(dataset=str(b), num_shards=2, image_size=16, base=str(a)))


def test_the_base_is_staged_in_the_order_pass(base_and_grown: tuple[Path, Path, Path], local_engine):
    """An incremental shard job runs two engine actions more than a build from scratch, the
    join and the scatter: both sides of the join are staged by the order pass's action (on
    Spark each action costs tenths of a second)."""
    _, a, b = base_and_grown
    opts = {"num_shards": 2, "image_size": 16, "overwrite": True}
    scratch, incremental = CountingEngine(local_engine), CountingEngine(local_engine)
    shard_job.run(ShardConfig(dataset=str(b), **opts), scratch)
    info = shard_job.run(ShardConfig(dataset=str(b), base=str(a), **opts), incremental)
    assert info.build.reused > 0
    assert len(incremental.actions) == len(scratch.actions) + 2, (incremental.actions, scratch.actions)
    assert [a for a in incremental.actions if a not in ("join", "scatter")] == scratch.actions


def test_the_short_passes_of_an_incremental_build_run_a_task_per_core(tmp_path: Path):
    """The slot pass (a slot task per channel at least) and the scatter (a task per base shard
    file, whatever the preprocessing's tasks) run at most a task per core, each task taking
    several in turn (on Spark each engine task costs tens of milliseconds); B still equals C."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    one = LocalEngine(workers=1)
    info_a = _build(one, str(lake), a, partitions=4)
    _grow_local(lake)
    engine = CountingEngine(one)
    info_b = _build(engine, str(lake), b, base=a, partitions=4)
    info_c = _build(one, str(lake), c, partitions=4)
    assert engine.tasks["preprocess_segment"] == [4]  # --partitions: the preprocessing keeps its tasks
    assert engine.tasks["slot_rows"] == [1] and engine.tasks["scatter"] == [1], engine.tasks
    assert engine.tasks["stage_both"] == [1], engine.tasks  # the manifest job's: the base and the listed rows
    _compare(b, c, info_b, info_c)
    _check_incremental(info_a, info_b, info_c, a)


def test_segments_cut_from_shards_take_their_images_by_position(tmp_path: Path, local_engine):
    """Shards preprocessed in several segments (``--partitions``) and assembled: each segment
    takes the base's images of its own rows; B still equals C."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))
    info_a = _build(local_engine, str(lake), a)
    _grow_local(lake)
    info_b = _build(local_engine, str(lake), b, base=a, partitions=7)
    info_c = _build(local_engine, str(lake), c, partitions=7)
    assert info_c.build.assembled_shards > 0
    _compare(b, c, info_b, info_c)
    _check_incremental(info_a, info_b, info_c, a)


def test_without_rejects_the_empty_rejects_table_is_written_by_the_driver(tmp_path: Path, local_engine):
    """No segment had a reject: the empty shard rejects table is written without an engine
    action; with a reject, a task writes it from the receipts."""
    lake = tmp_path / "raw"
    write_lake(lake, _COUNTS)
    a = str(tmp_path / "a")
    manifest_job.run(ManifestConfig(input=str(lake), output=a, **_MANIFEST), local_engine)
    clean = CountingEngine(local_engine)
    info = shard_job.run(ShardConfig(dataset=a, num_shards=2, image_size=16), clean)
    assert "write_rejects" not in clean.actions and info.counts.shard_rejects == 0
    assert read_table(storage.join(a, info.rejects_path)).num_rows == 0
    victim = sorted((lake / "dog").rglob("*.png"))[0]
    victim.write_bytes(b"\x89PNG not really")  # replaced since the manifest: rejected
    dirty = CountingEngine(local_engine)
    info = shard_job.run(
        ShardConfig(dataset=a, num_shards=2, image_size=16, overwrite=True, max_reject_fraction=0.2), dirty
    )
    assert dirty.actions.count("write_rejects") == 1 and info.counts.shard_rejects == 1
    assert read_table(storage.join(a, info.rejects_path))["uri"].to_pylist() == [f"file://{victim}"]
