"""Small complete datasets built by the real jobs, for tests that explore a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines import Engine
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from tests.helpers.lake import bad_objects, write_lake

__all__ = ["build_dataset_with_rejects"]


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
