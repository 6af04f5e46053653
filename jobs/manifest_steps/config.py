"""The manifest job's options, as a frozen dataclass (commented in ``conf/manifest.yaml``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobs.common.engines import ENGINE_NAMES
from jobs.manifest_steps.split import ALGORITHMS
from lakeshard.errors import ConfigError
from lakeshard.format.label_columns import TASK_KINDS
from lakeshard.format.layout import CHANNELS
from lakeshard.settings import (
    check_fraction,
    check_positive,
    opt,
    parse_globs,
    parse_option,
    parse_seed,
)

__all__ = ["BOX_UNITS", "ManifestConfig", "parse_columns", "parse_split"]

#: How a labels table's boxes are measured (``--box-units``).
BOX_UNITS = ("pixels", "normalized")


def parse_columns(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``"caption,source"`` (or a list) -> ``("caption", "source")``: names, each once."""
    names = (
        [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n).strip() for n in value]
    )
    names = [n for n in names if n]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"keep_columns names {', '.join(map(repr, repeated))} more than once")
    return tuple(names)


def parse_split(value: str | Mapping[str, Any]) -> dict[str, float]:
    """``"train=0.8,validation=0.1,test=0.1"`` (or a mapping) -> ``{"train": 0.8, ...}``.

    Channels are among ``train``, ``validation`` and ``test`` (any subset); fractions must be
    positive and add up to 1 (within 1e-6); channel order is kept.
    """
    if isinstance(value, Mapping):
        items = list(value.items())
    elif not isinstance(value, str):
        raise ValueError(
            f"split must be a mapping like {{train: 0.8, validation: 0.2}} or a string like "
            f"'train=0.8,validation=0.2', got a {type(value).__name__}: {value!r}"
        )
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"split entries look like 'train=0.8', got {part.strip()!r} in {value!r}")
            name, frac = part.split("=", 1)
            items.append((name.strip(), frac.strip()))
    out: dict[str, float] = {}
    for name, frac in items:
        if name not in CHANNELS:
            raise ValueError(
                f"unknown channel {name!r} in split {_as_text(value)!r}; channels are "
                f"{', '.join(CHANNELS)} (any of them)"
            )
        if name in out:
            raise ValueError(f"channel {name!r} appears twice in split {value!r}")
        try:
            f = float(frac)
        except (TypeError, ValueError):
            raise ValueError(f"fraction of channel {name!r} must be a number, got {frac!r}") from None
        if not 0 < f <= 1:
            raise ValueError(f"fraction of channel {name!r} must be in (0, 1], got {f!r}")
        out[str(name)] = f
    if not out:
        raise ValueError(f"split names no channel: {value!r}")
    total = sum(out.values())
    if abs(total - 1) > 1e-6:
        raise ValueError(f"split fractions must add up to 1, got {total:g} from {value!r}")
    return out


def _as_text(split: str | Mapping[str, Any]) -> str:
    """A split as it is typed (``train=0.8,test=0.2``), whether it was typed or a mapping."""
    if isinstance(split, str):
        return split
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in split.items())


@dataclass(frozen=True, slots=True)
class ManifestConfig:
    input: str = opt(
        help="the raw lake: a local folder or a file://, s3://, gs:// or az:// prefix laid out as <prefix>/<label>/.../<file>"
    )
    output: str = opt(help="the dataset URI to write manifests/ and labels.json under")
    split: dict[str, float] = opt(
        "train=0.8,validation=0.1,test=0.1", parse=parse_split, help="channel fractions, adding up to 1"
    )
    split_method: str = opt(
        "hash",
        choices=tuple(ALGORITHMS),
        help="hash: stable as the lake grows; stratified: exact per-class counts",
    )
    seed: int = opt(
        0, parse=parse_seed, help="seed of the split (and, by default, of the shard job), in [0, 2**32 - 1]"
    )
    min_per_class: int = opt(
        1,
        help="fail unless every class has at least this many objects in every "
        "channel (0: a class may be missing from a channel)",
    )
    label_depth: int | None = opt(
        None,
        help="which path component below the input is the label (1 = the first; "
        "the default: 1, or none with --labels, with which it cannot be given)",
    )
    labels: str | None = opt(
        None,
        help="a CSV, Parquet or JSON Lines table (or a folder of them) of the labels: a 'key' "
        "(relative to --input) or 'uri' column, a 'label' column and optionally a "
        "'channel' column pinning an object to a channel; every object under --input "
        "is listed (no path label), and one with no label row is rejected",
    )
    task: str = opt(
        TASK_KINDS[0],
        choices=TASK_KINDS,
        help="what an image is labelled with: one class (single-label), a set of classes "
        "(multi-label: a 'labels' list, or a row per label), or objects with boxes (boxes: a "
        "'boxes' list of {label, x, y, width, height})",
    )
    keep_columns: tuple[str, ...] = opt(
        (),
        parse=parse_columns,
        help="columns of the --labels table to keep in the manifest, with their Arrow types "
        "(e.g. caption,source)",
    )
    box_units: str = opt(
        BOX_UNITS[0],
        choices=BOX_UNITS,
        help="how the --labels table's boxes are measured: in pixels of the original image, "
        "or normalized to [0, 1] of its width and height",
    )
    input_manifest: str | None = opt(
        None,
        help="a SageMaker Ground Truth augmented manifest (JSON Lines of 'source-ref' "
        "and the --label-attribute): its objects under --input, not a listing "
        "of --input, are the lake, labelled with their class names",
    )
    label_attribute: str | None = opt(
        None,
        help="with --input-manifest: the label attribute of the Ground Truth job "
        "(its LabelAttributeName), whose class name labels each object",
    )
    base: str | None = opt(
        None,
        help="a previous complete manifest of the same --input, labels and split: objects it "
        "listed with the same size and ETag (local: size and modification time) are not "
        "read again; the result is what a build without --base writes",
    )
    max_reject_fraction: float = opt(
        0.05, help="fail if more than this fraction of listed objects is rejected"
    )
    overwrite: bool = opt(False, help="replace an existing manifest (and invalidate the dataset built on it)")
    engine: str = opt("spark", choices=ENGINE_NAMES, help="the engine that runs the job")
    scheduler: str | None = opt(
        None,
        help="dask: address of a dask.distributed scheduler (else DASK_SCHEDULER_ADDRESS, else a LocalCluster)",
    )
    partitions: int | None = opt(
        None, help="tasks for reading object headers (default: from the number of objects)"
    )
    rows_per_part: int = opt(
        100_000,
        help="objects per part of the manifest tables (a class is never split across "
        "parts) and per task that groups identical content",
    )
    exclude: tuple[str, ...] = opt(
        (),
        parse=parse_globs,
        repeat=True,
        help="skip objects matching this glob: against the key if it has a '/', else against "
        "each path component (e.g. '*.tmp')",
    )
    include_hidden: bool = opt(
        False,
        help="list hidden objects too (names starting with '.', __MACOSX, Thumbs.db, "
        "desktop.ini), which are skipped by default",
    )
    inventory: str | None = opt(
        None,
        help="an S3 Inventory report of --input's bucket (its manifest.json, or the dated "
        "folder holding it): its CSV or Parquet files are the lake instead of a listing",
    )
    sniff: bool = opt(
        True,
        help="read each object's first bytes to reject what is not an image now; off: no object is "
        "read, bad objects are rejected by the shard job's decode instead",
    )
    list_task_objects: int = opt(
        100_000,
        help="a listing task that has listed this many objects hands the rest of its "
        "class prefix to new tasks, so a large class is listed in parallel",
    )
    dedupe: bool = opt(
        False,
        help="keep one object of each set with identical content (the others are rejected "
        "naming the kept key), so no image is in two channels",
    )

    def __post_init__(self) -> None:
        for name, parse in (
            ("split", parse_split),
            ("seed", parse_seed),
            ("exclude", parse_globs),
            ("keep_columns", parse_columns),
        ):
            object.__setattr__(self, name, parse_option(name, parse, getattr(self, name)))
        check_positive("min_per_class", self.min_per_class, allow_zero=True, error=ConfigError)
        check_positive("label_depth", self.label_depth, allow_none=True, error=ConfigError)
        if self.label_depth is None and self.labels is None and self.input_manifest is None:
            object.__setattr__(self, "label_depth", 1)  # path labels, the default
        check_positive("partitions", self.partitions, allow_none=True, error=ConfigError)
        check_positive("list_task_objects", self.list_task_objects, error=ConfigError)
        check_positive("rows_per_part", self.rows_per_part, error=ConfigError)
        check_fraction("max_reject_fraction", self.max_reject_fraction)
