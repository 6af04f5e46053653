"""The Spark engine's worker daemon (``jobs.common.engines.spark_daemon``): which archives it drops
from the workers' path, and that local Spark tasks really run without them; and how those
workers talk to the executor (Unix sockets, not TCP); and that a worker whose executor closed
its connection exits without a traceback."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.common.engines.spark_daemon import installed_copies, quiet_when_gone


def _package(folder: Path, name: str) -> Path:
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("")
    return folder


def _archive(path: Path, *members: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for m in members:
            z.writestr(m, "")
    return str(path)


def test_pip_layout_drops_the_archives_inside_the_installed_package(tmp_path: Path) -> None:
    site = _package(_package(tmp_path / "site-packages", "pyspark"), "py4j")
    zips = [
        _archive(site / "pyspark/python/lib/pyspark.zip", "pyspark/__init__.py"),
        _archive(site / "pyspark/python/lib/py4j-0.10.9.9-src.zip", "py4j/__init__.py"),
        _archive(site / "pyspark/jars/spark-core_2.13-4.1.4.jar", "org/Foo.class"),
    ]
    other = _archive(tmp_path / "deps.zip", "dep/__init__.py")
    assert installed_copies([*zips, other, str(site)]) == zips


def test_distribution_layout_keeps_everything(tmp_path: Path) -> None:
    """A Spark distribution whose PySpark is only in its archives: nothing to drop."""
    home = tmp_path / "spark-4.1.4-bin"
    zips = [
        _archive(home / "python/lib/pyspark.zip", "pyspark/__init__.py"),
        _archive(home / "python/lib/py4j-0.10.9.9-src.zip", "py4j/__init__.py"),
    ]
    site = _package(tmp_path / "site-packages", "numpy")
    assert installed_copies([*zips, str(site)]) == []


def test_archives_of_another_spark_home_are_kept(tmp_path: Path) -> None:
    """PySpark installed, but SPARK_HOME is a separate distribution: its archives win, as Spark
    intends, so they stay."""
    site = _package(_package(tmp_path / "site-packages", "pyspark"), "py4j")
    zips = [_archive(tmp_path / "opt/spark/python/lib/pyspark.zip", "pyspark/__init__.py")]
    assert installed_copies([*zips, str(site)]) == []


def test_py4j_only_in_its_archive_keeps_everything(tmp_path: Path) -> None:
    site = _package(tmp_path / "site-packages", "pyspark")
    zips = [
        _archive(site / "pyspark/python/lib/pyspark.zip", "pyspark/__init__.py"),
        _archive(site / "pyspark/python/lib/py4j-0.10.9.9-src.zip", "py4j/__init__.py"),
    ]
    assert installed_copies([*zips, str(site)]) == []


def test_a_worker_whose_executor_closed_its_socket_ends_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PySpark's own worker, on a real socket whose other end (the executor's) is closed: it
    # fails to flush and raises (as Spark 4 asks it to), which its daemon printed as a
    # traceback; through quiet_when_gone it ends as a failed task does, with code 1.
    from pyspark import daemon

    monkeypatch.setenv("PYTHON_DAEMON_KILL_WORKER_ON_FLUSH_FAILURE", "1")
    with _signals_kept():
        ours, executors = socket.socketpair()
        executors.close()
        with ours, pytest.raises(BrokenPipeError):
            daemon.worker(ours, True)
        ours, executors = socket.socketpair()
        executors.close()
        with ours:
            assert quiet_when_gone(daemon.worker)(ours, True) == 1


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """This process's handlers of the signals PySpark's ``worker`` resets (it runs in a forked
    worker), put back afterwards."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def _worker_path(_: object) -> list[tuple[list[str], str]]:
    import pyspark

    return [(list(sys.path), pyspark.__file__)]


@pytest.mark.spark
def test_local_spark_tasks_run_without_the_archives(spark_engine) -> None:
    """The session the engine starts runs its Python workers through the daemon: no task has
    Spark's zips or jars on its path, and PySpark comes from the installed package."""
    assert spark_engine.sc.getConf().get("spark.python.daemon.module") == "jobs.common.engines.spark_daemon"
    seen = spark_engine.map_partitions(_worker_path, list(range(4)), partitions=4)
    assert len(seen) == 4
    for path, pyspark_file in seen:
        archives = [p for p in path if p.endswith((".zip", ".jar"))]
        assert not [p for p in archives if "pyspark" in p], archives
        assert ".zip" not in pyspark_file and pyspark_file.endswith("pyspark/__init__.py"), pyspark_file


def _worker_sockets(_: object) -> list[str | None]:
    import os

    return [str(os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED")).lower()]


@pytest.mark.spark
def test_local_spark_workers_talk_over_unix_sockets(spark_engine) -> None:
    """The session the engine starts has its executor reach its Python workers over Unix
    sockets: Spark starts the daemon, and so every worker, in that mode."""
    assert spark_engine.sc.getConf().get("spark.python.unix.domain.socket.enabled") == "true"
    assert spark_engine.map_partitions(_worker_sockets, list(range(2)), partitions=2) == ["true", "true"]


@pytest.mark.parametrize(
    ("version", "unix"),
    [
        ("4.0.1", False),
        ("4.1.0", True),
        ("4.1.0.dev1", True),
        ("4.10.2", True),
        ("5.0.0", True),
        ("3.5.4", False),
    ],
)
def test_unix_sockets_are_asked_for_from_spark_4_1(monkeypatch, version: str, unix: bool) -> None:
    """The engine turns them on only where this PySpark has them (4.1 and later), read from its
    version without a session."""
    import socket

    import pyspark

    from jobs.common.engines.spark_engine import _unix_sockets

    monkeypatch.setattr(pyspark, "__version__", version)
    assert _unix_sockets() is (unix and hasattr(socket, "AF_UNIX"))
