"""Labelling the listed rows from the ``--labels`` table on the workers (the manifest job's
labelling pass, between the listing and the header reads).

Both sides are staged by :func:`lakeshard.format.manifest_table.hash_bucket` of the key, so one task
per bucket joins them with no row on the driver:

1. :func:`stage_table` (one item per table file): read and check it
   (:func:`jobs.manifest_steps.labels.read_labels`), stage ``(key, label, channel)`` rows by key bucket; a
   ``uri`` outside ``--input`` names no object of the lake and is counted as such.
2. :func:`stage_keys` (one item per slice of the listed rows): stage them by key bucket.
3. :func:`join_task` (one item per key bucket): give each listed row its label and pinned
   channel; a listed object with no label row is rejected (``no label: not in --labels
   <uri>``); label rows naming no listed object and keys labelled two ways are counted, with
   the first few keys. The labelled rows are staged as the listing parts of the next pass.

Only counts and a few examples return to the driver, which fails the job on a key labelled
two ways before any object is read.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import pyarrow as pa
import pyarrow.compute as pc

from jobs.manifest_steps.label_sets import combine
from jobs.manifest_steps.labels import read_labels
from jobs.manifest_steps.listing import LabelledRow, reject
from jobs.manifest_steps.passes import (
    EXAMPLES,
    PartSlice,
    StagedPart,
    read_staged,
    staged_schema,
    write_staged,
)
from jobs.manifest_steps.table_values import TableColumns
from lakeshard import storage
from lakeshard.format import LabelsTable
from lakeshard.format.manifest_table import hash_bucket, read_part, table_rows, write_part

__all__ = [
    "BucketJoin",
    "Conflict",
    "LabelJoin",
    "LabelledBuckets",
    "Labelling",
    "StagedLabels",
    "conflicts_text",
    "join_task",
    "stage_keys",
    "stage_table",
]


@dataclass(frozen=True, kw_only=True)
class BucketJoin:
    """A join of the listed rows with another table by key bucket: its staging folder (one
    folder per side and bucket) and the number of key buckets."""

    staging: str
    buckets: int

    def folder(self, side: str, bucket: int) -> str:
        return storage.join(self.staging, side, f"b={bucket:05d}")


@dataclass(frozen=True, kw_only=True)
class LabelJoin(BucketJoin):
    """What every labelling task needs: the input, the table's URI (named in reasons), the
    split's channels, the staging folder and the number of key buckets."""

    root: str
    labels: str
    channels: tuple[str, ...]
    #: the task, the kept columns and the boxes' units (``--task``, ``--keep-columns``, ``--box-units``)
    columns: TableColumns = TableColumns()
    #: the kept columns' types (:func:`jobs.manifest_steps.labels.kept_schema`; None: none kept)
    kept: pa.Schema | None = None

    @property
    def staged(self) -> pa.Schema:
        """The labelled rows' schema: the staged columns, the task's and the kept ones."""
        return staged_schema(self.columns.task, self.kept)

    def labelled(self, bucket: int) -> str:
        return storage.join(self.staging, "labelled", f"part-{bucket:05d}.parquet")


def _name(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _keys(table: pa.Table, root: str) -> list[str | None]:
    """Each row's key relative to ``root`` (None: its ``uri`` is not under ``root``)."""
    if "key" in table.column_names:
        return table["key"].to_pylist()
    under = root.rstrip("/") + "/"
    out: list[str | None] = []
    for uri in table["uri"].to_pylist():
        full = storage.normalize(uri)
        out.append(full[len(under) :] if full.startswith(under) else None)
    return out


@dataclass(frozen=True, slots=True)
class StagedLabels:
    """What :func:`stage_table` hands back for the table files it staged: their rows, and the
    rows whose ``uri`` is outside ``--input`` (how many; the first few)."""

    rows: int
    outside: int
    outside_examples: tuple[str, ...]


def stage_table(files: list[str], *, join: LabelJoin) -> list[StagedLabels]:
    """Stage the label rows of ``files`` by key bucket; return, per file, its rows and the
    rows whose ``uri`` is outside ``--input``."""
    out = []
    for uri in files:
        table = read_labels(uri, channels=join.channels, columns=join.columns)
        keys = _keys(table, join.root)
        staged = pa.table(
            {"key": pa.array(keys, pa.string()), **{c: table[c] for c in table.column_names[1:]}}
        )
        buckets = pa.array([-1 if k is None else hash_bucket(k, join.buckets) for k in keys], pa.int64())
        for bucket in sorted(set(buckets.to_pylist()) - {-1}):
            write_part(
                storage.join(join.folder("labels", bucket), f"part-{_name(uri)}.parquet"),
                staged.filter(pc.equal(buckets, bucket)),
                durable=False,
            )
        outside = sorted(u for u, k in zip(table[table.column_names[0]].to_pylist(), keys) if k is None)
        out.append(
            StagedLabels(
                rows=table.num_rows, outside=len(outside), outside_examples=tuple(outside[:EXAMPLES])
            )
        )
    return out


def stage_keys(items: list[PartSlice], *, join: BucketJoin) -> list[int]:
    """Stage the listed rows ``items`` by key bucket (side ``keys`` of ``join``, any join by
    key bucket); return how many."""
    n = 0
    for piece in items:
        rows = table_rows(read_part(piece.uri).slice(piece.start, piece.stop - piece.start))
        by_bucket: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_bucket[hash_bucket(r["key"], join.buckets)].append(r)
        for bucket, mine in by_bucket.items():
            name = f"part-{_name(piece.uri)}-{piece.start:09d}.parquet"
            write_staged(mine, storage.join(join.folder("keys", bucket), name))
        n += len(rows)
    return [n]


class Conflict(NamedTuple):
    """A key labelled in two different ways, and each way (a label, and its channel if pinned)."""

    key: str
    labels: tuple[str, ...]

    def to_json(self) -> dict[str, list[str]]:
        return {self.key: list(self.labels)}


def conflicts_text(conflicts: Iterable[Conflict]) -> str:
    """``'a.png': cat, dog; ...``: the conflicts as an error names them."""
    return "; ".join(f"{c.key!r}: {', '.join(c.labels)}" for c in conflicts)


@dataclass(frozen=True, slots=True)
class LabelledBuckets:
    """What :func:`join_task` hands back for its key buckets, merged by :meth:`merge`: the
    labelled rows' staged parts and labels; how many listed objects have no label row
    (``unlabelled``, rejected) and how many a row pins to a channel; the label rows naming no
    listed object (``missing``; the first few keys); the keys labelled two ways (the first few
    of each bucket)."""

    parts: tuple[StagedPart, ...]
    labels: tuple[str, ...]
    unlabelled: int
    pinned: int
    missing: int
    missing_examples: tuple[str, ...]
    conflicts: int
    conflict_examples: tuple[Conflict, ...]

    @classmethod
    def merge(cls, results: Sequence[LabelledBuckets]) -> LabelledBuckets:
        return cls(
            parts=tuple(sorted(p for r in results for p in r.parts)),
            labels=tuple(sorted({x for r in results for x in r.labels})),
            unlabelled=sum(r.unlabelled for r in results),
            pinned=sum(r.pinned for r in results),
            missing=sum(r.missing for r in results),
            missing_examples=tuple(k for r in results for k in r.missing_examples),
            conflicts=sum(r.conflicts for r in results),
            conflict_examples=tuple(
                sorted((e for r in results for e in r.conflict_examples), key=lambda e: e.key)[:EXAMPLES]
            ),
        )


def join_task(buckets: list[int], *, join: LabelJoin) -> list[LabelledBuckets]:
    """For each key bucket: label its listed rows from its label rows
    (:func:`jobs.manifest_steps.label_sets.combine`: identical label rows of a key are one),
    reject a listed object that has none, count the label rows naming no listed object and
    the keys labelled two ways; stage the labelled rows. Returns each bucket's counts, and the
    first :data:`~jobs.manifest_steps.passes.EXAMPLES` keys of each."""
    out = []
    for bucket in buckets:
        rows = read_staged(join.folder("keys", bucket))
        given: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in read_staged(join.folder("labels", bucket)):
            given[r["key"]].append(dict(r))
        labelled = {key: combine(mine, join.columns) for key, mine in given.items()}
        listed = {r["key"] for r in rows}
        conflicts = sorted(k for k, v in labelled.items() if v.ways)
        missing = sorted(k for k in given if k not in listed)
        unlabelled = 0
        for r in rows:
            if r["key"] in labelled:
                labelled[r["key"]].apply(cast(LabelledRow, r), join.columns.task)
            elif r["status"] == "ok":
                reject(r, f"no label: not in --labels {join.labels}")
                unlabelled += 1
        write_staged(rows, join.labelled(bucket), join.staged)
        ok = [r for r in rows if r["status"] == "ok"]
        names = {
            x for r in rows for x in (cast(LabelledRow, r).get("labels") or [r["label"]]) if x is not None
        }
        out.append(
            LabelledBuckets(
                parts=(StagedPart(join.labelled(bucket), len(rows)),) if rows else (),
                labels=tuple(sorted(names)),
                unlabelled=unlabelled,
                pinned=sum(1 for r in ok if r["pin"]),
                missing=len(missing),
                missing_examples=tuple(missing[:EXAMPLES]),
                conflicts=len(conflicts),
                conflict_examples=tuple(Conflict(k, labelled[k].ways) for k in conflicts[:EXAMPLES]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Labelling:
    """The labelling's outcome: the table (its URI and files), the join's counts, and the label
    rows naming no object of the lake (``uri`` outside ``--input`` or no listed key)."""

    uri: str
    files: int
    rows: int
    joined: LabelledBuckets
    not_in_lake: int
    not_in_lake_examples: tuple[str, ...]

    @classmethod
    def merge(
        cls, uri: str, files: int, tables: Sequence[StagedLabels], results: Sequence[LabelledBuckets]
    ) -> Labelling:
        joined = LabelledBuckets.merge(results)
        missing = [*joined.missing_examples, *(u for t in tables for u in t.outside_examples)]
        return cls(
            uri=uri,
            files=files,
            rows=sum(t.rows for t in tables),
            joined=joined,
            not_in_lake=joined.missing + sum(t.outside for t in tables),
            not_in_lake_examples=tuple(sorted(missing, key=str)[:EXAMPLES]),
        )

    def summary(self) -> LabelsTable:
        """What ``_manifest.json`` says of the table (``labels_table``)."""
        return LabelsTable(
            uri=self.uri,
            files=self.files,
            rows=self.rows,
            unlabelled=self.joined.unlabelled,
            pinned=self.joined.pinned,
            not_in_lake=self.not_in_lake,
            not_in_lake_examples=list(self.not_in_lake_examples),
            conflicts=self.joined.conflicts,
            conflict_examples=[c.to_json() for c in self.joined.conflict_examples],
        )
