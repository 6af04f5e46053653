"""The shard job's first worker step: preprocess a segment of a shard straight into its file,
and the receipt that lets a rerun reuse it. Engines run it as a plain task; nothing here knows
about Spark or Dask (:mod:`jobs.assemble` is the second step).

Each image crosses the network once, from the lake to the worker that writes its shard: the
plan is made before preprocessing, so a task knows which shard, and which position in it, every
row of its segment goes to. Rows move between shard files only when images fail to decode (the
plan's repair moves a few rows, see :mod:`jobs.plan`) and when a shard is cut into several
segments to spread its work over more tasks.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.fetch import read_as_listed
from jobs.images import ImageSpec, preprocess
from jobs.tasks import compact
from lakeshard import storage
from lakeshard.errors import ImageRejected
from lakeshard.format import SHARD_SCHEMA
from lakeshard.format.writer import ShardWriter

__all__ = [
    "OUTCOME_SCHEMA",
    "SEGMENT_SCHEMA",
    "SegmentTask",
    "preprocess_segment",
    "read_receipt",
    "readers",
]

log = logging.getLogger(__name__)

#: The rows of one segment, in the order its file holds them. ``size`` and ``etag`` are what
#: the manifest recorded of the object (null: not checked); an object that is no longer that
#: one is rejected (:func:`jobs.fetch.read_as_listed`).
SEGMENT_SCHEMA = pa.schema(
    [("uri", pa.string()), ("key", pa.string()), ("label_index", pa.int64()), ("is_pad", pa.bool_()),
     ("size", pa.int64()), ("etag", pa.string())]
)

#: What preprocessing a segment reports for each of its rows: ``row`` is the row's index in
#: the segment's file, null when the image was rejected (``reason`` says why).
OUTCOME_SCHEMA = pa.schema(
    [("uri", pa.string()), ("file", pa.string()), ("row", pa.int64()), ("reason", pa.string())]
)

#: Rows preprocessed and written together: a pool task costs tens of microseconds, an image a
#: few milliseconds, and a chunk's results are written as soon as it is done.
_CHUNK_ROWS = 32

#: Rows read by one I/O task. Reads run ahead of decoding by at most ``2 × threads`` such
#: groups, which bounds the encoded bytes a task holds.
_READ_ROWS = 4

#: Threads reading an S3 segment ahead of decoding, unless ``threads`` says otherwise.
_S3_READERS = 8


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """Preprocess ``rows`` (:data:`SEGMENT_SCHEMA`) in order and write the survivors to ``uri``;
    then, if ``receipt`` is set, write there what the task returns (:func:`read_receipt` reads
    it back), so a rerun of an interrupted job can reuse the file instead of preprocessing
    its rows again.

    ``threads`` read the images ahead of decoding (:func:`readers`: by default none for local
    files, several for S3); ``decode_threads`` decode, resize and encode them: as many as the
    engine gives the task cores (one), since more threads than cores only make them take turns.
    """

    uri: str
    rows: pa.Table
    spec: ImageSpec
    metadata: Mapping[str, str]
    row_group_bytes: int
    threads: int | None
    receipt: str | None = None
    decode_threads: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", compact(self.rows))


def _preprocessed(data: bytes | str, spec: ImageSpec) -> tuple[bytes, int, int] | str:
    """The encoded image with its height and width, or the reason there is none."""
    if isinstance(data, str):
        return data
    try:
        return preprocess(data, spec)
    except ImageRejected as exc:
        return exc.reason


def _ahead(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int) -> Iterator[Future]:
    """Futures of ``fn(item)`` on ``pool``, in the order of ``items``, never more than ``depth``
    submitted beyond the one the caller is at."""
    items = iter(items)
    pending = deque(pool.submit(fn, item) for item in islice(items, depth))
    while pending:
        for item in islice(items, 1):
            pending.append(pool.submit(fn, item))
        yield pending.popleft()


def readers(threads: int | None, uris: list[str]) -> int:
    """Threads that read ahead of decoding: ``threads`` if given; else none for local files (a
    read from the page cache costs less than handing it to a thread, and extra threads cost the
    decoder cache and CPU) and :data:`_S3_READERS` for S3 (each read waits on the network)."""
    if threads is not None:
        return threads
    return 0 if all(u.startswith("file://") for u in uris) else _S3_READERS


def _preprocessed_chunks(task: SegmentTask) -> Iterator[tuple[pa.Table, list[Any]]]:
    """The segment's rows with their outcomes (an image tuple or a reason), chunk by chunk, in
    order: read ahead on :func:`readers` threads (or by the decoder as it goes, if none), then
    preprocessed on ``task.decode_threads`` threads (on the task's own thread when that is one)."""
    rows = task.rows
    uris = rows["uri"].to_pylist()
    starts = range(0, len(uris), _CHUNK_ROWS)
    read_starts = range(0, len(uris), _READ_ROWS)
    sizes, etags = rows["size"].to_pylist(), rows["etag"].to_pylist()
    n_readers = readers(task.threads, uris)

    def read(start: int) -> list[bytes | str]:
        stop = start + _READ_ROWS
        return [read_as_listed(u, size=s, etag=e) for u, s, e in zip(uris[start:stop], sizes[start:stop], etags[start:stop], strict=True)]

    def preprocess_all(reads: list[Callable[[], list[bytes | str]]]) -> list[Any]:
        return [_preprocessed(data, task.spec) for get in reads for data in get()]

    with ExitStack() as stack:
        if n_readers:
            io = stack.enter_context(ThreadPoolExecutor(n_readers, thread_name_prefix="read"))
            reads = (f.result for f in _ahead(io, read, read_starts, depth=2 * n_readers))
        else:
            reads = (partial(read, start) for start in read_starts)
        chunks = (list(islice(reads, _CHUNK_ROWS // _READ_ROWS)) for _ in starts)
        if task.decode_threads <= 1:
            for start, chunk in zip(starts, chunks, strict=True):
                yield rows.slice(start, _CHUNK_ROWS), preprocess_all(chunk)
            return
        cpu = stack.enter_context(ThreadPoolExecutor(task.decode_threads, thread_name_prefix="preprocess"))
        for start, done in zip(starts, _ahead(cpu, preprocess_all, chunks, depth=task.decode_threads), strict=True):
            yield rows.slice(start, _CHUNK_ROWS), done.result()


def preprocess_segment(task: SegmentTask) -> dict[str, Any]:
    """Fetch, decode, orient, resize and encode the segment's rows and write those that
    survive, in order, to ``task.uri``. Returns the file's stats and the per-row outcomes
    (:data:`OUTCOME_SCHEMA`)."""
    outcome_rows: list[int | None] = []
    reasons: list[str | None] = []
    written = 0
    with ShardWriter(task.uri, metadata=task.metadata, row_group_bytes=task.row_group_bytes) as writer:
        for chunk, outcomes in _preprocessed_chunks(task):
            keep = [not isinstance(o, str) for o in outcomes]
            for ok, o in zip(keep, outcomes, strict=True):
                outcome_rows.append(written if ok else None)
                reasons.append(None if ok else o)
                written += ok
            images = [o for o in outcomes if not isinstance(o, str)]
            if not images:
                continue
            chunk = chunk.filter(pa.array(keep))
            writer.write(pa.table({
                "image": pa.array([o[0] for o in images], pa.binary()),
                "label": chunk["label_index"],
                "uri": chunk["uri"],
                "key": chunk["key"],
                "height": pa.array([o[1] for o in images], pa.int32()),
                "width": pa.array([o[2] for o in images], pa.int32()),
                "is_pad": chunk["is_pad"],
            }, schema=SHARD_SCHEMA))
    outcomes_table = pa.table({
        "uri": task.rows["uri"],
        "file": pa.array([task.uri] * task.rows.num_rows, pa.string()),
        "row": pa.array(outcome_rows, pa.int64()),
        "reason": pa.array(reasons, pa.string()),
    }, schema=OUTCOME_SCHEMA)
    result = {"uri": task.uri, "stats": writer.stats, "outcomes": outcomes_table}
    if task.receipt is not None:  # after the file is complete: a receipt vouches for it
        sink = pa.BufferOutputStream()
        meta = {b"lakeshard.uri": task.uri.encode(), b"lakeshard.stats": json.dumps(writer.stats).encode()}
        pq.write_table(outcomes_table.replace_schema_metadata(meta), sink)
        storage.write_bytes_atomic(task.receipt, sink.getvalue().to_pybytes())
    return result


def read_receipt(data: bytes) -> dict[str, Any]:
    """What :func:`preprocess_segment` returned, from the receipt it wrote."""
    table = pq.read_table(pa.BufferReader(data))
    meta = table.schema.metadata
    return {"uri": meta[b"lakeshard.uri"].decode(), "stats": json.loads(meta[b"lakeshard.stats"]),
            "outcomes": table.replace_schema_metadata(None).cast(OUTCOME_SCHEMA)}


