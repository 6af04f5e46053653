"""Issue 51 (the shard job's side): a lake of drawn shapes whose classes and boxes are known ->
a multi-label or boxes manifest -> shards. Every stored box is the drawn shape's box moved as
the resize moves the pixels (computed here from the drawing's geometry, and checked against
the stored pixels), boxes the resize leaves without area are dropped and counted, the label
and kept columns come with their types, and every engine writes the same shards."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs import build
from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import SHARD_SCHEMA, TASK_FORMAT_VERSION, read_dataset_info
from lakeshard.format.label_columns import shard_schema
from tests.helpers.lake import encode
from tests.helpers.shapes import Drawn, Shape, shapes_lake
from tests.jobs.engines.compare import assert_same_dataset

SPLIT = {"train": 0.6, "validation": 0.2, "test": 0.2}
N = 40
#: The stored size per resize mode: crop at 16 px decodes the JPEGs at half size (DCT scaling).
SIZES = {"crop": 16, "pad": 32, "stretch": 32}
SQUARE = (40, 200, 40)  # tests.helpers.shapes draws squares in this colour
#: A box of the labels table, not drawn: a tenth of a pixel wide or less once resized.
TINY = {"label": "triangle", "x": 40.0, "y": 30.0, "width": 0.12, "height": 5.0}
#: EXIF orientation 6: the stored pixels are turned a quarter to the left; shown turned back.
ROTATED = 6


def _extra(root: Path) -> list[Drawn]:
    """An image shown upright from a JPEG stored turned (EXIF orientation 6), its square in the
    pixels as shown; and a PNG with a circle wholly left of the centre crop."""
    shown = Image.new("RGB", (48, 64), (250, 250, 250))
    shown.paste(SQUARE, (10, 20, 30, 40))
    exif = Image.Exif()
    exif[0x0112] = ROTATED
    stored = shown.transpose(Image.Transpose.ROTATE_90)
    (root / "rotated.jpg").write_bytes(encode(stored, "JPEG", quality=95, exif=exif.tobytes()))
    edge = Image.new("RGB", (64, 48), (250, 250, 250))
    edge.paste((220, 40, 40), (0, 10, 7, 20))
    edge.paste(SQUARE, (30, 10, 42, 22))
    (root / "edge.png").write_bytes(encode(edge, "PNG"))
    return [
        Drawn("rotated.jpg", 48, 64, (Shape("square", 10, 20, 20, 20),)),
        Drawn("edge.png", 64, 48, (Shape("circle", 0, 10, 7, 10), Shape("square", 30, 10, 12, 12))),
    ]


def _boxes(d: Drawn) -> list[dict[str, Any]]:
    """The labels table's boxes of ``d``: its shapes, and :data:`TINY` on ``edge.png``."""
    return [s.box() for s in d.shapes] + ([TINY] if d.key == "edge.png" else [])


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Drawn], str]:
    """The lake, what each image holds, and a ``boxes`` manifest's dataset (kept ``caption``, ``n``)."""
    return _boxes_lake(tmp_path_factory.mktemp("shapes"), N)


def _boxes_lake(root: Path, n: int) -> tuple[str, dict[str, Drawn], str]:
    """``n`` drawn images and :func:`_extra`'s under ``root``, and their ``boxes`` manifest."""
    drawn = shapes_lake(root / "lake", n, seed=7) + _extra(root / "lake")
    records = [
        {"key": d.key, "boxes": _boxes(d), "caption": f"{len(d.shapes)} shapes", "n": i}
        for i, d in enumerate(drawn)
    ]
    table = root / "boxes.parquet"
    pq.write_table(pa.Table.from_pylist(records), table)
    lake = storage.normalize(str(root / "lake"))
    _manifest(lake, str(table), root / "ds", task="boxes", keep_columns=("caption", "n"))
    return lake, {d.key: d for d in drawn}, str(root / "ds")


def _manifest(lake: str, table: str, out: Path, **opts: Any) -> None:
    cfg = ManifestConfig(
        input=lake,
        output=str(out),
        labels=table,
        split=SPLIT,
        seed=4,
        min_per_class=0,
        engine="local",
        **opts,
    )
    manifest_job.run(cfg, _local())


def _local() -> Any:
    from jobs.common.engines.local_engine import LocalEngine

    return LocalEngine(workers=2)


def _shard(dataset: str, out: Path, engine: Any, resize: str) -> str:
    """Shard a copy of the manifest at ``dataset`` into ``out``, as PNG (exact pixels to check),
    every image kept (``--remainder pad``: pad copies, not counted again among dropped boxes)."""
    shutil.copytree(dataset, out)
    cfg = ShardConfig(
        dataset=str(out),
        engine=engine.name,
        num_shards=2,
        image_size=SIZES[resize],
        resize=resize,
        image_format="png",
        remainder="pad",
    )
    shard_job.run(cfg, engine)
    return str(out)


def _expected(box: dict[str, Any], d: Drawn, resize: str) -> tuple[float, float, float, float] | str:
    """``box`` of ``d`` (pixels as shown) in the stored image's pixels (x0, y0, x1, y1), from the
    resize modes' documented geometry; or why it is dropped."""
    size, w, h = SIZES[resize], d.width, d.height
    if resize == "stretch":
        sx, sy, dx, dy = size / w, size / h, 0.0, 0.0
    elif resize == "crop":  # the shorter side to size, the centre kept
        side = min(w, h)
        sx = sy = size / side
        dx, dy = -(w - side) / 2 * sx, -(h - side) / 2 * sy
    else:  # pad: fit inside, centred on black
        scale = size / max(w, h)
        ow, oh = round(w * scale), round(h * scale)
        sx, sy, dx, dy = ow / w, oh / h, (size - ow) // 2, (size - oh) // 2
    x0, x1 = (min(max(v * sx + dx, 0), size) for v in (box["x"], box["x"] + box["width"]))
    y0, y1 = (min(max(v * sy + dy, 0), size) for v in (box["y"], box["y"] + box["height"]))
    if x1 <= x0 or y1 <= y0:
        return "outside the crop"
    if min(x1 - x0, y1 - y0) < 0.1:
        return "under a tenth of a pixel"
    return x0, y0, x1, y1


def _rows(root: str) -> list[dict[str, Any]]:
    info = read_dataset_info(root)
    return [
        r
        for c, entry in info.channels.items()
        for s in entry.shards
        for r in pq.read_table(storage.local_path(storage.join(root, s.path))).to_pylist()
    ]


def _square_pixels(image: bytes) -> tuple[int, int, int, int] | None:
    """The pixel bounds (x0, y0, x1, y1, exclusive) of the square's colour in a stored image."""
    with Image.open(io.BytesIO(image)) as img:
        px = np.asarray(img.convert("RGB"), dtype=np.int32)
    near = np.abs(px - np.asarray(SQUARE)).sum(axis=2) < 235  # over half the way from the background
    ys, xs = np.nonzero(near)
    return (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1) if len(xs) else None


def _check_rows(rows: list[dict[str, Any]], drawn: dict[str, Drawn], resize: str) -> Counter[str]:
    """Check each shard row's boxes against the drawing's (and the square's stored pixels);
    return the boxes the resize should have dropped from the rows, pad copies not counted."""
    dropped: Counter[str] = Counter()
    for row in rows:
        d = drawn[row["key"]]
        assert (row["label"], row["width"], row["height"]) == (None, SIZES[resize], SIZES[resize])
        moved = [(b["label"], _expected(b, d, resize)) for b in _boxes(d)]
        want = [(label, at) for label, at in moved if not isinstance(at, str)]
        assert row["labels"] == sorted({label for label, _ in want})  # the classes of the boxes kept
        assert row["caption"] == f"{len(d.shapes)} shapes"
        if not row["is_pad"]:
            dropped.update(at for _, at in moved if isinstance(at, str))
        got = [
            (b["label"], (b["x"], b["y"], b["x"] + b["width"], b["y"] + b["height"])) for b in row["boxes"]
        ]
        assert [label for label, _ in got] == [label for label, _ in want], row["key"]
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g == pytest.approx(w, abs=1.0), (row["key"], g, w)
        squares = [at for label, at in want if label == "square"]
        if len(squares) == 1 and min(squares[0][2] - squares[0][0], squares[0][3] - squares[0][1]) >= 3:
            seen = _square_pixels(row["image"])  # the pixels moved where the box went
            assert seen is not None and seen == pytest.approx(squares[0], abs=1.0), (
                row["key"],
                seen,
                squares,
            )
    return dropped


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch"])
def test_every_box_moves_with_its_image_and_dropped_boxes_are_counted(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str], resize: str
) -> None:
    _, drawn, dataset = lake
    root = _shard(dataset, tmp_path / "ds", _local(), resize)
    rows = _rows(root)
    dropped = _check_rows(rows, drawn, resize)
    info = read_dataset_info(root)
    assert info.counts.dropped_boxes == dict(sorted(dropped.items()))
    if resize == "crop":
        assert dropped["outside the crop"] >= 1 and dropped["under a tenth of a pixel"] >= 1
    assert info.counts.padded and {"rotated.jpg", "edge.png"} <= {r["key"] for r in rows}


def test_assembled_shards_carry_the_columns_and_count_the_dropped_boxes_of_their_rows(tmp_path: Path) -> None:
    """Shards assembled from segments, and a reject that makes the plan move rows: the boxes
    and their dropped counts travel with the rows."""
    _, drawn, dataset = _boxes_lake(tmp_path, 24)
    gone = next(k for k in drawn if k.startswith("img_"))
    (tmp_path / "lake" / gone).write_bytes(b"replaced since the manifest")  # a reject: changed
    cfg = ShardConfig(
        dataset=dataset, engine="local", num_shards=2, image_size=16, resize="crop", partitions=6
    )
    info = shard_job.run(cfg, _local())
    assert isinstance(info, type(read_dataset_info(dataset)))
    assert (info.counts.shard_rejects, info.build.assembled_shards > 0) == (1, True)
    rows = _rows(dataset)
    dropped = _check_rows(rows, drawn, "crop")
    assert gone not in {r["key"] for r in rows}
    assert info.counts.dropped_boxes == dict(sorted(dropped.items())) and dropped["outside the crop"] >= 1


def test_the_shards_carry_the_label_and_kept_columns_with_their_types(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str]
) -> None:
    _, drawn, dataset = lake
    root = _shard(dataset, tmp_path / "ds", _local(), "pad")
    info = read_dataset_info(root)
    kept = pa.schema([("caption", pa.string()), ("n", pa.int64())])
    schema = shard_schema("boxes", kept)
    assert (info.format_version, info.task, info.task_kind) == (TASK_FORMAT_VERSION, "boxes", "boxes")
    assert info.columns == {f.name: str(f.type) for f in schema if f.name not in SHARD_SCHEMA.names}
    assert set(info.columns) == {"labels", "label_indices", "boxes", "caption", "n"}
    for entry in info.channels.values():
        assert len({s.rows for s in entry.shards}) == 1  # equal rows per shard
        for s in entry.shards:
            file = pq.ParquetFile(storage.local_path(storage.join(root, s.path)))
            assert file.schema_arrow.remove_metadata().equals(schema), file.schema_arrow
            footer = file.schema_arrow.metadata
            assert footer[b"lakeshard.format_version"] == b"4"
            rows = file.read().to_pylist()
            labels = Counter(label for r in rows for label in r["labels"])
            assert s.class_counts == dict(sorted(labels.items()))  # an image once per label it holds
            assert all(r["n"] == [*drawn].index(r["key"]) for r in rows)


def test_the_report_shows_labels_and_boxes_per_image_and_draws_samples_with_their_boxes(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str]
) -> None:
    _, _, dataset = lake
    root = _shard(dataset, tmp_path / "ds", _local(), "pad")
    page = (tmp_path / "ds" / "report.html").read_text()
    assert "<script" not in page and "Labels and boxes (boxes, train)" in page
    for chart in ("images by their number of labels", "images by their number of boxes", "boxes by size"):
        assert chart in page
    first = read_dataset_info(root).channels["train"].shards[0].path
    samples = pq.read_table(storage.local_path(storage.join(root, first))).slice(0, 8).to_pylist()
    drawn = page[page.index("Samples, as stored") :]
    assert drawn.count("<figure class='sample'>") == len(samples)
    assert drawn.count("fill='none'") == sum(len(r["boxes"]) for r in samples)  # a rectangle per box
    box = samples[0]["boxes"][0]
    assert f"<rect x='{box['x']:.2f}' y='{box['y']:.2f}' width='{box['width']:.2f}'" in drawn


def test_a_multi_label_dataset_balances_images_and_stores_each_set(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str]
) -> None:
    root_lake, drawn, _ = lake
    table = tmp_path / "labels.jsonl"
    table.write_text("".join(json.dumps({"key": k, "labels": d.labels}) + "\n" for k, d in drawn.items()))
    _manifest(root_lake, str(table), tmp_path / "m", task="multi-label", split_method="stratified")
    root = _shard(str(tmp_path / "m"), tmp_path / "ds", _local(), "stretch")
    info = read_dataset_info(root)
    assert (info.task, info.counts.dropped_boxes) == ("multi-label", None)
    schema = shard_schema("multi-label")
    for entry in info.channels.values():
        assert len({s.rows for s in entry.shards}) == 1
    for row in _rows(root):
        assert (row["label"], row["labels"]) == (None, drawn[row["key"]].labels)
        assert row["label_indices"] == [info.labels[n] for n in row["labels"]]
    first = info.channels["train"].shards[0].path
    assert pq.read_schema(storage.local_path(storage.join(root, first))).remove_metadata().equals(schema)


@pytest.mark.parametrize("engine", ["dask_engine", "spark_engine"])
def test_dask_and_spark_write_the_same_boxes_shards_as_the_local_engine(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str], engine: str, request: pytest.FixtureRequest
) -> None:
    _, _, dataset = lake
    local = _shard(dataset, tmp_path / "local", _local(), "crop")
    other = _shard(dataset, tmp_path / "other", request.getfixturevalue(engine), "crop")
    assert assert_same_dataset(other, local).task == "boxes"


def test_base_with_a_boxes_manifest_is_refused_naming_the_flag(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str]
) -> None:
    _, _, dataset = lake
    cfg = ShardConfig(dataset=dataset, engine="local", num_shards=2, base=str(tmp_path / "old"))
    with pytest.raises(ShardError, match=r"^--base .* cannot be combined with the boxes manifest at "):
        shard_job.run(cfg, _local())


def test_the_plan_of_a_boxes_dataset_says_it_balances_images(lake: tuple[str, dict[str, Drawn], str]) -> None:
    _, drawn, dataset = lake
    cfg = ShardConfig(dataset=dataset, engine="local", num_shards=2, plan_only=True)
    summary = shard_job.run(cfg, _local())
    text = summary.text()
    assert "boxes rows -> 2 shards" in text and "images balanced, labels not" in text, text
    assert "classes" not in text
    assert sum(c.rows for c in summary.channels) == len(drawn)


def test_the_one_command_build_stores_boxes(
    tmp_path: Path, lake: tuple[str, dict[str, Drawn], str], capsys: pytest.CaptureFixture[str]
) -> None:
    root_lake, drawn, _ = lake
    table = tmp_path / "boxes.jsonl"
    table.write_text("".join(json.dumps({"key": k, "boxes": _boxes(d)}) + "\n" for k, d in drawn.items()))
    out = tmp_path / "ds"
    args = ["--engine", "local", "--input", root_lake, "--output", str(out), "--labels", str(table)]
    opts = ["--task", "boxes", "--split-method", "stratified", "--num-shards", "2", "--image-size", "32"]
    code = build.main([*args, *opts, "--split", "train=0.6,validation=0.2,test=0.2", "--resize", "pad"])
    assert code == 0, capsys.readouterr().err
    info = read_dataset_info(str(out))
    assert (info.task, info.format_version) == ("boxes", TASK_FORMAT_VERSION)
    rows = _rows(str(out))
    assert rows and all(len(r["boxes"]) == len(drawn[r["key"]].shapes) for r in rows)  # TINY dropped
