"""Two datasets written from the same lake and seed must be the same dataset, whichever engine
(or cluster) wrote them: compared by content, table by table and shard row by shard row."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pyarrow as pa

from lakeshard import storage
from lakeshard.format import (
    DatasetInfo,
    ManifestInfo,
    read_dataset_info,
    read_manifest_info,
    rejects_uri,
)
from lakeshard.format.manifest_table import iter_parts
from tests.helpers.checks import read_table, sagemaker_refs, shard_tables

__all__ = ["DATASET_JSON_ENGINE_KEYS", "assert_same_dataset", "assert_same_manifest"]

#: The only fields of dataset.json that may differ between engines and runs.
DATASET_JSON_ENGINE_KEYS = ("created_at", "engine", "build")


def _json(uri: str) -> Any:
    return json.loads(storage.read_bytes(uri))


def _assert_tables_equal(a: pa.Table, b: pa.Table, what: str) -> None:
    assert a.schema.equals(b.schema, check_metadata=True), f"{what}: schemas differ:\n{a.schema}\n{b.schema}"
    assert a.num_rows == b.num_rows, f"{what}: {a.num_rows} rows != {b.num_rows} rows"
    for name in a.column_names:
        left, right = a[name].to_pylist(), b[name].to_pylist()
        if left != right:
            i = next(i for i, (x, y) in enumerate(zip(left, right, strict=True)) if x != y)
            raise AssertionError(
                f"{what}: column {name!r} differs first at row {i}: {left[i]!r:.80} != {right[i]!r:.80}"
            )


def assert_same_manifest(a: str, b: str) -> ManifestInfo:
    """labels.json, the manifest marker, every manifest table (row for row) and the
    SageMaker manifests of the datasets at ``a`` and ``b`` are equal; returns the marker."""
    assert _json(storage.join(a, "labels.json")) == _json(storage.join(b, "labels.json"))
    marker = read_manifest_info(a)
    assert marker == read_manifest_info(b)
    for name in ("all", "rejects", *marker.split):
        for i, (x, y) in enumerate(zip(iter_parts(a, name), iter_parts(b, name), strict=True)):
            _assert_tables_equal(x, y, f"manifests/{name} part {i}")
    for channel in marker.split:
        assert sagemaker_refs(a, channel) == sagemaker_refs(b, channel)
    return marker


def assert_same_dataset(a: str, b: str) -> DatasetInfo:
    """The manifests, every shard (rows, order, footer metadata), the shard rejects and
    dataset.json (but for :data:`DATASET_JSON_ENGINE_KEYS`) are equal; returns ``a``'s
    dataset.json."""
    a, b = storage.normalize(a), storage.normalize(b)
    assert_same_manifest(a, b)
    info_a, info_b = read_dataset_info(a), read_dataset_info(b)
    assert replace(info_a, **{key: getattr(info_b, key) for key in DATASET_JSON_ENGINE_KEYS}) == info_b
    for channel in info_a.channels:
        for i, (x, y) in enumerate(
            zip(
                shard_tables(a, channel, info_a.num_shards),
                shard_tables(b, channel, info_b.num_shards),
                strict=True,
            )
        ):
            _assert_tables_equal(x, y, f"shards/{channel}/part {i}")
    # The rejects' row order follows the engine's partitioning, not the data: compare as sets.
    ra, rb = (read_table(rejects_uri(r, i)) for r, i in ((a, info_a), (b, info_b)))
    _assert_tables_equal(ra.sort_by("uri"), rb.sort_by("uri"), "shards/rejects.parquet")
    return info_a
