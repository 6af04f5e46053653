"""The Dask engine's operations, one by one, on a LocalCluster of worker processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lakeshard.errors import ManifestError

pytestmark = pytest.mark.dask


def _double(items: list[int]) -> list[int]:
    return [2 * i for i in items]


def _sizes(items: list[int]) -> list[int]:
    return [len(items)]


def _boom(items: list[int]) -> list[int]:
    if 3 in items:
        raise ManifestError("cannot list file:///lake/cat: boom on 3")
    return items


def test_map_partitions_runs_every_item_once(dask_engine) -> None:
    items = list(range(23))
    assert sorted(dask_engine.map_partitions(_double, items, partitions=4)) == [2 * i for i in items]
    assert sorted(dask_engine.map_partitions(_sizes, items, partitions=4)) == [5, 6, 6, 6]
    # More partitions than items: one item per task, none empty.
    assert dask_engine.map_partitions(_sizes, items[:3], partitions=50) == [1, 1, 1]
    assert dask_engine.map_partitions(_double, [], partitions=4) == []


def test_map_partitions_reraises_the_worker_error(dask_engine) -> None:
    with pytest.raises(ManifestError, match="boom on 3"):
        dask_engine.map_partitions(_boom, list(range(10)), partitions=5)


def test_parallelism_counts_worker_threads(dask_engine) -> None:
    assert dask_engine.parallelism == 2


def test_a_handed_client_is_not_closed(dask_client) -> None:
    from jobs.engines.dask_engine import DaskEngine

    DaskEngine(client=dask_client).close()
    assert dask_client.status == "running"


@pytest.mark.slow
def test_an_owned_local_cluster_is_closed() -> None:
    from jobs.engines.dask_engine import DaskEngine

    engine = DaskEngine(n_workers=1)
    try:
        assert engine.parallelism == 1
        assert engine.map_partitions(_double, [1, 2], partitions=2) == [2, 4]
    finally:
        engine.close()
    assert engine.client.status == "closed"


def test_an_unreachable_scheduler_is_a_clear_error(monkeypatch) -> None:
    from jobs.engines.dask_engine import DaskEngine
    from lakeshard.errors import EngineError
    from tests.helpers.procs import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"cannot connect to the dask scheduler at '{address}'"):
        DaskEngine(scheduler=address, connect_timeout=2)
    assert time.monotonic() - start < 30


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
