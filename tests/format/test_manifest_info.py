"""The typed model of ``manifests/_manifest.json`` (:mod:`lakeshard.format.manifest_info`)."""

from __future__ import annotations

import json
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from jobs import manifest as manifest_job
from jobs.common.engines.local_engine import LocalEngine
from jobs.manifest_steps.config import ManifestConfig
from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format import (
    FORMAT_VERSION,
    TASK_FORMAT_VERSION,
    ManifestInfo,
    manifest_marker_uri,
    read_manifest_info,
    write_manifest_info,
)
from tests.helpers.lake import write_lake


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A manifest the job wrote (its bytes are the contract)."""
    tmp = tmp_path_factory.mktemp("manifest_info")
    write_lake(tmp / "raw", {"cat": 12, "dog": 9, "fox": 7})
    (tmp / "raw" / "dog" / ".hidden.png").write_bytes(b"x")
    out = storage.normalize(str(tmp / "ds"))
    cfg = ManifestConfig(
        input=str(tmp / "raw"),
        output=out,
        max_reject_fraction=1.0,
        rows_per_part=10,
        split_method="stratified",
    )
    manifest_job.run(cfg, LocalEngine(workers=2))
    return out


def test_the_written_file_round_trips_byte_for_byte(written: str, tmp_path: Path) -> None:
    data = storage.read_bytes(manifest_marker_uri(written))
    info = read_manifest_info(written)
    assert info.to_json() == json.loads(data)
    again = storage.normalize(str(tmp_path))
    write_manifest_info(again, info)
    assert storage.read_bytes(manifest_marker_uri(again)) == data
    assert info.counts.listed == 28 and info.counts.skipped == 1 and info.labels_table is None


def test_another_format_version_is_refused_naming_the_file(written: str) -> None:
    """Versions 3 and 4 (labels beyond one class, issue 51) are read; any other is refused."""
    data = read_manifest_info(written).to_json()
    newer = TASK_FORMAT_VERSION + 1
    for version, who in ((FORMAT_VERSION - 1, "an older"), (newer, "a newer"), (None, "other")):
        with pytest.raises(DatasetError, match=f"_manifest.json has format_version {version!r}.*{who}"):
            ManifestInfo.from_json({**data, "format_version": version}, source="x/_manifest.json")


def test_fields_an_older_writer_left_out_take_their_defaults(written: str) -> None:
    data = read_manifest_info(written).to_json()
    for key in ("split_order", "skipped_by_reason", "skipped_examples", "duplicates"):
        del data[key]
    del data["counts"]["classes"]
    info = ManifestInfo.from_json(data)
    assert info.split_order is None and info.duplicates is None and info.counts.classes == {}
    assert "split_order" not in info.to_json()


def test_a_mistyped_or_missing_field_is_named(written: str) -> None:
    data = read_manifest_info(written).to_json()
    with pytest.raises(DatasetError, match=r"m.json: field counts.listed must be an integer, got 'x'"):
        ManifestInfo.from_json({**data, "counts": {**data["counts"], "listed": "x"}}, source="m.json")
    with pytest.raises(DatasetError, match=r"m.json: field fingerprint is missing"):
        ManifestInfo.from_json({k: v for k, v in data.items() if k != "fingerprint"}, source="m.json")
    with pytest.raises(DatasetError, match="parts must be a positive integer, got 0"):
        ManifestInfo.from_json({**data, "parts": 0}, source="m.json")


def test_no_manifest_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"no complete manifest at .*_manifest.json is missing"):
        read_manifest_info(str(tmp_path))


def test_replace_keeps_a_model(written: str) -> None:
    info = read_manifest_info(written)
    assert ManifestInfo.from_json(replace(info, fingerprint="f").to_json()).fingerprint == "f"


def test_the_row_types_name_the_tables_columns() -> None:
    from jobs.manifest_steps.listing import StagedRow
    from jobs.manifest_steps.passes import STAGED_SCHEMA
    from lakeshard.format import MANIFEST_SCHEMA
    from lakeshard.format.manifest_table import ManifestRow

    assert list(ManifestRow.__annotations__) == MANIFEST_SCHEMA.names
    assert list(typing.get_type_hints(StagedRow)) == STAGED_SCHEMA.names
