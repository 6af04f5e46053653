"""Repair after preprocessing, from the reject list alone: the budget of rejects, the plan made
again without them (:func:`jobs.shard_steps.deal.deal_from_counts` with their slots), and the shards that
must be assembled because of it. Plain Python on the driver; it never sees a row that was not
rejected (the assembly tasks find their rows themselves, :func:`jobs.shard_steps.assemble.locate_and_assemble`)."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from jobs.shard_steps.deal import Deal
from jobs.shard_steps.preprocess import SegmentTask
from lakeshard.errors import RejectFractionError

__all__ = ["changed_shards", "check_reject_budget", "final_deals", "moved_from", "outcome_sources"]


def check_reject_budget(rejects: pa.Table, total: int, *, max_fraction: float, root: str) -> None:
    """Raise :class:`RejectFractionError` if more than ``max_fraction`` of ``total`` rows were rejected."""
    if rejects.num_rows > max_fraction * max(1, total):
        sample = "; ".join(f"{u}: {r}" for u, r in zip(rejects["uri"].to_pylist()[:5], rejects["reason"].to_pylist()[:5]))
        raise RejectFractionError(
            f"{rejects.num_rows} of {total} images in {root} could not be used "
            f"(> max_reject_fraction={max_fraction:g}); first: {sample}")


def final_deals(first: dict[str, Deal], rejects: pa.Table, plan: Callable[[str, list[int]], Deal]) -> dict[str, Deal]:
    """The final plan of each channel: its first plan if none of its rows was rejected, else
    ``plan(channel, rejected_slots)``."""
    deals = {}
    for channel, deal in first.items():
        slots = rejects.filter(pc.equal(rejects["channel"], channel))["slot"].to_pylist()
        deals[channel] = plan(channel, slots) if slots else deal
    return deals


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
    return changed - {-1}


def moved_from(first: Deal, final: Deal, shard: int) -> set[int]:
    """The shards of the first plan (-1: its spare rows) that hold rows the final plan puts in
    ``shard``, other than ``shard`` itself: where an assembly of ``shard`` looks for its rows."""
    came = {first.shard_of(g) for g in set(first.moved) | set(final.moved)
            if final.shard_of(g) == shard and first.shard_of(g) != shard}
    came |= {first.shard_of(g) for g, s, _ in final.pads if s == shard}
    return came - {shard}


def outcome_sources(tasks: list[SegmentTask]) -> tuple[tuple[str, str], ...]:
    """(outcomes file, segment file) of each task."""
    return tuple((t.outcomes, t.uri) for t in tasks if t.outcomes is not None)
