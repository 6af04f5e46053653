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
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pyarrow as pa

from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.manifest_steps.base import BaseJoin, join_and_inspect, stage_join
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
from jobs.manifest_steps.label_tasks import Join, join_task, merge, stage_keys, stage_table
from jobs.manifest_steps.labels import label_files
from jobs.manifest_steps.listing import Skip, discover
from jobs.manifest_steps.listing_tasks import list_lake
from jobs.manifest_steps.passes import (
    EXAMPLES,
    Plan,
    class_task,
    content_task,
    duplicates_report,
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
    dataset_json_uri,
    labels_uri,
    manifest_marker_uri,
    manifests_uri,
)
from lakeshard.format.manifest_table import write_part
from lakeshard.locks import dataset_lock

__all__ = ["hold", "main", "prepare", "run"]

log = logging.getLogger("jobs.manifest")

@dataclass(frozen=True)
class _Listed:
    """Pass 1's aggregates: the staged listing parts ``(URI, rows)``, the class prefixes, and
    the skipped objects' counts by kind and first few (key, reason) by key."""

    parts: list[tuple[str, int]]
    prefixes: int
    skipped: Counter[str]
    skipped_examples: list[tuple[str, str]]

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.parts)


@dataclass(frozen=True)
class _Checked:
    """Pass 3's aggregates, checked: what the summary needs before the tables are written."""

    listed: int
    reasons: Counter[str]
    removed: int
    duplicate_groups: int
    labels: dict[str, int]
    counts: dict[str, dict[str, int]]


def _skip(cfg: ManifestConfig) -> Skip:
    return Skip(exclude=tuple(cfg.exclude), include_hidden=cfg.include_hidden)


def _staging(out: str) -> str:
    return storage.join(out, "_staging", "manifest")


def extract(cfg: ManifestConfig, engine: Engine, staging: str) -> _Listed:
    """List every object under ``cfg.input`` on the workers (pass 1: class prefixes in balanced
    rounds, :func:`jobs.manifest_steps.listing_tasks.list_lake`, or the ``--inventory`` data files), staging
    the rows; only counts come back."""
    src = storage.normalize(cfg.input)
    skip = _skip(cfg)

    def stage(produce: Any) -> Any:
        return partial(stage_listing, produce=produce, staging=staging)

    depth = cfg.label_depth or 0  # 0: no label from the path (--labels)
    stray: list[dict[str, Any]] = []
    if cfg.inventory:
        inventory = read_inventory(cfg.inventory, bucket=src[len("s3://"):].split("/", 1)[0])
        log.info("reading %d inventory data files of %s on %s", len(inventory.files), inventory.uri, engine.name)
        results = engine.map_partitions(stage(inventory_rows(inventory, src, label_depth=depth, skip=skip)),
                                        list(inventory.files), partitions=len(inventory.files))
        classes = len({label for r in results for label in r.labels})
    elif cfg.labels:  # a flat lake: every object under the input, listed in balanced rounds
        log.info("listing every object under %s on %s (labels from --labels %s)", src, engine.name, cfg.labels)
        results = list_lake(engine, src, [src], label_depth=0, skip=skip, task_objects=cfg.list_task_objects, stage=stage)
        classes = 1
    else:
        prefixes, stray = discover(src, label_depth=cfg.label_depth, skip=skip)
        log.info("found %d class prefixes under %s; listing them on %s", len(prefixes), src, engine.name)
        results = list_lake(engine, src, prefixes, label_depth=cfg.label_depth, skip=skip,
                            task_objects=cfg.list_task_objects, stage=stage)
        classes = len(prefixes)
    skipped = Counter(skip_kind(r["reason"]) for r in stray if r["status"] == "skipped")
    examples = [(r["key"], r["reason"]) for r in stray if r["status"] == "skipped"]
    for r in results:
        skipped.update(r.skipped)
        examples += r.skipped_examples
    parts = [(r.uri, r.rows) for r in results if r.rows]
    if unlabelled := [r for r in stray if r["status"] != "skipped"]:  # few: above the label level
        uri = storage.join(staging, "listed", "part-stray.parquet")
        write_part(uri, pa.Table.from_pylist(unlabelled, schema=MANIFEST_SCHEMA), durable=False)
        parts.append((uri, len(unlabelled)))
    listed = _Listed(parts=sorted(parts), prefixes=classes, skipped=skipped,
                     skipped_examples=sorted(examples)[:EXAMPLES])
    if cfg.inventory and not listed.rows:
        raise ManifestError(f"--inventory {cfg.inventory} lists no object under --input {src}")
    if skipped:
        log.info("skipped %d hidden or excluded objects (e.g. %s)", skipped.total(), listed.skipped_examples[0][0])
    return listed


def label(cfg: ManifestConfig, engine: Engine, listed: _Listed, staging: str) -> tuple[_Listed, dict[str, Any]]:
    """Label the listed rows from ``--labels`` on the workers (:mod:`jobs.manifest_steps.label_tasks`):
    stage the table's rows and the listed rows by key bucket, join each bucket. Returns the
    labelled rows as the listing for the next pass, and what the summary says of the table.

    Raises :class:`ManifestError` naming the keys labelled two different ways (before any
    object is read)."""
    where = storage.normalize(cfg.labels or "")
    files = label_files(where)
    join = Join(root=storage.normalize(cfg.input), labels=where, channels=tuple(cfg.split),
                staging=storage.join(staging, "labelling"), buckets=max(1, math.ceil(listed.rows / cfg.rows_per_part)))
    log.info("labelling %d listed objects from %s (%d file(s)) in %d key buckets", listed.rows, where, len(files),
             join.buckets)
    tables = engine.map_partitions(partial(stage_table, join=join), files, partitions=len(files))
    if listed.rows:
        partitions = cfg.partitions or _inspect_tasks(listed.rows, engine.parallelism)
        engine.map_partitions(partial(stage_keys, join=join), _slices(listed.parts, partitions), partitions=partitions)
    results = engine.map_partitions(partial(join_task, join=join), list(range(join.buckets)), partitions=join.buckets)
    report = merge(results, tables)
    if report["conflicts"]:
        examples = "; ".join(f"{k!r}: {', '.join(v)}" for e in report["conflict_examples"] for k, v in e.items())
        raise ManifestError(f"--labels {where} labels {report['conflicts']} key(s) in two different ways "
                            f"(e.g. {examples}); give each key one label and at most one channel (repeating an "
                            "identical row is fine)")
    if report["not_in_lake"]:
        log.warning("%d rows of --labels %s name no object under %s (e.g. %s)", report["not_in_lake"], where,
                    join.root, ", ".join(report["not_in_lake_examples"]))
    parts = sorted((r["part"], r["rows"]) for r in results if r["rows"])
    labelled = replace(listed, parts=parts, prefixes=max(1, len(report["labels"])))
    summary = {"uri": where, "files": len(files), **{k: v for k, v in report.items() if k != "labels"}}
    return labelled, summary


def rebase(cfg: ManifestConfig, engine: Engine, listed: _Listed, staging: str) -> tuple[BaseJoin, dict[str, Any]]:
    """Stage the listed rows and ``--base``'s by key bucket on the workers, for the
    header-reading pass to join them (:mod:`jobs.manifest_steps.base`). Returns the join, and what
    the summary says of the base so far (its identity)."""
    where = storage.normalize(cfg.base or "")
    marker = storage.read_json(manifest_marker_uri(where))  # checked by check_manifest_inputs
    objects = marker["counts"]["listed"]
    # Staging moves keys and ETags, not objects: a task per core, or per --rows-per-part rows of
    # both sides (each of these tasks is an engine task to schedule, and writes a file per key
    # bucket); the listed rows cut into a slice per core (or per --rows-per-part rows).
    slices = _slices(listed.parts, cfg.partitions or max(engine.parallelism, math.ceil(listed.rows / cfg.rows_per_part)))
    partitions = cfg.partitions or max(engine.parallelism, math.ceil((listed.rows + objects) / cfg.rows_per_part))
    # The header-reading tasks join whole buckets: at least a bucket per core keeps every core
    # reading; not one per task, as each staging task writes a file per bucket.
    join = BaseJoin(root=where, parts=marker["parts"], sniff=cfg.sniff, staging=storage.join(staging, "base"),
                    buckets=max(engine.parallelism, math.ceil(max(listed.rows, objects) / cfg.rows_per_part)))
    log.info("joining %d listed objects with the %d of --base %s in %d key buckets", listed.rows, objects, where,
             join.buckets)
    stage_join(engine, join, slices, partitions, base_rows=objects)
    return join, {"root": where, "fingerprint": marker["fingerprint"], "objects": objects}


def _slices(parts: list[tuple[str, int]], partitions: int) -> list[tuple[str, int, int]]:
    """``(part URI, start, stop)`` slices of the listing parts, about ``total / partitions`` rows each."""
    size = max(1, math.ceil(sum(n for _, n in parts) / partitions))
    return [(uri, a, min(a + size, n)) for uri, n in parts for a in range(0, n, size)]


def _plan(cfg: ManifestConfig, out: str, staging: str, listed: _Listed) -> Plan:
    """How the later passes part the rows: a function of the lake alone (so every engine writes
    the same parts), each class whole in one part."""
    buckets = max(1, math.ceil(listed.rows / cfg.rows_per_part))
    return Plan(out=out, staging=staging, content_buckets=buckets, parts=min(buckets, max(1, listed.prefixes)),
                split=dict(cfg.split), seed=cfg.seed, split_method=cfg.split_method, dedupe=cfg.dedupe,
                sniff=cfg.sniff)


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
    reasons = [f"{n} excluded by {kind.removeprefix('excluded: ')}" if kind.startswith("excluded") else
               f"{n} hidden (--include-hidden lists them)" if kind == "hidden" else f"{n} {kind}"
               for kind, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))]
    fix = "; check --exclude" if any(k.startswith("excluded") for k in skipped) else ""
    return (f"all {skipped.total()} objects found under {where} were skipped ({', '.join(reasons)}): none is "
            f"left to build a manifest from{fix}")


def _predicted_counts(cfg: ManifestConfig, labels: dict[str, int], ok: Counter[str], pinned: Counter[str],
                      per_row: dict[str, Counter[str]]) -> dict[str, dict[str, int]]:
    """``counts[channel][label]`` before the split runs: a per-row split's counts came back
    from the workers (``per_row``); the stratified split's follow from the class sizes, but
    for the rows ``--labels`` pins (``pinned`` per class; per channel in ``per_row``)."""
    if cfg.split_method == "stratified":  # the split's quotas of the unpinned rows, plus the pinned (in per_row)
        quotas = {label: class_quotas(ok[label] - pinned[label], cfg.split) for label in labels}
        return {c: {label: quotas[label][c] + per_row[label][c] for label in labels} for c in cfg.split}
    return {c: {label: per_row[label][c] for label in labels} for c in cfg.split}


def transform(cfg: ManifestConfig, engine: Engine, listed: _Listed, plan: Plan,
              join: BaseJoin | None = None) -> tuple[_Checked, dict[str, Any] | None]:
    """Inspect (pass 2; with ``join``, the join with ``--base``'s rows in the same tasks) and
    group by content (pass 3) on the workers; check the aggregates: every rule of
    :func:`jobs.manifest_steps.catalog.build_manifest` that fails a run fails it here, before any manifest
    table is written. Returns them, and the join's report (:func:`jobs.manifest_steps.base.merge_base`)."""
    where = storage.normalize(cfg.input)
    if not listed.rows:
        raise ManifestError(_nothing_listed(where, listed.skipped))
    split_function(cfg.split_method)
    partitions = cfg.partitions or _inspect_tasks(listed.rows, engine.parallelism)
    log.info("listed %d objects; %s in %d tasks", listed.rows,
             "reading their headers" if cfg.sniff else "not reading them (--no-sniff)", partitions)
    report = None
    if join is not None:
        rows, report = join_and_inspect(engine, join, plan, partitions)
        if rows != listed.rows:
            raise ManifestError(f"the join with --base {join.root} gave {rows} rows, {listed.rows} were listed")
    else:
        engine.map_partitions(partial(inspect_task, plan=plan), _slices(listed.parts, partitions),
                              partitions=partitions)  # several slices a task
    results = engine.map_partitions(partial(content_task, plan=plan), list(range(plan.content_buckets)),
                                    partitions=plan.content_buckets)
    ok, pinned, reasons, per_row = Counter[str](), Counter[str](), Counter[str](), defaultdict(Counter)
    for r in results:
        ok.update(r["ok"])
        pinned.update(r["pinned"])
        reasons.update(r["reasons"])
        for label, channels in r["channels"].items():
            per_row[label].update(channels)
    total, removed = sum(r["listed"] for r in results), sum(r["removed"] for r in results)
    labels = check_accepted(listed=total, reasons=reasons, removed=removed, ok_labels=list(ok),
                            max_reject_fraction=cfg.max_reject_fraction, where=where,
                            label_source=(f"--labels {cfg.labels}" if cfg.labels else
                                          f"--input-manifest {cfg.input_manifest}" if cfg.input_manifest else None))
    counts = _predicted_counts(cfg, labels, ok, pinned, per_row)
    check_min_per_class(counts, list(labels), cfg.min_per_class, cfg.split_method)
    return _Checked(listed=total, reasons=reasons, removed=removed, labels=labels, counts=counts,
                    duplicate_groups=sum(r["duplicate_groups"] for r in results)), report


def summarize(cfg: ManifestConfig, listed: _Listed, checked: _Checked, *, parts: int, fingerprint: str,
              duplicates: dict[str, Any], labels_table: dict[str, Any] | None = None,
              base: dict[str, Any] | None = None) -> dict[str, Any]:
    counts = checked.counts
    achieved = {}
    for label in checked.labels:
        total = sum(counts[c][label] for c in counts)
        achieved[label] = {c: round(counts[c][label] / total, 4) for c in counts}
    rejected = checked.reasons.total()
    return {
        "format_version": FORMAT_VERSION,
        "input": storage.normalize(cfg.input),
        "split": cfg.split,
        "split_order": list(cfg.split),  # the channels' order (the hash split's slices are cut in it)
        "split_method": cfg.split_method,
        "seed": cfg.seed,
        "min_per_class": cfg.min_per_class,
        "label_depth": cfg.label_depth,
        # --labels: the table's URI, rows, objects it left unlabelled, rows naming no listed object.
        "labels_table": labels_table,
        # --base: its root and fingerprint; objects reused (not read), new, changed, left, moved.
        "base": base,
        "labels": checked.labels,
        "fingerprint": fingerprint,
        "parts": parts,
        "counts": {
            "listed": checked.listed,
            "accepted": checked.listed - rejected,
            "rejected": rejected,
            "channels": {c: sum(counts[c].values()) for c in counts},
            "classes": counts,
            "skipped": listed.skipped.total(),
        },
        "achieved_fractions": achieved,
        "rejects_by_reason": dict(sorted(checked.reasons.items())),
        # "hidden" (their names vary without bound, as '._*' files do) or "excluded: --exclude GLOB".
        "skipped_by_reason": dict(sorted(listed.skipped.items())),
        "skipped_examples": dict(listed.skipped_examples),
        "exclude": list(cfg.exclude),
        "include_hidden": cfg.include_hidden,
        "dedupe": cfg.dedupe,
        "duplicates": duplicates,
    }


def _remove_tables(out: str) -> None:
    """Delete every manifest table (folders of parts, and a format-2 manifest's files)."""
    fs, path = storage.filesystem(manifests_uri(out))
    try:
        entries = fs.ls(path, detail=False) if fs.exists(path) else []
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.rstrip("/").rsplit("/", 1)[-1] != "_manifest.json":
            storage.remove(("s3://" if out.startswith("s3://") else "file://") + entry, recursive=True)


def load(cfg: ManifestConfig, engine: Engine, listed: _Listed, checked: _Checked, plan: Plan, *,
         labels_table: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Split each class part and write every manifest table's part on the workers (pass 4), the
    duplicate report (pass 5, if there are duplicates), ``labels.json``, then the marker. With
    ``base`` (:func:`rebase`'s report), the marker also counts the objects whose channel is
    not their base channel."""
    plan = replace(plan, labels=checked.labels)
    results = engine.map_partitions(partial(class_task, plan=plan), list(range(plan.parts)), partitions=plan.parts)
    fingerprints = {label: h for r in results for label, h in r["fingerprints"].items()}
    found = [] if not checked.duplicate_groups else engine.map_partitions(
        partial(duplicates_task, plan=plan), list(range(plan.content_buckets)), partitions=plan.content_buckets)
    duplicates = duplicates_report(found, checked.removed)
    if base is not None:
        moved = sorted((e for r in results for e in r["moved_examples"]), key=lambda e: e["key"])[:EXAMPLES]
        base = {**base, "moved": sum(r["moved"] for r in results), "moved_examples": moved}
    summary = summarize(cfg, listed, checked, parts=plan.parts, fingerprint=combine_fingerprints(fingerprints),
                        duplicates=duplicates, labels_table=labels_table, base=base)
    storage.write_json_atomic(labels_uri(plan.out), checked.labels)
    storage.write_json_atomic(manifest_marker_uri(plan.out), summary)  # last: the manifest is complete
    return summary


def _check_bucket(out: str) -> None:
    """Fail before any listing if the output's bucket is missing or denied (never create it)."""
    fs, path = storage.filesystem(out)
    try:
        fs.info(path.split("/", 1)[0])
    except FileNotFoundError:
        raise StorageError(f"cannot write {out}: its bucket does not exist (the job never creates buckets)") from None
    except Exception as exc:
        raise StorageError(f"cannot write {out}: {type(exc).__name__}: {exc}") from exc


def _warn_duplicates(dups: dict[str, Any]) -> None:
    if dups["across_channels"]:
        log.warning("leakage: %d groups of identical images are split across channels (%d objects in %d groups "
                    "of identical content in all; e.g. %s); pass --dedupe to keep one of each",
                    dups["across_channels"], dups["objects"], dups["groups"], dups["examples"][0])
    elif dups["groups"]:
        log.warning("%d objects in %d groups of identical content (each group within one channel; e.g. %s)",
                    dups["objects"], dups["groups"], dups["examples"][0])
    if dups["removed"]:
        log.info("dedupe: rejected %d copies of identical content", dups["removed"])


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
    ``manifests/_manifest.json``."""
    check_manifest_inputs(cfg)
    with hold(cfg):
        return _build(cfg, engine)


def _build(cfg: ManifestConfig, engine: Engine) -> dict[str, Any]:
    """List, label, split and write the manifest (inputs checked, the lock held)."""
    out = storage.normalize(cfg.output)
    if out.startswith("s3://"):
        _check_bucket(out)
    marker = manifest_marker_uri(out)
    replacing = storage.exists(marker) or storage.exists(dataset_json_uri(out))
    if replacing and not cfg.overwrite:
        raise DatasetExistsError(f"{out} already holds a manifest ({marker}); pass --overwrite to replace it")
    storage.remove_temporaries(out)  # half-written files of a killed run
    staging = _staging(out)
    storage.remove(staging, recursive=True)  # a killed run's staged rows
    labels_table = None
    if cfg.input_manifest:  # the objects and their labels from a Ground Truth manifest (jobs/manifest_steps/ground_truth.py)
        gt = read_manifest(engine, uri=cfg.input_manifest, attribute=cfg.label_attribute or "", root=cfg.input,
                           skip=_skip(cfg), rows_per_part=cfg.rows_per_part, staging=staging)
        listed = _Listed(parts=gt.parts, prefixes=max(1, len(gt.labels)), skipped=gt.skipped,
                         skipped_examples=gt.skipped_examples)
        labels_table = gt.summary
    else:
        listed = extract(cfg, engine, staging)
    if cfg.labels:
        listed, labels_table = label(cfg, engine, listed, staging)
    join = base = None
    if cfg.base:
        join, base = rebase(cfg, engine, listed, staging)
    plan = _plan(cfg, out, staging, listed)
    checked, report = transform(cfg, engine, listed, plan, join)
    if base is not None:
        base.update(report or {})
    if replacing:
        # Invalidate only now that the new manifest passed its checks (a run that fails before
        # leaves the old one, and its dataset, readable): no reader may see a dataset whose
        # manifest is being replaced.
        storage.remove(dataset_json_uri(out))
        storage.remove(marker)
    _remove_tables(out)
    summary = load(cfg, engine, listed, checked, plan, labels_table=labels_table, base=base)
    storage.remove(staging, recursive=True)
    _warn_duplicates(summary["duplicates"])
    c = summary["counts"]
    log.info("manifest written to %s: %d listed, %d accepted (%s), %d rejected", out, c["listed"], c["accepted"],
             ", ".join(f"{k}={v}" for k, v in c["channels"].items()), c["rejected"])
    if base := summary["base"]:
        log.info("--base %s: %s", base["root"], _base_counts(base))
        if base["relabelled"]:
            log.warning("%d objects have another label than in --base %s (e.g. %s): each takes its new "
                        "label, as a build without --base gives it", base["relabelled"], base["root"],
                        _relabelled(base))
    return summary


def _relabelled(base: dict[str, Any]) -> str:
    return ", ".join(f"{e['key']}: {e['from']} -> {e['to']}" for e in base["relabelled_examples"])


def _base_counts(base: dict[str, Any]) -> str:
    left = f" (e.g. {', '.join(base['left_examples'])})" if base["left"] else ""
    relabelled = base.get("relabelled") and f", {base['relabelled']} relabelled (e.g. {_relabelled(base)})"
    return (f"{base['unchanged']} unchanged ({base['reused']} not read again), {base['new']} new, {base['changed']} "
            f"changed, {base['left']} left the lake{left}, {base['moved']} moved to another channel"
            f"{relabelled or ''}")


def parser() -> argparse.ArgumentParser:
    return job_parser("jobs/manifest.py", ManifestConfig,
                      description="List a raw image lake (<prefix>/<label>/.../<file>, local, file:// or s3://), "
                                  "label and split it, and write manifests, labels.json and a rejects table.")


def _summary(cfg: ManifestConfig, summary: dict[str, Any]) -> str:
    c = summary["counts"]
    line = (f"manifest: {c['listed']} listed, {c['accepted']} accepted, {c['rejected']} rejected, "
            f"{len(summary['labels'])} classes -> {storage.normalize(cfg.output)}")
    return line + (f"\nbase {summary['base']['root']}: {_base_counts(summary['base'])}" if summary["base"] else "")


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, parser=parser(), config=ManifestConfig, run=run, summary=_summary, prog="jobs/manifest.py",
                   prepare=prepare)


if __name__ == "__main__":
    sys.exit(main())
