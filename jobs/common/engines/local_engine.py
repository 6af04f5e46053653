"""The local engine: the jobs' tasks on a thread pool in this process, no Spark, no Dask.

    python -m jobs.manifest --engine local --input ./lake/raw --output ./datasets/pets-v1
    python -m jobs.shard --engine local --dataset ./datasets/pets-v1 --num-shards 2

For small lakes and for fast tests of the engine-free core: it runs the same task functions on
the same parts of the work as the other engines (so it writes the same dataset), with nothing to
start. Tasks share the process and its GIL; image decoding releases it, the rest takes turns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jobs.common.engines import split_parts
from lakeshard.settings import check_positive

__all__ = ["LocalEngine"]

log = logging.getLogger(__name__)


class LocalEngine:
    name = "local"

    def __init__(self, *, workers: int | None = None, **_: Any) -> None:
        check_positive("workers", workers, allow_none=True)
        self._workers = workers or os.cpu_count() or 1
        log.info("local engine: %d thread(s) in this process", self._workers)

    @property
    def parallelism(self) -> int:
        return self._workers

    @property
    def task_cpus(self) -> int:
        return 1

    def map_partitions(
        self, fn: Callable[[list[Any]], list[Any]], items: Sequence[Any], *, partitions: int
    ) -> list[Any]:
        parts = split_parts(items, partitions)
        if not parts:
            return []
        # NOTE [ Local task errors ]: pool.map re-raises the first failed part's exception here,
        # with its own traceback; leaving the `with` waits for the parts already running.
        with ThreadPoolExecutor(min(self._workers, len(parts)), thread_name_prefix="lakeshard-task") as pool:
            return [row for part in pool.map(fn, parts) for row in part]

    def close(self) -> None:
        """Nothing to release: the pool lives only inside each ``map_partitions``."""
