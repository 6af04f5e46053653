"""The last passes, run from the driver: the shard rejects table written from the segments'
receipts, then the shards put in place and committed with ``dataset.json``
(:mod:`jobs.shard_steps.commit`)."""

from __future__ import annotations

import logging
from collections import Counter

from jobs.shard_steps.assemble import AssembledShard
from jobs.shard_steps.build_state import Build, run_tasks
from jobs.shard_steps.commit import commit, place_assembled, staged_rejects
from jobs.shard_steps.dataset_info import BuiltChannel, ShardFile, dataset_info
from jobs.shard_steps.preprocess import RejectsTask, write_rejects
from jobs.shard_steps.preprocess_pass import Preprocessed
from jobs.shard_steps.repair import RepairedChannel
from jobs.shard_steps.staging import rejects_path, versioned
from lakeshard.format import BuildInfo, DatasetInfo

__all__ = ["commit_build", "write_rejects_table"]

#: The shard job's driver logs as the job (``jobs.shard``), whichever step it runs.
log = logging.getLogger("jobs.shard")


def write_rejects_table(build: Build, pre: Preprocessed) -> None:
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
        run_tasks(build.engine, write_rejects, [table], [1], 1)
    else:  # an empty table: no row to read, and on Spark an engine action costs tenths of a second
        write_rejects(table)


def commit_build(
    build: Build, channels: list[RepairedChannel], pre: Preprocessed, assembled: list[AssembledShard]
) -> DatasetInfo:
    """Put the assembled shards in place, then commit them with ``dataset.json``
    (:mod:`jobs.shard_steps.commit`)."""
    job, n, staging = build.job, build.cfg.num_shards, build.staging
    files = {(c.name, s): uri for c in channels for s, uri in c.files.items()}
    paths = place_assembled(job.root, staging, files, pre.tasks, num_shards=n)
    written = {r.uri: r.stats for r in pre.results.values()} | {a.uri: a.stats for a in assembled}
    lost = {r.uri: r.dropped_boxes for r in pre.results.values()} | {
        a.uri: a.dropped_boxes for a in assembled
    }
    built = [
        BuiltChannel(
            name=c.name,
            deal=c.final,
            rejected=c.rejected,
            dropped=c.uris(c.final.dropped),
            padded=c.uris(c.final.padded),
            dropped_boxes=sum((Counter(lost[uri]) for uri in c.files.values()), Counter()),
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
