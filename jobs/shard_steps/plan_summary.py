"""What the shard job's plan would write, per channel, without writing it (``--plan-only``).

Made on the driver from each channel's :class:`~jobs.shard_steps.deal.Deal` and what the plan's order tasks
counted on the workers (rows per class in each shard file they wrote): rows per shard, the rows the
remainder policy drops or pads, and how evenly each class is spread over the shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jobs.shard_steps.deal import Deal
from jobs.shard_steps.plan_tasks import NamedRow
from lakeshard.errors import ShardError
from lakeshard.format.label_columns import SINGLE_LABEL

__all__ = ["ChannelPlan", "PlanSummary", "channel_plan"]


@dataclass(frozen=True, slots=True)
class ChannelPlan:
    """One channel's plan. ``spread`` is the largest difference, over the classes, between a
    class's rows in its fullest and its emptiest shard (the plan keeps it at most 1);
    ``uneven_classes`` counts the classes at that difference 1."""

    channel: str
    rows: int
    classes: int
    num_shards: int
    rows_per_shard: int
    dropped: int
    padded: int
    spread: int
    uneven_classes: int
    named: tuple[tuple[str, str], ...] = ()
    task: str = SINGLE_LABEL  #: beyond single-label the plan balances images, one class of all

    def text(self) -> str:
        kept = self.rows_per_shard * self.num_shards
        named = "".join(f"\n    {kind} {uri}" for kind, uri in self.named)
        if self.task != SINGLE_LABEL:
            return (
                f"  {self.channel}: {self.rows:,} {self.task} rows -> {self.num_shards} shards × "
                f"{self.rows_per_shard:,} rows ({kept:,} rows: {self.dropped} dropped, {self.padded} padded); "
                f"images balanced, labels not (an image holds several){named}"
            )
        return (
            f"  {self.channel}: {self.rows:,} rows in {self.classes} classes -> {self.num_shards} shards × "
            f"{self.rows_per_shard:,} rows ({kept:,} rows: {self.dropped} dropped, {self.padded} padded); "
            f"per class, shards differ by at most {self.spread} row(s) "
            f"({self.uneven_classes} of {self.classes} classes differ by one){named}"
        )


@dataclass(frozen=True, slots=True)
class PlanSummary:
    """The plan of every channel the job would write, and where the dataset would go."""

    dataset: str
    channels: tuple[ChannelPlan, ...]

    def text(self) -> str:
        return "\n".join(
            [f"plan only (nothing written) for {self.dataset}:", *(c.text() for c in self.channels)]
        )


def channel_plan(
    deal: Deal,
    per_shard: Mapping[int, Mapping[int, int]],
    *,
    named: Mapping[int, NamedRow] | None = None,
    show: int = 10,
    task: str = SINGLE_LABEL,
) -> ChannelPlan:
    """The summary of ``deal``'s channel; ``per_shard[s]`` counts shard s's rows per label index
    (pad copies included), as its order task found them. ``named`` gives the key and URI of
    dropped and padded slots; the first ``show`` are listed."""
    missing = [s for s in range(deal.num_shards) if s not in per_shard]
    if missing:
        raise ShardError(f"channel {deal.channel!r}: no counts for shards {missing}")
    named = named or {}
    spread = uneven = 0
    for label in deal.labels:
        rows = [int(per_shard[s].get(label, 0)) for s in range(deal.num_shards)]
        spread = max(spread, max(rows) - min(rows))
        uneven += max(rows) - min(rows) == 1
    shown = [("dropped", named[g].uri) for g in deal.dropped[:show] if g in named]
    shown += [("padded", named[g].uri) for g in deal.padded[: max(0, show - len(shown))] if g in named]
    return ChannelPlan(
        channel=deal.channel,
        rows=deal.total,
        classes=len(deal.labels),
        num_shards=deal.num_shards,
        rows_per_shard=deal.rows_per_shard,
        dropped=len(deal.dropped),
        padded=len(deal.pads),
        spread=spread,
        uneven_classes=uneven,
        named=tuple(shown),
        task=task,
    )
