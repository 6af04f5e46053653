"""Issue 51 end to end: a lake of drawn shapes whose boxes are known -> ``python -m jobs.build
--task boxes`` (the manifest job and the shard job's resize) -> the loader's augment (a random
crop and flip): every square's box that comes out of the loader is where the square's pixels
are, within a pixel. The shard job's and the loader's geometry are each tested alone
(``tests/jobs/shard/test_labels_beyond_one_class.py``, ``tests/loaders/test_task_batches.py``);
here they are chained as a user chains them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lakeshard.format import read_dataset_info
from loaders import ShardLoader
from tests.helpers.shapes import shapes_lake

REPO = Path(__file__).resolve().parents[1]
SQUARE = (40, 200, 40)  # tests.helpers.shapes draws squares in this colour


def _square_pixels(image: torch.Tensor) -> list[float] | None:
    """``x0, y0, x1, y1`` of the pixels nearer the square's colour than the background's in a
    ``[3, H, W]`` uint8 image: where the resampled square is, within a pixel."""
    far = (image.to(torch.int32) - torch.tensor(SQUARE).view(3, 1, 1)).abs().sum(dim=0)
    ys, xs = torch.nonzero(far < 235, as_tuple=True)
    if not len(xs):
        return None
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


@pytest.fixture(scope="module")
def boxes_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("e2e-boxes")
    drawn = shapes_lake(root / "lake", 48, seed=11, size=(80, 60))
    table = root / "boxes.jsonl"
    table.write_text(
        "".join(json.dumps({"key": d.key, "boxes": [s.box() for s in d.shapes]}) + "\n" for d in drawn)
    )
    out = root / "ds"
    cmd = [sys.executable, "-m", "jobs.build", "--engine", "local", "--input", str(root / "lake")]
    cmd += ["--output", str(out), "--labels", str(table), "--task", "boxes", "--split-method", "stratified"]
    cmd += [
        "--split",
        "train=0.75,validation=0.25",
        "--num-shards",
        "2",
        "--image-size",
        "48",
        "--image-format",
        "png",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


def test_boxes_from_the_lake_come_out_of_the_loader_where_the_shapes_are(boxes_dataset: str) -> None:
    info = read_dataset_info(boxes_dataset)
    assert info.task == "boxes"
    square = info.labels["square"]
    checked = flipped = 0
    for rank in (0, 1):
        with ShardLoader(
            boxes_dataset, rank=rank, world_size=2, batch_size=4, seed=3, augment=True, crop=40
        ) as loader:
            for batch in loader:
                assert batch.images.shape[-2:] == (40, 40)
                for image, boxes, classes, valid in zip(
                    batch.images, batch.boxes, batch.box_labels, batch.valid, strict=True
                ):
                    squares = boxes[classes == square]
                    seen = _square_pixels(image)
                    if not valid or len(squares) == 0:
                        continue
                    x0, y0, x1, y1 = squares[0].tolist()
                    if min(x1 - x0, y1 - y0) < 3:  # a sliver the crop left: too few pixels to read
                        continue
                    assert seen is not None, (x0, y0, x1, y1)
                    assert seen == pytest.approx([x0, y0, x1, y1], abs=1.0)
                    checked += 1
                    flipped += x0 > 0 and x1 < 40  # any place, not only at an edge
    assert checked >= 10 and flipped, (checked, flipped)


def test_a_multi_label_model_learns_the_drawn_shapes_from_the_lake(tmp_path: Path) -> None:
    """``jobs.build --task multi-label`` then ``python -m loaders.train``: the model tells which
    shapes an image holds far better than chance (each class's share of the test images)."""
    drawn = shapes_lake(tmp_path / "lake", 320, seed=12, size=(64, 48))
    table = tmp_path / "labels.jsonl"
    table.write_text("".join(json.dumps({"key": d.key, "labels": d.labels}) + "\n" for d in drawn))
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "jobs.build", "--engine", "local", "--input", str(tmp_path / "lake")]
    cmd += [
        "--output",
        str(out),
        "--labels",
        str(table),
        "--task",
        "multi-label",
        "--split-method",
        "stratified",
    ]
    cmd += ["--num-shards", "2", "--image-size", "16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [sys.executable, "-m", "loaders.train", "--dataset", str(out), "--output", str(tmp_path / "run")]
    train += ["--epochs", "4", "--batch-size", "16", "--no-progress", "--num-threads", "2", "--width", "8"]
    proc = subprocess.run(train, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    test = json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]
    images = sum(s.rows for s in read_dataset_info(str(out)).channel("test").shards)
    chance = sum(c["positives"] for c in test["per_class"].values()) / len(test["per_class"]) / images
    assert chance < 0.6 and test["mean_average_precision"] > 0.85, (chance, test)
