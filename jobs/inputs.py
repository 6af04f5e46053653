"""What each job reads, checked before an engine starts: a bad URI, a missing or incomplete
manifest, an unknown or repeated channel fail in a second, not after a 10 s engine start.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from jobs.dataset_info import dataset_version
from jobs.ground_truth import check_input_manifest
from jobs.inventory import read_inventory
from jobs.labels import check_labels
from jobs.manifest_base import check_base as check_manifest_base
from jobs.reuse import Base
from jobs.reuse import check_base as check_shard_base
from jobs.settings import ManifestConfig, ShardConfig
from lakeshard import storage
from lakeshard.errors import ConfigError, DatasetError, DatasetExistsError, ManifestError, ShardError
from lakeshard.format import dataset_json_uri, manifest_marker_uri

__all__ = ["ShardInputs", "check_manifest_inputs", "check_shard_inputs"]

@dataclass(frozen=True, slots=True)
class ShardInputs:
    """The shard job's inputs, checked: the dataset root, its manifest marker, the channels to
    shard (in order), the seed and the dataset version they make."""

    root: str
    marker: dict[str, Any]
    channels: list[str]
    seed: int
    version: str
    base: Base | None = None  #: the ``--base`` dataset, checked (:func:`jobs.reuse.check_base`)


def _channels(cfg: ShardConfig, known: list[str], root: str) -> list[str]:
    if not cfg.channels:
        return known
    channels = [c.strip() for c in cfg.channels.split(",")]
    if "" in channels:
        raise ShardError(f"--channels {cfg.channels!r} has an empty channel name")
    if repeated := sorted(c for c, n in Counter(channels).items() if n > 1):
        raise ShardError(f"--channels {cfg.channels!r} names {', '.join(map(repr, repeated))} more than once; "
                         "name each channel once")
    if unknown := [c for c in channels if c not in known]:
        raise ShardError(f"--channels names {unknown}, which the manifest at {root} does not have (it has {known})")
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
            "or write the subset to another dataset")


def check_shard_inputs(cfg: ShardConfig) -> ShardInputs:
    """The shard job's inputs, or an error naming what is wrong (the URI, the manifest, the
    channels, an existing dataset, a ``--base`` whose images cannot be reused): nothing is written."""
    root = storage.normalize(cfg.dataset)
    marker_uri = manifest_marker_uri(root)
    if not storage.exists(marker_uri):
        raise DatasetError(f"no complete manifest at {root}: {marker_uri} is missing; run jobs/manifest.py first")
    marker = storage.read_json(marker_uri)
    channels = _channels(cfg, list(marker["split"]), root)
    classes = marker.get("counts", {}).get("classes", {})
    if missing := [c for c in channels if c not in classes]:  # the plan is made from these counts
        raise DatasetError(f"the manifest marker {marker_uri} has no class counts (counts.classes) for channel(s) "
                           f"{missing}; run jobs/manifest.py again")
    _check_overwrite(cfg, root, channels)
    seed = marker["seed"] if cfg.seed is None else cfg.seed
    return ShardInputs(root=root, marker=marker, channels=channels, seed=seed,
                       version=dataset_version(marker["fingerprint"], cfg, seed, channels),
                       base=check_shard_base(cfg.base, cfg) if cfg.base is not None else None)


def check_manifest_inputs(cfg: ManifestConfig) -> None:
    """The manifest job's ``--input`` and ``--output`` are URIs this platform reads, a local
    input exists, the output is neither the input nor inside it (the next run would list
    the dataset as lake objects): a :class:`ConfigError` names both URIs; an
    ``--inventory`` is a readable S3 Inventory report of the input's bucket; an
    ``--input-manifest`` is a Ground Truth manifest (:func:`_check_ground_truth`); a ``--labels``
    table (not with ``--label-depth``) is readable and every value in it is valid
    (:func:`jobs.labels.check_labels`); a ``--base`` is a complete manifest of the same input,
    label source and split (:func:`jobs.manifest_base.check_base`)."""
    src, out = storage.normalize(cfg.input), storage.normalize(cfg.output)
    if src.startswith("file://") and not storage.exists(src):
        raise ManifestError(f"--input {cfg.input!r}: {src} does not exist")
    if cfg.input_manifest is not None or cfg.label_attribute is not None:
        _check_ground_truth(cfg, src)
    if cfg.inventory is not None:
        _check_inventory(cfg, src)
    if cfg.labels is not None:
        if cfg.label_depth is not None:
            raise ConfigError(f"--labels {cfg.labels} and --label-depth {cfg.label_depth} cannot be combined: with a "
                              "labels table no label is read from the path; drop --label-depth (or label_depth in "
                              "the --conf file)")
        check_labels(cfg.labels, channels=list(cfg.split))
    if cfg.base is not None:
        check_manifest_base(cfg)
    src_path, out_path = _local_path(src), _local_path(out)
    if out_path == src_path or out_path.startswith(src_path.rstrip("/") + "/"):
        where = "is the input" if out_path == src_path else "is inside the input"
        raise ConfigError(f"--output {out} {where} --input {src}; write the dataset outside the lake "
                          "(the next run would list it as images)")


def _check_inventory(cfg: ManifestConfig, src: str) -> None:
    """``--inventory`` lists an S3 ``--input``'s bucket, and its manifest and data files are
    readable and well formed (see :func:`jobs.inventory.read_inventory`)."""
    if not src.startswith("s3://"):
        raise ConfigError(f"--inventory {cfg.inventory!r} is an S3 Inventory report, but --input {src} is not an s3:// "
                          "prefix; list a local lake without --inventory")
    read_inventory(cfg.inventory, bucket=src[len("s3://"):].split("/", 1)[0])


def _check_ground_truth(cfg: ManifestConfig, src: str) -> None:
    """``--input-manifest`` comes with ``--label-attribute`` and none of the other sources of
    objects or labels, and its first lines are Ground Truth classification lines under
    ``--input`` (see :func:`jobs.ground_truth.check_input_manifest`)."""
    if cfg.input_manifest is None:
        raise ConfigError(f"--label-attribute {cfg.label_attribute!r} is only for --input-manifest (a SageMaker Ground "
                          "Truth manifest); drop it, or give the manifest")
    for flag, value in (("--labels", cfg.labels), ("--label-depth", cfg.label_depth), ("--inventory", cfg.inventory)):
        if value is not None:
            raise ConfigError(f"--input-manifest {cfg.input_manifest} and {flag} {value} cannot be combined: the Ground "
                              f"Truth manifest names the objects and their labels; drop {flag} (or "
                              f"{flag[2:].replace('-', '_')} in the --conf file)")
    attribute = cfg.label_attribute
    if not attribute or not attribute.strip():
        raise ConfigError(f"--input-manifest {cfg.input_manifest} needs --label-attribute: the name of the label "
                          "attribute of the Ground Truth job (its LabelAttributeName, e.g. 'sport')")
    if attribute.endswith(("-metadata", "-ref")):
        raise ConfigError(f"--label-attribute {attribute!r}: give the label attribute itself (not its -metadata; "
                          "a -ref attribute is a semantic segmentation mask, which is not supported)")
    check_input_manifest(cfg.input_manifest, attribute=attribute, root=src)


def _local_path(uri: str) -> str:
    """The real path of a local URI (links resolved), or the URI itself."""
    return os.path.realpath(storage.filesystem(uri)[1]) if uri.startswith("file://") else uri
