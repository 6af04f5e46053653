"""Manifest job: list a raw image lake, label and split it, write the manifests.

    spark-submit jobs/manifest.py --input s3://lake/raw/pets --output s3://lake/datasets/pets-v1 \\
        --split train=0.8,validation=0.1,test=0.1 --seed 7 --min-per-class 5
    python -m jobs.manifest --engine dask --input ./lake/raw --output ./datasets/pets-v1
    python jobs/manifest.py --conf conf/manifest.yaml --input ./lake/raw --output ./out

Writes, under ``--output``, the manifest tables as folders of parts (``manifests/all/``,
``manifests/<channel>/``, ``manifests/rejects/``, SageMaker augmented manifests in
``manifests/sagemaker/<channel>/``; read them with :mod:`lakeshard.format.manifest_table`), ``labels.json``,
and last ``manifests/_manifest.json``, the marker that the shard job waits for.

Extract (list the levels above the labels on the driver, list each class prefix on the
workers) -> transform (read each object's first bytes, group identical content, check the
counts) -> load (split each class, write the tables): every row stays on the workers, staged
under ``_staging/manifest/``; the driver sees counts per class and per reason
(:mod:`jobs.manifest_steps.passes`; the rules are :mod:`jobs.manifest_steps.catalog`'s).

With ``--input-manifest`` the objects and labels come from a SageMaker Ground Truth manifest
(:mod:`jobs.manifest_steps.ground_truth`), not a listing.

With ``--labels`` the labels come from a table instead of the path: the whole input is
listed, and the workers join the listed rows with the table's by key (:mod:`jobs.manifest_steps.label_tasks`)
before any object is read.

With ``--base`` (a previous manifest of the same lake, labels and split) the workers join the
listed rows with the base's by key (:mod:`jobs.manifest_steps.base`) before any object is read: an
unchanged object is not read again; the manifest is the one a build without ``--base`` writes,
and ``_manifest.json`` counts (``base``) what was reused, new, changed, left and moved.

Hidden objects (``.DS_Store``, ``._*``, ``.ipynb_checkpoints/``, ``__MACOSX/``, ``Thumbs.db``,
``desktop.ini``) and ``--exclude`` matches are skipped and counted (``counts.skipped``,
``skipped_by_reason`` in ``_manifest.json``); identical content under several keys is reported
(``duplicates``: across channels is leakage), and removed but for one key with ``--dedupe``.
:func:`jobs.manifest_steps.inputs.check_manifest_inputs` refuses an output inside the input before any engine starts.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.manifest_steps.base import BaseJoin, BaseReport, JoinCounts, join_and_inspect, stage_join
from jobs.manifest_steps.catalog import (
    check_accepted,
    check_min_per_class,
    combine_fingerprints,
    split_function,
)
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.ground_truth import read_manifest
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.inventory import inventory_rows, read_inventory
from jobs.manifest_steps.label_tasks import (
    LabelJoin,
    Labelling,
    conflicts_text,
    join_task,
    stage_keys,
    stage_table,
)
from jobs.manifest_steps.labels import label_files
from jobs.manifest_steps.listing import Skip, StagedRow, discover
from jobs.manifest_steps.listing_tasks import list_lake
from jobs.manifest_steps.passes import (
    EXAMPLES,
    ClassParts,
    ContentCounts,
    DuplicateGroups,
    Duplicates,
    ListedPart,
    Listing,
    PassPlan,
    SkippedObject,
    StagedPart,
    class_task,
    content_task,
    duplicates_task,
    inspect_task,
    skip_kind,
    stage_listing,
)
from jobs.manifest_steps.split import class_quotas
from lakeshard import storage
from lakeshard.errors import DatasetExistsError, ManifestError, StorageError
from lakeshard.format import (
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    BaseSummary,
    ManifestCounts,
    ManifestInfo,
    dataset_json_uri,
    labels_uri,
    manifest_marker_uri,
    manifests_uri,
    read_manifest_info,
    write_manifest_info,
)
from lakeshard.format.manifest_table import write_part
from lakeshard.locks import confirm, dataset_lock

__all__ = ["hold", "main", "prepare", "run"]

log = logging.getLogger("jobs.manifest")


@dataclass(frozen=True, slots=True)
class _CheckedCounts:
    """Pass 3's counts (:class:`~jobs.manifest_steps.passes.ContentCounts`), checked: the labels'
    indices, and ``counts[channel][label]`` as the split will make them."""

    content: ContentCounts
    labels: dict[str, int]
    counts: dict[str, dict[str, int]]


@dataclass(frozen=True, slots=True)
class _TablesWritten:
    """What the passes that write the tables hand back: each class's fingerprint and the
    objects moved from their ``--base`` channel, and the groups of identical content."""

    classes: ClassParts
    duplicates: Duplicates


def _skip(cfg: ManifestConfig) -> Skip:
    return Skip(exclude=tuple(cfg.exclude), include_hidden=cfg.include_hidden)


def _prepare_output(cfg: ManifestConfig, out: str) -> bool:
    """Check the output (its bucket exists; a manifest there is replaced only with
    ``--overwrite``) and remove what a killed run left (half-written files, staged rows).
    Returns whether a manifest is being replaced."""
    if not storage.is_local(out):
        _check_bucket(out)
    marker = manifest_marker_uri(out)
    replacing = storage.exists(marker) or storage.exists(dataset_json_uri(out))
    if replacing and not cfg.overwrite:
        raise DatasetExistsError(f"{out} already holds a manifest ({marker}); pass --overwrite to replace it")
    storage.remove_temporaries(out)  # half-written files of a killed run
    storage.remove(_staging(out), recursive=True)  # a killed run's staged rows
    return replacing


def _staging(out: str) -> str:
    return storage.join(out, "_staging", "manifest")


def read_ground_truth(cfg: ManifestConfig, engine: Engine, staging: str) -> Listing:
    """The objects and their labels from ``--input-manifest`` (:mod:`jobs.manifest_steps.ground_truth`)."""
    return read_manifest(
        engine,
        uri=cfg.input_manifest or "",
        attribute=cfg.label_attribute or "",
        root=cfg.input,
        skip=_skip(cfg),
        rows_per_part=cfg.rows_per_part,
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


def label(cfg: ManifestConfig, engine: Engine, listing: Listing, staging: str) -> Listing:
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
        partitions = cfg.partitions or _inspect_tasks(listing.rows, engine.parallelism)
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


def _plan(cfg: ManifestConfig, out: str, staging: str, listing: Listing) -> PassPlan:
    """How the later passes part the rows: a function of the lake alone (so every engine writes
    the same parts), each class whole in one part."""
    buckets = max(1, math.ceil(listing.rows / cfg.rows_per_part))
    return PassPlan(
        out=out,
        staging=staging,
        content_buckets=buckets,
        parts=min(buckets, max(1, listing.classes)),
        split=dict(cfg.split),
        seed=cfg.seed,
        split_method=cfg.split_method,
        dedupe=cfg.dedupe,
        sniff=cfg.sniff,
    )


#: Objects per header-reading task, and at most this many such tasks unless the engine has more
#: cores: each task writes a file per content bucket it meets (tasks x buckets staged files).
_ROWS_PER_INSPECT_TASK = 2000
_MAX_INSPECT_TASKS = 1000


def _inspect_tasks(rows: int, parallelism: int) -> int:
    wanted = max(2 * parallelism, math.ceil(rows / _ROWS_PER_INSPECT_TASK))
    return max(1, min(rows, wanted, max(2 * parallelism, _MAX_INSPECT_TASKS)))


def _nothing_listed(where: str, skipped: Counter[str]) -> str:
    """Why no object is left to build from: none found, or all skipped (counted by reason)."""
    if not skipped:
        return f"no objects found under {where}"
    reasons = [
        f"{n} excluded by {kind.removeprefix('excluded: ')}"
        if kind.startswith("excluded")
        else f"{n} hidden (--include-hidden lists them)"
        if kind == "hidden"
        else f"{n} {kind}"
        for kind, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    fix = "; check --exclude" if any(k.startswith("excluded") for k in skipped) else ""
    return (
        f"all {skipped.total()} objects found under {where} were skipped ({', '.join(reasons)}): none is "
        f"left to build a manifest from{fix}"
    )


def read_headers(
    cfg: ManifestConfig, engine: Engine, listing: Listing, plan: PassPlan, join: BaseJoin | None = None
) -> JoinCounts | None:
    """Read each listed object's first bytes on the workers and stage the rows by content
    bucket (pass 2); with ``join``, join the rows with ``--base``'s in the same tasks and return
    the join's counts (:func:`jobs.manifest_steps.base.join_and_inspect`)."""
    if not listing.rows:
        raise ManifestError(_nothing_listed(storage.normalize(cfg.input), listing.skipped))
    split_function(cfg.split_method)
    partitions = cfg.partitions or _inspect_tasks(listing.rows, engine.parallelism)
    log.info(
        "listed %d objects; %s in %d tasks",
        listing.rows,
        "reading their headers" if cfg.sniff else "not reading them (--no-sniff)",
        partitions,
    )
    if join is None:
        engine.map_partitions(
            partial(inspect_task, plan=plan), listing.slices(partitions), partitions=partitions
        )  # several slices a task
        return None
    counts = join_and_inspect(engine, join, plan, partitions)
    if counts.rows != listing.rows:
        raise ManifestError(
            f"the join with --base {join.root} gave {counts.rows} rows, {listing.rows} were listed"
        )
    return counts


def _predicted_counts(
    cfg: ManifestConfig, labels: dict[str, int], content: ContentCounts
) -> dict[str, dict[str, int]]:
    """``counts[channel][label]`` before the split runs: a per-row split's counts came back
    from the workers; the stratified split's follow from the class sizes, but for the rows
    ``--labels`` pins (counted per class and per channel on the workers)."""
    if cfg.split_method == "stratified":  # the split's quotas of the unpinned rows, plus the pinned
        quotas = {
            label: class_quotas(content.accepted[label] - content.pinned[label], cfg.split)
            for label in labels
        }
        return {
            c: {label: quotas[label][c] + content.in_channel(label, c) for label in labels} for c in cfg.split
        }
    return {c: {label: content.in_channel(label, c) for label in labels} for c in cfg.split}


def _label_source(cfg: ManifestConfig) -> str | None:
    """The table or Ground Truth manifest the labels came from (None: the path), as errors name it."""
    if cfg.labels:
        return f"--labels {cfg.labels}"
    return f"--input-manifest {cfg.input_manifest}" if cfg.input_manifest else None


def group_and_check(cfg: ManifestConfig, engine: Engine, plan: PassPlan) -> _CheckedCounts:
    """Group identical content on the workers (pass 3) and check the counts: every rule of
    :func:`jobs.manifest_steps.catalog.build_manifest` that fails a run fails it here, before any
    manifest table is written."""
    content = ContentCounts.merge(
        engine.map_partitions(
            partial(content_task, plan=plan),
            list(range(plan.content_buckets)),
            partitions=plan.content_buckets,
        )
    )
    labels = check_accepted(
        listed=content.listed,
        reasons=content.reasons,
        removed=content.removed,
        ok_labels=list(content.accepted),
        max_reject_fraction=cfg.max_reject_fraction,
        where=storage.normalize(cfg.input),
        label_source=_label_source(cfg),
    )
    counts = _predicted_counts(cfg, labels, content)
    check_min_per_class(counts, list(labels), cfg.min_per_class, cfg.split_method)
    return _CheckedCounts(content=content, labels=labels, counts=counts)


def _clear(out: str, *, replacing: bool) -> None:
    """Before the tables are written: take the manifest being replaced out of reach, and remove
    every table."""
    if replacing:
        # Invalidate only now that the new manifest passed its checks (a run that fails before
        # leaves the old one, and its dataset, readable): no reader may see a dataset whose
        # manifest is being replaced.
        storage.remove(dataset_json_uri(out))
        storage.remove(manifest_marker_uri(out))
    _remove_tables(out)


def _remove_tables(out: str) -> None:
    """Delete every manifest table (folders of parts, and a format-2 manifest's files)."""
    fs, path = storage.filesystem(manifests_uri(out))
    try:
        entries = fs.ls(path, detail=False) if fs.exists(path) else []
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.rstrip("/").rsplit("/", 1)[-1] != "_manifest.json":
            storage.remove(storage.from_listing(out, entry), recursive=True)


def write_tables(engine: Engine, plan: PassPlan, checked: _CheckedCounts) -> _TablesWritten:
    """Split each class part and write every manifest table's part on the workers (pass 4),
    then report the groups of identical content (pass 5, if there are any)."""
    plan = replace(plan, labels=checked.labels)
    classes = engine.map_partitions(
        partial(class_task, plan=plan), list(range(plan.parts)), partitions=plan.parts
    )
    found = (
        []
        if not checked.content.duplicate_groups
        else engine.map_partitions(
            partial(duplicates_task, plan=plan),
            list(range(plan.content_buckets)),
            partitions=plan.content_buckets,
        )
    )
    duplicates = Duplicates(DuplicateGroups.merge(found), removed=checked.content.removed)
    return _TablesWritten(classes=ClassParts.merge(classes), duplicates=duplicates)


def summarize(
    cfg: ManifestConfig,
    listing: Listing,
    checked: _CheckedCounts,
    written: _TablesWritten,
    *,
    parts: int,
    base: BaseReport | None = None,
) -> ManifestInfo:
    """What ``manifests/_manifest.json`` says."""
    counts = checked.counts
    achieved = {}
    for label in checked.labels:
        total = sum(counts[c][label] for c in counts)
        achieved[label] = {c: round(counts[c][label] / total, 4) for c in counts}
    listed, reasons = checked.content.listed, checked.content.reasons
    return ManifestInfo(
        format_version=FORMAT_VERSION,
        input=storage.normalize(cfg.input),
        split=cfg.split,
        split_order=list(cfg.split),  # the channels' order (the hash split's slices are cut in it)
        split_method=cfg.split_method,
        seed=cfg.seed,
        min_per_class=cfg.min_per_class,
        label_depth=cfg.label_depth,
        # --labels: the table's URI, rows, objects it left unlabelled, rows naming no listed object.
        labels_table=listing.labels_table,
        # --base: its root and fingerprint; objects reused (not read), new, changed, left, moved.
        base=base.summary() if base is not None else None,
        labels=checked.labels,
        fingerprint=combine_fingerprints(written.classes.fingerprints),
        parts=parts,
        counts=ManifestCounts(
            listed=listed,
            accepted=listed - reasons.total(),
            rejected=reasons.total(),
            channels={c: sum(counts[c].values()) for c in counts},
            classes=counts,
            skipped=listing.skipped.total(),
        ),
        achieved_fractions=achieved,
        rejects_by_reason=dict(sorted(reasons.items())),
        # "hidden" (their names vary without bound, as '._*' files do) or "excluded: --exclude GLOB".
        skipped_by_reason=dict(sorted(listing.skipped.items())),
        skipped_examples=dict(listing.skipped_examples),
        exclude=list(cfg.exclude),
        include_hidden=cfg.include_hidden,
        dedupe=cfg.dedupe,
        duplicates=written.duplicates.summary(),
    )


def commit(out: str, labels: dict[str, int], summary: ManifestInfo) -> None:
    """Write ``labels.json``, then the marker: last, it says the manifest is complete (unless
    another job took the output's lock over: :func:`lakeshard.locks.confirm`)."""
    confirm(out)
    storage.write_json_atomic(labels_uri(out), labels)
    write_manifest_info(out, summary)


def _check_bucket(out: str) -> None:
    """Fail before any listing if the output's bucket is missing or denied (never create it)."""
    fs, path = storage.filesystem(out)
    try:
        fs.info(path.split("/", 1)[0])
    except FileNotFoundError:
        raise StorageError(
            f"cannot write {out}: its bucket does not exist (the job never creates buckets)"
        ) from None
    except Exception as exc:
        raise StorageError(f"cannot write {out}: {type(exc).__name__}: {exc}") from exc


def _warn_duplicates(dups: Duplicates) -> None:
    found = dups.found
    if found.across_channels:
        log.warning(
            "leakage: %d groups of identical images are split across channels (%d objects in %d groups "
            "of identical content in all; e.g. %s); pass --dedupe to keep one of each",
            found.across_channels,
            found.objects,
            found.groups,
            dups.examples[0],
        )
    elif found.groups:
        log.warning(
            "%d objects in %d groups of identical content (each group within one channel; e.g. %s)",
            found.objects,
            found.groups,
            dups.examples[0],
        )
    if dups.removed:
        log.info("dedupe: rejected %d copies of identical content", dups.removed)


def _log_written(out: str, summary: ManifestInfo) -> None:
    c = summary.counts
    log.info(
        "manifest written to %s: %d listed, %d accepted (%s), %d rejected",
        out,
        c.listed,
        c.accepted,
        ", ".join(f"{k}={v}" for k, v in c.channels.items()),
        c.rejected,
    )
    if base := summary.base:
        log.info("--base %s: %s", base.root, _base_counts(base))
        if base.relabelled:
            log.warning(
                "%d objects have another label than in --base %s (e.g. %s): each takes its new "
                "label, as a build without --base gives it",
                base.relabelled,
                base.root,
                _relabelled(base),
            )


def hold(cfg: ManifestConfig) -> AbstractContextManager[None]:
    """The output dataset's lock for this run (:mod:`lakeshard.locks`)."""
    return dataset_lock(cfg.output, job="manifest")


@contextmanager
def prepare(cfg: ManifestConfig) -> Iterator[None]:
    """Before the engine starts: check the inputs (the output is outside the input, before the
    lock creates the output's folder), then take the output's lock; hold it to the end."""
    check_manifest_inputs(cfg)
    with hold(cfg):
        yield


def run(cfg: ManifestConfig, engine: Engine) -> dict[str, Any]:
    """Run the job, holding the output dataset's lock (another job writing it makes this one
    fail at once: :class:`~lakeshard.locks.DatasetBusyError`); return the summary written to
    ``manifests/_manifest.json``, as its JSON object (:meth:`ManifestInfo.to_json`)."""
    check_manifest_inputs(cfg)
    with hold(cfg):
        return _build(cfg, engine).to_json()


def _build(cfg: ManifestConfig, engine: Engine) -> ManifestInfo:
    """List (or read the Ground Truth manifest), label, join with the base, inspect, check,
    split and write the manifest (inputs checked, the lock held)."""
    out = storage.normalize(cfg.output)
    replacing = _prepare_output(cfg, out)
    staging = _staging(out)
    listing = read_ground_truth(cfg, engine, staging) if cfg.input_manifest else extract(cfg, engine, staging)
    if cfg.labels:
        listing = label(cfg, engine, listing, staging)
    join = rebase(cfg, engine, listing, staging) if cfg.base else None
    plan = _plan(cfg, out, staging, listing)
    joined = read_headers(cfg, engine, listing, plan, join)
    checked = group_and_check(cfg, engine, plan)
    _clear(out, replacing=replacing)
    written = write_tables(engine, plan, checked)
    base = None if join is None or joined is None else BaseReport(join, joined, written.classes)
    summary = summarize(cfg, listing, checked, written, parts=plan.parts, base=base)
    commit(out, checked.labels, summary)
    storage.remove(staging, recursive=True)
    _warn_duplicates(written.duplicates)
    _log_written(out, summary)
    return summary


def _relabelled(base: BaseSummary) -> str:
    return ", ".join(f"{e['key']}: {e['from']} -> {e['to']}" for e in base.relabelled_examples)


def _base_counts(base: BaseSummary) -> str:
    left = f" (e.g. {', '.join(base.left_examples)})" if base.left else ""
    relabelled = base.relabelled and f", {base.relabelled} relabelled (e.g. {_relabelled(base)})"
    return (
        f"{base.unchanged} unchanged ({base.reused} not read again), {base.new} new, {base.changed} "
        f"changed, {base.left} left the lake{left}, {base.moved} moved to another channel"
        f"{relabelled or ''}"
    )


def parser() -> argparse.ArgumentParser:
    return job_parser(
        "jobs/manifest.py",
        ManifestConfig,
        description="List a raw image lake (<prefix>/<label>/.../<file>, local, file:// or s3://), "
        "label and split it, and write manifests, labels.json and a rejects table.",
    )


def _summary(cfg: ManifestConfig, summary: dict[str, Any]) -> str:
    info = ManifestInfo.from_json(summary)
    c = info.counts
    line = (
        f"manifest: {c.listed} listed, {c.accepted} accepted, {c.rejected} rejected, "
        f"{len(info.labels)} classes -> {storage.normalize(cfg.output)}"
    )
    return line + (f"\nbase {info.base.root}: {_base_counts(info.base)}" if info.base else "")


def main(argv: list[str] | None = None) -> int:
    return run_job(
        argv,
        parser=parser(),
        config=ManifestConfig,
        run=run,
        summary=_summary,
        prog="jobs/manifest.py",
        prepare=prepare,
    )


if __name__ == "__main__":
    sys.exit(main())
