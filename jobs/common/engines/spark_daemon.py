"""PySpark's Python worker daemon, minus the archive copies of an installed PySpark on its path.

In local mode the Spark engine starts its Python workers through this module
(``spark.python.daemon.module``; on a cluster, a ``--conf`` of yours).
Spark puts ``$SPARK_HOME/python/lib/pyspark.zip``, ``py4j-*.zip`` and the ``spark-core`` jar at
the head of every Python worker's ``sys.path``, and PySpark calls ``importlib.invalidate_caches()``
at the start of every task (``pyspark.worker_util.setup_spark_files``). Before Python 3.12 that
re-reads the central directory of every archive the import system has opened (CPython
gh-103200): the 15 MB ``spark-core`` jar holds 5,000 entries and ``pyspark.zip`` 1,500. Measured
on this 2-core machine it cost each task 0.2-0.5 s, even for a task that does nothing.

When PySpark is installed as a package (``pip install pyspark``, so ``SPARK_HOME`` is that
package), those archives are files inside that same package: copies of what is already
importable. This daemon drops them (and their cached importers) from ``sys.path`` before the
workers are forked, then runs PySpark's own daemon. With a Spark distribution whose PySpark is
only in its archives, or whose archives are not part of the installed package, nothing changes.

A worker whose connection the executor has closed (Spark's stop closes its idle workers') exits
quietly: PySpark's worker fails to flush into the closed socket, and its daemon printed that
``BrokenPipeError``'s traceback at the end of some builds, with nobody left to report to.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import Callable
from importlib.machinery import PathFinder

__all__ = ["installed_copies", "main", "quiet_when_gone"]


def installed_copies(path: list[str]) -> list[str]:
    """The archive entries of ``path`` that lie inside the ``pyspark`` package that ``path``
    also holds as a directory, provided ``py4j`` is also importable from outside an archive."""
    archives = [p for p in path if os.path.isfile(p)]
    plain = [p for p in path if p not in archives]
    pyspark, py4j = PathFinder.find_spec("pyspark", plain), PathFinder.find_spec("py4j", plain)
    if pyspark is None or py4j is None or not pyspark.submodule_search_locations:
        return []
    home = os.path.realpath(next(iter(pyspark.submodule_search_locations))) + os.sep
    return [p for p in archives if os.path.realpath(p).startswith(home)]


def quiet_when_gone(worker: Callable[[socket.socket, bool], int]) -> Callable[[socket.socket, bool], int]:
    """PySpark's ``daemon.worker``, returning 1 (the daemon then ends that worker, as after any
    failed task) where it raised ``BrokenPipeError``: the executor closed the worker's socket, so
    it already knows, and the traceback the daemon would print reaches only the console."""

    @functools.wraps(worker)
    def run(sock: socket.socket, authenticated: bool) -> int:
        try:
            return worker(sock, authenticated)
        except BrokenPipeError:
            return 1

    return run


def main() -> None:
    drop = set(installed_copies(sys.path))
    sys.path[:] = [p for p in sys.path if p not in drop]
    for key in list(sys.path_importer_cache):  # importers of the archives and of folders in them
        if any(key == p or key.startswith(p + os.sep) for p in drop):
            del sys.path_importer_cache[key]
    from pyspark import daemon

    daemon.worker = quiet_when_gone(daemon.worker)
    daemon.manager()


if __name__ == "__main__":
    main()
