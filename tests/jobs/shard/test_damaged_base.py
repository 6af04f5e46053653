"""A ``--base`` whose shard is damaged is never copied: each reused shard file is checked against
the sha256 its ``dataset.json`` records, and a shard that fails (or whose Parquet cannot be read)
lends no image; its rows are fetched and decoded from the lake, with one warning naming the
shard. The build equals a build from scratch, byte for byte."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from lakeshard.format import DatasetInfo
from tests.helpers.checks import check_dataset, shard_tables
from tests.helpers.lake import encode, make_image, write_lake

_COUNTS = {"cat": 20, "dog": 16, "fox": 12}
_MANIFEST = {"split": "train=0.7,validation=0.3", "seed": 3}


def _build(engine: Any, lake: Path, out: Path, *, base: Path | None = None) -> DatasetInfo:
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), base=base and str(base), **_MANIFEST), engine
    )
    return shard_job.run(
        ShardConfig(
            dataset=str(out), num_shards=2, image_size=16, image_format="png", base=base and str(base)
        ),
        engine,
    )


def _same(b: Path, c: Path, info_b: DatasetInfo, info_c: DatasetInfo) -> None:
    assert info_b.dataset_version == info_c.dataset_version
    for channel, entry in info_c.channels.items():
        for x, y in zip(shard_tables(str(b), channel, 2), shard_tables(str(c), channel, 2), strict=True):
            assert x.equals(y), channel
        assert [s.sha256 for s in info_b.channels[channel].shards] == [s.sha256 for s in entry.shards]


def _flip(path: Path, offset: int, n: int = 40) -> None:
    """Flip ``n`` bytes of ``path`` from ``offset``: same size, other content."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def grown(tmp_path: Path, local_engine) -> tuple[Path, Path, DatasetInfo]:
    """A dataset A of a lake, and the lake grown by a few objects since."""
    lake, a = tmp_path / "raw", tmp_path / "a"
    write_lake(lake, _COUNTS)
    info_a = _build(local_engine, lake, a)
    for i in range(4):
        (lake / sorted(_COUNTS)[i % 3] / f"new_{i}.png").write_bytes(encode(make_image(6000 + i), "PNG"))
    return lake, a, info_a


@pytest.mark.parametrize("damage", ["image bytes", "parquet footer"])
def test_a_damaged_base_shard_lends_no_image_and_the_build_equals_a_fresh_one(
    grown, tmp_path: Path, local_engine, caplog: pytest.LogCaptureFixture, damage: str
):
    lake, a, info_a = grown
    shard = info_a.channels["train"].shards[0]
    path = a / shard.path
    size = path.stat().st_size
    if damage == "image bytes":  # inside one stored image (images are stored uncompressed)
        image = pq.read_table(path, columns=["image"])["image"][3].as_py()
        start = path.read_bytes().find(image)
        assert start > 0 and len(image) > 100
        _flip(path, start + len(image) // 2)
    else:
        _flip(path, size - 60)
    assert path.stat().st_size == size
    with caplog.at_level(logging.WARNING):
        info_b = _build(local_engine, lake, tmp_path / "b", base=a)
    info_c = _build(local_engine, lake, tmp_path / "c")
    check_dataset(str(tmp_path / "b"))
    _same(tmp_path / "b", tmp_path / "c", info_b, info_c)
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()
    ]
    assert warned, [r.getMessage() for r in caplog.records]
    assert "fetched and decoded from the lake" in warned[0]
    # the damaged shard's rows were decoded, the other shards' were reused
    assert info_b.build.reused > 0
    assert info_b.build.reused + info_b.build.preprocessed == info_c.build.preprocessed
    assert info_b.build.preprocessed >= shard.rows


def test_an_intact_base_lends_every_image_it_holds(
    grown, tmp_path: Path, local_engine, caplog: pytest.LogCaptureFixture
):
    lake, a, info_a = grown
    with caplog.at_level(logging.WARNING):
        info_b = _build(local_engine, lake, tmp_path / "b", base=a)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "base" in r.getMessage()]
    assert info_b.build.preprocessed == 4 + info_a.counts.dropped  # the new objects and A's dropped rows


def test_a_damaged_base_manifest_part_lends_no_image_and_the_build_equals_a_fresh_one(
    grown, tmp_path: Path, local_engine, caplog: pytest.LogCaptureFixture
):
    lake, a, _ = grown
    part = sorted((a / "manifests" / "train").glob("part-*.parquet"))[0]
    with open(part, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        info_b = _build(local_engine, lake, tmp_path / "b", base=a)
    info_c = _build(local_engine, lake, tmp_path / "c")
    _same(tmp_path / "b", tmp_path / "c", info_b, info_c)
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(part) in r.getMessage()
    ]
    assert warned and warned[0].startswith("--base manifest part "), [r.getMessage() for r in caplog.records]
    assert info_b.build.reused + info_b.build.preprocessed == info_c.build.preprocessed
