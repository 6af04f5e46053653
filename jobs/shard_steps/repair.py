"""Repair after preprocessing, from the reject list alone: the budget of rejects, and, once the
plan is made again without them (:func:`jobs.shard_steps.deal.deal_from_counts` with their
slots), the shards that must be assembled because of it. Plain Python on the driver; it never
sees a row that was not rejected (the assembly tasks find their rows themselves,
:func:`jobs.shard_steps.assemble.locate_and_assemble`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jobs.shard_steps.assemble import RepairTask, SegmentFiles
from jobs.shard_steps.deal import DROPPED_ROWS_SHARD, Deal
from jobs.shard_steps.plan_tasks import NamedRow, OrderPass, PlannedChannel, ShardOrder
from jobs.shard_steps.preprocess import SegmentTask
from jobs.shard_steps.staging import assembled_shard, staged_shard
from lakeshard.errors import RejectFractionError
from lakeshard.format import SHARD_SCHEMA

__all__ = [
    "RepairedChannel",
    "changed_shards",
    "check_reject_budget",
    "moved_from",
    "outcome_sources",
    "repair_tasks",
    "repaired_channel",
    "segments_by_shard",
    "shards_to_assemble",
]


def check_reject_budget(rejects: pa.Table, total: int, *, max_fraction: float, root: str) -> None:
    """Raise :class:`RejectFractionError` if more than ``max_fraction`` of ``total`` rows were rejected."""
    if rejects.num_rows > max_fraction * max(1, total):
        sample = "; ".join(
            f"{u}: {r}" for u, r in zip(rejects["uri"].to_pylist()[:5], rejects["reason"].to_pylist()[:5])
        )
        raise RejectFractionError(
            f"{rejects.num_rows} of {total} images in {root} could not be used "
            f"(> max_reject_fraction={max_fraction:g}); first: {sample}"
        )


def changed_shards(first: Deal, final: Deal, *, written: set[int]) -> set[int]:
    """The shards whose rows (or their order) differ between the files written for the first
    plan and the final plan. A shard's order depends only on the rows in it, so only shards that
    gain or lose a row or a pad copy change. ``written``: the rejected slots whose row was
    written all the same (only a pad copy of it failed)."""
    changed = {first.shard_of(g) for g in written}
    for slot in set(first.moved) | set(final.moved):
        was, now = first.shard_of(slot), final.shard_of(slot)
        if was != now and slot not in final.rejected:
            changed |= {was, now}
    changed |= {s for g, s, _ in first.pads if g in final.rejected}  # a copy that may have been written
    changed |= {s for _, s, _ in set(first.pads) ^ set(final.pads)}
    return changed - {DROPPED_ROWS_SHARD}


def moved_from(first: Deal, final: Deal, shard: int) -> set[int]:
    """The shards of the first plan (:data:`~jobs.shard_steps.deal.DROPPED_ROWS_SHARD`: its
    dropped rows) that hold rows the final plan puts in ``shard``, other than ``shard`` itself:
    where an assembly of ``shard`` looks for its rows."""
    came = {
        first.shard_of(g)
        for g in set(first.moved) | set(final.moved)
        if final.shard_of(g) == shard and first.shard_of(g) != shard
    }
    came |= {first.shard_of(g) for g, s, _ in final.pads if s == shard}
    return came - {shard}


def outcome_sources(tasks: list[SegmentTask]) -> tuple[SegmentFiles, ...]:
    """The segment file and outcomes file of each task."""
    return tuple(SegmentFiles(outcomes=t.outcomes, segment=t.uri) for t in tasks if t.outcomes is not None)


def segments_by_shard(tasks: list[SegmentTask], channel: str) -> dict[int, list[SegmentTask]]:
    """The preprocessing tasks of ``channel``, by shard (its dropped rows' included)."""
    by_shard: dict[int, list[SegmentTask]] = {}
    for t in tasks:
        if t.metadata["channel"] == channel:
            by_shard.setdefault(t.metadata["shard_index"], []).append(t)
    return by_shard


def shards_to_assemble(
    planned: PlannedChannel, final: Deal, failed: pa.Table, tasks: list[SegmentTask], *, num_shards: int
) -> tuple[int, ...]:
    """The shards of a channel assembled from preprocessed rows: those its rejects changed
    (``failed``: every segment's rejects, a row's pad copies' included), and those preprocessed
    in segments (``tasks``: every segment's task)."""
    first = planned.channel.first
    mine = failed.filter(pc.equal(failed["channel"], first.channel))
    whole = set(mine.filter(pc.invert(mine["is_pad"]))["slot"].to_pylist())
    changed = (
        changed_shards(first, final, written=set(mine["slot"].to_pylist()) - whole)
        if final is not first
        else set()
    )
    segments = segments_by_shard(tasks, first.channel)
    return tuple(sorted(changed | {s for s in range(num_shards) if len(segments[s]) > 1}))


@dataclass(frozen=True, slots=True)
class RepairedChannel:
    """A channel after preprocessing: its final plan (its first, unless rows were rejected), the
    order file of each shard assembled from preprocessed rows, the file each shard is committed
    from (staged, or assembled beside it), the rows its plans drop and pad (by slot) and how many
    of its rows were rejected."""

    planned: PlannedChannel
    final: Deal
    assemble: dict[int, ShardOrder]
    files: dict[int, str]
    named: dict[int, NamedRow]
    rejected: int

    @property
    def name(self) -> str:
        return self.planned.channel.name

    @property
    def replanned(self) -> bool:
        """Whether rejects changed the plan."""
        return self.final is not self.planned.channel.first

    def uris(self, slots: tuple[int, ...]) -> tuple[str, ...]:
        """The URIs of the rows at ``slots`` (a padded row once per copy), by key."""
        return tuple(self.named[g].uri for g in sorted(slots, key=lambda g: self.named[g]))


def repaired_channel(
    planned: PlannedChannel,
    final: Deal,
    shards: tuple[int, ...],
    redone: OrderPass,
    *,
    staging: str,
    rejected: int,
) -> RepairedChannel:
    """The channel with its ``final`` plan and the ``shards`` to assemble, each following its
    order file in the final plan (``redone``, the pass that wrote them) if rejects changed the
    plan, else in the first."""
    name, n = planned.channel.name, final.num_shards
    named, orders = dict(planned.named), planned.orders
    if final is not planned.channel.first and shards:
        orders = redone.of(name)
        named.update(orders[shards[0]].named or {})
    return RepairedChannel(
        planned=planned,
        final=final,
        assemble={s: orders[s] for s in shards},
        named=named,
        rejected=rejected,
        files={
            s: assembled_shard(staging, name, s, n) if s in shards else staged_shard(staging, name, s, n)
            for s in range(n)
        },
    )


def repair_tasks(
    channel: RepairedChannel,
    tasks: list[SegmentTask],
    *,
    metadata: Mapping[str, Any],
    row_group_bytes: int,
    schema: pa.Schema = SHARD_SCHEMA,
) -> list[RepairTask]:
    """The assembly of each shard of ``channel`` that needs one, from the segments (``tasks``)
    that wrote its rows: its own, and those of the shards rows moved in from. ``metadata``:
    every shard's footer, less its channel and index; ``schema``: the shards'."""
    segments = segments_by_shard(tasks, channel.name)
    repairs = []
    for s, order in channel.assemble.items():
        moved = moved_from(channel.planned.channel.first, channel.final, s) if channel.replanned else set()
        repairs.append(
            RepairTask(
                uri=channel.files[s],
                order=order.uri,
                own=outcome_sources(segments[s]),
                others=outcome_sources([t for k in sorted(moved) for t in segments.get(k, [])]),
                metadata={**metadata, "channel": channel.name, "shard_index": s},
                row_group_bytes=row_group_bytes,
                schema=schema,
            )
        )
    return repairs
