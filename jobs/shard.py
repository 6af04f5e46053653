"""Shard job: turn the manifests into equal per-GPU Parquet shards of preprocessed images.

    spark-submit jobs/shard.py --dataset s3://lake/datasets/pets-v1 --num-shards 4 --image-size 224
    python -m jobs.shard --engine dask --dataset ./datasets/pets-v1 --num-shards 2

For each channel, writes exactly ``--num-shards`` files ``shards/<channel>/part-0000i-of-0000N.parquet``
with equal row counts and every class spread evenly (at most one apart), rows shuffled within
each shard; images that fail go to ``shards/rejects.parquet``; ``dataset.json`` comes last.

Extract (manifest rows) -> plan on the driver (:mod:`jobs.plan`) -> preprocess on the workers
(fetch, decode, orient, RGB, resize, encode), each task writing its shard's rows straight into
the shard's file in a staging folder -> repair: if images were rejected, re-plan without them
(the plan moves as few rows as it can) and assemble the shards that changed from rows already
preprocessed -> commit: move the staging folder into place, then write ``dataset.json``. A
reader sees the old dataset, no dataset, or the new one, never a part. No image is sent through
the engine: a task reads it from the lake and writes it to its shard.

Resume: the staging folder is named after everything its files depend on, and each
preprocessing task writes a receipt once its file is complete; a rerun of a killed job reuses
every segment with a valid receipt (``--no-resume`` starts over).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import math
import os
import platform
import sys
from itertools import pairwise
from typing import Any

if __name__ == "__main__" and not __package__:
    # Run as a script (spark-submit jobs/shard.py): import the package, not its siblings.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.engines import Engine
from jobs.engines.cli import run_job
from jobs.plan import ShardPlan, make_plan
from jobs.report import write_report
from jobs.settings import ShardConfig
from jobs.shards import (
    OUTCOME_SCHEMA,
    SEGMENT_SCHEMA,
    SOURCE_SCHEMA,
    AssembleTask,
    SegmentTask,
    assemble_shard,
    preprocess_segment,
    read_receipt,
)
from lakeshard import storage
from lakeshard.config import add_arguments
from lakeshard.errors import DatasetError, DatasetExistsError, RejectFractionError, ShardError
from lakeshard.format import (
    FORMAT_VERSION,
    SHARD_REJECTS_SCHEMA,
    dataset_json_uri,
    manifest_marker_uri,
    manifests_uri,
    shard_name,
    shard_relpath,
    shards_uri,
)

__all__ = ["dataset_version", "main", "run"]

log = logging.getLogger("jobs.shard")

_MANIFEST_COLUMNS = ["uri", "key", "label", "label_index", "channel"]

#: Rows preprocessed by one task at most, when ``--partitions`` is not given: a shard with more
#: rows is cut into segments, preprocessed by several tasks and then assembled.
_ROWS_PER_TASK = 2000

#: Inside the staging folder: segment files and spare rows, removed before the commit.
_RUNS = "_runs"


def dataset_version(fingerprint: str, cfg: ShardConfig, seed: int, channels: list[str]) -> str:
    """The dataset's identity: a hash of the manifest's content and every option that changes
    the shards (not the engine: both engines write the same dataset)."""
    spec = {"format_version": FORMAT_VERSION, "manifest": fingerprint, "num_shards": cfg.num_shards,
            "image": [cfg.image_size, cfg.resize, cfg.image_format, cfg.quality, cfg.max_image_pixels],
            "remainder": cfg.remainder, "seed": seed, "channels": channels}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _read_manifest(root: str, channels: list[str]) -> pa.Table:
    fs, _ = storage.filesystem(root)
    tables = []
    for channel in channels:
        path = storage.filesystem(manifests_uri(root, f"{channel}.parquet"))[1]
        tables.append(pq.read_table(path, filesystem=fs, columns=_MANIFEST_COLUMNS))
    return pa.concat_tables(tables)


def _channel_rows(rows: pa.Table, channel: str) -> pa.Table:
    """The channel's manifest rows, sorted by key: the rows the plan indexes."""
    mine = rows.filter(pc.equal(rows["channel"], channel))
    return mine.take(pc.sort_indices(mine, sort_keys=[("key", "ascending")]))


def _rows_by_shard(rows: pa.Table, plan: ShardPlan) -> list[pa.Table]:
    """Each shard's rows in position order (:data:`SEGMENT_SCHEMA`)."""
    order = np.lexsort((plan.position, plan.shard))
    source = pa.array(plan.source[order], pa.int64())
    table = pa.table({"uri": rows["uri"].take(source), "key": rows["key"].take(source),
                      "label_index": rows["label_index"].take(source),
                      "is_pad": pa.array(plan.is_pad[order], pa.bool_())}, schema=SEGMENT_SCHEMA)
    cuts = np.searchsorted(plan.shard[order], np.arange(plan.num_shards + 1))
    return [table.slice(int(a), int(b - a)) for a, b in pairwise(cuts)]


def _segment_tasks(staging: str, ordered: dict[str, pa.Table], plans: dict[str, ShardPlan], cfg: ShardConfig,
                   meta: dict[str, Any], *, segment_rows: int, decode_threads: int) -> list[SegmentTask]:
    """Preprocessing tasks for the first plan: each shard whole into its file, or, if it has more
    than ``segment_rows`` rows, in segments written apart and assembled afterwards. The rows the
    remainder policy left out are preprocessed too (a spare task per channel), in case rejects
    change the plan."""
    tasks = []

    def task(uri: str, rows: pa.Table, channel: str, shard: int) -> SegmentTask:
        receipt = storage.join(staging, _RUNS, "receipts", uri[len(staging) + 1 :])
        return SegmentTask(uri=uri, rows=rows, spec=cfg.image_spec(), threads=cfg.threads, receipt=receipt,
                           decode_threads=decode_threads,
                           row_group_bytes=cfg.row_group_size, metadata={**meta, "channel": channel, "shard_index": shard})

    for channel, plan in plans.items():
        rows = ordered[channel]
        for shard, mine in enumerate(_rows_by_shard(rows, plan)):
            pieces = max(1, round(mine.num_rows / segment_rows))  # segments of 0.67-1.5x segment_rows
            if pieces == 1:
                tasks.append(task(storage.join(staging, channel, shard_name(shard, cfg.num_shards)), mine, channel, shard))
                continue
            size = math.ceil(mine.num_rows / pieces)
            for j in range(pieces):
                uri = storage.join(staging, _RUNS, channel, f"{shard:05d}-{j:05d}.parquet")
                tasks.append(task(uri, mine.slice(j * size, size), channel, shard))
        if len(plan.dropped):
            spare = rows.take(pa.array(plan.dropped, pa.int64()))
            spare = pa.table({"uri": spare["uri"], "key": spare["key"], "label_index": spare["label_index"],
                              "is_pad": pa.array([False] * spare.num_rows)}, schema=SEGMENT_SCHEMA)
            tasks.append(task(storage.join(staging, _RUNS, channel, "spare.parquet"), spare, channel, -1))
    return tasks


def _staging(staging_root: str, version: str, cfg: ShardConfig, segment_rows: int, *, resume: bool) -> str:
    """This job's staging folder, named after everything its files depend on, so a rerun of an
    interrupted job finds the segments it finished (``resume``); any other staging folder is a
    leftover of a job with other settings, and is removed."""
    key = {"dataset_version": version, "versions": _versions(), "code": _preprocessing_code(),
           "segment_rows": segment_rows, "row_group_bytes": cfg.row_group_size}
    name = "shards-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    staging = storage.join(staging_root, name)
    fs, path = storage.filesystem(staging_root)
    try:
        children = [c.rstrip("/").rsplit("/", 1)[-1] for c in fs.ls(path, detail=False)]
    except FileNotFoundError:
        children = []
    for child in children:
        if not resume or child != name:
            storage.remove(storage.join(staging_root, child), recursive=True)
    return staging


def _preprocessing_code() -> str:
    """A hash of the source of the modules that decide a segment file's bytes: an edited
    preprocessing step must not reuse files the old one wrote."""
    from jobs import images, shards
    from lakeshard.format import layout as contract

    digest = hashlib.sha256()
    for module in (images, shards, contract):
        digest.update(module.__loader__.get_data(module.__file__))  # works from a --py-files zip too
    return digest.hexdigest()[:16]


def _finished(staging: str, tasks: list[SegmentTask]) -> dict[str, dict[str, Any]]:
    """The results of the segments an earlier run of this job finished: those whose receipt is
    there, names the same rows, and whose file has the size the receipt says (one listing, then
    one read per receipt)."""
    fs, path = storage.filesystem(staging)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    by_receipt = {storage.filesystem(t.receipt)[1]: t for t in tasks if t.receipt is not None}
    hits = [p for p in found if p in by_receipt]
    reused: dict[str, dict[str, Any]] = {}
    for p, data in (fs.cat(hits) if hits else {}).items():
        task = by_receipt[p]
        try:
            result = read_receipt(data)
        except Exception as exc:  # a receipt is written whole; still, never trust a bad one
            log.warning("ignoring the unreadable receipt %s: %s", p, exc)
            continue
        segment = found.get(storage.filesystem(task.uri)[1])
        if (result["uri"] == task.uri and segment is not None and segment["size"] == result["stats"]["bytes"]
                and result["outcomes"]["uri"].equals(task.rows["uri"])):
            reused[task.uri] = result
    return reused


def _pack(items: list[Any], sizes: list[int], bins: int) -> list[list[Any]]:
    """``items`` in at most ``bins`` groups of nearly equal total size (largest first into the
    lightest group), largest group first. An engine task costs tenths of a second to schedule
    here (PySpark), so many small shards share a task rather than each taking one."""
    groups: list[list[Any]] = [[] for _ in range(max(1, min(bins, len(items))))]
    loads = [0] * len(groups)
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
        g = loads.index(min(loads))
        groups[g].append(items[i])
        loads[g] += sizes[i]
    return [g for _, g in sorted(zip(loads, groups, strict=True), key=lambda lg: -lg[0]) if g]


class _each:
    """``fn`` on every item of a partition of groups: an engine's ``map_partitions`` function
    (a class, so it pickles by reference)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, groups: list[list[Any]]) -> list[Any]:
        return [self.fn(item) for group in groups for item in group]


def _rejects(rows: pa.Table, outcomes: pa.Table) -> pa.Table:
    """One row per manifest row that could not be used (:data:`SHARD_REJECTS_SCHEMA`), by key.
    A row preprocessed twice (a pad copy) is one reject."""
    failed = outcomes.filter(pc.is_null(outcomes["row"]))
    reason: dict[str, str] = {}
    for uri, why in zip(failed["uri"].to_pylist(), failed["reason"].to_pylist(), strict=True):
        reason.setdefault(uri, why)
    hit = rows.filter(pc.is_in(rows["uri"], value_set=pa.array(list(reason), pa.string())))
    hit = hit.append_column("reason", pa.array([reason[u] for u in hit["uri"].to_pylist()], pa.string()))
    return hit.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA).sort_by("key")


def _assemble_tasks(staging: str, ordered: dict[str, pa.Table], plans: dict[str, ShardPlan],
                    tasks: list[SegmentTask], outcomes: pa.Table, cfg: ShardConfig,
                    meta: dict[str, Any]) -> tuple[list[AssembleTask], dict[tuple[str, int], str]]:
    """Compare the final plan with what preprocessing wrote. A shard written whole whose rows are
    the plan's, in its order, is done; every other shard is assembled from preprocessed rows
    (its own segments first, then rows the repair moved in from other shards).

    Returns the assemble tasks and, by (channel, shard), the file that holds each shard once they
    are done (an assembled shard is written beside and moved into place afterwards).
    """
    ok = outcomes.filter(pc.is_valid(outcomes["row"]))
    anywhere: dict[str, tuple[str, int]] = {}
    by_file: dict[str, list[tuple[str, int]]] = {}
    for uri, file, row in zip(ok["uri"].to_pylist(), ok["file"].to_pylist(), ok["row"].to_pylist(), strict=True):
        anywhere.setdefault(uri, (file, row))
        by_file.setdefault(file, []).append((uri, row))
    written_rows = {t.uri: t.rows for t in tasks}
    files_of: dict[tuple[str, int], list[str]] = {}
    for t in tasks:
        files_of.setdefault((t.metadata["channel"], t.metadata["shard_index"]), []).append(t.uri)

    repairs: list[AssembleTask] = []
    final: dict[tuple[str, int], str] = {}
    for channel, plan in plans.items():
        for shard, want in enumerate(_rows_by_shard(ordered[channel], plan)):
            uri = storage.join(staging, channel, shard_name(shard, cfg.num_shards))
            final[(channel, shard)] = uri
            if uri in written_rows:
                have = written_rows[uri]
                have = have.filter(pc.is_in(have["uri"], value_set=ok["uri"]))
                if have.select(["uri", "is_pad"]).equals(want.select(["uri", "is_pad"])):
                    continue
            own = {u: (f, r) for f in files_of[(channel, shard)] for u, r in by_file.get(f, [])}
            where = [own.get(u) or anywhere[u] for u in want["uri"].to_pylist()]
            sources = pa.table({"file": [f for f, _ in where], "row": [r for _, r in where],
                                "is_pad": want["is_pad"]}, schema=SOURCE_SCHEMA)
            # Assembled beside, moved into place when every assembly is done: this shard's file
            # may be another assembly's source.
            repairs.append(AssembleTask(uri=storage.join(staging, _RUNS, "assembled", channel, shard_name(shard, cfg.num_shards)),
                                        sources=sources, row_group_bytes=cfg.row_group_size,
                                        metadata={**meta, "channel": channel, "shard_index": shard}))
            final[(channel, shard)] = repairs[-1].uri
    read = {f for t in repairs for f in t.sources["file"].unique().to_pylist()}
    if overwritten := read & {t.uri for t in repairs}:  # assemblies run at the same time
        raise ShardError(f"an assembly would overwrite a file other assemblies read: {sorted(overwritten)[:3]}")
    return repairs, final


def _channel_entry(channel: str, plan, ordered: pa.Table, stats: list[dict[str, Any]],
                   labels: dict[str, int], rejected: int) -> dict[str, Any]:
    names = {str(i): name for name, i in labels.items()}
    shards = sorted((s for s in stats if s["channel"] == channel), key=lambda s: s["shard"])
    uris = ordered["uri"]
    return {
        "rows": sum(s["rows"] for s in shards),
        "rows_per_shard": plan.rows_per_shard,
        "rejected": rejected,
        "dropped": uris.take(pa.array(plan.dropped, pa.int64())).to_pylist(),
        "padded": uris.take(pa.array(plan.padded, pa.int64())).to_pylist(),
        "class_counts": {names[k]: v for k, v in sorted(
            _sum_counts(s["label_counts"] for s in shards).items(), key=lambda kv: int(kv[0]))},
        "shards": [{"path": shard_relpath(channel, s["shard"], plan.num_shards), "rows": s["rows"],
                    "bytes": s["bytes"], "sha256": s["sha256"], "row_groups": s["row_groups"],
                    "class_counts": {names[k]: v for k, v in s["label_counts"].items()}} for s in shards],
    }


def _sum_counts(items) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in items:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total


def _versions() -> dict[str, str]:
    import numpy
    import PIL

    return {"python": platform.python_version(), "pyarrow": pa.__version__, "pillow": PIL.__version__,
            "numpy": numpy.__version__}


def run(cfg: ShardConfig, engine: Engine) -> dict[str, Any]:
    """Run the job; return what it wrote to ``dataset.json``."""
    root = storage.normalize(cfg.dataset)
    marker_uri = manifest_marker_uri(root)
    if not storage.exists(marker_uri):
        raise DatasetError(f"no complete manifest at {root}: {marker_uri} is missing; run jobs/manifest.py first")
    marker = storage.read_json(marker_uri)
    if storage.exists(dataset_json_uri(root)):
        if not cfg.overwrite:
            raise DatasetExistsError(f"{root} already holds a complete dataset; pass --overwrite to rebuild it")
        # The old dataset stays readable until the commit below: a run that fails (a denied
        # object, an outage) or is killed before it leaves it as it was.
    staging_root = storage.join(root, "_staging")
    storage.remove_temporaries(root)  # a killed run's half-written files (kept staging included)

    known = list(marker["split"])
    channels = [c.strip() for c in cfg.channels.split(",")] if cfg.channels else known
    unknown = [c for c in channels if c not in known]
    if unknown:
        raise ShardError(f"--channels names {unknown}, which the manifest at {root} does not have (it has {known})")
    seed = marker["seed"] if cfg.seed is None else cfg.seed
    labels: dict[str, int] = marker["labels"]
    version = dataset_version(marker["fingerprint"], cfg, seed, channels)

    rows = _read_manifest(root, channels)
    ordered = {c: _channel_rows(rows, c) for c in channels}
    meta = {"dataset_version": version, "num_shards": cfg.num_shards, "format_version": FORMAT_VERSION,
            "image_format": cfg.image_format, "image_size": cfg.image_size}
    def plan(channel: str, rejected: Any = None) -> ShardPlan:
        rows = ordered[channel]
        return make_plan(rows["key"].to_pylist(), rows["label_index"].to_pylist(), num_shards=cfg.num_shards,
                         seed=seed, channel=channel, remainder=cfg.remainder, rejected=rejected)

    first = {c: plan(c) for c in channels}
    # One task per core, or more when each would get over _ROWS_PER_TASK rows. A task uses its
    # core to the end whatever the others do: fewer, longer tasks leave fewer gaps between tasks.
    wanted = cfg.partitions or max(engine.parallelism, math.ceil(rows.num_rows / _ROWS_PER_TASK))
    segment_rows = math.ceil(rows.num_rows / wanted)
    staging = _staging(staging_root, version, cfg, segment_rows, resume=cfg.resume)
    tasks = _segment_tasks(staging, ordered, first, cfg, meta, segment_rows=segment_rows,
                           decode_threads=cfg.decode_threads or engine.task_cpus)
    reused = _finished(staging, tasks)
    todo = [t for t in tasks if t.uri not in reused]
    if reused:
        log.info("resuming: %d of %d segments (%d images) were preprocessed by an interrupted run of this job; "
                 "reusing them (--no-resume starts over)", len(reused), len(tasks),
                 sum(r["outcomes"].num_rows for r in reused.values()))
    # Engine tasks in a multiple of the cores, so the last round of tasks keeps every core busy.
    slots = engine.parallelism * math.ceil(wanted / engine.parallelism)
    bins = _pack(todo, [t.rows.num_rows for t in todo], slots)
    log.info("preprocessing %d images (%s) straight into %d shard files: %d segments in %d tasks on %s",
             sum(t.rows.num_rows for t in todo), ", ".join(channels), len(channels) * cfg.num_shards, len(todo),
             len(bins), engine.name)
    done = engine.map_partitions(_each(preprocess_segment), bins, partitions=len(bins)) if bins else []
    decoded = sum(d["outcomes"].num_rows for d in done)
    done = [*reused.values(), *done]
    outcomes = pa.concat_tables([d["outcomes"] for d in done]) if done else OUTCOME_SCHEMA.empty_table()
    written = {d["uri"]: d["stats"] for d in done}

    rejects = _rejects(rows, outcomes)
    if rejects.num_rows > cfg.max_reject_fraction * max(1, rows.num_rows):
        sample = "; ".join(f"{u}: {r}" for u, r in zip(rejects["uri"].to_pylist()[:5], rejects["reason"].to_pylist()[:5]))
        raise RejectFractionError(
            f"{rejects.num_rows} of {rows.num_rows} images in {root} could not be used "
            f"(> max_reject_fraction={cfg.max_reject_fraction:g}); first: {sample}")
    rejected = rejects["uri"]
    plans = {}
    for c in channels:  # a channel with no rejects keeps its first plan
        hit = pc.is_in(ordered[c]["uri"], value_set=rejected).to_numpy(zero_copy_only=False)
        plans[c] = plan(c, hit) if hit.any() else first[c]
    log.info("plan: %s", ", ".join(f"{c}={plans[c].rows_per_shard}×{cfg.num_shards}" for c in channels))
    repairs, final = _assemble_tasks(staging, ordered, plans, tasks, outcomes, cfg, meta)
    if repairs:
        log.info("assembling %d of %d shard files from preprocessed rows (%d images rejected)", len(repairs),
                 len(channels) * cfg.num_shards, rejects.num_rows)
        bins = _pack(repairs, [t.sources.num_rows for t in repairs], slots)
        written.update({d["uri"]: d["stats"] for d in engine.map_partitions(
            _each(assemble_shard), bins, partitions=len(bins))})
    stats = [{"channel": c, "shard": s, **written[uri]} for (c, s), uri in final.items()]
    moves = {uri: storage.join(staging, channel, shard_name(shard, cfg.num_shards)) for (channel, shard), uri in final.items()}
    moves = {uri: target for uri, target in moves.items() if uri != target}
    replaced = set(moves.values())
    for task in tasks:  # a segment file about to be replaced: its receipt no longer vouches for it
        if task.uri in replaced:
            storage.remove(task.receipt)
    for uri, target in moves.items():
        storage.replace(uri, target)

    for channel in channels:  # the invariant, counted: exactly num_shards files of equal size
        got = sorted((s["shard"], s["rows"]) for s in stats if s["channel"] == channel)
        want = [(i, plans[channel].rows_per_shard) for i in range(cfg.num_shards)]
        if got != want:
            raise ShardError(f"channel {channel!r}: wrote shards {got}, planned {want}; nothing was committed")
    storage.remove(storage.join(staging, _RUNS), recursive=True)

    fs, _ = storage.filesystem(root)
    pq.write_table(rejects.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA),
                   storage.filesystem(storage.join(staging, "rejects.parquet"))[1], filesystem=fs)

    # Commit: invalidate the old dataset, the new shards replace the old, then dataset.json
    # makes the dataset visible.
    storage.remove(dataset_json_uri(root))
    storage.remove(shards_uri(root), recursive=True)
    storage.remove_temporaries(staging)  # a killed client's tasks may still have been writing
    storage.move(staging, shards_uri(root))
    storage.remove(staging_root, recursive=True)
    reject_counts = {c: int(pc.sum(pc.equal(rejects["channel"], c)).as_py() or 0) for c in channels}
    info = {
        "format_version": FORMAT_VERSION,
        "dataset_version": version,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "engine": engine.name,
        "inputs": {"lake": marker["input"], "manifest_fingerprint": marker["fingerprint"],
                   "split": marker["split"], "split_method": marker["split_method"], "manifest_seed": marker["seed"]},
        "seed": seed,
        "labels": labels,
        "num_classes": len(labels),
        "image": {"size": cfg.image_size, "format": cfg.image_format, "quality": cfg.quality,
                  "resize": cfg.resize, "max_pixels": cfg.max_image_pixels},
        "num_shards": cfg.num_shards,
        "remainder": cfg.remainder,
        "row_group_bytes": cfg.row_group_size,
        "counts": {
            "listed": marker["counts"]["listed"],
            "manifest_rejects": marker["counts"]["rejected"],
            "shard_rejects": rejects.num_rows,
            "dropped": sum(len(p.dropped) for p in plans.values()),
            "padded": sum(int(p.is_pad.sum()) for p in plans.values()),
        },
        # How this run made the shards (depends on the engine's parallelism, not part of the
        # dataset's identity): preprocessing tasks, images decoded (each once; pad copies
        # count), and shard files assembled again because rejects changed the plan or the
        # shard was cut into segments.
        "build": {"preprocess_tasks": len(todo), "preprocessed": decoded, "reused_segments": len(reused),
                  "assembled_shards": len(repairs)},
        "channels": {c: _channel_entry(c, plans[c], ordered[c], stats, labels, reject_counts[c]) for c in channels},
        "versions": _versions(),
    }
    write_report(root, info)  # a failure here fails the job before the dataset is committed
    storage.write_json_atomic(dataset_json_uri(root), info)
    log.info("dataset %s committed at %s", version, root)
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jobs/shard.py",
        description="Preprocess the images of a manifest (decode, EXIF orientation, RGB, resize, encode) and write, "
                    "for each channel, exactly --num-shards Parquet shards of equal size, one per target GPU.",
        epilog="Options also come from a YAML file (--conf conf/shard.yaml); flags override it.",
    )
    add_arguments(p, ShardConfig)
    return p


def _summary(cfg: ShardConfig, info: dict[str, Any]) -> str:
    rows = ", ".join(f"{c}={e['rows_per_shard']}×{info['num_shards']}" for c, e in info["channels"].items())
    return (f"shards: {rows} rows, {info['counts']['shard_rejects']} rejected, "
            f"version {info['dataset_version']} -> {storage.normalize(cfg.dataset)}")


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, parser=parser(), config=ShardConfig, run=run, summary=_summary, prog="jobs/shard.py")


if __name__ == "__main__":
    sys.exit(main())
