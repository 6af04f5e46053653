"""The shard versions of a dataset in an object store (S3, GCS), listed and removed.

    python -m jobs.versions list --dataset s3://lake/datasets/pets-v1
    python -m jobs.versions remove --dataset s3://lake/datasets/pets-v1 --keep 2 --dry-run
    python -m jobs.versions remove --dataset s3://lake/datasets/pets-v1 --version 3f2a...-9c1b0d2e

In an object store each run of the shard job writes its shards once, into a version folder
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

from jobs.common.cli import cli_main
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, PlatformError, StorageError
from lakeshard.format import version_dirname, versions_uri
from lakeshard.format.versions import Version, list_versions
from lakeshard.settings import command_name

__all__ = ["main", "parser", "remove_versions"]

log = logging.getLogger("jobs.versions")


def _check_dataset(root: str) -> None:
    """Raise :class:`StorageError` if ``root``'s bucket does not exist, :class:`DatasetError` if
    nothing is at ``root``: a typo is an error, not a dataset without versions."""
    fs, path = storage.filesystem(root)
    try:
        if not storage.is_local(root):
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


def remove_versions(
    root: str, *, keep: int | None = None, version: str | None = None, dry_run: bool = False
) -> list[Version]:
    """Remove old versions of the dataset at ``root`` (``keep`` or ``version``, see the module
    docstring); return what was removed (or would be, with ``dry_run``).

    Raises:
        ConfigError: neither or both of ``keep`` and ``version``, ``keep`` < 1, a ``version``
            the dataset does not have, or the current version.
        DatasetError: nothing is at ``root``.
        StorageError: ``root``'s bucket does not exist, or cannot be read.
    """
    if (keep is None) == (version is None):
        raise ConfigError("give exactly one of --keep N and --version V")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(
            f"--keep must be an integer >= 1 (the current version is always kept), got {keep!r}"
        )
    root = storage.normalize(root)
    _check_dataset(root)
    found = list_versions(root)
    if version is not None:
        try:
            version_dirname(version)
        except ValueError as exc:
            raise ConfigError(f"--version: {exc}") from None
        by_name = {v.name: v for v in found}
        if version not in by_name:
            raise ConfigError(
                f"--version {version!r}: {versions_uri(root)} has no such version "
                f"(it has {sorted(by_name) or 'none'}; python -m jobs.versions list --dataset {root})"
            )
        if by_name[version].current:
            raise ConfigError(
                f"--version {version!r} is the current version of {root} (dataset.json names it); "
                "it cannot be removed"
            )
        doomed = [by_name[version]]
    else:
        assert keep is not None  # exactly one of keep and version, checked above
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
        prog=command_name("python -m jobs.versions"),
        description="List or remove the shard versions of a dataset on S3 (shards/v=<version>/). The version "
        "dataset.json names is never removed.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every version folder: current, complete or incomplete, files, bytes")
    rm = sub.add_parser("remove", help="remove old versions (--keep N or --version V)")
    for s in (ls, rm):
        s.add_argument(
            "--dataset", required=True, help="the dataset's URI (s3://..., gs://... or a local path)"
        )
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--keep", type=int, help="keep the N newest complete versions (the current one included)"
    )
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
            _check_dataset(storage.normalize(args.dataset))
            return list_versions(args.dataset)
        return remove_versions(args.dataset, keep=args.keep, version=args.version, dry_run=args.dry_run)

    def summary(done: list[Version]) -> str:
        if args.command == "list":
            return (
                "\n".join(map(_line, done))
                if done
                else f"{storage.normalize(args.dataset)} has no version folders"
            )
        verb = "would remove" if args.dry_run else "removed"
        return "\n".join(f"{verb} {_line(v)}" for v in done) if done else "nothing to remove"

    return cli_main("jobs/versions.py", work, summary)


if __name__ == "__main__":
    sys.exit(main())
