"""What the shard job reads, checked before an engine starts: a bad URI, a missing or
incomplete manifest, a manifest of labels beyond one class (multi-label, boxes) with an
option that cannot carry its columns yet (``--base``), an unknown or repeated channel, an existing dataset or an unusable ``--base`` fail in a
second, not after a 10 s engine start."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from jobs.shard_steps.columns import ShardColumns, shard_columns
from jobs.shard_steps.config import ShardConfig
from jobs.shard_steps.dataset_info import dataset_version
from jobs.shard_steps.reuse import BaseDataset, check_shard_base
from lakeshard import storage
from lakeshard.errors import DatasetError, DatasetExistsError, ShardError
from lakeshard.format import ManifestInfo, dataset_json_uri, manifest_marker_uri, read_manifest_info
from lakeshard.format.label_columns import SINGLE_LABEL

__all__ = ["ShardInputs", "check_shard_inputs", "check_task", "pick_channels"]


@dataclass(frozen=True, slots=True)
class ShardInputs:
    """The shard job's inputs, checked: the dataset root, its manifest marker, the channels to
    shard (in order), the seed and the dataset version they make."""

    root: str
    marker: ManifestInfo
    channels: list[str]
    seed: int
    version: str
    #: the ``--base`` dataset, checked (:func:`jobs.shard_steps.reuse.check_shard_base`)
    base: BaseDataset | None = None
    #: the task kind and kept columns the shards carry
    columns: ShardColumns = ShardColumns()


def pick_channels(cfg: ShardConfig, known: list[str], root: str) -> list[str]:
    """The channels ``--channels`` names (each once, each one of ``known``, the manifest's at
    ``root``), or all of ``known``."""
    if not cfg.channels:
        return known
    channels = [c.strip() for c in cfg.channels.split(",")]
    if "" in channels:
        raise ShardError(f"--channels {cfg.channels!r} has an empty channel name")
    if repeated := sorted(c for c, n in Counter(channels).items() if n > 1):
        raise ShardError(
            f"--channels {cfg.channels!r} names {', '.join(map(repr, repeated))} more than once; "
            "name each channel once"
        )
    if unknown := [c for c in channels if c not in known]:
        raise ShardError(
            f"--channels names {unknown}, which the manifest at {root} does not have (it has {known})"
        )
    return channels


def _check_overwrite(cfg: ShardConfig, root: str, channels: list[str]) -> None:
    """An existing complete dataset is replaced only with ``--overwrite``, and never loses a
    channel: ``--channels`` naming fewer channels than it has is refused (the commit replaces
    every shard folder, so the others would be deleted)."""
    uri = dataset_json_uri(root)
    if not storage.exists(uri):
        return
    if not cfg.overwrite:
        raise DatasetExistsError(f"{root} already holds a complete dataset; pass --overwrite to rebuild it")
    has = list(storage.read_json(uri).get("channels", {}))
    if dropped := [c for c in has if c not in channels]:
        raise ShardError(
            f"--channels {cfg.channels!r} with --overwrite would delete the shards of channel(s) {dropped} of the "
            f"dataset at {root} (it has {has}); rebuild every channel it has (e.g. --channels {','.join(has)}), "
            "or write the subset to another dataset"
        )


def check_task(task: str, root: str, cfg: ShardConfig) -> None:
    """Refuse a manifest of labels beyond one class with an option that cannot carry its
    columns yet (docs/design/0045-shard-job-labels.md): ``--base``, whose join takes images,
    not label columns, from the base's shards."""
    if task != SINGLE_LABEL and cfg.base is not None:
        raise ShardError(
            f"--base {cfg.base} cannot be combined with the {task} manifest at {root}: an "
            "incremental build reuses single-label rows only; build it from scratch"
        )


def check_shard_inputs(cfg: ShardConfig) -> ShardInputs:
    """The shard job's inputs, or an error naming what is wrong (the URI, the manifest, the
    channels, an existing dataset, a ``--base`` whose images cannot be reused): nothing is written."""
    root = storage.normalize(cfg.dataset)
    marker_uri = manifest_marker_uri(root)
    if not storage.exists(marker_uri):
        raise DatasetError(
            f"no complete manifest at {root}: {marker_uri} is missing; run jobs/manifest.py first"
        )
    marker = read_manifest_info(root)
    check_task(marker.task_kind, root, cfg)
    channels = pick_channels(cfg, list(marker.split), root)
    classes = marker.counts.classes
    if missing := [c for c in channels if c not in classes]:  # the plan is made from these counts
        raise DatasetError(
            f"the manifest marker {marker_uri} has no class counts (counts.classes) for channel(s) "
            f"{missing}; run jobs/manifest.py again"
        )
    _check_overwrite(cfg, root, channels)
    seed = marker.seed if cfg.seed is None else cfg.seed
    columns = shard_columns(root, marker, channels[0])
    return ShardInputs(
        root=root,
        marker=marker,
        channels=channels,
        seed=seed,
        version=dataset_version(
            marker.fingerprint, cfg, seed, channels, format_version=columns.format_version
        ),
        base=check_shard_base(cfg.base, cfg) if cfg.base is not None else None,
        columns=columns,
    )
