"""The shard job's options, as a frozen dataclass (commented in ``conf/shard.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.common.engines import ENGINE_NAMES
from jobs.common.images import DEFAULT_SPEC, ImageSpec
from jobs.shard_steps.deal import REMAINDER_POLICIES
from lakeshard.errors import ConfigError
from lakeshard.format.info import IMAGE_FORMATS, RESIZE_MODES, image_rule_broken
from lakeshard.settings import check_fraction, check_positive, opt, parse_option, parse_seed, parse_size

__all__ = ["ShardConfig"]


#: The shard job's image options and the :class:`ImageSpec` fields they set.
_IMAGE_OPTIONS = {
    "image_size": "size",
    "resize": "resize",
    "image_format": "format",
    "quality": "quality",
    "max_image_pixels": "max_pixels",
}


def _check_image_option(name: str, value: Any) -> None:  # any option's value: ImageSpec checks it
    """Check one image option with :class:`ImageSpec`'s own rule; the error names the option
    (``max_image_pixels must be positive``), not the spec's field (``max_pixels``)."""
    if broken := image_rule_broken(_IMAGE_OPTIONS[name], value):
        raise ConfigError(f"{name} {broken}", option=name)


@dataclass(frozen=True, slots=True)
class ShardConfig:
    dataset: str = opt(help="the dataset URI the manifest job wrote")
    num_shards: int = opt(1, help="shards per channel: one per target GPU (or a multiple)")
    image_size: int = opt(DEFAULT_SPEC.size, help="side of the square output images, in pixels")
    resize: str = opt(
        DEFAULT_SPEC.resize,
        choices=RESIZE_MODES,
        help="crop: shorter side to size, center crop; pad: fit inside on black; stretch: ignore aspect",
    )
    image_format: str = opt(DEFAULT_SPEC.format, choices=IMAGE_FORMATS, help="encoding of the stored images")
    quality: int = opt(DEFAULT_SPEC.quality, help="JPEG quality (1-100)")
    max_image_pixels: int = opt(
        DEFAULT_SPEC.max_pixels, help="reject images with more pixels than this (decompression bombs)"
    )
    remainder: str = opt(
        "drop",
        choices=REMAINDER_POLICIES,
        help="rows beyond a multiple of num_shards: drop them, or pad by repeating samples",
    )
    seed: int | None = opt(
        None,
        parse=parse_seed,
        help="seed of the shard plan and in-shard shuffle, in [0, 2**32 - 1] (default: the manifest's seed)",
    )
    channels: str | None = opt(
        None, help="comma-separated channels to shard, each once (default: all in the manifest)"
    )
    row_group_size: int = opt("4MiB", parse=parse_size, help="target bytes per Parquet row group")
    max_reject_fraction: float = opt(
        0.05, help="fail if more than this fraction of manifest rows fails to decode"
    )
    threads: int | None = opt(
        None,
        help="threads that read images inside each task, ahead of decoding (default: 8 for S3, "
        "whose reads wait on the network; 0 for local files, read as they are decoded)",
    )
    decode_threads: int | None = opt(
        None,
        help="threads that decode, resize and encode inside each task (default: the cores the "
        "engine gives a task: 1, or spark.task.cpus); more than that only makes them take turns",
    )
    overwrite: bool = opt(
        False,
        help="replace an existing complete dataset, every channel it has (refused if "
        "--channels names fewer: the others' shards would be deleted)",
    )
    resume: bool = opt(
        True, help="reuse the segments an interrupted run with the same settings already preprocessed"
    )
    plan_only: bool = opt(
        False,
        help="a dry run: check the inputs, run the plan (each row's slot and each shard's "
        "order) on the engine, print its summary (rows per shard per channel, dropped "
        "and padded rows, each class's spread over the shards) and exit; no image is "
        "read and nothing is left in the dataset (the plan's files are removed)",
    )
    engine: str = opt(
        "spark",
        choices=ENGINE_NAMES,
        help="the engine that runs the job (local: no cluster, this machine's cores)",
    )
    scheduler: str | None = opt(
        None,
        help="dask: address of a dask.distributed scheduler (else DASK_SCHEDULER_ADDRESS, else a LocalCluster)",
    )
    partitions: int | None = opt(None, help="tasks for preprocessing (default: from the number of rows)")
    base: str | None = opt(
        None,
        help="a previous complete dataset (local folder or s3://) built with the same image "
        "options: the images of rows whose object (URI and ETag) it already holds are "
        "taken from its shards, not fetched and decoded again; a base built with other "
        "options, or incomplete, is refused",
    )

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "row_group_size", parse_option("row_group_size", parse_size, self.row_group_size)
        )
        if self.seed is not None:
            object.__setattr__(self, "seed", parse_option("seed", parse_seed, self.seed))
        check_positive("num_shards", self.num_shards, error=ConfigError)
        check_positive("threads", self.threads, allow_none=True, allow_zero=True, error=ConfigError)
        check_positive("decode_threads", self.decode_threads, allow_none=True, error=ConfigError)
        check_positive("partitions", self.partitions, allow_none=True, error=ConfigError)
        check_fraction("max_reject_fraction", self.max_reject_fraction)
        if self.row_group_size < 1:
            raise ConfigError(
                f"row_group_size must be positive, got {self.row_group_size!r}", option="row_group_size"
            )
        for name in _IMAGE_OPTIONS:
            _check_image_option(name, getattr(self, name))
        self.image_spec()  # the options together

    def image_spec(self) -> ImageSpec:
        """The spec the images are preprocessed to (its ``code`` not set: ``dataset.json`` records it)."""
        return ImageSpec(
            size=self.image_size,
            format=self.image_format,
            quality=self.quality,
            resize=self.resize,
            max_pixels=self.max_image_pixels,
        )
