"""Shard job: turn the manifests into equal per-GPU Parquet shards of preprocessed images.

    spark-submit jobs/shard.py --dataset s3://lake/datasets/pets-v1 --num-shards 4 --image-size 224
    python -m jobs.shard --engine dask --dataset ./datasets/pets-v1 --num-shards 2
    python -m jobs.shard --dataset ./datasets/pets-v2 --num-shards 2 --base ./datasets/pets-v1

For each channel, writes exactly ``--num-shards`` files ``shards/channel=<c>/part-0000i-of-0000N.parquet``
(on S3 in a version folder, ``shards/v=<version>/channel=<c>/...``: no copy, see :mod:`jobs.shard_steps.commit`)
with equal row counts and every class spread evenly (at most one apart), rows shuffled within
each shard; images that fail (or were replaced since the manifest was built) go to the shard rejects table;
``dataset.json`` comes last, then ``report.html`` (a report that fails is a warning, not a failed job).

Check the inputs (:mod:`jobs.shard_steps.inputs`, before the engine starts) -> plan from the manifest's class
counts on the driver (:mod:`jobs.shard_steps.deal`), each row's slot and each shard's order on the workers
(:mod:`jobs.shard_steps.plan_tasks`: the driver never holds the manifest's rows) -> preprocess on the workers
(:mod:`jobs.shard_steps.preprocess`: fetch, decode, orient, RGB, resize, encode), each task writing its shard's rows straight into
the shard's file in a staging folder -> repair: if images were rejected, re-plan without them, from
the reject list alone (the plan moves as few rows as it can), and assemble the shards that changed from rows already
preprocessed (:mod:`jobs.shard_steps.repair`, :mod:`jobs.shard_steps.assemble`) -> commit (:mod:`jobs.shard_steps.commit`): move the staging folder into place
(locally; on S3 it is the version folder), then write ``dataset.json``. A
reader sees the old dataset, no dataset, or the new one, never a part. No image is sent through
the engine: a task reads it from the lake and writes it to its shard; the tasks return counts
and rejects, not a row per image.

Incremental (``--base``, :mod:`jobs.shard_steps.reuse`): rows whose object (URI, ETag, size) a previous
dataset built with the same image options already holds take their images from its shards,
joined on the workers by URI bucket before preprocessing; the rest is as above, and so is the
dataset (a build from scratch makes the same one).

Resume: the staging folder is named after everything its files depend on, and each
preprocessing task writes a receipt once its file is complete; a rerun of a killed job reuses
every segment with a valid receipt (``--no-resume`` starts over; :mod:`jobs.shard_steps.staging`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

import pyarrow as pa
import pyarrow.compute as pc

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.common.tasks import each, pack
from jobs.shard_steps.assemble import AssembledShard, locate_and_assemble
from jobs.shard_steps.commit import commit, place_assembled, staged_rejects
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.dataset_info import BuiltChannel, ShardFile, dataset_info, dataset_version
from jobs.shard_steps.deal import DROPPED_ROWS_SHARD, Deal, deal_from_counts
from jobs.shard_steps.inputs import ShardInputs, check_shard_inputs
from jobs.shard_steps.plan_summary import PlanSummary, channel_plan
from jobs.shard_steps.plan_tasks import (
    Channel,
    ClassRows,
    OrderPass,
    OrderTask,
    PlannedChannel,
    ShardOrder,
    ShardsToOrder,
    SlotPart,
    order_rows,
    order_tasks,
    slot_rows,
    slot_tasks,
)
from jobs.shard_steps.preprocess import (
    REJECT_SCHEMA,
    RejectsTask,
    SegmentResult,
    SegmentTask,
    preprocess_segment,
    unique_rejects,
    write_rejects,
)
from jobs.shard_steps.repair import (
    RepairedChannel,
    check_reject_budget,
    repair_tasks,
    repaired_channel,
    shards_to_assemble,
)
from jobs.shard_steps.report_html import write_report
from jobs.shard_steps.reuse import (
    BaseDataset,
    ReusePlan,
    StagedFile,
    StageTask,
    plan_reuse,
    reuse_images,
    stage,
)
from jobs.shard_steps.segments import segment_tasks
from jobs.shard_steps.staging import (
    finished,
    plan_only_folder,
    rejects_path,
    staging_folder,
    versioned,
    work_uri,
)
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import FORMAT_VERSION, BuildInfo, DatasetInfo, ManifestInfo
from lakeshard.locks import dataset_lock

__all__ = ["dataset_version", "hold", "main", "parser", "plan_only", "prepare", "run"]

log = logging.getLogger("jobs.shard")

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


def _run(engine: Engine, fn: Any, items: list[Any], sizes: list[int], slots: int) -> list[Any]:
    """``fn`` over ``items`` on the engine, packed into at most ``slots`` tasks by ``sizes``."""
    if not items:
        return []
    bins = pack(items, sizes, slots)
    return engine.map_partitions(each(fn), bins, partitions=len(bins))


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
            "format_version": FORMAT_VERSION,
            "image_format": self.cfg.image_format,
            "image_size": self.cfg.image_size,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    """The first plan of every channel, and (``--base``) where the join with the base is staged
    and what the order pass staged for it."""

    channels: tuple[PlannedChannel, ...]
    reuse: ReusePlan | None
    staged: tuple[StagedFile, ...]


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


# --- The plan -------------------------------------------------------------------------------


def _classes(marker: ManifestInfo, channel: str) -> tuple[ClassRows, ...]:
    """Each class of ``channel`` with rows, from the manifest's marker (``counts.classes``), by
    label index: the aggregates the plan is made from."""
    counts = marker.counts.classes[channel]
    classes = (ClassRows(name, int(marker.labels[name]), int(n)) for name, n in counts.items() if n)
    return tuple(sorted(classes, key=lambda c: c.index))


def _deal(
    cfg: ShardConfig,
    classes: tuple[ClassRows, ...],
    *,
    seed: int,
    channel: str,
    rejected: list[int] | None = None,
) -> Deal:
    """The plan of ``channel`` from its ``classes``, without the rows at slots ``rejected``."""
    return deal_from_counts(
        {c.index: c.rows for c in classes},
        num_shards=cfg.num_shards,
        seed=seed,
        channel=channel,
        remainder=cfg.remainder,
        rejected=rejected or (),
    )


def _channels(cfg: ShardConfig, job: ShardInputs) -> list[Channel]:
    """The channels to shard, each with its first plan, from the manifest's counts (the rows
    stay on the workers: :mod:`jobs.shard_steps.deal`, :mod:`jobs.shard_steps.plan_tasks`)."""
    channels = []
    for name in job.channels:
        classes = _classes(job.marker, name)
        first = _deal(cfg, classes, seed=job.seed, channel=name)
        channels.append(Channel(name=name, classes=classes, first=first))
    return channels


def _preprocess_tasks(cfg: ShardConfig, rows: int, engine: Engine) -> int:
    """Engine tasks that preprocess ``rows`` rows: one per core, or more when each would get
    over :data:`_ROWS_PER_TASK` rows, up to :data:`_MAX_TASKS` (``--partitions`` if given). A
    task uses its core to the end whatever the others do: fewer, longer tasks leave fewer gaps
    between tasks."""
    return cfg.partitions or default_tasks(rows, engine.parallelism)


def _start(cfg: ShardConfig, engine: Engine, job: ShardInputs, *, rows: int) -> Build:
    """A build of ``rows`` rows: its segments' size and its staging folder (named after them)."""
    wanted = _preprocess_tasks(cfg, rows, engine)
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


def _slot_parts(
    engine: Engine, staging: str, root: str, channels: list[Channel]
) -> dict[str, tuple[str, ...]]:
    """Give every row its slot on the workers, a task per group of classes; the slot parts of
    each channel."""
    tasks = slot_tasks(channels, root=root, staging=staging, cores=engine.parallelism)
    # At most a task per core: every channel has a slot task of its own (three channels on two
    # cores are four), and these tasks are short; the engine's tasks each run several in turn.
    done: list[SlotPart] = _run(engine, slot_rows, tasks, [t.rows for t in tasks], engine.parallelism)
    total = sum(c.first.total for c in channels)
    if sum(p.rows for p in done) != total:
        raise ShardError(
            f"the slot tasks gave {sum(p.rows for p in done)} rows their slots, the plan counts {total}"
        )  # slot_rows checks each class
    return {c.name: tuple(t.uri for t in tasks if t.deal.channel == c.name) for c in channels}


def _plan_step(item: OrderTask | StageTask) -> ShardOrder | StagedFile:
    """An item of the order pass: an order task, or (``--base``) one staging the base's side of the join."""
    return order_rows(item) if isinstance(item, OrderTask) else stage(item)


def _order(
    engine: Engine,
    staging: str,
    plan: str,
    wanted: list[ShardsToOrder],
    *,
    segment_rows: int,
    reuse: ReusePlan | None = None,
) -> OrderPass:
    """Write the order files ``wanted`` of plan ``plan`` on the workers, in as many engine tasks
    as it has cores. With ``reuse`` (:func:`jobs.shard_steps.reuse.plan_reuse`), stage both
    sides of the join with the base in the same engine action."""
    tasks = order_tasks(
        staging, plan, wanted, segment_rows=segment_rows, join=reuse.folder if reuse else None
    )
    stage_tasks, sizes = (reuse.stage_tasks, reuse.sizes) if reuse else ((), ())
    done = _run(
        engine, _plan_step, [*tasks, *stage_tasks], [*(t.cuts[-1] for t in tasks), *sizes], engine.parallelism
    )
    orders = tuple(d for d in done if isinstance(d, ShardOrder))
    staged = [d for d in done if isinstance(d, StagedFile)]
    staged += [o.staged for o in orders if o.staged is not None]
    return OrderPass(orders=orders, staged=tuple(staged))


def _plan(build: Build, channels: list[Channel]) -> Plan:
    """The first plan on the workers: every row's slot, then the order file of every shard and
    of the dropped rows (preprocessed too, in case rejects change the plan); with ``--base``,
    both sides of the join with the base staged in the order pass's engine action."""
    job, n = build.job, build.cfg.num_shards
    parts = _slot_parts(build.engine, build.staging, job.root, channels)
    rows = sum(c.first.total for c in channels)
    reuse = (
        None
        if job.base is None
        else plan_reuse(job.base, rows, folder=work_uri(build.staging, "reuse"), slots=build.slots)
    )
    wanted = [
        ShardsToOrder(
            deal=c.first,
            slot_parts=parts[c.name],
            shards=(*range(n), *([DROPPED_ROWS_SHARD] if c.first.dropped else [])),
        )
        for c in channels
    ]
    done = _order(build.engine, build.staging, "first", wanted, segment_rows=build.segment_rows, reuse=reuse)
    return Plan(
        channels=tuple(
            PlannedChannel(channel=c, slot_parts=parts[c.name], orders=done.of(c.name)) for c in channels
        ),
        reuse=reuse,
        staged=done.staged,
    )


# --- Preprocessing --------------------------------------------------------------------------


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
        partial(_run, build.engine),
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


def _preprocess(build: Build, plan: Plan) -> Preprocessed:
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
    done: list[SegmentResult] = _run(engine, preprocess_segment, todo, sizes, build.slots)
    taken = sum(d.reused for d in done)
    return Preprocessed(
        tasks=tasks,
        results={**resumed, **{d.uri: d for d in done}},
        resumed=len(resumed),
        ran=len(todo),
        decoded=sum(d.rows for d in done) - taken,
        taken=taken,
    )


# --- Repair and assembly --------------------------------------------------------------------


def _final_deal(build: Build, channel: Channel, rejects: pa.Table) -> Deal:
    """The plan of ``channel`` without its ``rejects`` (its first plan if it has none), from the
    reject list alone: the plan moves as few rows as it can."""
    slots = rejects.filter(pc.equal(rejects["channel"], channel.name))["slot"].to_pylist()
    if not slots:
        return channel.first
    return _deal(build.cfg, channel.classes, seed=build.job.seed, channel=channel.name, rejected=slots)


def _repair(build: Build, plan: Plan, pre: Preprocessed) -> list[RepairedChannel]:
    """After preprocessing: the rejects checked against their budget, each channel's plan made
    again without its rejects (:mod:`jobs.shard_steps.repair`), and the shards to assemble (those
    that changed, and those preprocessed in segments); the order files of those that changed,
    on the workers."""
    n = build.cfg.num_shards
    failed = pre.rejects()
    rejects = unique_rejects(failed)
    check_reject_budget(
        rejects,
        sum(c.channel.first.total for c in plan.channels),
        max_fraction=build.cfg.max_reject_fraction,
        root=build.job.root,
    )
    finals = [_final_deal(build, c.channel, rejects) for c in plan.channels]
    log.info("plan: %s", ", ".join(f"{d.channel}={d.rows_per_shard}×{n}" for d in finals))
    need = [
        shards_to_assemble(c, final, failed, pre.tasks, num_shards=n)
        for c, final in zip(plan.channels, finals, strict=True)
    ]
    wanted = [
        ShardsToOrder(deal=final, shards=shards, slot_parts=c.slot_parts)
        for c, final, shards in zip(plan.channels, finals, need, strict=True)
        if final is not c.channel.first and shards
    ]
    redone = (
        _order(build.engine, build.staging, "final", wanted, segment_rows=build.segment_rows)
        if wanted
        else OrderPass(orders=(), staged=())
    )
    return [
        repaired_channel(
            c,
            final,
            shards,
            redone,
            staging=build.staging,
            rejected=int(pc.sum(pc.equal(rejects["channel"], final.channel)).as_py() or 0),
        )
        for c, final, shards in zip(plan.channels, finals, need, strict=True)
    ]


def _assemble(build: Build, channels: list[RepairedChannel], pre: Preprocessed) -> list[AssembledShard]:
    """Assemble the shards of ``channels`` that need it from rows already preprocessed, each
    beside its place (:mod:`jobs.shard_steps.assemble`), on the workers."""
    repairs = [
        r
        for c in channels
        for r in repair_tasks(c, pre.tasks, metadata=build.footer(), row_group_bytes=build.cfg.row_group_size)
    ]
    if repairs:
        log.info(
            "assembling %d of %d shard files from preprocessed rows (%d images rejected)",
            len(repairs),
            len(channels) * build.cfg.num_shards,
            sum(c.rejected for c in channels),
        )
    sizes = [c.final.rows_per_shard for c in channels for _ in c.assemble]
    return _run(build.engine, locate_and_assemble, repairs, sizes, build.slots)


# --- The rejects table and the commit -------------------------------------------------------


def _write_rejects_table(build: Build, pre: Preprocessed) -> None:
    """The shard rejects table, from the receipts of the segments that had rejects (before
    :func:`~jobs.shard_steps.commit.place_assembled`, which removes the receipts of the files
    assembled shards replace). On S3 straight into the version folder (no copy at the commit);
    locally into the staging folder, moved into place by the commit."""
    staging = build.staging
    with_rejects = tuple(
        t.receipt for t in pre.tasks if t.receipt is not None and pre.results[t.uri].rejects.num_rows
    )
    table = (
        RejectsTask(root=build.job.root, relpath=rejects_path(staging), receipts=with_rejects)
        if versioned(staging)
        else RejectsTask(root=staged_rejects(staging), receipts=with_rejects)
    )
    if with_rejects:
        _run(build.engine, write_rejects, [table], [1], 1)
    else:  # an empty table: no row to read, and on Spark an engine action costs tenths of a second
        write_rejects(table)


def _commit(
    build: Build, channels: list[RepairedChannel], pre: Preprocessed, assembled: list[AssembledShard]
) -> DatasetInfo:
    """Put the assembled shards in place, then commit them with ``dataset.json``
    (:mod:`jobs.shard_steps.commit`)."""
    job, n, staging = build.job, build.cfg.num_shards, build.staging
    files = {(c.name, s): uri for c in channels for s, uri in c.files.items()}
    paths = place_assembled(job.root, staging, files, pre.tasks, num_shards=n)
    written = {r.uri: r.stats for r in pre.results.values()} | {a.uri: a.stats for a in assembled}
    built = [
        BuiltChannel(
            name=c.name,
            deal=c.final,
            rejected=c.rejected,
            dropped=c.uris(c.final.dropped),
            padded=c.uris(c.final.padded),
            shards=tuple(
                ShardFile(index=s, path=paths[(c.name, s)], stats=written[uri]) for s, uri in c.files.items()
            ),
        )
        for c in channels
    ]
    made = BuildInfo(
        preprocess_tasks=pre.ran,
        preprocessed=pre.decoded,
        reused_segments=pre.resumed,
        assembled_shards=len(assembled),
        reused=pre.taken,
        base=job.base.ref() if job.base is not None else None,
    )
    info = dataset_info(
        build.cfg, job, built, made, engine=build.engine.name, rejects_path=rejects_path(staging)
    )
    commit(job.root, staging, built, info)
    log.info("dataset %s committed at %s", job.version, job.root)
    return info


def _write_report(root: str, info: DatasetInfo) -> None:
    """The report, after the commit: a report that cannot be written is a warning, never a
    failed job (the dataset is complete without it)."""
    try:
        write_report(root, info)
    except Exception as exc:
        log.warning(
            "the dataset at %s is committed, but its report could not be written: %s: %s "
            "(python -m jobs.report %s writes it again)",
            root,
            type(exc).__name__,
            exc,
            root,
        )


# --- The job --------------------------------------------------------------------------------


def plan_only(cfg: ShardConfig, engine: Engine) -> PlanSummary:
    """The job's dry run (``--plan-only``): its checks, then its plan from the manifest (every
    row's slot, every shard's order, on the workers as in :func:`run`) into a folder of its own
    under the dataset's ``_staging/`` (:func:`~jobs.shard_steps.staging.plan_only_folder`), removed at
    the end whatever happens; returns the plan's summary. Reads no image and leaves the dataset (and any staging of a real run) as it was."""
    job = check_shard_inputs(cfg)
    channels, n = _channels(cfg, job), cfg.num_shards
    rows = sum(c.first.total for c in channels)
    segment_rows = math.ceil(rows / _preprocess_tasks(cfg, rows, engine))
    staging = plan_only_folder(job.root)
    log.info("plan only: the plan's files go to %s (removed at the end)", staging)
    try:
        parts = _slot_parts(engine, staging, job.root, channels)
        wanted = [
            ShardsToOrder(deal=c.first, shards=tuple(range(n)), slot_parts=parts[c.name]) for c in channels
        ]
        done = _order(engine, staging, "plan", wanted, segment_rows=segment_rows)
    finally:
        storage.remove(staging, recursive=True)
    plans = []
    for c in channels:
        orders = done.of(c.name)
        plans.append(channel_plan(c.first, {s: o.classes for s, o in orders.items()}, named=orders[0].named))
    summary = PlanSummary(dataset=storage.normalize(cfg.dataset), channels=tuple(plans))
    log.info("%s", summary.text())
    return summary


def hold(cfg: ShardConfig) -> AbstractContextManager[None]:
    """The dataset's lock for this run (:mod:`lakeshard.locks`): exclusive for a build, shared
    for ``--plan-only``, which only reads the manifest."""
    if cfg.plan_only:
        return dataset_lock(cfg.dataset, job="shard --plan-only", exclusive=False)
    return dataset_lock(cfg.dataset, job="shard")


@contextmanager
def prepare(cfg: ShardConfig) -> Iterator[None]:
    """Before the engine starts: take the dataset's lock, then check the inputs (a manifest job
    still writing the manifest is named as such, not as a missing manifest); hold the lock to
    the end."""
    with hold(cfg):
        check_shard_inputs(cfg)
        yield


def run(cfg: ShardConfig, engine: Engine) -> DatasetInfo | PlanSummary:
    """Run the job, holding the dataset's lock; return what it wrote to ``dataset.json`` (with
    ``plan_only``, the plan's summary: :func:`plan_only`). Another job writing the dataset makes
    it fail at once (:class:`~lakeshard.locks.DatasetBusyError`)."""
    with hold(cfg):
        return plan_only(cfg, engine) if cfg.plan_only else _build(cfg, engine)


def _build(cfg: ShardConfig, engine: Engine) -> DatasetInfo:
    """Build and commit the shards (the lock held): plan, preprocess, repair, assemble, write
    the rejects table, commit; then the report."""
    job = check_shard_inputs(cfg)
    # The old dataset stays readable until the commit: a run that fails (a denied object, an
    # outage) or is killed before it leaves it as it was.
    storage.remove_temporaries(job.root)  # a killed run's half-written files (kept staging included)
    channels = _channels(cfg, job)
    build = _start(cfg, engine, job, rows=sum(c.first.total for c in channels))
    plan = _plan(build, channels)
    pre = _preprocess(build, plan)
    repaired = _repair(build, plan, pre)
    assembled = _assemble(build, repaired, pre)
    _write_rejects_table(build, pre)
    info = _commit(build, repaired, pre, assembled)
    _write_report(job.root, info)
    return info


def parser() -> argparse.ArgumentParser:
    return job_parser(
        "jobs/shard.py",
        ShardConfig,
        description="Preprocess the images of a manifest (decode, EXIF orientation, RGB, resize, encode) and write, "
        "for each channel, exactly --num-shards Parquet shards of equal size, one per target GPU.",
        epilog="--overwrite replaces every channel of the existing dataset: with --channels naming fewer channels "
        "than it has, the job refuses (naming the channels it would delete) rather than delete them.",
    )


def _summary(cfg: ShardConfig, info: DatasetInfo | PlanSummary) -> str:
    if isinstance(info, PlanSummary):
        return info.text()
    rows = ", ".join(f"{c}={e.rows_per_shard}×{info.num_shards}" for c, e in info.channels.items())
    return (
        f"shards: {rows} rows, {info.counts.shard_rejects} rejected, "
        f"version {info.dataset_version} -> {storage.normalize(cfg.dataset)}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_job(
        argv,
        parser=parser(),
        config=ShardConfig,
        run=run,
        summary=_summary,
        prog="jobs/shard.py",
        prepare=prepare,
    )


if __name__ == "__main__":
    sys.exit(main())
