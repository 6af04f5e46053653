"""The Dask engine: ``python -m jobs.shard --engine dask`` on a dask.distributed cluster.

    python -m jobs.manifest --engine dask --input ./lake/raw --output ./datasets/pets-v1
    python -m jobs.shard --engine dask --scheduler tcp://10.0.0.5:8786 --dataset s3://lake/datasets/pets-v1

The cluster is ``--scheduler`` if given, else ``DASK_SCHEDULER_ADDRESS``, else a
``LocalCluster`` of worker processes (one per core, one thread each: the preprocessing step
runs its own I/O and decode threads inside each task).

Data travels as futures of pyarrow Tables, never as dask DataFrames: no pandas conversion
(which turns binary columns into strings), no lazy graph of generators (which cannot be
pickled), and routing that is explicit rather than hashed. ``write_shards`` runs one task per
staged chunk that splits its rows by the plan's partition, then one task per partition that
concatenates its pieces, sorts them by position and writes the shard: exactly one partition
per shard, as the plan says. The client only plans and commits; every image is read,
transformed and written on a worker.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.engines import WriteFn
from jobs.errors import EngineError, ShardError

__all__ = ["DaskEngine"]

log = logging.getLogger(__name__)

# Where S3 is (not who: credentials stay with the AWS environment of each worker), as the
# Spark engine forwards it to its executors.
_FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")

#: Seconds to wait for a remote scheduler to answer and to have at least one worker.
_CONNECT_TIMEOUT = 60


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
                raise EngineError(f"the dask scheduler at {address!r} answered the handshake with "
                                  "unexpected messages three times") from None
            log.warning("dask handshake with %s was interrupted; connecting again", address)
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class _Staged:
    """Preprocessed rows kept on the workers: ``chunks[i]`` is a future of the pyarrow Table
    made from input rows ``bounds[i]:bounds[i + 1]``; ``uris`` are the input rows' URIs."""

    chunks: list[Any]
    bounds: np.ndarray
    uris: pa.ChunkedArray
    schema: pa.Schema
    token: str


def _bounds(n: int, parts: int) -> np.ndarray:
    """Contiguous slices, as ``SparkContext.parallelize`` cuts them: part i is
    ``[i * n // parts, (i + 1) * n // parts)``."""
    parts = max(1, min(parts, n))
    return np.array([i * n // parts for i in range(parts + 1)], dtype=np.int64)


def _copy(table: pa.Table, start: int, stop: int) -> pa.Table:
    """Rows ``start:stop`` of ``table`` as a table of their own: a slice would pickle (into a
    task) with all of its parent's buffers."""
    return table.take(pa.array(np.arange(start, stop, dtype=np.int64)))


def _with_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    os.environ.update(env)
    return fn(*args)


def _preprocess_chunk(fn: Callable[[pa.RecordBatch], pa.RecordBatch], rows: pa.Table, schema: pa.Schema) -> pa.Table:
    return pa.Table.from_batches([fn(b) for b in rows.combine_chunks().to_batches()], schema=schema)


def _select(table: pa.Table, columns: list[str]) -> pa.Table:
    return table.select(columns)


def _split(chunk: pa.Table, routes: pa.Table) -> dict[int, pa.Table]:
    """The rows of one staged chunk, routed by ``routes`` (the plan's rows for this chunk;
    a row listed twice goes twice), grouped by partition."""
    index = pc.index_in(routes["uri"], value_set=chunk["uri"])
    if index.null_count:
        missing = routes["uri"].filter(pc.is_null(index)).to_pylist()[:3]
        raise ShardError(f"{index.null_count} planned rows are not in their staged chunk, e.g. {missing}")
    rows = chunk.take(index)
    bad = pc.not_equal(rows["status"], "ok")
    if pc.any(bad).as_py():
        raise ShardError(f"the plan routes rejected rows to shards, e.g. {rows['uri'].filter(bad)[0]}")
    for name in ("part", "position", "is_pad"):
        rows = rows.append_column(name, routes[name])
    parts = rows["part"].to_numpy()
    order = np.argsort(parts, kind="stable")
    rows, parts = rows.take(order), parts[order]
    values, starts = np.unique(parts, return_index=True)
    ends = [*starts[1:], len(parts)]
    return {int(p): rows.slice(s, e - s) for p, s, e in zip(values, starts, ends, strict=True)}


def _records(table: pa.Table, part: int) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
    for batch in table.to_batches(max_chunksize=256):
        positions = batch.column("position").to_pylist()
        for pos, row in zip(positions, batch.drop_columns(["part", "position"]).to_pylist(), strict=True):
            yield (part, pos), row


def _write_part(fn: WriteFn, part: int, schema: pa.Schema, *pieces: pa.Table) -> dict[str, Any]:
    table = pa.concat_tables(pieces) if pieces else schema.empty_table()
    table = table.sort_by("position")
    return fn(part, _records(table, part))


def _progress(futures: list[Any], desc: str) -> Iterator[Any]:
    """Yield ``futures`` as they finish, with a progress bar when stderr is a terminal."""
    from distributed import as_completed
    from tqdm import tqdm

    with tqdm(total=len(futures), desc=desc, unit="task", disable=not sys.stderr.isatty(), leave=False) as bar:
        for future in as_completed(futures):
            bar.update(1)
            yield future


class DaskEngine:
    name = "dask"

    def __init__(self, *, scheduler: str | None = None, client: Any = None, app_name: str = "lakeshard",
                 n_workers: int | None = None, threads_per_worker: int = 1,
                 connect_timeout: float = _CONNECT_TIMEOUT, **_: Any) -> None:
        from distributed import Client, LocalCluster

        self._cluster = None
        self._owned = client is None
        if client is None:
            address = scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS") or None
            if address:
                log.info("connecting to the dask scheduler at %s", address)
                client = _connect(Client, address, app_name, connect_timeout)
            else:
                workers = n_workers or os.cpu_count() or 1
                log.info("starting a LocalCluster of %d worker processes × %d thread(s)", workers, threads_per_worker)
                # The cluster's own INFO lines (nannies starting and stopping) drown the job's.
                logging.getLogger("distributed").setLevel(logging.WARNING)
                self._cluster = LocalCluster(n_workers=workers, threads_per_worker=threads_per_worker,
                                             processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                             silence_logs=logging.WARNING)
                client = Client(self._cluster, name=app_name)
            try:
                client.wait_for_workers(1, timeout=connect_timeout)
            except TimeoutError as exc:
                self._close(client)
                raise EngineError(f"the dask scheduler at {client.scheduler.address} has no workers after "
                                  f"{connect_timeout:g} s; start some with `dask worker {client.scheduler.address}`") from exc
        self.client = client
        self._env = {k: os.environ[k] for k in _FORWARDED_ENV if os.environ.get(k)}

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

    def map_partitions(self, fn: Callable[[list[Any]], list[Any]], items: Sequence[Any], *,
                       partitions: int) -> list[Any]:
        if not items:
            return []
        items = list(items)
        bounds = _bounds(len(items), partitions)
        token = uuid.uuid4().hex[:8]
        # Each slice travels inside its task (not scattered): a task whose worker dies can be rerun.
        futures = [self._submit(fn, items[a:b], key=f"lakeshard-map-{token}-{i}")
                   for i, (a, b) in enumerate(pairwise(bounds))]
        try:
            return [row for part in self._gather(futures, getattr(fn, "__name__", "map")) for row in part]
        finally:
            self.client.cancel(futures)

    def preprocess(self, rows: pa.Table, fn: Callable[[pa.RecordBatch], pa.RecordBatch],
                   schema: pa.Schema, *, partitions: int) -> _Staged:
        bounds = _bounds(rows.num_rows, partitions)
        token = uuid.uuid4().hex[:8]
        # The manifest rows travel inside the tasks (a few KiB each), not scattered: if a worker
        # holding staged chunks dies, the scheduler recomputes them from their tasks.
        chunks = [self._submit(_preprocess_chunk, fn, _copy(rows, a, b), schema,
                               key=f"lakeshard-preprocess-{token}-{i}")
                  for i, (a, b) in enumerate(pairwise(bounds))]
        try:
            for future in _progress(chunks, "preprocess"):  # materialise once, as Spark's persist + count
                if future.status == "error":
                    future.result()
        except BaseException:
            self.client.cancel(chunks)
            raise
        return _Staged(chunks=chunks, bounds=bounds, uris=rows["uri"], schema=schema, token=token)

    def collect(self, staged: _Staged, columns: list[str]) -> pa.Table:
        futures = [self._submit(_select, c, columns, key=f"lakeshard-collect-{staged.token}-{i}-{uuid.uuid4().hex[:6]}")
                   for i, c in enumerate(staged.chunks)]
        try:
            return pa.concat_tables(self._gather(futures, "collect"))
        finally:
            self.client.cancel(futures)

    def write_shards(self, staged: _Staged, plan: pa.Table, fn: WriteFn, *, num_parts: int) -> list[dict[str, Any]]:
        # Which chunk holds each planned row: the chunks are contiguous slices of the input.
        index = pc.index_in(plan["uri"], value_set=staged.uris)
        if index.null_count:
            missing = plan["uri"].filter(pc.is_null(index)).to_pylist()[:3]
            raise ShardError(f"{index.null_count} planned rows name URIs that were never staged, e.g. {missing}")
        chunk_of = np.searchsorted(staged.bounds, index.to_numpy(), side="right") - 1
        order = np.argsort(chunk_of, kind="stable")
        routes, chunk_of = plan.take(order), chunk_of[order]
        cuts = np.searchsorted(chunk_of, np.arange(len(staged.chunks) + 1))
        schema = _route_schema(staged.schema)
        token = f"{staged.token}-{uuid.uuid4().hex[:6]}"

        splits, pieces = [], [[] for _ in range(num_parts)]
        for i, chunk in enumerate(staged.chunks):
            sub = _copy(routes, cuts[i], cuts[i + 1])
            if not sub.num_rows:
                continue
            split = self._submit(_split, chunk, sub, key=f"lakeshard-split-{token}-{i}")
            splits.append(split)
            for p in np.unique(sub["part"].to_numpy()):
                if not 0 <= p < num_parts:
                    raise ShardError(f"the plan names partition {int(p)}, outside 0..{num_parts - 1}")
                pieces[p].append(self.client.submit(operator.getitem, split, int(p),
                                                    key=f"lakeshard-piece-{token}-{i}-{p}", pure=False))
        writes = [self._submit(_write_part, fn, p, schema, *pieces[p], key=f"lakeshard-write-{token}-{p}")
                  for p in range(num_parts)]
        try:
            return self._gather(writes, "write shards")
        finally:
            self.client.cancel([*writes, *splits, *(f for ps in pieces for f in ps)])

    def release(self, staged: _Staged) -> None:
        self.client.cancel(staged.chunks)

    def close(self) -> None:
        if self._owned:
            self._close(self.client)

    def _close(self, client: Any) -> None:
        client.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def _route_schema(schema: pa.Schema) -> pa.Schema:
    """The staged schema plus the routing columns that :func:`_split` appends."""
    return pa.schema([*schema, pa.field("part", pa.int64()), pa.field("position", pa.int64()),
                      pa.field("is_pad", pa.bool_())])
