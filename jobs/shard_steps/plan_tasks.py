"""The shard plan's worker steps: the rows stay on the workers, the driver holds a
:class:`~jobs.shard_steps.deal.Deal` (counts and a few exceptions).

1. :func:`slot_rows`, one task per group of classes of a channel: reads those classes' manifest
   rows (:func:`lakeshard.format.manifest_table.read_channel_rows`), gives each row its slot
   (:func:`jobs.shard_steps.deal_rows.class_slots`) and writes them to a *slot part* in the staging folder, sorted
   by ``home`` (``slot mod N``, the row's shard unless the deal says otherwise).
2. :func:`order_rows`, one task per shard: reads the shard's rows from every slot part of its
   channel (``home`` is the shard, or the slot is one of the deal's exceptions) and writes them
   in position order (:func:`jobs.shard_steps.deal_rows.order_shard`), the *order file* that preprocessing tasks
   read their segments from. With ``--base``, it also stages its rows for the join with the
   base (:func:`jobs.shard_steps.reuse_tasks.stage_order`).

On the driver, :func:`slot_tasks` and :func:`order_tasks` make the tasks of a pass, and a
channel's plan is what they return (:class:`PlannedChannel`: file names and counts, never its
rows). Nothing here knows about Spark or Dask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from jobs.common.tasks import pack, write_table
from jobs.shard_steps.deal import DROPPED_ROWS_SHARD, Deal
from jobs.shard_steps.deal_rows import class_slots, order_shard
from jobs.shard_steps.preprocess import rows_digest
from jobs.shard_steps.reuse_tasks import JoinFolder, StagedFile, stage_order
from jobs.shard_steps.segments import segment_cuts
from jobs.shard_steps.staging import work_uri
from lakeshard import storage
from lakeshard.errors import ManifestError
from lakeshard.format import channel_dirname
from lakeshard.format.manifest_table import iter_parts, read_channel_rows

__all__ = [
    "IMAGES",
    "ORDER_COLUMNS",
    "Channel",
    "ClassRows",
    "NamedRow",
    "OrderPass",
    "OrderTask",
    "PlannedChannel",
    "ShardOrder",
    "ShardsToOrder",
    "SlotPart",
    "SlotTask",
    "order_rows",
    "order_tasks",
    "order_uri",
    "slot_rows",
    "slot_tasks",
]

#: The manifest columns the shard job reads: ``size``, ``etag`` and ``last_modified`` let it
#: tell an object that was replaced since the manifest was built.
_MANIFEST_COLUMNS = ["uri", "key", "label", "label_index", "size", "etag", "last_modified"]

#: An order file's columns: a segment's rows (:data:`jobs.shard_steps.preprocess.SEGMENT_SCHEMA`) and what
#: the repair needs to name a reject (its ``label`` and ``slot``) and order a pad (``copy``).
ORDER_COLUMNS = [
    "uri",
    "key",
    "label_index",
    "is_pad",
    "size",
    "etag",
    "last_modified",
    "label",
    "slot",
    "copy",
]

#: A slot part's columns other than a multi-label or boxes row's label and kept columns, which
#: follow :data:`ORDER_COLUMNS` in its order files.
_SLOT_COLUMNS = frozenset([*_MANIFEST_COLUMNS, *ORDER_COLUMNS, "home"])

#: Rows per row group of a slot part: ``home`` is sorted, so an order task reads only the
#: row groups that hold its shard.
_SLOT_ROW_GROUP = 65_536

#: Rows given their slots by one task at most (a group of classes; a larger class is one task).
_ROWS_PER_SLOT_TASK = 500_000


@dataclass(frozen=True, slots=True)  # not a NamedTuple: its field index would hide tuple.index
class ClassRows:
    """One class of a channel, as the manifest marker counts it (``counts.classes``)."""

    label: str
    index: int  #: its label index
    rows: int


#: The one class a multi-label or boxes channel is planned as: its images (the plan balances
#: images, not labels; docs/design/0045-shard-job-labels.md).
IMAGES = "(images)"


@dataclass(frozen=True, slots=True)
class SlotTask:
    """Give the rows of ``classes`` of ``deal``'s channel their slots and write them to ``uri``.
    With ``carried`` (a multi-label or boxes channel's label and kept columns, read too), the
    one class is :data:`IMAGES`, every row of the channel."""

    root: str
    deal: Deal
    classes: tuple[ClassRows, ...]
    uri: str
    carried: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.classes)


@dataclass(frozen=True, slots=True)
class SlotPart:
    """A slot part a :class:`SlotTask` wrote: its URI and rows."""

    uri: str
    rows: int


def slot_rows(task: SlotTask) -> SlotPart:
    """Run a :class:`SlotTask`."""
    deal, channel = task.deal, task.deal.channel
    if task.carried:
        return _write_slots(task, _image_slots(task))
    rows = read_channel_rows(
        task.root, channel, labels=[c.label for c in task.classes], columns=_MANIFEST_COLUMNS
    )
    code = pc.dictionary_encode(rows["label"]).combine_chunks()
    names = code.dictionary.to_pylist()
    indices = code.indices.to_numpy(zero_copy_only=False)
    slots = np.empty(rows.num_rows, dtype=np.int64)
    for c in task.classes:
        mine = np.flatnonzero(indices == names.index(c.label)) if c.label in names else np.empty(0, np.int64)
        if len(mine) != c.rows:
            raise ManifestError(
                f"channel {channel!r}, class {c.label!r}: the manifest table has {len(mine)} rows but "
                f"_manifest.json counts {c.rows}; the manifest is inconsistent, run jobs/manifest.py again"
            )
        slots[mine] = class_slots(
            rows["key"].take(pa.array(mine)), seed=deal.seed, channel=channel, start=deal.class_start(c.index)
        )
    return _write_slots(task, rows.append_column("slot", pa.array(slots)))


def _image_slots(task: SlotTask) -> pa.Table:
    """A multi-label or boxes channel's rows, their label and kept columns too, with their
    slots: the channel is one class (:data:`IMAGES`)."""
    channel, (images,) = task.deal.channel, task.classes
    rows = pa.concat_tables(iter_parts(task.root, channel, columns=[*_MANIFEST_COLUMNS, *task.carried]))
    if rows.num_rows != images.rows:
        raise ManifestError(
            f"channel {channel!r}: the manifest table has {rows.num_rows} rows but _manifest.json "
            f"counts {images.rows} images; the manifest is inconsistent, run jobs/manifest.py again"
        )
    slots = class_slots(
        rows["key"], seed=task.deal.seed, channel=channel, start=task.deal.class_start(images.index)
    )
    return rows.append_column("slot", pa.array(slots))


def _write_slots(task: SlotTask, table: pa.Table) -> SlotPart:
    """Write ``table`` (rows with their slots) as ``task``'s slot part, sorted by home shard."""
    slots = table["slot"].to_numpy()
    table = table.append_column("home", pa.array(slots % task.deal.num_shards))
    table = table.take(pc.sort_indices(table, sort_keys=[("home", "ascending"), ("slot", "ascending")]))
    write_table(task.uri, table, row_group_size=_SLOT_ROW_GROUP)
    return SlotPart(uri=task.uri, rows=table.num_rows)


@dataclass(frozen=True, slots=True)
class OrderTask:
    """Write shard ``shard`` of ``deal``'s channel in position order to ``uri``, from the slot
    ``parts``; shard :data:`~jobs.shard_steps.deal.DROPPED_ROWS_SHARD` writes the rows the deal
    drops, by slot (they are preprocessed in case rejects change the plan). ``cuts`` are the
    shard's segment boundaries: the task returns each segment's
    :func:`~jobs.shard_steps.preprocess.rows_digest`. With ``report``, it also returns the key
    and URI of every dropped and padded row. With ``join`` (``--base``), it stages the rows for
    the join with the base, under the ids ``segments`` of its segments (one per cut)."""

    deal: Deal
    shard: int
    parts: tuple[str, ...]
    uri: str
    cuts: tuple[int, ...]
    report: bool = False
    join: JoinFolder | None = None
    segments: tuple[int, ...] = ()


class NamedRow(NamedTuple):
    """A row ``dataset.json`` names (one the plan drops or pads): its key, then its URI."""

    key: str
    uri: str


@dataclass(frozen=True, slots=True)
class ShardOrder:
    """What an :class:`OrderTask` wrote: the order file of ``shard`` of ``channel`` and what the
    driver needs of it, classes × shards numbers and a few rows, never a row per image."""

    uri: str
    channel: str
    shard: int
    digests: tuple[str, ...]  #: each segment's :func:`~jobs.shard_steps.preprocess.rows_digest`
    segments: tuple[int, ...]  #: each segment's id (the task's ``segments``)
    classes: dict[int, int]  #: rows per label index, pad copies included
    #: with ``report``: the dropped and padded rows of the channel, by slot
    named: dict[int, NamedRow] | None = None
    #: with ``join``: the order file's rows staged for the join with the base
    staged: StagedFile | None = None


def order_rows(task: OrderTask) -> ShardOrder:
    """Run an :class:`OrderTask`."""
    deal = task.deal
    placed = task.shard != DROPPED_ROWS_SHARD
    wanted = pa.array(sorted(deal.exceptions), pa.int64())
    where = pc.field("slot").isin(wanted)
    if placed:
        where = (pc.field("home") == task.shard) | where
    fs, _ = storage.filesystem(task.parts[0])
    rows = ds.dataset(
        [storage.filesystem(p)[1] for p in task.parts], filesystem=fs, format="parquet"
    ).to_table(filter=where)
    if placed:
        table = order_shard(deal, rows, task.shard)
    else:
        table = rows.filter(pc.is_in(rows["slot"], pa.array(deal.dropped, pa.int64())))
        table = table.take(pc.sort_indices(table, sort_keys=[("slot", "ascending")]))
        table = table.append_column("is_pad", pa.array(np.zeros(table.num_rows, bool))).append_column(
            "copy", pa.array(np.zeros(table.num_rows, np.int64))
        )
    table = table.select([*ORDER_COLUMNS, *(c for c in rows.column_names if c not in _SLOT_COLUMNS)])
    write_table(
        task.uri, table, row_group_size=max(1, task.cuts[1] - task.cuts[0])
    )  # a row group per segment
    staged = stage_order(task.join, table, task.cuts, task.segments) if task.join is not None else None
    return ShardOrder(
        uri=task.uri,
        channel=deal.channel,
        shard=task.shard,
        digests=tuple(rows_digest(table.slice(a, b - a)) for a, b in pairwise(task.cuts)),
        segments=task.segments,
        classes=_label_counts(table),
        named=_named_rows(deal, rows) if task.report else None,
        staged=staged,
    )


def _named_rows(deal: Deal, rows: pa.Table) -> dict[int, NamedRow]:
    """The key and URI of the deal's dropped and padded rows among ``rows``, by slot."""
    named = set(deal.dropped) | set(deal.padded)
    hit = rows.filter(pc.is_in(rows["slot"], pa.array(sorted(named), pa.int64())))
    return {
        int(g): NamedRow(k, u)
        for g, k, u in zip(
            hit["slot"].to_pylist(), hit["key"].to_pylist(), hit["uri"].to_pylist(), strict=True
        )
    }


def _label_counts(table: pa.Table) -> dict[int, int]:
    """``{label index: rows}`` of ``table``: classes × shards numbers in all, never rows (a
    multi-label or boxes row, its ``label_index`` null, counts as the plan's one class, 0)."""
    counts = pc.value_counts(pc.fill_null(table["label_index"], 0))
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True))


def order_uri(staging: str, plan: str, channel: str, shard: int) -> str:
    """The order file of ``shard`` (or the dropped rows, :data:`~jobs.shard_steps.deal.DROPPED_ROWS_SHARD`)
    of ``channel`` in plan ``plan``."""
    name = "spare.parquet" if shard == DROPPED_ROWS_SHARD else f"{shard:05d}.parquet"
    return work_uri(staging, f"order-{plan}", channel_dirname(channel), name)


# The driver's side: the tasks of a pass, and a channel's plan from what they return.


@dataclass(frozen=True, slots=True)
class Channel:
    """A channel to shard: its classes, as the manifest counts them, and its first plan (its
    deal before any row is rejected)."""

    name: str
    classes: tuple[ClassRows, ...]
    first: Deal
    #: a multi-label or boxes channel's label and kept columns (its one class is :data:`IMAGES`)
    carried: tuple[str, ...] = ()


def slot_tasks(channels: list[Channel], *, root: str, staging: str, cores: int) -> list[SlotTask]:
    """The slot tasks of ``channels``, a task per group of classes: the engine's ``cores``
    shared by the channels, by rows, and no task over :data:`_ROWS_PER_SLOT_TASK` rows (but a
    class whole): an engine task costs tenths of a second to schedule on Spark."""
    tasks = []
    total = sum(c.first.total for c in channels)
    for channel in channels:
        deal = channel.first
        wanted = max(1, round(cores * deal.total / total), math.ceil(deal.total / _ROWS_PER_SLOT_TASK))
        groups = pack(list(channel.classes), [c.rows for c in channel.classes], wanted)
        for i, group in enumerate(sorted(groups, key=lambda g: min(c.index for c in g))):
            uri = work_uri(staging, "slots", channel_dirname(channel.name), f"part-{i:05d}.parquet")
            classes = tuple(sorted(group, key=lambda c: c.index))
            tasks.append(SlotTask(root=root, deal=deal, classes=classes, uri=uri, carried=channel.carried))
    return tasks


@dataclass(frozen=True, slots=True)
class ShardsToOrder:
    """The shards of one channel's plan ``deal`` whose order files an order pass writes, from
    the channel's slot parts."""

    deal: Deal
    shards: tuple[int, ...]
    slot_parts: tuple[str, ...]


def order_tasks(
    staging: str, plan: str, wanted: list[ShardsToOrder], *, segment_rows: int, join: JoinFolder | None = None
) -> list[OrderTask]:
    """The order tasks that write the order files ``wanted`` of plan ``plan``, each shard cut
    into segments (:func:`~jobs.shard_steps.segments.segment_cuts`), the segments numbered
    across the pass; the first shard of each channel reports its channel's dropped and padded
    rows."""
    tasks: list[OrderTask] = []
    for shards in wanted:
        deal = shards.deal
        for k, shard in enumerate(shards.shards):
            rows = len(deal.dropped) if shard == DROPPED_ROWS_SHARD else deal.rows_per_shard
            cuts = (0, rows) if shard == DROPPED_ROWS_SHARD else segment_cuts(rows, segment_rows)
            first = tasks[-1].segments[-1] + 1 if tasks else 0
            tasks.append(
                OrderTask(
                    deal=deal,
                    shard=shard,
                    parts=shards.slot_parts,
                    cuts=cuts,
                    report=k == 0,
                    uri=order_uri(staging, plan, deal.channel, shard),
                    join=join,
                    segments=tuple(range(first, first + len(cuts) - 1)),
                )
            )
    return tasks


@dataclass(frozen=True, slots=True)
class OrderPass:
    """What an order pass wrote: its order files, and (``--base``) both sides of the join staged."""

    orders: tuple[ShardOrder, ...]
    staged: tuple[StagedFile, ...]

    def of(self, channel: str) -> dict[int, ShardOrder]:
        """The order files of ``channel``, by shard."""
        return {o.shard: o for o in self.orders if o.channel == channel}


@dataclass(frozen=True, slots=True)
class PlannedChannel:
    """A channel's first plan on the workers: the slot parts that hold its rows with their
    slots, and its order files by shard (its dropped rows' too,
    :data:`~jobs.shard_steps.deal.DROPPED_ROWS_SHARD`)."""

    channel: Channel
    slot_parts: tuple[str, ...]
    orders: dict[int, ShardOrder]

    @property
    def named(self) -> dict[int, NamedRow]:
        """The channel's dropped and padded rows in the first plan, by slot."""
        return self.orders[0].named or {}
