"""A synthetic manifest of any size, in the manifest job's on-disk layout (``docs/format.md``,
"Manifest tables"), written with pyarrow's vectorised kernels: no lake, no Python loop per row.

:func:`write_manifest` writes one channel, ``train``, of ``rows`` rows in ``classes`` classes of
uneven sizes (:func:`plan_alone.class_counts`) as the manifest job lays it out:
``manifests/train/part-<i>-of-<n>.parquet`` (``MANIFEST_SCHEMA``; every class's rows in the part
:func:`lakeshard.format.manifest_table.label_part` names, each part sorted by key; ``n`` parts of about
``rows_per_part`` rows), ``labels.json`` and the commit marker ``manifests/_manifest.json`` (the
fields the shard job reads: ``split``, ``seed``, ``labels``, ``fingerprint``, ``parts``,
``counts``). The ``all``, ``rejects`` and SageMaker tables, which the shard job does not read,
are not written. Keys are ``class_XXXX/img_NNNNNNNNNN.png``; the objects do not exist, so the
shard job can run on it only with ``--plan-only``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from plan_alone import class_counts

from lakeshard.format import (
    FORMAT_VERSION,
    MANIFEST_SCHEMA,
    ManifestCounts,
    ManifestInfo,
    manifest_part_uri,
    write_manifest_info,
)
from lakeshard.format.manifest_table import label_part

__all__ = ["write_manifest"]

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
