"""The shard plan's worker steps: the rows stay on the workers, the driver holds a
:class:`~jobs.shard_steps.deal.Deal` (counts and a few exceptions).

1. :func:`slot_rows`, one task per group of classes of a channel: reads those classes' manifest
   rows (:func:`lakeshard.format.manifest_table.read_channel_rows`), gives each row its slot
   (:func:`jobs.shard_steps.deal.class_slots`) and writes them to a *slot part* in the staging folder, sorted
   by ``home`` (``slot mod N``, the row's shard unless the deal says otherwise).
2. :func:`order_rows`, one task per shard: reads the shard's rows from every slot part of its
   channel (``home`` is the shard, or the slot is one of the deal's exceptions) and writes them
   in position order (:func:`jobs.shard_steps.deal.order_shard`), the *order file* that preprocessing tasks
   read their segments from. With ``--base``, it also stages its rows for the join with the
   base (:func:`jobs.shard_steps.reuse.stage_order`).

Nothing here knows about Spark or Dask.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from jobs.common.tasks import write_table
from jobs.shard_steps.deal import Deal, class_slots, order_shard
from jobs.shard_steps.preprocess import rows_digest
from jobs.shard_steps.reuse import Reuse, stage_order
from lakeshard import storage
from lakeshard.errors import ManifestError
from lakeshard.format.manifest_table import read_channel_rows

__all__ = ["ORDER_COLUMNS", "OrderTask", "SlotTask", "order_rows", "slot_rows"]

#: The manifest columns the shard job reads: ``size``, ``etag`` and ``last_modified`` let it
#: tell an object that was replaced since the manifest was built.
_MANIFEST_COLUMNS = ["uri", "key", "label", "label_index", "size", "etag", "last_modified"]

#: An order file's columns: a segment's rows (:data:`jobs.shard_steps.preprocess.SEGMENT_SCHEMA`) and what
#: the repair needs to name a reject (its ``label`` and ``slot``) and order a pad (``copy``).
ORDER_COLUMNS = ["uri", "key", "label_index", "is_pad", "size", "etag", "last_modified", "label", "slot", "copy"]

#: Rows per row group of a slot part: ``home`` is sorted, so an order task reads only the
#: row groups that hold its shard.
_SLOT_ROW_GROUP = 65_536


@dataclass(frozen=True, slots=True)
class SlotTask:
    """Give the rows of ``classes`` of ``channel`` their slots and write them to ``uri``.
    ``classes`` holds (label, label index, first slot, rows) per class."""

    root: str
    channel: str
    classes: tuple[tuple[str, int, int, int], ...]
    seed: int
    num_shards: int
    uri: str


def slot_rows(task: SlotTask) -> dict[str, Any]:
    """Run a :class:`SlotTask`; returns the part's URI and its number of rows."""
    rows = read_channel_rows(task.root, task.channel, labels=[c[0] for c in task.classes], columns=_MANIFEST_COLUMNS)
    code = pc.dictionary_encode(rows["label"]).combine_chunks()
    names = code.dictionary.to_pylist()
    indices = code.indices.to_numpy(zero_copy_only=False)
    slots = np.empty(rows.num_rows, dtype=np.int64)
    for name, _, start, size in task.classes:
        mine = np.flatnonzero(indices == names.index(name)) if name in names else np.empty(0, np.int64)
        if len(mine) != size:
            raise ManifestError(
                f"channel {task.channel!r}, class {name!r}: the manifest table has {len(mine)} rows but "
                f"_manifest.json counts {size}; the manifest is inconsistent, run jobs/manifest.py again")
        slots[mine] = class_slots(rows["key"].take(pa.array(mine)), seed=task.seed, channel=task.channel, start=start)
    table = rows.append_column("slot", pa.array(slots)).append_column("home", pa.array(slots % task.num_shards))
    table = table.take(pc.sort_indices(table, sort_keys=[("home", "ascending"), ("slot", "ascending")]))
    write_table(task.uri, table, row_group_size=_SLOT_ROW_GROUP)
    return {"uri": task.uri, "rows": table.num_rows}


@dataclass(frozen=True, slots=True)
class OrderTask:
    """Write shard ``shard`` of ``deal``'s channel in position order to ``uri``, from the slot
    ``parts``; ``shard`` -1 writes the rows the deal drops, by slot (they are preprocessed in
    case rejects change the plan). ``cuts`` are the shard's segment boundaries: the task
    returns each segment's :func:`~jobs.shard_steps.preprocess.rows_digest`. With ``report``, it also returns the key and
    URI of every dropped and padded row. With ``reuse`` (``--base``), it stages the rows for
    the join with the base, under the ids ``segments`` of its segments (one per cut)."""

    deal: Deal
    shard: int
    parts: tuple[str, ...]
    uri: str
    cuts: tuple[int, ...]
    report: bool = False
    reuse: Reuse | None = None
    segments: tuple[int, ...] = ()


def order_rows(task: OrderTask) -> dict[str, Any]:
    """Run an :class:`OrderTask`; returns the order file's URI, its segments' digests and ids,
    its rows per label index (``classes``), if ``report``, ``{slot: (key, uri)}`` of the dropped
    and padded rows, and with ``reuse``, the staged file (``staged``,
    :func:`jobs.shard_steps.reuse.stage_order`)."""
    deal = task.deal
    wanted = pa.array(sorted(deal.exceptions), pa.int64())
    where = pc.field("slot").isin(wanted)
    if task.shard >= 0:
        where = (pc.field("home") == task.shard) | where
    fs, _ = storage.filesystem(task.parts[0])
    rows = ds.dataset([storage.filesystem(p)[1] for p in task.parts], filesystem=fs, format="parquet").to_table(
        filter=where)
    if task.shard >= 0:
        table = order_shard(deal, rows, task.shard)
    else:
        table = rows.filter(pc.is_in(rows["slot"], pa.array(deal.dropped, pa.int64())))
        table = table.take(pc.sort_indices(table, sort_keys=[("slot", "ascending")]))
        table = table.append_column("is_pad", pa.array(np.zeros(table.num_rows, bool))).append_column(
            "copy", pa.array(np.zeros(table.num_rows, np.int64)))
    table = table.select(ORDER_COLUMNS)
    write_table(task.uri, table, row_group_size=max(1, task.cuts[1] - task.cuts[0]))  # a row group per segment
    result: dict[str, Any] = {"uri": task.uri, "channel": deal.channel, "shard": task.shard,
                              "digests": [rows_digest(table.slice(a, b - a)) for a, b in pairwise(task.cuts)],
                              "segments": task.segments, "classes": _label_counts(table)}
    if task.reuse is not None:
        result["staged"] = stage_order(task.reuse, table, task.cuts, task.segments)
    if task.report:
        named = set(deal.dropped) | set(deal.padded)
        hit = rows.filter(pc.is_in(rows["slot"], pa.array(sorted(named), pa.int64())))
        result["named"] = {int(g): (k, u) for g, k, u in zip(hit["slot"].to_pylist(), hit["key"].to_pylist(),
                                                             hit["uri"].to_pylist(), strict=True)}
    return result


def _label_counts(table: pa.Table) -> dict[int, int]:
    """``{label index: rows}`` of ``table``: classes × shards numbers in all, never rows."""
    counts = pc.value_counts(table["label_index"])
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True))
