"""Shard job: turn the manifests into equal per-GPU Parquet shards of preprocessed images.

    spark-submit jobs/shard.py --dataset s3://lake/datasets/pets-v1 --num-shards 4 --image-size 224
    python -m jobs.shard --engine dask --dataset ./datasets/pets-v1 --num-shards 2

For each channel, writes exactly ``--num-shards`` files ``shards/<channel>/part-0000i-of-0000N.parquet``
with equal row counts and every class spread evenly (at most one apart), rows shuffled within
each shard; images that fail go to ``shards/rejects.parquet``; ``dataset.json`` comes last.

Extract (manifest rows) -> preprocess on the workers (fetch, decode, orient, RGB, resize,
encode) -> plan on the driver from the survivors (:mod:`jobs.plan`) -> route and write on the
workers into a staging folder -> commit: move the staging folder into place, then write
``dataset.json``. A reader sees the old dataset, no dataset, or the new one, never a part.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import hashlib
import json
import logging
import math
import os
import platform
import sys
import uuid
from typing import Any

if __name__ == "__main__" and not __package__:
    # Run as a script (spark-submit jobs/shard.py): import the package, not its siblings.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs import storage
from jobs.config import add_arguments
from jobs.contract import (
    FORMAT_VERSION,
    SHARD_REJECTS_SCHEMA,
    dataset_json_uri,
    manifest_marker_uri,
    manifests_uri,
    shard_name,
    shards_uri,
)
from jobs.engines import Engine
from jobs.engines.cli import run_job
from jobs.errors import DatasetError, DatasetExistsError, RejectFractionError, ShardError
from jobs.report import write_report
from jobs.settings import ShardConfig
from jobs.shards import STAGED_SCHEMA, build_plans, preprocess_batch, shard_rows, write_shard

__all__ = ["dataset_version", "main", "run"]

log = logging.getLogger("jobs.shard")

_MANIFEST_COLUMNS = ["uri", "key", "label", "label_index", "channel"]


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


def _writer(staging: str, channels: list[str], cfg: ShardConfig, version: str):
    n = cfg.num_shards
    row_group_bytes = cfg.row_group_size

    def write(part: int, records) -> dict[str, Any]:
        channel, shard = channels[part // n], part % n
        uri = storage.join(staging, channel, shard_name(shard, n))
        meta = {"dataset_version": version, "channel": channel, "shard_index": shard, "num_shards": n,
                "format_version": FORMAT_VERSION, "image_format": cfg.image_format, "image_size": cfg.image_size}
        stats = write_shard(shard_rows(records), uri, metadata=meta, row_group_bytes=row_group_bytes)
        return {"channel": channel, "shard": shard, **stats}
    return write


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
        "shards": [{"path": f"shards/{channel}/{shard_name(s['shard'], plan.num_shards)}", "rows": s["rows"],
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
        storage.remove(dataset_json_uri(root))  # invalidate first, then rebuild
    staging_root = storage.join(root, "_staging")
    storage.remove(staging_root, recursive=True)  # leftovers of a killed run
    staging = storage.join(staging_root, f"shards-{uuid.uuid4().hex[:12]}")

    known = list(marker["split"])
    channels = [c.strip() for c in cfg.channels.split(",")] if cfg.channels else known
    unknown = [c for c in channels if c not in known]
    if unknown:
        raise ShardError(f"--channels names {unknown}, which the manifest at {root} does not have (it has {known})")
    seed = marker["seed"] if cfg.seed is None else cfg.seed
    labels: dict[str, int] = marker["labels"]
    version = dataset_version(marker["fingerprint"], cfg, seed, channels)

    rows = _read_manifest(root, channels)
    partitions = cfg.partitions or max(1, min(rows.num_rows, max(2 * engine.parallelism, math.ceil(rows.num_rows / 500))))
    log.info("preprocessing %d images (%s) in %d tasks on %s", rows.num_rows, ", ".join(channels), partitions, engine.name)
    fn = functools.partial(preprocess_batch, spec=cfg.image_spec(), threads=cfg.threads)
    staged = engine.preprocess(rows, fn, STAGED_SCHEMA, partitions=partitions)
    try:
        meta = engine.collect(staged, [f.name for f in STAGED_SCHEMA if f.name != "image"])
        rejects = meta.filter(pc.equal(meta["status"], "rejected")).sort_by("key")
        if rejects.num_rows > cfg.max_reject_fraction * max(1, meta.num_rows):
            sample = "; ".join(f"{u}: {r}" for u, r in zip(rejects["uri"].to_pylist()[:5], rejects["reason"].to_pylist()[:5]))
            raise RejectFractionError(
                f"{rejects.num_rows} of {meta.num_rows} images in {root} could not be used "
                f"(> max_reject_fraction={cfg.max_reject_fraction:g}); first: {sample}")
        plan_table, plans, ordered = build_plans(meta, channels, num_shards=cfg.num_shards, seed=seed,
                                                 remainder=cfg.remainder)
        log.info("plan: %s; writing %d shard files", ", ".join(
            f"{c}={plans[c].rows_per_shard}×{cfg.num_shards}" for c in channels), len(channels) * cfg.num_shards)
        stats = engine.write_shards(staged, plan_table, _writer(staging, channels, cfg, version),
                                    num_parts=len(channels) * cfg.num_shards)
    finally:
        engine.release(staged)

    for channel in channels:  # the invariant, counted: exactly num_shards files of equal size
        got = sorted((s["shard"], s["rows"]) for s in stats if s["channel"] == channel)
        want = [(i, plans[channel].rows_per_shard) for i in range(cfg.num_shards)]
        if got != want:
            raise ShardError(f"channel {channel!r}: wrote shards {got}, planned {want}; nothing was committed")

    fs, _ = storage.filesystem(root)
    pq.write_table(rejects.select([f.name for f in SHARD_REJECTS_SCHEMA]).cast(SHARD_REJECTS_SCHEMA),
                   storage.filesystem(storage.join(staging, "rejects.parquet"))[1], filesystem=fs)

    # Commit: the new shards replace the old, then dataset.json makes the dataset visible.
    storage.remove(shards_uri(root), recursive=True)
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
