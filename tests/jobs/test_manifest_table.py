"""Reading a channel's manifest rows, all or some classes, some columns."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.manifest_table import read_channel_rows
from lakeshard.errors import ManifestError


def _manifest(root: Path) -> None:
    (root / "manifests").mkdir(parents=True)
    rows = pa.table({"uri": [f"file:///l/{c}/{i}" for c in "abc" for i in range(3)],
                     "key": [f"{c}/{i}" for c in "abc" for i in range(3)],
                     "label": [c for c in "abc" for _ in range(3)],
                     "label_index": [i for i in range(3) for _ in range(3)]})
    pq.write_table(rows, root / "manifests" / "train.parquet", row_group_size=2)


def test_reads_the_rows_of_the_classes_asked_for(tmp_path: Path):
    _manifest(tmp_path)
    root = f"file://{tmp_path}"
    assert read_channel_rows(root, "train").num_rows == 9
    some = read_channel_rows(root, "train", labels=["c", "a"], columns=["key", "label"])
    assert some.column_names == ["key", "label"]
    assert sorted(some["key"].to_pylist()) == ["a/0", "a/1", "a/2", "c/0", "c/1", "c/2"]
    assert read_channel_rows(root, "train", labels=[]).num_rows == 0


def test_a_missing_channel_is_named(tmp_path: Path):
    _manifest(tmp_path)
    with pytest.raises(ManifestError, match="channel 'test' has no manifest table"):
        read_channel_rows(f"file://{tmp_path}", "test")
