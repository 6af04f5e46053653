"""Issue 23, incremental manifests (``--base``): a lake grows by 10%, loses three objects and has
one rewritten; the manifest built with ``--base`` is the one built from scratch, row for row, an
unchanged object is not read again, and the summary counts what was reused, new, changed, left
and moved. A base that is incomplete or was split otherwise is refused before an engine starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from jobs import manifest as manifest_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, ManifestError
from lakeshard.format import read_manifest_info
from lakeshard.format.manifest_table import read_channel
from tests.helpers.incremental import (
    NOT_AN_IMAGE,
    CountingEngine,
    assert_same_tables,
    build,
    channels,
    grow,
    write_lake_objects,
)


def _check_counts(
    summary: dict[str, Any], before: list[str], growth: Any, root_a: str, *, unread: int = 0
) -> None:
    """The summary's ``base`` counts are what :func:`grow` did to the lake (``unread``: the
    unchanged objects rejected before any read, so not reused)."""
    base = summary["base"]
    unchanged = len(before) - len(growth.removed) - len(growth.changed)
    assert base["root"] == root_a
    assert base["fingerprint"] == read_manifest_info(root_a).fingerprint
    assert base["objects"] == len(before)
    assert (base["unchanged"], base["reused"]) == (
        unchanged,
        unchanged - unread,
    )  # the non-image's reject is reused
    assert (base["new"], base["changed"]) == (len(growth.added), len(growth.changed))
    assert base["inspected"] == len(growth.added) + len(growth.changed) + unread
    assert (base["left"], base["left_examples"]) == (len(growth.removed), sorted(growth.removed))


def test_base_gives_the_manifest_built_from_scratch(tmp_path: Path, local_engine) -> None:
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    storage.write_bytes_atomic(f"{lake}/README.txt", b"above the label level: rejected as it is listed")
    build(local_engine, lake, a)
    growth = grow(lake, before)
    build(local_engine, lake, c)
    # An unchanged object (same size and modification time) whose bytes are now garbage: a job
    # that read it again would reject it (or give it another ETag), and B would differ from C.
    path = storage.filesystem(storage.join(lake, "cat/img_001.png"))[1]
    st = os.stat(path)
    Path(path).write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    summary = build(local_engine, lake, b, base=a)
    assert_same_tables(b, c)
    _check_counts(summary, [*before, "README.txt"], growth, a, unread=1)
    assert (summary["base"]["moved"], summary["base"]["moved_examples"]) == (0, [])  # the hash split
    assert summary["rejects_by_reason"] == {"no label": 1, "not an image": 1}
    assert NOT_AN_IMAGE in read_channel(b, "rejects")["key"].to_pylist()  # reused as the reject it was
    assert channels(b)["cat/img_001.png"] == channels(a)["cat/img_001.png"]
    assert read_manifest_info(c).base is None


def _label_table(uri: str, keys: list[str]) -> str:
    lines = ["key,label", *(f"{k},{k.split('/')[0]}" for k in sorted(keys))]
    storage.write_bytes_atomic(uri, ("\n".join(lines) + "\n").encode())
    return storage.normalize(uri)


def test_base_with_a_labels_table_and_a_stray_object(tmp_path: Path, local_engine) -> None:
    """With --labels (the table grows with the lake; its rows for gone objects stay) and an
    object with no label row (a reject before any read, so unchanged but read again if it gets
    a label: here it does not, and it is not reused)."""
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    storage.write_bytes_atomic(f"{lake}/stray.png", b"an object with no label row")
    table = _label_table(str(tmp_path / "labels.csv"), before)
    build(local_engine, lake, a, labels=table)
    growth = grow(lake, before)
    _label_table(str(tmp_path / "labels.csv"), before + growth.added)
    summary = build(local_engine, lake, b, base=a, labels=table)
    build(local_engine, lake, c, labels=table)
    assert_same_tables(b, c)
    base = summary["base"]
    unchanged = len(before) + 1 - len(growth.removed) - len(growth.changed)
    assert (base["unchanged"], base["reused"]) == (unchanged, unchanged - 1)  # the stray one is not reused
    assert (base["new"], base["changed"], base["left"]) == (len(growth.added), 1, len(growth.removed))
    assert summary["rejects_by_reason"] == {"no label": 1, "not an image": 1}
    assert summary["labels_table"]["not_in_lake"] == len(growth.removed)
    with pytest.raises(ManifestError) as err:  # path labels on a base labelled from the table
        check_manifest_inputs(_cfg(lake, str(tmp_path / "d"), a))
    assert f"took its labels from --labels {table}, this run from the path (--label-depth 1)" in str(
        err.value
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "bucket",
    [
        pytest.param("s3_bucket", marks=pytest.mark.s3),
        pytest.param("gcs_bucket", marks=pytest.mark.gcs),
        pytest.param("az_container", marks=pytest.mark.azure),
    ],
)
def test_base_on_a_bucket_store(bucket: str, local_engine, request: pytest.FixtureRequest) -> None:
    """As locally: an unchanged object is not read again. Its content is the MD5 the listing
    states (S3's ETag, GCS's md5Hash, Azure's Content-MD5), not a hash of a read."""
    root = request.getfixturevalue(bucket)
    lake, a, b, c = (f"{root}/{n}" for n in ("raw", "ds/a", "ds/b", "ds/c"))
    before = write_lake_objects(lake)
    build(local_engine, lake, a)
    growth = grow(lake, before)
    summary = build(local_engine, lake, b, base=a)
    build(local_engine, lake, c)
    assert_same_tables(b, c)
    _check_counts(summary, before, growth, a)
    assert summary["base"]["moved"] == 0


def test_stratified_split_counts_what_moved(tmp_path: Path, local_engine) -> None:
    """The stratified split re-deals each class that changed: the summary counts the objects
    whose channel is not their base channel, as the tables show them."""
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    build(local_engine, lake, a, split_method="stratified")
    grow(lake, before, added_per_class=4)
    summary = build(local_engine, lake, b, base=a, split_method="stratified")
    build(local_engine, lake, c, split_method="stratified")
    assert_same_tables(b, c)
    old, new = channels(a), channels(b)
    moved = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    assert moved, "this growth moves objects under the stratified split"
    assert summary["base"]["moved"] == len(moved)
    assert summary["base"]["moved_examples"] == [{"key": k, "from": old[k], "to": new[k]} for k in moved[:5]]


def test_no_sniff_reads_nothing_and_reuses_nothing(tmp_path: Path, local_engine) -> None:
    """With --no-sniff no object is read anyway: nothing is counted as reused, the counts of
    new, changed and left still hold, and the manifest is the one built from scratch."""
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    build(local_engine, lake, a, sniff=False)
    growth = grow(lake, before)
    summary = build(local_engine, lake, b, base=a, sniff=False)
    build(local_engine, lake, c, sniff=False)
    assert_same_tables(b, c)
    base = summary["base"]
    assert (base["reused"], base["new"], base["changed"], base["left"]) == (0, len(growth.added), 1, 3)


# -- refusals, before an engine starts -----------------------------------------------------------


@pytest.fixture()
def base_a(tmp_path: Path, local_engine) -> tuple[str, str]:
    lake = storage.normalize(str(tmp_path / "lake"))
    write_lake_objects(lake)
    a = storage.normalize(str(tmp_path / "a"))
    build(local_engine, lake, a)
    return lake, a


def _cfg(lake: str, out: str, base: str, **opts: Any) -> ManifestConfig:
    kw: dict[str, Any] = {"seed": 5, "split": {"train": 0.6, "validation": 0.2, "test": 0.2}, **opts}
    return ManifestConfig(input=lake, output=out, base=base, engine="local", **kw)


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"seed": 6}, "was split with --seed 5, this run with --seed 6"),
        (
            {"split_method": "stratified"},
            "was split with --split-method hash, this run with --split-method stratified",
        ),
        (
            {"split": {"train": 0.8, "validation": 0.1, "test": 0.1}},
            "was split with --split train=0.6,validation=0.2,test=0.2, this run with --split train=0.8,validation=0.1,test=0.1",
        ),
        (
            {"split": {"train": 0.6, "test": 0.2, "validation": 0.2}},
            "this run with --split train=0.6,test=0.2,validation=0.2",
        ),
        (
            {"label_depth": 2},
            "took its labels from the path (--label-depth 1), this run from the path (--label-depth 2)",
        ),
    ],
)
def test_a_base_split_otherwise_is_refused(
    tmp_path: Path, base_a: tuple[str, str], opts: dict[str, Any], message: str
) -> None:
    lake, a = base_a
    with pytest.raises(ManifestError, match="base") as err:
        check_manifest_inputs(_cfg(lake, str(tmp_path / "b"), a, **opts))
    assert message in str(err.value) and a in str(err.value)


def test_a_base_of_another_input_is_refused(tmp_path: Path, base_a: tuple[str, str]) -> None:
    lake, a = base_a
    other = storage.normalize(str(tmp_path / "other"))
    write_lake_objects(other)
    with pytest.raises(ManifestError) as err:
        check_manifest_inputs(_cfg(other, str(tmp_path / "b"), a))
    assert f"--base {a} is a manifest of --input {lake}, not of --input {other}" in str(err.value)


def test_an_incomplete_base_is_refused(tmp_path: Path, base_a: tuple[str, str]) -> None:
    lake, a = base_a
    storage.remove(f"{a}/manifests/_manifest.json")
    with pytest.raises(DatasetError) as err:
        check_manifest_inputs(_cfg(lake, str(tmp_path / "b"), a))
    assert f"--base {a} holds no complete manifest: {a}/manifests/_manifest.json is missing" in str(err.value)


def test_the_output_as_base_is_refused(base_a: tuple[str, str]) -> None:
    lake, a = base_a
    with pytest.raises(ConfigError, match=f"--base {a} is the --output"):
        check_manifest_inputs(_cfg(lake, a, a, overwrite=True))


def test_the_cli_names_the_refusal_in_one_line(
    tmp_path: Path, base_a: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    lake, a = base_a
    code = manifest_job.main(
        [
            "--engine",
            "local",
            "--input",
            lake,
            "--output",
            str(tmp_path / "b"),
            "--base",
            a,
            "--seed",
            "9",
            "--split",
            "train=0.6,validation=0.2,test=0.2",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jobs/manifest.py: error: --base ")
    assert "was split with --seed 5, this run with --seed 9" in err[-1]
    assert not (tmp_path / "b").exists()


def test_base_with_dedupe_reuses_the_removed_copies(tmp_path: Path, local_engine) -> None:
    """A copy the base's --dedupe rejected was read (its format is in the base): it is reused,
    and --dedupe rejects it again, as from scratch."""
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    storage.write_bytes_atomic(f"{lake}/cat/copy.png", storage.read_bytes(f"{lake}/cat/img_001.png"))
    build(local_engine, lake, a, dedupe=True)
    growth = grow(lake, before)
    summary = build(local_engine, lake, b, base=a, dedupe=True)
    build(local_engine, lake, c, dedupe=True)
    assert_same_tables(b, c)
    _check_counts(summary, [*before, "cat/copy.png"], growth, a)
    assert summary["duplicates"]["removed"] == 1


def test_the_cli_prints_the_base_counts(
    tmp_path: Path, base_a: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    lake, a = base_a
    storage.remove(f"{lake}/fox/img_010.png")
    storage.write_bytes_atomic(
        f"{lake}/fox/new.png", storage.read_bytes(f"{lake}/fox/img_001.png")[:-1] + b"\0"
    )
    code = manifest_job.main(
        [
            "--engine",
            "local",
            "--input",
            lake,
            "--output",
            str(tmp_path / "b"),
            "--base",
            a,
            "--seed",
            "5",
            "--split",
            "train=0.6,validation=0.2,test=0.2",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (
        f"base {a}: 60 unchanged (60 not read again), 1 new, 0 changed, 1 left the lake "
        "(e.g. fox/img_010.png), 0 moved to another channel"
    )


def test_a_base_costs_one_engine_action(tmp_path: Path, local_engine) -> None:
    """The base's rows and the listed rows are staged by key bucket in one engine action, and
    the header-reading tasks join them (on Spark each action costs tenths of a second): a build
    with --base runs one action more than one from scratch."""
    lake = storage.normalize(str(tmp_path / "lake"))
    a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("a", "b", "c"))
    before = write_lake_objects(lake)
    build(local_engine, lake, a)
    grow(lake, before)
    scratch, incremental = CountingEngine(local_engine), CountingEngine(local_engine)
    build(scratch, lake, c)
    build(incremental, lake, b, base=a)
    assert_same_tables(b, c)
    read = scratch.actions.index("inspect_task")
    assert incremental.actions == [
        *scratch.actions[:read],
        "stage_both",
        "inspect_bucket",
        *scratch.actions[read + 1 :],
    ]
