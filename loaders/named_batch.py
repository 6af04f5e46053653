"""The batch of a multi-label or boxes dataset: its fields named (:class:`Batch`), built from the
rows' label columns (``lakeshard.format.label_columns``), and moved with the images by a crop or
a flip.

A single-label dataset's batches stay ``(images, labels)``; a dataset whose ``dataset.json`` has
a ``task`` (``multi-label`` or ``boxes``) yields a :class:`Batch`:

- ``images``: uint8 ``[B, 3, H, W]`` (channels_last), or what the transform made of them; with
  ``decoder="none"`` each row's encoded image, a 1-D uint8 tensor;
- ``labels``: float32 ``[B, num_classes]``, multi-hot (1 for each of the row's classes);
- ``valid``: bool ``[B]``, False for a row that must not count (a row repeated to even out
  ranks, a row the dataset marks ``is_pad``, a bad row skipped): its ``labels`` are all 0 and
  it has no boxes;
- ``boxes`` (boxes datasets; ``None`` otherwise): per image a float32 ``[n, 4]`` tensor of
  ``x0, y0, x1, y1`` in pixels of the batch's image, and ``box_labels``: per image int64 ``[n]``;
- ``columns``: the labels table's kept columns, numeric ones (without nulls) as tensors ``[B]``,
  others as lists;
- ``shards``, ``rows``: int64 ``[B]``, each row's shard (an index into the loader's
  ``shard_uris``) and row number there;
- ``table``: the batch's label columns as stored (Arrow), for a ``collate`` of your own.

It reads by attribute (``batch.boxes``) or by key (``batch["boxes"]``, a kept column by its name);
:meth:`Batch.to` moves its tensors to a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lakeshard.errors import LoaderError
from lakeshard.format.label_columns import BOXES

__all__ = ["Batch", "Collate", "bad_label_rows", "batch_of_rows", "joined"]

#: ``collate(images, batch) -> anything``: what the loader yields for a multi-label or boxes batch,
#: from its images and its :class:`Batch` (after the transform); by default the batch itself.
Collate = Callable[[Any, "Batch"], Any]

#: The label columns every multi-label or boxes shard carries (``label_columns.shard_fields``).
_LABEL_COLUMNS = ("labels", "label_indices", "boxes")


@dataclass(eq=False, repr=False)
class Batch:
    """A multi-label or boxes batch, by name (see :mod:`loaders.named_batch`).

    Read like a mapping (``batch["boxes"]``, ``"boxes" in batch``, ``list(batch)``: the names of
    the fields it has) but not one, so that a ``DataLoader`` over ``as_dataset()`` hands it on as
    it is (its default conversion makes a plain ``dict`` of a mapping)."""

    images: Any
    labels: torch.Tensor
    valid: torch.Tensor
    shards: torch.Tensor
    rows: torch.Tensor
    boxes: list[torch.Tensor] | None = None
    box_labels: list[torch.Tensor] | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    table: pa.Table | None = None

    def __getitem__(self, key: str) -> Any:
        if key in self.columns:
            return self.columns[key]
        if key in _FIELDS and getattr(self, key) is not None:
            return getattr(self, key)
        raise KeyError(f"batch has no field {key!r}; its fields: {', '.join(self)}")

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _FIELDS if name not in ("boxes", "box_labels") or self.boxes is not None)
        yield from self.columns

    def __contains__(self, key: object) -> bool:
        return key in list(self)

    def keys(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"Batch({len(self.valid)} rows: {', '.join(self)})"

    def replace(self, **changes: Any) -> Batch:
        """A copy with ``changes`` (``images=...``)."""
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """This batch with every tensor (the boxes' too) on ``device``."""

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.to(device, non_blocking=non_blocking)
            if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                return [move(v) for v in value]
            return value

        changes = {name: move(getattr(self, name)) for name in _FIELDS}
        return self.replace(**changes, columns={k: move(v) for k, v in self.columns.items()})

    def pinned(self) -> Batch:
        """This batch with its tensors in pinned memory."""
        changes = {
            name: _pin(getattr(self, name)) for name in ("images", "labels", "valid", "shards", "rows")
        }
        return self.replace(**changes)

    def cropped(self, ys: list[int], xs: list[int], size: int) -> Batch:
        """The boxes of each image ``i`` cropped to its ``size`` x ``size`` window at
        ``(ys[i], xs[i])``: shifted, clipped to the window, and dropped where no area is left."""
        n = len(ys)
        return self.windowed(xs, ys, [size] * n, [size] * n, size)

    def windowed(
        self,
        xs: Sequence[float],
        ys: Sequence[float],
        widths: Sequence[float],
        heights: Sequence[float],
        size: int,
    ) -> Batch:
        """The boxes of each image ``i`` in its window ``(xs[i], ys[i], widths[i], heights[i])``
        (pixels) resized to ``size`` x ``size``: shifted, scaled, clipped to the window, and
        dropped where no area is left."""
        if self.boxes is None:
            return self
        moved = []
        for box, x, y, w, h in zip(self.boxes, xs, ys, widths, heights, strict=True):
            origin = torch.tensor([x, y, x, y], dtype=box.dtype)
            scale = torch.tensor([size / w, size / h, size / w, size / h], dtype=box.dtype)
            moved.append(((box - origin) * scale).clamp(0, size))
        return self._keep_with_area(moved)

    def flipped(self, flip: np.ndarray, width: int) -> Batch:
        """The boxes of each image where ``flip`` is True mirrored across an image ``width``
        pixels wide (``x -> width - x``)."""
        if self.boxes is None or not flip.any():
            return self
        boxes = [
            torch.stack([width - b[:, 2], b[:, 1], width - b[:, 0], b[:, 3]], dim=1) if f else b
            for b, f in zip(self.boxes, flip.tolist(), strict=True)
        ]
        return self.replace(boxes=boxes)

    def rows_of(self, lo: int, hi: int) -> Batch:
        """Rows ``[lo, hi)`` of this batch (views of its tensors)."""
        cut = {name: _cut(getattr(self, name), lo, hi) for name in _FIELDS}
        columns = {k: _cut(v, lo, hi) for k, v in self.columns.items()}
        table = None if self.table is None else self.table.slice(lo, hi - lo)
        return self.replace(**cut, columns=columns, table=table)

    def in_classes(self, lut: torch.Tensor | None, num_classes: int, *, shard_offset: int = 0) -> Batch:
        """This batch in a class map of ``num_classes`` classes, class ``c`` becoming ``lut[c]``
        (``None``: ``c``), in ``labels`` and ``box_labels``; its ``shards`` counted from
        ``shard_offset`` (a mixture's). ``table`` stays as stored."""
        width = self.labels.shape[1]
        index = torch.arange(width) if lut is None else lut
        if len(index) != width or (len(index) and int(index.max()) >= num_classes):
            raise LoaderError(
                f"cannot map a batch of {width} classes (labels {list(self.labels.shape)}) by {index.tolist()} "
                f"into {num_classes} classes: a transform must keep the batch's labels"
            )
        labels = torch.zeros((len(self.labels), num_classes), dtype=self.labels.dtype)
        labels[:, index] = self.labels
        box_labels = self.box_labels
        if box_labels is not None and lut is not None:
            box_labels = [lut[b] for b in box_labels]
        return self.replace(labels=labels, box_labels=box_labels, shards=self.shards + shard_offset)

    def _keep_with_area(self, boxes: list[torch.Tensor]) -> Batch:
        assert self.box_labels is not None  # boxes and box_labels go together
        keep = [(b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]) for b in boxes]
        return self.replace(
            boxes=[b[k] for b, k in zip(boxes, keep, strict=True)],
            box_labels=[lab[k] for lab, k in zip(self.box_labels, keep, strict=True)],
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(Batch) if f.name not in ("columns", "table"))


def joined(parts: Sequence[Batch], images: Any) -> Batch:
    """One batch of the rows of ``parts``, one part after another, with ``images`` (theirs,
    joined by the caller); the parts' tables must have the same columns (in any order)."""
    first = parts[0]
    if len(parts) == 1:
        return first.replace(images=images)
    changes = {name: _joined([getattr(p, name) for p in parts]) for name in _FIELDS if name != "images"}
    tables = [p.table for p in parts if p.table is not None]
    table = None
    if len(tables) == len(parts):
        names = tables[0].column_names
        table = pa.concat_tables([t.select(names) for t in tables])
    columns = (
        _kept(table)
        if table is not None
        else {k: _joined([p.columns[k] for p in parts]) for k in first.columns}
    )
    return first.replace(images=images, **changes, columns=columns, table=table)


def _cut(value: Any, lo: int, hi: int) -> Any:
    return None if value is None else value[lo:hi]


def _joined(values: list[Any]) -> Any:
    """Values of one field of several batches as one: tensors concatenated, lists chained."""
    if values[0] is None:
        return None
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    return [x for value in values for x in value]


def _pin(value: Any) -> Any:
    return value.pin_memory() if isinstance(value, torch.Tensor) else value


def _list_values(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """A list column's values (flattened) and its offsets (int64, ``len + 1``), nulls as empty."""
    array = column.combine_chunks()
    offsets = np.asarray(array.offsets, dtype=np.int64)
    return array.values.slice(offsets[0], offsets[-1] - offsets[0]), offsets - offsets[0]


def bad_label_rows(table: pa.Table, num_classes: int) -> list[str | None]:
    """Per row of ``table`` (a batch's label columns), why its labels are bad (``None``: they
    are not): ``label_indices`` null, a class index out of ``[0, num_classes)`` (the row's or a
    box's)."""
    reasons: list[str | None] = [None] * table.num_rows
    for name in ("label_indices", "boxes"):
        if name not in table.column_names:
            continue
        column = table.column(name)
        values, offsets = _list_values(column)
        if name == "boxes":
            values = values.field("label_index")
        flat = np.asarray(values.fill_null(-1) if values.null_count else values, dtype=np.int64)
        out = (flat < 0) | (flat >= num_classes)
        nulls = column.combine_chunks().is_null().to_numpy(zero_copy_only=False)
        for i in range(table.num_rows):
            if reasons[i] is not None:
                continue
            if name == "label_indices" and nulls[i]:
                reasons[i] = "label_indices is null"
            elif out[offsets[i] : offsets[i + 1]].any():
                bad = int(flat[offsets[i] : offsets[i + 1]][out[offsets[i] : offsets[i + 1]]][0])
                where = "a box's label_index" if name == "boxes" else "label index"
                reasons[i] = f"{where} {bad} out of range [0, {num_classes})"
    return reasons


def batch_of_rows(
    images: Any,
    table: pa.Table,
    *,
    valid: np.ndarray,
    num_classes: int,
    task: str,
    shards: np.ndarray,
    rows: np.ndarray,
) -> Batch:
    """The :class:`Batch` of ``images`` and their rows' label columns ``table`` (in batch
    order); rows not ``valid`` get no labels and no boxes."""
    n = table.num_rows
    values, offsets = _list_values(table.column("label_indices"))
    flat = np.asarray(values, dtype=np.int64)
    row_of = np.repeat(np.arange(n), np.diff(offsets))
    keep = valid[row_of]
    labels = torch.zeros((n, num_classes), dtype=torch.float32)
    labels[torch.from_numpy(row_of[keep]), torch.from_numpy(flat[keep])] = 1.0
    batch = Batch(
        images,
        labels,
        torch.from_numpy(valid.copy()),
        torch.from_numpy(shards.astype(np.int64, copy=True)),
        torch.from_numpy(rows.astype(np.int64, copy=True)),
        columns=_kept(table),
        table=table,
    )
    if task == BOXES:
        batch.boxes, batch.box_labels = _boxes(table.column("boxes"), valid)
    return batch


def _boxes(column: pa.ChunkedArray, valid: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row, its boxes as float32 ``[n, 4]`` ``x0, y0, x1, y1`` and their int64 class indices."""
    values, offsets = _list_values(column)
    x, y, w, h = (np.asarray(values.field(k), dtype=np.float64) for k in ("x", "y", "width", "height"))
    corners = torch.from_numpy(np.stack([x, y, x + w, y + h], axis=1).astype(np.float32)).reshape(-1, 4)
    classes = torch.from_numpy(np.array(values.field("label_index"), dtype=np.int64))
    boxes, labels = [], []
    for i, ok in enumerate(valid.tolist()):
        lo, hi = (int(offsets[i]), int(offsets[i + 1])) if ok else (0, 0)
        boxes.append(corners[lo:hi].clone())
        labels.append(classes[lo:hi].clone())
    return boxes, labels


def _kept(table: pa.Table) -> dict[str, Any]:
    """The kept columns: numeric ones without nulls as tensors, the others as lists."""
    out: dict[str, Any] = {}
    for name in table.column_names:
        if name in _LABEL_COLUMNS:
            continue
        column = table.column(name)
        numeric = pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
        if (numeric or pa.types.is_boolean(column.type)) and column.null_count == 0:
            out[name] = torch.from_numpy(
                np.asarray(column.combine_chunks().to_numpy(zero_copy_only=False)).copy()
            )
        else:
            out[name] = column.to_pylist()
    return out
