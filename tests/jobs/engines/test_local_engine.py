"""The local engine (a thread pool in this process) behind the same Engine protocol, and the
jobs' CLI accepting it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jobs.common.engines import open_engine
from jobs.common.engines.local_engine import LocalEngine
from lakeshard.errors import ManifestError
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

REPO = Path(__file__).resolve().parents[3]


def _sizes(items: list[int]) -> list[int]:
    return [len(items)]


def test_map_partitions_runs_every_item_once_in_parts_cut_as_spark_cuts_them() -> None:
    engine = open_engine("local", scheduler=None, app_name="test")
    assert isinstance(engine, LocalEngine) and engine.task_cpus == 1 and engine.parallelism >= 1
    items = list(range(23))
    assert sorted(engine.map_partitions(lambda part: [2 * i for i in part], items, partitions=4)) == [
        2 * i for i in items
    ]
    assert engine.map_partitions(_sizes, items, partitions=4) == [5, 6, 6, 6]
    assert engine.map_partitions(_sizes, items[:3], partitions=50) == [1, 1, 1]
    assert engine.map_partitions(_sizes, [], partitions=4) == []
    engine.close()


def test_parts_run_on_several_threads_at_once() -> None:
    engine = LocalEngine(workers=2)
    both = threading.Barrier(2, timeout=10)  # each part waits for the other: only concurrent parts pass

    def meet(part: list[int]) -> list[str]:
        both.wait()
        return [threading.current_thread().name for _ in part]

    names = engine.map_partitions(meet, [1, 2], partitions=2)
    assert len(set(names)) == 2


def test_a_task_error_is_raised_as_it_was() -> None:
    def boom(part: list[int]) -> list[int]:
        if 3 in part:
            raise ManifestError("cannot list file:///lake/cat: boom on 3")
        return part

    with pytest.raises(ManifestError, match="boom on 3"):
        LocalEngine(workers=2).map_partitions(boom, list(range(10)), partitions=5)


def test_both_jobs_run_on_the_local_engine_from_the_command_line(tmp_path: Path) -> None:
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 10, "b": 8})
    out = tmp_path / "ds"
    for argv in (
        ["jobs/manifest.py", "--input", str(lake), "--output", str(out), "--split-method", "stratified"],
        ["jobs/shard.py", "--dataset", str(out), "--num-shards", "2", "--image-size", "16"],
    ):
        proc = subprocess.run(
            [sys.executable, *argv, "--engine", "local"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    info = check_dataset(str(out))
    assert info.engine == "local"
