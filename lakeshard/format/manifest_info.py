"""A typed model of ``manifests/_manifest.json``: what the manifest job wrote last, its commit
marker, checked field by field on read.

```python
info = read_manifest_info("s3://lake/datasets/pets-v1")
info.counts.classes["train"]["cat"], info.parts, info.fingerprint
```

The manifest job builds a :class:`ManifestInfo` and writes it with :func:`write_manifest_info`;
the shard job, ``--base`` and the report read it with :func:`read_manifest_info`. The file's
``format_version`` is the dataset's (:data:`~lakeshard.format.layout.FORMAT_VERSION`): another
version is refused naming the file. Fields an older writer of this version did not write take
their defaults; fields this code does not know are ignored. The file is written with sorted keys,
and ``ManifestInfo.from_json(d).to_json() == d`` for every ``d`` the manifest job writes.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from lakeshard import storage
from lakeshard.errors import DatasetError, StorageError
from lakeshard.format._json_model import OMIT_NONE, from_json_document, to_json_value
from lakeshard.format.label_columns import SINGLE_LABEL
from lakeshard.format.layout import FORMAT_VERSION, READ_VERSIONS, TASK_FORMAT_VERSION, manifest_marker_uri

__all__ = [
    "TASK_FORMAT_VERSION",
    "BaseSummary",
    "DuplicatesSummary",
    "LabelsTable",
    "ManifestCounts",
    "ManifestInfo",
    "read_manifest_info",
    "write_manifest_info",
]


@dataclass(frozen=True, slots=True)
class ManifestCounts:
    """Objects accounted for: every listed object is accepted (in one channel) or rejected."""

    listed: int
    accepted: int
    rejected: int
    channels: dict[str, int]  #: channel -> accepted objects in it
    #: channel -> label name -> accepted objects (the shard job plans from these)
    classes: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: int = 0  #: objects the listing skipped (hidden or ``--exclude``), not listed


@dataclass(frozen=True, slots=True)
class LabelsTable:
    """Where the labels came from when not the path: a ``--labels`` table, or a Ground Truth
    ``--input-manifest`` (which also has ``format``, ``label_attribute`` and the ``missing_objects``
    / ``outside_input`` counts)."""

    uri: str
    files: int
    rows: int
    unlabelled: int  #: listed objects the table gave no label
    pinned: int
    not_in_lake: int  #: rows naming no listed object
    not_in_lake_examples: list[str]
    conflicts: int
    conflict_examples: list[dict[str, list[str]]]  #: ``{key: [labels]}``
    format: str | None = field(default=None, metadata=OMIT_NONE)
    label_attribute: str | None = field(default=None, metadata=OMIT_NONE)
    missing_objects: int | None = field(default=None, metadata=OMIT_NONE)
    outside_input: int | None = field(default=None, metadata=OMIT_NONE)
    outside_input_examples: list[str] | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True, slots=True)
class BaseSummary:
    """The ``--base`` manifest a build reused (``docs/format.md``, "Manifest tables")."""

    root: str
    fingerprint: str
    objects: int  #: objects the base listed
    unchanged: int
    reused: int  #: unchanged and not read again
    new: int
    changed: int
    left: int
    inspected: int
    left_examples: list[str]
    moved: int
    moved_examples: list[dict[str, str]]  #: ``{"key", "from", "to"}``
    relabelled: int = 0
    relabelled_examples: list[dict[str, str]] = field(default_factory=list)  #: ``{"key", "from", "to"}``


@dataclass(frozen=True, slots=True)
class DuplicatesSummary:
    """Accepted objects of identical content, and how many ``--dedupe`` rejected."""

    groups: int
    objects: int
    across_channels: int
    across_labels: int
    examples: list[dict[str, str]]  #: groups: key -> channel
    removed: int


@dataclass(frozen=True, slots=True)
class ManifestInfo:
    """``manifests/_manifest.json``: written last by the manifest job; the manifest is complete
    once it exists."""

    format_version: int
    input: str  #: the lake prefix listed
    split: dict[str, float]  #: channel -> fraction asked for
    split_method: str
    seed: int
    min_per_class: int
    label_depth: int | None
    labels: dict[str, int]  #: label name -> index, as ``labels.json``
    fingerprint: str
    parts: int  #: parts of every manifest table
    counts: ManifestCounts
    achieved_fractions: dict[str, dict[str, float]]  #: label -> channel -> fraction of its objects
    rejects_by_reason: dict[str, int]
    #: the channels of ``split`` in the order given (the hash split's slices are cut in it); None:
    #: not recorded (older manifests)
    split_order: list[str] | None = field(default=None, metadata=OMIT_NONE)
    labels_table: LabelsTable | None = None  #: None: labels from the path
    base: BaseSummary | None = None  #: None: built without ``--base``
    #: ``hidden`` (their names vary without bound) or ``excluded: --exclude GLOB`` -> objects
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    skipped_examples: dict[str, str] = field(default_factory=dict)  #: key -> reason
    exclude: list[str] = field(default_factory=list)
    include_hidden: bool = False
    dedupe: bool = False
    duplicates: DuplicatesSummary | None = None
    #: ``multi-label`` or ``boxes`` (:mod:`lakeshard.format.label_columns`); None: ``single-label``
    task: str | None = field(default=None, metadata=OMIT_NONE)
    #: the columns the task and ``--keep-columns`` add to the manifest tables -> their Arrow type
    #: as text (the tables' Parquet schema holds the types); None: none added
    columns: dict[str, str] | None = field(default=None, metadata=OMIT_NONE)

    @property
    def task_kind(self) -> str:
        """The manifest's task kind: ``single-label``, ``multi-label`` or ``boxes``."""
        return self.task or SINGLE_LABEL

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise ValueError(f"parts must be a positive integer, got {self.parts!r}")

    @classmethod
    def from_json(cls, data: Any, *, source: str = "_manifest.json") -> ManifestInfo:
        """Check and convert the parsed ``_manifest.json`` (read from ``source``).

        Raises:
            DatasetError: another format version, or a field missing or of the wrong type.
        """
        return from_json_document(cls, data, source, versions=READ_VERSIONS, advice=_rebuild_manifest)

    def to_json(self) -> dict[str, Any]:
        """The JSON object :meth:`from_json` reads (plain dicts, lists and scalars)."""
        return typing.cast(dict[str, Any], to_json_value(self))


def _rebuild_manifest(version: object) -> str:
    if isinstance(version, int) and not isinstance(version, bool):
        writer = "an older lakeshard" if version < FORMAT_VERSION else "a newer lakeshard"
    else:
        writer = "something other than lakeshard's manifest job"
    return (
        f": it was written by {writer}; this code reads format version {FORMAT_VERSION} only: "
        "rebuild the manifest (jobs/manifest.py --overwrite)"
    )


def read_manifest_info(root: str) -> ManifestInfo:
    """Read and check ``<root>/manifests/_manifest.json``.

    Raises:
        DatasetError: no complete manifest (no ``_manifest.json``), another format version, or a
            field missing or mistyped.
    """
    uri = manifest_marker_uri(root)
    try:
        data = storage.read_json(uri)
    except StorageError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise DatasetError(
            f"no complete manifest at {storage.normalize(root)}: {uri} is missing; run jobs/manifest.py first"
        ) from None
    return ManifestInfo.from_json(data, source=uri)


def write_manifest_info(root: str, info: ManifestInfo) -> None:
    """Write ``<root>/manifests/_manifest.json`` atomically (sorted keys): the manifest's commit
    marker, so the caller writes it after every table."""
    storage.write_json_atomic(manifest_marker_uri(root), info.to_json())
