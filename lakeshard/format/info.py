"""A typed model of ``dataset.json``: what the shard job wrote, checked field by field on read.

```python
info = read_dataset_info("s3://lake/datasets/pets-v1")
info.channels["train"].shards[0].rows, info.image.size, info.dataset_version
```

:meth:`DatasetInfo.from_json` checks the format version first (another version is refused with
what to do), then every field's presence and type, naming the file and the field's path
(``channels.train.shards[1].rows``) in the :class:`~lakeshard.errors.DatasetError`. Fields it
does not know are ignored (see the compatibility policy in ``docs/format.md``).
``DatasetInfo.from_json(d).to_json() == d`` for every ``d`` the shard job writes.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lakeshard import storage
from lakeshard.errors import DatasetError, StorageError
from lakeshard.format._json_model import OMIT_NONE, from_json_document, model_of, optional_of, to_json_value
from lakeshard.format.label_columns import SINGLE_LABEL
from lakeshard.format.layout import (
    FORMAT_VERSION,
    READ_VERSIONS,
    TASK_FORMAT_VERSION,
    check_shard_path,
    dataset_json_uri,
    shard_relpath,
)

__all__ = [
    "IMAGE_FORMATS",
    "RESIZE_MODES",
    "BaseRef",
    "BuildInfo",
    "ChannelInfo",
    "Counts",
    "DatasetInfo",
    "ImageSpec",
    "Inputs",
    "ShardInfo",
    "image_rule_broken",
    "info_fields",
    "read_dataset_info",
]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file of a channel."""

    path: str  #: relative to the dataset root (``layout.check_shard_path`` says which paths)
    rows: int
    bytes: int
    sha256: str
    row_groups: int
    class_counts: dict[str, int]  #: label name -> rows of that label (pad copies count)

    @classmethod
    def from_stats(
        cls,
        channel: str,
        index: int,
        count: int,
        stats: Mapping[str, Any],
        names: Mapping[int, str],
        *,
        path: str | None = None,
    ) -> ShardInfo:
        """The entry of shard ``index`` of ``count`` of ``channel`` from its writer's ``stats``
        (:attr:`ShardWriter.stats`); ``names`` maps label index -> label name. ``path``: where
        the file is, relative to the dataset root (the local layout's place when not given)."""
        if path is None:
            path = shard_relpath(channel, index, count)
        check_shard_path(path, channel, index, count)
        return cls(
            path=path,
            rows=stats["rows"],
            bytes=stats["bytes"],
            sha256=stats["sha256"],
            row_groups=stats["row_groups"],
            class_counts={names[int(k)]: v for k, v in stats["label_counts"].items()},
        )


@dataclass(frozen=True, slots=True)
class ChannelInfo:
    """One channel: its equal shards and how its manifest rows were accounted for."""

    rows: int  #: rows in all its shards (num_shards * rows_per_shard)
    rows_per_shard: int
    rejected: int  #: manifest rows whose image the shard job could not use
    dropped: list[str]  #: URIs left out by the ``drop`` remainder policy
    padded: list[str]  #: URIs repeated (``is_pad`` rows) by the ``pad`` remainder policy
    class_counts: dict[str, int]
    shards: list[ShardInfo]

    @classmethod
    def of_shards(
        cls,
        shards: list[ShardInfo],
        *,
        rejected: int = 0,
        dropped: list[str] | None = None,
        padded: list[str] | None = None,
    ) -> ChannelInfo:
        """A channel of equal ``shards``: its rows and class counts summed from theirs."""
        counts: dict[str, int] = {}
        for shard in shards:
            for name, n in shard.class_counts.items():
                counts[name] = counts.get(name, 0) + n
        return cls(
            rows=sum(s.rows for s in shards),
            rows_per_shard=shards[0].rows if shards else 0,
            rejected=rejected,
            dropped=dropped or [],
            padded=padded or [],
            class_counts=counts,
            shards=shards,
        )


#: How an image is fitted to ``size``×``size`` (:class:`ImageSpec`'s ``resize``).
RESIZE_MODES = ("crop", "pad", "stretch")
#: How a stored image is encoded (:class:`ImageSpec`'s ``format``).
IMAGE_FORMATS = ("jpeg", "png")


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """How every stored image is made: what the shard job preprocesses to (``jobs/common/images.py``)
    and what ``dataset.json`` records. Checked on creation (:class:`ValueError` naming the field).

    ``resize``: ``crop`` scales the shorter side to ``size`` and takes the center square;
    ``pad`` fits the whole image inside ``size``×``size`` on black; ``stretch`` ignores the
    aspect ratio. Transparent images are composited over white.
    """

    size: int  #: height and width in pixels, 8 to 8192
    format: str  #: ``jpeg`` or ``png``
    quality: int  #: JPEG quality, 1 to 100
    resize: str  #: the resize mode (``crop``, ``pad`` or ``stretch``)
    max_pixels: int  #: larger source images are rejected (decompression bombs)
    #: a hash of the code that made the images (``jobs/common/images.py``); None: not recorded (older
    #: datasets), or a spec to preprocess with
    code: str | None = None

    def __post_init__(self) -> None:
        for field, (name, _, _) in _IMAGE_RULES.items():
            if broken := image_rule_broken(field, getattr(self, field)):
                raise ValueError(f"{name} {broken}")


#: :class:`ImageSpec`'s rules: per field, the name its messages use, the check and what it says.
_IMAGE_RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "size": (
        "image size",
        lambda v: isinstance(v, int) and 8 <= v <= 8192,
        "must be an integer in [8, 8192]",
    ),
    "resize": ("resize", lambda v: v in RESIZE_MODES, f"must be one of {', '.join(RESIZE_MODES)}"),
    "format": ("image format", lambda v: v in IMAGE_FORMATS, f"must be one of {', '.join(IMAGE_FORMATS)}"),
    "quality": ("quality", lambda v: 1 <= v <= 100, "must be in [1, 100]"),
    "max_pixels": ("max_pixels", lambda v: v >= 1, "must be positive"),
}


def image_rule_broken(field: str, value: Any) -> str | None:
    """What ``value`` breaks of :class:`ImageSpec`'s rule for ``field`` (``"must be positive, got
    0"``), or None: for a caller that names the value its own way (the shard job's options)."""
    _, ok, rule = _IMAGE_RULES[field]
    return None if ok(value) else f"{rule}, got {value!r}"


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the dataset was made from: the manifest job's lake, split and seed."""

    lake: str
    manifest_fingerprint: str
    split: dict[str, float]
    split_method: str
    manifest_seed: int


@dataclass(frozen=True, slots=True)
class Counts:
    """Objects and rows accounted for across every channel."""

    listed: int
    manifest_rejects: int
    shard_rejects: int
    dropped: int
    padded: int
    #: a ``boxes`` dataset: boxes the shard job's resize left out of its shards, by reason
    #: (``outside the crop``: no area left; ``under a tenth of a pixel``); None: not ``boxes``
    dropped_boxes: dict[str, int] | None = dataclasses.field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True, slots=True)
class BaseRef:
    """The dataset an incremental build took preprocessed images from (``--base``)."""

    root: str  #: its URI
    dataset_version: str  #: its ``dataset_version`` when it was read


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """How one run made the shards (depends on the engine's parallelism; not the dataset's identity)."""

    preprocess_tasks: int
    preprocessed: int  #: images decoded
    reused_segments: int
    assembled_shards: int
    reused: int = 0  #: images taken, already preprocessed, from the shards of ``base``
    base: BaseRef | None = None  #: the ``--base`` dataset, None for a build from scratch


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """``dataset.json``: written last by the shard job; a dataset is complete once it exists."""

    format_version: int
    dataset_version: str
    created_at: str
    engine: str
    inputs: Inputs
    seed: int
    labels: dict[str, int]  #: label name -> index, 0..num_classes-1
    num_classes: int
    image: ImageSpec
    num_shards: int
    remainder: str
    row_group_bytes: int
    counts: Counts
    build: BuildInfo
    channels: dict[str, ChannelInfo]
    rejects_path: (
        str  #: the shard rejects table, relative to the dataset root (``layout.shard_rejects_relpath``)
    )
    versions: dict[str, str]  #: library versions of the run (python, pyarrow, pillow, numpy)
    #: ``multi-label`` or ``boxes`` (:mod:`lakeshard.format.label_columns`; format version 4);
    #: None: ``single-label``
    task: str | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    #: the columns the shards add to ``SHARD_SCHEMA`` (``label_columns.shard_fields``) -> their
    #: Arrow type as text (the shards' Parquet schema holds the types); None: none added
    columns: dict[str, str] | None = dataclasses.field(default=None, metadata=OMIT_NONE)

    @property
    def task_kind(self) -> str:
        """The dataset's task kind: ``single-label``, ``multi-label`` or ``boxes``."""
        return self.task or SINGLE_LABEL

    @classmethod
    def from_json(cls, data: Any, *, source: str = "dataset.json") -> DatasetInfo:
        """Check and convert the parsed ``dataset.json`` (read from ``source``).

        Raises:
            DatasetError: another format version, or a field missing or of the wrong type.
        """
        info = from_json_document(cls, data, source, versions=READ_VERSIONS, advice=_rebuild_dataset)
        if (info.task is None) != (info.format_version == FORMAT_VERSION):
            raise DatasetError(
                f"{source} has format_version {info.format_version} and task {info.task!r}: a single-label "
                f"dataset has format_version {FORMAT_VERSION} and no task, any other has "
                f"format_version {TASK_FORMAT_VERSION} and its task"
            )
        return info

    def to_json(self) -> dict[str, Any]:
        """The JSON object :meth:`from_json` reads (plain dicts, lists and scalars)."""
        return typing.cast(dict[str, Any], to_json_value(self))

    def channel(self, name: str, *, source: str = "dataset.json") -> ChannelInfo:
        """The entry of channel ``name``; :class:`DatasetError` if the dataset has no such channel."""
        if name not in self.channels:
            raise DatasetError(f"{source} has no channel {name!r} (it has {sorted(self.channels)})")
        return self.channels[name]


def _rebuild_dataset(version: object) -> str:
    return (
        f"; this code reads format version {FORMAT_VERSION} only: "
        "rebuild the dataset with this version's jobs (jobs/manifest.py, then jobs/shard.py --overwrite)"
    )


def read_dataset_info(root: str) -> DatasetInfo:
    """Read and check ``<root>/dataset.json``.

    Raises:
        DatasetError: the dataset is not complete (no ``dataset.json``), was written in another
            format version, or a field is missing or mistyped.
    """
    uri = dataset_json_uri(root)
    try:  # one GET, no HEAD first: a remote loader's first batch waits on this
        data = storage.read_json(uri)
    except StorageError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise DatasetError(
            f"no complete dataset at {storage.normalize(root)}: {uri} does not exist "
            "(run jobs/manifest.py then jobs/shard.py, or wait for the shard job to finish)"
        ) from None
    return DatasetInfo.from_json(data, source=uri)


def info_fields(cls: type = DatasetInfo, prefix: str = "") -> dict[str, Any]:
    """Every field's path, as ``docs/format.md`` names it (``channels.<channel>.shards[].rows``),
    and its type; a field holding a model is followed by its own fields."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, hint = f"{prefix}{f.name}", hints[f.name]
        out[path] = hint
        hint = optional_of(hint) or hint
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if (model := model_of(hint)) is not None:
            out.update(info_fields(model, f"{path}."))
        elif origin is dict and (model := model_of(args[1])) is not None:
            out.update(info_fields(model, f"{path}.<{_key_name(f.name)}>."))
        elif origin is list and (model := model_of(args[0])) is not None:
            out.update(info_fields(model, f"{path}[]."))
    return out


def _key_name(field: str) -> str:
    return {"channels": "channel"}.get(field, "key")
