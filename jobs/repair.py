"""Repair after preprocessing: the rows that could not be used (counted, with their reason),
the plan made again without them, and the shards that must be assembled because of it.
Plain Python on the driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jobs.assemble import SOURCE_SCHEMA, AssembleTask
from jobs.plan import ShardPlan
from jobs.preprocess import SegmentTask
from jobs.segments import rows_by_shard
from jobs.settings import ShardConfig
from jobs.staging import assembled_shard, staged_shard
from lakeshard.errors import RejectFractionError, ShardError
from lakeshard.format import SHARD_REJECTS_SCHEMA

__all__ = ["assemble_tasks", "check_reject_budget", "rejected_rows", "replan"]


def rejected_rows(rows: pa.Table, outcomes: pa.Table) -> pa.Table:
    """One row per manifest row that could not be used (:data:`SHARD_REJECTS_SCHEMA`), by key.
    A row preprocessed twice (a pad copy) is one reject."""
    failed = outcomes.filter(pc.is_null(outcomes["row"]))
    reason: dict[str, str] = {}
    for uri, why in zip(failed["uri"].to_pylist(), failed["reason"].to_pylist(), strict=True):
        reason.setdefault(uri, why)
    hit = rows.filter(pc.is_in(rows["uri"], value_set=pa.array(list(reason), pa.string())))
    hit = hit.append_column("reason", pa.array([reason[u] for u in hit["uri"].to_pylist()], pa.string()))
    return hit.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA).sort_by("key")


def check_reject_budget(rejects: pa.Table, total: int, *, max_fraction: float, root: str) -> None:
    """Raise :class:`RejectFractionError` if more than ``max_fraction`` of ``total`` rows were rejected."""
    if rejects.num_rows > max_fraction * max(1, total):
        sample = "; ".join(f"{u}: {r}" for u, r in zip(rejects["uri"].to_pylist()[:5], rejects["reason"].to_pylist()[:5]))
        raise RejectFractionError(
            f"{rejects.num_rows} of {total} images in {root} could not be used "
            f"(> max_reject_fraction={max_fraction:g}); first: {sample}")


def replan(ordered: dict[str, pa.Table], first: dict[str, ShardPlan], rejects: pa.Table,
           plan: Callable[[str, Any], ShardPlan]) -> dict[str, ShardPlan]:
    """The final plan of each channel: its first plan if none of its rows was rejected, else
    ``plan(channel, rejected_mask)``."""
    plans = {}
    for c, rows in ordered.items():
        hit = pc.is_in(rows["uri"], value_set=rejects["uri"]).to_numpy(zero_copy_only=False)
        plans[c] = plan(c, hit) if hit.any() else first[c]
    return plans


def assemble_tasks(staging: str, ordered: dict[str, pa.Table], plans: dict[str, ShardPlan],
                   tasks: list[SegmentTask], outcomes: pa.Table, cfg: ShardConfig,
                   meta: dict[str, Any]) -> tuple[list[AssembleTask], dict[tuple[str, int], str]]:
    """Compare the final plan with what preprocessing wrote. A shard written whole whose rows are
    the plan's, in its order, is done; every other shard is assembled from preprocessed rows
    (its own segments first, then rows the repair moved in from other shards).

    Returns the assemble tasks and, by (channel, shard), the file that holds each shard once they
    are done (an assembled shard is written beside and moved into place afterwards).
    """
    ok = outcomes.filter(pc.is_valid(outcomes["row"]))
    anywhere: dict[str, tuple[str, int]] = {}
    by_file: dict[str, list[tuple[str, int]]] = {}
    for uri, file, row in zip(ok["uri"].to_pylist(), ok["file"].to_pylist(), ok["row"].to_pylist(), strict=True):
        anywhere.setdefault(uri, (file, row))
        by_file.setdefault(file, []).append((uri, row))
    written_rows = {t.uri: t.rows for t in tasks}
    files_of: dict[tuple[str, int], list[str]] = {}
    for t in tasks:
        files_of.setdefault((t.metadata["channel"], t.metadata["shard_index"]), []).append(t.uri)

    repairs: list[AssembleTask] = []
    final: dict[tuple[str, int], str] = {}
    for channel, plan in plans.items():
        for shard, want in enumerate(rows_by_shard(ordered[channel], plan)):
            uri = staged_shard(staging, channel, shard, cfg.num_shards)
            final[(channel, shard)] = uri
            if uri in written_rows:
                have = written_rows[uri]
                have = have.filter(pc.is_in(have["uri"], value_set=ok["uri"]))
                if have.select(["uri", "is_pad"]).equals(want.select(["uri", "is_pad"])):
                    continue
            own = {u: (f, r) for f in files_of[(channel, shard)] for u, r in by_file.get(f, [])}
            where = [own.get(u) or anywhere[u] for u in want["uri"].to_pylist()]
            sources = pa.table({"file": [f for f, _ in where], "row": [r for _, r in where],
                                "is_pad": want["is_pad"]}, schema=SOURCE_SCHEMA)
            # Assembled beside, moved into place when every assembly is done: this shard's file
            # may be another assembly's source.
            beside = assembled_shard(staging, channel, shard, cfg.num_shards)
            repairs.append(AssembleTask(uri=beside, sources=sources, row_group_bytes=cfg.row_group_size,
                                        metadata={**meta, "channel": channel, "shard_index": shard}))
            final[(channel, shard)] = beside
    read = {f for t in repairs for f in t.sources["file"].unique().to_pylist()}
    if overwritten := read & {t.uri for t in repairs}:  # assemblies run at the same time
        raise ShardError(f"an assembly would overwrite a file other assemblies read: {sorted(overwritten)[:3]}")
    return repairs, final
