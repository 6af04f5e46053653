"""The Dask engine's operations, one by one, on a LocalCluster of worker processes (``slow``:
tests/conftest.py marks every test that uses one) and, where the claim is the engine's own code,
also on a cluster of threads in this process, which starts in a fraction of a second (quick)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lakeshard.errors import ManifestError

REPO = Path(__file__).resolve().parents[3]


def _double(items: list[int]) -> list[int]:
    return [2 * i for i in items]


def _sizes(items: list[int]) -> list[int]:
    return [len(items)]


def _boom(items: list[int]) -> list[int]:
    if 3 in items:
        raise ManifestError("cannot list file:///lake/cat: boom on 3")
    return items


@pytest.fixture(scope="module")
def threaded_dask_engine() -> Iterator[Any]:
    """A DaskEngine on a LocalCluster of one worker of two threads in this process: the engine's
    code, without worker processes (so no pickling: the process cluster's tests check that)."""
    from distributed import Client, LocalCluster

    from jobs.common.engines.dask_engine import DaskEngine

    with (
        LocalCluster(  # its dashboards on loopback (the defaults listen on every interface)
            n_workers=1,
            threads_per_worker=2,
            processes=False,
            dashboard_address="127.0.0.1:0",
            worker_dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield DaskEngine(client=client)


#: Each engine test runs on both clusters: the engine of worker processes (slow) and of threads.
ON_BOTH = pytest.mark.parametrize("engine_fixture", ["dask_engine", "threaded_dask_engine"])


@ON_BOTH
def test_map_partitions_runs_every_item_once(engine_fixture: str, request: pytest.FixtureRequest) -> None:
    dask_engine = request.getfixturevalue(engine_fixture)
    items = list(range(23))
    assert sorted(dask_engine.map_partitions(_double, items, partitions=4)) == [2 * i for i in items]
    assert sorted(dask_engine.map_partitions(_sizes, items, partitions=4)) == [5, 6, 6, 6]
    # More partitions than items: one item per task, none empty.
    assert dask_engine.map_partitions(_sizes, items[:3], partitions=50) == [1, 1, 1]
    assert dask_engine.map_partitions(_double, [], partitions=4) == []


@ON_BOTH
def test_map_partitions_reraises_the_worker_error(
    engine_fixture: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(ManifestError, match="boom on 3"):
        request.getfixturevalue(engine_fixture).map_partitions(_boom, list(range(10)), partitions=5)


@ON_BOTH
def test_parallelism_counts_worker_threads(engine_fixture: str, request: pytest.FixtureRequest) -> None:
    assert request.getfixturevalue(engine_fixture).parallelism == 2


@ON_BOTH
def test_a_handed_client_is_not_closed(engine_fixture: str, request: pytest.FixtureRequest) -> None:
    from jobs.common.engines.dask_engine import DaskEngine

    client = request.getfixturevalue(engine_fixture).client
    DaskEngine(client=client).close()
    assert client.status == "running"


@pytest.mark.slow
@pytest.mark.dask
def test_an_owned_local_cluster_is_closed() -> None:
    from jobs.common.engines.dask_engine import DaskEngine

    engine = DaskEngine(n_workers=1)
    try:
        assert engine.parallelism == 1
        assert engine.map_partitions(_double, [1, 2], partitions=2) == [2, 4]
    finally:
        engine.close()
    assert engine.client.status == "closed"


def test_an_unreachable_scheduler_is_a_clear_error(monkeypatch) -> None:
    from jobs.common.engines.dask_engine import DaskEngine
    from lakeshard.errors import EngineError
    from tests.helpers.procs import refused_port

    with refused_port() as port:
        address = f"tcp://127.0.0.1:{port}"
        start = time.monotonic()
        with pytest.raises(EngineError, match=f"cannot connect to the dask scheduler at '{address}'"):
            DaskEngine(scheduler=address, connect_timeout=2)
    assert time.monotonic() - start < 30


@pytest.fixture()
def manifested(tmp_path: Path, local_engine) -> Path:
    from jobs import manifest as manifest_job
    from jobs.manifest_steps.config import ManifestConfig
    from tests.helpers.lake import write_lake

    write_lake(tmp_path / "raw", {"a": 6, "b": 6})
    manifest_job.run(
        ManifestConfig(input=str(tmp_path / "raw"), output=str(tmp_path / "ds"), split="train=1"),
        local_engine,
    )
    return tmp_path / "ds"


def _shard_cli(dataset: Path, scheduler: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    # A hang guard below the client's own 60 s connect timeout: a refused port must fail sooner.
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.shard",
            "--engine",
            "dask",
            "--scheduler",
            scheduler,
            "--dataset",
            str(dataset),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=40,
    )


def test_a_malformed_scheduler_address_is_one_error_line_naming_it(manifested: Path) -> None:
    proc = _shard_cli(manifested, "127.0.0.1:8786x")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and errors[0].startswith(
        "jobs/shard.py: error: --scheduler '127.0.0.1:8786x' is not a dask scheduler address"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_a_refused_scheduler_port_fails_naming_the_address(manifested: Path) -> None:
    from tests.helpers.procs import refused_port

    with refused_port() as port:
        address = f"tcp://127.0.0.1:{port}"
        proc = _shard_cli(manifested, address)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"jobs/shard.py: error: cannot connect to the dask scheduler at '{address}' (--scheduler)"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def _die_once(items: list[str]) -> list[str]:
    """Kill this worker process the first time it runs item "die" (as an OOM kill would)."""
    marker = Path(items[0].split("|")[1])
    if any(i.startswith("die|") for i in items) and not marker.exists():
        marker.write_text("died once")
        os._exit(1)
    return [i.split("|")[0] for i in items]


@pytest.mark.slow
def test_a_task_whose_worker_dies_runs_again(dask_engine, tmp_path: Path) -> None:
    marker = tmp_path / "died"
    items = [f"{name}|{marker}" for name in ("a", "b", "die", "c", "d")]
    got = dask_engine.map_partitions(_die_once, items, partitions=5)
    assert marker.exists(), "the task never killed its worker: the test tested nothing"
    assert sorted(got) == ["a", "b", "c", "d", "die"]
