"""Manifest job: list a raw image lake, label and split it, write the manifests.

    spark-submit jobs/manifest.py --input s3://lake/raw/pets --output s3://lake/datasets/pets-v1 \\
        --split train=0.8,validation=0.1,test=0.1 --seed 7 --min-per-class 5
    python -m jobs.manifest --engine dask --input ./lake/raw --output ./datasets/pets-v1
    python jobs/manifest.py --conf conf/manifest.yaml --input ./lake/raw --output ./out

Writes, under ``--output``: ``manifests/all.parquet``, ``manifests/<channel>.parquet`` (and a
SageMaker-style ``<channel>.manifest``), ``manifests/rejects.parquet``, ``labels.json``, and
last ``manifests/_manifest.json``, the marker that the shard job waits for.

Extract (list class prefixes on the driver, list each prefix and read each object's first bytes
on the workers) -> transform (:func:`jobs.catalog.build_manifest`: label, split, check) -> load.

Hidden objects (``.DS_Store``, ``._*``, ``.ipynb_checkpoints/``, ``__MACOSX/``, ``Thumbs.db``,
``desktop.ini``) and ``--exclude`` matches are skipped and counted (``counts.skipped``,
``skipped_by_reason`` in ``_manifest.json``); identical content under several keys is reported
(``duplicates``: across channels is leakage), and removed but for one key with ``--dedupe``.
:func:`jobs.inputs.check_manifest_inputs` refuses an output inside the input before any engine starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)
from collections import Counter
from functools import partial
from typing import Any

import pyarrow.parquet as pq

from jobs.catalog import Manifest, build_manifest, fingerprint, sagemaker_manifest
from jobs.engines import Engine
from jobs.engines.cli import job_parser, run_job
from jobs.inputs import check_manifest_inputs
from jobs.inventory import inventory_rows, read_inventory
from jobs.listing import Skip, discover, inspect_objects
from jobs.listing_tasks import list_lake
from jobs.settings import ManifestConfig
from lakeshard import storage
from lakeshard.errors import DatasetExistsError, ManifestError, StorageError
from lakeshard.format import FORMAT_VERSION, dataset_json_uri, labels_uri, manifest_marker_uri, manifests_uri

__all__ = ["main", "run"]

log = logging.getLogger("jobs.manifest")

_EXAMPLES = 5


def _skip(cfg: ManifestConfig) -> Skip:
    return Skip(exclude=tuple(cfg.exclude), include_hidden=cfg.include_hidden)


def _listed(cfg: ManifestConfig, engine: Engine, skip: Skip) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of the lake's objects, not yet inspected: those above the label level (from
    the driver's listing) and the others (listed, or read from ``--inventory``, on the workers)."""
    src = storage.normalize(cfg.input)
    if cfg.inventory:
        inventory = read_inventory(cfg.inventory, bucket=src[len("s3://"):].split("/", 1)[0])
        log.info("reading %d inventory data files of %s on %s", len(inventory.files), inventory.uri, engine.name)
        rows = engine.map_partitions(inventory_rows(inventory, src, label_depth=cfg.label_depth, skip=skip),
                                     list(inventory.files), partitions=len(inventory.files))
        if not rows:
            raise ManifestError(f"--inventory {inventory.uri} lists no object under --input {src}")
        return [], rows
    prefixes, stray = discover(src, label_depth=cfg.label_depth, skip=skip)
    log.info("found %d class prefixes under %s; listing them on %s", len(prefixes), src, engine.name)
    return stray, list_lake(engine, src, prefixes, label_depth=cfg.label_depth, skip=skip,
                            task_objects=cfg.list_task_objects)


def extract(cfg: ManifestConfig, engine: Engine) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every listed object under ``cfg.input``, inspected, as manifest rows; and the objects
    skipped (hidden or excluded), as rows whose ``reason`` says why."""
    stray, listed = _listed(cfg, engine, _skip(cfg))
    skipped = sorted((r for r in stray + listed if r["status"] == "skipped"), key=lambda r: r["key"])
    if skipped:
        log.info("skipped %d hidden or excluded objects (e.g. %s)", len(skipped), skipped[0]["key"])
    stray = [r for r in stray if r["status"] != "skipped"]
    listed = sorted((r for r in listed if r["status"] != "skipped"), key=lambda r: r["key"])
    partitions = cfg.partitions or max(1, min(len(listed), max(2 * engine.parallelism, math.ceil(len(listed) / 2000))))
    log.info("listed %d objects; %s in %d tasks", len(listed),
             "reading their headers" if cfg.sniff else "not reading them (--no-sniff)", partitions)
    inspect = partial(inspect_objects, sniff=cfg.sniff)
    return stray + engine.map_partitions(inspect, listed, partitions=partitions), skipped


def _skip_kind(reason: str) -> str:
    return reason if reason.startswith("excluded") else reason.split(":")[0]


def summarize(cfg: ManifestConfig, manifest: Manifest, skipped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    table = manifest.all
    skipped = skipped or []
    reasons = Counter(r.split(":")[0] for r in manifest.rejects["reason"].to_pylist())
    achieved = {}
    for label in manifest.labels:
        total = sum(manifest.counts[c][label] for c in manifest.counts)
        achieved[label] = {c: round(manifest.counts[c][label] / total, 4) for c in manifest.counts}
    return {
        "format_version": FORMAT_VERSION,
        "input": storage.normalize(cfg.input),
        "split": cfg.split,
        "split_method": cfg.split_method,
        "seed": cfg.seed,
        "min_per_class": cfg.min_per_class,
        "label_depth": cfg.label_depth,
        "labels": manifest.labels,
        "fingerprint": fingerprint(table),
        "counts": {
            "listed": table.num_rows,
            "accepted": table.num_rows - manifest.rejects.num_rows,
            "rejected": manifest.rejects.num_rows,
            "channels": {c: t.num_rows for c, t in manifest.channels.items()},
            "classes": manifest.counts,
            "skipped": len(skipped),
        },
        "achieved_fractions": achieved,
        "rejects_by_reason": dict(sorted(reasons.items())),
        # "hidden" (their names vary without bound, as '._*' files do) or "excluded: --exclude GLOB".
        "skipped_by_reason": dict(sorted(Counter(_skip_kind(r["reason"]) for r in skipped).items())),
        "skipped_examples": {r["key"]: r["reason"] for r in skipped[:_EXAMPLES]},
        "exclude": list(cfg.exclude),
        "include_hidden": cfg.include_hidden,
        "dedupe": cfg.dedupe,
        "duplicates": manifest.duplicates,
    }


def load(cfg: ManifestConfig, manifest: Manifest, summary: dict[str, Any]) -> None:
    out = storage.normalize(cfg.output)
    fs, _ = storage.filesystem(out)
    if not out.startswith("s3://"):  # S3 has no folders; s3fs's makedirs would create a missing bucket
        fs.makedirs(storage.filesystem(manifests_uri(out))[1], exist_ok=True)

    def write(table, name: str) -> None:
        uri = manifests_uri(out, name)
        try:
            pq.write_table(table, storage.filesystem(uri)[1], filesystem=fs)
        except Exception as exc:
            raise StorageError(f"cannot write {uri}: {type(exc).__name__}: {exc}") from exc

    write(manifest.all, "all.parquet")
    write(manifest.rejects, "rejects.parquet")
    for channel, table in manifest.channels.items():
        write(table, f"{channel}.parquet")
        body = sagemaker_manifest(summary["input"], table["key"].to_pylist())
        storage.write_bytes_atomic(manifests_uri(out, f"{channel}.manifest"), json.dumps(body).encode())
    storage.write_json_atomic(labels_uri(out), manifest.labels)
    storage.write_json_atomic(manifest_marker_uri(out), summary)  # last: the manifest is complete


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


def run(cfg: ManifestConfig, engine: Engine) -> dict[str, Any]:
    """Run the job; return the summary written to ``manifests/_manifest.json``."""
    check_manifest_inputs(cfg)
    out = storage.normalize(cfg.output)
    if out.startswith("s3://"):
        _check_bucket(out)
    marker = manifest_marker_uri(out)
    replacing = storage.exists(marker) or storage.exists(dataset_json_uri(out))
    if replacing and not cfg.overwrite:
        raise DatasetExistsError(f"{out} already holds a manifest ({marker}); pass --overwrite to replace it")
    storage.remove_temporaries(out)  # half-written files of a killed run
    rows, skipped = extract(cfg, engine)
    manifest = build_manifest(rows, split=cfg.split, seed=cfg.seed, split_method=cfg.split_method,
                              min_per_class=cfg.min_per_class, max_reject_fraction=cfg.max_reject_fraction,
                              source=storage.normalize(cfg.input), dedupe=cfg.dedupe)
    summary = summarize(cfg, manifest, skipped)
    _warn_duplicates(manifest.duplicates)
    if replacing:
        # Invalidate only now that the new manifest is built (a run that fails before leaves the
        # old one, and its dataset, readable): no reader may see a dataset whose manifest is
        # being replaced.
        storage.remove(dataset_json_uri(out))
        storage.remove(marker)
    load(cfg, manifest, summary)
    c = summary["counts"]
    log.info("manifest written to %s: %d listed, %d accepted (%s), %d rejected", out, c["listed"], c["accepted"],
             ", ".join(f"{k}={v}" for k, v in c["channels"].items()), c["rejected"])
    return summary


def parser() -> argparse.ArgumentParser:
    return job_parser("jobs/manifest.py", ManifestConfig,
                      description="List a raw image lake (<prefix>/<label>/.../<file>, local, file:// or s3://), "
                                  "label and split it, and write manifests, labels.json and a rejects table.")


def _summary(cfg: ManifestConfig, summary: dict[str, Any]) -> str:
    c = summary["counts"]
    return (f"manifest: {c['listed']} listed, {c['accepted']} accepted, {c['rejected']} rejected, "
            f"{len(summary['labels'])} classes -> {storage.normalize(cfg.output)}")


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, parser=parser(), config=ManifestConfig, run=run, summary=_summary, prog="jobs/manifest.py")


if __name__ == "__main__":
    sys.exit(main())
