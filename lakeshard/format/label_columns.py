"""The manifest's label columns beyond one class: the task kinds and the columns each adds.

A manifest's task kind says what an image is labelled with (``_manifest.json``'s ``task``;
absent: ``single-label``):

``single-label``
    one class: ``label`` and ``label_index`` (the columns of
    :data:`~lakeshard.format.layout.MANIFEST_SCHEMA`, nothing added).
``multi-label``
    a set of classes: ``labels`` (their names, sorted) and ``label_indices`` (their indices,
    in the same order); ``label`` and ``label_index`` are null.
``boxes``
    objects with boxes: ``boxes`` (a list of :data:`BOX_TYPE`, in pixels of the original image,
    ``x``/``y`` the top left corner), the image's ``image_width`` and ``image_height``, and
    ``labels``/``label_indices`` (the distinct classes of its boxes).

Columns a labels table adds with ``--keep-columns`` follow, with the Arrow types they had.

A dataset's shards carry the same columns after :data:`~lakeshard.format.layout.SHARD_SCHEMA`
(:func:`shard_schema`), with ``label`` null beyond ``single-label``: boxes are then in pixels of
the image as stored in the shard (resized, cropped or padded with it), and the image's size is
the shard's ``width`` and ``height``.
"""

from __future__ import annotations

import pyarrow as pa

from lakeshard.format.layout import MANIFEST_SCHEMA, SHARD_SCHEMA

__all__ = [
    "BOXES",
    "BOX_TYPE",
    "MULTI_LABEL",
    "SINGLE_LABEL",
    "TASK_KINDS",
    "manifest_schema",
    "shard_fields",
    "shard_schema",
    "task_fields",
]

SINGLE_LABEL = "single-label"
MULTI_LABEL = "multi-label"
BOXES = "boxes"
#: The task kinds, the first the default (``--task``).
TASK_KINDS = (SINGLE_LABEL, MULTI_LABEL, BOXES)

#: One box of a ``boxes`` manifest: its class (name and index), its rectangle in pixels of the
#: original image (``x``, ``y``: the top left corner; ``width``, ``height`` > 0) and the
#: annotator's confidence in [0, 1] (Ground Truth's; null where the labels did not give one).
BOX_TYPE = pa.struct(
    [
        ("label", pa.string()),
        ("label_index", pa.int64()),
        ("x", pa.float64()),
        ("y", pa.float64()),
        ("width", pa.float64()),
        ("height", pa.float64()),
        ("confidence", pa.float64()),
    ]
)

_LABELS = [pa.field("labels", pa.list_(pa.string())), pa.field("label_indices", pa.list_(pa.int64()))]
_BOXES = [
    pa.field("boxes", pa.list_(BOX_TYPE)),
    pa.field("image_width", pa.int32()),
    pa.field("image_height", pa.int32()),
]


def task_fields(task: str) -> list[pa.Field]:
    """The columns ``task`` adds to :data:`~lakeshard.format.layout.MANIFEST_SCHEMA`.

    Raises ``ValueError`` naming an unknown task kind."""
    if task not in TASK_KINDS:
        raise ValueError(f"task must be one of {', '.join(TASK_KINDS)}, got {task!r}")
    return {SINGLE_LABEL: [], MULTI_LABEL: _LABELS, BOXES: [*_LABELS, *_BOXES]}[task]


def manifest_schema(task: str = SINGLE_LABEL, kept: pa.Schema | None = None) -> pa.Schema:
    """The manifest tables' schema: :data:`MANIFEST_SCHEMA` (exactly, for a single-label
    manifest with no kept column), the task's columns, then the kept columns ``kept``."""
    return pa.schema([*MANIFEST_SCHEMA, *task_fields(task), *(kept or [])])


def shard_fields(task: str, kept: pa.Schema | None = None) -> list[pa.Field]:
    """The columns a ``task`` dataset's shards add to :data:`SHARD_SCHEMA`: the manifest's
    label columns (not the original image's size: the shard's ``width`` and ``height`` are
    the stored image's), then the kept columns ``kept``.

    Raises ``ValueError`` naming an unknown task kind."""
    return [f for f in task_fields(task) if f.name not in ("image_width", "image_height")] + list(kept or [])


def shard_schema(task: str = SINGLE_LABEL, kept: pa.Schema | None = None) -> pa.Schema:
    """A shard's schema: :data:`SHARD_SCHEMA` (exactly, for a single-label dataset with no kept
    column), then :func:`shard_fields`."""
    return pa.schema([*SHARD_SCHEMA, *shard_fields(task, kept)])
