"""Make the class archive with which the Spark engine's driver JVM starts sooner (design/0048).

    python -m jobs.spark_cds             # once per Java and Spark install
    python -m jobs.spark_cds --check     # this install's archive: where, and whether it is made
    python -m jobs.spark_cds --remove    # remove every archive of the folder

When ``python -m jobs.build --engine spark`` (or ``jobs.manifest``, ``jobs.shard``) starts Spark's
driver JVM itself, it maps this install's archive if there is one: the classes Spark loads to
start a session and run its first tasks, already parsed, verified and laid out. Nothing changes
under ``spark-submit`` or in a session that is already running. See
:mod:`jobs.common.engines.jvm_archive` for where archives live and how one is made safely.
"""

from __future__ import annotations

import argparse
import logging
import sys

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

from jobs.common.cli import cli_main
from jobs.common.engines.jvm_archive import (
    Archive,
    archive_dir,
    is_whole,
    make_archive,
    required_archive_path,
)
from jobs.common.engines.spark_engine import archive_unused_because
from lakeshard.settings import command_name

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=command_name("jobs/spark_cds.py"),
        description="Make the class-data-sharing archive of this Java and Spark install, with which the "
        "Spark engine's driver JVM starts sooner: Spark is started twice (once to record the classes it "
        "loads, once to check the archive); the archive takes about 100 MB.",
        epilog="Archives live in $LAKESHARD_SPARK_CDS_DIR, else $XDG_CACHE_HOME/lakeshard/spark-cds, else "
        "~/.cache/lakeshard/spark-cds; LAKESHARD_SPARK_CDS=off makes the engine start without one. An "
        "upgrade of Java or Spark needs a new archive (this command again).",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--check", action="store_true", help="print this install's archive and whether it is made"
    )
    what.add_argument("--remove", action="store_true", help="remove every archive of the folder")
    what.add_argument("--force", action="store_true", help="make the archive again even if it is there")
    return p


def _remove() -> list[str]:
    folder = archive_dir()
    removed = []
    for path in sorted(folder.glob("spark-*.js[ao]*")) if folder.is_dir() else []:
        path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed


def _check() -> str:
    path = required_archive_path()
    unused = archive_unused_because(path)
    if not is_whole(path):
        return f"{path}: not made; run `python -m jobs.spark_cds` to make it" + (
            f" (once made, it would not be used: {unused})" if unused else ""
        )
    made = f"{path}: made ({path.stat().st_size / 2**20:.0f} MiB); "
    return made + (f"not used: {unused}" if unused else "the Spark engine's driver JVM maps it")


def _summary(done: Archive) -> str:
    size = f"{done.size / 2**20:.0f} MiB"
    if not done.made:
        return f"{done.path} ({size}) is there already; --force makes it again"
    return (
        f"made {done.path} ({size}); with it Spark started a session in {done.session_s:.1f} s. "
        "The Spark engine's driver JVM maps it from now on."
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.check:
        return cli_main("jobs/spark_cds.py", _check, str)
    if args.remove:
        return cli_main(
            "jobs/spark_cds.py",
            _remove,
            lambda removed: "\n".join(f"removed {p}" for p in removed) or f"no archive in {archive_dir()}",
        )
    return cli_main("jobs/spark_cds.py", lambda: make_archive(force=args.force), _summary)


if __name__ == "__main__":
    sys.exit(main())
