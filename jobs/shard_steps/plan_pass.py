"""The shard plan's passes, run from the driver: each channel's first plan from the manifest's
class counts (:mod:`jobs.shard_steps.deal`), then every row's slot and every shard's order file on
the workers (:mod:`jobs.shard_steps.plan_tasks`); with ``--base``, both sides of the join with the
base staged in the order pass's engine action (:mod:`jobs.shard_steps.reuse`)."""

from __future__ import annotations

from dataclasses import dataclass

from jobs.common.engines import Engine
from jobs.shard_steps.build_state import Build, run_tasks
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.deal import DROPPED_ROWS_SHARD, Deal, deal_from_counts
from jobs.shard_steps.inputs import ShardInputs
from jobs.shard_steps.plan_tasks import (
    IMAGES,
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
from jobs.shard_steps.reuse import ReusePlan, plan_reuse
from jobs.shard_steps.reuse_tasks import StagedFile, StageTask, stage
from jobs.shard_steps.staging import work_uri
from lakeshard.errors import ShardError
from lakeshard.format import ManifestInfo
from lakeshard.format.label_columns import SINGLE_LABEL

__all__ = ["Plan", "channel_deal", "first_plan", "give_slots", "order_pass", "plan_channels"]


@dataclass(frozen=True, slots=True)
class Plan:
    """The first plan of every channel, and (``--base``) where the join with the base is staged
    and what the order pass staged for it."""

    channels: tuple[PlannedChannel, ...]
    reuse: ReusePlan | None
    staged: tuple[StagedFile, ...]


def _classes(marker: ManifestInfo, channel: str) -> tuple[ClassRows, ...]:
    """Each class of ``channel`` with rows, from the manifest's marker (``counts.classes``), by
    label index: the aggregates the plan is made from. A multi-label or boxes channel is one
    class, :data:`~jobs.shard_steps.plan_tasks.IMAGES` (``counts.channels``): the plan balances
    images."""
    if marker.task_kind != SINGLE_LABEL:
        images = marker.counts.channels.get(channel, 0)
        return (ClassRows(IMAGES, 0, images),) if images else ()
    counts = marker.counts.classes[channel]
    classes = (ClassRows(name, int(marker.labels[name]), int(n)) for name, n in counts.items() if n)
    return tuple(sorted(classes, key=lambda c: c.index))


def channel_deal(
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


def plan_channels(cfg: ShardConfig, job: ShardInputs) -> list[Channel]:
    """The channels to shard, each with its first plan, from the manifest's counts (the rows
    stay on the workers: :mod:`jobs.shard_steps.deal`, :mod:`jobs.shard_steps.plan_tasks`)."""
    channels = []
    for name in job.channels:
        classes = _classes(job.marker, name)
        first = channel_deal(cfg, classes, seed=job.seed, channel=name)
        channels.append(Channel(name=name, classes=classes, first=first, carried=job.columns.carried))
    return channels


def give_slots(
    engine: Engine, staging: str, root: str, channels: list[Channel]
) -> dict[str, tuple[str, ...]]:
    """Give every row its slot on the workers, a task per group of classes; the slot parts of
    each channel."""
    tasks = slot_tasks(channels, root=root, staging=staging, cores=engine.parallelism)
    # At most a task per core: every channel has a slot task of its own (three channels on two
    # cores are four), and these tasks are short; the engine's tasks each run several in turn.
    done: list[SlotPart] = run_tasks(engine, slot_rows, tasks, [t.rows for t in tasks], engine.parallelism)
    total = sum(c.first.total for c in channels)
    if sum(p.rows for p in done) != total:
        raise ShardError(
            f"the slot tasks gave {sum(p.rows for p in done)} rows their slots, the plan counts {total}"
        )  # slot_rows checks each class
    return {c.name: tuple(t.uri for t in tasks if t.deal.channel == c.name) for c in channels}


def _plan_step(item: OrderTask | StageTask) -> ShardOrder | StagedFile:
    """An item of the order pass: an order task, or (``--base``) one staging the base's side of the join."""
    return order_rows(item) if isinstance(item, OrderTask) else stage(item)


def order_pass(
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
    done = run_tasks(
        engine, _plan_step, [*tasks, *stage_tasks], [*(t.cuts[-1] for t in tasks), *sizes], engine.parallelism
    )
    orders = tuple(d for d in done if isinstance(d, ShardOrder))
    staged = [d for d in done if isinstance(d, StagedFile)]
    staged += [o.staged for o in orders if o.staged is not None]
    return OrderPass(orders=orders, staged=tuple(staged))


def first_plan(build: Build, channels: list[Channel]) -> Plan:
    """The first plan on the workers: every row's slot, then the order file of every shard and
    of the dropped rows (preprocessed too, in case rejects change the plan); with ``--base``,
    both sides of the join with the base staged in the order pass's engine action."""
    job, n = build.job, build.cfg.num_shards
    parts = give_slots(build.engine, build.staging, job.root, channels)
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
    done = order_pass(
        build.engine, build.staging, "first", wanted, segment_rows=build.segment_rows, reuse=reuse
    )
    return Plan(
        channels=tuple(
            PlannedChannel(channel=c, slot_parts=parts[c.name], orders=done.of(c.name)) for c in channels
        ),
        reuse=reuse,
        staged=done.staged,
    )
