"""The manifest job's extract side, on the workers: pass 1 lists the objects (the lake's class
prefixes in balanced rounds, an S3 Inventory's data files, or a Ground Truth manifest's lines)
and stages the rows; a ``--labels`` table is joined with them by key; a ``--base`` manifest's
rows are staged beside them for the header-reading pass to join. Only counts come back to the
driver (:mod:`jobs.manifest_steps.passes`)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.engines import Engine
from jobs.manifest_steps.base import BaseJoin, stage_join
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.ground_truth import read_manifest
from jobs.manifest_steps.inventory import inventory_rows, read_inventory
from jobs.manifest_steps.label_tasks import (
    LabelJoin,
    Labelling,
    conflicts_text,
    join_task,
    stage_keys,
    stage_table,
)
from jobs.manifest_steps.labels import kept_schema, label_files, read_labels
from jobs.manifest_steps.listing import Skip, StagedRow, discover
from jobs.manifest_steps.listing_tasks import list_lake
from jobs.manifest_steps.passes import (
    EXAMPLES,
    ListedPart,
    Listing,
    SkippedObject,
    StagedPart,
    skip_kind,
    stage_listing,
)
from jobs.manifest_steps.table_values import TableColumns
from lakeshard import storage
from lakeshard.errors import ManifestError
from lakeshard.format import MANIFEST_SCHEMA, read_manifest_info
from lakeshard.format.manifest_table import write_part

__all__ = [
    "extract",
    "inspect_tasks",
    "kept_columns",
    "label",
    "read_ground_truth",
    "rebase",
    "table_columns",
]

log = logging.getLogger("jobs.manifest")


def _skip(cfg: ManifestConfig) -> Skip:
    return Skip(exclude=tuple(cfg.exclude), include_hidden=cfg.include_hidden)


def read_ground_truth(cfg: ManifestConfig, engine: Engine, staging: str) -> Listing:
    """The objects and their labels from ``--input-manifest`` (:mod:`jobs.manifest_steps.ground_truth`)."""
    return read_manifest(
        engine,
        uri=cfg.input_manifest or "",
        attribute=cfg.label_attribute or "",
        root=cfg.input,
        skip=_skip(cfg),
        rows_per_part=cfg.rows_per_part,
        task=cfg.task,
        staging=staging,
    )


def extract(cfg: ManifestConfig, engine: Engine, staging: str) -> Listing:
    """List every object under ``cfg.input`` on the workers (pass 1: class prefixes in balanced
    rounds, :func:`jobs.manifest_steps.listing_tasks.list_lake`, or the ``--inventory`` data files), staging
    the rows; only counts come back."""
    src = storage.normalize(cfg.input)
    if cfg.inventory:
        listing = _list_inventory(cfg, engine, src, staging)
    elif cfg.labels:  # a flat lake: every object under the input, listed in balanced rounds
        log.info(
            "listing every object under %s on %s (labels from --labels %s)", src, engine.name, cfg.labels
        )
        listing = _listing(
            list_lake(
                engine,
                src,
                [src],
                label_depth=0,
                skip=_skip(cfg),
                task_objects=cfg.list_task_objects,
                stage=_stage(staging),
            ),
            classes=1,
        )
    else:
        assert cfg.label_depth is not None  # ManifestConfig sets it for a lake of class folders
        found = discover(src, label_depth=cfg.label_depth, skip=_skip(cfg))
        log.info(
            "found %d class prefixes under %s; listing them on %s", len(found.prefixes), src, engine.name
        )
        results = list_lake(
            engine,
            src,
            found.prefixes,
            label_depth=cfg.label_depth,
            skip=_skip(cfg),
            task_objects=cfg.list_task_objects,
            stage=_stage(staging),
        )
        listing = _listing(results, classes=len(found.prefixes), stray=found.stray, staging=staging)
    if listing.skipped:
        log.info(
            "skipped %d hidden or excluded objects (e.g. %s)",
            listing.skipped.total(),
            listing.skipped_examples[0].key,
        )
    return listing


def _stage(staging: str) -> Callable[[Callable[[list[Any]], list[Any]]], Callable[[list[Any]], list[Any]]]:
    """A listing task made into one that stages its rows
    (:func:`jobs.manifest_steps.passes.stage_listing`)."""
    return lambda produce: partial(stage_listing, produce=produce, staging=staging)


def _list_inventory(cfg: ManifestConfig, engine: Engine, src: str, staging: str) -> Listing:
    """Pass 1 from the ``--inventory`` report's data files, a task each."""
    inventory = read_inventory(cfg.inventory or "", bucket=storage.bucket(src))
    log.info("reading %d inventory data files of %s on %s", len(inventory.files), inventory.uri, engine.name)
    task = _stage(staging)(inventory_rows(inventory, src, label_depth=cfg.label_depth or 0, skip=_skip(cfg)))
    results = engine.map_partitions(task, list(inventory.files), partitions=len(inventory.files))
    listing = _listing(results, classes=len({label for r in results for label in r.labels}))
    if not listing.rows:
        raise ManifestError(f"--inventory {cfg.inventory} lists no object under --input {src}")
    return listing


def _listing(
    results: Sequence[ListedPart], *, classes: int, stray: Sequence[StagedRow] = (), staging: str = ""
) -> Listing:
    """The listing tasks' parts as one listing. ``stray``: the objects the driver found above
    the label level (few), counted if skipped, else staged in a part of their own (rejects)."""
    skipped = Counter(skip_kind(r["reason"]) for r in stray if r["status"] == "skipped")
    examples = [SkippedObject(r["key"], r["reason"]) for r in stray if r["status"] == "skipped"]
    for r in results:
        skipped.update(r.skipped)
        examples += r.skipped_examples
    parts = [StagedPart(r.uri, r.rows) for r in results if r.rows]
    if unlabelled := [r for r in stray if r["status"] != "skipped"]:
        uri = storage.join(staging, "listed", "part-stray.parquet")
        write_part(uri, pa.Table.from_pylist(unlabelled, schema=MANIFEST_SCHEMA), durable=False)
        parts.append(StagedPart(uri, len(unlabelled)))
    return Listing(
        parts=tuple(sorted(parts)),
        classes=classes,
        skipped=skipped,
        skipped_examples=tuple(sorted(examples)[:EXAMPLES]),
    )


def table_columns(cfg: ManifestConfig) -> TableColumns:
    """What the ``--labels`` table's rows carry besides a key, a class and a channel."""
    return TableColumns(task=cfg.task, keep=cfg.keep_columns, units=cfg.box_units)


def kept_columns(cfg: ManifestConfig) -> pa.Schema | None:
    """The ``--keep-columns`` with their types, from the table's first file (every file has
    them: :func:`jobs.manifest_steps.labels.check_labels`); None: none kept."""
    if not cfg.keep_columns or not cfg.labels:
        return None
    first = label_files(cfg.labels)[0]
    return kept_schema(
        read_labels(first, channels=list(cfg.split), columns=table_columns(cfg)), table_columns(cfg)
    )


def label(
    cfg: ManifestConfig, engine: Engine, listing: Listing, staging: str, kept: pa.Schema | None = None
) -> Listing:
    """Label the listed rows from ``--labels`` on the workers (:mod:`jobs.manifest_steps.label_tasks`):
    stage the table's rows and the listed rows by key bucket, join each bucket. Returns the
    labelled rows as the listing for the next pass, with what the summary says of the table.

    Raises :class:`ManifestError` naming the keys labelled two different ways (before any
    object is read)."""
    where = storage.normalize(cfg.labels or "")
    files = label_files(where)
    join = LabelJoin(
        root=storage.normalize(cfg.input),
        labels=where,
        channels=tuple(cfg.split),
        staging=storage.join(staging, "labelling"),
        buckets=max(1, math.ceil(listing.rows / cfg.rows_per_part)),
        columns=table_columns(cfg),
        kept=kept,
    )
    log.info(
        "labelling %d listed objects from %s (%d file(s)) in %d key buckets",
        listing.rows,
        where,
        len(files),
        join.buckets,
    )
    tables = engine.map_partitions(partial(stage_table, join=join), files, partitions=len(files))
    if listing.rows:
        partitions = cfg.partitions or inspect_tasks(listing.rows, engine.parallelism)
        engine.map_partitions(
            partial(stage_keys, join=join), listing.slices(partitions), partitions=partitions
        )
    results = engine.map_partitions(
        partial(join_task, join=join), list(range(join.buckets)), partitions=join.buckets
    )
    labelling = Labelling.merge(where, len(files), tables, results)
    joined = labelling.joined
    if joined.conflicts:
        raise ManifestError(
            f"--labels {where} labels {joined.conflicts} key(s) in two different ways "
            f"(e.g. {conflicts_text(joined.conflict_examples)}); give each key one label and "
            "at most one channel (repeating an identical row is fine)"
        )
    if labelling.not_in_lake:
        log.warning(
            "%d rows of --labels %s name no object under %s (e.g. %s)",
            labelling.not_in_lake,
            where,
            join.root,
            ", ".join(labelling.not_in_lake_examples),
        )
    return replace(
        listing, parts=joined.parts, classes=max(1, len(joined.labels)), labels_table=labelling.summary()
    )


def rebase(cfg: ManifestConfig, engine: Engine, listing: Listing, staging: str) -> BaseJoin:
    """Stage the listed rows and ``--base``'s by key bucket on the workers, for the
    header-reading pass to join them (:mod:`jobs.manifest_steps.base`). Returns the join, which
    also holds the base's identity for the summary."""
    where = storage.normalize(cfg.base or "")
    marker = read_manifest_info(where)  # checked by check_manifest_inputs
    objects = marker.counts.listed
    # Staging moves keys and ETags, not objects: a task per core, or per --rows-per-part rows of
    # both sides (each of these tasks is an engine task to schedule, and writes a file per key
    # bucket); the listed rows cut into a slice per core (or per --rows-per-part rows).
    rows, per_part = listing.rows, cfg.rows_per_part
    slices = listing.slices(cfg.partitions or max(engine.parallelism, math.ceil(rows / per_part)))
    partitions = cfg.partitions or max(engine.parallelism, math.ceil((rows + objects) / per_part))
    # The header-reading tasks join whole buckets: at least a bucket per core keeps every core
    # reading; not one per task, as each staging task writes a file per bucket.
    join = BaseJoin(
        root=where,
        parts=marker.parts,
        sniff=cfg.sniff,
        staging=storage.join(staging, "base"),
        buckets=max(engine.parallelism, math.ceil(max(rows, objects) / per_part)),
        fingerprint=marker.fingerprint,
        objects=objects,
    )
    log.info(
        "joining %d listed objects with the %d of --base %s in %d key buckets",
        rows,
        objects,
        where,
        join.buckets,
    )
    stage_join(engine, join, slices, partitions)
    return join


#: Objects per header-reading task, and at most this many such tasks unless the engine has more
#: cores: each task writes a file per content bucket it meets (tasks x buckets staged files).
_ROWS_PER_INSPECT_TASK = 2000
_MAX_INSPECT_TASKS = 1000


def inspect_tasks(rows: int, parallelism: int) -> int:
    """How many header-reading (and key-staging) tasks for ``rows`` objects on ``parallelism`` cores."""
    wanted = max(2 * parallelism, math.ceil(rows / _ROWS_PER_INSPECT_TASK))
    return max(1, min(rows, wanted, max(2 * parallelism, _MAX_INSPECT_TASKS)))
