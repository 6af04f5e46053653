"""One shard build's shared state (:class:`Build`: options, engine, checked inputs, staging
folder, segment size) and how its steps run their tasks on the engine (:func:`run_tasks`), with
the number of preprocessing tasks (:func:`preprocess_tasks`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jobs.common.engines import Engine
from jobs.common.tasks import each, pack
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.inputs import ShardInputs
from jobs.shard_steps.staging import staging_folder

__all__ = ["Build", "default_tasks", "preprocess_tasks", "run_tasks", "start_build"]

#: Rows preprocessed by one task at most, when ``--partitions`` is not given: a shard with more
#: rows is cut into segments, preprocessed by several tasks and then assembled.
_ROWS_PER_TASK = 2000
#: Preprocessing tasks at most by default (or four per core on a larger cluster): a Dask client
#: holds ~40 kB per task (docs/scaling.md), so at 100M rows segments grow instead of tasks.
_MAX_TASKS = 10_000


def default_tasks(rows: int, cores: int) -> int:
    """Preprocessing tasks without ``--partitions``: one per :data:`_ROWS_PER_TASK` rows, at least
    one per core, at most :data:`_MAX_TASKS` (or four per core, if more)."""
    return max(cores, min(math.ceil(rows / _ROWS_PER_TASK), max(_MAX_TASKS, 4 * cores)))


def run_tasks(
    engine: Engine, fn: Any, items: list[Any], sizes: list[int], slots: int, *, cpu_bound: bool = False
) -> list[Any]:
    """``fn`` over ``items`` on the engine, packed into at most ``slots`` tasks by ``sizes``
    (``cpu_bound``: see :meth:`~jobs.common.engines.Engine.map_partitions`)."""
    if not items:
        return []
    bins = pack(items, sizes, slots)
    return engine.map_partitions(each(fn), bins, partitions=len(bins), cpu_bound=cpu_bound)


@dataclass(frozen=True, slots=True)
class Build:
    """What every step of one build shares: its options, engine and checked inputs, its staging
    folder, the rows of a preprocessing segment and the engine tasks that preprocess."""

    cfg: ShardConfig
    engine: Engine
    job: ShardInputs
    staging: str
    segment_rows: int
    slots: int

    def footer(self) -> dict[str, Any]:
        """Every shard's footer, less its channel and index."""
        return {
            "dataset_version": self.job.version,
            "num_shards": self.cfg.num_shards,
            "format_version": self.job.columns.format_version,
            "image_format": self.cfg.image_format,
            "image_size": self.cfg.image_size,
        }


def preprocess_tasks(cfg: ShardConfig, rows: int, engine: Engine) -> int:
    """Engine tasks that preprocess ``rows`` rows: one per core, or more when each would get
    over :data:`_ROWS_PER_TASK` rows, up to :data:`_MAX_TASKS` (``--partitions`` if given). A
    task uses its core to the end whatever the others do: fewer, longer tasks leave fewer gaps
    between tasks."""
    return cfg.partitions or default_tasks(rows, engine.parallelism)


def start_build(cfg: ShardConfig, engine: Engine, job: ShardInputs, *, rows: int) -> Build:
    """A build of ``rows`` rows: its segments' size and its staging folder (named after them)."""
    wanted = preprocess_tasks(cfg, rows, engine)
    segment_rows = math.ceil(rows / wanted)
    return Build(
        cfg=cfg,
        engine=engine,
        job=job,
        segment_rows=segment_rows,
        staging=staging_folder(job.root, job.version, cfg, segment_rows, resume=cfg.resume),
        # Engine tasks in a multiple of the cores, so the last round of tasks keeps every core busy.
        slots=engine.parallelism * math.ceil(wanted / engine.parallelism),
    )
