"""The distributed manifest (rows on the workers, tables in parts) is the manifest the in-memory
reference :func:`jobs.manifest_steps.catalog.build_manifest` builds from the same objects: same rows in the same
channels, same labels, counts, duplicate report and fingerprint; and it is read back through
:mod:`lakeshard.format.manifest_table`."""

from __future__ import annotations

import random
import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import manifest as manifest_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.catalog import build_manifest, fingerprint
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.listing import Skip, discover, inspect_objects, list_prefix
from jobs.manifest_steps.passes import ListedPart, stage_listing
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.inputs import check_shard_inputs
from lakeshard import storage
from lakeshard.errors import DatasetError, PlatformError
from lakeshard.format import MANIFEST_SCHEMA, manifest_marker_uri, read_manifest_info
from lakeshard.format.manifest_table import (
    channel_parts,
    label_part,
    manifest_parts,
    read_channel,
    read_channel_rows,
    read_part,
    table_rows,
)
from tests.helpers.checks import sagemaker_refs
from tests.helpers.lake import encode, make_image, write_lake


def _random_lake(root: Path, seed: int) -> None:
    """Classes of random sizes, nested folders, copies of the same content within and across
    classes, rejects (empty, not an image) and an object above the label level."""
    rng = random.Random(seed)
    blobs: list[bytes] = []
    for c in range(rng.randint(3, 6)):
        for i in range(rng.randint(6, 30)):
            folder = root / f"class{c}" / ("deep" if rng.random() < 0.3 else "")
            folder.mkdir(parents=True, exist_ok=True)
            roll = rng.random()
            if blobs and roll < 0.15:
                data = rng.choice(blobs)  # identical content under another key
            elif roll < 0.2:
                data = rng.choice([b"", b"just text, not an image"])
            else:
                data = encode(make_image(seed * 1000 + c * 100 + i, size=(6, 5)))
                blobs.append(data)
            (folder / f"{rng.randint(0, 10**6):07d}_{i}.png").write_bytes(data)
    (root / "stray.png").write_bytes(blobs[0])


def _reference(cfg: ManifestConfig):
    """Today's path on one process: every row listed and inspected here, then build_manifest."""
    src = storage.normalize(cfg.input)
    prefixes, stray = discover(src, label_depth=cfg.label_depth, skip=Skip())
    rows = stray + [r for p in prefixes for r in list_prefix(src, p, label_depth=cfg.label_depth)]
    return build_manifest(
        inspect_objects(rows),
        split=cfg.split,
        seed=cfg.seed,
        split_method=cfg.split_method,
        min_per_class=cfg.min_per_class,
        max_reject_fraction=cfg.max_reject_fraction,
        source=src,
        dedupe=cfg.dedupe,
    )


def _sorted(table: pa.Table) -> list[dict]:
    return table.sort_by("key").to_pylist()


@pytest.mark.parametrize("dedupe", [False, True])
@pytest.mark.parametrize("method", ["hash", "stratified"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_distributed_manifest_equals_the_reference(tmp_path, local_engine, seed, method, dedupe):
    _random_lake(tmp_path / "raw", seed)
    cfg = ManifestConfig(
        input=str(tmp_path / "raw"),
        output=str(tmp_path / "ds"),
        seed=seed,
        split_method=method,
        split={"train": 0.6, "validation": 0.2, "test": 0.2},
        max_reject_fraction=1.0,
        dedupe=dedupe,
        rows_per_part=7,
    )
    try:
        want = _reference(cfg)
    except PlatformError as exc:  # e.g. a class too small for a channel: the job fails alike
        with pytest.raises(type(exc)) as got:
            manifest_job.run(cfg, local_engine)
        assert str(got.value) == str(exc)
        assert not storage.exists(manifest_marker_uri(cfg.output))
        return
    summary = manifest_job.run(cfg, local_engine)
    out = storage.normalize(cfg.output)
    assert summary["parts"] > 1  # the lake was really parted
    assert storage.read_json(storage.join(out, "labels.json")) == want.labels == summary["labels"]
    assert _sorted(read_channel(out, "all")) == want.all.to_pylist()
    assert _sorted(read_channel(out, "rejects")) == want.rejects.to_pylist()
    for channel, table in want.channels.items():
        assert _sorted(read_channel(out, channel)) == table.to_pylist()
        assert sorted(sagemaker_refs(out, channel)) == sorted(table["uri"].to_pylist())
    assert summary["counts"]["classes"] == want.counts
    assert summary["duplicates"] == want.duplicates
    assert summary["fingerprint"] == fingerprint(want.all)
    assert summary["counts"]["rejected"] == want.rejects.num_rows
    assert not storage.exists(storage.join(out, "_staging", "manifest"))


def _parted_manifest(tmp_path, local_engine, seed: int) -> str:
    """A random lake's manifest in parts of about 5 rows; its root."""
    _random_lake(tmp_path / "raw", seed)
    out = str(tmp_path / "ds")
    manifest_job.run(
        ManifestConfig(
            input=str(tmp_path / "raw"),
            output=out,
            max_reject_fraction=1.0,
            split={"train": 0.5, "test": 0.5},
            rows_per_part=5,
        ),
        local_engine,
    )
    return storage.normalize(out)


def test_every_class_is_whole_in_its_part(tmp_path, local_engine):
    out = _parted_manifest(tmp_path, local_engine, 4)
    parts = manifest_parts(out)
    assert len(channel_parts(out, "train")) == parts > 1
    for part in range(parts):
        rows = read_channel_rows(out, "all", part=part, columns=["key", "label"]).to_pylist()
        assert [r["key"] for r in rows] == sorted(r["key"] for r in rows)
        assert all(label_part(r["label"], parts) == part for r in rows)


def test_the_rows_of_some_classes_are_read_from_their_parts_alone(tmp_path, local_engine):
    out = _parted_manifest(tmp_path, local_engine, 5)
    whole = read_channel(out, "train").to_pylist()
    labels = sorted({r["label"] for r in whole})
    some = labels[::2]
    got = read_channel_rows(out, "train", labels=some, columns=["key", "label"])
    assert got.column_names == ["key", "label"]
    assert sorted(got["key"].to_pylist()) == sorted(r["key"] for r in whole if r["label"] in some)
    assert read_channel_rows(out, "train", labels=[]).num_rows == 0


def test_reading_a_manifest_without_parts_names_the_problem(tmp_path):
    root = storage.normalize(str(tmp_path))
    with pytest.raises(DatasetError, match="no complete manifest"):
        read_channel(root, "train")
    storage.write_json_atomic(manifest_marker_uri(root), {"format_version": 2})
    with pytest.raises(DatasetError, match="older lakeshard"):
        read_channel(root, "train")


def test_a_failed_check_writes_no_table_and_keeps_the_old_manifest(tmp_path, local_engine):
    _random_lake(tmp_path / "raw", 5)
    (tmp_path / "raw" / "tiny").mkdir()
    (tmp_path / "raw" / "tiny" / "one.png").write_bytes(encode(make_image(99, size=(6, 5))))
    cfg = ManifestConfig(
        input=str(tmp_path / "raw"),
        output=str(tmp_path / "ds"),
        max_reject_fraction=1.0,
        split_method="stratified",
        split={"train": 0.5, "test": 0.5},
        rows_per_part=7,
    )
    with pytest.raises(PlatformError) as want:
        _reference(cfg)
    with pytest.raises(type(want.value)) as got:
        manifest_job.run(cfg, local_engine)
    assert str(got.value) == str(want.value) and "'tiny'" in str(got.value)
    assert not (tmp_path / "ds" / "manifests").exists()

    (tmp_path / "raw" / "tiny" / "one.png").unlink()
    (tmp_path / "raw" / "tiny").rmdir()
    old = manifest_job.run(replace(cfg, split={"train": 0.5, "test": 0.5}), local_engine)
    (tmp_path / "raw" / "tiny").mkdir()
    (tmp_path / "raw" / "tiny" / "one.png").write_bytes(encode(make_image(99, size=(6, 5))))
    with pytest.raises(type(want.value)):
        manifest_job.run(replace(cfg, overwrite=True), local_engine)
    out = storage.normalize(cfg.output)
    assert read_manifest_info(out).to_json() == old  # still the complete, readable manifest
    assert read_channel(out, "all").num_rows == old["counts"]["listed"]


def test_a_killed_runs_parts_and_staged_rows_are_never_a_manifest(tmp_path, local_engine, small_lake):
    cfg = ManifestConfig(input=str(small_lake), output=str(tmp_path / "ds"), seed=3, rows_per_part=40)
    clean = manifest_job.run(replace(cfg, output=str(tmp_path / "clean")), local_engine)
    out = storage.normalize(cfg.output)
    # What a run killed in its last pass leaves: some table parts, staged rows, no marker.
    (tmp_path / "ds" / "manifests" / "train").mkdir(parents=True)
    part = f"part-00000-of-{clean['parts']:05d}.parquet"
    shutil.copy(
        tmp_path / "clean" / "manifests" / "train" / part, tmp_path / "ds" / "manifests" / "train" / part
    )
    staged = tmp_path / "ds" / "_staging" / "manifest" / "classes" / "b=00000"
    staged.mkdir(parents=True)
    stray = read_channel(storage.normalize(str(tmp_path / "clean")), "all").slice(0, 1).to_pylist()
    staged_schema = MANIFEST_SCHEMA.append(pa.field("content", pa.string())).append(
        pa.field("duplicate", pa.bool_())
    )
    pq.write_table(
        pa.Table.from_pylist([{**stray[0], "key": "zzz/ghost.png"}], schema=staged_schema),
        staged / "part-00099.parquet",
    )
    with pytest.raises(DatasetError, match="no complete manifest"):
        check_shard_inputs(ShardConfig(dataset=out))
    with pytest.raises(DatasetError, match="no complete manifest"):
        read_channel(out, "train")

    again = manifest_job.run(cfg, local_engine)
    assert again == clean | {"input": again["input"]}
    assert "zzz/ghost.png" not in read_channel(out, "all")["key"].to_pylist()
    assert not (tmp_path / "ds" / "_staging" / "manifest").exists()


def test_header_tasks_are_bounded_so_the_staged_files_are():
    from jobs.manifest_steps.extract import inspect_tasks

    assert inspect_tasks(100_000, 2) == 50  # one per 2,000 objects, as before
    assert inspect_tasks(10, 2) == 4  # twice the cores, at most one per object
    # Each task writes a file per content bucket (one per --rows-per-part objects): at 100M
    # objects, 1,000 tasks x 1,000 buckets, not 50,000 x 1,000.
    assert inspect_tasks(100_000_000, 2) == 1000
    assert inspect_tasks(100_000_000, 4000) == 8000  # a bigger cluster still gets two tasks per core


class _Recording(LocalEngine):
    """The local engine, recording what each map_partitions call handed back to the driver."""

    def __init__(self) -> None:
        super().__init__(workers=2)
        self.calls: list[tuple[int, list]] = []

    def map_partitions(self, fn, items, *, partitions):
        results = super().map_partitions(fn, items, partitions=partitions)
        self.calls.append((len(items), results))
        return results


def test_the_driver_gets_aggregates_never_rows(tmp_path):
    raw = tmp_path / "raw"
    write_lake(raw, {"cat": 120, "dog": 90, "emu": 60})
    engine = _Recording()
    summary = manifest_job.run(
        ManifestConfig(input=str(raw), output=str(tmp_path / "ds"), rows_per_part=100), engine
    )
    assert summary["counts"]["accepted"] == 270
    assert len(engine.calls) >= 4  # list, inspect, group by content, split by class
    for items, results in engine.calls:
        assert len(results) <= items  # at most one result per work item (a prefix, a slice, a bucket)
        assert not any(isinstance(r, dict) and "uri" in r for r in results)  # no row came back
    assert sum(len(results) for _, results in engine.calls) < 30


def test_any_listing_task_becomes_a_staging_one(tmp_path, small_lake):
    """A listing task that returns rows and work for another round (as a balanced listing's
    does) keeps its rows on the worker: one staged part, its counts, the rest passed on."""
    src = storage.normalize(str(small_lake))
    hidden = {**list_prefix(src, f"{src}/dog")[0], "status": "skipped", "reason": "hidden: '.x'"}
    rows = [*list_prefix(src, f"{src}/cat"), hidden]
    left = ("more work", 7)
    out = stage_listing(
        [f"{src}/cat"],
        produce=lambda items: [*rows, left],
        staging=storage.normalize(str(tmp_path / "staging")),
    )
    assert out[1:] == [left]
    part = out[0]
    assert isinstance(part, ListedPart) and part.rows == 40
    assert part.skipped == {"hidden": 1} and part.skipped_examples[0].reason == "hidden: '.x'"
    assert read_part(part.uri, ["key"])["key"].to_pylist() == [r["key"] for r in rows[:40]]


_TIMES = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), _TIMES),
            st.one_of(st.none(), st.text(max_size=5)),
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        ),
        max_size=30,
    ),
    st.sampled_from(["s", "ms", "us"]),
    st.integers(0, 3),
)
def test_table_rows_are_the_rows_pyarrow_makes(rows: list, unit: str, offset: int) -> None:
    """``table_rows`` gives what ``Table.to_pylist`` gives: the same dicts, the same values,
    the same ``tzinfo`` objects, for UTC times in every unit it converts itself (before and
    after 1970, nulls included), other time zones and other columns, and a slice of a table."""
    times = [
        t
        if t is None or unit == "us"
        else t.replace(microsecond=0 if unit == "s" else t.microsecond // 1000 * 1000)
        for t, _, _ in rows
    ]
    table = pa.table(
        {
            "t": pa.array(times, pa.timestamp(unit, tz="UTC")),
            "local": pa.array(times, pa.timestamp(unit, tz="Europe/Paris")),
            "naive": pa.array(
                [None if t is None else t.replace(tzinfo=None) for t in times], pa.timestamp(unit)
            ),
            "s": pa.array([s for _, s, _ in rows], pa.string()),
            "n": pa.array([n for _, _, n in rows], pa.int64()),
        }
    ).slice(min(offset, len(rows)))
    expected = table.to_pylist()
    got = table_rows(table)
    assert got == expected
    assert [type(v) for r in got for v in r.values()] == [type(v) for r in expected for v in r.values()]
    zones = [
        (a.tzinfo, b.tzinfo)
        for x, y in zip(got, expected, strict=True)
        for a, b in zip(x.values(), y.values(), strict=True)
        if isinstance(a, datetime)
    ]
    assert all(a is b for a, b in zones)


def test_table_rows_of_a_table_without_columns() -> None:
    assert table_rows(pa.table({"a": [1, 2]}).select([])) == [{}, {}]
