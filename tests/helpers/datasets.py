"""Small complete datasets built by the real jobs, for tests that explore a dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines import Engine
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.format.label_columns import BOXES
from tests.helpers.lake import bad_objects, write_lake
from tests.helpers.shapes import Drawn, shapes_lake

__all__ = ["ShapesDataset", "build_dataset_with_rejects", "build_shapes_dataset"]


@dataclass(frozen=True, slots=True)
class ShapesDataset:
    """A dataset built from a lake of drawn shapes, and what each of its images holds."""

    root: Path
    drawn: list[Drawn]


def build_dataset_with_rejects(
    engine: Engine, tmp: Path, counts: dict[str, int], *, seed: int, **shard_options: Any
) -> Path:
    """A lake of ``counts`` small PNGs plus one object the manifest job rejects (text named
    .jpg, in the first class) and one the shard job rejects (a truncated JPEG, in the second),
    through both jobs on ``engine``: 2 shards of 24 px PNGs. Returns the dataset root."""
    lake = tmp / "raw"
    write_lake(lake, counts, size=(40, 32))
    first, second = sorted(counts)[:2]
    bad = bad_objects()
    (lake / first / "notes.jpg").write_bytes(bad["cls_a/bad_text.jpg"])
    (lake / second / "broken.jpg").write_bytes(bad["cls_a/bad_truncated.jpg"])
    out = tmp / "ds"
    manifest_job.run(
        ManifestConfig(
            input=str(lake), output=str(out), seed=seed, split_method="stratified", max_reject_fraction=0.5
        ),
        engine,
    )
    shard_job.run(
        ShardConfig(
            dataset=str(out),
            num_shards=2,
            image_size=24,
            image_format="png",
            max_reject_fraction=0.5,
            **shard_options,
        ),
        engine,
    )
    return out


def build_shapes_dataset(engine: Engine, tmp: Path, task: str, *, n: int, seed: int) -> ShapesDataset:
    """A lake of ``n`` drawn shapes (:func:`~tests.helpers.shapes.shapes_lake`, 64×48 px) and its
    labels table for ``task`` (``multi-label``: each image's classes; ``boxes``: its shapes'
    boxes), with a kept ``caption``, through both jobs on ``engine``: 2 shards of 32 px PNGs,
    padded (no box is cropped away)."""
    drawn = shapes_lake(tmp / "raw", n, seed=seed)
    labels = [
        {"key": d.key, "caption": f"{len(d.shapes)} shapes"}
        | ({"boxes": [s.box() for s in d.shapes]} if task == BOXES else {"labels": d.labels})
        for d in drawn
    ]
    table = tmp / "labels.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in labels))
    out = tmp / "ds"
    manifest_job.run(
        ManifestConfig(
            input=str(tmp / "raw"),
            output=str(out),
            labels=str(table),
            task=task,
            keep_columns=("caption",),
            seed=seed,
            split_method="stratified",
            split={"train": 0.6, "validation": 0.2, "test": 0.2},
        ),
        engine,
    )
    shard_job.run(
        ShardConfig(dataset=str(out), num_shards=2, image_size=32, image_format="png", resize="pad"), engine
    )
    return ShapesDataset(out, drawn)
