"""What the manifest job reads, checked before an engine starts: the ``--input`` and
``--output`` URIs, a Ground Truth manifest, an S3 Inventory, a labels table and a ``--base``
fail in a second, not after a 10 s engine start."""

from __future__ import annotations

import os

from jobs.manifest_steps.base import check_manifest_base
from jobs.manifest_steps.config import ManifestConfig
from jobs.manifest_steps.extract import table_columns
from jobs.manifest_steps.ground_truth_lines import check_input_manifest
from jobs.manifest_steps.inventory import read_inventory
from jobs.manifest_steps.labels import check_labels
from jobs.manifest_steps.passes import STAGED_SCHEMA
from lakeshard import storage
from lakeshard.errors import ConfigError, ManifestError
from lakeshard.format.label_columns import BOXES, SINGLE_LABEL, manifest_schema

__all__ = ["check_manifest_inputs"]


def check_manifest_inputs(cfg: ManifestConfig) -> None:
    """The manifest job's ``--input`` and ``--output`` are URIs this platform reads, a local
    input exists, the output is neither the input nor inside it (the next run would list
    the dataset as lake objects): a :class:`ConfigError` names both URIs; an
    ``--inventory`` is a readable S3 Inventory report of the input's bucket; an
    ``--input-manifest`` is a Ground Truth manifest (:func:`_check_ground_truth`); a ``--labels``
    table (not with ``--label-depth``) is readable and every value in it is valid
    (:func:`jobs.manifest_steps.labels.check_labels`); a ``--base`` is a complete manifest of the same input,
    label source and split (:func:`jobs.manifest_steps.base.check_manifest_base`)."""
    src, out = storage.normalize(cfg.input), storage.normalize(cfg.output)
    if storage.is_local(src) and not storage.exists(src):
        raise ManifestError(f"--input {cfg.input!r}: {src} does not exist")
    if cfg.input_manifest is not None or cfg.label_attribute is not None:
        _check_ground_truth(cfg, src)
    if cfg.inventory is not None:
        _check_inventory(cfg.inventory, src)
    _check_task(cfg)
    if cfg.labels is not None:
        if cfg.label_depth is not None:
            raise ConfigError(
                f"--labels {cfg.labels} and --label-depth {cfg.label_depth} cannot be combined: with a "
                "labels table no label is read from the path; drop --label-depth (or label_depth in "
                "the --conf file)"
            )
        check_labels(cfg.labels, channels=list(cfg.split), columns=table_columns(cfg))
    if cfg.base is not None:
        check_manifest_base(cfg)
    src_path, out_path = _local_path(src), _local_path(out)
    if out_path == src_path or out_path.startswith(src_path.rstrip("/") + "/"):
        where = "is the input" if out_path == src_path else "is inside the input"
        raise ConfigError(
            f"--output {out} {where} --input {src}; write the dataset outside the lake "
            "(the next run would list it as images)"
        )


def _check_task(cfg: ManifestConfig) -> None:
    """Labels beyond one class (``--task``) come from a ``--labels`` table or a Ground Truth
    ``--input-manifest``, kept columns from a table, and they go with the options that can
    carry them (docs/design/0043-labels-beyond-one-class.md)."""
    if cfg.task != SINGLE_LABEL and cfg.labels is None and cfg.input_manifest is None:
        raise ConfigError(
            f"--task {cfg.task} reads its labels from a --labels table (a 'labels' or 'boxes' column) or "
            "a Ground Truth --input-manifest; give one (a path label is one class)"
        )
    if cfg.keep_columns and cfg.labels is None:
        raise ConfigError(
            f"--keep-columns {','.join(cfg.keep_columns)} keeps columns of a --labels table; give one"
        )
    if clash := [c for c in cfg.keep_columns if c in _RESERVED]:
        raise ConfigError(
            f"--keep-columns {','.join(cfg.keep_columns)}: {clash[0]!r} is a column the manifest job writes "
            "itself; keep columns of other names"
        )
    for flag, given in (
        ("--base", cfg.base is not None),
        ("--no-sniff", not cfg.sniff and cfg.task == BOXES),
    ):
        if given and cfg.task != SINGLE_LABEL:
            raise ConfigError(
                f"--task {cfg.task} cannot be combined with {flag} in this version"
                + (": the image sizes are read to check the boxes" if flag == "--no-sniff" else "")
            )


#: Columns the manifest job writes itself, which a kept column may not be named.
_RESERVED = frozenset({*STAGED_SCHEMA.names, *manifest_schema(BOXES).names, "problem"})


def _check_inventory(inventory: str, src: str) -> None:
    """``--inventory`` lists an S3 ``--input``'s bucket, and its manifest and data files are
    readable and well formed (see :func:`jobs.manifest_steps.inventory.read_inventory`)."""
    if storage.scheme(src) != "s3":  # an S3 Inventory lists a bucket
        raise ConfigError(
            f"--inventory {inventory!r} is an S3 Inventory report, but --input {src} is not an s3:// "
            "prefix (S3 Inventory is S3's alone); list a local, gs:// or az:// lake without --inventory"
        )
    read_inventory(inventory, bucket=storage.bucket(src))


def _check_ground_truth(cfg: ManifestConfig, src: str) -> None:
    """``--input-manifest`` comes with ``--label-attribute`` and none of the other sources of
    objects or labels, and its first lines are Ground Truth classification lines under
    ``--input`` (see :func:`jobs.manifest_steps.ground_truth_lines.check_input_manifest`)."""
    if cfg.input_manifest is None:
        raise ConfigError(
            f"--label-attribute {cfg.label_attribute!r} is only for --input-manifest (a SageMaker Ground "
            "Truth manifest); drop it, or give the manifest"
        )
    for flag, value in (
        ("--labels", cfg.labels),
        ("--label-depth", cfg.label_depth),
        ("--inventory", cfg.inventory),
    ):
        if value is not None:
            raise ConfigError(
                f"--input-manifest {cfg.input_manifest} and {flag} {value} cannot be combined: the Ground "
                f"Truth manifest names the objects and their labels; drop {flag} (or "
                f"{flag[2:].replace('-', '_')} in the --conf file)"
            )
    attribute = cfg.label_attribute
    if not attribute or not attribute.strip():
        raise ConfigError(
            f"--input-manifest {cfg.input_manifest} needs --label-attribute: the name of the label "
            "attribute of the Ground Truth job (its LabelAttributeName, e.g. 'sport')"
        )
    if attribute.endswith(("-metadata", "-ref")):
        raise ConfigError(
            f"--label-attribute {attribute!r}: give the label attribute itself (not its -metadata; "
            "a -ref attribute is a semantic segmentation mask, which is not supported)"
        )
    check_input_manifest(cfg.input_manifest, attribute=attribute, root=src, task=cfg.task)


def _local_path(uri: str) -> str:
    """The real path of a local URI (links resolved), or the URI itself."""
    return os.path.realpath(storage.local_path(uri)) if storage.is_local(uri) else uri
