"""Incremental manifests (``--base URI``): what a previous manifest of the same lake already knows.

The base is checked before an engine starts (:func:`check_manifest_base`: complete, of this format, the
same ``--input``, kind of label source and split). On the workers its rows are joined with the listed
rows by key bucket, with the labelling pass's machinery (:class:`jobs.manifest_steps.label_tasks.BucketJoin`,
:func:`jobs.manifest_steps.label_tasks.stage_keys`), after the labelling; the join itself is done by the
header-reading pass's tasks:

1. :func:`stage_base` (one item per part of the base's ``all`` table): stage its rows by key
   bucket.
2. :func:`jobs.manifest_steps.label_tasks.stage_keys` (one item per slice of the listed rows): the same, in the
   same engine action as step 1 (:func:`stage_both`; on Spark an action costs tenths of a second).
3. :func:`inspect_bucket` (one item per key bucket, in the header-reading pass's action): a
   listed object the base listed with the same identity (S3: size and ETag; local: size and
   modification time, as local files have no ETag until read) is *unchanged*; if the base also
   records how its header read ended (the format of an accepted object, or the reason of a
   reject by that read), the row takes it (and a local file its ETag, the MD5 the read
   computed) and is marked ``reused``: it is not read again. Every listed row gets the base's
   channel (``base_channel``) so the split pass counts the objects that changed channel; the
   base's objects not listed now are counted (they left the lake). The task then reads the
   headers of the other rows, as the header-reading pass does (:func:`jobs.manifest_steps.passes.inspect_rows`):
   the joined rows are never staged. A row whose label is not the base's (a labels table or
   Ground Truth job that changed it) is counted (``relabelled``): it keeps its new label.

The channels are never taken from the base: the split runs on every row as without ``--base``,
so the manifest is the one a build from scratch writes; the hash split gives an unchanged key
its old channel by construction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.engines import Engine
from jobs.common.tasks import pack
from jobs.manifest_steps.catalog import DUPLICATE, reason_kind
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.label_tasks import BucketJoin, stage_keys
from jobs.manifest_steps.listing import StagedRow, reject
from jobs.manifest_steps.passes import (
    EXAMPLES,
    ClassParts,
    KeyChange,
    PartSlice,
    PassPlan,
    inspect_rows,
    read_staged,
)
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, ManifestError
from lakeshard.format import (
    MANIFEST_SCHEMA,
    BaseSummary,
    ManifestInfo,
    manifest_marker_uri,
    manifest_part_uri,
    read_manifest_info,
)
from lakeshard.format.manifest_table import hash_bucket, read_part, table_rows, write_part

__all__ = [
    "BaseJoin",
    "BaseReport",
    "JoinCounts",
    "check_manifest_base",
    "inspect_bucket",
    "join_and_inspect",
    "stage_base",
    "stage_both",
    "stage_join",
]

#: The options that decide each object's channel: a base split otherwise would have its objects
#: moved, which ``--base`` promises not to do (their flags name them in errors).
SPLIT_OPTIONS = {"split": "--split", "split_method": "--split-method", "seed": "--seed"}

#: The base's columns the join reads.
_BASE_COLUMNS = ("key", "size", "etag", "last_modified", "format", "status", "reason", "channel", "label")

#: Reject reasons (by :func:`jobs.manifest_steps.catalog.reason_kind`) that the header read itself gave
#: (:func:`jobs.manifest_steps.listing.inspect_objects`): the same bytes give the same reason. Any other
#: reject (no label, a listing reject) says nothing of the read, and the object is read.
_READ_REJECTS = ("empty object (0 bytes)", "not an image", "unsupported format")


def _split_text(split: Any) -> str:
    return ",".join(f"{c}={f:g}" for c, f in split.items()) if isinstance(split, dict) else repr(split)


def _label_source(label_depth: int | None, labels: str | None, attribute: str | None) -> str:
    if attribute:
        return f"--input-manifest {labels} --label-attribute {attribute}"
    return f"--labels {labels}" if labels else f"the path (--label-depth {label_depth})"


def _label_kind(label_depth: int | None, table: bool) -> str:
    """What decides the labels, not where a table lives: the path at a depth, or a table
    (``--labels`` or ``--input-manifest``; the join compares its labels key by key)."""
    return "a table" if table else f"the path at depth {label_depth}"


def check_manifest_base(cfg: ManifestConfig) -> ManifestInfo:
    """The ``--base`` manifest's marker, checked before an engine starts: the base is not the
    output, its manifest is complete (``_manifest.json``) and of this format, and it was built
    from the same ``--input``, kind of label source (the path at the same ``--label-depth``, or a
    table: ``--labels`` or ``--input-manifest``, wherever it lives; the join counts the objects
    whose label changed) and split options (``--split``, ``--split-method``, ``--seed``). Other
    options may differ (the result is the one a build with this run's options writes); so may
    ``--sniff`` (a base built without reading objects has nothing to reuse, and every object is
    read).

    Raises :class:`ConfigError` (the base is the output), :class:`DatasetError` (no complete
    manifest of this format) or :class:`ManifestError` naming the option, the base's value and
    this run's."""
    base, out, src = (storage.normalize(u) for u in (cfg.base or "", cfg.output, cfg.input))
    if base == out:
        raise ConfigError(
            f"--base {base} is the --output: write the new version to another --output (the base's "
            "manifest is read while the new one is written)"
        )
    marker_uri = manifest_marker_uri(base)
    if not storage.exists(marker_uri):
        raise DatasetError(
            f"--base {base} holds no complete manifest: {marker_uri} is missing (a manifest job that "
            "did not finish, or not a dataset); give a dataset the manifest job completed"
        )
    try:
        marker = read_manifest_info(base)
    except DatasetError as exc:
        raise DatasetError(f"--base {base}: {exc}; or build without --base") from None
    if marker.input != src:
        raise ManifestError(
            f"--base {base} is a manifest of --input {marker.input}, not of --input {src}: "
            "a base must be an earlier manifest of the same lake"
        )
    _check_label_source(cfg, base, marker)
    _check_split(cfg, base, marker)
    return marker


def _check_label_source(cfg: ManifestConfig, base: str, marker: ManifestInfo) -> None:
    """The base took its labels from the same kind of source as this run (:func:`_label_kind`)."""
    table = marker.labels_table
    old_labels = storage.normalize(table.uri) if table is not None and table.uri else None
    new_labels = cfg.labels or cfg.input_manifest
    old = _label_source(marker.label_depth, old_labels, table.label_attribute if table else None)
    new = _label_source(
        cfg.label_depth, storage.normalize(new_labels) if new_labels else None, cfg.label_attribute
    )
    if _label_kind(marker.label_depth, table is not None) != _label_kind(cfg.label_depth, bool(new_labels)):
        raise ManifestError(
            f"--base {base} took its labels from {old}, this run from {new}: objects would change "
            "class; use the base's label source or build without --base"
        )


def _check_split(cfg: ManifestConfig, base: str, marker: ManifestInfo) -> None:
    """The base was split with this run's split options (:data:`SPLIT_OPTIONS`)."""
    for name, flag in SPLIT_OPTIONS.items():
        was, now = getattr(marker, name), getattr(cfg, name)
        if name == "split":  # the marker's keys are sorted: its order is split_order
            order = marker.split_order or list(now)  # older markers did not record it
            was = {c: was[c] for c in order if c in was} if set(order) == set(was) else was
            now = dict(now)
        same = list(was.items()) == list(now.items()) if isinstance(was, dict) else was == now
        if not same:
            show = _split_text if name == "split" else str
            raise ManifestError(
                f"--base {base} was split with {flag} {show(was)}, this run with {flag} {show(now)}: "
                f"a different split moves objects between channels, which --base promises not to "
                f"do; use the base's {flag} or build without --base"
            )


@dataclass(frozen=True, kw_only=True)
class BaseJoin(BucketJoin):
    """What every task of the join with the base needs: the base's root and number of parts,
    whether objects are read at all (``--sniff``), the staging folder and the key buckets; and
    what the summary says of the base's identity: its fingerprint and how many objects it
    listed."""

    root: str
    parts: int
    sniff: bool
    fingerprint: str
    objects: int


def stage_base(parts: list[int], *, join: BaseJoin) -> list[int]:
    """Stage the rows of the base's ``all`` parts ``parts`` by key bucket; return how many."""
    schema = pa.schema([MANIFEST_SCHEMA.field(c) for c in _BASE_COLUMNS])
    n = 0
    for part in parts:
        try:
            rows = table_rows(read_part(manifest_part_uri(join.root, "all", part, join.parts), _BASE_COLUMNS))
        except DatasetError as exc:  # missing or damaged: name the option it came from
            raise DatasetError(f"--base {join.root}: {exc}; or build without --base") from None
        by_bucket: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            by_bucket.setdefault(hash_bucket(r["key"], join.buckets), []).append(r)
        for bucket, mine in by_bucket.items():
            write_part(
                storage.join(join.folder("base", bucket), f"part-{part:05d}.parquet"),
                pa.Table.from_pylist(mine, schema=schema),
                durable=False,
            )
        n += len(rows)
    return [n]


def stage_both(groups: list[list[int | PartSlice]], *, join: BaseJoin) -> list[int]:
    """Steps 1 and 2 in one task: the items of ``groups`` are parts of the base (a number:
    :func:`stage_base`) and slices of the listed rows (:func:`jobs.manifest_steps.label_tasks.stage_keys`);
    return how many rows of each were staged."""
    items = [item for group in groups for item in group]
    return [
        *stage_base([i for i in items if isinstance(i, int)], join=join),
        *stage_keys([i for i in items if isinstance(i, PartSlice)], join=join),
    ]


def _s3(row: StagedRow) -> bool:
    return not storage.is_local(str(row["uri"]))


def _unchanged(row: StagedRow, old: StagedRow) -> bool:
    """The listed ``row`` is the object the base listed as ``old``: same size and ETag on S3;
    same size and modification time locally (a local file's ETag is known only once read)."""
    if row["size"] != old["size"]:
        return False
    if _s3(row):
        return row["etag"] is not None and row["etag"] == old["etag"]
    return row["last_modified"] is not None and row["last_modified"] == old["last_modified"]


def _reuse(row: StagedRow, old: StagedRow) -> bool:
    """Give the unchanged, listed ``row`` the outcome of the base's header read of it, if the
    base records one it can be rebuilt from; return whether it did. Not reused: an object whose
    listing states no MD5 of its bytes (an S3 multipart upload, a composite GCS object, an Azure
    blob committed from blocks without a Content-MD5: its content hash is of the bytes, not in
    the manifest), a local row the base has no ETag for, a base row rejected for anything but
    its read (no label, say), an accepted base row without a format (the base did not read
    objects)."""
    kind = reason_kind(old["reason"] or "")
    accepted = (old["status"] == "ok" or kind == DUPLICATE) and old[
        "format"
    ] is not None  # dedupe came after the read
    if not (accepted or (old["status"] != "ok" and kind in _READ_REJECTS)):
        return False
    if _s3(row) and row.get("content") is None:  # no MD5 listed: only a read gives the content
        return False
    if not _s3(row):  # a local file's ETag, the MD5 of its bytes, is known once read: the base's
        if old["etag"] is None:
            return False
        row["etag"] = row["content"] = old["etag"]
    if accepted:
        row["format"] = old["format"]
    else:
        reject(row, old["reason"])
    row["reused"] = True
    return True


@dataclass(frozen=True, slots=True)
class JoinCounts:
    """What :func:`inspect_bucket` hands back for its key buckets, merged by :meth:`merge`: the
    listed rows (``rows``), of which ``new``, ``changed`` and ``unchanged``, of those ``reused``
    (not read again); those whose label is not the base's (``relabelled``, the first few); the
    base's rows not listed (``left``, the first few keys)."""

    rows: int
    new: int
    changed: int
    unchanged: int
    reused: int
    relabelled: int
    relabelled_examples: tuple[KeyChange, ...]
    left: int
    left_examples: tuple[str, ...]

    @classmethod
    def merge(cls, results: Sequence[JoinCounts]) -> JoinCounts:
        relabelled = sorted((e for r in results for e in r.relabelled_examples), key=lambda e: e.key)
        return cls(
            rows=sum(r.rows for r in results),
            new=sum(r.new for r in results),
            changed=sum(r.changed for r in results),
            unchanged=sum(r.unchanged for r in results),
            reused=sum(r.reused for r in results),
            relabelled=sum(r.relabelled for r in results),
            relabelled_examples=tuple(relabelled[:EXAMPLES]),
            left=sum(r.left for r in results),
            left_examples=tuple(sorted(k for r in results for k in r.left_examples)[:EXAMPLES]),
        )

    @property
    def inspected(self) -> int:
        """The listed objects whose headers were read."""
        return self.new + self.changed + self.unchanged - self.reused


def inspect_bucket(buckets: list[int], *, join: BaseJoin, plan: PassPlan) -> list[JoinCounts]:
    """Step 3 and the header reads in one task: for each key bucket, join the listed rows with
    the base's (see the module docstring), then inspect them (but those the base gave) and
    stage them by content bucket (:func:`jobs.manifest_steps.passes.inspect_rows`). Returns each
    bucket's counts, with the first :data:`~jobs.manifest_steps.passes.EXAMPLES` of each kind."""
    out = []
    for bucket in buckets:
        rows = read_staged(join.folder("keys", bucket))
        base = {r["key"]: r for r in read_staged(join.folder("base", bucket))}
        counts = Counter[str]()
        relabelled = []
        for r in rows:
            old = base.get(r["key"])
            if old is None:
                counts["new"] += 1
                continue
            if None not in (r["label"], old["label"]) and r["label"] != old["label"]:
                relabelled.append(KeyChange(r["key"], old["label"], r["label"]))
            r["base_channel"] = old["channel"] if old["status"] == "ok" else None
            if not _unchanged(r, old):
                counts["changed"] += 1
                continue
            counts["unchanged"] += 1
            if join.sniff and r["status"] == "ok" and _reuse(r, old):
                counts["reused"] += 1
        if rows:
            inspect_rows(rows, f"part-key-{bucket:05d}.parquet", plan=plan)
        listed = {r["key"] for r in rows}
        left = sorted(k for k in base if k not in listed)
        relabelled.sort(key=lambda e: e.key)
        out.append(
            JoinCounts(
                rows=len(rows),
                new=counts["new"],
                changed=counts["changed"],
                unchanged=counts["unchanged"],
                reused=counts["reused"],
                relabelled=len(relabelled),
                relabelled_examples=tuple(relabelled[:EXAMPLES]),
                left=len(left),
                left_examples=tuple(left[:EXAMPLES]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class BaseReport:
    """What ``_manifest.json`` says under ``base``: the base's identity (root, fingerprint,
    objects), the join's counts, and the objects now in another channel than in the base."""

    join: BaseJoin
    counts: JoinCounts
    classes: ClassParts

    def summary(self) -> BaseSummary:
        c, moved = self.counts, self.classes
        return BaseSummary(
            root=self.join.root,
            fingerprint=self.join.fingerprint,
            objects=self.join.objects,
            unchanged=c.unchanged,
            reused=c.reused,
            new=c.new,
            changed=c.changed,
            left=c.left,
            relabelled=c.relabelled,
            inspected=c.inspected,
            left_examples=list(c.left_examples),
            relabelled_examples=[e.to_json() for e in c.relabelled_examples],
            moved=moved.moved,
            moved_examples=[e.to_json() for e in moved.moved_examples],
        )


def stage_join(engine: Engine, join: BaseJoin, slices: list[PartSlice], partitions: int) -> None:
    """Steps 1 and 2 on ``engine``, in one action of at most ``partitions`` tasks: the base's
    parts (``join.objects`` rows in all) and ``slices`` of the listed rows, shared by rows
    (:func:`jobs.common.tasks.pack`)."""
    items: list[int | PartSlice] = [*range(join.parts), *slices]
    sizes = [-(-join.objects // join.parts)] * join.parts + [s.stop - s.start for s in slices]
    groups = pack(items, sizes, partitions)
    engine.map_partitions(partial(stage_both, join=join), groups, partitions=len(groups))


def join_and_inspect(engine: Engine, join: BaseJoin, plan: PassPlan, partitions: int) -> JoinCounts:
    """Step 3 with the header reads on ``engine`` (:func:`inspect_bucket`, the key buckets in
    ``partitions`` tasks); return the join's counts."""
    results = engine.map_partitions(
        partial(inspect_bucket, join=join, plan=plan),
        list(range(join.buckets)),
        partitions=min(join.buckets, partitions),
    )
    return JoinCounts.merge(results)
