"""Rewrite the report of a complete dataset: ``<dataset>/report.html``.

    python -m jobs.report ./datasets/pets-v1
    python -m jobs.report s3://lake/datasets/pets-v1 --samples-per-class 8

The shard job writes the report after its commit; this command writes it again (after a
report failed, or with other sample settings). What it holds: :mod:`jobs.shard_steps.report_html`.
"""

from __future__ import annotations

import argparse
import logging
import sys

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

from jobs.common.cli import cli_main
from jobs.shard_steps.report_html import write_report
from lakeshard import storage
from lakeshard.format import read_dataset_info
from lakeshard.settings import command_name

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=command_name("python -m jobs.report"),
        description="(Re)write <dataset>/report.html, a self-contained HTML report of a complete dataset "
        "(one that has dataset.json): counts, splits, rejects, shard balance, samples, lineage.",
    )
    p.add_argument(
        "dataset",
        help="dataset root: a local path or a file://, s3://, gs:// or az:// URI (the folder holding dataset.json)",
    )
    p.add_argument(
        "--samples-per-class", type=int, default=6, metavar="N", help="thumbnails per class (default: 6)"
    )
    p.add_argument(
        "--max-classes",
        type=int,
        default=24,
        metavar="N",
        help="classes shown in the sample grid (default: 24)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def rewrite() -> str:
        root = storage.normalize(args.dataset)
        return write_report(
            root,
            read_dataset_info(root),
            samples_per_class=args.samples_per_class,
            max_classes=args.max_classes,
        )

    return cli_main("jobs/shard_steps/report_html.py", rewrite, lambda uri: f"report: {uri}")


if __name__ == "__main__":
    sys.exit(main())
