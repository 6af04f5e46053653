"""The options of each job, as frozen dataclasses (one commented YAML file each in ``conf/``)."""

from __future__ import annotations

from dataclasses import dataclass

from jobs.images import IMAGE_FORMATS, RESIZE_MODES, ImageSpec
from jobs.plan import REMAINDER_POLICIES
from jobs.split import ALGORITHMS
from lakeshard.config import check_positive, opt, parse_globs, parse_seed, parse_size, parse_split

__all__ = ["ENGINE_NAMES", "ManifestConfig", "ShardConfig"]

ENGINE_NAMES = ("spark", "dask", "local")


#: The shard job's image options and the :class:`ImageSpec` fields they set.
_IMAGE_OPTIONS = {"image_size": "size", "resize": "resize", "image_format": "format", "quality": "quality",
                  "max_image_pixels": "max_pixels"}


def _check_fraction(name: str, value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _check_image_option(name: str, value: object) -> None:
    """Check one image option with :class:`ImageSpec`'s own rule; the error names the option
    (``max_image_pixels must be positive``), not the spec's field (``max_pixels``)."""
    try:
        ImageSpec(**{_IMAGE_OPTIONS[name]: value})
    except ValueError as exc:
        text = str(exc)
        raise ValueError(f"{name} {text[text.index('must '):]}" if "must " in text
                         else f"{name}: {text}") from None


@dataclass(frozen=True, slots=True)
class ManifestConfig:
    input: str = opt(help="the raw lake: a local folder, file:// or s3:// prefix laid out as <prefix>/<label>/.../<file>")
    output: str = opt(help="the dataset URI to write manifests/ and labels.json under")
    split: dict = opt("train=0.8,validation=0.1,test=0.1", parse=parse_split,
                      help="channel fractions, adding up to 1")
    split_method: str = opt("hash", choices=tuple(ALGORITHMS),
                            help="hash: stable as the lake grows; stratified: exact per-class counts")
    seed: int = opt(0, parse=parse_seed, help="seed of the split (and, by default, of the shard job), in [0, 2**32 - 1]")
    min_per_class: int = opt(1, help="fail unless every class has at least this many objects in every "
                                     "channel (0: a class may be missing from a channel)")
    label_depth: int | None = opt(None, help="which path component below the input is the label (1 = the first; "
                                             "the default: 1, or none with --labels, with which it cannot be given)")
    labels: str | None = opt(None, help="a CSV, Parquet or JSON Lines table (or a folder of them) of the labels: a 'key' "
                                        "(relative to --input) or 'uri' column, a 'label' column and optionally a "
                                        "'channel' column pinning an object to a channel; every object under --input "
                                        "is listed (no path label), and one with no label row is rejected")
    input_manifest: str | None = opt(None, help="a SageMaker Ground Truth augmented manifest (JSON Lines of 'source-ref' "
                                                "and the --label-attribute): its objects under --input, not a listing "
                                                "of --input, are the lake, labelled with their class names")
    label_attribute: str | None = opt(None, help="with --input-manifest: the label attribute of the Ground Truth job "
                                                 "(its LabelAttributeName), whose class name labels each object")
    base: str | None = opt(None, help="a previous complete manifest of the same --input, labels and split: objects it "
                                      "listed with the same size and ETag (local: size and modification time) are not "
                                      "read again; the result is what a build without --base writes")
    max_reject_fraction: float = opt(0.05, help="fail if more than this fraction of listed objects is rejected")
    overwrite: bool = opt(False, help="replace an existing manifest (and invalidate the dataset built on it)")
    engine: str = opt("spark", choices=ENGINE_NAMES, help="the engine that runs the job")
    scheduler: str | None = opt(None, help="dask: address of a dask.distributed scheduler (else DASK_SCHEDULER_ADDRESS, else a LocalCluster)")
    partitions: int | None = opt(None, help="tasks for reading object headers (default: from the number of objects)")
    rows_per_part: int = opt(100_000, help="objects per part of the manifest tables (a class is never split across "
                                           "parts) and per task that groups identical content")
    exclude: tuple = opt((), parse=parse_globs, repeat=True,
                         help="skip objects matching this glob: against the key if it has a '/', else against "
                              "each path component (e.g. '*.tmp')")
    include_hidden: bool = opt(False, help="list hidden objects too (names starting with '.', __MACOSX, Thumbs.db, "
                                           "desktop.ini), which are skipped by default")
    inventory: str | None = opt(None, help="an S3 Inventory report of --input's bucket (its manifest.json, or the dated "
                                          "folder holding it): its CSV or Parquet files are the lake instead of a listing")
    sniff: bool = opt(True, help="read each object's first bytes to reject what is not an image now; off: no object is "
                                 "read, bad objects are rejected by the shard job's decode instead")
    list_task_objects: int = opt(100_000, help="a listing task that has listed this many objects hands the rest of its "
                                               "class prefix to new tasks, so a large class is listed in parallel")
    dedupe: bool = opt(False, help="keep one object of each set with identical content (the others are rejected "
                                   "naming the kept key), so no image is in two channels")

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", parse_split(self.split))
        object.__setattr__(self, "seed", parse_seed(self.seed))
        object.__setattr__(self, "exclude", parse_globs(self.exclude))
        check_positive("min_per_class", self.min_per_class, allow_zero=True)
        check_positive("label_depth", self.label_depth, allow_none=True)
        if self.label_depth is None and self.labels is None and self.input_manifest is None:
            object.__setattr__(self, "label_depth", 1)  # path labels, the default
        check_positive("partitions", self.partitions, allow_none=True)
        check_positive("list_task_objects", self.list_task_objects)
        check_positive("rows_per_part", self.rows_per_part)
        _check_fraction("max_reject_fraction", self.max_reject_fraction)


@dataclass(frozen=True, slots=True)
class ShardConfig:
    dataset: str = opt(help="the dataset URI the manifest job wrote")
    num_shards: int = opt(1, help="shards per channel: one per target GPU (or a multiple)")
    image_size: int = opt(224, help="side of the square output images, in pixels")
    resize: str = opt("crop", choices=RESIZE_MODES,
                      help="crop: shorter side to size, center crop; pad: fit inside on black; stretch: ignore aspect")
    image_format: str = opt("jpeg", choices=IMAGE_FORMATS, help="encoding of the stored images")
    quality: int = opt(90, help="JPEG quality (1-100)")
    max_image_pixels: int = opt(89_478_485, help="reject images with more pixels than this (decompression bombs)")
    remainder: str = opt("drop", choices=REMAINDER_POLICIES,
                         help="rows beyond a multiple of num_shards: drop them, or pad by repeating samples")
    seed: int | None = opt(None, parse=parse_seed,
                           help="seed of the shard plan and in-shard shuffle, in [0, 2**32 - 1] (default: the manifest's seed)")
    channels: str | None = opt(None, help="comma-separated channels to shard, each once (default: all in the manifest)")
    row_group_size: int = opt("4MiB", parse=parse_size, help="target bytes per Parquet row group")
    max_reject_fraction: float = opt(0.05, help="fail if more than this fraction of manifest rows fails to decode")
    threads: int | None = opt(None, help="threads that read images inside each task, ahead of decoding (default: 8 for S3, "
                                         "whose reads wait on the network; 0 for local files, read as they are decoded)")
    decode_threads: int | None = opt(None, help="threads that decode, resize and encode inside each task (default: the cores the "
                                               "engine gives a task: 1, or spark.task.cpus); more than that only makes them take turns")
    overwrite: bool = opt(False, help="replace an existing complete dataset, every channel it has (refused if "
                                      "--channels names fewer: the others' shards would be deleted)")
    resume: bool = opt(True, help="reuse the segments an interrupted run with the same settings already preprocessed")
    plan_only: bool = opt(False, help="a dry run: check the inputs, run the plan (each row's slot and each shard's "
                                      "order) on the engine, print its summary (rows per shard per channel, dropped "
                                      "and padded rows, each class's spread over the shards) and exit; no image is "
                                      "read and nothing is left in the dataset (the plan's files are removed)")
    engine: str = opt("spark", choices=ENGINE_NAMES,
                      help="the engine that runs the job (local: a thread pool in this process, for small lakes)")
    scheduler: str | None = opt(None, help="dask: address of a dask.distributed scheduler (else DASK_SCHEDULER_ADDRESS, else a LocalCluster)")
    partitions: int | None = opt(None, help="tasks for preprocessing (default: from the number of rows)")
    base: str | None = opt(None, help="a previous complete dataset (local folder or s3://) built with the same image "
                                      "options: the images of rows whose object (URI and ETag) it already holds are "
                                      "taken from its shards, not fetched and decoded again; a base built with other "
                                      "options, or incomplete, is refused")

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_group_size", parse_size(self.row_group_size))
        if self.seed is not None:
            object.__setattr__(self, "seed", parse_seed(self.seed))
        check_positive("num_shards", self.num_shards)
        check_positive("threads", self.threads, allow_none=True, allow_zero=True)
        check_positive("decode_threads", self.decode_threads, allow_none=True)
        check_positive("partitions", self.partitions, allow_none=True)
        _check_fraction("max_reject_fraction", self.max_reject_fraction)
        if self.row_group_size < 1:
            raise ValueError(f"row_group_size must be positive, got {self.row_group_size!r}")
        for name in _IMAGE_OPTIONS:
            _check_image_option(name, getattr(self, name))
        self.image_spec()  # the options together

    def image_spec(self) -> ImageSpec:
        return ImageSpec(size=self.image_size, resize=self.resize, format=self.image_format,
                         quality=self.quality, max_pixels=self.max_image_pixels)
