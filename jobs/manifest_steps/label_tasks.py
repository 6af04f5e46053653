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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from jobs.manifest_steps.labels import read_labels
from jobs.manifest_steps.listing import reject
from jobs.manifest_steps.passes import EXAMPLES, read_staged, write_staged
from lakeshard import storage
from lakeshard.format.manifest_table import hash_bucket, read_part, table_rows, write_part

__all__ = ["Buckets", "Join", "join_task", "merge", "stage_keys", "stage_table"]

_LABEL_SCHEMA = pa.schema([("key", pa.string()), ("label", pa.string()), ("channel", pa.string())])


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """A join of the listed rows with another table by key bucket: its staging folder (one
    folder per side and bucket) and the number of key buckets."""

    staging: str
    buckets: int

    def folder(self, side: str, bucket: int) -> str:
        return storage.join(self.staging, side, f"b={bucket:05d}")


@dataclass(frozen=True, kw_only=True)
class Join(Buckets):
    """What every labelling task needs: the input, the table's URI (named in reasons), the
    split's channels, the staging folder and the number of key buckets."""

    root: str
    labels: str
    channels: tuple[str, ...]

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
        out.append(full[len(under):] if full.startswith(under) else None)
    return out


def stage_table(files: list[str], *, join: Join) -> list[dict[str, Any]]:
    """Stage the label rows of ``files`` by key bucket; return, per file, its rows and the
    rows whose ``uri`` is outside ``--input`` (count and first few)."""
    out = []
    for uri in files:
        table = read_labels(uri, channels=join.channels)
        keys = _keys(table, join.root)
        by_bucket: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for key, label, channel in zip(keys, table["label"].to_pylist(), table["channel"].to_pylist()):
            if key is not None:
                by_bucket[hash_bucket(key, join.buckets)].append({"key": key, "label": label, "channel": channel})
        for bucket, rows in by_bucket.items():
            write_part(storage.join(join.folder("labels", bucket), f"part-{_name(uri)}.parquet"),
                       pa.Table.from_pylist(rows, schema=_LABEL_SCHEMA), durable=False)
        outside = sorted(u for u, k in zip(table[table.column_names[0]].to_pylist(), keys) if k is None)
        out.append({"rows": table.num_rows, "outside": len(outside), "outside_examples": outside[:EXAMPLES]})
    return out


def stage_keys(items: list[tuple[str, int, int]], *, join: Buckets) -> list[int]:
    """Stage the listed rows ``items`` (``(part URI, start, stop)``) by key bucket (side
    ``keys`` of ``join``, any join by key bucket); return how many."""
    n = 0
    for uri, start, stop in items:
        rows = table_rows(read_part(uri).slice(start, stop - start))
        by_bucket: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_bucket[hash_bucket(r["key"], join.buckets)].append(r)
        for bucket, mine in by_bucket.items():
            write_staged(mine, storage.join(join.folder("keys", bucket), f"part-{_name(uri)}-{start:09d}.parquet"))
        n += len(rows)
    return [n]


def join_task(buckets: list[int], *, join: Join) -> list[dict[str, Any]]:
    """For each key bucket: label its listed rows from its label rows (identical label rows
    of a key are one), reject a listed object that has none, count the label rows naming no
    listed object and the keys labelled two ways; stage the labelled rows. Returns per-bucket
    aggregates: rows, labels, unlabelled, pinned, missing and conflicts (counts, and the first
    :data:`~jobs.manifest_steps.passes.EXAMPLES` keys; a conflict as ``{key: [label/channel, ...]}``)."""
    out = []
    for bucket in buckets:
        rows = read_staged(join.folder("keys", bucket))
        given: dict[str, set[tuple[str, str | None]]] = defaultdict(set)
        for r in read_staged(join.folder("labels", bucket)):
            given[r["key"]].add((r["label"], r["channel"]))
        listed = {r["key"] for r in rows}
        conflicts = sorted(k for k, v in given.items() if len(v) > 1)
        missing = sorted(k for k in given if k not in listed)
        unlabelled = 0
        for r in rows:
            if r["key"] in given:
                r["label"], r["pin"] = min(given[r["key"]], key=lambda v: (v[0], v[1] or ""))
            elif r["status"] == "ok":
                reject(r, f"no label: not in --labels {join.labels}")
                unlabelled += 1
        write_staged(rows, join.labelled(bucket))
        ok = [r for r in rows if r["status"] == "ok"]
        out.append({"part": join.labelled(bucket), "rows": len(rows), "labels": sorted({r["label"] for r in rows if r["label"] is not None}),
                    "unlabelled": unlabelled, "pinned": sum(1 for r in ok if r["pin"]),
                    "missing": len(missing), "missing_examples": missing[:EXAMPLES],
                    "conflicts": len(conflicts),
                    "conflict_examples": [{k: sorted(_spelled(v) for v in given[k])} for k in conflicts[:EXAMPLES]]})
    return out


def _spelled(value: tuple[str, str | None]) -> str:
    label, channel = value
    return label if channel is None else f"{label} (channel {channel})"


def merge(results: Sequence[dict[str, Any]], tables: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The join's and the table staging's aggregates merged (what the summary reports)."""
    def first(examples: list[Any]) -> list[Any]:
        return sorted(examples, key=str)[:EXAMPLES]

    missing = [k for r in results for k in r["missing_examples"]] + [u for t in tables for u in t["outside_examples"]]
    return {"rows": sum(t["rows"] for t in tables), "labels": sorted({x for r in results for x in r["labels"]}),
            "unlabelled": sum(r["unlabelled"] for r in results), "pinned": sum(r["pinned"] for r in results),
            "not_in_lake": sum(r["missing"] for r in results) + sum(t["outside"] for t in tables),
            "not_in_lake_examples": first(missing),
            "conflicts": sum(r["conflicts"] for r in results),
            "conflict_examples": sorted((e for r in results for e in r["conflict_examples"]), key=lambda e: next(iter(e)))
            [:EXAMPLES]}

