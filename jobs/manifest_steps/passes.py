"""The manifest job's worker tasks: rows stay on the workers, each task returns aggregates.

Four passes of ``Engine.map_partitions`` (``docs/design/0011-distributed-manifest.md``), each
writing Parquet parts for the next under the staging folder, and a fifth when there are
duplicates:

1. :func:`stage_listing` (one item per class prefix): list, write the rows; return counts.
2. :func:`inspect_task` (one item per slice of the listed rows): read each object's first
   bytes, write the rows bucketed by content hash.
3. :func:`content_task` (one item per content bucket: every object of identical content is in
   one): ``--dedupe``, mark duplicate groups, write the rows bucketed by class part; return
   per-class counts and reject reasons, from which the driver checks ``--min-per-class``.
4. :func:`class_task` (one item per class part: every row of a class is in one): split
   group-wise, write the manifest tables' part; return per-class fingerprints.
5. :func:`jobs.manifest_steps.duplicates.duplicates_task` (content buckets with duplicates): the
   duplicate-group report.

The result is the manifest :func:`jobs.manifest_steps.catalog.build_manifest` builds from the same rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import pyarrow as pa

from jobs.manifest_steps.catalog import dedupe_rows, fingerprint_line, reason_kind, same_content
from jobs.manifest_steps.label_rows import WrittenCounts, index_labels, row_labels, written_counts
from jobs.manifest_steps.listing import LabelledRow, StagedRow, inspect_objects, place_boxes
from jobs.manifest_steps.split import ALGORITHMS, MULTI_LABEL_ALGORITHMS
from lakeshard import storage
from lakeshard.errors import StorageError
from lakeshard.format import (
    MANIFEST_SCHEMA,
    LabelsTable,
    manifest_part_uri,
    sagemaker_part_uri,
)
from lakeshard.format.label_columns import BOXES, SINGLE_LABEL, manifest_schema, task_fields
from lakeshard.format.manifest_table import hash_bucket, label_part, read_part, table_rows, write_part

__all__ = [
    "EXAMPLES",
    "STAGED_SCHEMA",
    "ClassParts",
    "ContentCounts",
    "KeyChange",
    "ListedPart",
    "Listing",
    "PartSlice",
    "PassPlan",
    "SkippedObject",
    "StagedPart",
    "assign_channels",
    "class_task",
    "content_task",
    "inspect_rows",
    "inspect_task",
    "read_staged",
    "skip_kind",
    "stage_listing",
    "staged_schema",
    "write_staged",
]

#: How many examples (skipped objects, duplicate groups) the summary keeps.
EXAMPLES = 5

#: Staged rows: the manifest columns, the content hash, whether the row is an accepted object
#: in a group of identical content, the channel ``--labels`` pins it to (None: the split's),
#: whether its header read was taken from ``--base`` (so the read is skipped) and its channel
#: in the base (None: not accepted there; :mod:`jobs.manifest_steps.base`).
STAGED_SCHEMA = pa.schema(
    [
        *MANIFEST_SCHEMA,
        pa.field("content", pa.string()),
        pa.field("duplicate", pa.bool_()),
        pa.field("pin", pa.string()),
        pa.field("reused", pa.bool_()),
        pa.field("base_channel", pa.string()),
    ]
)


def staged_schema(task: str = SINGLE_LABEL, kept: pa.Schema | None = None) -> pa.Schema:
    """:data:`STAGED_SCHEMA` and the columns ``task`` and the kept columns ``kept`` add
    (:func:`lakeshard.format.label_columns.manifest_schema`)."""
    return pa.schema([*STAGED_SCHEMA, *task_fields(task), *(kept or [])])


_DUPLICATE_SCHEMA = pa.schema([(n, pa.string()) for n in ("content", "key", "label", "channel")])


@dataclass(frozen=True)
class PassPlan:
    """What every task of the passes after the listing needs (small: no rows)."""

    out: str
    staging: str
    content_buckets: int
    parts: int
    split: dict[str, float]
    seed: int
    split_method: str
    dedupe: bool
    labels: dict[str, int] = field(default_factory=dict)
    #: Read each object's first bytes (``--sniff``); off: rows are inspected by their listing only.
    sniff: bool = True
    #: What an image is labelled with (``--task``), and how a ``boxes`` table measured its boxes.
    task: str = SINGLE_LABEL
    box_units: str = "pixels"
    #: The ``--keep-columns`` of the labels table, with their types (None: none kept).
    kept: pa.Schema | None = None

    @property
    def staged(self) -> pa.Schema:
        return staged_schema(self.task, self.kept)

    @property
    def manifest(self) -> pa.Schema:
        """The manifest tables' schema (:data:`MANIFEST_SCHEMA` for a single-label manifest)."""
        return manifest_schema(self.task, self.kept)

    @property
    def extra_columns(self) -> list[str]:
        """The manifest's columns beyond :data:`MANIFEST_SCHEMA` (the fingerprint hashes them)."""
        return self.manifest.names[len(MANIFEST_SCHEMA) :]

    def folder(self, stage: str, bucket: int) -> str:
        return storage.join(self.staging, stage, f"b={bucket:05d}")


def skip_kind(reason: str) -> str:
    """ "hidden" (their names vary without bound, as '._*' files do) or "excluded: --exclude GLOB"."""
    return reason if reason.startswith("excluded") else reason.split(":")[0]


def write_staged(rows: Sequence[Mapping[str, Any]], uri: str, schema: pa.Schema = STAGED_SCHEMA) -> None:
    """Stage ``rows`` at ``uri`` (not fsynced: a rerun removes the staging folder and stages
    anew), as ``schema`` (:func:`staged_schema`: the labels table's columns, once joined)."""
    write_part(uri, pa.Table.from_pylist(list(rows), schema=schema), durable=False)


def read_staged(folder: str) -> list[StagedRow]:
    """Every staged row under ``folder``, sorted by key ([] if nothing was staged there)."""
    fs, path = storage.filesystem(folder)
    try:
        names = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise StorageError(f"cannot list {folder}: {type(exc).__name__}: {exc}") from exc
    rows = [r for name in names for r in table_rows(read_part(storage.from_listing(folder, name)))]
    return cast(list[StagedRow], sorted(rows, key=lambda r: r["key"]))


def _by_bucket(
    rows: Sequence[StagedRow], bucket_of: Callable[[StagedRow], int]
) -> dict[int, list[StagedRow]]:
    out: dict[int, list[StagedRow]] = defaultdict(list)
    for r in rows:
        out[bucket_of(r)].append(r)
    return out


class SkippedObject(NamedTuple):
    """An object the listing skipped, and why (``hidden: ...`` or ``excluded: ...``)."""

    key: str
    reason: str


class StagedPart(NamedTuple):
    """A staged part of listed rows, and how many rows it holds."""

    uri: str
    rows: int


class PartSlice(NamedTuple):
    """Rows ``start`` to ``stop`` (excluded) of a staged part: a task's share of the listed rows."""

    uri: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ListedPart:
    """What a listing task hands back for the rows it staged (not a dict: a row never is one
    of these, so a listing loop that collects dict rows passes it by)."""

    uri: str
    rows: int
    skipped: dict[str, int]
    skipped_examples: tuple[SkippedObject, ...]
    #: The distinct labels of the staged rows (from their keys; ``None`` above the label level).
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Listing:
    """The listed rows, staged on the workers, as the header reads start from them: the parts,
    how many classes are known before then (class prefixes or labels), the skipped
    objects (by kind; the first few by key), and what ``_manifest.json`` says of the labels
    table or Ground Truth manifest the labels came from (``labels_table``; None: the path)."""

    parts: tuple[StagedPart, ...]
    classes: int
    skipped: Counter[str]
    skipped_examples: tuple[SkippedObject, ...]
    labels_table: LabelsTable | None = None

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def slices(self, tasks: int) -> list[PartSlice]:
        """The parts cut into slices of about ``rows / tasks`` rows each."""
        size = max(1, math.ceil(self.rows / tasks))
        return [
            PartSlice(p.uri, a, min(a + size, p.rows)) for p in self.parts for a in range(0, p.rows, size)
        ]


def stage_listing(items: list[Any], *, produce: Callable[[list[Any]], list[Any]], staging: str) -> list[Any]:
    """Run the listing task ``produce`` on ``items`` and stage the rows it makes (dicts) in one
    part; return a :class:`ListedPart` for them, then whatever else ``produce`` returned (work
    left for another round, say). Any listing (prefixes, balanced pieces, inventory files)
    becomes a pass that keeps its rows on the workers."""
    out = produce(items)
    rows = [r for r in out if isinstance(r, dict)]
    kept = [r for r in rows if r["status"] != "skipped"]
    skipped = sorted(SkippedObject(r["key"], r["reason"]) for r in rows if r["status"] == "skipped")
    name = hashlib.blake2b(repr(items).encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    uri = storage.join(staging, "listed", f"part-{name}.parquet")
    write_staged(kept, uri)
    part = ListedPart(
        uri=uri,
        rows=len(kept),
        skipped=dict(Counter(skip_kind(s.reason) for s in skipped)),
        skipped_examples=tuple(skipped[:EXAMPLES]),
        labels=tuple(sorted({r["label"] for r in kept if r["label"] is not None})),
    )
    return [part, *(r for r in out if not isinstance(r, dict))]


def _content_bucket(row: Mapping[str, Any], buckets: int) -> int:
    return hash_bucket(row.get("content") or "key:" + row["key"], buckets)


def inspect_task(items: list[PartSlice], *, plan: PassPlan) -> list[int]:
    """Inspect the listed rows ``items`` but those whose inspection ``--base`` gave
    (``reused``); stage them by content bucket. Returns the number of rows."""
    rows = cast(
        list[StagedRow],
        [r for s in items for r in table_rows(read_part(s.uri).slice(s.start, s.stop - s.start))],
    )
    first = items[0]
    name = f"part-{first.uri.rsplit('/', 1)[-1].split('.')[0].split('-')[-1]}-{first.start:09d}.parquet"
    inspect_rows(rows, name, plan=plan)
    return [len(rows)]


def inspect_rows(rows: list[StagedRow], name: str, *, plan: PassPlan) -> None:
    """Inspect ``rows`` but those whose inspection ``--base`` gave (``reused``); stage them by
    content bucket, in a file ``name`` of each bucket's folder."""
    inspected = [r for r in rows if r.get("reused")] + inspect_objects(
        [r for r in rows if not r.get("reused")], sniff=plan.sniff, sizes=plan.task == BOXES
    )
    if plan.task == BOXES:
        place_boxes(cast(list[LabelledRow], inspected), units=plan.box_units)
    for bucket, mine in _by_bucket(inspected, lambda r: _content_bucket(r, plan.content_buckets)).items():
        write_staged(mine, storage.join(plan.folder("inspected", bucket), name), plan.staged)


def assign_channels(ok: Sequence[StagedRow], plan: PassPlan) -> list[str]:
    """The channel of each accepted row of ``ok``: its ``pin`` (``--labels``' channel column)
    if it has one, else the split's (the split sees the unpinned rows only; rows with several
    labels are split by the set of them)."""
    free = [r for r in ok if not r.get("pin")]
    keys = [r["key"] for r in free]
    if plan.task == SINGLE_LABEL:
        channels = ALGORITHMS[plan.split_method](keys, [r["label"] for r in free], plan.split, plan.seed)
    else:
        sets = [row_labels(r) for r in free]
        channels = MULTI_LABEL_ALGORITHMS[plan.split_method](keys, sets, plan.split, plan.seed)
    split = iter(channels)
    return [r.get("pin") or next(split) for r in ok]


def _channel_counts(
    ok: Sequence[StagedRow], plan: PassPlan, *, pinned_only: bool
) -> dict[str, dict[str, int]]:
    """``{label: {channel: n}}`` of ``ok``: of every row under a per-row split (the ``hash``
    split), of the pinned rows only for a split that needs the whole class (the others'
    counts follow from the class size)."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(plan.split, 0))
    rows = [r for r in ok if r.get("pin")] if pinned_only else ok
    for r, channel in zip(rows, assign_channels(rows, plan)):
        for label in row_labels(r):
            counts[label][channel] += 1
    return dict(counts)


@dataclass(frozen=True, slots=True)
class ContentCounts:
    """What :func:`content_task` hands back for its content buckets, and merged (:meth:`merge`)
    what the driver checks: the rows, the rejects ``--dedupe`` made, the groups of identical
    accepted content; per label, the accepted rows and those ``--labels`` pins; the rejects by
    reason kind; per label, the accepted rows per channel the workers counted (every row under
    the ``hash`` split; the pinned rows only under a split that needs the whole class)."""

    listed: int
    removed: int
    duplicate_groups: int
    accepted: Counter[str]
    pinned: Counter[str]
    reasons: Counter[str]
    channels: dict[str, Counter[str]]

    @classmethod
    def merge(cls, parts: Iterable[ContentCounts]) -> ContentCounts:
        listed = removed = groups = 0
        accepted, pinned, reasons = Counter[str](), Counter[str](), Counter[str]()
        channels: dict[str, Counter[str]] = defaultdict(Counter)
        for p in parts:
            listed, removed, groups = listed + p.listed, removed + p.removed, groups + p.duplicate_groups
            accepted.update(p.accepted)
            pinned.update(p.pinned)
            reasons.update(p.reasons)
            for label, counts in p.channels.items():
                channels[label].update(counts)
        return cls(
            listed=listed,
            removed=removed,
            duplicate_groups=groups,
            accepted=accepted,
            pinned=pinned,
            reasons=reasons,
            channels=dict(channels),
        )

    def in_channel(self, label: str, channel: str) -> int:
        """The accepted rows of ``label`` the workers counted in ``channel``."""
        return self.channels[label][channel] if label in self.channels else 0


def content_task(buckets: list[int], *, plan: PassPlan) -> list[ContentCounts]:
    """For each content bucket: with ``dedupe``, reject all but the first key of each group of
    identical content (as :func:`jobs.manifest_steps.catalog.build_manifest` does); mark the accepted rows in
    groups; stage the rows by class part. Returns each bucket's counts."""
    out = []
    for bucket in buckets:
        rows = read_staged(plan.folder("inspected", bucket))
        removed = dedupe_rows([r for r in rows if r["status"] == "ok"]) if plan.dedupe else 0
        ok = [r for r in rows if r["status"] == "ok"]
        groups = same_content(ok)
        for r in (r for g in groups for r in g):
            r["duplicate"] = True
        for part, mine in _by_bucket(rows, lambda r: label_part(r["label"], plan.parts)).items():
            name = f"part-{bucket:05d}.parquet"
            write_staged(mine, storage.join(plan.folder("classes", part), name), plan.staged)
        channels = _channel_counts(ok, plan, pinned_only=plan.split_method != "hash")
        out.append(
            ContentCounts(
                listed=len(rows),
                removed=removed,
                duplicate_groups=len(groups),
                accepted=Counter(label for r in ok for label in row_labels(r)),
                pinned=Counter(label for r in ok if r.get("pin") for label in row_labels(r)),
                reasons=Counter(reason_kind(r["reason"]) for r in rows if r["status"] != "ok"),
                channels={label: Counter(counts) for label, counts in channels.items()},
            )
        )
    return out


def _write_tables(plan: PassPlan, part: int, rows: list[StagedRow]) -> None:
    """Part ``part`` of every manifest table, and of each channel's SageMaker manifest."""

    def write(table: str, mine: list[StagedRow]) -> None:
        write_part(
            manifest_part_uri(plan.out, table, part, plan.parts),
            pa.Table.from_pylist(mine, schema=plan.manifest),
        )

    write("all", rows)
    write("rejects", [r for r in rows if r["status"] != "ok"])
    for channel in plan.split:
        mine = [r for r in rows if r["channel"] == channel and r["status"] == "ok"]
        write(channel, mine)
        lines = "".join(json.dumps({"source-ref": r["uri"]}) + "\n" for r in mine)
        storage.write_bytes_atomic(sagemaker_part_uri(plan.out, channel, part, plan.parts), lines.encode())


class KeyChange(NamedTuple):
    """An object whose channel (or label) is not the one ``--base`` gave it: its key, the
    base's value and this build's."""

    key: str
    old: str
    new: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "from": self.old, "to": self.new}


@dataclass(frozen=True, slots=True)
class ClassParts:
    """What :func:`class_task` hands back for its class parts, merged by :meth:`merge`: each
    class's fingerprint (:func:`jobs.manifest_steps.catalog.combine_fingerprints` makes the
    manifest's), and the accepted rows whose channel is not their ``--base`` channel (how many;
    the first few by key)."""

    fingerprints: dict[str, str]
    moved: int
    moved_examples: tuple[KeyChange, ...]
    counts: WrittenCounts = field(default_factory=WrittenCounts)

    @classmethod
    def merge(cls, parts: Sequence[ClassParts]) -> ClassParts:
        moved = sorted((e for p in parts for e in p.moved_examples), key=lambda e: e.key)
        return cls(
            fingerprints={label: h for p in parts for label, h in p.fingerprints.items()},
            moved=sum(p.moved for p in parts),
            moved_examples=tuple(moved[:EXAMPLES]),
            counts=WrittenCounts.merge(p.counts for p in parts),
        )


def class_task(parts: list[int], *, plan: PassPlan) -> list[ClassParts]:
    """For each class part: split its accepted rows (each class is whole here, so a stratified
    split ranks each class's rows group-wise), write the part of every manifest table, stage
    the rows of duplicate groups by content bucket. Returns, for each part, its classes'
    fingerprints and the rows whose channel differs from their ``--base`` channel."""
    out = []
    for part in parts:
        rows = read_staged(plan.folder("classes", part))
        ok = [r for r in rows if r["status"] == "ok"]
        channels = assign_channels(ok, plan)
        hashes: dict[str, Any] = defaultdict(hashlib.sha256)
        columns = plan.extra_columns  # a schema built anew at each call: once, not once a row
        for r, channel in zip(ok, channels):
            r["channel"] = channel
            index_labels(cast(LabelledRow, r), plan.labels)
            hashes[r["label"] or ""].update(fingerprint_line(r, channel, columns))
        moved = [r for r in ok if r.get("base_channel") not in (None, "", r["channel"])]
        _write_tables(plan, part, rows)
        duplicates = [r for r in ok if r["duplicate"]]
        for bucket, mine in _by_bucket(
            duplicates, lambda r: _content_bucket(r, plan.content_buckets)
        ).items():
            table = pa.Table.from_pylist(mine, schema=_DUPLICATE_SCHEMA)
            write_part(
                storage.join(plan.folder("duplicates", bucket), f"part-{part:05d}.parquet"),
                table,
                durable=False,
            )
        examples = tuple(
            KeyChange(r["key"], r.get("base_channel") or "", r["channel"]) for r in moved[:EXAMPLES]
        )
        out.append(
            ClassParts(
                fingerprints={label: h.hexdigest() for label, h in hashes.items()},
                moved=len(moved),
                moved_examples=examples,
                counts=written_counts(ok, plan.split),
            )
        )
    return out
