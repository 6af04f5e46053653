"""Issue 23, incremental manifests on Spark and Dask: the manifest built with ``--base`` is the one
built from scratch, row for row, on each engine (and the same as the local engine's), with the
counts of what was reused, new, changed and left; the S3 lake on Dask's worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lakeshard import storage
from lakeshard.format import ManifestInfo, read_manifest_info
from tests.helpers.incremental import assert_same_tables, build, grow, write_lake_objects

pytestmark = [pytest.mark.slow]


def _scenario(engine: Any, lake: str, root: str, local_engine: Any) -> None:
    a, b, c, local = (f"{root}/{n}" for n in ("a", "b", "c", "local"))
    before = write_lake_objects(lake)
    build(engine, lake, a, split_method="stratified")
    growth = grow(lake, before)
    summary = build(engine, lake, b, base=a, split_method="stratified")
    build(engine, lake, c, split_method="stratified")
    build(local_engine, lake, local, base=a, split_method="stratified")
    assert_same_tables(b, c)
    assert_same_tables(b, local)
    assert read_manifest_info(local).base == ManifestInfo.from_json(summary).base
    base = summary["base"]
    unchanged = len(before) - len(growth.removed) - len(growth.changed)
    assert (base["unchanged"], base["reused"], base["new"], base["changed"]) == (unchanged, unchanged, 6, 1)
    assert (base["left"], base["left_examples"]) == (3, sorted(growth.removed))


@pytest.mark.spark
def test_spark_base_gives_the_manifest_built_from_scratch(spark_engine, local_engine, tmp_path: Path) -> None:
    root = storage.normalize(str(tmp_path))
    _scenario(spark_engine, f"{root}/lake", root, local_engine)


@pytest.mark.dask
@pytest.mark.s3
def test_dask_base_on_s3_gives_the_manifest_built_from_scratch(
    dask_engine, local_engine, s3_bucket: str
) -> None:
    _scenario(dask_engine, f"{s3_bucket}/raw", f"{s3_bucket}/ds", local_engine)
