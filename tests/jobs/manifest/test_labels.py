"""Issue 23: labels from a table (``--labels``), local and on the S3 server: every object is
accounted for (unlabelled objects are rejects, label rows without an object are counted), a key
labelled two ways fails before any object is read, a ``channel`` column pins objects, and a bad
table fails before an engine starts naming the URI and what is wrong."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.split import hash_split
from jobs.shard_steps import report_html as report_job
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import ConfigError, ManifestError
from lakeshard.format import read_dataset_info, read_manifest_info
from lakeshard.format.manifest_table import read_channel
from tests.helpers.lake import encode, make_image
from tests.jobs.engines.compare import assert_same_manifest

SPLIT = {"train": 0.6, "validation": 0.2, "test": 0.2}
SEED = 3
#: The lake: 30 images, flat and in arbitrary folders (no folder is a label).
OBJECTS = {(f"img_{i:03d}.png" if i % 3 else f"batch{i % 2}/deep/img_{i:03d}.png"): i for i in range(30)}
UNLABELLED = "img_029.png"  # in the lake, no label row
GHOST = "img_999.png"  # a label row, no object


def _label_of(i: int) -> str:
    return "cat" if i % 2 else "dog"


def _pinned() -> dict[str, str]:
    """Three keys the hash split puts in ``train``, pinned to ``test`` (so a pin that is
    ignored shows)."""
    keys = sorted(k for k in OBJECTS if k != UNLABELLED)
    train = [k for k, c in zip(keys, hash_split(keys, [""] * len(keys), SPLIT, SEED)) if c == "train"]
    return dict.fromkeys(train[:3], "test")


def _records(prefix: str = "") -> list[dict[str, Any]]:
    """The label table: a row per object but one, a row naming no object, an identical
    duplicate row, three pinned rows. ``prefix``: a ``uri`` column of ``prefix + key``."""
    pinned = _pinned()
    rows = [
        {"key": k, "label": _label_of(i), "channel": pinned.get(k, "")}
        for k, i in sorted(OBJECTS.items())
        if k != UNLABELLED
    ]
    rows += [{"key": GHOST, "label": "cat", "channel": ""}, dict(rows[4])]
    if prefix:
        rows = [{"uri": prefix + r.pop("key"), **r} for r in rows]
    return rows


def _table_bytes(records: list[dict[str, Any]], fmt: str) -> bytes:
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
        return out.getvalue().encode()
    if fmt == "jsonl":  # JSON: an unpinned row has no channel at all
        return "".join(json.dumps({k: v for k, v in r.items() if v != ""}) + "\n" for r in records).encode()
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{**r, "channel": r["channel"] or None} for r in records]), sink)
    return sink.getvalue()


def _write(uri: str, data: bytes) -> str:
    storage.write_bytes_atomic(uri, data)
    return storage.normalize(uri)


def _lake(root: str) -> None:
    for key, i in OBJECTS.items():
        _write(storage.join(root, key), encode(make_image(i), "PNG"))


def _run(lake: str, table: str, out: str, engine: Any, **opts: Any) -> dict[str, Any]:
    cfg = ManifestConfig(
        input=lake,
        output=out,
        labels=table,
        split=SPLIT,
        seed=SEED,
        max_reject_fraction=0.2,
        engine=engine.name,
        list_task_objects=8,
        rows_per_part=10,
        **opts,
    )
    return manifest_job.run(cfg, engine)


def _check_manifest(out: str, summary: dict[str, Any], table: str) -> None:
    """Every object accounted for, labelled as the table says; the pins held; the table's
    problems counted."""
    rows = {r["key"]: r for r in read_channel(out, "all").to_pylist()}
    assert sorted(rows) == sorted(OBJECTS)
    assert rows[UNLABELLED]["status"] == "rejected"
    assert rows[UNLABELLED]["reason"] == f"no label: not in --labels {table}"
    accepted = {k: r for k, r in rows.items() if r["status"] == "ok"}
    assert sorted(accepted) == sorted(k for k in OBJECTS if k != UNLABELLED)
    assert {k: r["label"] for k, r in accepted.items()} == {k: _label_of(OBJECTS[k]) for k in accepted}
    assert summary["labels"] == {"cat": 0, "dog": 1}
    assert {k: r["label_index"] for k, r in accepted.items()} == {
        k: summary["labels"][r["label"]] for k, r in accepted.items()
    }
    for key in _pinned():
        assert accepted[key]["channel"] == "test", key
    for channel in SPLIT:  # the channel tables hold what "all" says
        assert sorted(read_channel(out, channel)["key"].to_pylist()) == sorted(
            k for k, r in accepted.items() if r["channel"] == channel
        )
    t = summary["labels_table"]
    assert (t["uri"], t["rows"], t["unlabelled"], t["pinned"]) == (table, 31, 1, 3)
    assert t["not_in_lake"] == 1 and t["not_in_lake_examples"][0].endswith(GHOST)
    assert summary["rejects_by_reason"] == {"no label": 1}
    assert summary["label_depth"] is None


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_labels_table_local(tmp_path: Path, local_engine, fmt: str) -> None:
    lake, out = storage.normalize(str(tmp_path / "lake")), str(tmp_path / "ds")
    _lake(lake)
    table = _write(str(tmp_path / f"labels.{fmt}"), _table_bytes(_records(), fmt))
    summary = _run(lake, table, out, local_engine)
    _check_manifest(out, summary, table)


@pytest.mark.slow
@pytest.mark.parametrize(
    "store",
    [pytest.param("s3_bucket", marks=pytest.mark.s3), pytest.param("gcs_bucket", marks=pytest.mark.gcs)],
)
def test_labels_uri_column_on_s3(store: str, local_engine, request: pytest.FixtureRequest) -> None:
    """On S3, and on GCS as on S3."""
    bucket = request.getfixturevalue(store)
    lake, out = f"{bucket}/raw", f"{bucket}/ds"
    _lake(lake)
    table = _write(f"{bucket}/meta/labels.csv", _table_bytes(_records(prefix=lake + "/"), "csv"))
    summary = _run(lake, table, out, local_engine)
    _check_manifest(out, summary, table)
    assert read_channel(out, "all")["uri"].to_pylist()[0].startswith(lake + "/")


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("s3_bucket", marks=[pytest.mark.s3, pytest.mark.slow]),
        pytest.param("az_container", marks=pytest.mark.azure),
    ],
)
def test_labels_key_column_parquet_folder_on_s3(
    store: str, local_engine, request: pytest.FixtureRequest
) -> None:
    """A folder of table files on S3 or Azure (each staged by its own task), with a key column."""
    bucket = request.getfixturevalue(store)
    lake, out = f"{bucket}/raw", f"{bucket}/ds"
    _lake(lake)
    records = _records()
    _write(f"{bucket}/meta/labels/a.parquet", _table_bytes(records[:12], "parquet"))
    _write(f"{bucket}/meta/labels/b.parquet", _table_bytes(records[12:], "parquet"))
    summary = _run(lake, f"{bucket}/meta/labels", out, local_engine)
    _check_manifest(out, summary, f"{bucket}/meta/labels")


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def test_conflicting_labels_fail_before_any_object_is_read(
    tmp_path: Path, local_engine, where: str, request: pytest.FixtureRequest
) -> None:
    base = storage.normalize(str(tmp_path)) if where == "local" else request.getfixturevalue("s3_bucket")
    lake, out = f"{base}/lake", f"{base}/ds"
    _lake(lake)
    records = [
        *_records(),
        {"key": "img_001.png", "label": "dog", "channel": ""},
        {"key": "img_002.png", "label": "dog", "channel": "test"},
    ]
    table = _write(f"{base}/labels.csv", _table_bytes(records, "csv"))
    with pytest.raises(ManifestError, match=r"labels 2 key\(s\) in two different ways") as err:
        _run(lake, table, out, local_engine)
    assert "'img_001.png': cat, dog" in str(err.value)
    assert "'img_002.png': dog, dog (channel test)" in str(err.value)
    assert table in str(err.value)
    staged = f"{out}/_staging/manifest"
    assert storage.exists(f"{staged}/labelling/labelled")
    assert not storage.exists(f"{staged}/inspected")  # the headers pass never ran
    assert not storage.exists(f"{out}/manifests")


def test_stratified_counts_include_pinned_rows(tmp_path: Path, local_engine) -> None:
    """The stratified split cuts the unpinned rows by its quotas; the pinned ones add to
    their channel: the counts checked before the split (and written) are the counts of the
    tables, and ``--min-per-class`` counts the pinned rows."""
    lake, out = storage.normalize(str(tmp_path / "lake")), str(tmp_path / "ds")
    _lake(lake)
    records = _records()
    to_validation = {r["key"] for r in records if not r["channel"]}
    to_validation = set(sorted(to_validation - {GHOST})[:6])
    for r in records:
        r["channel"] = "validation" if r["key"] in to_validation else r["channel"]
    table = _write(str(tmp_path / "labels.csv"), _table_bytes(records, "csv"))
    summary = _run(lake, table, out, local_engine, split_method="stratified", min_per_class=2)
    for channel in SPLIT:
        got = read_channel(out, channel)["label"].to_pylist()
        assert summary["counts"]["classes"][channel] == {label: got.count(label) for label in ("cat", "dog")}
    assert summary["labels_table"]["pinned"] == 9  # six to validation, three (of the others) to test
    assert sum(summary["counts"]["classes"]["validation"].values()) >= 6


def test_labels_report_names_rows_without_object(tmp_path: Path, local_engine) -> None:
    lake, out = storage.normalize(str(tmp_path / "lake")), str(tmp_path / "ds")
    _lake(lake)
    table = _write(str(tmp_path / "labels.csv"), _table_bytes(_records(), "csv"))
    _run(lake, table, out, local_engine)
    shard_job.run(ShardConfig(dataset=out, engine="local", num_shards=1, image_size=16), local_engine)
    page = Path(storage.filesystem(report_job.write_report(out, read_dataset_info(out)))[1]).read_text()
    assert f"Labels from <code>{table}</code>" in page
    assert "1 label row(s) name no object under the input (e.g. <code>img_999.png</code>)" in page


# -- the table is checked before an engine starts -----------------------------------------------------


def _cfg(tmp_path: Path, table: str, **opts: Any) -> ManifestConfig:
    lake = tmp_path / "lake"
    lake.mkdir(exist_ok=True)
    return ManifestConfig(input=str(lake), output=str(tmp_path / "ds"), labels=table, split=SPLIT, **opts)


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("labels.csv", None, "--labels {uri} does not exist"),
        ("labels.parquet", b"not parquet at all", "--labels {uri} is not a readable parquet table"),
        ("labels.jsonl", b'{"key": "a.png", "label": "cat"}\n{oops\n', "--labels {uri}: line 2 is not JSON"),
        (
            "labels.csv",
            b"name,label\na.png,cat\n",
            "--labels {uri} has no 'key' or 'uri' column (its columns: ['name', 'label'])",
        ),
        ("labels.csv", b"key,class\na.png,cat\n", "--labels {uri} has no 'label' column"),
        ("labels.csv", b"key,label\na.png,cat\nb.png, \n", "--labels {uri}: row 2 has an empty 'label'"),
        ("labels.csv", b"key,label\n,cat\n", "--labels {uri}: row 1 has an empty 'key'"),
        (
            "labels.csv",
            b"key,label,channel\na.png,cat,train\nb.png,dog,holdout\n",
            "--labels {uri}: row 2 has channel 'holdout', which is not a channel of --split (train, validation, test)",
        ),
        ("labels.csv", b"key,label\n", "--labels {uri} has no rows"),
        ("labels.txt", b"key,label\na.png,cat\n", "--labels {uri}: unknown table format"),
    ],
)
def test_bad_table_fails_before_the_engine(
    tmp_path: Path, name: str, data: bytes | None, message: str
) -> None:
    uri = storage.normalize(str(tmp_path / name))
    if data is not None:
        _write(uri, data)
    with pytest.raises(ManifestError) as err:
        check_manifest_inputs(_cfg(tmp_path, uri))
    assert message.format(uri=uri) in str(err.value)


def test_labels_and_label_depth_cannot_be_combined(tmp_path: Path) -> None:
    uri = _write(str(tmp_path / "labels.csv"), b"key,label\na.png,cat\n")
    with pytest.raises(ConfigError, match=r"--labels .* and --label-depth 1 cannot be combined"):
        check_manifest_inputs(_cfg(tmp_path, uri, label_depth=1))
    check_manifest_inputs(_cfg(tmp_path, uri))  # the table alone is fine
    assert ManifestConfig(input="a", output="b").label_depth == 1  # path labels stay the default


def test_cli_bad_table_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lake").mkdir()
    uri = _write(str(tmp_path / "labels.csv"), b"key,label,channel\na.png,cat,holdout\n")
    code = manifest_job.main(
        [
            "--engine",
            "local",
            "--input",
            str(tmp_path / "lake"),
            "--output",
            str(tmp_path / "ds"),
            "--labels",
            uri,
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("jobs/manifest.py: error: --labels") and "'holdout'" in err[-1]


@pytest.mark.s3
def test_s3_table_missing(s3_bucket: str, tmp_path: Path) -> None:
    boto3.client("s3").put_object(
        Bucket=s3_bucket[len("s3://") :], Key="raw/a.png", Body=encode(make_image(1), "PNG")
    )
    cfg = ManifestConfig(input=f"{s3_bucket}/raw", output=f"{s3_bucket}/ds", labels=f"{s3_bucket}/nope.csv")
    with pytest.raises(ManifestError, match=f"--labels {s3_bucket}/nope.csv does not exist"):
        check_manifest_inputs(cfg)


def test_cli_with_the_shipped_conf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """conf/manifest.yaml sets no label_depth, so ``--labels`` works with it."""
    lake, out = storage.normalize(str(tmp_path / "lake")), str(tmp_path / "ds")
    _lake(lake)
    table = _write(str(tmp_path / "labels.jsonl"), _table_bytes(_records(), "jsonl"))
    code = manifest_job.main(
        [
            "--conf",
            "conf/manifest.yaml",
            "--engine",
            "local",
            "--input",
            lake,
            "--output",
            out,
            "--labels",
            table,
            "--split-method",
            "stratified",
        ]
    )
    assert code == 0, capsys.readouterr().err
    marker = read_manifest_info(out)
    assert (
        marker.counts.accepted == len(OBJECTS) - 1
        and marker.labels_table
        and marker.labels_table.unlabelled == 1
    )


@pytest.mark.slow
@pytest.mark.spark
def test_spark_writes_the_same_labelled_manifest(tmp_path: Path, spark_engine, local_engine) -> None:
    lake = storage.normalize(str(tmp_path / "lake"))
    _lake(lake)
    table = _write(str(tmp_path / "labels.parquet"), _table_bytes(_records(), "parquet"))
    summary = _run(lake, table, str(tmp_path / "spark"), spark_engine, split_method="stratified")
    _run(lake, table, str(tmp_path / "local"), local_engine, split_method="stratified")
    assert_same_manifest(str(tmp_path / "spark"), str(tmp_path / "local"))
    assert summary["labels_table"]["not_in_lake"] == 1 and summary["parts"] > 1


def test_one_class_left_names_the_labels_table(tmp_path: Path, local_engine) -> None:
    """Every row labelled alike: the error names the table the labels came from, not
    --label-depth (which a labels table does not use)."""
    root = storage.normalize(str(tmp_path))
    lake = storage.join(root, "lake")
    for i in range(6):
        _write(storage.join(lake, f"img_{i}.png"), encode(make_image(i), "PNG"))
    table = _write(
        storage.join(root, "labels.csv"),
        b"key,label\n" + "".join(f"img_{i}.png,cat\n" for i in range(6)).encode(),
    )
    with pytest.raises(
        ManifestError, match=rf"1 class only: 'cat'\. Check the labels of --labels {table}\.$"
    ):
        manifest_job.run(
            ManifestConfig(input=lake, output=str(tmp_path / "ds"), labels=table, engine="local"),
            local_engine,
        )
