"""A segment's rows as its shard stores them (:mod:`jobs.shard_steps.preprocess`): the image
and its size, the manifest's label and kept columns as they are, and a ``boxes`` row's boxes
moved with its image (:mod:`jobs.common.boxes`), with the boxes the resize dropped."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

import pyarrow as pa

from jobs.common.boxes import Geometry, move_boxes
from jobs.common.images import EncodedImage
from lakeshard.errors import ShardError

__all__ = ["Stored", "count_dropped", "shard_rows"]


class Stored(NamedTuple):
    """A row's image as its shard stores it and, for a ``boxes`` dataset, where its pixels went."""

    image: EncodedImage
    geometry: Geometry | None = None


def shard_rows(chunk: pa.Table, made: list[Stored], schema: pa.Schema) -> tuple[pa.Table, list[list[str]]]:
    """The shard rows of ``chunk``'s rows whose images are ``made``, and each row's boxes
    dropped by the resize (a reason each): the label and kept columns taken as they are, a
    boxes row's boxes moved with the image (:func:`_moved_boxes`)."""
    columns = {
        "image": pa.array([m.image.data for m in made], pa.binary()),
        "label": chunk["label_index"],
        "uri": chunk["uri"],
        "key": chunk["key"],
        "height": pa.array([m.image.height for m in made], pa.int32()),
        "width": pa.array([m.image.width for m in made], pa.int32()),
        "is_pad": chunk["is_pad"],
    }
    columns |= {f.name: chunk[f.name] for f in schema if f.name not in columns}
    dropped: list[list[str]] = [[] for _ in made]
    if "boxes" in schema.names:
        moved, dropped = _moved_boxes(chunk, made)
        columns |= {name: pa.array(values, schema.field(name).type) for name, values in moved.items()}
    return pa.table(columns, schema=schema), dropped


def _moved_boxes(chunk: pa.Table, made: list[Stored]) -> tuple[dict[str, list[Any]], list[list[str]]]:
    """The rows' boxes moved with their images (:func:`jobs.common.boxes.move_boxes`), with
    their ``labels`` and ``label_indices`` (a boxes row's are its boxes' classes: those the
    resize kept), and each row's dropped boxes (a reason each)."""
    boxes: list[list[dict[str, Any]]] = []
    dropped: list[list[str]] = []
    for rows, image, uri in zip(chunk["boxes"].to_pylist(), made, chunk["uri"].to_pylist(), strict=True):
        if image.geometry is None:  # an image taken already preprocessed (--base, refused with boxes)
            raise ShardError(f"{uri}: its image was not preprocessed here, so its boxes cannot move with it")
        kept, why = move_boxes(rows or [], image.geometry)
        boxes.append(kept)
        dropped.append(sorted(why.elements()))
    classes = [sorted({(b["label"], b["label_index"]) for b in kept}) for kept in boxes]
    moved = {
        "boxes": boxes,
        "labels": [[name for name, _ in c] for c in classes],
        "label_indices": [[index for _, index in c] for c in classes],
    }
    return moved, dropped


def count_dropped(reasons: Iterable[list[str]]) -> dict[str, int]:
    """Boxes dropped by reason, over rows' lists of reasons."""
    return dict(sorted(Counter(why for row in reasons for why in row).items()))
