"""The shard job's staging folder: where its files are written before the commit, named after
everything they depend on, so a rerun of an interrupted job finds the segments it finished.

    <dataset>/_staging/shards-<hash>/<channel folder>/part-00000-of-00004.parquet
    <dataset>/_staging/shards-<hash>/_runs/...       segments, spare rows, receipts, assemblies

The staging folder is laid out as ``shards/`` is (:func:`staged_shard` goes through the format's
layout helpers), so the commit moves it into place whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from typing import Any

import pyarrow as pa

from jobs.preprocess import SegmentTask, read_receipt
from jobs.settings import ShardConfig
from lakeshard import storage
from lakeshard.format import channel_dirname, shard_name

__all__ = ["RUNS", "finished", "library_versions", "outcomes_uri", "preprocessing_code", "receipt_uri", "staged_shard",
           "staging_folder", "staging_root"]

log = logging.getLogger(__name__)

#: Inside the staging folder: segment files, spare rows, receipts and assemblies, removed
#: before the commit.
RUNS = "_runs"


def staging_root(root: str) -> str:
    return storage.join(root, "_staging")


def staged_shard(staging: str, channel: str, shard: int, count: int) -> str:
    """Where shard ``shard`` of ``channel`` waits for the commit (its place below ``shards/``)."""
    return storage.join(staging, channel_dirname(channel), shard_name(shard, count))


def receipt_uri(staging: str, uri: str) -> str:
    """The receipt of the segment file ``uri`` (inside ``staging``)."""
    return storage.join(staging, RUNS, "receipts", uri[len(staging) + 1 :])


def outcomes_uri(staging: str, uri: str) -> str:
    """Where the segment file ``uri`` (inside ``staging``) says where it wrote each row."""
    return storage.join(staging, RUNS, "outcomes", uri[len(staging) + 1 :])


def staging_folder(root: str, version: str, cfg: ShardConfig, segment_rows: int, *, resume: bool) -> str:
    """This job's staging folder, named after everything its files depend on, so a rerun of an
    interrupted job finds the segments it finished (``resume``); any other staging folder is a
    leftover of a job with other settings, and is removed."""
    key = {"dataset_version": version, "versions": library_versions(), "code": preprocessing_code(),
           "segment_rows": segment_rows, "row_group_bytes": cfg.row_group_size}
    name = "shards-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    parent = staging_root(root)
    staging = storage.join(parent, name)
    fs, path = storage.filesystem(parent)
    try:
        children = [c.rstrip("/").rsplit("/", 1)[-1] for c in fs.ls(path, detail=False)]
    except FileNotFoundError:
        children = []
    for child in children:
        if not resume or child != name:
            storage.remove(storage.join(parent, child), recursive=True)
    return staging


def preprocessing_code() -> str:
    """A hash of the source of the modules that decide a segment file's bytes: an edited
    preprocessing step must not reuse files the old one wrote."""
    from jobs import assemble, fetch, images, preprocess, segments
    from lakeshard.format import layout, writer

    digest = hashlib.sha256()
    for module in (images, fetch, preprocess, assemble, segments, layout, writer):
        digest.update(module.__loader__.get_data(module.__file__))  # works from a --py-files zip too
    return digest.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    import numpy
    import PIL

    return {"python": platform.python_version(), "pyarrow": pa.__version__, "pillow": PIL.__version__,
            "numpy": numpy.__version__}


def finished(staging: str, tasks: list[SegmentTask]) -> dict[str, dict[str, Any]]:
    """The results of the segments an earlier run of this job finished: those whose receipt is
    there, names the same rows (their digest), and whose file has the size the receipt says and
    whose outcomes are there (one listing, then one read per receipt: a receipt holds the
    segment's rejects, not a row per image)."""
    fs, path = storage.filesystem(staging)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    by_receipt = {storage.filesystem(t.receipt)[1]: t for t in tasks if t.receipt is not None}
    hits = [p for p in found if p in by_receipt]
    reused: dict[str, dict[str, Any]] = {}
    for p, data in (fs.cat(hits) if hits else {}).items():
        task = by_receipt[p]
        try:
            result = read_receipt(data)
        except Exception as exc:  # a receipt is written whole; still, never trust a bad one
            log.warning("ignoring the unreadable receipt %s: %s", p, exc)
            continue
        segment = found.get(storage.filesystem(task.uri)[1])
        outcomes = task.outcomes is None or storage.filesystem(task.outcomes)[1] in found
        if (result["uri"] == task.uri and segment is not None and segment["size"] == result["stats"]["bytes"]
                and outcomes and result["rows"] == task.num_rows
                and result.pop("digest") == task.expected_digest()):
            reused[task.uri] = result
    return reused
