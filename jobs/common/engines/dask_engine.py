"""The Dask engine: ``python -m jobs.shard --engine dask`` on a dask.distributed cluster.

    python -m jobs.manifest --engine dask --input ./lake/raw --output ./datasets/pets-v1
    python -m jobs.shard --engine dask --scheduler tcp://10.0.0.5:8786 --dataset s3://lake/datasets/pets-v1

The cluster is ``--scheduler`` if given, else ``DASK_SCHEDULER_ADDRESS``, else a
``LocalCluster`` of worker processes (one per core, one thread each: the preprocessing step
runs its own read threads inside each task, and decodes on the task's thread).

Work is plain futures (``Client.submit``), one per part of the items, never dask DataFrames or
bags: no pandas conversion (which turns binary columns into strings), no lazy graph of
generators (which cannot be pickled). Each task carries its own input, so a task whose worker
dies is simply run again elsewhere. The client only plans and commits; every image is read,
transformed and written on a worker.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jobs.common.engines import FORWARDED_ENV, split_parts
from lakeshard.errors import EngineError

__all__ = ["DaskEngine"]

log = logging.getLogger(__name__)


#: Seconds to wait for a remote scheduler to answer and to have at least one worker.
_CONNECT_TIMEOUT = 60

#: Seconds to wait for a remote scheduler's port to accept a connection at all: a refused or
#: silent port fails in these, not after the client's whole ``_CONNECT_TIMEOUT`` of retries.
_PROBE_TIMEOUT = 5


def _check_address(address: str, source: str, *, timeout: float = _PROBE_TIMEOUT) -> None:
    """Raise :class:`EngineError` naming ``address`` (and where it came from, ``source``) if it
    is not a scheduler address, or if its TCP port does not accept a connection within
    ``timeout`` seconds. Schemes other than tcp/tls are left to distributed."""
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location, 8786) if scheme in ("tcp", "tls") else (None, None)
    except (ValueError, TypeError) as exc:
        raise EngineError(
            f"{source} {address!r} is not a dask scheduler address (like tcp://10.0.0.5:8786): {exc}"
        ) from None
    if host is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise EngineError(
            f"cannot connect to the dask scheduler at {address!r} ({source}): "
            f"{exc.strerror or type(exc).__name__}; is a scheduler running there?"
        ) from None


def _connect(client_cls: Any, address: str, name: str, timeout: float) -> Any:
    """``Client(address)``, tried up to three times on the one handshake race we have seen.

    distributed's ``Client._ensure_connected`` asserts that the scheduler's first reply is a
    single ``stream-start`` message; a scheduler that has just lost a client (our kill tests
    kill jobs mid-run) sometimes batches another message with it, and the client dies on a
    bare ``AssertionError``. A fresh connection succeeds. Any other error is final.
    """
    for attempt in range(3):
        try:
            return client_cls(address, name=name, timeout=timeout)
        except OSError as exc:
            raise EngineError(f"cannot connect to the dask scheduler at {address!r}: {exc}") from exc
        except AssertionError:
            if attempt == 2:
                raise EngineError(
                    f"the dask scheduler at {address!r} answered the handshake with "
                    "unexpected messages three times"
                ) from None
            log.warning("dask handshake with %s was interrupted; connecting again", address)
    raise AssertionError("unreachable")


def _worker_environ() -> dict[str, Any]:
    """dask's pre-spawn environment for worker processes, minus ``MALLOC_TRIM_THRESHOLD_``.

    dask sets it to 64 KiB to hand freed memory back to the OS early. Fixing it also fixes
    glibc's mmap threshold (glibc stops adapting it), so every decode buffer of a photo (~1 MiB)
    is mapped and unmapped again, page-faulting its memory in for every image: the shard job's
    preprocessing ran ~20% slower on dask workers than on Spark's Python workers (glibc
    defaults) until the engine's own cluster left glibc to its defaults. Clusters the engine
    does not start keep their own settings (``docs/scaling.md``).
    """
    import dask

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    return env


def _with_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    os.environ.update(env)
    return fn(*args)


def _progress(futures: list[Any], desc: str) -> Iterator[Any]:
    """Yield ``futures`` as they finish, with a progress bar when stderr is a terminal."""
    from distributed import as_completed
    from tqdm import tqdm

    with tqdm(
        total=len(futures), desc=desc, unit="task", disable=not sys.stderr.isatty(), leave=False
    ) as bar:
        for future in as_completed(futures):
            bar.update(1)
            yield future


class DaskEngine:
    name = "dask"

    def __init__(
        self,
        *,
        scheduler: str | None = None,
        client: Any = None,
        app_name: str = "lakeshard",
        n_workers: int | None = None,
        threads_per_worker: int = 1,
        connect_timeout: float = _CONNECT_TIMEOUT,
        **_: Any,
    ) -> None:
        import dask
        from distributed import Client, LocalCluster

        self._cluster = None
        self._owned = client is None
        if client is None:
            address = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
            if address:
                _check_address(
                    address,
                    "--scheduler" if scheduler else "DASK_SCHEDULER_ADDRESS",
                    timeout=min(connect_timeout, _PROBE_TIMEOUT),
                )
                log.info("connecting to the dask scheduler at %s", address)
                client = _connect(Client, address, app_name, connect_timeout)
            else:
                workers = n_workers or os.cpu_count() or 1
                log.info(
                    "starting a LocalCluster of %d worker processes × %d thread(s)",
                    workers,
                    threads_per_worker,
                )
                # The cluster's own INFO lines (nannies starting and stopping) drown the job's.
                logging.getLogger("distributed").setLevel(logging.WARNING)
                with dask.config.set({"distributed.nanny.pre-spawn-environ": _worker_environ()}):
                    self._cluster = LocalCluster(
                        n_workers=workers,
                        threads_per_worker=threads_per_worker,
                        processes=True,
                        host="127.0.0.1",
                        dashboard_address="127.0.0.1:0",
                        silence_logs=logging.WARNING,
                    )
                client = Client(self._cluster, name=app_name)
            try:
                client.wait_for_workers(1, timeout=connect_timeout)
            except TimeoutError as exc:
                self._close(client)
                raise EngineError(
                    f"the dask scheduler at {client.scheduler.address} has no workers after "
                    f"{connect_timeout:g} s; start some with `dask worker {client.scheduler.address}`"
                ) from exc
        self.client = client
        self._env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}

    def _submit(self, fn: Callable[..., Any], *args: Any, key: str) -> Any:
        return self.client.submit(_with_env, self._env, fn, *args, key=key, pure=False)

    def _gather(self, futures: list[Any], desc: str) -> list[Any]:
        """Wait for ``futures`` (re-raising the first task error as it happened on its worker)
        and return their results in order."""
        for future in _progress(futures, desc):
            if future.status == "error":
                future.result()  # raises the worker's exception, with its traceback
        return self.client.gather(futures)

    @property
    def parallelism(self) -> int:
        return max(1, sum(self.client.nthreads().values()))

    @property
    def task_cpus(self) -> int:
        return 1  # each of a worker's threads runs one task at a time

    def map_partitions(
        self,
        fn: Callable[[list[Any]], list[Any]],
        items: Sequence[Any],
        *,
        partitions: int,
        cpu_bound: bool = False,
    ) -> list[Any]:
        token = uuid.uuid4().hex[:8]
        # Each part travels inside its task (not scattered): a task whose worker dies can be rerun.
        futures = [
            self._submit(fn, part, key=f"lakeshard-map-{token}-{i}")
            for i, part in enumerate(split_parts(items, partitions))
        ]
        if not futures:
            return []
        try:
            return [row for part in self._gather(futures, getattr(fn, "__name__", "map")) for row in part]
        finally:
            self.client.cancel(futures)

    def close(self) -> None:
        if self._owned:
            self._close(self.client)

    def _close(self, client: Any) -> None:
        client.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
