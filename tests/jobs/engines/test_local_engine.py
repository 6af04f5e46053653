"""The local engine (a thread pool in this process, worker processes for a CPU-bound map) behind
the same Engine protocol, and the jobs' CLI accepting it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.common.engines import open_engine
from jobs.common.engines.local_engine import LocalEngine
from lakeshard.errors import EngineError, ManifestError
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


def _where(part: list[int]) -> list[tuple[int, int, str | None]]:
    return [(i, os.getpid(), os.environ.get("LAKESHARD_TEST_SET_LATE")) for i in part]


def _fail_on_3(part: list[int]) -> list[int]:
    if 3 in part:
        raise ManifestError("cannot list file:///lake/cat: boom on 3")
    return part


def _die(part: list[int]) -> list[int]:
    os.kill(os.getpid(), signal.SIGKILL)
    return part


def test_a_cpu_bound_map_runs_on_worker_processes_in_the_drivers_environment(monkeypatch) -> None:
    """Worker processes, kept between maps, each task seeing the environment as it is when the
    map starts (set after the engine and its forkserver started); stopped by close()."""
    engine = LocalEngine(workers=2)
    monkeypatch.setenv("LAKESHARD_TEST_SET_LATE", "yes")
    first = engine.map_partitions(_where, list(range(6)), partitions=3, cpu_bound=True)
    second = engine.map_partitions(_where, list(range(6)), partitions=3, cpu_bound=True)
    assert sorted(i for i, _, _ in first) == list(range(6))
    pids = {pid for _, pid, _ in first + second}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert {env for _, _, env in first} == {"yes"}
    monkeypatch.delenv("LAKESHARD_TEST_SET_LATE")
    assert {env for _, _, env in engine.map_partitions(_where, [1, 2], partitions=2, cpu_bound=True)} == {
        None
    }
    # One part, or one worker: no process is worth starting.
    assert {pid for _, pid, _ in engine.map_partitions(_where, [1], partitions=1, cpu_bound=True)} == {
        os.getpid()
    }
    engine.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            for _ in range(200):  # close() has waited for them; a zombie is reaped by the pool
                os.kill(pid, 0)
                threading.Event().wait(0.05)


def test_a_cpu_bound_task_error_is_raised_as_it_was() -> None:
    engine = LocalEngine(workers=2)
    try:
        with pytest.raises(ManifestError, match="boom on 3"):
            engine.map_partitions(_fail_on_3, list(range(10)), partitions=5, cpu_bound=True)
        assert engine.map_partitions(_fail_on_3, [5, 6], partitions=2, cpu_bound=True) == [5, 6]
    finally:
        engine.close()


def test_a_worker_process_killed_mid_task_fails_the_map_naming_it() -> None:
    engine = LocalEngine(workers=2)
    try:
        with pytest.raises(
            EngineError,
            match=r"a local worker process died while running _die \(killed, or out of memory\?\)",
        ):
            engine.map_partitions(_die, [1, 2], partitions=2, cpu_bound=True)
        assert sorted(engine.map_partitions(_fail_on_3, [5, 6], partitions=2, cpu_bound=True)) == [5, 6]
    finally:
        engine.close()


_KILLED_DRIVER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from jobs.common.engines.local_engine import LocalEngine
from tests.jobs.engines.test_local_engine import _where

if __name__ == "__main__":
    engine = LocalEngine(workers=2)
    pids = {pid for _, pid, _ in engine.map_partitions(_where, [1, 2, 3, 4], partitions=2, cpu_bound=True)}
    print(" ".join(map(str, sorted(pids))), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as kill -9 would: no close(), no atexit
"""


def test_the_worker_processes_of_a_killed_driver_exit_with_it(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_KILLED_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert pids, proc.stdout
    deadline = time.monotonic() + 30
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} outlived their killed driver"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its parent's wait has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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


_SMALL = ["--split-method", "stratified", "--num-shards", "2", "--image-size", "16", "--engine", "local"]


def test_the_worker_processes_of_a_job_run_as_a_module_warn_of_nothing(tmp_path: Path) -> None:
    """``python -m jobs.build``: each worker runs ``jobs.build`` again (as ``__mp_main__``); the
    forkserver must not have imported it already, or runpy warns in every worker."""
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 10, "b": 8})
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.build", "--input", str(lake), "--output", str(tmp_path / "ds"), *_SMALL],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preprocessing" in proc.stderr  # the cpu-bound map ran, on the worker processes
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


_MANIFEST_ALONE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from jobs.manifest import main

assert main(["--input", sys.argv[2], "--output", sys.argv[3], "--engine", "local", "--split-method", "stratified"]) == 0
print("children:", *(open(f"/proc/self/task/{t}/children").read() for t in os.listdir("/proc/self/task")))
"""


def test_the_manifest_job_alone_starts_no_worker_process(tmp_path: Path) -> None:
    """Its maps are not cpu_bound: the local engine's forkserver (a second of CPU importing the
    jobs' modules) and its resource tracker are not started."""
    lake = tmp_path / "raw"
    write_lake(lake, {"a": 10, "b": 10})
    script = tmp_path / "manifest_alone.py"
    script.write_text(_MANIFEST_ALONE)
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO), str(lake), str(tmp_path / "ds")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    children = proc.stdout.rsplit("children:", 1)[1].split()
    assert children == [], f"the manifest job left child processes {children}"
