"""A local Spark session's tasks run in the driver's store environment as it is at the map, not
the one the session's JVM started with (a notebook or a test session started before the store's
settings were set): set late, it is there; removed, it is gone; other variables are not sent."""

from __future__ import annotations

import os

from jobs.common.engines import store_environ
from jobs.common.engines.spark_engine import SparkEngine

_LATE = ("AZURE_STORAGE_SAS_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS", "LAKESHARD_TEST_SET_LATE")


def _seen(items: list[int]) -> list[tuple[int, tuple[str | None, ...]]]:
    return [(i, tuple(os.environ.get(k) for k in _LATE)) for i in items]


def test_store_environ_takes_the_variables_stores_read() -> None:
    env = {"AWS_REGION": "r", "AZURE_STORAGE_ACCOUNT_NAME": "a", "STORAGE_EMULATOR_HOST": "h", "HOME": "/h"}
    assert store_environ(env) == {k: v for k, v in env.items() if k != "HOME"}


def test_local_spark_tasks_get_the_drivers_store_environment_at_the_map(spark, monkeypatch) -> None:
    engine = SparkEngine(spark=spark)  # the session (and its Python workers) started before these
    for name in _LATE:
        monkeypatch.setenv(name, f"late {name}")
    got = engine.map_partitions(_seen, list(range(4)), partitions=2)
    assert sorted(i for i, _ in got) == list(range(4))
    assert {env for _, env in got} == {
        ("late AZURE_STORAGE_SAS_TOKEN", "late GOOGLE_APPLICATION_CREDENTIALS", None)
    }
    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN")
    got = engine.map_partitions(_seen, list(range(4)), partitions=2)  # the same workers, reused
    assert {env for _, env in got} == {(None, "late GOOGLE_APPLICATION_CREDENTIALS", None)}
