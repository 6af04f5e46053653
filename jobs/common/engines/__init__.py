"""Engines run the jobs' heavy steps on workers; the jobs themselves are engine-free.

An engine runs a function over parts of a list of work items on its workers and gives back the
results (see :class:`Engine`). That is all the jobs need: they plan on the driver and hand each
task everything it reads and writes, so the Spark and Dask engines are thin adapters over the
same core functions, which is why both write the same dataset. No image passes through an
engine's shuffle, cache or result.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any, Protocol, TypeVar

__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "FORWARDED_ENV",
    "STORE_ENV_PREFIXES",
    "Engine",
    "open_engine",
    "split_parts",
    "store_environ",
]

#: Where S3, GCS and the Azure storage account are (not who: credentials stay with each worker's
#: AWS, Google or Azure environment); both engines forward these from the driver to their workers.
FORWARDED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_PROJECT",
)

#: The environment the stores read, where and who (endpoints, accounts, keys, key files, tokens):
#: every variable whose name starts with one of these. An engine whose workers run on the
#: driver's machine gives each task the driver's (:func:`store_environ`).
STORE_ENV_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCLOUD_", "STORAGE_EMULATOR_HOST")

T = TypeVar("T")
R = TypeVar("R")


class Engine(Protocol):
    name: str

    @property
    def parallelism(self) -> int:
        """How many tasks the engine runs at once (cores across workers)."""

    @property
    def task_cpus(self) -> int:
        """Cores each task has to itself (Spark's ``spark.task.cpus``; 1 on Dask)."""

    def map_partitions(
        self,
        fn: Callable[[list[T]], list[R]],
        items: Sequence[T],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[R]:
        """Split ``items`` into ``partitions`` parts, run ``fn`` on each part on a worker,
        and return the concatenated results (in no particular order). ``cpu_bound``: ``fn``
        spends its time in Python code that holds the GIL (an engine of threads runs it in
        processes instead; Spark's and Dask's tasks are in processes already)."""

    def close(self) -> None:
        """Release what the engine started (not what it was handed)."""


ENGINES: dict[str, str] = {
    "spark": "jobs.common.engines.spark_engine:SparkEngine",
    "dask": "jobs.common.engines.dask_engine:DaskEngine",
    "local": "jobs.common.engines.local_engine:LocalEngine",
}

#: The engines a job's ``--engine`` takes.
ENGINE_NAMES = tuple(ENGINES)


def split_parts(items: Sequence[T], partitions: int) -> list[list[T]]:
    """``items`` in contiguous parts, as ``SparkContext.parallelize`` cuts them: part i is
    ``items[i * n // parts : (i + 1) * n // parts]``; at most ``len(items)`` parts, none if
    there are no items."""
    items = list(items)
    parts = max(1, min(partitions, len(items)))
    bounds = [i * len(items) // parts for i in range(parts + 1)]
    return [items[a:b] for a, b in pairwise(bounds)] if items else []


def store_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (this process's environment by default) that a store reads
    (:data:`STORE_ENV_PREFIXES`)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(STORE_ENV_PREFIXES)}


def open_engine(name: str, **options: Any) -> Engine:
    """Import and start the engine called ``name`` (``spark``, ``dask`` or ``local``)."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
