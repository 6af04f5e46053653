"""What a Spark task raises on purpose reaches the driver as itself (Spark passes a worker's
traceback as text), so the CLI prints ``error: cannot read ...`` instead of a JVM stack. The tests
with a session are ``slow`` (tests/conftest.py marks them); the reading of the text is quick."""

from __future__ import annotations

import pytest

from jobs.common.engines.spark_engine import SparkEngine, _task_error
from lakeshard.errors import PlatformError, ShardError, StorageError


def test_the_error_is_rebuilt_from_the_last_of_ours_in_the_text_spark_passes_on() -> None:
    """As a ``PythonException`` carries it: the worker's traceback, one of our errors on its last
    line (a chained traceback names the error it led to last); text naming no error of ours gives
    ``None``, and the engine re-raises what Spark raised."""
    trace = (
        "An exception was thrown from the Python worker. Please see the stack trace below.\n"
        "Traceback (most recent call last):\n"
        '  File "/work/jobs/shard_steps/preprocess.py", line 40, in read\n'
        "lakeshard.errors.ShardError: shard 3 is short\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "lakeshard.errors.StorageError: cannot read s3://lake/cat/3.jpg: PermissionError: Access Denied\n"
    )
    got = _task_error(RuntimeError(trace))
    assert type(got) is StorageError
    assert str(got) == "cannot read s3://lake/cat/3.jpg: PermissionError: Access Denied"
    assert type(_task_error(RuntimeError("lakeshard.errors.ShardError: shard 3 is short"))) is ShardError
    assert _task_error(RuntimeError("ZeroDivisionError: division by zero")) is None
    assert _task_error(RuntimeError("lakeshard.errors.NoSuchError: not a class of ours")) is None
    assert _task_error(RuntimeError("  lakeshard.errors.StorageError: indented, not a last line")) is None


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
