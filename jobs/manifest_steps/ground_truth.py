"""A SageMaker Ground Truth augmented manifest as the lake and its labels (``--input-manifest``).

Ground Truth writes one JSON object a line: ``source-ref`` (the object's ``s3://`` URI), the
label attribute the labelling job was given (``--label-attribute``) and ``<attribute>-metadata``::

    {"source-ref": "s3://lake/raw/0001.jpg", "sport": 0,
     "sport-metadata": {"class-name": "football", "type": "groundtruth/image-classification", ...}}

The label is the class *name*: the metadata's ``class-name``, else its ``class-map`` entry for
the attribute's value, else the value itself if it is text (:func:`jobs.manifest_steps.ground_truth_lines.label_of`), without
surrounding white space; values become text as a ``--labels`` table's do
(:func:`jobs.manifest_steps.labels.value_text`: the index ``0.0`` is the ``class-map`` entry ``"0"``). A line without
the attribute (a worker or the job failed: the metadata holds only ``failure-reason``) labels
nothing: its object is a reject whose reason says so. Multi-label classification (a list of
class indices) and bounding boxes (``annotations`` of ``class_id``, ``left``, ``top``, ``width``,
``height``; ``image_size``; each box's ``confidence`` from the metadata's ``objects``) are read
with ``--task multi-label`` and ``--task boxes``
(:func:`jobs.manifest_steps.ground_truth_lines.set_label_of`: a class index the ``class-map``
does not name, or a malformed box, rejects the object with the reason); a line of another task
type is refused.

The listed objects are the manifest's ``source-ref``s under ``--input`` (keys relative to it),
not a listing of ``--input``. Two passes on the workers, no row on the driver:

1. :func:`stage_lines` (one item per byte range of the manifest; a line belongs to the range
   its first byte is in): parse each line, stage ``(key, label, reason)`` by
   :func:`lakeshard.format.manifest_table.hash_bucket` of the key; count the lines outside ``--input`` and
   the lines that are not a single-label classification (the driver fails on those).
2. :func:`resolve_task` (one item per key bucket): give each key one label (a key labelled two
   ways is counted, and the driver fails before any image is read), read each object's size,
   ETag and modification time (one HEAD each, concurrently), count the keys whose object does
   not exist, and stage the rows as the listing parts the header-reading pass reads.

:func:`jobs.manifest_steps.ground_truth_lines.check_input_manifest` checks the first lines on the driver before an engine starts.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, cast

import pyarrow as pa

from jobs.common.engines import Engine
from jobs.manifest_steps.ground_truth_lines import (
    TASK_LINES,
    LineLabel,
    UnsupportedLine,
    key_under,
    parse_line,
    parse_set_line,
)
from jobs.manifest_steps.json_lines import json_lines
from jobs.manifest_steps.label_sets import KeyLabels, combine
from jobs.manifest_steps.label_tasks import Conflict, conflicts_text
from jobs.manifest_steps.listing import LabelledRow, Skip, _row, reject
from jobs.manifest_steps.passes import (
    EXAMPLES,
    Listing,
    SkippedObject,
    StagedPart,
    read_staged,
    skip_kind,
    staged_schema,
    write_staged,
)
from jobs.manifest_steps.table_values import TableColumns
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError
from lakeshard.format import BOX_TYPE, LabelsTable
from lakeshard.format.label_columns import SINGLE_LABEL
from lakeshard.format.manifest_table import hash_bucket, write_part

__all__ = [
    "ByteRange",
    "GroundTruthSource",
    "Resolved",
    "StagedLines",
    "read_manifest",
    "resolve_task",
    "stage_lines",
]

log = logging.getLogger(__name__)

#: The manifest is cut into byte ranges of about ``--rows-per-part`` lines of this many bytes.
_LINE_BYTES = 256
_IO_THREADS = 16  # HEAD requests are latency-bound; threads overlap them
_LINE_SCHEMA = pa.schema([("key", pa.string()), ("label", pa.string()), ("reason", pa.string())])
#: A staged line of a multi-label or bounding-box manifest: its classes, boxes and problem too.
_SET_LINE_SCHEMA = (
    _LINE_SCHEMA.append(pa.field("labels", pa.list_(pa.string())))
    .append(pa.field("boxes", pa.list_(BOX_TYPE)))
    .append(pa.field("problem", pa.string()))
)


@dataclass(frozen=True)
class GroundTruthSource:
    """What every task needs: the manifest, the label attribute, the input (keys are relative
    to it), the skip rules, the staging folder and the number of key buckets."""

    uri: str
    attribute: str
    root: str
    skip: Skip
    staging: str
    buckets: int
    task: str = SINGLE_LABEL  #: ``--task``: what a line's label attribute holds

    def folder(self, bucket: int) -> str:
        return storage.join(self.staging, "lines", f"b={bucket:05d}")

    def labelled(self, bucket: int) -> str:
        return storage.join(self.staging, "labelled", f"part-{bucket:05d}.parquet")


def _lines(uri: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line)`` of each line of ``uri`` that starts in ``[start, end)`` (the
    last one read past ``end`` to its newline)."""
    fs, path = storage.filesystem(uri)
    size = fs.size(path)
    lo = max(0, start - 1)  # a line starts at `start` if the byte before it is a newline
    data = fs.cat_file(path, start=lo, end=min(end, size))
    pos = 0 if start == 0 else data.find(b"\n") + 1
    if start and pos == 0:
        return  # no newline in the range: no line starts in it
    read = lo + len(data)
    while not data.endswith(b"\n") and read < size:  # complete the last line
        more = fs.cat_file(path, start=read, end=min(read + 65536, size))
        cut = more.find(b"\n")
        data += more if cut < 0 else more[: cut + 1]
        read += len(more)
        if cut >= 0:
            break
    while pos < len(data) and lo + pos < end:
        stop = data.find(b"\n", pos)
        stop = len(data) if stop < 0 else stop
        yield lo + pos, data[pos:stop]
        pos = stop + 1


@dataclass(frozen=True, slots=True)
class StagedLines:
    """What :func:`stage_lines` hands back for its byte ranges, merged by :meth:`merge`: the
    lines, those naming an object outside ``--input`` (the first few URIs, sorted) and those
    that are not a single-label classification (the first few, in the manifest's order)."""

    lines: int
    outside: int
    outside_examples: tuple[str, ...]
    bad: int
    bad_examples: tuple[str, ...]

    @classmethod
    def merge(cls, parts: Sequence[StagedLines]) -> StagedLines:
        return cls(
            lines=sum(p.lines for p in parts),
            outside=sum(p.outside for p in parts),
            outside_examples=tuple(sorted(u for p in parts for u in p.outside_examples)[:EXAMPLES]),
            bad=sum(p.bad for p in parts),
            bad_examples=tuple(e for p in parts for e in p.bad_examples)[:EXAMPLES],
        )


class ByteRange(NamedTuple):
    """Bytes ``start`` to ``end`` (excluded) of the manifest: a task reads the lines starting there."""

    start: int
    end: int


def stage_lines(ranges: list[ByteRange], *, source: GroundTruthSource) -> list[StagedLines]:
    """Parse the lines starting in each byte range of the manifest; stage ``(key, label,
    reason)`` by key bucket. Returns, per range, its counts."""
    return [_stage_range(source, r.start, r.end) for r in ranges]


def _stage_range(source: GroundTruthSource, start: int, end: int) -> StagedLines:
    try:
        found = list(_lines(source.uri, start, end))
    except Exception as exc:
        raise StorageError(
            f"cannot read --input-manifest {source.uri} bytes {start}-{end}: {type(exc).__name__}: {exc}"
        ) from exc
    by_bucket: dict[int, list[dict[str, Any]]] = defaultdict(list)
    outside: list[str] = []
    bad: list[str] = []

    def refuse(offset: int, why: Exception) -> None:
        bad.append(f"the line at byte {offset}: {why}")

    for offset, record in json_lines(found, on_error=lambda exc: refuse(exc.at, exc)):
        try:
            uri, row = _line_row(record, source)
        except UnsupportedLine as exc:
            refuse(offset, exc)
            continue
        if (key := key_under(uri, source.root)) is None:
            outside.append(uri)
            continue
        by_bucket[hash_bucket(key, source.buckets)].append({"key": key, **row})
    schema = _LINE_SCHEMA if source.task == SINGLE_LABEL else _SET_LINE_SCHEMA
    for bucket, rows in by_bucket.items():
        write_part(
            storage.join(source.folder(bucket), f"part-{start:015d}.parquet"),
            pa.Table.from_pylist(rows, schema=schema),
            durable=False,
        )
    return StagedLines(
        lines=sum(1 for _, line in found if line.strip()),
        outside=len(outside),
        outside_examples=tuple(sorted(outside)[:EXAMPLES]),
        bad=len(bad),
        bad_examples=tuple(bad[:EXAMPLES]),
    )


def _line_row(record: dict[str, Any], source: GroundTruthSource) -> tuple[str, dict[str, Any]]:
    """A line's object and what is staged of it: its class name (or the reason it has none),
    or with a ``--task`` beyond one class its classes, boxes and problem."""
    if source.task == SINGLE_LABEL:
        line = parse_line(record, source.attribute)
        return line.uri, {"label": line.label, "reason": line.reason}
    uri, got = parse_set_line(record, source.attribute, source.task)
    if isinstance(got, LineLabel):  # a failed line: no attribute
        return uri, {"label": None, "reason": got.reason}
    return uri, {"label": None, "reason": None, **got._asdict()}


def _head(fs: Any, path: str) -> dict[str, Any] | None:
    """The object's info (size, ETag, modification time), or None if there is no object."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except Exception as exc:  # the platform, not the object: never a silent reject
        raise StorageError(f"cannot read the object {path}: {type(exc).__name__}: {exc}") from exc
    return info if info.get("type") == "file" else None


@dataclass(frozen=True, slots=True)
class Resolved:
    """What :func:`resolve_task` hands back for its key buckets, merged by :meth:`merge`: the
    labelled rows' staged parts and labels; the objects whose line has no label (``unlabelled``,
    rejected); the source-refs naming no object (``missing``, the first few keys); the hidden
    and excluded keys (``skipped`` by kind, the first few); the keys labelled two ways (the
    first few of each bucket)."""

    parts: tuple[StagedPart, ...]
    labels: tuple[str, ...]
    unlabelled: int
    missing: int
    missing_examples: tuple[str, ...]
    skipped: Counter[str]
    skipped_examples: tuple[SkippedObject, ...]
    conflicts: int
    conflict_examples: tuple[Conflict, ...]

    @classmethod
    def merge(cls, results: Sequence[Resolved]) -> Resolved:
        skipped = Counter[str]()
        for r in results:
            skipped.update(r.skipped)
        return cls(
            parts=tuple(sorted(p for r in results for p in r.parts)),
            labels=tuple(sorted({x for r in results for x in r.labels})),
            unlabelled=sum(r.unlabelled for r in results),
            missing=sum(r.missing for r in results),
            missing_examples=tuple(sorted(k for r in results for k in r.missing_examples)[:EXAMPLES]),
            skipped=skipped,
            skipped_examples=tuple(sorted(e for r in results for e in r.skipped_examples)[:EXAMPLES]),
            conflicts=sum(r.conflicts for r in results),
            conflict_examples=tuple(e for r in results for e in r.conflict_examples),
        )


def resolve_task(buckets: list[int], *, source: GroundTruthSource) -> list[Resolved]:
    """For each key bucket: one label per key (identical lines of a key are one; a failed line
    beside a labelled one is ignored; two labels are a conflict), skip hidden and excluded keys,
    HEAD each other object, stage its row (accepted, or rejected with the line's reason).
    Returns each bucket's counts. A bucket with a conflict reads no object."""
    fs, root_path = storage.filesystem(source.root)
    out = []
    for bucket in buckets:
        given: dict[str, set[str]] = defaultdict(set)
        failed: dict[str, str] = {}
        sets: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for line in read_staged(source.folder(bucket)):
            if line["label"] is not None:
                given[line["key"]].add(line["label"])
            elif line["reason"] is None:  # a line of classes or boxes: each key's lines together
                sets[line["key"]].append({**line, "channel": None})
                given[line["key"]].add("")
            else:
                failed.setdefault(line["key"], line["reason"])
        if conflicts := sorted(k for k, v in given.items() if len(v) > 1):
            out.append(
                Resolved(
                    parts=(),
                    labels=(),
                    unlabelled=0,
                    missing=0,
                    missing_examples=(),
                    skipped=Counter(),
                    skipped_examples=(),
                    conflicts=len(conflicts),
                    conflict_examples=tuple(
                        Conflict(k, tuple(sorted(given[k]))) for k in conflicts[:EXAMPLES]
                    ),
                )
            )
            continue
        labelled = {k: combine(v, TableColumns(task=source.task)) for k, v in sets.items()}
        out.append(_resolve_bucket(source, bucket, fs, root_path, given, failed, labelled))
    return out


def _resolve_bucket(
    source: GroundTruthSource,
    bucket: int,
    fs: Any,
    root_path: str,
    given: dict[str, set[str]],
    failed: dict[str, str],
    labelled: dict[str, KeyLabels],
) -> Resolved:
    """One key bucket with no conflict: its objects HEADed, labelled (or rejected) and staged
    (``labelled``: the classes or boxes of a ``--task`` beyond one class)."""
    rows = [
        _row(source.root, root_path, {"name": f"{root_path}/{k}", "size": 0}, 0, source.skip)
        for k in sorted(set(given) | set(failed))
    ]
    skipped = [r for r in rows if r["status"] == "skipped"]
    todo = [r for r in rows if r["status"] == "ok"]
    with ThreadPoolExecutor(max_workers=max(1, min(_IO_THREADS, len(todo)))) as pool:
        infos = list(pool.map(partial(_head, fs), [f"{root_path}/{r['key']}" for r in todo]))
    missing = sorted(r["key"] for r, info in zip(todo, infos) if info is None)
    found = {
        r["key"]: _row(source.root, root_path, {**info, "name": f"{root_path}/{r['key']}"}, 0, source.skip)
        for r, info in zip(todo, infos)
        if info is not None
    }
    staged = [found.get(r["key"], r) for r in rows if r["status"] == "rejected" or r["key"] in found]
    unlabelled = 0
    for r in staged:
        if r["status"] != "ok":
            continue
        if r["key"] in labelled:
            labelled[r["key"]].apply(cast(LabelledRow, r), source.task)
        elif r["key"] in given:
            r["label"] = next(iter(given[r["key"]]))
        else:
            reject(r, failed[r["key"]])
            unlabelled += 1
    write_staged(staged, source.labelled(bucket), staged_schema(source.task))
    names = {x for k in labelled.values() for x in k.labels or ()}
    return Resolved(
        parts=(StagedPart(source.labelled(bucket), len(staged)),) if staged else (),
        labels=tuple(sorted(names | {r["label"] for r in staged if r["label"] is not None})),
        unlabelled=unlabelled,
        missing=len(missing),
        missing_examples=tuple(missing[:EXAMPLES]),
        skipped=Counter(skip_kind(r["reason"]) for r in skipped),
        skipped_examples=tuple(sorted(SkippedObject(r["key"], r["reason"]) for r in skipped)[:EXAMPLES]),
        conflicts=0,
        conflict_examples=(),
    )


def _ranges(size: int, pieces: int) -> list[ByteRange]:
    step = max(1, math.ceil(size / pieces))
    return [ByteRange(a, min(a + step, size)) for a in range(0, size, step)]


def read_manifest(
    engine: Engine,
    *,
    uri: str,
    attribute: str,
    root: str,
    skip: Skip,
    rows_per_part: int,
    staging: str,
    task: str = SINGLE_LABEL,
) -> Listing:
    """The objects of the Ground Truth manifest at ``uri`` under ``root``, labelled, as staged
    listing parts (the two passes above). Raises :class:`ManifestError`, before any image is
    read, naming the lines that are not a single-label classification or the keys labelled two
    different ways."""
    uri, root = storage.normalize(uri), storage.normalize(root)
    fs, path = storage.filesystem(uri)
    size = fs.size(path)
    pieces = max(1, math.ceil(size / (rows_per_part * _LINE_BYTES)))
    source = GroundTruthSource(
        uri=uri,
        attribute=attribute,
        root=root,
        skip=skip,
        staging=storage.join(staging, "ground-truth"),
        buckets=pieces,
        task=task,
    )
    ranges = _ranges(size, pieces)
    log.info("reading --input-manifest %s (%d bytes) in %d ranges on %s", uri, size, len(ranges), engine.name)
    staged = StagedLines.merge(
        engine.map_partitions(partial(stage_lines, source=source), ranges, partitions=len(ranges))
    )
    if staged.bad:
        raise ManifestError(
            f"--input-manifest {uri}: {staged.bad} line(s) are not {TASK_LINES[task]} "
            f"with --label-attribute {attribute!r}; e.g. {staged.bad_examples[0]}"
        )
    if not staged.lines:
        raise ManifestError(f"--input-manifest {uri} has no lines")
    resolved = Resolved.merge(
        engine.map_partitions(
            partial(resolve_task, source=source), list(range(source.buckets)), partitions=source.buckets
        )
    )
    if resolved.conflicts:
        raise ManifestError(
            f"--input-manifest {uri} labels {resolved.conflicts} key(s) in two different ways "
            f"(e.g. {conflicts_text(resolved.conflict_examples)}); give each source-ref one class "
            "(repeating an identical line is fine)"
        )
    if staged.outside:
        log.warning(
            "%d lines of --input-manifest %s name an object outside --input %s (e.g. %s)",
            staged.outside,
            uri,
            root,
            ", ".join(staged.outside_examples),
        )
    if resolved.missing:
        log.warning(
            "%d source-refs of --input-manifest %s name no object (e.g. %s)",
            resolved.missing,
            uri,
            ", ".join(resolved.missing_examples),
        )
    return Listing(
        parts=resolved.parts,
        classes=max(1, len(resolved.labels)),
        skipped=resolved.skipped,
        skipped_examples=resolved.skipped_examples,
        labels_table=_summary(uri, attribute, staged, resolved),
    )


def _summary(uri: str, attribute: str, staged: StagedLines, resolved: Resolved) -> LabelsTable:
    """What ``_manifest.json`` says of the manifest (``labels_table``)."""
    examples = sorted([*resolved.missing_examples, *staged.outside_examples])[:EXAMPLES]
    return LabelsTable(
        uri=uri,
        format="sagemaker-ground-truth",
        label_attribute=attribute,
        files=1,
        rows=staged.lines,
        unlabelled=resolved.unlabelled,
        pinned=0,
        not_in_lake=resolved.missing + staged.outside,
        not_in_lake_examples=examples,
        missing_objects=resolved.missing,
        outside_input=staged.outside,
        outside_input_examples=list(staged.outside_examples),
        conflicts=0,
        conflict_examples=[],
    )
