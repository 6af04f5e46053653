"""Issue 35: ``--base`` compares what the labels are, not where they live. A labels table copied
to a new URI (a dated export) or a new Ground Truth job's output is accepted; a table whose rows
changed, at the same URI or another, is accepted too, and every object whose label changed is
counted (``base.relabelled``, with examples) and logged; the manifest is the one a build from
scratch writes either way. Path labels and a table are still two different label sources."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from jobs import manifest as manifest_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from lakeshard import storage
from lakeshard.errors import ManifestError
from tests.helpers.incremental import assert_same_tables, build, write_lake_objects


def _table(uri: str, keys: list[str], *, relabel: dict[str, str] | None = None) -> str:
    relabel = relabel or {}
    lines = ["key,label", *(f"{k},{relabel.get(k, k.split('/')[0])}" for k in sorted(keys))]
    storage.write_bytes_atomic(uri, ("\n".join(lines) + "\n").encode())
    return storage.normalize(uri)


def _dirs(tmp_path: Path) -> tuple[str, str, str, str]:
    lake, a, b, c = (storage.normalize(str(tmp_path / n)) for n in ("lake", "a", "b", "c"))
    return lake, a, b, c


def test_the_same_table_at_a_new_uri_is_accepted(tmp_path: Path, local_engine) -> None:
    lake, a, b, c = _dirs(tmp_path)
    keys = write_lake_objects(lake)
    july = _table(str(tmp_path / "labels_2024-07.csv"), keys)
    build(local_engine, lake, a, labels=july)
    august = _table(str(tmp_path / "labels_2024-08.csv"), keys)  # byte for byte the same
    summary = build(local_engine, lake, b, base=a, labels=august)
    build(local_engine, lake, c, labels=august)
    assert_same_tables(b, c)
    assert (summary["base"]["relabelled"], summary["base"]["relabelled_examples"]) == (0, [])
    assert summary["base"]["reused"] == len(keys)  # the no-image reject included: nothing is read


def test_changed_labels_are_counted_at_the_same_uri_or_another(
    tmp_path: Path, local_engine, caplog: pytest.LogCaptureFixture
) -> None:
    lake, a, b, c = _dirs(tmp_path)
    keys = write_lake_objects(lake)
    table = _table(str(tmp_path / "labels.csv"), keys)
    build(local_engine, lake, a, labels=table)
    moved = {"cat/img_001.png": "dog", "fox/img_002.png": "cat"}
    for where in (table, str(tmp_path / "labels_fixed.csv")):
        fixed = _table(where, keys, relabel=moved)
        with caplog.at_level(logging.WARNING):
            summary = build(local_engine, lake, b, base=a, labels=fixed, overwrite=True)
        build(local_engine, lake, c, labels=fixed, overwrite=True)
        assert_same_tables(b, c)
        base = summary["base"]
        assert base["relabelled"] == 2
        assert base["relabelled_examples"] == [
            {"key": "cat/img_001.png", "from": "cat", "to": "dog"},
            {"key": "fox/img_002.png", "from": "fox", "to": "cat"},
        ]
        assert any("2 objects have another label than in --base" in r.getMessage() for r in caplog.records)
        caplog.clear()


def test_the_cli_prints_the_relabelled_count(
    tmp_path: Path, local_engine, capsys: pytest.CaptureFixture[str]
) -> None:
    lake, a, _, _ = _dirs(tmp_path)
    keys = write_lake_objects(lake)
    build(local_engine, lake, a, labels=_table(str(tmp_path / "old.csv"), keys))
    fixed = _table(str(tmp_path / "new.csv"), keys, relabel={"dog/img_004.png": "fox"})
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
            "--labels",
            fixed,
            "--seed",
            "5",
            "--split",
            "train=0.6,validation=0.2,test=0.2",
        ]
    )
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("0 moved to another channel, 1 relabelled (e.g. dog/img_004.png: dog -> fox)"), last


def _gt(uri: str, lake: str, keys: list[str], attribute: str) -> str:
    lines = [
        {
            "source-ref": f"{lake}/{k}",
            attribute: k.split("/")[0],
            f"{attribute}-metadata": {"type": "groundtruth/image-classification", "job-name": attribute},
        }
        for k in sorted(keys)
    ]
    storage.write_bytes_atomic(uri, "".join(json.dumps(x) + "\n" for x in lines).encode())
    return storage.normalize(uri)


def test_a_new_ground_truth_job_with_the_same_labels_is_accepted(tmp_path: Path, local_engine) -> None:
    """Each Ground Truth job writes its own output path, under its own label attribute."""
    lake, a, b, c = _dirs(tmp_path)
    keys = [k for k in write_lake_objects(lake) if k.endswith(".png") and "notes" not in k]
    first = _gt(str(tmp_path / "jobs" / "animals-1" / "output.manifest"), lake, keys, "animals-1")
    build(local_engine, lake, a, input_manifest=first, label_attribute="animals-1")
    second = _gt(str(tmp_path / "jobs" / "animals-2" / "output.manifest"), lake, keys, "animals-2")
    summary = build(local_engine, lake, b, base=a, input_manifest=second, label_attribute="animals-2")
    build(local_engine, lake, c, input_manifest=second, label_attribute="animals-2")
    assert_same_tables(b, c)
    assert summary["base"]["relabelled"] == 0 and summary["base"]["reused"] == len(keys)


def test_path_labels_and_a_table_are_still_two_sources(tmp_path: Path, local_engine) -> None:
    lake, a, _, _ = _dirs(tmp_path)
    keys = write_lake_objects(lake)
    build(local_engine, lake, a)
    table = _table(str(tmp_path / "labels.csv"), keys)
    cfg: dict[str, Any] = {"seed": 5, "split": {"train": 0.6, "validation": 0.2, "test": 0.2}}
    with pytest.raises(
        ManifestError,
        match=r"took its labels from the path \(--label-depth 1\), this run from "
        rf"--labels {table}",
    ):
        check_manifest_inputs(
            ManifestConfig(input=lake, output=str(tmp_path / "b"), base=a, labels=table, **cfg)
        )
