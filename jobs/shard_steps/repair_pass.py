"""The repair pass, run from the driver: each channel's plan made again without its rejects
(from the reject list alone), the order files of the shards that changed and their assembly
from rows already preprocessed, on the workers (:mod:`jobs.shard_steps.repair`,
:mod:`jobs.shard_steps.assemble`)."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from jobs.shard_steps.assemble import AssembledShard, locate_and_assemble
from jobs.shard_steps.build_state import Build, run_tasks
from jobs.shard_steps.deal import Deal
from jobs.shard_steps.plan_pass import Plan, channel_deal, order_pass
from jobs.shard_steps.plan_tasks import Channel, OrderPass, ShardsToOrder
from jobs.shard_steps.preprocess import unique_rejects
from jobs.shard_steps.preprocess_pass import Preprocessed
from jobs.shard_steps.repair import (
    RepairedChannel,
    check_reject_budget,
    repair_tasks,
    repaired_channel,
    shards_to_assemble,
)

__all__ = ["assemble_shards", "repair_plans"]

#: The shard job's driver logs as the job (``jobs.shard``), whichever step it runs.
log = logging.getLogger("jobs.shard")


def _final_deal(build: Build, channel: Channel, rejects: pa.Table) -> Deal:
    """The plan of ``channel`` without its ``rejects`` (its first plan if it has none), from the
    reject list alone: the plan moves as few rows as it can."""
    slots = rejects.filter(pc.equal(rejects["channel"], channel.name))["slot"].to_pylist()
    if not slots:
        return channel.first
    return channel_deal(build.cfg, channel.classes, seed=build.job.seed, channel=channel.name, rejected=slots)


def repair_plans(build: Build, plan: Plan, pre: Preprocessed) -> list[RepairedChannel]:
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
        order_pass(build.engine, build.staging, "final", wanted, segment_rows=build.segment_rows)
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


def assemble_shards(build: Build, channels: list[RepairedChannel], pre: Preprocessed) -> list[AssembledShard]:
    """Assemble the shards of ``channels`` that need it from rows already preprocessed, each
    beside its place (:mod:`jobs.shard_steps.assemble`), on the workers."""
    repairs = [
        r
        for c in channels
        for r in repair_tasks(
            c,
            pre.tasks,
            metadata=build.footer(),
            row_group_bytes=build.cfg.row_group_size,
            schema=build.job.columns.schema,
        )
    ]
    if repairs:
        log.info(
            "assembling %d of %d shard files from preprocessed rows (%d images rejected)",
            len(repairs),
            len(channels) * build.cfg.num_shards,
            sum(c.rejected for c in channels),
        )
    sizes = [c.final.rows_per_shard for c in channels for _ in c.assemble]
    return run_tasks(build.engine, locate_and_assemble, repairs, sizes, build.slots)
