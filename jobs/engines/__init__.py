"""Engines run the jobs' heavy steps on workers; the jobs themselves are engine-free.

An engine provides five operations (see :class:`Engine`); the Spark and Dask engines are thin
adapters over the same core functions, which is why both write the same dataset.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import pyarrow as pa

__all__ = ["ENGINES", "Engine", "WriteFn", "open_engine"]

T = TypeVar("T")
R = TypeVar("R")

#: ``fn(part, records)``: write partition ``part`` from its ``((part, position), row)``
#: records, sorted by position; returns the shard's stats.
WriteFn = Callable[[int, Iterator[tuple[Any, dict[str, Any]]]], dict[str, Any]]


class Engine(Protocol):
    name: str

    @property
    def parallelism(self) -> int:
        """How many tasks the engine runs at once (cores across workers)."""

    def map_partitions(self, fn: Callable[[list[T]], list[R]], items: Sequence[T], *,
                       partitions: int) -> list[R]:
        """Split ``items`` into ``partitions`` parts, run ``fn`` on each part on a worker,
        and return the concatenated results (in no particular order)."""

    def preprocess(self, rows: pa.Table, fn: Callable[[pa.RecordBatch], pa.RecordBatch],
                   schema: pa.Schema, *, partitions: int) -> Any:
        """Run ``fn`` over ``rows`` in ``partitions`` tasks and keep the result on the
        workers; return a handle to it."""

    def collect(self, staged: Any, columns: list[str]) -> pa.Table:
        """Bring ``columns`` of the staged result to the driver."""

    def write_shards(self, staged: Any, plan: pa.Table, fn: WriteFn, *, num_parts: int) -> list[dict[str, Any]]:
        """Route each staged row to the plan's partitions (a row listed twice in ``plan`` goes
        twice, with its ``is_pad``), sort each partition by position, and run ``fn`` on it."""

    def release(self, staged: Any) -> None:
        """Free the staged result on the workers."""

    def close(self) -> None:
        """Release what the engine started (not what it was handed)."""


ENGINES: dict[str, str] = {
    "spark": "jobs.engines.spark_engine:SparkEngine",
    "dask": "jobs.engines.dask_engine:DaskEngine",
}


def open_engine(name: str, **options: Any) -> Engine:
    """Import and start the engine called ``name`` (``spark`` or ``dask``)."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
