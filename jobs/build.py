"""Both jobs in one command: list, label and split the lake, then write the shards, on one engine.

    spark-submit jobs/build.py --input s3://lake/raw/pets --output s3://lake/datasets/pets-v1 --num-shards 4
    python -m jobs.build --engine dask --input ./lake/raw --output ./datasets/pets-v1 --num-shards 2
    python -m jobs.build --engine local --input ./lake/raw --output ./datasets/pets-v2 --base ./datasets/pets-v1

The same two jobs as ``jobs/manifest.py`` then ``jobs/shard.py`` (same passes, same dataset,
byte for byte), with what they would each pay once paid once: one engine (one Spark session and
its JVM, one Dask cluster, one interpreter with its imports), one lock on the dataset held from
the first check to the commit, so no other job comes between the manifest and the shards. The
two jobs stay commands of their own, for a manifest looked at before any image is fetched, or
shards rebuilt with other image options from the same manifest.

Options: every option of both jobs (:class:`BuildConfig`); ``--output`` is the shard job's
``--dataset``. The options the two jobs share (:data:`BOTH`) apply to both: ``--seed`` seeds the
split and, as when the shard job is given none, the shard plan; ``--base`` names the previous
version (its manifest and its shards); ``--overwrite`` replaces the manifest and the shards;
``--partitions`` and ``--max-reject-fraction`` are each job's own, set to the same value.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

if __name__ == "__main__" and not __package__:
    import _script  # noqa: F401  (jobs/_script.py: the repository root first on sys.path)

from jobs import manifest, shard
from jobs.common.cli import job_parser, run_job
from jobs.common.engines import Engine
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.inputs import check_manifest_inputs
from jobs.manifest_steps.summary import summary_line
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.inputs import check_task, pick_channels
from jobs.shard_steps.reuse import check_shard_base
from lakeshard import storage
from lakeshard.format import DatasetInfo
from lakeshard.locks import dataset_lock

__all__ = ["BOTH", "BuildConfig", "Built", "main", "parser", "prepare", "run"]

#: The options both jobs have, each given once and passed to both, with what it means here.
BOTH = {
    "seed": "seed of the split and of the shard plan and in-shard shuffle, in [0, 2**32 - 1]",
    "base": "a previous complete dataset of the same --input, labels and split, built with the "
    "same image options: objects it listed unchanged are not read again, and their images are "
    "taken from its shards",
    "overwrite": "replace an existing dataset: its manifest and every channel's shards",
    "max_reject_fraction": "fail if more than this fraction of listed objects is rejected, or of "
    "manifest rows fails to decode",
    "partitions": "tasks of each job's heaviest pass: reading object headers, preprocessing "
    "(default: from the number of objects)",
    "engine": "the engine that runs the jobs (local: no cluster, this machine's cores)",
    "scheduler": ManifestConfig.__dataclass_fields__["scheduler"].metadata["help"],
}

#: Shard options this command does not take, and why.
_NOT_HERE = {
    "dataset": "it is --output",
    "plan_only": "the plan needs the manifest: run jobs/manifest.py, then jobs/shard.py --plan-only",
}


def _fields() -> list[tuple[str, Any, Any]]:
    """The fields of :class:`BuildConfig`: the manifest job's, then the shard job's it lacks."""
    out: list[tuple[str, Any, Any]] = []
    for cls in (ManifestConfig, ShardConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _NOT_HERE or any(name == f.name for name, _, _ in out):
                continue
            meta = dict(f.metadata)
            if f.name in BOTH:
                meta["help"] = BOTH[f.name] + " (both jobs)"
            out.append((f.name, hints[f.name], dataclasses.field(default=f.default, metadata=meta)))
    return out


def _split(self: Any) -> tuple[ManifestConfig, ShardConfig]:
    """The two jobs' options, each checked by its own class (a bad value is named by its option)."""
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    m = ManifestConfig(**{f.name: values[f.name] for f in dataclasses.fields(ManifestConfig)})
    given = {f.name: values[f.name] for f in dataclasses.fields(ShardConfig) if f.name in values}
    return m, ShardConfig(**{**given, "dataset": m.output, "seed": None})


#: Every option of both jobs, as a frozen dataclass (a ``--conf`` YAML file holds any of them);
#: ``cfg.jobs`` is the ``(ManifestConfig, ShardConfig)`` pair they make, checked on creation.
BuildConfig: type[Any] = dataclasses.make_dataclass(
    "BuildConfig",
    _fields(),
    frozen=True,
    namespace={"__post_init__": _split, "jobs": property(_split), "__module__": __name__},
)


@dataclasses.dataclass(frozen=True, slots=True)
class Built:
    """What the two jobs wrote: the manifest's summary (``manifests/_manifest.json``) and ``dataset.json``."""

    manifest: dict[str, Any]
    dataset: DatasetInfo


@contextmanager
def prepare(cfg: Any) -> Iterator[None]:
    """Before the engine starts: the manifest job's checks, the dataset's lock (held to the
    end), then what the shard job can check before its manifest exists: ``--channels`` against
    ``--split``, and a ``--base`` whose images could not be reused."""
    m, s = cfg.jobs
    check_manifest_inputs(m)
    check_task(m.task, storage.normalize(m.output), s)  # before a manifest the shards could not store
    with dataset_lock(m.output, job="build"):
        pick_channels(s, list(m.split), storage.normalize(m.output))
        if s.base is not None:
            check_shard_base(s.base, s)
        yield


def run(cfg: Any, engine: Engine) -> Built:
    """The manifest job, then the shard job, on ``engine``, the dataset's lock held throughout."""
    m, s = cfg.jobs
    with dataset_lock(m.output, job="build"):
        summary = manifest.run(m, engine)
        info = shard.run(s, engine)
    assert isinstance(info, DatasetInfo)  # not --plan-only, which this command does not take
    return Built(summary, info)


def parser() -> argparse.ArgumentParser:
    return job_parser(
        "jobs/build.py",
        BuildConfig,
        description="List, label and split a raw image lake (jobs/manifest.py), then preprocess its images "
        "into --num-shards equal Parquet shards per channel (jobs/shard.py), on one engine, the dataset "
        "locked throughout.",
        epilog="Options shared by the two jobs (--seed, --base, --overwrite, --partitions, "
        "--max-reject-fraction, --engine, --scheduler) apply to both; --output is the shard job's --dataset.",
    )


def _summary(cfg: Any, built: Built) -> str:
    m, s = cfg.jobs
    return summary_line(m, built.manifest) + "\n" + shard.summary(s, built.dataset)


def main(argv: list[str] | None = None) -> int:
    return run_job(
        argv,
        parser=parser(),
        config=BuildConfig,
        run=run,
        summary=_summary,
        prog="jobs/build.py",
        prepare=prepare,
    )


if __name__ == "__main__":
    sys.exit(main())
