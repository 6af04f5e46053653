"""The shard plan alone at scale, on synthetic data: no lake, no images on disk.

The shard job's plan has a driver side, :func:`jobs.shard_steps.deal.deal_from_counts` (class counts and the
reject slots in, a small :class:`~jobs.shard_steps.deal.Deal` out), and a worker side
(:mod:`jobs.shard_steps.plan_tasks`: each row's slot by :func:`jobs.shard_steps.deal_rows.class_slots`, then each shard's order
by :func:`jobs.shard_steps.deal_rows.order_shard`). :func:`measure_plan` runs the driver side on ``rows`` rows
in ``classes`` classes over ``num_shards`` shards and measures its time and peak memory (Python
allocations by ``tracemalloc``, and the process's resident set), then runs the worker side's
functions on a sample of ``sample_rows`` synthetic rows and reports their cost per row, which a
run at ``rows`` multiplies over the engine's cores. The worker side's reading and writing of the
slot parts and order files is not included.

:func:`write_manifest` writes a synthetic manifest of any size in the manifest job's on-disk
layout (``docs/format.md``, "Manifest tables") with pyarrow's vectorised kernels (no Python loop
per row), for the shard job's own ``--plan-only`` to run on: one channel, ``train``, of ``rows``
rows in ``classes`` classes of uneven sizes (:func:`class_counts`) as
``manifests/train/part-<i>-of-<n>.parquet`` (every class's rows in the part
:func:`lakeshard.format.manifest_table.label_part` names, each part sorted by key), ``labels.json``
and the commit marker ``manifests/_manifest.json`` with the fields the shard job reads. The
``all``, ``rejects`` and SageMaker tables, which the shard job does not read, are not written;
the objects (``class_XXXX/img_NNNNNNNNNN.png``) do not exist.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from process_peaks import vm_hwm, vm_rss

from jobs.shard_steps.deal import deal_from_counts
from jobs.shard_steps.deal_rows import class_slots, order_shard
from lakeshard.format import (
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    ManifestCounts,
    ManifestInfo,
    manifest_part_uri,
    write_manifest_info,
)
from lakeshard.format.manifest_table import label_part

__all__ = ["class_counts", "measure_plan", "write_manifest"]

_MIB = 1024 * 1024


def class_counts(rows: int, classes: int, *, seed: int) -> dict[int, int]:
    """``rows`` split over ``classes`` classes of uneven sizes (each within ±50 % of the mean)."""
    if classes <= 0 or rows < 3 * classes:
        raise ValueError(f"need at least 3 rows per class, got {rows} rows in {classes} classes")
    weights = np.random.default_rng(seed).uniform(0.5, 1.5, classes)
    exact = weights / weights.sum() * rows
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact)[: rows - int(counts.sum())]] += 1  # the largest remainders
    return {i: int(c) for i, c in enumerate(counts)}


def _deal(counts: dict[int, int], rejected: np.ndarray, *, num_shards: int, seed: int) -> Any:
    return deal_from_counts(
        counts, num_shards=num_shards, seed=seed, channel="train", rejected=rejected.tolist()
    )


def measure_plan(
    *, rows: int, classes: int, num_shards: int, rejects: int, sample_rows: int, seed: int = 0
) -> dict[str, Any]:
    """The driver side's time and peak memory at ``rows`` rows, and the worker side's cost per
    row on ``sample_rows`` rows (see the module docstring)."""
    rss_before = vm_rss(os.getpid()) or 0
    counts = class_counts(rows, classes, seed=seed)
    rejected = np.unique(np.random.default_rng(seed + 1).integers(0, rows, size=rejects))
    t = time.perf_counter()
    deal = _deal(counts, rejected, num_shards=num_shards, seed=seed)
    driver_s = time.perf_counter() - t
    rss_peak = vm_hwm(os.getpid())
    tracemalloc.start()
    _deal(counts, rejected, num_shards=num_shards, seed=seed)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result: dict[str, Any] = {
        "rows": rows,
        "classes": classes,
        "num_shards": num_shards,
        "rejects": len(rejected),
        "driver_s": round(driver_s, 3),
        "driver_traced_peak_mib": round(traced_peak / _MIB, 2),
        "driver_rss_before_mib": round(rss_before / _MIB, 1),
        "driver_rss_peak_mib": round((rss_peak or 0) / _MIB, 1),
        "deal_pickled_bytes": len(pickle.dumps(deal)),
        "deal_exceptions": len(deal.exceptions),
        "rows_per_shard": deal.rows_per_shard,
    }
    result.update(_workers(sample_rows, num_shards=num_shards, seed=seed))
    return result


def _workers(sample_rows: int, *, num_shards: int, seed: int) -> dict[str, Any]:
    """The worker side's functions on ``sample_rows`` rows in 10 classes: wall and CPU time per
    row (timed without ``tracemalloc``, which hooks every allocation and slows this
    allocation-heavy code several times over), then Python allocations per row (a second, traced
    run). ``order_shard`` is given every row for each shard, as in :func:`jobs.shard_steps.deal.plan_of_rows`
    (an order task of the job reads its shard's rows only)."""
    counts = class_counts(sample_rows, 10, seed=seed)
    deal = _deal(counts, np.empty(0, np.int64), num_shards=num_shards, seed=seed)
    keys = {
        c: [f"class_{c:03d}/batch{i % 16:02d}/img_{i:09d}.png" for i in range(n)] for c, n in counts.items()
    }

    def slot() -> np.ndarray:
        return np.concatenate(
            [class_slots(k, seed=seed, channel="train", start=deal.class_start(c)) for c, k in keys.items()]
        )

    def order(table: pa.Table) -> None:
        for s in range(num_shards):
            order_shard(deal, table, s)

    (slots, slot_s, slot_cpu) = _timed(slot)
    table = pa.table({"key": [k for ks in keys.values() for k in ks], "slot": slots})
    (_, order_s, order_cpu) = _timed(lambda: order(table))
    tracemalloc.start()
    order(pa.table({"key": table["key"], "slot": slot()}))
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_row = 1e6 / sample_rows
    return {
        "worker_sample_rows": sample_rows,
        "worker_slot_us_per_row": round(slot_s * per_row, 3),
        "worker_slot_cpu_us_per_row": round(slot_cpu * per_row, 3),
        "worker_order_us_per_row": round(order_s * per_row, 3),
        "worker_order_cpu_us_per_row": round(order_cpu * per_row, 3),
        "worker_traced_bytes_per_row": round(traced / sample_rows, 1),
    }


def _timed(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds and this process's CPU seconds while it ran."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


# -- a synthetic manifest, for the shard job's own --plan-only ------------------------------------
_CHANNEL = "train"


def _class_rows(label: str, index: int, count: int) -> pa.Table:
    numbers = pc.utf8_lpad(
        pc.cast(pa.array(np.arange(count, dtype=np.int64)), pa.string()), width=10, padding="0"
    )
    key = pc.binary_join_element_wise(f"{label}/img_", numbers, ".png", "")
    n = len(key)
    return pa.table(
        {
            "uri": pc.binary_join_element_wise("s3://synthetic-lake/raw/", key, ""),
            "key": key,
            "label": pa.repeat(label, n),
            "label_index": pa.repeat(pa.scalar(index, pa.int64()), n),
            "channel": pa.repeat(_CHANNEL, n),
            "size": pa.repeat(pa.scalar(1000, pa.int64()), n),
            "etag": pa.repeat("0" * 32, n),
            "last_modified": pa.repeat(pa.scalar(0, pa.timestamp("us", tz="UTC")), n),
            "format": pa.repeat("PNG", n),
            "status": pa.repeat("ok", n),
            "reason": pa.nulls(n, pa.string()),
        },
        schema=MANIFEST_SCHEMA,
    )


def write_manifest(
    root: Path, *, rows: int, classes: int, rows_per_part: int = 100_000, seed: int = 0
) -> Path:
    """Write the manifest at ``root`` (a new folder); returns ``root``."""
    counts = class_counts(rows, classes, seed=seed)
    labels = {f"class_{i:04d}": i for i in range(classes)}
    parts = max(1, math.ceil(rows / rows_per_part))
    uri = f"file://{root.resolve()}"
    by_part: dict[int, list[str]] = {}
    for label in labels:
        by_part.setdefault(label_part(label, parts), []).append(label)
    for p in range(parts):
        # Labels in sorted order, numbers zero-padded: each part comes out sorted by key.
        tables = [
            _class_rows(label, labels[label], counts[labels[label]]) for label in sorted(by_part.get(p, []))
        ]
        path = Path(manifest_part_uri(uri, _CHANNEL, p, parts).removeprefix("file://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables) if tables else MANIFEST_SCHEMA.empty_table(), path)
    per_class = {label: counts[i] for label, i in labels.items()}
    marker = ManifestInfo(
        format_version=FORMAT_VERSION,
        input="s3://synthetic-lake/raw",
        split={_CHANNEL: 1.0},
        split_order=[_CHANNEL],
        split_method="hash",
        seed=seed,
        min_per_class=0,
        label_depth=1,
        labels=labels,
        parts=parts,
        fingerprint=hashlib.sha256(f"synthetic {rows} {classes} {seed}".encode()).hexdigest(),
        counts=ManifestCounts(
            listed=rows,
            accepted=rows,
            rejected=0,
            channels={_CHANNEL: rows},
            classes={_CHANNEL: per_class},
            skipped=0,
        ),
        achieved_fractions={label: {_CHANNEL: 1.0} for label in labels},
        rejects_by_reason={},
    )
    (root / "labels.json").write_text(json.dumps(labels, sort_keys=True))
    write_manifest_info(uri, marker)
    return root
