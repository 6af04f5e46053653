"""The shard versions of a dataset on S3, listed and removed.

    python -m jobs.versions list --dataset s3://lake/datasets/pets-v1
    python -m jobs.versions remove --dataset s3://lake/datasets/pets-v1 --keep 2 --dry-run
    python -m jobs.versions remove --dataset s3://lake/datasets/pets-v1 --version 3f2a...-9c1b0d2e

On S3 each run of the shard job writes its shards once, into a version folder
``shards/v=<version>/``, and ``dataset.json`` names the one that is the dataset (see
``docs/format.md``); the folders of earlier versions stay until removed here, so a reader that
opened an earlier ``dataset.json`` keeps reading whole files. A version is *current* (named by
``dataset.json``), *complete* (its build finished: it has its marker, a copy of its
``dataset.json``) or *incomplete* (a build in progress, or a killed build's leftover, which the
shard job's next run reuses or removes).

``remove`` never removes the current version. ``--keep N`` keeps the N newest complete versions
(the current one always among them) and never touches incomplete ones (a build may be writing
them); ``--version V`` removes one version that is not the current one. A local dataset has no
version folders: its shard job replaces ``shards/`` in place.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

from jobs.engines.cli import cli_main
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, PlatformError, StorageError
from lakeshard.format import (
    DatasetInfo,
    dataset_json_uri,
    shard_version,
    version_dirname,
    version_marker_uri,
    versions_uri,
)

__all__ = ["Version", "current_version", "list_versions", "main", "parser", "remove_versions"]

log = logging.getLogger("jobs.versions")

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


def _check_dataset(root: str) -> None:
    """Raise :class:`StorageError` if ``root``'s bucket does not exist, :class:`DatasetError` if
    nothing is at ``root``: a typo is an error, not a dataset without versions."""
    fs, path = storage.filesystem(root)
    try:
        if root.startswith("s3://"):
            bucket = path.split("/", 1)[0]
            try:
                fs.info(bucket)
            except FileNotFoundError:
                raise StorageError(f"--dataset {root}: its bucket {bucket!r} does not exist") from None
        if not fs.exists(path):
            raise DatasetError(f"--dataset {root} does not exist")
    except PlatformError:
        raise
    except Exception as exc:  # a denied or unreachable endpoint: name the URI and the cause
        raise StorageError(f"cannot read --dataset {root}: {type(exc).__name__}: {exc}") from exc


def list_versions(root: str) -> list[Version]:
    """Every version folder of the dataset at ``root``, oldest first (complete ones by their
    ``created_at``, then incomplete ones by name).

    Raises:
        DatasetError: nothing is at ``root``.
        StorageError: ``root``'s bucket does not exist, or cannot be read.
    """
    root = storage.normalize(root)
    _check_dataset(root)
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
        name = name[len(_PREFIX):]
        uri = versions_uri(root, name)
        files = fs.find(storage.filesystem(uri)[1], detail=True)
        marker = version_marker_uri(root, name)
        created = storage.read_json(marker).get("created_at") if storage.filesystem(marker)[1] in files else None
        out.append(Version(name=name, uri=uri, current=name == current, complete=created is not None or name == current,
                           created_at=created, files=len(files), bytes=sum(int(f["size"]) for f in files.values())))
    return sorted(out, key=lambda v: (not v.complete, v.created_at or "", v.name))


def remove_versions(root: str, *, keep: int | None = None, version: str | None = None,
                    dry_run: bool = False) -> list[Version]:
    """Remove old versions of the dataset at ``root`` (``keep`` or ``version``, see the module
    docstring); return what was removed (or would be, with ``dry_run``).

    Raises:
        ConfigError: neither or both of ``keep`` and ``version``, ``keep`` < 1, a ``version``
            the dataset does not have, or the current version.
        DatasetError, StorageError: as :func:`list_versions`.
    """
    if (keep is None) == (version is None):
        raise ConfigError("give exactly one of --keep N and --version V")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"--keep must be an integer >= 1 (the current version is always kept), got {keep!r}")
    root = storage.normalize(root)
    found = list_versions(root)
    if version is not None:
        try:
            version_dirname(version)
        except ValueError as exc:
            raise ConfigError(f"--version: {exc}") from None
        by_name = {v.name: v for v in found}
        if version not in by_name:
            raise ConfigError(f"--version {version!r}: {versions_uri(root)} has no such version "
                              f"(it has {sorted(by_name) or 'none'}; python -m jobs.versions list --dataset {root})")
        if by_name[version].current:
            raise ConfigError(f"--version {version!r} is the current version of {root} (dataset.json names it); "
                              "it cannot be removed")
        doomed = [by_name[version]]
    else:
        complete = [v for v in found if v.complete]
        kept = {v.name for v in complete if v.current}
        for v in reversed(complete):
            if len(kept) >= keep:
                break
            kept.add(v.name)
        doomed = [v for v in complete if v.name not in kept]
    for v in doomed:
        if dry_run:
            log.info("would remove %s version %s (%d files, %d bytes)", v.state, v.uri, v.files, v.bytes)
            continue
        storage.remove(v.uri, recursive=True)
        log.info("removed %s version %s (%d files, %d bytes)", v.state, v.uri, v.files, v.bytes)
    return doomed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.versions",
        description="List or remove the shard versions of a dataset on S3 (shards/v=<version>/). The version "
                    "dataset.json names is never removed.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every version folder: current, complete or incomplete, files, bytes")
    rm = sub.add_parser("remove", help="remove old versions (--keep N or --version V)")
    for s in (ls, rm):
        s.add_argument("--dataset", required=True, help="the dataset's URI (s3://... or a local path)")
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument("--keep", type=int, help="keep the N newest complete versions (the current one included)")
    which.add_argument("--version", help="remove this version (not the current one)")
    rm.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    return p


def _line(v: Version) -> str:
    return f"{v.name}  {v.state:<10}  {v.created_at or '-':<25}  {v.files:>6} files  {v.bytes:>14} bytes"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def work() -> list[Version]:
        if args.command == "list":
            return list_versions(args.dataset)
        return remove_versions(args.dataset, keep=args.keep, version=args.version, dry_run=args.dry_run)

    def summary(done: list[Version]) -> str:
        if args.command == "list":
            return "\n".join(map(_line, done)) if done else f"{storage.normalize(args.dataset)} has no version folders"
        verb = "would remove" if args.dry_run else "removed"
        return "\n".join(f"{verb} {_line(v)}" for v in done) if done else "nothing to remove"

    return cli_main("jobs/versions.py", work, summary)


if __name__ == "__main__":
    sys.exit(main())
