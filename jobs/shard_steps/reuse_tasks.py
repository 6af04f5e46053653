"""The join with the ``--base`` dataset, on the workers: both sides staged by URI bucket
(:func:`stage`, :func:`stage_order`), joined (:func:`join`) and the matched images copied into
runs (:func:`scatter`); steps 1 to 3 of :mod:`jobs.shard_steps.reuse`, which plans and runs them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.common.tasks import row_group_starts
from jobs.shard_steps.preprocess import read_where
from lakeshard import storage
from lakeshard.errors import DatasetError, ShardError
from lakeshard.format.manifest_table import hash_bucket, read_part

__all__ = [
    "JoinFolder",
    "JoinTask",
    "Matches",
    "ScatterTask",
    "Scattered",
    "StageTask",
    "StagedFile",
    "join",
    "scatter",
    "stage",
    "stage_order",
]

#: Image bytes a scatter task holds before it writes them as a run.
_RUN_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class JoinFolder:
    """Where the join with the base stages its files (the folder ``uri``: both sides, the
    matches and the runs of images) and into how many URI buckets."""

    uri: str
    buckets: int

    def staged(self, side: str, index: int) -> str:
        return storage.join(self.uri, side, f"part-{index:05d}.parquet")

    def matches(self, index: int) -> str:
        return storage.join(self.uri, "matches", f"part-{index:05d}.parquet")

    def run(self, file: int, index: int) -> str:
        return storage.join(self.uri, "runs", f"file-{file:05d}-{index:03d}.parquet")


def _write_grouped(uri: str, table: pa.Table, by: str) -> list[int]:
    """Write ``table`` sorted by its int column ``by``, a row group per value; return the values.
    Binary columns (images) are written as they are: no compression, dictionary or statistics
    (JPEG bytes do not compress, and only ``by``'s statistics are ever read)."""
    table = table.take(pc.sort_indices(table, sort_keys=[(by, "ascending")]))
    values = table[by].to_numpy()
    cuts = [0, *(np.flatnonzero(np.diff(values)) + 1).tolist(), len(values)]
    fs, path = storage.filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    sink = pa.BufferOutputStream()
    plain = [f.name for f in table.schema if pa.types.is_binary(f.type)]
    with pq.ParquetWriter(
        sink,
        table.schema,
        write_statistics=[by],
        compression={f.name: "NONE" if f.name in plain else "SNAPPY" for f in table.schema},
        use_dictionary=[f.name for f in table.schema if f.name not in plain],
    ) as writer:
        for a, b in pairwise(cuts):
            if b > a:
                writer.write_table(table.slice(a, b - a), row_group_size=b - a)
    storage.write_bytes_atomic(uri, sink.getvalue().to_pybytes(), durable=False)  # every run stages them anew
    return sorted({int(v) for v in values})


@dataclass(frozen=True, slots=True)
class StagedFile:
    """A file of one side of the join, staged by URI bucket (step 1): ``side`` is ``shards``,
    ``manifest`` (the base's) or ``current`` (this build's). A base input that could not be
    read stages no row: ``source`` names it and ``damaged`` says why."""

    side: str
    uri: str
    rows: int
    source: str | None = None
    damaged: str | None = None


def _bucketed(side: str, uri: str, table: pa.Table, buckets: int) -> StagedFile:
    """Stage ``table`` (a ``uri`` column) by URI bucket at ``uri``."""
    bucket = pa.array([hash_bucket(u, buckets) for u in table["uri"].to_pylist()], pa.int32())
    _write_grouped(uri, table.append_column("bucket", bucket), "bucket")
    return StagedFile(side=side, uri=uri, rows=table.num_rows)


@dataclass(frozen=True, slots=True)
class StageTask:
    """Stage one input of the base's side of the join by URI bucket (step 1): ``side`` is
    ``shards`` (base shard ``source``, its index ``index``) or ``manifest`` (base manifest part
    ``source``)."""

    side: str
    index: int
    folder: JoinFolder
    source: str


def stage(task: StageTask) -> StagedFile:
    """Run a :class:`StageTask`."""
    out = task.folder.staged(task.side, task.index)
    if task.side == "shards":
        fs, path = storage.filesystem(task.source)
        try:
            rows = pq.read_table(path, filesystem=fs, columns=["uri", "is_pad"])
        except (pa.ArrowException, OSError) as exc:  # a damaged shard lends no image
            return _unreadable(task, out, f"cannot be read as Parquet ({type(exc).__name__}: {exc})")
        keep = pc.invert(rows["is_pad"])
        table = pa.table(
            {
                "uri": rows["uri"],
                "file": pa.array(np.full(rows.num_rows, task.index, np.int32)),
                "row": pa.array(np.arange(rows.num_rows, dtype=np.int64)),
            }
        ).filter(keep)
    else:
        try:
            table = read_part(task.source, ["uri", "etag", "size"])
        except (
            DatasetError,
            pa.ArrowException,
            OSError,
        ) as exc:  # its rows' ETags are unknown: none is reused
            return _unreadable(task, out, f"cannot be read ({type(exc).__name__}: {exc})")
        table = table.filter(pc.is_valid(table["etag"]))
    return _bucketed(task.side, out, table, task.folder.buckets)


def _unreadable(task: StageTask, out: str, why: str) -> StagedFile:
    """What a :class:`StageTask` whose input cannot be read stages: no row, and why."""
    return StagedFile(side=task.side, uri=out, rows=0, source=task.source, damaged=why)


def stage_order(
    folder: JoinFolder, rows: pa.Table, cuts: tuple[int, ...], segments: tuple[int, ...]
) -> StagedFile:
    """Stage this build's side of the join for an order file (step 1): its ``rows``, in order,
    cut at ``cuts`` into segments ``segments``, as ``(uri, etag, size, segment, pos)``, ``pos``
    a row's position in its segment, rows without an ETag left out. The staged file, side
    ``current``, is named after the first segment."""
    out = folder.staged("current", segments[0])
    if not rows.num_rows:
        return StagedFile(side="current", uri=out, rows=0)
    position = np.arange(rows.num_rows, dtype=np.int64)
    which = np.searchsorted(np.asarray(cuts[1:-1], np.int64), position, side="right")
    table = pa.table(
        {
            "uri": rows["uri"],
            "etag": rows["etag"],
            "size": rows["size"],
            "segment": pa.array(np.asarray(segments, np.int32)[which]),
            "pos": pa.array(position - np.asarray(cuts, np.int64)[which]),
        }
    )
    table = table.filter(pc.is_valid(table["etag"]))
    if not table.num_rows:
        return StagedFile(side="current", uri=out, rows=0)
    return _bucketed("current", out, table, folder.buckets)


@dataclass(frozen=True, slots=True)
class JoinTask:
    """Join the staged sides of ``buckets`` (step 2) and write the matches to ``uri``."""

    buckets: tuple[int, ...]
    uri: str
    shards: tuple[str, ...]
    manifest: tuple[str, ...]
    current: tuple[str, ...]
    #: Segments not to match (an interrupted run of this job finished them).
    skip: tuple[int, ...] = ()


def _first_per_uri(table: pa.Table) -> pa.Table:
    """One row per URI (the first by file and row): a base holds each object once, but never trust that."""
    table = table.take(
        pc.sort_indices(table, sort_keys=[("uri", "ascending"), ("file", "ascending"), ("row", "ascending")])
    )
    uris = table["uri"].to_pylist()
    return table.take(pa.array([i for i, u in enumerate(uris) if i == 0 or uris[i - 1] != u], pa.int64()))


@dataclass(frozen=True, slots=True)
class Matches:
    """What a :class:`JoinTask` matched: the matches file (None: no match), its rows and the
    base shard files (by index) they name."""

    uri: str | None
    rows: int
    files: tuple[int, ...]


def join(task: JoinTask) -> Matches:
    """Run a :class:`JoinTask`."""
    pieces = []
    for b in task.buckets:
        current = read_where(task.current, "bucket", b, ["uri", "etag", "size", "segment", "pos"])
        if task.skip:
            current = current.filter(pc.invert(pc.is_in(current["segment"], pa.array(task.skip, pa.int32()))))
        if not current.num_rows or not task.shards or not task.manifest:
            continue
        shards = _first_per_uri(read_where(task.shards, "bucket", b, ["uri", "file", "row"]))
        manifest = read_where(task.manifest, "bucket", b, ["uri", "etag", "size"])
        base = shards.join(manifest, keys="uri", join_type="inner")
        pieces.append(
            current.join(base, keys=["uri", "etag", "size"], join_type="inner").select(
                ["uri", "file", "row", "segment", "pos"]
            )
        )
    if not pieces or not sum(p.num_rows for p in pieces):
        return Matches(uri=None, rows=0, files=())
    matches = pa.concat_tables(pieces)
    files = _write_grouped(task.uri, matches, "file")
    return Matches(uri=task.uri, rows=matches.num_rows, files=tuple(files))


@dataclass(frozen=True, slots=True)
class ScatterTask:
    """Copy the matched images of base shard ``source`` (index ``file``) into runs (step 3),
    once the file's bytes hash to ``sha256``."""

    file: int
    source: str
    sha256: str
    matches: tuple[str, ...]
    folder: JoinFolder


@dataclass(frozen=True, slots=True)
class Scattered:
    """What a :class:`ScatterTask` copied: its runs as ``(uri, segment ids)`` pairs and the
    images they hold; or, for a damaged base shard, no run and why (``damaged``)."""

    file: int
    runs: tuple[tuple[str, tuple[int, ...]], ...]
    images: int
    damaged: str | None = None


_HASH_CHUNK = 8 << 20


def _damage(source: str, sha256: str) -> str | None:
    """Why the base shard file ``source`` cannot lend its images (its bytes do not hash to
    ``sha256``, as ``dataset.json`` says they do), or None."""
    fs, path = storage.filesystem(source)
    digest = hashlib.sha256()
    try:
        with fs.open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        return f"cannot be read: {type(exc).__name__}: {exc}"
    if digest.hexdigest() != sha256:
        return f"its sha256 is {digest.hexdigest()[:16]}..., dataset.json says {sha256[:16]}... (damaged since it was built)"
    return None


def scatter(task: ScatterTask) -> Scattered:
    """Run a :class:`ScatterTask`: check the base shard's sha256 (a sequential read of the whole
    file: a damaged image must never be copied into the new dataset), then copy the images."""
    if (why := _damage(task.source, task.sha256)) is not None:
        return Scattered(file=task.file, runs=(), images=0, damaged=why)
    want = read_where(task.matches, "file", task.file, ["uri", "row", "segment", "pos"])
    want = want.take(pc.sort_indices(want, sort_keys=[("row", "ascending")]))
    rows = want["row"].to_numpy()
    fs, path = storage.filesystem(task.source)
    runs: list[tuple[str, list[int]]] = []
    held: list[pa.Table] = []
    size = 0

    def flush() -> None:
        nonlocal held, size
        if held:
            uri = task.folder.run(task.file, len(runs))
            runs.append((uri, _write_grouped(uri, pa.concat_tables(held), "segment")))
        held, size = [], 0

    with fs.open(path, "rb") as handle:
        pf = pq.ParquetFile(handle)
        starts = row_group_starts(pf)
        groups = np.searchsorted(starts, rows, side="right") - 1
        for g in np.unique(groups):
            mine = np.flatnonzero(groups == g)
            got = pf.read_row_group(int(g), columns=["uri", "image", "height", "width"]).take(
                pa.array(rows[mine] - starts[g])
            )
            expect = want["uri"].take(pa.array(mine))
            if not got["uri"].equals(expect):
                raise ShardError(
                    f"--base shard {task.source} changed while it was read: row "
                    f"{int(rows[mine][0])} is not {expect[0].as_py()}"
                )
            piece = pa.table(
                {
                    "segment": want["segment"].take(pa.array(mine)),
                    "pos": want["pos"].take(pa.array(mine)),
                    "image": got["image"],
                    "height": got["height"],
                    "width": got["width"],
                }
            )
            held.append(piece)
            size += piece.nbytes
            if size >= _RUN_BYTES:
                flush()
    flush()
    return Scattered(file=task.file, runs=tuple((u, tuple(seg)) for u, seg in runs), images=len(rows))
