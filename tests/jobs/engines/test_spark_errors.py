"""What a Spark task raises on purpose reaches the driver as itself (Spark passes a worker's
traceback as text), so the CLI prints ``error: cannot read ...`` instead of a JVM stack."""

from __future__ import annotations

import pytest

from jobs.common.engines.spark_engine import SparkEngine
from lakeshard.errors import PlatformError, StorageError

pytestmark = pytest.mark.spark


def test_a_platform_error_in_a_task_is_raised_on_the_driver(spark) -> None:
    engine = SparkEngine(spark=spark)

    def fails(items: list[int]) -> list[int]:
        if 3 in items:
            raise StorageError(f"cannot read s3://lake/cat/{items[0]}.jpg: PermissionError: Access Denied")
        return items

    with pytest.raises(StorageError) as err:
        engine.map_partitions(fails, [1, 2, 3, 4], partitions=4)
    assert str(err.value) == "cannot read s3://lake/cat/3.jpg: PermissionError: Access Denied"
    assert engine.map_partitions(fails, [1, 2], partitions=2) == [1, 2]  # the engine still works


def test_any_other_task_error_is_left_as_spark_raised_it(spark) -> None:
    engine = SparkEngine(spark=spark)

    def fails(items: list[int]) -> list[int]:
        raise ZeroDivisionError("lakeshard.errors.StorageError: looks like ours, is not")

    with pytest.raises(Exception) as err:
        engine.map_partitions(fails, [1], partitions=1)
    assert not isinstance(err.value, PlatformError), type(err.value)
    assert "ZeroDivisionError" in str(err.value)
