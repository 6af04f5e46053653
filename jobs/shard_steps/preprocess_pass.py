"""The preprocessing pass, run from the driver: every segment of the first plan that an
interrupted run did not finish, preprocessed straight into its file on the workers
(:mod:`jobs.shard_steps.preprocess`); with ``--base``, the base's images of unchanged objects
found first (:mod:`jobs.shard_steps.reuse`). What it did is a :class:`Preprocessed`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import pyarrow as pa

from jobs.common.tasks import pack
from jobs.shard_steps.build_state import Build, run_tasks
from jobs.shard_steps.plan_pass import Plan
from jobs.shard_steps.preprocess import REJECT_SCHEMA, SegmentResult, SegmentTask, preprocess_segment
from jobs.shard_steps.reuse import BaseDataset, ReusePlan, reuse_images
from jobs.shard_steps.reuse_tasks import StagedFile
from jobs.shard_steps.segments import segment_tasks
from jobs.shard_steps.staging import finished

__all__ = ["Preprocessed", "preprocess_segments"]

#: The shard job's driver logs as the job (``jobs.shard``), whichever step it runs.
log = logging.getLogger("jobs.shard")


@dataclass(frozen=True, slots=True)
class Preprocessed:
    """Every segment's task and result (by segment file; those an interrupted run of this job
    finished first), and what :class:`~lakeshard.format.BuildInfo` counts of them."""

    tasks: list[SegmentTask]
    results: dict[str, SegmentResult]
    resumed: int  #: segments an interrupted run finished, reused as they are
    ran: int  #: preprocessing tasks run
    decoded: int  #: images fetched and decoded
    taken: int  #: images taken from the ``--base`` dataset

    def rejects(self) -> pa.Table:
        """Every segment's rejects (a row and its pad copies may each have failed)."""
        tables = [r.rejects for r in self.results.values()]
        return pa.concat_tables(tables) if tables else REJECT_SCHEMA.empty_table()


def _with_base(
    build: Build,
    base: BaseDataset,
    reuse: ReusePlan,
    staged: tuple[StagedFile, ...],
    tasks: list[SegmentTask],
    resumed: dict[str, SegmentResult],
) -> list[SegmentTask]:
    """``tasks``, those still to run naming the runs of the images they take from ``base``
    (:mod:`jobs.shard_steps.reuse`, on the workers; ``staged`` by the order pass)."""
    todo = [t for t in tasks if t.uri not in resumed]
    log.info(
        "--base %s (version %s): looking up the %d rows to preprocess among its %d shard files",
        base.root,
        base.info.dataset_version,
        sum(t.num_rows for t in todo),
        len(base.shards),
    )
    found = reuse_images(
        partial(run_tasks, build.engine),
        base,
        reuse.folder,
        list(staged),
        todo,
        skip=tuple(t.reuse_id for t in tasks if t.uri in resumed),
        cores=build.engine.parallelism,
    )
    log.info(
        "--base %s holds the images of %d of them, taken from its shards; the other %d are fetched "
        "and decoded",
        base.root,
        found.matched,
        sum(t.num_rows for t in todo) - found.matched,
    )
    swap = {t.uri: t for t in found.tasks}
    return [swap.get(t.uri, t) for t in tasks]


def preprocess_segments(build: Build, plan: Plan) -> Preprocessed:
    """Preprocess every segment of the first plan that an earlier run did not finish, straight
    into its file (with ``--base``, the base's images of unchanged objects found first)."""
    cfg, engine, n = build.cfg, build.engine, build.cfg.num_shards
    tasks = [
        t
        for c in plan.channels
        for t in segment_tasks(
            build.staging,
            c.channel.first,
            c.orders,
            cfg,
            build.footer(),
            segment_rows=build.segment_rows,
            decode_threads=cfg.decode_threads or engine.task_cpus,
            schema=build.job.columns.schema,
        )
    ]
    resumed = finished(build.staging, tasks)
    if build.job.base is not None and plan.reuse is not None:
        tasks = _with_base(build, build.job.base, plan.reuse, plan.staged, tasks, resumed)
    todo = [t for t in tasks if t.uri not in resumed]
    if resumed:
        log.info(
            "resuming: %d of %d segments (%d images) were preprocessed by an interrupted run of this "
            "job; reusing them (--no-resume starts over)",
            len(resumed),
            len(tasks),
            sum(r.rows for r in resumed.values()),
        )
    sizes = [t.num_rows for t in todo]
    log.info(
        "preprocessing %d images (%s) straight into %d shard files: %d segments in %d tasks on %s",
        sum(sizes),
        ", ".join(build.job.channels),
        len(build.job.channels) * n,
        len(todo),
        len(pack(todo, sizes, build.slots)) if todo else 0,
        engine.name,
    )
    done: list[SegmentResult] = run_tasks(
        engine, preprocess_segment, todo, sizes, build.slots, cpu_bound=True
    )
    taken = sum(d.reused for d in done)
    return Preprocessed(
        tasks=tasks,
        results={**resumed, **{d.uri: d for d in done}},
        resumed=len(resumed),
        ran=len(todo),
        decoded=sum(d.rows for d in done) - taken,
        taken=taken,
    )
