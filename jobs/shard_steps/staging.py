"""The shard job's staging folder: where its files are written before the commit, named after
everything they depend on, so a rerun of an interrupted job finds the segments it finished.

    local:  <dataset>/_staging/shards-<hash>/<channel folder>/part-00000-of-00004.parquet
    S3:     <dataset>/shards/v=<dataset version>-<hash>/<channel folder>/part-00000-of-00004.parquet
    both:   <staging>/_runs/...       the work folder: slot parts, order files, segments, the dropped
                                      rows' segment, receipts, the --base join (removed by the commit)

The staging folder is laid out as ``shards/`` is (:func:`staged_shard` goes through the format's
layout helpers). Locally the commit moves it into place whole (a rename). On S3, which has no
rename, it is the version folder itself: the shards are written once, where ``dataset.json``
will name them (:func:`versioned`; ``docs/design/0012-versioned-shards.md``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import tempfile
import uuid
from typing import Any

import pyarrow as pa

from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.preprocess import SegmentResult, SegmentTask, read_receipt
from lakeshard import locks, storage
from lakeshard.format import (
    VERSION_MARKER,
    channel_dirname,
    shard_name,
    shard_rejects_relpath,
    version_dirname,
    versions_uri,
)
from lakeshard.format.versions import current_version, list_versions

__all__ = [
    "WORK_FOLDER",
    "assembled_shard",
    "finished",
    "image_code",
    "library_versions",
    "outcomes_uri",
    "plan_only_folder",
    "preprocessing_code",
    "receipt_uri",
    "rejects_path",
    "staged_shard",
    "staging_folder",
    "staging_root",
    "versioned",
    "work_uri",
]

log = logging.getLogger(__name__)

#: The staging folder's work folder: every file the build needs only until the commit (slot
#: parts, order files, segment files, receipts, outcomes, the ``--base`` join), removed by it.
WORK_FOLDER = "_runs"


def work_uri(staging: str, *parts: str) -> str:
    """``parts`` below the work folder of ``staging`` (:data:`WORK_FOLDER`)."""
    return storage.join(staging, WORK_FOLDER, *parts)


def staging_root(root: str) -> str:
    return storage.join(root, "_staging")


def plan_only_folder(root: str) -> str:
    """Where a ``--plan-only`` run writes its plan's files (removed at the end): a folder of its
    own under the dataset's ``_staging/``, or, for a local dataset this process cannot write (a
    read-only mount, another user's folder), a temporary folder on this machine (the plan only
    reads the dataset; a cluster's workers must then share this machine's disk)."""
    name = f"plan-only-{uuid.uuid4().hex[:12]}"
    folder = storage.normalize(root)
    if storage.is_local(folder) and not os.access(storage.local_path(folder), os.W_OK):
        log.warning("%s cannot be written: the plan's files go to this machine's temporary folder", root)
        return storage.join(tempfile.gettempdir(), name)
    return storage.join(staging_root(root), name)


def versioned(uri: str) -> bool:
    """Whether the dataset (or staging folder) at ``uri`` is built in version folders: on S3,
    which has no rename. A local dataset's commit renames its staging folder to ``shards/``."""
    return not storage.is_local(uri)


def rejects_path(staging: str) -> str:
    """Where this build's shard rejects table goes, relative to the dataset root (what
    ``dataset.json``'s ``rejects_path`` says): in the version folder on S3."""
    name = staging.rsplit("/", 1)[-1]
    return shard_rejects_relpath(name.removeprefix("v=") if versioned(staging) else None)


def staged_shard(staging: str, channel: str, shard: int, count: int) -> str:
    """Where shard ``shard`` of ``channel`` waits for the commit (its place below ``shards/``)."""
    return storage.join(staging, channel_dirname(channel), shard_name(shard, count))


def assembled_shard(staging: str, channel: str, shard: int, count: int) -> str:
    """Where shard ``shard`` of ``channel`` is assembled again (after rejects): beside its place,
    which may hold a segment file other assemblies read. Locally it is renamed onto its place;
    on S3 it stays, and ``dataset.json`` names it there."""
    return storage.join(staging, channel_dirname(channel), shard_name(shard, count, assembled=True))


def receipt_uri(staging: str, uri: str) -> str:
    """The receipt of the segment file ``uri`` (inside ``staging``)."""
    return work_uri(staging, "receipts", uri[len(staging) + 1 :])


def outcomes_uri(staging: str, uri: str) -> str:
    """Where the segment file ``uri`` (inside ``staging``) says where it wrote each row."""
    return work_uri(staging, "outcomes", uri[len(staging) + 1 :])


def staging_folder(root: str, version: str, cfg: ShardConfig, segment_rows: int, *, resume: bool) -> str:
    """This job's staging folder, named after everything its files depend on, so a rerun of an
    interrupted job finds the segments it finished (``resume``); any other staging folder is a
    leftover of a job with other settings, and is removed."""
    key = {
        "dataset_version": version,
        "versions": library_versions(),
        "code": preprocessing_code(),
        "segment_rows": segment_rows,
        "row_group_bytes": cfg.row_group_size,
    }
    if versioned(root):
        return _version_folder(root, version, key, resume=resume)
    name = "shards-" + _digest(key)[:12]
    parent = staging_root(root)
    staging = storage.join(parent, name)
    _remove_children(parent, keep={name} if resume else set())
    return staging


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _version_folder(root: str, version: str, key: dict[str, Any], *, resume: bool) -> str:
    """On S3: this build's version folder, ``shards/v=<version>-<hash>``. The hash is of the
    staging key and of the version ``dataset.json`` names now, so a rerun of a killed build
    finds its folder again, and a build of the same dataset version after a commit gets a new
    folder (never one a reader may be reading). Holding the dataset's lock (:mod:`lakeshard.locks`),
    no other build runs, so every other incomplete folder is a leftover of a killed build and is
    removed; without it (a store with no conditional writes) another build may own one, and they
    all stay. Complete versions stay (``python -m jobs.versions`` removes them)."""
    current = current_version(root)
    name = f"{version}-{_digest({**key, 'replaces': current})[:8]}"
    complete = {version_dirname(v.name) for v in list_versions(root) if v.complete}
    mine = version_dirname(name)
    if locks.holds(root):
        _remove_children(versions_uri(root), keep=complete - {mine} | ({mine} if resume else set()))
    else:
        log.warning(
            "%s: not holding the dataset's lock, this build leaves other builds' incomplete version "
            "folders (the next build that holds the lock removes them)",
            root,
        )
        if not resume:
            storage.remove(versions_uri(root, name), recursive=True)
    staging = versions_uri(root, name)
    storage.remove(storage.join(staging, VERSION_MARKER))  # writing into it: no longer a complete version
    return staging


def _children(uri: str) -> list[str]:
    fs, path = storage.filesystem(uri)
    try:
        return [c.rstrip("/").rsplit("/", 1)[-1] for c in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def _remove_children(parent: str, *, keep: set[str]) -> None:
    for child in _children(parent):
        if child not in keep:
            storage.remove(storage.join(parent, child), recursive=True)


#: The modules whose source decides a segment file's bytes (:func:`preprocessing_code`).
_PREPROCESSING_MODULES = (
    "jobs.common.images",
    "jobs.shard_steps.as_listed",
    "jobs.shard_steps.preprocess",
    "jobs.shard_steps.assemble",
    "jobs.shard_steps.segments",
    "lakeshard.format.layout",
    "lakeshard.format.writer",
)


def _source(module: str) -> bytes:
    """The source of ``module``, found without importing it (from a ``--py-files`` zip too)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the source of {module}")
    return spec.loader.get_data(spec.origin)  # type: ignore[union-attr]


def preprocessing_code() -> str:
    """A hash of the source of the modules that decide a segment file's bytes: an edited
    preprocessing step must not reuse files the old one wrote."""
    digest = hashlib.sha256()
    for module in _PREPROCESSING_MODULES:
        digest.update(_source(module))
    return digest.hexdigest()[:16]


def image_code() -> str:
    """A hash of the source of the module that decides a stored image's bytes from its object's
    (``dataset.json``'s ``image.code``): an incremental build reuses images only from a dataset
    whose images the same code made (:mod:`jobs.shard_steps.reuse`)."""
    return hashlib.sha256(_source("jobs.common.images")).hexdigest()[:16]


def library_versions() -> dict[str, str]:
    import numpy
    import PIL

    return {
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "pillow": PIL.__version__,
        "numpy": numpy.__version__,
    }


def finished(staging: str, tasks: list[SegmentTask]) -> dict[str, SegmentResult]:
    """The results of the segments an earlier run of this job finished, by segment file: those
    whose receipt is there, names the same rows (their digest), and whose file has the size the
    receipt says and whose outcomes are there (one listing, then one read per receipt: a receipt
    holds the segment's rejects, not a row per image)."""
    fs, path = storage.filesystem(staging)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    by_receipt = {storage.filesystem(t.receipt)[1]: t for t in tasks if t.receipt is not None}
    hits = [p for p in found if p in by_receipt]
    reused: dict[str, SegmentResult] = {}
    for p, data in (fs.cat(hits) if hits else {}).items():
        task = by_receipt[p]
        try:
            result = read_receipt(data)
        except Exception as exc:  # a receipt is written whole; still, never trust a bad one
            log.warning("ignoring the unreadable receipt %s: %s", p, exc)
            continue
        segment = found.get(storage.filesystem(task.uri)[1])
        outcomes = task.outcomes is None or storage.filesystem(task.outcomes)[1] in found
        if (
            result.uri == task.uri
            and segment is not None
            and segment["size"] == result.stats["bytes"]
            and outcomes
            and result.rows == task.num_rows
            and result.digest == task.expected_digest()
        ):
            reused[task.uri] = result
    return reused
