"""Incremental builds (``--base``): take the preprocessed images of unchanged objects from a
previous dataset's shards instead of fetching and decoding them again.

A row's stored image depends only on its object's bytes and the image options, so a row whose
object has the same URI, ETag and size as when the base dataset was built, under the same
image options and preprocessing code (:func:`check_shard_base` refuses any other base), has the image
the base already stores, byte for byte. The base's shards do not record ETags: its manifest
does (the one its ``dataset.json`` was built from, checked by fingerprint).

The rows stay on the workers (``docs/design/0017-incremental-shards.md``); each side is staged
by :func:`lakeshard.format.manifest_table.hash_bucket` of the URI, one file per staging task, sorted by
bucket with a row group per bucket (a join task reads only its bucket's row groups). The
tasks of steps 1 to 3 run on the workers (:mod:`jobs.shard_steps.reuse_tasks`); this module
checks the base, plans the tasks and runs them:

1. *stage*, in the plan's order pass (the same engine action): each base shard file ->
   ``(uri, file, row)`` of its rows that are not pad copies (the ``uri`` and ``is_pad`` columns
   only; :func:`~jobs.shard_steps.reuse_tasks.stage`); each part of the base's channel manifests -> ``(uri, etag, size)``
   (:func:`~jobs.shard_steps.reuse_tasks.stage`); each order task, as it writes its shard's order file -> ``(uri, etag, size,
   segment, pos)`` of its segments' rows, pad copies and spare rows included
   (:func:`~jobs.shard_steps.reuse_tasks.stage_order`).
2. *join* (:func:`~jobs.shard_steps.reuse_tasks.join`, a task per group of buckets): a segment row whose ``(uri, etag, size)``
   is a base row's is a *match* ``(file, row, segment, pos)``, written sorted by base file.
3. *scatter* (:func:`~jobs.shard_steps.reuse_tasks.scatter`, a task per base shard file): check the file against the sha256
   its ``dataset.json`` records (one sequential read), then read the matched rows' images, a
   row group at a time, and write them as *runs* sorted by ``(segment, pos)``, a row group per
   segment, a run each time :data:`~jobs.shard_steps.reuse_tasks._RUN_BYTES` of images are held.

A damaged base shard lends no image: one whose sha256 differs (bytes flipped inside its images
keep its size) or whose Parquet cannot be read is named in one warning, and its rows are
fetched and decoded from the lake like new ones; the dataset is the one a build from scratch
makes.

Each preprocessing task then reads its segment's row groups of the runs
(:func:`jobs.shard_steps.preprocess.reused_rows`) and fetches and decodes only the rows not there; the shards are made
from there on exactly as without ``--base``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.preprocess import SegmentTask
from jobs.shard_steps.reuse_tasks import (
    JoinFolder,
    JoinTask,
    Matches,
    Scattered,
    ScatterTask,
    StagedFile,
    StageTask,
    join,
    scatter,
)
from jobs.shard_steps.staging import image_code, library_versions
from lakeshard import storage
from lakeshard.errors import DatasetError, ShardError
from lakeshard.format import channel_shards, manifest_marker_uri, read_dataset_info, read_manifest_info
from lakeshard.format.info import BaseRef, DatasetInfo
from lakeshard.format.manifest_table import channel_parts

__all__ = [
    "BaseDataset",
    "BaseImages",
    "BaseShard",
    "ReusePlan",
    "check_shard_base",
    "image_options",
    "plan_reuse",
    "reuse_images",
]

log = logging.getLogger(__name__)

#: Rows per join bucket, at most (the buckets hold URIs and ETags, not images).
_ROWS_PER_BUCKET = 500_000

#: The library versions whose code makes an image's bytes (Pillow and its codecs; numpy for
#: the 16-bit conversion).
_IMAGE_LIBRARIES = ("pillow", "numpy")


def image_options(
    *,
    size: int,
    resize: str,
    image_format: str,
    quality: int,
    max_pixels: int,
    code: str | None,
    versions: dict[str, str],
) -> dict[str, Any]:
    """Everything a stored image's bytes depend on besides its object, by the name of its
    ``dataset.json`` field."""
    return {
        "image.size": size,
        "image.resize": resize,
        "image.format": image_format,
        "image.quality": quality,
        "image.max_pixels": max_pixels,
        "image.code": code,
        **{f"versions.{name}": versions.get(name) for name in _IMAGE_LIBRARIES},
    }


def _options_of(info: DatasetInfo) -> dict[str, Any]:
    i = info.image
    return image_options(
        size=i.size,
        resize=i.resize,
        image_format=i.format,
        quality=i.quality,
        max_pixels=i.max_pixels,
        code=i.code,
        versions=info.versions,
    )


def _options_now(cfg: ShardConfig) -> dict[str, Any]:
    return image_options(
        size=cfg.image_size,
        resize=cfg.resize,
        image_format=cfg.image_format,
        quality=cfg.quality,
        max_pixels=cfg.max_image_pixels,
        code=image_code(),
        versions=library_versions(),
    )


@dataclass(frozen=True, slots=True)
class BaseShard:
    """A shard file of the ``--base`` dataset, as its ``dataset.json`` describes it."""

    uri: str
    rows: int
    sha256: str


@dataclass(frozen=True, slots=True)
class BaseDataset:
    """The ``--base`` dataset, checked (:func:`check_shard_base`): its root, ``dataset.json``, every
    shard file and every part of its channel manifests."""

    root: str
    info: DatasetInfo
    shards: tuple[BaseShard, ...]
    manifest_parts: tuple[str, ...]

    def ref(self) -> BaseRef:
        return BaseRef(root=self.root, dataset_version=self.info.dataset_version)


def check_shard_base(uri: str, cfg: ShardConfig) -> BaseDataset:
    """The ``--base`` dataset at ``uri``, or an error naming it and what is wrong: no
    ``dataset.json`` (not complete), another image option, library version or preprocessing
    code (the option, its value there and here), a manifest rebuilt since its shards, a shard
    file missing or of another size. Reads ``dataset.json``, the manifest marker and a listing
    of each shard folder; no row."""
    root = storage.normalize(uri)
    try:
        info = read_dataset_info(root)
    except DatasetError as exc:
        raise DatasetError(
            f"--base {root} is not a complete dataset, so none of its images can be reused: {exc}"
        ) from None
    then, now = _options_of(info), _options_now(cfg)
    if differ := [k for k in now if then[k] != now[k]]:
        k = differ[0]
        raise ShardError(
            f"--base {root} was built with {k} {then[k]!r}, this build has {k} {now[k]!r}"
            + (f" (and differs in {', '.join(differ[1:])})" if differ[1:] else "")
            + (
                " (None: the base's dataset.json does not record it, it was built by an older lakeshard)"
                if then[k] is None
                else ""
            )
            + ": its images are not the ones this build makes; build without --base, or with the base's options"
        )
    marker = manifest_marker_uri(root)
    fingerprint = read_manifest_info(root).fingerprint if storage.exists(marker) else None
    if fingerprint != info.inputs.manifest_fingerprint:
        raise DatasetError(
            f"--base {root}: its manifest ({marker}) is not the one its shards were built from "
            f"(fingerprint {fingerprint!r}, dataset.json says {info.inputs.manifest_fingerprint!r}); "
            "the ETags of its images are unknown, so none can be reused"
        )
    shards = [
        BaseShard(uri=uri, rows=rows, sha256=entry.sha256)
        for c in info.channels
        for (uri, rows), entry in zip(channel_shards(root, info, c), info.channels[c].shards, strict=True)
    ]
    sizes = {storage.join(root, s.path): s.bytes for e in info.channels.values() for s in e.shards}
    for folder in sorted({s.uri.rsplit("/", 1)[0] for s in shards}):
        fs, path = storage.filesystem(folder)
        try:
            found = {
                p.rstrip("/").rsplit("/", 1)[-1]: d["size"] for p, d in fs.find(path, detail=True).items()
            }
        except FileNotFoundError:
            found = {}
        for shard in shards:
            u, name = shard.uri, shard.uri.rsplit("/", 1)[-1]
            if u.rsplit("/", 1)[0] == folder and found.get(name) != sizes[u]:
                raise DatasetError(
                    f"--base {root} is incomplete: its shard {u} is "
                    + (
                        "missing"
                        if name not in found
                        else f"{found[name]} bytes, dataset.json says {sizes[u]}"
                    )
                )
    parts = [p for c in info.channels for p in channel_parts(root, c)]
    return BaseDataset(root=root, info=info, shards=tuple(shards), manifest_parts=tuple(parts))


Runner = Callable[[Callable[[Any], Any], list[Any], list[int], int], list[Any]]


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """Where a build stages its join with the base, and the tasks that stage the base's side
    (step 1) with their sizes (rows)."""

    folder: JoinFolder
    stage_tasks: tuple[StageTask, ...]
    sizes: tuple[int, ...]


def plan_reuse(base: BaseDataset, rows: int, *, folder: str, slots: int) -> ReusePlan:
    """Where a build of ``rows`` rows on ``base`` stages its join (``folder``, emptied), and the
    tasks that stage the base's side (step 1; the plan's order pass runs them, and its order
    tasks stage this build's side, :func:`~jobs.shard_steps.reuse_tasks.stage_order`)."""
    storage.remove(folder, recursive=True)  # a killed run's files: every file read is named by a result
    where = JoinFolder(uri=folder, buckets=max(slots, -(-rows // _ROWS_PER_BUCKET)))
    items = [StageTask(side="shards", index=f, folder=where, source=s.uri) for f, s in enumerate(base.shards)]
    items += [
        StageTask(side="manifest", index=i, folder=where, source=u) for i, u in enumerate(base.manifest_parts)
    ]
    return ReusePlan(
        folder=where,
        stage_tasks=tuple(items),
        sizes=(*(s.rows for s in base.shards), *[1] * len(base.manifest_parts)),
    )


@dataclass(frozen=True, slots=True)
class BaseImages:
    """What the join and the copy found (:func:`reuse_images`): the segment tasks, each naming
    the runs that hold the images of its rows the base had, and how many rows were matched."""

    tasks: list[SegmentTask]
    matched: int


def reuse_images(
    run: Runner,
    base: BaseDataset,
    folder: JoinFolder,
    staged: list[StagedFile],
    tasks: list[SegmentTask],
    *,
    skip: tuple[int, ...],
    cores: int,
) -> BaseImages:
    """Find the rows of ``tasks`` whose images ``base`` holds (the join, step 2, of the files
    ``staged`` in step 1; segments ``skip`` left out) and copy those images into runs on the
    workers (step 3). ``run(fn, items, sizes, slots)`` runs ``fn`` over ``items`` on the engine
    (:func:`jobs.shard_steps.build_state.run_tasks`); the join runs in a task per core at most (it reads URIs and
    ETags: more tasks cost more than they share), and so does the copy of the images: its work
    per base file is known (the file's rows), so a task per core shares it as well as more
    would, and each engine task costs time to schedule."""
    files = {
        side: tuple(sorted(f.uri for f in staged if f.side == side and f.rows))
        for side in ("shards", "manifest", "current")
    }
    if not tasks or not all(files.values()):
        return BaseImages(tasks=tasks, matched=0)
    buckets = [list(range(folder.buckets))[i::cores] for i in range(min(cores, folder.buckets))]
    joins = [
        JoinTask(
            buckets=tuple(b),
            uri=folder.matches(i),
            shards=files["shards"],
            manifest=files["manifest"],
            current=files["current"],
            skip=skip,
        )
        for i, b in enumerate(buckets)
    ]
    matched: list[Matches] = [m for m in run(join, joins, [len(j.buckets) for j in joins], cores) if m.rows]
    by_file: dict[int, list[str]] = {}
    for m in matched:
        assert m.uri is not None  # join(): a match with rows has its file
        for f in m.files:
            by_file.setdefault(f, []).append(m.uri)
    scatters = [
        ScatterTask(
            file=f, source=base.shards[f].uri, sha256=base.shards[f].sha256, matches=tuple(m), folder=folder
        )
        for f, m in sorted(by_file.items())
    ]
    done: list[Scattered] = run(scatter, scatters, [base.shards[s.file].rows for s in scatters], cores)
    _warn_damaged(base, staged, done)
    runs_of: dict[int, list[str]] = {}
    for d in done:
        for uri, segments in d.runs:
            for s in segments:
                runs_of.setdefault(s, []).append(uri)
    return BaseImages(
        tasks=[replace(t, base_runs=tuple(runs_of.get(t.reuse_id, ()))) for t in tasks],
        matched=sum(d.images for d in done),
    )


def _warn_damaged(base: BaseDataset, staged: list[StagedFile], done: list[Scattered]) -> None:
    """One warning per damaged base shard: those whose Parquet could not be read when staged
    (they match no row) and those whose sha256 differs."""
    # A damaged staged file names its source (stage()).
    damaged = [(f.source, f.damaged) for f in staged if f.damaged and f.source is not None]
    damaged += [(base.shards[d.file].uri, d.damaged) for d in done if d.damaged is not None]
    for uri, why in damaged:
        what = "manifest part" if "/manifests/" in uri else "shard"
        log.warning(
            "--base %s %s %s: none of its images is reused; its rows are fetched and decoded from the lake",
            what,
            uri,
            why,
        )
