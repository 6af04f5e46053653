"""Issue 35, labels: one value is one class whatever the table's format (CSV, JSON Lines,
Parquet, Ground Truth), surrounding spaces are not part of a class, lists and booleans are
refused naming the row, labels that differ only by case or spaces are warned about, integer
labels are numbered in numeric order, and a table in the wrong shape is named as such."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import manifest as manifest_job
from jobs.manifest_steps.catalog import build_manifest, encode_labels
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.labels import read_labels
from lakeshard import storage
from lakeshard.errors import ManifestError
from lakeshard.format.manifest_table import read_channel
from tests.helpers.lake import encode, make_image

CHANNELS = ("train", "validation", "test")


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return storage.normalize(str(path))


def _parquet(columns: dict[str, Any]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue()


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _labels(uri: str) -> list[str]:
    return read_labels(uri, channels=CHANNELS)["label"].to_pylist()


# -- one conversion for every format ---------------------------------------------------------


def test_a_number_is_the_same_class_in_every_format(tmp_path: Path) -> None:
    """0.0 in JSON, 0.0 and 0 in Parquet, 0 in JSON and "0" in CSV are one class, "0"; 2.5 is "2.5"."""
    jsonl = _write(
        tmp_path / "a.jsonl",
        _jsonl(
            [{"key": "a.png", "label": 0.0}, {"key": "b.png", "label": 0}, {"key": "c.png", "label": 2.5}]
        ),
    )
    floats = _write(
        tmp_path / "f.parquet", _parquet({"key": ["a.png", "c.png"], "label": pa.array([0.0, 2.5])})
    )
    ints = _write(tmp_path / "i.parquet", _parquet({"key": ["a.png"], "label": pa.array([0], pa.int64())}))
    csv = _write(tmp_path / "c.csv", b"key,label\na.png,0\n")
    assert _labels(jsonl) == ["0", "0", "2.5"]
    assert _labels(floats) == ["0", "2.5"]
    assert _labels(ints) == _labels(csv) == ["0"]


def test_surrounding_spaces_are_not_part_of_a_label_or_channel(tmp_path: Path) -> None:
    csv = _write(
        tmp_path / "c.csv", b"key,label,channel\na.png,cat ,train\nb.png, cat,test \nc.png,\tdog\t,\n"
    )
    table = read_labels(csv, channels=CHANNELS)
    assert table["label"].to_pylist() == ["cat", "cat", "dog"]
    assert table["channel"].to_pylist() == ["train", "test", None]
    jsonl = _write(tmp_path / "j.jsonl", _jsonl([{"key": "a.png", "label": " cat"}]))
    assert _labels(jsonl) == ["cat"]


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        (
            "l.jsonl",
            _jsonl([{"key": "a.png", "label": "cat"}, {"key": "b.png", "label": ["cat"]}]),
            "--labels {uri}: line 2: 'label' is a list (['cat'])",
        ),
        (
            "l.jsonl",
            _jsonl([{"key": "a.png", "label": True}]),
            "--labels {uri}: line 1: 'label' is a boolean (True)",
        ),
        (
            "l.jsonl",
            _jsonl([{"key": "a.png", "label": "cat"}, {"key": "b.png", "label": {"name": "cat"}}]),
            "--labels {uri}: line 2: 'label' is an object ({'name': 'cat'})",
        ),
        ("l.jsonl", _jsonl([{"key": ["a.png"], "label": "cat"}]), "--labels {uri}: line 1: 'key' is a list"),
        (
            "l.parquet",
            _parquet({"key": ["a.png", "b.png"], "label": pa.array([False, True])}),
            "--labels {uri}: row 1: 'label' is a boolean (False)",
        ),
        (
            "l.parquet",
            _parquet({"key": ["a.png", "b.png"], "label": pa.array([None, ["cat", "dog"]])}),
            "--labels {uri}: row 2: 'label' is a list (['cat', 'dog'])",
        ),
    ],
)
def test_lists_booleans_and_objects_are_refused_naming_the_row(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    uri = _write(tmp_path / name, data)
    with pytest.raises(ManifestError) as err:
        read_labels(uri, channels=CHANNELS)
    assert message.replace("{uri}", uri) in str(err.value)
    assert "one class" in str(err.value)


# -- the table's shape -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "found"),
    [
        (
            "l.json",
            b'[{"key": "a.png", "label": "cat"},\n {"key": "b.png", "label": "dog"}]\n',
            "a JSON array (of 2 items)",
        ),
        ("l.json", b'[\n  {"key": "a.png", "label": "cat"}\n]\n', "a JSON array (of 1 item)"),
        ("l.json", b'{"a.png": "cat", "b.png": "dog"}\n', "one JSON object of 2 members ('a.png', 'b.png')"),
        ("l.json", b'{\n  "a.png": "cat"\n}\n', "one JSON object of 1 member ('a.png')"),
    ],
)
def test_a_json_document_is_named_as_such(tmp_path: Path, name: str, data: bytes, found: str) -> None:
    uri = _write(tmp_path / name, data)
    with pytest.raises(ManifestError) as err:
        read_labels(uri, channels=CHANNELS)
    text = str(err.value)
    assert text.startswith(f"--labels {uri} holds {found}"), text
    assert "JSON Lines" in text and '{"key": "a.png", "label": "cat"}' in text
    assert "is not JSON:" not in text and "columns: []" not in text


@pytest.mark.parametrize(
    ("data", "separator"), [(b"key;label\na.png;cat\n", "';'"), (b"key\tlabel\na.png\tcat\n", "a tab")]
)
def test_a_csv_with_another_separator_is_named_as_such(tmp_path: Path, data: bytes, separator: str) -> None:
    uri = _write(tmp_path / "l.csv", data)
    with pytest.raises(ManifestError) as err:
        read_labels(uri, channels=CHANNELS)
    text = str(err.value)
    header = data.splitlines()[0].decode()
    assert f"--labels {uri}: its header {header!r} is separated by {separator}" in text, text
    assert "comma-separated" in text


def test_the_shape_errors_come_before_the_engine(tmp_path: Path) -> None:
    (tmp_path / "lake").mkdir()
    uri = _write(tmp_path / "labels.json", b'[{"key": "a.png", "label": "cat"}]')
    cfg = ManifestConfig(input=str(tmp_path / "lake"), output=str(tmp_path / "ds"), labels=uri)
    with pytest.raises(ManifestError, match="holds a JSON array"):
        check_manifest_inputs(cfg)


# -- class ids -------------------------------------------------------------------------------


def test_integer_labels_are_numbered_in_numeric_order() -> None:
    assert encode_labels([str(i) for i in range(12)]) == {str(i): i for i in range(12)}
    assert encode_labels(["-1", "10", "2"]) == {"-1": 0, "2": 1, "10": 2}
    assert encode_labels(["10", "2", "cat"]) == {"10": 0, "2": 1, "cat": 2}  # not all integers: as text


def _lake(root: Path, labels: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, key in enumerate(labels):
        (root / key).write_bytes(encode(make_image(i), "PNG"))


def test_the_manifest_job_numbers_integer_classes_as_the_user_does(tmp_path: Path, local_engine) -> None:
    """Twelve classes 0..11 from a Parquet table of integers: class i is index i in
    labels.json, in _manifest.json and in every row."""
    labels = {f"img_{i:03d}.png": str(i % 12) for i in range(48)}
    _lake(tmp_path / "lake", labels)
    table = _write(
        tmp_path / "labels.parquet",
        _parquet({"key": list(labels), "label": pa.array([int(v) for v in labels.values()])}),
    )
    out, again = (storage.normalize(str(tmp_path / n)) for n in ("ds", "again"))
    opts: dict[str, Any] = {
        "input": str(tmp_path / "lake"),
        "labels": table,
        "engine": "local",
        "split": {"train": 0.5, "test": 0.5},
        "split_method": "stratified",
    }
    summary = manifest_job.run(ManifestConfig(output=out, **opts), local_engine)
    assert summary["labels"] == {str(i): i for i in range(12)}
    assert storage.read_json(storage.join(out, "labels.json")) == {str(i): i for i in range(12)}
    rows = read_channel(out, "all").to_pylist()
    assert all(r["label_index"] == int(r["label"]) for r in rows)
    # Incremental (--base), the same indices.
    rebuilt = manifest_job.run(ManifestConfig(output=again, base=out, **opts), local_engine)
    assert rebuilt["labels"] == summary["labels"] and rebuilt["base"]["reused"] == len(labels)
    assert {r["key"]: r["label_index"] for r in read_channel(again, "all").to_pylist()} == {
        r["key"]: r["label_index"] for r in rows
    }


def test_a_trailing_space_is_one_class_and_a_case_twin_is_warned_about(
    tmp_path: Path, local_engine, caplog: pytest.LogCaptureFixture
) -> None:
    labels = {f"img_{i:03d}.png": ["cat", "cat ", "dog", "Dog"][i % 4] for i in range(32)}
    _lake(tmp_path / "lake", labels)
    table = _write(
        tmp_path / "labels.csv", ("key,label\n" + "".join(f"{k},{v}\n" for k, v in labels.items())).encode()
    )
    out = storage.normalize(str(tmp_path / "ds"))
    with caplog.at_level(logging.WARNING):
        summary = manifest_job.run(
            ManifestConfig(
                input=str(tmp_path / "lake"),
                output=out,
                labels=table,
                engine="local",
                split={"train": 0.5, "test": 0.5},
                split_method="stratified",
            ),
            local_engine,
        )
    assert summary["labels"] == {"Dog": 0, "cat": 1, "dog": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("differ only by case or spaces" in w and "'Dog', 'dog'" in w for w in warnings), warnings
    assert not any("'cat'," in w for w in warnings), warnings


def test_path_labels_that_differ_only_by_case_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    rows = [
        {
            "key": f"{label}/{i}.png",
            "label": label,
            "status": "ok",
            "reason": None,
            "uri": f"file:///l/{label}/{i}.png",
            "size": 1,
            "etag": str(i),
            "last_modified": None,
            "format": "png",
            "channel": None,
            "label_index": None,
        }
        for i, label in enumerate(["Golden Retriever", "golden retriever", "cat", "cat", "poodle", "poodle"])
    ]
    with caplog.at_level(logging.WARNING):
        build_manifest(rows, split={"train": 1.0}, seed=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'Golden Retriever', 'golden retriever'" in w for w in warnings), warnings


def test_ground_truth_values_convert_as_the_tables_do() -> None:
    """A class index written 0.0 finds its class-map entry "0"; a class name keeps no
    surrounding spaces."""
    from jobs.manifest_steps.ground_truth_lines import label_of

    meta = {"type": "groundtruth/image-classification", "class-map": {"0": "cat", "1": "dog"}}
    assert label_of({"animal": 0.0, "animal-metadata": meta}, "animal") == ("cat", None)
    assert label_of({"animal": 1, "animal-metadata": meta}, "animal") == ("dog", None)
    assert label_of({"animal": 0, "animal-metadata": {"class-name": " cat "}}, "animal") == ("cat", None)
    assert label_of({"animal": "dog\t"}, "animal") == ("dog", None)
