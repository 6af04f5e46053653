"""A preprocessing task's threads: images are read ahead on their own threads (or by the
decoder as it goes), decoded on as many threads as the task has cores, and the file and the
per-row outcomes do not depend on either."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.common.images import DEFAULT_SPEC
from jobs.shard import parser as shard_parser
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.preprocess import (
    SEGMENT_SCHEMA,
    SegmentResult,
    SegmentTask,
    ShardWriter,
    _ahead,
    preprocess_segment,
    readers,
)
from lakeshard.errors import ConfigError
from lakeshard.format import SHARD_SCHEMA
from lakeshard.settings import resolve
from tests.helpers.lake import write_lake


def _rows(paths: list[Path]) -> pa.Table:
    return pa.table(
        {
            "uri": [f"file://{p}" for p in paths],
            "key": [p.name for p in paths],
            "label_index": [i % 3 for i in range(len(paths))],
            "is_pad": [False] * len(paths),
            "size": [None] * len(paths),
            "etag": [None] * len(paths),
            "last_modified": [None] * len(paths),
        },
        schema=SEGMENT_SCHEMA,
    )


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("lake")
    paths = write_lake(root, {"a": 40, "b": 35}, size=(40, 30))  # 75 rows: chunks of 32, 32 and 11
    broken = root / "a" / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    paths.insert(33, broken)  # in the second chunk
    paths.insert(5, root / "a" / "gone.png")  # listed, then deleted: never written
    return paths


@pytest.mark.parametrize("threads,decode_threads", [(0, 1), (3, 1), (2, 3), (None, 2), (1, 4)])
def test_the_file_and_outcomes_do_not_depend_on_the_threads(lake, tmp_path, threads, decode_threads):
    def run(threads: int | None, decode_threads: int, name: str) -> tuple[str, SegmentResult, list]:
        task = SegmentTask(
            uri=f"file://{tmp_path}/{name}.parquet",
            rows=_rows(lake),
            spec=replace(DEFAULT_SPEC, size=16),
            metadata={"channel": "train"},
            row_group_bytes=20_000,
            threads=threads,
            decode_threads=decode_threads,
            outcomes=f"file://{tmp_path}/outcomes/{name}.parquet",
        )
        result = preprocess_segment(task)
        outcomes = pq.read_table(tmp_path / "outcomes" / f"{name}.parquet").to_pylist()
        return hashlib.sha256((tmp_path / f"{name}.parquet").read_bytes()).hexdigest(), result, outcomes

    want_digest, want, want_outcomes = run(0, 1, "reference")
    got_digest, got, outcomes = run(threads, decode_threads, "other")
    assert got_digest == want_digest
    assert outcomes == want_outcomes and got.rejects.equals(want.rejects)
    assert [o["uri"] for o in outcomes] == [f"file://{p}" for p in lake]  # every row, in order
    rejects = got.rejects
    reasons = {Path(u).name: r for u, r in zip(rejects["uri"].to_pylist(), rejects["reason"].to_pylist())}
    assert set(reasons) == {"broken.png", "gone.png"}
    assert reasons["gone.png"] == "cannot read: object disappeared after listing"
    assert reasons["broken.png"].startswith("cannot decode")
    assert got.rows == len(lake) and set(got.rejects["channel"].to_pylist()) == {"train"}
    written = pq.read_table(tmp_path / "other.parquet", columns=["uri"])["uri"].to_pylist()
    assert written == [o["uri"] for o in outcomes if o["row"] is not None] and len(written) == len(lake) - 2
    assert [o["row"] for o in outcomes if o["row"] is not None] == list(range(len(lake) - 2))
    assert pq.ParquetFile(tmp_path / "other.parquet").num_row_groups > 1


def test_reads_run_ahead_of_the_reader_by_at_most_the_depth():
    submitted = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            submitted.append(i)
        return i * i

    with ThreadPoolExecutor(3) as pool:
        results = []
        for consumed, future in enumerate(_ahead(pool, work, range(40), depth=5), start=1):
            results.append(future.result())
            time.sleep(0.001)  # a slow consumer: the pool could run far ahead if it were allowed to
            with lock:
                assert len(submitted) <= consumed + 5
    assert results == [i * i for i in range(40)]


def test_reader_threads_default_to_none_for_local_files_and_several_for_s3():
    local = ["file:///lake/a/1.jpg", "file:///lake/a/2.jpg"]
    assert readers(None, local) == 0
    assert readers(None, ["s3://bucket/a/1.jpg"]) > 1
    assert readers(None, [*local, "s3://bucket/a/1.jpg"]) > 1
    assert readers(3, local) == 3 and readers(0, ["s3://bucket/a/1.jpg"]) == 0


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--threads", "-1", "--threads (command line): must be a non-negative integer, got -1"),
        ("--decode-threads", "0", "--decode-threads (command line): must be a positive integer, got 0"),
    ],
)
def test_bad_thread_counts_are_named(flag, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(ShardConfig, shard_parser().parse_args(["--dataset", "/d", flag, value]))


def _shard_rows(n: int, tag: bytes) -> pa.Table:
    return pa.table(
        {
            "image": [tag * 100] * n,
            "label": [1] * n,
            "uri": [f"file:///l/{i}" for i in range(n)],
            "key": [str(i) for i in range(n)],
            "height": [8] * n,
            "width": [8] * n,
            "is_pad": [False] * n,
        },
        schema=SHARD_SCHEMA,
    )


def test_a_writer_never_truncates_a_complete_file(tmp_path: Path):
    """A task of a killed attempt that a Dask worker still finishes writes the same file as the
    next attempt's task: until it is complete, the file already there must stay whole."""
    target = tmp_path / "train" / "part-0.parquet"
    with ShardWriter(f"file://{target}", metadata={}, row_group_bytes=1 << 20) as first:
        first.write(_shard_rows(50, b"a"))
    complete = target.read_bytes()
    assert first.stats["sha256"] == hashlib.sha256(complete).hexdigest()

    with ShardWriter(f"file://{target}", metadata={}, row_group_bytes=1 << 20) as late:
        late.write(_shard_rows(50, b"b"))
        assert target.read_bytes() == complete  # not truncated while the late writer runs
    assert pq.read_table(target)["image"][0].as_py() == b"b" * 100  # replaced whole once complete
    replaced = target.read_bytes()

    with pytest.raises(RuntimeError, match="task died"):
        with ShardWriter(f"file://{target}", metadata={}, row_group_bytes=1 << 20) as failing:
            failing.write(_shard_rows(50, b"c"))
            raise RuntimeError("task died")
    assert target.read_bytes() == replaced  # a failed writer leaves the file as it was
    assert sorted(p.name for p in target.parent.iterdir()) == ["part-0.parquet"]  # and no temporary file


@pytest.mark.parametrize(
    ("rows", "cores", "tasks"),
    [
        (20_000, 2, 10),  # one per 2,000 rows
        (1_000, 8, 8),  # at least one per core
        (100_000_000, 2, 10_000),  # at most 10,000: segments of 10,000 rows, not 50,000 tasks
        (1_000_000_000, 4_000, 16_000),  # a larger cluster: four per core
    ],
)
def test_default_preprocessing_tasks_are_capped(rows: int, cores: int, tasks: int) -> None:
    from jobs.shard_steps.build_state import default_tasks

    assert default_tasks(rows, cores) == tasks
