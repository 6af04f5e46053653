"""Preprocessing tasks: receipts (a rerun reuses a segment only if its receipt is there, names
the same rows, and its file is the size the receipt says), and what a task carries when pickled."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.common.images import DEFAULT_SPEC
from jobs.shard_steps.assemble import SOURCE_SCHEMA, AssembleTask
from jobs.shard_steps.preprocess import SEGMENT_SCHEMA, RowRange, SegmentTask, preprocess_segment, rows_digest
from jobs.shard_steps.staging import finished
from tests.helpers.lake import write_lake


def _task(lake: Path, staging: Path, paths: list[Path]) -> SegmentTask:
    rows = pa.table(
        {
            "uri": [f"file://{p}" for p in paths],
            "key": [p.name for p in paths],
            "label_index": [0] * len(paths),
            "is_pad": [False] * len(paths),
            "size": [None] * len(paths),
            "etag": [None] * len(paths),
            "last_modified": [None] * len(paths),
        },
        schema=SEGMENT_SCHEMA,
    )
    return SegmentTask(
        uri=f"file://{staging}/train/part-0.parquet",
        rows=rows,
        spec=replace(DEFAULT_SPEC, size=16, format="png"),
        metadata={"channel": "train"},
        row_group_bytes=1 << 20,
        threads=2,
        receipt=f"file://{staging}/_runs/receipts/train/part-0.parquet",
        outcomes=f"file://{staging}/_runs/outcomes/train/part-0.parquet",
    )


def test_a_finished_segment_is_reused_and_a_damaged_one_is_not(tmp_path: Path):
    paths = write_lake(tmp_path / "raw", {"a": 6})
    (tmp_path / "raw" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    paths.append(tmp_path / "raw" / "a" / "broken.png")
    staging = tmp_path / "staging"
    task = _task(tmp_path / "raw", staging, paths)
    assert finished(f"file://{staging}", [task]) == {}  # nothing yet

    result = preprocess_segment(task)
    reused = finished(f"file://{staging}", [task])
    assert list(reused) == [task.uri]
    assert reused[task.uri].stats == result.stats
    assert reused[task.uri].rows == result.rows == 7
    assert reused[task.uri].rejects.equals(result.rejects)
    assert reused[task.uri].rejects.select(["key", "reason"]).to_pylist() == [
        {"key": "broken.png", "reason": result.rejects["reason"][0].as_py()}
    ]  # the reason came back too
    assert reused[task.uri].digest == result.digest == rows_digest(task.rows)
    assert result.rejects["reason"][0].as_py().startswith("cannot decode")
    outcomes = pq.read_table(task.outcomes[len("file://") :])
    assert outcomes["row"].to_pylist() == [0, 1, 2, 3, 4, 5, None]  # where each row was written

    other_rows = _task(tmp_path / "raw", staging, paths[:-1])  # same file name, other rows
    assert finished(f"file://{staging}", [other_rows]) == {}

    outcomes_file = Path(task.outcomes[len("file://") :])
    kept = outcomes_file.read_bytes()
    outcomes_file.unlink()  # the assembly tasks could not find the segment's rows
    assert finished(f"file://{staging}", [task]) == {}
    outcomes_file.write_bytes(kept)
    assert list(finished(f"file://{staging}", [task])) == [task.uri]

    segment = staging / "train" / "part-0.parquet"
    segment.write_bytes(segment.read_bytes()[:-10])  # a file cut short: the receipt no longer vouches for it
    assert finished(f"file://{staging}", [task]) == {}

    segment.unlink()
    assert finished(f"file://{staging}", [task]) == {}


def test_a_segment_read_from_its_order_file_is_reused_only_for_the_same_rows(tmp_path: Path):
    """A task that names its rows as a slice of an order file (the driver never holds them) is
    matched to its receipt by the digest of those rows."""
    paths = write_lake(tmp_path / "raw", {"a": 8})
    rows = _task(tmp_path / "raw", tmp_path / "s", paths).rows
    order = tmp_path / "order.parquet"
    pq.write_table(rows, order)
    staging = tmp_path / "staging"

    def task(offset: int, length: int, digest: str) -> SegmentTask:
        return SegmentTask(
            uri=f"file://{staging}/train/seg.parquet",
            rows=None,
            source=RowRange(f"file://{order}", offset, length),
            digest=digest,
            spec=replace(DEFAULT_SPEC, size=16, format="png"),
            metadata={"channel": "train"},
            row_group_bytes=1 << 20,
            threads=0,
            receipt=f"file://{staging}/_runs/receipts/train/seg.parquet",
        )

    mine = task(2, 5, rows_digest(rows.slice(2, 5)))
    result = preprocess_segment(mine)
    assert result.rows == 5 and result.rejects.num_rows == 0
    written = pq.read_table(staging / "train" / "seg.parquet", columns=["uri"])["uri"].to_pylist()
    assert written == rows["uri"].to_pylist()[2:7]
    assert list(finished(f"file://{staging}", [mine])) == [mine.uri]
    shifted = task(3, 5, rows_digest(rows.slice(3, 5)))  # same file, other rows
    assert finished(f"file://{staging}", [shifted]) == {}


def test_a_task_pickles_its_own_rows_not_the_table_it_was_cut_from(tmp_path: Path):
    big = pa.table(
        {
            "uri": [f"file:///lake/raw/class{i % 10}/image_{i:07d}.png" for i in range(100_000)],
            "key": [f"class{i % 10}/image_{i:07d}.png" for i in range(100_000)],
            "label_index": [i % 10 for i in range(100_000)],
            "is_pad": [False] * 100_000,
            "size": [None] * 100_000,
            "etag": [None] * 100_000,
            "last_modified": [None] * 100_000,
        },
        schema=SEGMENT_SCHEMA,
    )
    part = big.slice(40_000, 100)
    task = SegmentTask(
        uri="file:///x.parquet",
        rows=part,
        spec=replace(DEFAULT_SPEC, size=16),
        metadata={},
        row_group_bytes=1 << 20,
        threads=1,
    )
    assert task.rows.equals(part)
    assert len(pickle.dumps(big)) > 5_000_000
    assert len(pickle.dumps(task)) < 30_000  # ~100 rows' worth, not the 100,000 rows' buffers
    sources = pa.table(
        {"file": ["a"] * 100_000, "row": list(range(100_000)), "is_pad": [False] * 100_000},
        schema=SOURCE_SCHEMA,
    ).slice(10, 50)
    assemble = AssembleTask(uri="file:///y.parquet", sources=sources, metadata={}, row_group_bytes=1 << 20)
    assert assemble.sources.equals(sources) and len(pickle.dumps(assemble)) < 10_000


def test_an_assembly_task_names_each_source_file_once():
    """A shard's rows come from a handful of segment files: their paths, repeated on every row,
    made each assembly task of a 100,000-image Spark job 1.9 MB (Spark warns over 1 MB)."""
    rows = 20_000
    files = [
        f"file:///data/pets/_staging/shards-2f00987917b6/_runs/train/part-{i % 12:05d}-of-00004.parquet"
        for i in range(rows)
    ]
    sources = pa.table(
        {"file": files, "row": list(range(rows)), "is_pad": [False] * rows}, schema=SOURCE_SCHEMA
    )
    task = AssembleTask(uri="file:///y.parquet", sources=sources, metadata={}, row_group_bytes=1 << 20)
    assert task.sources["file"].to_pylist() == files
    assert len(pickle.dumps(task)) < 16 * rows  # a row and an index per row; the paths once (~90 bytes each)
