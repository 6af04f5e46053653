"""A SageMaker Ground Truth augmented manifest as the lake and its labels (``--input-manifest``).

Ground Truth writes one JSON object a line: ``source-ref`` (the object's ``s3://`` URI), the
label attribute the labelling job was given (``--label-attribute``) and ``<attribute>-metadata``::

    {"source-ref": "s3://lake/raw/0001.jpg", "sport": 0,
     "sport-metadata": {"class-name": "football", "type": "groundtruth/image-classification", ...}}

The label is the class *name*: the metadata's ``class-name``, else its ``class-map`` entry for
the attribute's value, else the value itself if it is text (:func:`label_of`), without
surrounding white space; values become text as a ``--labels`` table's do
(:func:`jobs.manifest_steps.labels.value_text`: the index ``0.0`` is the ``class-map`` entry ``"0"``). A line without
the attribute (a worker or the job failed: the metadata holds only ``failure-reason``) labels
nothing: its object is a reject whose reason says so. Multi-label classification (a list of
classes), bounding boxes and other task types are refused.

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

:func:`check_input_manifest` checks the first lines on the driver before an engine starts.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.engines import Engine
from jobs.manifest_steps.labels import value_text
from jobs.manifest_steps.listing import Skip, _row, reject
from jobs.manifest_steps.passes import EXAMPLES, read_staged, skip_kind, write_staged
from lakeshard import storage
from lakeshard.errors import ManifestError, StorageError
from lakeshard.format.manifest_table import hash_bucket, write_part

__all__ = ["CHECK_LINES", "GroundTruth", "Source", "check_input_manifest", "label_of", "read_manifest",
           "resolve_task", "stage_lines"]

log = logging.getLogger(__name__)

#: Lines of the manifest checked on the driver before an engine starts.
CHECK_LINES = 1000
#: The manifest is cut into byte ranges of about ``--rows-per-part`` lines of this many bytes.
_LINE_BYTES = 256
_IO_THREADS = 16  # HEAD requests are latency-bound; threads overlap them
_LINE_SCHEMA = pa.schema([("key", pa.string()), ("label", pa.string()), ("reason", pa.string())])


class _Unsupported(ValueError):
    """A line that is not a single-label classification (the caller names where it is)."""


def label_of(record: dict[str, Any], attribute: str) -> tuple[str | None, str | None]:
    """``(label, None)``, or ``(None, reject reason)`` for a line without the attribute.

    Raises ``ValueError`` (with no location: the caller adds it) for a value that is not one
    class: a list (multi-label), an object (bounding boxes, ...), an index with no class name."""
    meta = record.get(f"{attribute}-metadata")
    meta = meta if isinstance(meta, dict) else {}
    value = record.get(attribute)
    if value is None:
        failure = meta.get("failure-reason")
        why = f" (failure-reason: {failure})" if failure else ""
        return None, f"no label: the line has no {attribute!r} in --input-manifest{why}"
    kind = str(meta.get("type", ""))
    if isinstance(value, list) or kind.endswith("multilabel"):
        raise _Unsupported(f"{attribute!r} is {value!r:.80} ({kind or 'a list'}): multi-label classification is not "
                           "supported (each object needs exactly one class)")
    if isinstance(value, (dict, bool)):
        raise _Unsupported(f"{attribute!r} is {value!r:.80}{f' ({kind})' if kind else ''}: not an image "
                           "classification label (one class index or name)")
    try:  # a value and a class name become text as a --labels table's do (0.0 is the class index "0")
        text = value_text(value)
        name = value_text(meta.get("class-name"))
    except ValueError as exc:
        raise _Unsupported(f"{attribute!r} or its class-name is {exc}: not one class") from None
    if name is None and isinstance(meta.get("class-map"), dict):
        name = meta["class-map"].get(text)
    if name is None and isinstance(value, str):
        name = value
    if not isinstance(name, str) or not name.strip():
        raise _Unsupported(f"{attribute!r} is {value!r:.80} but {attribute}-metadata gives no class-name for it "
                           f"(got {meta.get('class-name', meta.get('class-map'))!r:.80})")
    name = name.strip()
    return name, None


def _record(line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise _Unsupported(f"not JSON ({exc}): {line[:80]!r}") from None
    if not isinstance(record, dict):
        raise _Unsupported(f"not a JSON object: {line[:80]!r}")
    return record


def _parse(record: dict[str, Any], attribute: str) -> tuple[str, str | None, str | None]:
    """``(source-ref URI, label, reject reason)`` of one manifest line."""
    ref = record.get("source-ref")
    if not isinstance(ref, str) or not ref.startswith(("s3://", "file://")):
        raise _Unsupported(f"source-ref is {ref!r:.120}, not an s3:// (or file://) URI")
    try:
        uri = storage.normalize(ref)
    except StorageError as exc:
        raise _Unsupported(f"source-ref {ref!r}: {exc}") from None
    return (uri, *label_of(record, attribute))


def _key(uri: str, root: str) -> str | None:
    """``uri``'s key relative to ``root``, or None if it is not under ``root``."""
    under = root.rstrip("/") + "/"
    return uri[len(under):] if uri.startswith(under) else None


def check_input_manifest(uri: str, *, attribute: str, root: str) -> int:
    """Check the first :data:`CHECK_LINES` lines of the manifest at ``uri`` (before an engine
    starts); return how many were read. Raises :class:`ManifestError` naming the URI, the line
    number and the value: a missing or empty manifest, a line that is not a JSON object with an
    ``s3://`` ``source-ref``, a label that is not one class; none of those lines having
    ``attribute`` (a misspelt ``--label-attribute``), or none being under ``root``."""
    uri, root = storage.normalize(uri), storage.normalize(root)
    fs, path = storage.filesystem(uri)
    seen: set[str] = set()
    under = n = 0
    try:
        if not fs.isfile(path):
            raise ManifestError(f"--input-manifest {uri} does not exist (give the output.manifest file of a "
                                "Ground Truth labelling job)")
        with fs.open(path, "rb") as f:
            for line in f:
                n += 1
                if n > CHECK_LINES:
                    n -= 1
                    break
                if not line.strip():
                    continue
                try:
                    record = _record(line)
                    ref, _, _ = _parse(record, attribute)
                except _Unsupported as exc:
                    raise ManifestError(f"--input-manifest {uri}: line {n}: {exc}") from None
                seen.update(record.keys())
                under += _key(ref, root) is not None
    except (ManifestError, StorageError):
        raise
    except Exception as exc:
        raise StorageError(f"cannot read --input-manifest {uri}: {type(exc).__name__}: {exc}") from exc
    if not seen:
        raise ManifestError(f"--input-manifest {uri} has no lines")
    if attribute not in seen and f"{attribute}-metadata" not in seen:
        names = sorted(k for k in seen if k != "source-ref" and not k.endswith("-metadata"))
        raise ManifestError(f"--label-attribute {attribute!r}: none of the first {n} line(s) of --input-manifest {uri} "
                            f"has it (their label attributes: {names})")
    if not under:
        raise ManifestError(f"--input-manifest {uri}: none of the first {n} line(s) names an object under --input "
                            f"{root} (give as --input the prefix every source-ref is under)")
    return n


@dataclass(frozen=True)
class Source:
    """What every task needs: the manifest, the label attribute, the input (keys are relative
    to it), the skip rules, the staging folder and the number of key buckets."""

    uri: str
    attribute: str
    root: str
    skip: Skip
    staging: str
    buckets: int

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
        data += more if cut < 0 else more[:cut + 1]
        read += len(more)
        if cut >= 0:
            break
    while pos < len(data) and lo + pos < end:
        stop = data.find(b"\n", pos)
        stop = len(data) if stop < 0 else stop
        yield lo + pos, data[pos:stop]
        pos = stop + 1


def stage_lines(ranges: list[tuple[int, int]], *, source: Source) -> list[dict[str, Any]]:
    """Parse the lines starting in each byte range ``(start, end)`` of the manifest; stage
    ``(key, label, reason)`` by key bucket. Returns per range: its lines, those outside
    ``--input`` and those that are not a single-label classification (counts, first few)."""
    out = []
    for start, end in ranges:
        by_bucket: dict[int, list[dict[str, Any]]] = defaultdict(list)
        lines, outside, bad = 0, [], []
        try:
            found = list(_lines(source.uri, start, end))
        except Exception as exc:
            raise StorageError(f"cannot read --input-manifest {source.uri} bytes {start}-{end}: "
                               f"{type(exc).__name__}: {exc}") from exc
        for offset, line in found:
            if not line.strip():
                continue
            lines += 1
            try:
                ref, label, reason = _parse(_record(line), source.attribute)
            except _Unsupported as exc:
                bad.append(f"the line at byte {offset}: {exc}")
                continue
            if (key := _key(ref, source.root)) is None:
                outside.append(ref)
                continue
            by_bucket[hash_bucket(key, source.buckets)].append({"key": key, "label": label, "reason": reason})
        for bucket, rows in by_bucket.items():
            write_part(storage.join(source.folder(bucket), f"part-{start:015d}.parquet"),
                       pa.Table.from_pylist(rows, schema=_LINE_SCHEMA), durable=False)
        out.append({"lines": lines, "outside": len(outside), "outside_examples": sorted(outside)[:EXAMPLES],
                    "bad": len(bad), "bad_examples": bad[:EXAMPLES]})
    return out


def _head(fs: Any, path: str) -> dict[str, Any] | None:
    """The object's info (size, ETag, modification time), or None if there is no object."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except Exception as exc:  # the platform, not the object: never a silent reject
        raise StorageError(f"cannot read the object {path}: {type(exc).__name__}: {exc}") from exc
    return info if info.get("type") == "file" else None


def resolve_task(buckets: list[int], *, source: Source) -> list[dict[str, Any]]:
    """For each key bucket: one label per key (identical lines of a key are one; a failed line
    beside a labelled one is ignored; two labels are a conflict), skip hidden and excluded keys,
    HEAD each other object, stage its row (accepted, or rejected with the line's reason).
    Returns per-bucket aggregates: rows, labels, unlabelled, missing, skipped and conflicts
    (counts and first few). A bucket with a conflict reads no object."""
    fs, root_path = storage.filesystem(source.root)
    out = []
    for bucket in buckets:
        given: dict[str, set[str]] = defaultdict(set)
        failed: dict[str, str] = {}
        for line in read_staged(source.folder(bucket)):
            if line["label"] is not None:
                given[line["key"]].add(line["label"])
            else:
                failed.setdefault(line["key"], line["reason"])
        conflicts = sorted(k for k, v in given.items() if len(v) > 1)
        result: dict[str, Any] = {"part": source.labelled(bucket), "rows": 0, "labels": [], "unlabelled": 0, "missing": 0, "missing_examples": [],
                                  "skipped": {}, "skipped_examples": [], "conflicts": len(conflicts),
                                  "conflict_examples": [{k: sorted(given[k])} for k in conflicts[:EXAMPLES]]}
        if conflicts:
            out.append(result)
            continue
        rows = [_row(source.root, root_path, {"name": f"{root_path}/{k}", "size": 0}, 0, source.skip)
                for k in sorted(set(given) | set(failed))]
        skipped = [r for r in rows if r["status"] == "skipped"]
        todo = [r for r in rows if r["status"] == "ok"]
        with ThreadPoolExecutor(max_workers=max(1, min(_IO_THREADS, len(todo)))) as pool:
            infos = list(pool.map(partial(_head, fs), [f"{root_path}/{r['key']}" for r in todo]))
        missing = sorted(r["key"] for r, info in zip(todo, infos) if info is None)
        found = {r["key"]: _row(source.root, root_path, {**info, "name": f"{root_path}/{r['key']}"}, 0, source.skip)
                 for r, info in zip(todo, infos) if info is not None}
        staged = [found.get(r["key"], r) for r in rows if r["status"] == "rejected" or r["key"] in found]
        for r in staged:
            if r["status"] != "ok":
                continue
            if r["key"] in given:
                r["label"] = next(iter(given[r["key"]]))
            else:
                reject(r, failed[r["key"]])
                result["unlabelled"] += 1
        write_staged(staged, source.labelled(bucket))
        result.update(rows=len(staged), labels=sorted({r["label"] for r in staged if r["label"] is not None}),
                      missing=len(missing), missing_examples=missing[:EXAMPLES],
                      skipped=dict(Counter(skip_kind(r["reason"]) for r in skipped)),
                      skipped_examples=sorted((r["key"], r["reason"]) for r in skipped)[:EXAMPLES])
        out.append(result)
    return out


@dataclass(frozen=True)
class GroundTruth:
    """The manifest's objects, labelled and staged: the listing parts ``(URI, rows)``, the
    labels, the skipped objects (by kind; first few ``(key, reason)``) and what the summary
    says of the manifest (``labels_table`` in ``_manifest.json``)."""

    parts: list[tuple[str, int]]
    labels: list[str]
    skipped: Counter[str]
    skipped_examples: list[tuple[str, str]]
    summary: dict[str, Any]


def _ranges(size: int, pieces: int) -> list[tuple[int, int]]:
    step = max(1, math.ceil(size / pieces))
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def read_manifest(engine: Engine, *, uri: str, attribute: str, root: str, skip: Skip, rows_per_part: int,
                  staging: str) -> GroundTruth:
    """The objects of the Ground Truth manifest at ``uri`` under ``root``, labelled, as staged
    listing parts (the two passes above). Raises :class:`ManifestError`, before any image is
    read, naming the lines that are not a single-label classification or the keys labelled two
    different ways."""
    uri, root = storage.normalize(uri), storage.normalize(root)
    fs, path = storage.filesystem(uri)
    size = fs.size(path)
    pieces = max(1, math.ceil(size / (rows_per_part * _LINE_BYTES)))
    source = Source(uri=uri, attribute=attribute, root=root, skip=skip, staging=storage.join(staging, "ground-truth"),
                    buckets=pieces)
    ranges = _ranges(size, pieces)
    log.info("reading --input-manifest %s (%d bytes) in %d ranges on %s", uri, size, len(ranges), engine.name)
    staged = engine.map_partitions(partial(stage_lines, source=source), ranges, partitions=len(ranges))
    if bad := sum(s["bad"] for s in staged):
        example = next(e for s in staged for e in s["bad_examples"])
        raise ManifestError(f"--input-manifest {uri}: {bad} line(s) are not a single-label image classification "
                            f"with --label-attribute {attribute!r}; e.g. {example}")
    lines = sum(s["lines"] for s in staged)
    if not lines:
        raise ManifestError(f"--input-manifest {uri} has no lines")
    results = engine.map_partitions(partial(resolve_task, source=source), list(range(source.buckets)),
                                    partitions=source.buckets)
    if conflicts := sum(r["conflicts"] for r in results):
        examples = "; ".join(f"{k!r}: {', '.join(v)}" for r in results for e in r["conflict_examples"]
                             for k, v in e.items())
        raise ManifestError(f"--input-manifest {uri} labels {conflicts} key(s) in two different ways (e.g. {examples}); "
                            "give each source-ref one class (repeating an identical line is fine)")
    outside = sorted(u for s in staged for u in s["outside_examples"])[:EXAMPLES]
    missing = sorted(k for r in results for k in r["missing_examples"])[:EXAMPLES]
    n_outside, n_missing = sum(s["outside"] for s in staged), sum(r["missing"] for r in results)
    if n_outside:
        log.warning("%d lines of --input-manifest %s name an object outside --input %s (e.g. %s)", n_outside, uri,
                    root, ", ".join(outside))
    if n_missing:
        log.warning("%d source-refs of --input-manifest %s name no object (e.g. %s)", n_missing, uri, ", ".join(missing))
    skipped = Counter[str]()
    for r in results:
        skipped.update(r["skipped"])
    summary = {"uri": uri, "format": "sagemaker-ground-truth", "label_attribute": attribute, "files": 1,
               "rows": lines, "unlabelled": sum(r["unlabelled"] for r in results), "pinned": 0,
               "not_in_lake": n_missing + n_outside, "not_in_lake_examples": sorted(missing + outside)[:EXAMPLES],
               "missing_objects": n_missing, "outside_input": n_outside, "outside_input_examples": outside,
               "conflicts": 0, "conflict_examples": []}
    return GroundTruth(parts=sorted((r["part"], r["rows"]) for r in results if r["rows"]),
                       labels=sorted({x for r in results for x in r["labels"]}), skipped=skipped,
                       skipped_examples=sorted(e for r in results for e in r["skipped_examples"])[:EXAMPLES],
                       summary=summary)
