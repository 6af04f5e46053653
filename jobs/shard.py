"""Shard job: turn the manifests into equal per-GPU Parquet shards of preprocessed images.

    spark-submit jobs/shard.py --dataset s3://lake/datasets/pets-v1 --num-shards 4 --image-size 224
    python -m jobs.shard --engine dask --dataset ./datasets/pets-v1 --num-shards 2

For each channel, writes exactly ``--num-shards`` files ``shards/channel=<c>/part-0000i-of-0000N.parquet``
(on S3 in a version folder, ``shards/v=<version>/channel=<c>/...``: no copy, see :mod:`jobs.commit`)
with equal row counts and every class spread evenly (at most one apart), rows shuffled within
each shard; images that fail (or were replaced since the manifest was built) go to the shard rejects table;
``dataset.json`` comes last, then ``report.html`` (a report that fails is a warning, not a failed job).

Check the inputs (:mod:`jobs.inputs`, before the engine starts) -> extract (manifest rows) -> plan on the driver (:mod:`jobs.plan`) -> preprocess on the workers
(:mod:`jobs.preprocess`: fetch, decode, orient, RGB, resize, encode), each task writing its shard's rows straight into
the shard's file in a staging folder -> repair: if images were rejected, re-plan without them
(the plan moves as few rows as it can) and assemble the shards that changed from rows already
preprocessed (:mod:`jobs.repair`, :mod:`jobs.assemble`) -> commit (:mod:`jobs.commit`): move the staging folder into place
(locally; on S3 it is the version folder), then write ``dataset.json``. A
reader sees the old dataset, no dataset, or the new one, never a part. No image is sent through
the engine: a task reads it from the lake and writes it to its shard.

Resume: the staging folder is named after everything its files depend on, and each
preprocessing task writes a receipt once its file is complete; a rerun of a killed job reuses
every segment with a valid receipt (``--no-resume`` starts over; :mod:`jobs.staging`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

import pyarrow as pa
import pyarrow.compute as pc

from jobs.assemble import assemble_shard
from jobs.commit import commit, place_assembled
from jobs.dataset_info import dataset_info, dataset_version
from jobs.engines import Engine
from jobs.engines.cli import job_parser, run_job
from jobs.inputs import channel_rows, check_shard_inputs, read_manifest
from jobs.plan import ShardPlan, make_plan
from jobs.preprocess import OUTCOME_SCHEMA, SegmentTask, preprocess_segment
from jobs.repair import assemble_tasks, check_reject_budget, rejected_rows, replan
from jobs.report import write_report
from jobs.segments import segment_tasks
from jobs.settings import ShardConfig
from jobs.staging import finished, rejects_path, staging_folder
from jobs.tasks import each, pack
from lakeshard import storage
from lakeshard.format import FORMAT_VERSION, BuildInfo, DatasetInfo

__all__ = ["dataset_version", "main", "parser", "run"]

log = logging.getLogger("jobs.shard")

#: Rows preprocessed by one task at most, when ``--partitions`` is not given: a shard with more
#: rows is cut into segments, preprocessed by several tasks and then assembled.
_ROWS_PER_TASK = 2000


def _preprocess(engine: Engine, tasks: list[SegmentTask], reused: dict[str, dict[str, Any]], *,
                slots: int, channels: list[str], num_shards: int) -> tuple[list[dict[str, Any]], int, int]:
    """Run the tasks an earlier run did not finish; return every segment's result (reused ones
    first), the number of tasks run and of images they preprocessed."""
    todo = [t for t in tasks if t.uri not in reused]
    if reused:
        log.info("resuming: %d of %d segments (%d images) were preprocessed by an interrupted run of this job; "
                 "reusing them (--no-resume starts over)", len(reused), len(tasks),
                 sum(r["outcomes"].num_rows for r in reused.values()))
    bins = pack(todo, [t.rows.num_rows for t in todo], slots)
    log.info("preprocessing %d images (%s) straight into %d shard files: %d segments in %d tasks on %s",
             sum(t.rows.num_rows for t in todo), ", ".join(channels), len(channels) * num_shards, len(todo),
             len(bins), engine.name)
    done = engine.map_partitions(each(preprocess_segment), bins, partitions=len(bins)) if bins else []
    return [*reused.values(), *done], len(todo), sum(d["outcomes"].num_rows for d in done)


def _write_report(root: str, info: DatasetInfo) -> None:
    """The report, after the commit: a report that cannot be written is a warning, never a
    failed job (the dataset is complete without it)."""
    try:
        write_report(root, info)
    except Exception as exc:
        log.warning("the dataset at %s is committed, but its report could not be written: %s: %s "
                    "(python -m jobs.report %s writes it again)", root, type(exc).__name__, exc, root)


def run(cfg: ShardConfig, engine: Engine) -> DatasetInfo:
    """Run the job; return what it wrote to ``dataset.json``."""
    job = check_shard_inputs(cfg)
    root, channels = job.root, job.channels
    # The old dataset stays readable until the commit: a run that fails (a denied object, an
    # outage) or is killed before it leaves it as it was.
    storage.remove_temporaries(root)  # a killed run's half-written files (kept staging included)

    rows = read_manifest(root, channels)
    ordered = {c: channel_rows(rows, c) for c in channels}
    meta = {"dataset_version": job.version, "num_shards": cfg.num_shards, "format_version": FORMAT_VERSION,
            "image_format": cfg.image_format, "image_size": cfg.image_size}

    def plan(channel: str, rejected: Any = None) -> ShardPlan:
        mine = ordered[channel]
        return make_plan(mine["key"].to_pylist(), mine["label_index"].to_pylist(), num_shards=cfg.num_shards,
                         seed=job.seed, channel=channel, remainder=cfg.remainder, rejected=rejected)

    first = {c: plan(c) for c in channels}
    # One task per core, or more when each would get over _ROWS_PER_TASK rows. A task uses its
    # core to the end whatever the others do: fewer, longer tasks leave fewer gaps between tasks.
    wanted = cfg.partitions or max(engine.parallelism, math.ceil(rows.num_rows / _ROWS_PER_TASK))
    segment_rows = math.ceil(rows.num_rows / wanted)
    # Engine tasks in a multiple of the cores, so the last round of tasks keeps every core busy.
    slots = engine.parallelism * math.ceil(wanted / engine.parallelism)
    staging = staging_folder(root, job.version, cfg, segment_rows, resume=cfg.resume)
    tasks = segment_tasks(staging, ordered, first, cfg, meta, segment_rows=segment_rows,
                          decode_threads=cfg.decode_threads or engine.task_cpus)
    reused = finished(staging, tasks)
    done, ran, decoded = _preprocess(engine, tasks, reused, slots=slots, channels=channels, num_shards=cfg.num_shards)
    outcomes = pa.concat_tables([d["outcomes"] for d in done]) if done else OUTCOME_SCHEMA.empty_table()
    written = {d["uri"]: d["stats"] for d in done}

    rejects = rejected_rows(rows, outcomes)
    check_reject_budget(rejects, rows.num_rows, max_fraction=cfg.max_reject_fraction, root=root)
    plans = replan(ordered, first, rejects, plan)
    log.info("plan: %s", ", ".join(f"{c}={plans[c].rows_per_shard}×{cfg.num_shards}" for c in channels))
    repairs, final = assemble_tasks(staging, ordered, plans, tasks, outcomes, cfg, meta)
    if repairs:
        log.info("assembling %d of %d shard files from preprocessed rows (%d images rejected)", len(repairs),
                 len(channels) * cfg.num_shards, rejects.num_rows)
        bins = pack(repairs, [t.sources.num_rows for t in repairs], slots)
        written.update({d["uri"]: d["stats"] for d in engine.map_partitions(each(assemble_shard), bins, partitions=len(bins))})
    paths = place_assembled(root, staging, final, tasks, num_shards=cfg.num_shards)

    stats = [{"channel": c, "shard": s, "path": paths[(c, s)], **written[uri]} for (c, s), uri in final.items()]
    reject_counts = {c: int(pc.sum(pc.equal(rejects["channel"], c)).as_py() or 0) for c in channels}
    info = dataset_info(cfg, marker=job.marker, version=job.version, seed=job.seed, engine=engine.name,
                        plans=plans, ordered=ordered, stats=stats, reject_counts=reject_counts,
                        build=BuildInfo(preprocess_tasks=ran, preprocessed=decoded, reused_segments=len(reused),
                                        assembled_shards=len(repairs)),
                        rejects_path=rejects_path(staging))
    commit(root, staging, stats=stats, plans=plans, rejects=rejects, info=info)
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


def _summary(cfg: ShardConfig, info: DatasetInfo) -> str:
    rows = ", ".join(f"{c}={e.rows_per_shard}×{info.num_shards}" for c, e in info.channels.items())
    return (f"shards: {rows} rows, {info.counts.shard_rejects} rejected, "
            f"version {info.dataset_version} -> {storage.normalize(cfg.dataset)}")


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, parser=parser(), config=ShardConfig, run=run, summary=_summary, prog="jobs/shard.py",
                   check=check_shard_inputs)


if __name__ == "__main__":
    sys.exit(main())
