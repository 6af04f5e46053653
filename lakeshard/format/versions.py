"""The shard versions of a dataset on S3: ``shards/v=<version>/`` folders, one per build of the
shard job (``docs/format.md``; the layout's names come from :mod:`lakeshard.format.layout`).

A version is *current* (named by ``dataset.json``), *complete* (its build finished: it has its
marker, a copy of its ``dataset.json``) or *incomplete* (a build in progress, or a killed
build's leftover). A local dataset has no version folders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lakeshard import storage
from lakeshard.errors import DatasetError
from lakeshard.format.info import DatasetInfo
from lakeshard.format.layout import dataset_json_uri, version_marker_uri, versions_uri
from lakeshard.format.reader import shard_version

__all__ = ["Version", "current_version", "list_versions"]

log = logging.getLogger(__name__)

_PREFIX = "v="


@dataclass(frozen=True, slots=True)
class Version:
    """One version folder below ``shards/``."""

    name: str  #: the folder is ``shards/v=<name>/``
    uri: str
    current: bool  #: ``dataset.json`` names it
    complete: bool  #: its build finished (it has its marker)
    created_at: str | None  #: from its marker; None for an incomplete version
    files: int
    bytes: int

    @property
    def state(self) -> str:
        return "current" if self.current else "complete" if self.complete else "incomplete"


def current_version(root: str) -> str | None:
    """The version ``<root>/dataset.json`` names, or None (no dataset, the local layout, or a
    ``dataset.json`` of another format version, whose shards are no version of this one).

    Raises:
        DatasetError: ``dataset.json`` of this format names shards the layout does not allow.
    """
    uri = dataset_json_uri(root)
    if not storage.exists(uri):
        return None
    data = storage.read_json(uri)
    try:
        info = DatasetInfo.from_json(data, source=uri)
    except DatasetError:
        log.warning("%s is not a dataset.json this code reads; it names no shard version", uri)
        return None
    return shard_version(info, source=uri)


def list_versions(root: str) -> list[Version]:
    """Every version folder of the dataset at ``root``, oldest first (complete ones by their
    ``created_at``, then incomplete ones by name).

    Raises:
        DatasetError: ``dataset.json`` names shards the layout does not allow.
    """
    root = storage.normalize(root)
    current = current_version(root)
    fs, path = storage.filesystem(versions_uri(root))
    try:
        children = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for child in children:
        name = child.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith(_PREFIX):
            continue
        name = name[len(_PREFIX) :]
        uri = versions_uri(root, name)
        files = fs.find(storage.filesystem(uri)[1], detail=True)
        marker = version_marker_uri(root, name)
        created = (
            storage.read_json(marker).get("created_at") if storage.filesystem(marker)[1] in files else None
        )
        out.append(
            Version(
                name=name,
                uri=uri,
                current=name == current,
                complete=created is not None or name == current,
                created_at=created,
                files=len(files),
                bytes=sum(int(f["size"]) for f in files.values()),
            )
        )
    return sorted(out, key=lambda v: (not v.complete, v.created_at or "", v.name))
