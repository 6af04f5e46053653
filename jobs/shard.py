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
This module wires the passes, each run from the driver by a module of its own
(:mod:`jobs.shard_steps.plan_pass`, ``preprocess_pass``, ``repair_pass``, ``commit_pass``) over one
:class:`~jobs.shard_steps.build_state.Build`.

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

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.shard_steps.build_state import preprocess_tasks, start_build
from jobs.shard_steps.commit_pass import commit_build, write_rejects_table
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.dataset_info import dataset_version
from jobs.shard_steps.inputs import check_shard_inputs
from jobs.shard_steps.plan_pass import first_plan, give_slots, order_pass, plan_channels
from jobs.shard_steps.plan_summary import PlanSummary, channel_plan
from jobs.shard_steps.plan_tasks import ShardsToOrder
from jobs.shard_steps.preprocess_pass import preprocess_segments
from jobs.shard_steps.repair_pass import assemble_shards, repair_plans
from jobs.shard_steps.report_html import write_report
from jobs.shard_steps.staging import plan_only_folder
from lakeshard import storage
from lakeshard.format import DatasetInfo
from lakeshard.locks import dataset_lock

__all__ = ["dataset_version", "hold", "main", "parser", "plan_only", "prepare", "run", "summary"]

log = logging.getLogger("jobs.shard")


# --- The job --------------------------------------------------------------------------------


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


def plan_only(cfg: ShardConfig, engine: Engine) -> PlanSummary:
    """The job's dry run (``--plan-only``): its checks, then its plan from the manifest (every
    row's slot, every shard's order, on the workers as in :func:`run`) into a folder of its own
    under the dataset's ``_staging/`` (:func:`~jobs.shard_steps.staging.plan_only_folder`), removed at
    the end whatever happens; returns the plan's summary. Reads no image and leaves the dataset (and any staging of a real run) as it was."""
    job = check_shard_inputs(cfg)
    channels, n = plan_channels(cfg, job), cfg.num_shards
    rows = sum(c.first.total for c in channels)
    segment_rows = math.ceil(rows / preprocess_tasks(cfg, rows, engine))
    staging = plan_only_folder(job.root)
    log.info("plan only: the plan's files go to %s (removed at the end)", staging)
    try:
        parts = give_slots(engine, staging, job.root, channels)
        wanted = [
            ShardsToOrder(deal=c.first, shards=tuple(range(n)), slot_parts=parts[c.name]) for c in channels
        ]
        done = order_pass(engine, staging, "plan", wanted, segment_rows=segment_rows)
    finally:
        storage.remove(staging, recursive=True)
    plans = []
    for c in channels:
        orders = done.of(c.name)
        classes = {s: o.classes for s, o in orders.items()}
        plans.append(channel_plan(c.first, classes, named=orders[0].named, task=job.columns.task))
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
    channels = plan_channels(cfg, job)
    build = start_build(cfg, engine, job, rows=sum(c.first.total for c in channels))
    plan = first_plan(build, channels)
    pre = preprocess_segments(build, plan)
    repaired = repair_plans(build, plan, pre)
    assembled = assemble_shards(build, repaired, pre)
    write_rejects_table(build, pre)
    info = commit_build(build, repaired, pre, assembled)
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


def summary(cfg: ShardConfig, info: DatasetInfo | PlanSummary) -> str:
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
        summary=summary,
        prog="jobs/shard.py",
        prepare=prepare,
    )


if __name__ == "__main__":
    sys.exit(main())
