"""Issue 51 (the manifest job's side): a ``--labels`` table with several labels per image, boxes
and kept columns, on a lake of drawn shapes whose classes and boxes are known. Every input form
parses to the same manifest; bad values are counted rejects with their reason; the multi-label
split keeps every label in each channel and every image's boxes with it; the task is recorded
and the shard job refuses ``--base`` with it (tests/jobs/shard/test_labels_beyond_one_class.py
shards them)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import ExifTags, Image, ImageOps

from jobs import build
from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import ConfigError, ManifestError, ShardError
from lakeshard.format import TASK_FORMAT_VERSION, manifest_part_uri, read_manifest_info
from lakeshard.format.manifest_table import read_channel
from tests.helpers.shapes import SHAPES, Drawn, shapes_lake
from tests.jobs.engines.compare import assert_same_manifest

SPLIT = {"train": 0.6, "validation": 0.2, "test": 0.2}
N = 60


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Drawn]]:
    root = tmp_path_factory.mktemp("shapes")
    drawn = shapes_lake(root / "lake", N, seed=5)
    return storage.normalize(str(root / "lake")), drawn


def _csv(records: list[dict[str, Any]]) -> bytes:
    """A CSV of ``records``, lists as JSON text in their cells."""
    names = list(dict.fromkeys(k for r in records for k in r))
    out = io.StringIO()
    out.write(",".join(names) + "\n")
    for r in records:
        cells = [json.dumps(r[n]) if isinstance(r.get(n), list) else str(r.get(n, "")) for n in names]
        out.write(",".join('"' + c.replace('"', '""') + '"' for c in cells) + "\n")
    return out.getvalue().encode()


def _table(path: Path, records: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "csv":
        data = _csv(records)
    elif fmt == "jsonl":
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
    else:
        sink = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(records), sink)
        data = sink.getvalue()
    uri = storage.normalize(str(path.with_suffix("." + fmt)))
    storage.write_bytes_atomic(uri, data)
    return uri


def _run(lake: str, table: str, out: Path, engine: Any, **opts: Any) -> dict[str, Any]:
    cfg = ManifestConfig(
        input=lake,
        output=str(out),
        labels=table,
        split=SPLIT,
        seed=4,
        engine=engine.name,
        rows_per_part=16,
        max_reject_fraction=0.3,
        **opts,
    )
    return manifest_job.run(cfg, engine)


def _accepted(out: Path) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in read_channel(str(out), "all").to_pylist() if r["status"] == "ok"}


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_a_labels_list_and_a_row_per_label_give_each_image_its_set(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine, fmt: str
) -> None:
    root, drawn = lake
    lists = [{"key": d.key, "labels": d.labels} for d in drawn]
    rows = [{"key": d.key, "label": label} for d in drawn for label in d.labels]
    by_list = _run(
        root, _table(tmp_path / "lists", lists, fmt), tmp_path / "a", local_engine, task="multi-label"
    )
    _run(root, _table(tmp_path / "rows", rows, fmt), tmp_path / "b", local_engine, task="multi-label")
    accepted = _accepted(tmp_path / "a")
    assert {k: r["labels"] for k, r in accepted.items()} == {d.key: d.labels for d in drawn}
    index = by_list["labels"]
    assert index == {name: i for i, name in enumerate(SHAPES)}
    assert all(r["label_indices"] == [index[x] for x in r["labels"]] for r in accepted.values())
    assert all(r["label"] is None and r["label_index"] is None for r in accepted.values())
    assert {k: (r["labels"], r["channel"]) for k, r in _accepted(tmp_path / "b").items()} == {
        k: (r["labels"], r["channel"]) for k, r in accepted.items()
    }


def test_the_stratified_multi_label_split_keeps_every_label_in_every_channel(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    table = _table(tmp_path / "t", [{"key": d.key, "labels": d.labels} for d in drawn], "jsonl")
    summary = _run(root, table, tmp_path / "ds", local_engine, task="multi-label", split_method="stratified")
    accepted = _accepted(tmp_path / "ds")
    for label in SHAPES:
        having = [r["channel"] for r in accepted.values() if label in r["labels"]]
        assert set(having) == set(SPLIT), (label, having)
        for channel, fraction in SPLIT.items():  # each label spread as asked, within two images
            assert abs(having.count(channel) - fraction * len(having)) <= 2, (label, channel, having)
    counted = {c: {x: 0 for x in SHAPES} for c in SPLIT}
    for r in accepted.values():
        for x in r["labels"]:
            counted[r["channel"]][x] += 1
    assert summary["counts"]["classes"] == counted
    assert summary["counts"]["channels"] == {
        c: sum(r["channel"] == c for r in accepted.values()) for c in SPLIT
    }
    again = _run(root, table, tmp_path / "again", local_engine, task="multi-label", split_method="stratified")
    assert again["fingerprint"] == summary["fingerprint"]  # the same seed, the same split


def test_boxes_stay_with_their_image_and_the_task_is_recorded(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    records = [
        {"key": d.key, "boxes": [s.box() for s in d.shapes], "caption": f"{len(d.shapes)} shapes", "n": i}
        for i, d in enumerate(drawn)
    ]
    table = _table(tmp_path / "boxes", records, "parquet")
    summary = _run(
        root,
        table,
        tmp_path / "ds",
        local_engine,
        task="boxes",
        split_method="stratified",
        keep_columns=("caption", "n"),
    )
    accepted = _accepted(tmp_path / "ds")
    assert len(accepted) == N
    for d in drawn:
        row = accepted[d.key]
        assert [{k: b[k] for k in ("label", "x", "y", "width", "height")} for b in row["boxes"]] == [
            s.box() for s in d.shapes
        ]
        assert {b["label_index"] for b in row["boxes"]} == {summary["labels"][s.label] for s in d.shapes}
        assert (row["image_width"], row["image_height"], row["labels"]) == (d.width, d.height, d.labels)
        assert row["caption"] == f"{len(d.shapes)} shapes"
    for channel in SPLIT:  # every box of an image is in its image's channel table
        part = read_channel(str(tmp_path / "ds"), channel).to_pylist()
        assert all(len(r["boxes"]) == len(accepted[r["key"]]["boxes"]) for r in part)
    schema = pq.read_schema(storage.local_path(manifest_part_uri(str(tmp_path / "ds"), "train", 0, 1)))
    assert schema.field("n").type == pa.int64() and schema.field("caption").type == pa.string()
    info = read_manifest_info(str(tmp_path / "ds"))
    assert (info.format_version, info.task_kind) == (TASK_FORMAT_VERSION, "boxes")
    assert info.columns is not None and {"boxes", "image_width", "caption", "n"} <= set(info.columns)
    with pytest.raises(ShardError, match=r"^--base \S+ cannot be combined with the boxes manifest at "):
        cfg = ShardConfig(dataset=str(tmp_path / "ds"), engine="local", num_shards=1, base=str(tmp_path))
        shard_job.run(cfg, local_engine)


def test_normalised_boxes_are_the_same_boxes_in_pixels(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    scaled = [
        {
            "key": d.key,
            "boxes": [
                {
                    "label": s.label,
                    "x": s.x / d.width,
                    "y": s.y / d.height,
                    "width": s.width / d.width,
                    "height": s.height / d.height,
                }
                for s in d.shapes
            ],
        }
        for d in drawn
    ]
    pixels = [{"key": d.key, "boxes": [s.box() for s in d.shapes]} for d in drawn]
    _run(
        root,
        _table(tmp_path / "n", scaled, "jsonl"),
        tmp_path / "n",
        local_engine,
        task="boxes",
        box_units="normalized",
    )
    _run(root, _table(tmp_path / "p", pixels, "jsonl"), tmp_path / "p", local_engine, task="boxes")
    normal, pixel = _accepted(tmp_path / "n"), _accepted(tmp_path / "p")
    for key, row in pixel.items():
        for a, b in zip(normal[key]["boxes"], row["boxes"], strict=True):
            assert (
                all(abs(a[k] - b[k]) < 1e-6 for k in ("x", "y", "width", "height"))
                and a["label"] == b["label"]
            )


def test_bad_values_are_counted_rejects_with_their_reason(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    records = [{"key": d.key, "boxes": [s.box() for s in d.shapes]} for d in drawn]
    bad = {
        drawn[0].key: [
            {"label": "circle", "x": 60, "y": 0, "width": 10, "height": 10}
        ],  # past the right edge
        drawn[1].key: [{"label": "circle", "x": 1, "y": 1, "width": -4, "height": 5}],
        drawn[2].key: "not a list",
        drawn[3].key: [{"x": 1, "y": 1, "width": 4, "height": 5}],
    }
    for r in records:
        r["boxes"] = bad.get(r["key"], r["boxes"])
    summary = _run(
        root,
        _table(tmp_path / "bad", records, "jsonl"),
        tmp_path / "ds",
        local_engine,
        task="boxes",
        min_per_class=0,
    )
    rejects = {r["key"]: r["reason"] for r in read_channel(str(tmp_path / "ds"), "rejects").to_pylist()}
    assert rejects == {
        drawn[0].key: "bad box: box 1 (circle) ends at x=70, y=10, outside the 64x48 image",
        drawn[1].key: "bad box: box 1 has width=-4, height=5; both must be positive",
        drawn[2].key: "bad box: 'boxes' is not a list: 'not a list'",
        drawn[3].key: "bad box: box 1 has no label",
    }
    assert summary["rejects_by_reason"] == {"bad box": 4}
    assert summary["counts"]["accepted"] == N - 4

    mixed = [{"key": d.key, "labels": d.labels} for d in drawn] + [{"key": drawn[5].key, "label": "square"}]
    mixed[6] = {"key": drawn[6].key, "labels": "[circle"}
    summary = _run(
        root,
        _table(tmp_path / "mixed", mixed, "jsonl"),
        tmp_path / "m",
        local_engine,
        task="multi-label",
        min_per_class=0,
    )
    rejects = {r["key"]: r["reason"] for r in read_channel(str(tmp_path / "m"), "rejects").to_pylist()}
    assert rejects[drawn[5].key].startswith("mixed labels: a 'labels' list in one row and a single 'label'")
    assert rejects[drawn[6].key] == "bad labels: 'labels' is not a list: '[circle'"
    assert summary["rejects_by_reason"] == {"bad labels": 1, "mixed labels": 1}


def test_single_label_manifests_have_no_task_and_the_old_version(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    table = _table(tmp_path / "one", [{"key": d.key, "label": d.labels[0]} for d in drawn], "csv")
    summary = _run(root, table, tmp_path / "ds", local_engine, min_per_class=0)
    assert "task" not in summary and "columns" not in summary and summary["format_version"] == 3
    assert read_channel(str(tmp_path / "ds"), "all").column_names[-1] == "reason"


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (
            {"task": "multi-label", "labels": None},
            r"--task multi-label reads its labels from a --labels table",
        ),
        ({"keep_columns": ("status",)}, r"'status' is a column the manifest job writes itself"),
        ({"task": "boxes", "sniff": False}, r"--task boxes cannot be combined with --no-sniff"),
    ],
)
def test_options_that_cannot_carry_the_labels_are_refused(
    tmp_path: Path, lake: tuple[str, list[Drawn]], opts: dict[str, Any], message: str
) -> None:
    root, drawn = lake
    table = _table(
        tmp_path / "t", [{"key": d.key, "labels": d.labels, "status": "x"} for d in drawn], "jsonl"
    )
    cfg = ManifestConfig(input=root, output=str(tmp_path / "ds"), **{"labels": table, **opts})
    with pytest.raises(ConfigError, match=message):
        check_manifest_inputs(cfg)


@pytest.mark.dask
def test_dask_writes_the_same_multi_label_manifest(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine, dask_engine
) -> None:
    root, drawn = lake
    records = [{"key": d.key, "boxes": [s.box() for s in d.shapes], "caption": d.key[:5]} for d in drawn]
    table = _table(tmp_path / "t", records, "csv")
    opts: dict[str, Any] = {"task": "boxes", "split_method": "stratified", "keep_columns": ("caption",)}
    _run(root, table, tmp_path / "dask", dask_engine, **opts)
    _run(root, table, tmp_path / "local", local_engine, **opts)
    assert assert_same_manifest(str(tmp_path / "dask"), str(tmp_path / "local")).task == "boxes"


def _ground_truth(lake: str, drawn: list[Drawn], task: str) -> list[dict[str, Any]]:
    """Ground Truth output lines for ``drawn`` as the documented output manifests have them
    (``sms-data-output``): class indices named by the metadata's ``class-map`` (not 0..K-1)."""
    ids = {"circle": 4, "square": 0, "triangle": 7}
    class_map = {str(i): name for name, i in ids.items()}
    lines = []
    for d in drawn:
        ref = storage.join(lake, d.key)
        if task == "boxes":
            value: Any = {
                "image_size": [{"width": d.width, "height": d.height, "depth": 3}],
                "annotations": [
                    {"class_id": ids[s.label], "left": s.x, "top": s.y, "width": s.width, "height": s.height}
                    for s in d.shapes
                ],
            }
            meta = {
                "objects": [{"confidence": 0.9} for _ in d.shapes],
                "type": "groundtruth/object-detection",
            }
        else:
            value = [ids[x] for x in d.labels]
            meta = {"confidence-map": {str(ids[x]): 0.95 for x in d.labels}}
            meta["type"] = "groundtruth/image-classification-multilabel"
        meta |= {"class-map": class_map, "human-annotated": "yes", "job-name": "labeling-job/shapes"}
        lines.append({"source-ref": ref, "shapes": value, "shapes-metadata": meta})
    return lines


def _write_lines(path: Path, lines: list[dict[str, Any]]) -> str:
    uri = storage.normalize(str(path))
    storage.write_bytes_atomic(uri, "".join(json.dumps(line) + "\n" for line in lines).encode())
    return uri


def _run_ground_truth(lake: str, manifest: str, out: Path, engine: Any, task: str) -> dict[str, Any]:
    cfg = ManifestConfig(
        input=lake,
        output=str(out),
        input_manifest=manifest,
        label_attribute="shapes",
        task=task,
        split=SPLIT,
        split_method="stratified",
        engine=engine.name,
        max_reject_fraction=0.3,
        min_per_class=0,
    )
    check_manifest_inputs(cfg)
    return manifest_job.run(cfg, engine)


def test_ground_truth_bounding_boxes_and_multi_label_lines(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    lines = _ground_truth(root, drawn, "boxes")
    lines[0]["shapes"]["annotations"][0]["class_id"] = 9  # not in the class-map
    lines[1]["shapes"]["annotations"][0]["width"] = -3
    lines[2] = {"source-ref": lines[2]["source-ref"], "shapes-metadata": {"failure-reason": "timed out"}}
    summary = _run_ground_truth(
        root, _write_lines(tmp_path / "boxes.manifest", lines), tmp_path / "b", local_engine, "boxes"
    )
    accepted = _accepted(tmp_path / "b")
    for d in drawn[3:]:
        boxes = accepted[d.key]["boxes"]
        assert [{k: b[k] for k in ("label", "x", "y", "width", "height")} for b in boxes] == [
            s.box() for s in d.shapes
        ]
        assert {b["confidence"] for b in boxes} == {0.9}
    rejects = {r["key"]: r["reason"] for r in read_channel(str(tmp_path / "b"), "rejects").to_pylist()}
    assert rejects == {
        drawn[0].key: "unknown class: class index 9 is not in shapes-metadata's class-map",
        drawn[1].key: "bad box: box 1 has width=-3, height="
        + f"{drawn[1].shapes[0].height}; both must be positive",
        drawn[2].key: "no label: the line has no 'shapes' in --input-manifest (failure-reason: timed out)",
    }
    assert summary["labels"] == {name: i for i, name in enumerate(SHAPES)} and summary["task"] == "boxes"

    multi = _run_ground_truth(
        root,
        _write_lines(tmp_path / "multi.manifest", _ground_truth(root, drawn, "multi-label")),
        tmp_path / "m",
        local_engine,
        "multi-label",
    )
    assert {k: r["labels"] for k, r in _accepted(tmp_path / "m").items()} == {d.key: d.labels for d in drawn}
    assert multi["labels_table"]["format"] == "sagemaker-ground-truth" and multi["task"] == "multi-label"


def test_a_ground_truth_line_of_another_task_is_refused(
    tmp_path: Path, lake: tuple[str, list[Drawn]], local_engine
) -> None:
    root, drawn = lake
    manifest = _write_lines(tmp_path / "boxes.manifest", _ground_truth(root, drawn, "boxes"))
    with pytest.raises(
        ManifestError, match=r"line 1: 'shapes' is .*: not a multi-label image classification"
    ):
        _run_ground_truth(root, manifest, tmp_path / "x", local_engine, "multi-label")


@pytest.mark.parametrize("dedupe", [False, True])
def test_identical_images_with_several_labels_are_reported(
    tmp_path: Path, local_engine, dedupe: bool
) -> None:
    """The duplicates (leakage) report counts multi-label images as it counts single-label ones."""
    drawn = shapes_lake(tmp_path / "lake", 24, seed=9)
    (tmp_path / "lake" / "copy.png").write_bytes((tmp_path / "lake" / drawn[0].key).read_bytes())
    records = [{"key": d.key, "labels": d.labels} for d in drawn] + [
        {"key": "copy.png", "labels": ["square"]}
    ]
    summary = _run(
        storage.normalize(str(tmp_path / "lake")),
        _table(tmp_path / "t", records, "jsonl"),
        tmp_path / "ds",
        local_engine,
        task="multi-label",
        min_per_class=0,
        dedupe=dedupe,
    )
    found = summary["duplicates"]
    rows = {r["key"]: r for r in read_channel(str(tmp_path / "ds"), "all").to_pylist()}
    if dedupe:
        assert found["removed"] == 1 and found["groups"] == 0
        assert rows["img_0000.png"]["reason"] == "duplicate: same content as 'copy.png'"
    else:
        assert (found["groups"], found["objects"]) == (1, 2)
        leaks = rows["copy.png"]["channel"] != rows["img_0000.png"]["channel"]
        assert found["across_channels"] == int(leaks)


@pytest.mark.slow
@pytest.mark.spark
def test_spark_writes_the_same_boxes_manifest(
    tmp_path: Path, lake: tuple[str, list[Drawn]], spark_engine, local_engine
) -> None:
    root, drawn = lake
    table = _table(
        tmp_path / "t", [{"key": d.key, "boxes": [s.box() for s in d.shapes]} for d in drawn], "parquet"
    )
    opts: dict[str, Any] = {"task": "boxes", "split_method": "stratified"}
    _run(root, table, tmp_path / "spark", spark_engine, **opts)
    _run(root, table, tmp_path / "local", local_engine, **opts)
    assert assert_same_manifest(str(tmp_path / "spark"), str(tmp_path / "local")).task == "boxes"


def test_the_one_command_build_refuses_base_with_labels_beyond_one_class_before_any_work(
    tmp_path: Path, lake: tuple[str, list[Drawn]]
) -> None:
    root, drawn = lake
    table = _table(tmp_path / "t", [{"key": d.key, "labels": d.labels} for d in drawn], "jsonl")
    out = tmp_path / "ds"
    cfg = build.BuildConfig(
        input=root, output=str(out), labels=table, task="multi-label", engine="local", base=str(tmp_path)
    )
    with pytest.raises((ShardError, ConfigError), match=r"--base"):
        with build.prepare(cfg):
            pass
    assert not (out / "manifests").exists()


def test_the_command_line_takes_the_task_kept_columns_and_box_units(
    tmp_path: Path, lake: tuple[str, list[Drawn]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, drawn = lake
    records = [
        {
            "key": d.key,
            "boxes": [
                {"label": s.label, "x": s.x / d.width, "y": s.y / d.height, "width": s.width / d.width}
                | {"height": s.height / d.height}
                for s in d.shapes
            ],
            "caption": f"{len(d.shapes)} shapes",
            "tags": [s.label[:2] for s in d.shapes],
        }
        for d in drawn
    ]
    table = _table(tmp_path / "t", records, "csv")
    out = tmp_path / "ds"
    args = ["--engine", "local", "--input", root, "--output", str(out), "--labels", table, "--task", "boxes"]
    code = manifest_job.main(
        [*args, "--keep-columns", "caption,tags", "--box-units", "normalized", "--split-method", "stratified"]
    )
    assert code == 0, capsys.readouterr().err
    info = read_manifest_info(str(out))
    assert info.task == "boxes" and info.columns is not None
    assert (info.columns["caption"], info.columns["tags"]) == ("string", "string")  # a CSV cell is text
    row = _accepted(out)[drawn[0].key]
    assert [round(b["x"]) for b in row["boxes"]] == [s.x for s in drawn[0].shapes]


def test_a_table_of_lists_without_task_names_the_flag(tmp_path: Path, lake: tuple[str, list[Drawn]]) -> None:
    root, drawn = lake
    table = _table(tmp_path / "t", [{"key": d.key, "labels": d.labels} for d in drawn], "parquet")
    with pytest.raises(
        ManifestError, match=r"has no 'label' column .* read with --task multi-label or --task boxes$"
    ):
        check_manifest_inputs(ManifestConfig(input=root, output=str(tmp_path / "ds"), labels=table))


def test_boxes_are_placed_on_the_image_as_displayed_exif_orientation_applied(
    tmp_path: Path, local_engine
) -> None:
    """An image stored turned a quarter, with the EXIF orientation that turns it back: its boxes
    (drawn on the image as displayed, as an annotator sees it) fit the displayed size, which the
    manifest records; against the stored size they would fall outside it."""
    drawn = shapes_lake(tmp_path / "lake", N, seed=5)
    turned = drawn[0]
    assert turned.width != turned.height
    path = tmp_path / "lake" / turned.key
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # shown turned 90 degrees clockwise
    with Image.open(path) as img:
        stored = img.transpose(Image.Transpose.ROTATE_90)  # what orientation 6 turns back
    stored.save(path, "PNG", exif=exif)
    with Image.open(path) as img:
        assert ImageOps.exif_transpose(img).size == (turned.width, turned.height)
    records = [{"key": d.key, "boxes": [s.box() for s in d.shapes]} for d in drawn]
    _run(
        storage.normalize(str(tmp_path / "lake")),
        _table(tmp_path / "t", records, "jsonl"),
        tmp_path / "o",
        local_engine,
        task="boxes",
    )
    row = _accepted(tmp_path / "o")[turned.key]
    assert (row["image_width"], row["image_height"]) == (turned.width, turned.height)
    assert [(b["x"], b["y"], b["width"], b["height"]) for b in row["boxes"]] == [
        (s.x, s.y, s.width, s.height) for s in turned.shapes
    ]
