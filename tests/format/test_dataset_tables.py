"""``<dataset>/shards`` read as one table, by the readers users have: every shard row of every
channel, with its channel (Hive-style ``channel=<name>`` folders), and nothing else (the shard
rejects live outside ``shards/``). The dataset is built by the real jobs on the Spark fixture."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from jobs.common.engines.local_engine import LocalEngine
from lakeshard.format import (
    SHARD_REJECTS_SCHEMA,
    SHARD_SCHEMA,
    read_dataset_info,
    shard_rejects_uri,
    shards_uri,
)
from tests.helpers.checks import read_table, shard_tables
from tests.helpers.datasets import build_dataset_with_rejects


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Built by the real jobs (in-process engine: the readers below are what is tested)."""
    engine = LocalEngine(workers=2)
    return build_dataset_with_rejects(
        engine, tmp_path_factory.mktemp("tables"), {"ant": 9, "bee": 8, "cat": 7}, seed=3
    )


@pytest.fixture(scope="module")
def expected(dataset: Path) -> Counter:
    """``(channel, uri, is_pad)`` of every row of every shard file, read file by file."""
    info = read_dataset_info(str(dataset))
    rows: Counter = Counter()
    for channel in info.channels:
        for table in shard_tables(str(dataset), channel, info.num_shards):
            rows.update(
                (channel, u, p) for u, p in zip(table["uri"].to_pylist(), table["is_pad"].to_pylist())
            )
    assert sum(rows.values()) == sum(c.rows for c in info.channels.values()) > 0
    assert len({c for c, _, _ in rows}) == len(info.channels) == 3
    return rows


def _rows(records: list[dict[str, Any]]) -> Counter:
    return Counter((str(r["channel"]), r["uri"], bool(r["is_pad"])) for r in records)


def _check_columns(names: list[str]) -> None:
    assert sorted(names) == sorted([*SHARD_SCHEMA.names, "channel"])


def test_the_shard_rejects_are_outside_shards(dataset: Path):
    rejects = read_table(shard_rejects_uri(str(dataset)))
    assert rejects.schema.equals(SHARD_REJECTS_SCHEMA) and rejects.num_rows == 1  # the truncated JPEG
    assert not any(p.name == "rejects.parquet" for p in (dataset / "shards").rglob("*"))


def test_pandas_reads_every_shard_row_with_its_channel(dataset: Path, expected: Counter):
    import pandas as pd

    frame = pd.read_parquet(shards_uri(str(dataset)).removeprefix("file://"))
    _check_columns(list(frame.columns))
    assert _rows(frame.to_dict("records")) == expected


def test_pyarrow_reads_every_shard_row_with_its_channel(dataset: Path, expected: Counter):
    path = shards_uri(str(dataset)).removeprefix("file://")
    for table in (pq.read_table(path), pads.dataset(path, partitioning="hive").to_table()):
        _check_columns(table.column_names)
        assert _rows(table.select(["channel", "uri", "is_pad"]).to_pylist()) == expected


@pytest.mark.dask
def test_dask_reads_every_shard_row_with_its_channel(dataset: Path, expected: Counter):
    import dask.dataframe as dd

    frame = dd.read_parquet(shards_uri(str(dataset)).removeprefix("file://")).compute()
    _check_columns(list(frame.columns))
    assert _rows(frame.to_dict("records")) == expected


@pytest.mark.spark
def test_spark_reads_every_shard_row_with_its_channel(spark, dataset: Path, expected: Counter):
    frame = spark.read.parquet(shards_uri(str(dataset)))
    _check_columns(frame.columns)
    assert _rows([r.asDict() for r in frame.select("channel", "uri", "is_pad").collect()]) == expected
