"""The local engine: the jobs' tasks on this machine, no Spark, no Dask.

    python -m jobs.manifest --engine local --input ./lake/raw --output ./datasets/pets-v1
    python -m jobs.shard --engine local --dataset ./datasets/pets-v1 --num-shards 2

For one machine and for fast tests of the engine-free core: it runs the same task functions on
the same parts of the work as the other engines (so it writes the same dataset), with nothing to
start. Tasks run on a thread pool in this process, where they mostly wait on storage or run
Arrow and Pillow code that releases the GIL. A map that is ``cpu_bound`` (the shard job's
preprocessing: Pillow parses a JPEG's markers and runs its encoder holding the GIL, about half
of each image's time) runs on worker processes instead, one per core, forked from a
``forkserver`` started with the engine when the job runs such maps (a clean process: no thread of this one, such as a
lock's refresher, is copied into a worker) and kept until the engine closes; each task gets
this process's environment as it is when the map starts. A worker exits when this process
does, killed or not.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any

from jobs.common.engines import split_parts
from lakeshard.errors import EngineError
from lakeshard.settings import check_positive

__all__ = ["LocalEngine"]

log = logging.getLogger(__name__)

#: Imported by the forkserver whatever the driver imported, so that each worker forked from it
#: starts with them: the task functions (preprocessing's, for one).
_TASK_MODULES = ("jobs.shard_steps.preprocess",)


def _preload() -> list[str]:
    """What the forkserver imports once: the task modules and every module of this project the
    driver has imported, except the one it runs as ``__main__``. A worker runs that one again
    itself (as ``__mp_main__``, multiprocessing's rule), its imports then already loaded; had
    the forkserver imported it too, runpy would warn in every worker that it was found in
    ``sys.modules`` before it ran."""
    main = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    ours = (m for m in sys.modules if m.split(".", 1)[0] in ("jobs", "lakeshard"))
    return sorted({*_TASK_MODULES, *ours} - {main})


def _follow(driver: int) -> None:
    """In a worker process: exit when the ``driver`` process does. A driver killed (``kill -9``)
    closes no pipe the worker waits on (a worker holds both ends of its task queue), so without
    this its workers, and the forkserver they keep alive, would wait for tasks forever."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(driver)
        except (AttributeError, OSError):  # not Linux 5.3+: look once a second
            while _alive(driver):
                time.sleep(1)
        else:
            select.select([fd], [], [])  # readable once the driver has exited
        os._exit(0)

    threading.Thread(target=watch, name="lakeshard-follow-driver", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _in_environ(env: dict[str, str], fn: Callable[[list[Any]], list[Any]], part: list[Any]) -> list[Any]:
    """``fn(part)`` in a worker process whose environment is ``env`` (the driver's, at the map)."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    return fn(part)


class LocalEngine:
    name = "local"

    def __init__(self, *, workers: int | None = None, start_processes: bool = True, **_: Any) -> None:
        """``start_processes``: start the forkserver of the ``cpu_bound`` maps now, importing
        the jobs' modules while the job plans, so that the first such map does not wait (a job
        that runs none passes False: it would cost a second of CPU and 130 MB for nothing; a
        ``cpu_bound`` map then starts it)."""
        check_positive("workers", workers, allow_none=True)
        self._workers = workers or os.cpu_count() or 1
        self._processes: ProcessPoolExecutor | None = None
        self._context = multiprocessing.get_context("forkserver")
        if self._workers > 1:
            self._context.set_forkserver_preload(_preload())
            if start_processes:
                multiprocessing.forkserver.ensure_running()
        log.info("local engine: %d thread(s) in this process (processes for preprocessing)", self._workers)

    @property
    def parallelism(self) -> int:
        return self._workers

    @property
    def task_cpus(self) -> int:
        return 1

    def map_partitions(
        self,
        fn: Callable[[list[Any]], list[Any]],
        items: Sequence[Any],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[Any]:
        parts = split_parts(items, partitions)
        if not parts:
            return []
        if cpu_bound and self._workers > 1 and len(parts) > 1:
            return self._on_processes(fn, parts)
        # NOTE [ Local task errors ]: pool.map re-raises the first failed part's exception here,
        # with its own traceback; leaving the `with` waits for the parts already running.
        with ThreadPoolExecutor(min(self._workers, len(parts)), thread_name_prefix="lakeshard-task") as pool:
            return _joined(pool, fn, parts)

    def _on_processes(self, fn: Callable[[list[Any]], list[Any]], parts: list[list[Any]]) -> list[Any]:
        if self._processes is None:
            self._processes = ProcessPoolExecutor(
                self._workers, mp_context=self._context, initializer=_follow, initargs=(os.getpid(),)
            )
        env = dict(os.environ)
        try:
            return _joined(self._processes, partial(_in_environ, env, fn), parts)
        except BrokenProcessPool as exc:
            self._processes = None
            task = getattr(fn, "fn", fn)  # jobs.common.tasks.each: its function
            raise EngineError(
                f"a local worker process died while running {getattr(task, '__name__', 'a task')} "
                f"(killed, or out of memory?): {exc}"
            ) from None

    def close(self) -> None:
        """Stop the worker processes, if a map started them (the thread pools live only inside
        each ``map_partitions``)."""
        if self._processes is not None:
            self._processes.shutdown(cancel_futures=True)
            self._processes = None


def _joined(pool: Executor, fn: Callable[[list[Any]], list[Any]], parts: list[list[Any]]) -> list[Any]:
    return [row for part in pool.map(fn, parts) for row in part]
