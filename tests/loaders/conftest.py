"""Fixtures of the loader tests; the dataset builders are in ``loader_builders.py``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loader_builders import write_dataset


@pytest.fixture(scope="module")
def prep_cluster() -> Iterator[Any]:
    """A preparation cluster: a dask ``LocalCluster`` of one worker process, one thread."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    ) as running:
        yield running


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A 2-shard PNG dataset: 40 train rows (8 row groups of 5), 12 validation, 12 test."""
    root = tmp_path / "ds"
    write_dataset(root)
    return root


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every loader test must leave no thread behind (a loader's threads stop when it is closed
    or garbage-collected). The garbage is collected only when a thread is still there: a full
    collection costs ~0.4 s once Spark, Dask and torch are imported, and most tests leave none."""
    before = set(threading.enumerate())
    yield

    def leaked() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.name.startswith("lakeshard")]

    left = leaked()
    if left:
        gc.collect()
        left = leaked()
    assert not left, f"leaked threads: {left}"
