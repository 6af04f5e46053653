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
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

import pyarrow as pa
import pyarrow.compute as pc

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.common.tasks import each, pack
from jobs.shard_steps.assemble import RepairTask, locate_and_assemble
from jobs.shard_steps.commit import commit, place_assembled, staged_rejects
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.dataset_info import dataset_info, dataset_version
from jobs.shard_steps.deal import Deal, deal_from_counts
from jobs.shard_steps.inputs import check_shard_inputs
from jobs.shard_steps.plan_summary import PlanSummary, channel_plan
from jobs.shard_steps.plan_tasks import OrderTask, SlotTask, order_rows, slot_rows
from jobs.shard_steps.preprocess import (
    REJECT_SCHEMA,
    RejectsTask,
    SegmentTask,
    preprocess_segment,
    unique_rejects,
    write_rejects,
)
from jobs.shard_steps.repair import (
    changed_shards,
    check_reject_budget,
    final_deals,
    moved_from,
    outcome_sources,
)
from jobs.shard_steps.report_html import write_report
from jobs.shard_steps.reuse import Base, Reuse, StageTask, plan_reuse, reuse_images, stage
from jobs.shard_steps.segments import SPARE, order_uri, segment_cuts, segment_tasks
from jobs.shard_steps.staging import (
    RUNS,
    assembled_shard,
    finished,
    rejects_path,
    staged_shard,
    staging_folder,
    staging_root,
    versioned,
)
from lakeshard import storage
from lakeshard.errors import ShardError
from lakeshard.format import FORMAT_VERSION, BuildInfo, DatasetInfo, channel_dirname
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


#: Rows given their slots by one task at most (a group of classes; a larger class is one task).
_ROWS_PER_SLOT_TASK = 500_000


def _run(engine: Engine, fn: Any, items: list[Any], sizes: list[int], slots: int) -> list[Any]:
    """``fn`` over ``items`` on the engine, packed into at most ``slots`` tasks by ``sizes``."""
    if not items:
        return []
    bins = pack(items, sizes, slots)
    return engine.map_partitions(each(fn), bins, partitions=len(bins))


def _preprocess(engine: Engine, tasks: list[SegmentTask], reused: dict[str, dict[str, Any]], *,
                slots: int, channels: list[str], num_shards: int) -> tuple[list[dict[str, Any]], int, int, int]:
    """Run the tasks an earlier run did not finish; return every segment's result (reused ones
    first), the number of tasks run, of images they decoded and of images they took from the
    ``--base`` dataset."""
    todo = [t for t in tasks if t.uri not in reused]
    if reused:
        log.info("resuming: %d of %d segments (%d images) were preprocessed by an interrupted run of this job; "
                 "reusing them (--no-resume starts over)", len(reused), len(tasks),
                 sum(r["rows"] for r in reused.values()))
    log.info("preprocessing %d images (%s) straight into %d shard files: %d segments in %d tasks on %s",
             sum(t.num_rows for t in todo), ", ".join(channels), len(channels) * num_shards, len(todo),
             len(pack(todo, [t.num_rows for t in todo], slots)) if todo else 0, engine.name)
    done = _run(engine, preprocess_segment, todo, [t.num_rows for t in todo], slots)
    taken = sum(d["reused"] for d in done)
    return [*reused.values(), *done], len(todo), sum(d["rows"] for d in done) - taken, taken


def _with_base(engine: Engine, base: Base, reuse: Reuse, staged: list[dict[str, Any]], tasks: list[SegmentTask],
               finished_: dict[str, dict[str, Any]]) -> list[SegmentTask]:
    """``tasks``, those still to run naming the runs of the images they take from ``base``
    (:mod:`jobs.shard_steps.reuse`, on the workers; ``staged`` by the order pass)."""
    todo = [t for t in tasks if t.uri not in finished_]
    log.info("--base %s (version %s): looking up the %d rows to preprocess among its %d shard files", base.root,
             base.info.dataset_version, sum(t.num_rows for t in todo), len(base.shards))
    found, matched = reuse_images(partial(_run, engine), base, reuse, staged, todo,
                                  skip=tuple(t.reuse_id for t in tasks if t.uri in finished_),
                                  cores=engine.parallelism)
    log.info("--base %s holds the images of %d of them, taken from its shards; the other %d are fetched and decoded",
             base.root, matched, sum(t.num_rows for t in todo) - matched)
    swap = {t.uri: t for t in found}
    return [swap.get(t.uri, t) for t in tasks]


def _classes(marker: dict[str, Any], channel: str) -> list[tuple[str, int, int]]:
    """(label, label index, rows) of each class of ``channel`` with rows, from the manifest's
    marker (``counts.classes``): the aggregates the plan is made from."""
    counts = marker["counts"]["classes"][channel]
    return sorted(((name, int(marker["labels"][name]), int(n)) for name, n in counts.items() if n),
                  key=lambda c: c[1])


def _slot_parts(engine: Engine, staging: str, root: str, deals: dict[str, Deal],
                classes: dict[str, list[tuple[str, int, int]]]) -> dict[str, tuple[str, ...]]:
    """Give every row its slot on the workers, a task per group of classes; the slot parts of each channel."""
    tasks = []
    total = sum(d.total for d in deals.values())
    for channel, deal in deals.items():
        mine = classes[channel]
        # The engine's cores shared by the channels, by rows, and no task over _ROWS_PER_SLOT_TASK rows
        # (but a class whole): an engine task costs tenths of a second to schedule on Spark.
        wanted = max(1, round(engine.parallelism * deal.total / total), math.ceil(deal.total / _ROWS_PER_SLOT_TASK))
        groups = pack(mine, [n for _, _, n in mine], wanted)
        for i, group in enumerate(sorted(groups, key=lambda g: min(c[1] for c in g))):
            tasks.append(SlotTask(root=root, channel=channel, seed=deal.seed, num_shards=deal.num_shards,
                                  classes=tuple((name, i_, deal.class_start(i_), n) for name, i_, n in sorted(group, key=lambda c: c[1])),
                                  uri=storage.join(staging, RUNS, "slots", channel_dirname(channel), f"part-{i:05d}.parquet")))
    # At most a task per core: every channel has a slot task of its own (three channels on two
    # cores are four), and these tasks are short; the engine's tasks each run several in turn.
    done = _run(engine, slot_rows, tasks, [sum(c[3] for c in t.classes) for t in tasks], engine.parallelism)
    if sum(d["rows"] for d in done) != sum(d.total for d in deals.values()):
        raise ShardError(f"the slot tasks gave {sum(d['rows'] for d in done)} rows their slots, "
                         f"the plan counts {sum(d.total for d in deals.values())}")  # slot_rows checks each class
    return {c: tuple(t.uri for t in tasks if t.channel == c) for c in deals}


def _plan_step(item: OrderTask | StageTask) -> dict[str, Any]:
    """An item of the order pass: an order task, or (``--base``) one staging the base's side of the join."""
    return order_rows(item) if isinstance(item, OrderTask) else stage(item)


def _order(engine: Engine, staging: str, name: str, deals: dict[str, Deal], shards: dict[str, list[int]],
           parts: dict[str, tuple[str, ...]], *, segment_rows: int,
           reuse: tuple[Reuse, list[StageTask], list[int]] | None = None
           ) -> tuple[dict[tuple[str, int], dict[str, Any]], list[dict[str, Any]]]:
    """Write the order file of each of ``shards`` of each channel of plan ``name`` on the workers,
    in as many engine tasks as it has cores; number the segments. With ``reuse`` (a
    :func:`jobs.shard_steps.reuse.plan_reuse`), stage both sides of the join with the base in the same
    engine action. Returns the order tasks' results by (channel, shard), and what was staged."""
    tasks: list[OrderTask] = []
    for channel, deal in deals.items():
        for k, shard in enumerate(shards[channel]):
            rows = len(deal.dropped) if shard == SPARE else deal.rows_per_shard
            cuts = (0, rows) if shard == SPARE else segment_cuts(rows, segment_rows)
            first = tasks[-1].segments[-1] + 1 if tasks else 0
            tasks.append(OrderTask(deal=deal, shard=shard, parts=parts[channel], cuts=cuts, report=k == 0,
                                   uri=order_uri(staging, name, channel, shard), reuse=reuse[0] if reuse else None,
                                   segments=tuple(range(first, first + len(cuts) - 1))))
    extra, sizes = (reuse[1], reuse[2]) if reuse else ([], [])
    done = _run(engine, _plan_step, [*tasks, *extra], [*(t.cuts[-1] for t in tasks), *sizes], engine.parallelism)
    orders = {(d["channel"], d["shard"]): d for d in done if "side" not in d}  # a stage task's result has a side
    staged = [d for d in done if "side" in d] + [d["staged"] for d in orders.values() if "staged" in d]
    return orders, staged


def _named(deal: Deal, known: dict[int, tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The URIs of the deal's dropped and padded rows (a padded row once per copy), by key."""
    def uris(slots: tuple[int, ...]) -> list[str]:
        return [known[g][1] for g in sorted(slots, key=lambda g: known[g])]
    return uris(deal.dropped), uris(deal.padded)


def _write_report(root: str, info: DatasetInfo) -> None:
    """The report, after the commit: a report that cannot be written is a warning, never a
    failed job (the dataset is complete without it)."""
    try:
        write_report(root, info)
    except Exception as exc:
        log.warning("the dataset at %s is committed, but its report could not be written: %s: %s "
                    "(python -m jobs.report %s writes it again)", root, type(exc).__name__, exc, root)


def _deal(cfg: ShardConfig, classes: list[tuple[str, int, int]], *, seed: int, channel: str,
          rejected: list[int] | None = None) -> Deal:
    """The plan of ``channel`` from its ``classes`` (:func:`_classes`), without the rows at slots ``rejected``."""
    return deal_from_counts({i: rows for _, i, rows in classes}, num_shards=cfg.num_shards, seed=seed,
                            channel=channel, remainder=cfg.remainder, rejected=rejected or ())


def _segment_rows(cfg: ShardConfig, total: int, engine: Engine) -> tuple[int, int]:
    """(rows per preprocessing segment, engine tasks that preprocess) for ``total`` rows."""
    # One task per core, or more when each would get over _ROWS_PER_TASK rows, up to _MAX_TASKS.
    # A task uses its core to the end whatever the others do: fewer, longer tasks leave fewer
    # gaps between tasks.
    wanted = cfg.partitions or default_tasks(total, engine.parallelism)
    # Engine tasks in a multiple of the cores, so the last round of tasks keeps every core busy.
    return math.ceil(total / wanted), engine.parallelism * math.ceil(wanted / engine.parallelism)


def plan_only(cfg: ShardConfig, engine: Engine) -> PlanSummary:
    """The job's dry run (``--plan-only``): its checks, then its plan from the manifest (every
    row's slot, every shard's order, on the workers as in :func:`run`) into a folder of its own
    under the dataset's ``_staging/``, removed at the end whatever happens; returns the plan's
    summary. Reads no image and leaves the dataset (and any staging of a real run) as it was."""
    job = check_shard_inputs(cfg)
    root, n = job.root, cfg.num_shards
    classes = {c: _classes(job.marker, c) for c in job.channels}
    deals = {c: _deal(cfg, classes[c], seed=job.seed, channel=c) for c in job.channels}
    segment_rows, _ = _segment_rows(cfg, sum(d.total for d in deals.values()), engine)
    staging = storage.join(staging_root(root), f"plan-only-{uuid.uuid4().hex[:12]}")
    log.info("plan only: the plan's files go to %s (removed at the end)", staging)
    try:
        parts = _slot_parts(engine, staging, root, deals, classes)
        orders, _ = _order(engine, staging, "plan", deals, {c: list(range(n)) for c in deals}, parts,
                           segment_rows=segment_rows)
    finally:
        storage.remove(staging, recursive=True)
    summary = PlanSummary(dataset=storage.normalize(cfg.dataset), channels=tuple(
        channel_plan(d, {s: orders[(c, s)]["classes"] for s in range(n)}, named=orders[(c, 0)].get("named"))
        for c, d in deals.items()))
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
    """Build and commit the shards (the lock held)."""
    job = check_shard_inputs(cfg)
    root, channels, n = job.root, job.channels, cfg.num_shards
    # The old dataset stays readable until the commit: a run that fails (a denied object, an
    # outage) or is killed before it leaves it as it was.
    storage.remove_temporaries(root)  # a killed run's half-written files (kept staging included)

    # The plan from the manifest's counts; the rows stay on the workers (jobs.shard_steps.deal, jobs.shard_steps.plan_tasks).
    classes = {c: _classes(job.marker, c) for c in channels}

    def deal(channel: str, rejected: list[int] | None = None) -> Deal:
        return _deal(cfg, classes[channel], seed=job.seed, channel=channel, rejected=rejected)

    first = {c: deal(c) for c in channels}
    total = sum(d.total for d in first.values())
    meta = {"dataset_version": job.version, "num_shards": n, "format_version": FORMAT_VERSION,
            "image_format": cfg.image_format, "image_size": cfg.image_size}
    segment_rows, slots = _segment_rows(cfg, total, engine)
    staging = staging_folder(root, job.version, cfg, segment_rows, resume=cfg.resume)

    parts = _slot_parts(engine, staging, root, first, classes)
    shards = {c: [*range(n), *([SPARE] if d.dropped else [])] for c, d in first.items()}
    reuse = plan_reuse(job.base, total, folder=storage.join(staging, RUNS, "reuse"), slots=slots) \
        if job.base is not None else None
    orders, staged = _order(engine, staging, "first", first, shards, parts, segment_rows=segment_rows, reuse=reuse)
    known = {c: dict(orders[(c, 0)].get("named", {})) for c in channels}
    tasks = segment_tasks(staging, first, orders, cfg, meta, segment_rows=segment_rows,
                          decode_threads=cfg.decode_threads or engine.task_cpus)
    reused = finished(staging, tasks)
    if job.base is not None and reuse is not None:
        tasks = _with_base(engine, job.base, reuse[0], staged, tasks, reused)
    done, ran, decoded, taken = _preprocess(engine, tasks, reused, slots=slots, channels=channels, num_shards=n)
    written = {d["uri"]: d["stats"] for d in done}

    failed = pa.concat_tables([d["rejects"] for d in done]) if done else REJECT_SCHEMA.empty_table()
    rejects = unique_rejects(failed)
    check_reject_budget(rejects, total, max_fraction=cfg.max_reject_fraction, root=root)
    plans = final_deals(first, rejects, deal)
    log.info("plan: %s", ", ".join(f"{c}={plans[c].rows_per_shard}×{n}" for c in channels))

    # Repair: the shards the rejects changed, and those preprocessed in segments, are assembled.
    by_shard: dict[tuple[str, int], list[SegmentTask]] = {}
    for t in tasks:
        by_shard.setdefault((t.metadata["channel"], t.metadata["shard_index"]), []).append(t)
    need: dict[str, list[int]] = {}
    for c in channels:
        mine = failed.filter(pc.equal(failed["channel"], c))
        whole = set(mine.filter(pc.invert(mine["is_pad"]))["slot"].to_pylist())
        changed = changed_shards(first[c], plans[c], written=set(mine["slot"].to_pylist()) - whole) \
            if plans[c] is not first[c] else set()
        need[c] = sorted(changed | {s for s in range(n) if len(by_shard[(c, s)]) > 1})
    redone = {c for c in channels if plans[c] is not first[c] and need[c]}
    final_orders = _order(engine, staging, "final", {c: plans[c] for c in redone}, need, parts,
                          segment_rows=segment_rows)[0] if redone else {}
    for c in redone:
        known[c].update(final_orders[(c, need[c][0])].get("named", {}))
    repairs: list[RepairTask] = []
    final = {(c, s): staged_shard(staging, c, s, n) for c in channels for s in range(n)}
    for c in channels:
        for s in need[c]:
            sources = moved_from(first[c], plans[c], s) if c in redone else set()
            beside = assembled_shard(staging, c, s, n)
            repairs.append(RepairTask(
                uri=beside, order=(final_orders if c in redone else orders)[(c, s)]["uri"],
                own=outcome_sources(by_shard[(c, s)]),
                others=outcome_sources([t for k in sorted(sources) for t in by_shard.get((c, k), [])]),
                metadata={**meta, "channel": c, "shard_index": s}, row_group_bytes=cfg.row_group_size))
            final[(c, s)] = beside
    if repairs:
        log.info("assembling %d of %d shard files from preprocessed rows (%d images rejected)", len(repairs),
                 len(channels) * n, rejects.num_rows)
        sizes = [plans[r.metadata["channel"]].rows_per_shard for r in repairs]
        written.update({d["uri"]: d["stats"] for d in _run(engine, locate_and_assemble, repairs, sizes, slots)})
    # The rejects table, from the receipts of the segments that had rejects (before
    # place_assembled, which removes the receipts of the files assembled shards replace).
    results = {d["uri"]: d for d in done}
    with_rejects = tuple(t.receipt for t in tasks if t.receipt is not None and results[t.uri]["rejects"].num_rows)
    # On S3 straight into the version folder (no copy at the commit); locally into the staging
    # folder, moved into place by the commit.
    table = RejectsTask(root=root, relpath=rejects_path(staging), receipts=with_rejects) if versioned(staging) \
        else RejectsTask(root=staged_rejects(staging), receipts=with_rejects)
    if with_rejects:
        _run(engine, write_rejects, [table], [1], 1)
    else:  # an empty table: no row to read, and on Spark an engine action costs tenths of a second
        write_rejects(table)
    paths = place_assembled(root, staging, final, tasks, num_shards=n)

    stats = [{"channel": c, "shard": s, "path": paths[(c, s)], **written[uri]} for (c, s), uri in final.items()]
    reject_counts = {c: int(pc.sum(pc.equal(rejects["channel"], c)).as_py() or 0) for c in channels}
    info = dataset_info(cfg, marker=job.marker, version=job.version, seed=job.seed, engine=engine.name,
                        deals=plans, named={c: _named(plans[c], known[c]) for c in channels}, stats=stats,
                        reject_counts=reject_counts,
                        build=BuildInfo(preprocess_tasks=ran, preprocessed=decoded, reused_segments=len(reused),
                                        assembled_shards=len(repairs), reused=taken,
                                        base=job.base.ref() if job.base is not None else None),
                        rejects_path=rejects_path(staging))
    commit(root, staging, stats=stats, plans=plans, info=info)
    log.info("dataset %s committed at %s", job.version, root)
    _write_report(root, info)
    return info


def parser() -> argparse.ArgumentParser:
    return job_parser(
        "jobs/shard.py", ShardConfig,
        description="Preprocess the images of a manifest (decode, EXIF orientation, RGB, resize, encode) and write, "
                    "for each channel, exactly --num-shards Parquet shards of equal size, one per target GPU.",
        epilog="--overwrite replaces every channel of the existing dataset: with --channels naming fewer channels "
               "than it has, the job refuses (naming the channels it would delete) rather than delete them.")


def _summary(cfg: ShardConfig, info: DatasetInfo | PlanSummary) -> str:
    if isinstance(info, PlanSummary):
        return info.text()
    rows = ", ".join(f"{c}={e.rows_per_shard}×{info.num_shards}" for c, e in info.channels.items())
    return (f"shards: {rows} rows, {info.counts.shard_rejects} rejected, "
            f"version {info.dataset_version} -> {storage.normalize(cfg.dataset)}")


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, parser=parser(), config=ShardConfig, run=run, summary=_summary, prog="jobs/shard.py",
                   prepare=prepare)


if __name__ == "__main__":
    sys.exit(main())
