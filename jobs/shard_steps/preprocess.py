"""The shard job's first worker step: preprocess a segment of a shard straight into its file,
and the receipt that lets a rerun reuse it. Engines run it as a plain task; nothing here knows
about Spark or Dask (:mod:`jobs.shard_steps.assemble` is the second step).

Each image crosses the network once, from the lake to the worker that writes its shard: the
plan is made before preprocessing, so a task knows which shard, and which position in it, every
row of its segment goes to. Rows move between shard files only when images fail to decode (the
plan's repair moves a few rows, see :mod:`jobs.shard_steps.deal`) and when a shard is cut into several
segments to spread its work over more tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from jobs.common.boxes import geometry
from jobs.common.images import EncodedImage, ImageSpec, preprocess
from jobs.common.tasks import compact, read_rows, write_table
from jobs.shard_steps.as_listed import read_as_listed
from jobs.shard_steps.shard_rows import Stored, count_dropped, shard_rows
from lakeshard import storage
from lakeshard.errors import ImageRejected
from lakeshard.format import SHARD_REJECTS_SCHEMA, SHARD_SCHEMA
from lakeshard.format.writer import ShardWriter, write_shard_rejects

__all__ = [
    "DROPPED_FIELD",
    "OUTCOME_SCHEMA",
    "REJECT_SCHEMA",
    "SEGMENT_SCHEMA",
    "RejectsTable",
    "RejectsTask",
    "RowRange",
    "SegmentResult",
    "SegmentTask",
    "preprocess_segment",
    "read_receipt",
    "read_where",
    "readers",
    "reused_rows",
    "rows_digest",
    "unique_rejects",
    "write_rejects",
]

log = logging.getLogger(__name__)

#: The rows of one segment, in the order its file holds them. ``size``, ``etag`` and
#: ``last_modified`` are what the manifest recorded of the object (null: not checked); an object
#: that is no longer that one is rejected (:func:`jobs.shard_steps.as_listed.read_as_listed`).
SEGMENT_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("key", pa.string()),
        ("label_index", pa.int64()),
        ("is_pad", pa.bool_()),
        ("size", pa.int64()),
        ("etag", pa.string()),
        ("last_modified", pa.timestamp("us", tz="UTC")),
    ]
)

#: Where preprocessing wrote each row of a segment (the *outcomes* file, read by the assembly
#: tasks, :mod:`jobs.shard_steps.repair`): ``row`` is the row's index in the segment's file, null when the
#: image was rejected. A ``boxes`` dataset's also has :data:`DROPPED_FIELD`.
OUTCOME_SCHEMA = pa.schema([("uri", pa.string()), ("row", pa.int64())])
#: An outcome's boxes the resize dropped, a reason each (:mod:`jobs.common.boxes`).
DROPPED_FIELD = pa.field("dropped", pa.list_(pa.string()))

#: A segment's rejects, as its receipt holds them: the shard rejects table's columns
#: (:data:`~lakeshard.format.SHARD_REJECTS_SCHEMA`), the row's slot (:mod:`jobs.shard_steps.deal`; null
#: when the segment's rows have none) and whether it was a pad copy (its row is also
#: preprocessed elsewhere, and may have failed there too).
REJECT_SCHEMA = pa.schema([*SHARD_REJECTS_SCHEMA, ("slot", pa.int64()), ("is_pad", pa.bool_())])

#: Rows preprocessed and written together: a pool task costs tens of microseconds, an image a
#: few milliseconds, and a chunk's results are written as soon as it is done.
_CHUNK_ROWS = 32

#: Rows read by one I/O task. Reads run ahead of decoding by at most ``2 × threads`` such
#: groups, which bounds the encoded bytes a task holds.
_READ_ROWS = 4

#: Threads reading an S3 segment ahead of decoding, unless ``threads`` says otherwise.
_S3_READERS = 8


class RowRange(NamedTuple):
    """Rows ``offset`` to ``offset + length`` of the Parquet file ``uri`` (a shard's order file)."""

    uri: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """Preprocess a segment's rows (:data:`SEGMENT_SCHEMA`, other columns carried along) in
    order and write the survivors to ``uri``; then, if ``outcomes`` is set, write there where
    each row went (:data:`OUTCOME_SCHEMA`), and if ``receipt`` is set, write there what the task
    returns (:func:`read_receipt` reads it back), so a rerun of an interrupted job can reuse the
    file instead of preprocessing its rows again.

    The rows are ``rows``, or, when that is None, the range ``source`` of an order file (read by
    the task: the driver never holds them); ``digest`` is their :func:`rows_digest`, which a
    receipt must match.

    ``threads`` read the images ahead of decoding (:func:`readers`: by default none for local
    files, several for S3); ``decode_threads`` decode, resize and encode them: as many as the
    engine gives the task cores (one), since more threads than cores only make them take turns.
    """

    uri: str
    rows: pa.Table | None
    spec: ImageSpec
    metadata: Mapping[str, Any]
    row_group_bytes: int
    threads: int | None
    receipt: str | None = None
    decode_threads: int = 1
    source: RowRange | None = None
    digest: str | None = None
    outcomes: str | None = None
    #: Runs holding images of this segment's rows already preprocessed (``--base``), under
    #: segment id ``reuse_id`` (:func:`reused_rows`): those rows are not fetched.
    base_runs: tuple[str, ...] = ()
    reuse_id: int = -1
    #: The shard's schema: :data:`SHARD_SCHEMA`, or a multi-label or boxes dataset's (its label
    #: and kept columns taken from the rows, boxes moved with the image: :mod:`jobs.common.boxes`).
    schema: pa.Schema = SHARD_SCHEMA

    @property
    def boxes(self) -> bool:
        return "boxes" in self.schema.names

    def __post_init__(self) -> None:
        if self.rows is not None:
            object.__setattr__(self, "rows", compact(self.rows))
        elif self.source is None:
            raise ValueError(f"segment {self.uri}: neither rows nor a source to read them from")

    @property
    def num_rows(self) -> int:
        if self.rows is not None:
            return self.rows.num_rows
        assert self.source is not None  # __post_init__ refuses a task with neither
        return self.source.length

    def expected_digest(self) -> str:
        if self.digest is not None:
            return self.digest
        if self.rows is None:
            raise ValueError(
                f"segment {self.uri}: its rows are read from {self.source}, but it has no digest"
            )
        return rows_digest(self.rows)

    def read_rows(self) -> pa.Table:
        """The segment's rows (read from its source if the task does not carry them)."""
        if self.rows is not None:
            return self.rows
        source = self.source
        assert source is not None  # __post_init__ refuses a task with neither
        return read_rows(source.uri, source.offset, source.length)


def read_where(files: Sequence[str], column: str, value: int, columns: list[str]) -> pa.Table:
    """The rows of the Parquet ``files`` whose int ``column`` is ``value``: only the row groups
    whose statistics hold it are read (files written a row group per value, :mod:`jobs.shard_steps.reuse`)."""
    fs, _ = storage.filesystem(files[0])
    return ds.dataset([storage.filesystem(f)[1] for f in files], filesystem=fs, format="parquet").to_table(
        columns=columns, filter=pc.field(column) == value
    )


def reused_rows(task: SegmentTask) -> dict[int, EncodedImage]:
    """The images of the segment's rows an incremental build reuses (by position), from the
    runs it names (:mod:`jobs.shard_steps.reuse`)."""
    if not task.base_runs:
        return {}
    got = read_where(task.base_runs, "segment", task.reuse_id, ["pos", "image", "height", "width"])
    return {
        int(p): EncodedImage(i, int(h), int(w))
        for p, i, h, w in zip(
            got["pos"].to_pylist(),
            got["image"].to_pylist(),
            got["height"].to_pylist(),
            got["width"].to_pylist(),
            strict=True,
        )
    }


def rows_digest(rows: pa.Table) -> str:
    """What identifies a segment's rows: their URIs and pad flags, in order."""
    digest = hashlib.sha256()
    for uri, pad in zip(rows["uri"].to_pylist(), rows["is_pad"].to_pylist(), strict=True):
        digest.update(f"{uri}\x1f{int(pad)}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def _preprocessed(data: bytes | str | EncodedImage, spec: ImageSpec, *, boxes: bool) -> Stored | str:
    """The encoded image with its height and width (and with ``boxes``, its geometry), or the
    reason there is none (``data`` already preprocessed: as it is)."""
    if isinstance(data, str):
        return data
    if isinstance(data, EncodedImage):
        return Stored(data)
    try:
        image = preprocess(data, spec)
    except ImageRejected as exc:
        return exc.reason
    return Stored(image, geometry(data, spec) if boxes else None)


def _ahead(
    pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int
) -> Iterator[Future[Any]]:
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
    return 0 if all(storage.is_local(u) for u in uris) else _S3_READERS


def _preprocessed_chunks(
    task: SegmentTask, rows: pa.Table, reused: Mapping[int, EncodedImage]
) -> Iterator[tuple[pa.Table, list[Any]]]:
    """The segment's rows with their outcomes (an :class:`EncodedImage` or a reason), chunk by chunk, in
    order: read ahead on :func:`readers` threads (or by the decoder as it goes, if none), then
    preprocessed on ``task.decode_threads`` threads (on the task's own thread when that is one).
    A row in ``reused`` (by position) has its image already: it is neither read nor decoded."""
    uris = rows["uri"].to_pylist()
    starts = range(0, len(uris), _CHUNK_ROWS)
    read_starts = range(0, len(uris), _READ_ROWS)
    sizes, etags, modified = (rows[c].to_pylist() for c in ("size", "etag", "last_modified"))
    n_readers = readers(task.threads, [u for i, u in enumerate(uris) if i not in reused])

    def read(start: int) -> list[bytes | str | EncodedImage]:
        stop = min(start + _READ_ROWS, len(uris))
        return [
            reused[i]
            if i in reused
            else read_as_listed(uris[i], size=sizes[i], etag=etags[i], modified=modified[i])
            for i in range(start, stop)
        ]

    def preprocess_all(reads: list[Callable[[], list[bytes | str | EncodedImage]]]) -> list[Any]:
        return [_preprocessed(data, task.spec, boxes=task.boxes) for get in reads for data in get()]

    reads: Iterator[Callable[[], list[bytes | str | EncodedImage]]]
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
        for start, done in zip(
            starts, _ahead(cpu, preprocess_all, chunks, depth=task.decode_threads), strict=True
        ):
            yield rows.slice(start, _CHUNK_ROWS), done.result()


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """What a segment's task wrote (:func:`preprocess_segment`), or its receipt says it wrote
    (:func:`read_receipt`): counts and a few rows, never a row per image."""

    uri: str  #: the segment's file
    stats: dict[str, Any]  #: the file's :attr:`~lakeshard.format.writer.ShardWriter.stats`
    rows: int  #: the segment's rows, rejects included
    reused: int  #: images taken from the ``--base`` dataset, not fetched and decoded
    rejects: pa.Table  #: :data:`REJECT_SCHEMA`
    digest: str  #: the :func:`rows_digest` of the rows it preprocessed
    #: a ``boxes`` dataset: boxes the resize dropped from the rows it wrote, pad copies not
    #: counted, by reason
    dropped_boxes: dict[str, int] = field(default_factory=dict)


def preprocess_segment(task: SegmentTask) -> SegmentResult:
    """Fetch, decode, orient, resize and encode the segment's rows and write those that
    survive, in order, to ``task.uri``."""
    rows = task.read_rows()
    reused = reused_rows(task)
    outcome_rows: list[int | None] = []
    reasons: list[str | None] = []
    dropped: list[list[str]] = []  # each row's boxes dropped by the resize (rejected rows: none)
    written = 0
    with ShardWriter(
        task.uri, metadata=task.metadata, row_group_bytes=task.row_group_bytes, schema=task.schema
    ) as writer:
        for chunk, outcomes in _preprocessed_chunks(task, rows, reused):
            keep = [not isinstance(o, str) for o in outcomes]
            for ok, o in zip(keep, outcomes, strict=True):
                outcome_rows.append(written if ok else None)
                reasons.append(None if ok else o)
                written += ok
            made = [o for o in outcomes if not isinstance(o, str)]
            if not made:
                dropped += [[] for _ in outcomes]
                continue
            table, moved = shard_rows(chunk.filter(pa.array(keep)), made, task.schema)
            writer.write(table)
            each = iter(moved)
            dropped += [next(each) if ok else [] for ok in keep]
    bad = [i for i, why in enumerate(reasons) if why is not None]
    rejects = rows.take(pa.array(bad, pa.int64()))

    def column(name: str, kind: pa.DataType) -> pa.Array:
        return rejects[name].cast(kind) if name in rejects.column_names else pa.nulls(len(bad), kind)

    rejects = pa.table(
        {
            "uri": rejects["uri"],
            "key": rejects["key"],
            "label": column("label", pa.string()),
            "channel": pa.array([task.metadata.get("channel")] * len(bad), pa.string()),
            "reason": pa.array([reasons[i] for i in bad], pa.string()),
            "slot": column("slot", pa.int64()),
            "is_pad": rejects["is_pad"],
        },
        schema=REJECT_SCHEMA,
    )
    pads = rows["is_pad"].to_pylist()
    result = SegmentResult(
        uri=task.uri,
        stats=writer.stats,
        rows=rows.num_rows,
        reused=len(reused),
        rejects=rejects,
        digest=rows_digest(rows),
        dropped_boxes=count_dropped(why for why, pad in zip(dropped, pads, strict=True) if not pad),
    )
    if task.outcomes is not None:
        outcomes = pa.table(
            {"uri": rows["uri"], "row": pa.array(outcome_rows, pa.int64())}, schema=OUTCOME_SCHEMA
        )
        if task.boxes:
            outcomes = outcomes.append_column(DROPPED_FIELD, pa.array(dropped, DROPPED_FIELD.type))
        write_table(task.outcomes, outcomes)
    if task.receipt is not None:  # after the file (and its outcomes) is complete: a receipt vouches for it
        write_table(
            task.receipt,
            rejects,
            metadata={
                b"lakeshard.uri": result.uri.encode(),
                b"lakeshard.stats": json.dumps(result.stats).encode(),
                b"lakeshard.rows": str(result.rows).encode(),
                b"lakeshard.reused": str(result.reused).encode(),
                b"lakeshard.digest": result.digest.encode(),
            }
            | ({b"lakeshard.dropped_boxes": json.dumps(result.dropped_boxes).encode()} if task.boxes else {}),
        )
    return result


def read_receipt(data: bytes) -> SegmentResult:
    """What :func:`preprocess_segment` returned, from the receipt it wrote (a Parquet file of
    its rejects, the rest in the file's metadata)."""
    table = pq.read_table(pa.BufferReader(data))
    meta = table.schema.metadata
    return SegmentResult(
        uri=meta[b"lakeshard.uri"].decode(),
        stats=json.loads(meta[b"lakeshard.stats"]),
        rows=int(meta[b"lakeshard.rows"]),
        reused=int(meta.get(b"lakeshard.reused", b"0")),
        rejects=table.replace_schema_metadata(None).cast(REJECT_SCHEMA),
        digest=meta[b"lakeshard.digest"].decode(),
        dropped_boxes=json.loads(meta.get(b"lakeshard.dropped_boxes", b"{}")),
    )


def unique_rejects(rejects: pa.Table) -> pa.Table:
    """One row per rejected manifest row (a row and its pad copies may all have failed), sorted
    by key; a row's own failure comes before its copies'."""
    rejects = rejects.take(
        pc.sort_indices(rejects, sort_keys=[("key", "ascending"), ("is_pad", "ascending")])
    )
    keys = rejects["key"].to_pylist()
    first = [i for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    return rejects.take(pa.array(first, pa.int64()))


@dataclass(frozen=True, slots=True)
class RejectsTask:
    """Write the shard rejects table of the dataset at ``root`` from the rejects in the
    ``receipts`` of the segments that had any."""

    root: str
    receipts: tuple[str, ...]
    #: Where below ``root`` (default: the local layout's ``rejects/shards.parquet``).
    relpath: str | None = None


@dataclass(frozen=True, slots=True)
class RejectsTable:
    """The shard rejects table a :class:`RejectsTask` wrote: its URI and rows."""

    uri: str
    rows: int


def write_rejects(task: RejectsTask) -> RejectsTable:
    """Run a :class:`RejectsTask` (:func:`~lakeshard.format.writer.write_shard_rejects`)."""
    tables = [read_receipt(storage.read_bytes(r)).rejects for r in task.receipts]
    rejects = unique_rejects(pa.concat_tables(tables) if tables else REJECT_SCHEMA.empty_table())
    uri = write_shard_rejects(task.root, rejects, relpath=task.relpath)
    return RejectsTable(uri=uri, rows=rejects.num_rows)
