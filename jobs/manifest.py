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
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.manifest_steps.base import BaseJoin, BaseReport, JoinCounts, join_and_inspect
from jobs.manifest_steps.catalog import (
    check_accepted,
    check_min_per_class,
    split_function,
)
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.duplicates import DuplicateGroups, Duplicates, duplicates_task
from jobs.manifest_steps.extract import (
    extract,
    inspect_tasks,
    kept_columns,
    label,
    read_ground_truth,
    rebase,
)
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.passes import (
    ClassParts,
    ContentCounts,
    Listing,
    PassPlan,
    class_task,
    content_task,
    inspect_task,
)
from jobs.manifest_steps.split import class_quotas
from jobs.manifest_steps.summary import (
    CheckedCounts,
    TablesWritten,
    log_written,
    summarize,
    summary_line,
    warn_duplicates,
)
from lakeshard import storage
from lakeshard.errors import DatasetExistsError, ManifestError, StorageError
from lakeshard.format import (
    ManifestInfo,
    dataset_json_uri,
    labels_uri,
    manifest_marker_uri,
    manifests_uri,
    write_manifest_info,
)
from lakeshard.format.label_columns import BOXES, SINGLE_LABEL
from lakeshard.locks import confirm, dataset_lock

__all__ = ["hold", "main", "prepare", "run"]

log = logging.getLogger("jobs.manifest")


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


def _plan(cfg: ManifestConfig, out: str, staging: str, listing: Listing, kept: pa.Schema | None) -> PassPlan:
    """How the later passes part the rows: a function of the lake alone (so every engine writes
    the same parts), each class whole in one part; images with several labels in one part
    (the split of a set of labels sees every image: docs/design/0043)."""
    buckets = max(1, math.ceil(listing.rows / cfg.rows_per_part))
    return PassPlan(
        out=out,
        staging=staging,
        content_buckets=buckets,
        parts=min(buckets, max(1, listing.classes)) if cfg.task == SINGLE_LABEL else 1,
        split=dict(cfg.split),
        seed=cfg.seed,
        split_method=cfg.split_method,
        dedupe=cfg.dedupe,
        sniff=cfg.sniff,
        task=cfg.task,
        box_units=cfg.box_units,
        kept=kept,
    )


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
    partitions = cfg.partitions or inspect_tasks(listing.rows, engine.parallelism)
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


def group_and_check(cfg: ManifestConfig, engine: Engine, plan: PassPlan) -> CheckedCounts:
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
        min_classes=1 if cfg.task == BOXES else 2,
    )
    if cfg.task != SINGLE_LABEL:  # the split of label sets is known once made: checked after it
        return CheckedCounts(content=content, labels=labels, counts={})
    counts = _predicted_counts(cfg, labels, content)
    check_min_per_class(counts, list(labels), cfg.min_per_class, cfg.split_method)
    return CheckedCounts(content=content, labels=labels, counts=counts)


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


def write_tables(engine: Engine, plan: PassPlan, checked: CheckedCounts) -> TablesWritten:
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
    return TablesWritten(classes=ClassParts.merge(classes), duplicates=duplicates)


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
    kept = kept_columns(cfg)
    if cfg.labels:
        listing = label(cfg, engine, listing, staging, kept)
    join = rebase(cfg, engine, listing, staging) if cfg.base else None
    plan = _plan(cfg, out, staging, listing, kept)
    joined = read_headers(cfg, engine, listing, plan, join)
    checked = group_and_check(cfg, engine, plan)
    _clear(out, replacing=replacing)
    written = write_tables(engine, plan, checked)
    if cfg.task != SINGLE_LABEL:  # before the marker: a failing run leaves no manifest
        counts = written.classes.counts.classes
        check_min_per_class(counts, list(checked.labels), cfg.min_per_class, cfg.split_method)
    base = None if join is None or joined is None else BaseReport(join, joined, written.classes)
    summary = summarize(cfg, listing, checked, written, parts=plan.parts, base=base, columns=plan.manifest)
    commit(out, checked.labels, summary)
    storage.remove(staging, recursive=True)
    warn_duplicates(written.duplicates)
    log_written(out, summary)
    return summary


def parser() -> argparse.ArgumentParser:
    return job_parser(
        "jobs/manifest.py",
        ManifestConfig,
        description="List a raw image lake (<prefix>/<label>/.../<file>, local, file://, s3://, gs:// or az://), "
        "label and split it, and write manifests, labels.json and a rejects table.",
    )


def main(argv: list[str] | None = None) -> int:
    return run_job(
        argv,
        parser=parser(),
        config=ManifestConfig,
        run=run,
        summary=summary_line,
        prog="jobs/manifest.py",
        prepare=prepare,
        cpu_bound=False,  # its maps wait on storage or run Arrow: threads
    )


if __name__ == "__main__":
    sys.exit(main())
