"""The shard job plans from the manifest's counts, with the rows on the workers: it writes
make_plan's plan (same shards, rows, order, pads and drops), and what crosses the engine
between the driver and its tasks does not grow with the rows."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.tasks import read_rows, write_table
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.plan_tasks import OrderTask
from lakeshard import storage
from lakeshard.format import rejects_uri
from lakeshard.format.manifest_table import read_channel
from tests.helpers.checks import check_dataset, read_table, shard_tables
from tests.helpers.lake import write_lake
from tests.helpers.reference_plan import make_plan


def _truncated_jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(
        buf, "JPEG"
    )
    return buf.getvalue()[:400]  # starts like a JPEG (the manifest accepts it), cannot be decoded


def test_the_job_writes_make_plans_plan(tmp_path: Path, local_engine):
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 31, "b": 17, "c": 9, "d": 4})
    for i, label in enumerate(["a", "a", "b", "d"]):
        (lake / label / f"broken{i}.jpg").write_bytes(_truncated_jpeg(i))
    out = tmp_path / "ds"
    manifest_job.run(
        ManifestConfig(input=str(lake), output=str(out), split="train=0.75,validation=0.25"), local_engine
    )
    for remainder, num_shards, partitions in (("pad", 3, 10), ("drop", 4, None)):
        info = shard_job.run(
            ShardConfig(
                dataset=str(out),
                num_shards=num_shards,
                image_size=16,
                remainder=remainder,
                partitions=partitions,
                max_reject_fraction=0.2,
                overwrite=True,
            ),
            local_engine,
        )
        check_dataset(str(out))
        rejected = set(read_table(rejects_uri(str(out), info))["key"].to_pylist())
        assert len(rejected) == 4
        for channel in ("train", "validation"):
            rows = read_channel(storage.normalize(str(out)), channel)
            rows = rows.take(pc.sort_indices(rows, sort_keys=[("key", "ascending")]))
            keys, uris = rows["key"].to_pylist(), rows["uri"].to_pylist()
            plan = make_plan(
                keys,
                rows["label_index"].to_pylist(),
                num_shards=num_shards,
                seed=info.seed,
                channel=channel,
                remainder=remainder,
                rejected=[k in rejected for k in keys],
            )
            for s, table in enumerate(shard_tables(str(out), channel, num_shards)):
                mine = plan.shard == s
                assert list(zip(table["key"].to_pylist(), table["is_pad"].to_pylist())) == [
                    (keys[i], bool(p)) for i, p in zip(plan.source[mine], plan.is_pad[mine])
                ], (remainder, channel, s)
            assert info.channels[channel].dropped == [uris[i] for i in plan.dropped]
            assert info.channels[channel].padded == [uris[i] for i in plan.padded]


class _Recording:
    """An engine that counts the pickled bytes of what it is given and what its tasks return:
    what would cross between a Spark or Dask driver and its workers."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        self.sent = self.returned = 0

    @property
    def parallelism(self) -> int:
        return self.inner.parallelism

    @property
    def task_cpus(self) -> int:
        return self.inner.task_cpus

    def map_partitions(
        self,
        fn: Callable[[list[Any]], list[Any]],
        items: Sequence[Any],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[Any]:
        self.sent += len(pickle.dumps(list(items)))
        out = self.inner.map_partitions(fn, items, partitions=partitions, cpu_bound=cpu_bound)
        self.returned += len(pickle.dumps(out))
        return out

    def close(self) -> None:
        self.inner.close()


def test_what_crosses_the_engine_does_not_grow_with_the_rows(tmp_path: Path, local_engine):
    crossed = {}
    for n in (40, 400):
        lake = tmp_path / f"raw{n}"
        write_lake(lake, {"a": n // 2, "b": n // 4, "c": n // 4}, size=(8, 8), nested=False)
        (lake / "a" / "broken.jpg").write_bytes(_truncated_jpeg(0))
        out = tmp_path / f"ds{n}"
        manifest_job.run(ManifestConfig(input=str(lake), output=str(out), split="train=1"), local_engine)
        engine = _Recording(local_engine)
        info = shard_job.run(
            ShardConfig(dataset=str(out), num_shards=3, image_size=8, remainder="pad", partitions=4), engine
        )
        assert info.counts.shard_rejects == 1 and info.build.assembled_shards >= 1  # a repair ran
        crossed[n] = (engine.sent, engine.returned)
    # Ten times the rows, the same tasks: a row per image on either side would show as ~10x.
    assert crossed[400][0] < 1.2 * crossed[40][0], crossed
    assert crossed[400][1] < 1.2 * crossed[40][1], crossed


class _OrderFiles(_Recording):
    """An engine that, as each order pass returns, reads the row-group sizes of the order files
    it wrote (they are staging files, gone once the job commits)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.files: list[tuple[tuple[int, ...], list[int]]] = []

    def map_partitions(
        self,
        fn: Callable[[list[Any]], list[Any]],
        items: Sequence[Any],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[Any]:
        out = super().map_partitions(fn, items, partitions=partitions, cpu_bound=cpu_bound)
        for item in (i for group in items for i in (group if isinstance(group, list) else [group])):
            if isinstance(item, OrderTask):
                meta = pq.ParquetFile(storage.filesystem(item.uri)[1]).metadata
                self.files.append(
                    (item.cuts, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
                )
        return out


def test_an_order_file_has_a_row_group_per_segment(tmp_path: Path, local_engine):
    # A segment's task reads its rows from the shard's order file: a row group of its own, not
    # the whole file (at 1M rows the whole file was read by each of its ~100 segments).
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 60, "b": 40}, size=(8, 8), nested=False)
    out = tmp_path / "ds"
    manifest_job.run(ManifestConfig(input=str(lake), output=str(out), split="train=1"), local_engine)
    engine = _OrderFiles(local_engine)
    shard_job.run(ShardConfig(dataset=str(out), num_shards=2, image_size=8, partitions=10), engine)
    assert engine.files
    segmented = [(cuts, groups) for cuts, groups in engine.files if len(cuts) > 2]
    assert segmented, engine.files  # the shards were cut in segments
    for cuts, groups in engine.files:
        assert groups == [b - a for a, b in pairwise(cuts)], (cuts, groups)


def test_a_range_of_rows_is_read_from_its_row_groups_only(tmp_path: Path):
    table = pa.table(
        {"i": pa.array(range(100), pa.int64()), "s": pa.array([f"row{i:03d}" for i in range(100)])}
    )
    uri = storage.normalize(str(tmp_path / "order.parquet"))
    write_table(uri, table, row_group_size=25)
    for offset, length in ((0, 25), (25, 25), (75, 25), (10, 30), (24, 2), (0, 100), (99, 1), (50, 0)):
        assert read_rows(uri, offset, length).equals(table.slice(offset, length)), (offset, length)
    with pytest.raises(IndexError, match="has 100 rows"):
        read_rows(uri, 90, 20)
    # Spoil the first row group's data: the last one is still read whole and right, the file not.
    path = tmp_path / "order.parquet"
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(0).column(1)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    assert read_rows(uri, 75, 25).equals(table.slice(75, 25))
    with pytest.raises(Exception):  # noqa: B017 - whichever error Arrow gives for a spoilt page
        pq.read_table(path)
