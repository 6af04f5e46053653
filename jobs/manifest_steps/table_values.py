"""A labels table's values: one class as text (:func:`value_text`, the one conversion of every
table format and of a Ground Truth value), a ``labels`` list and a ``boxes`` list, each checked
on its own, and boxes checked against their image once its size is known.

A list cell is a list (Parquet, JSON Lines) or its JSON text (a CSV cell: ``["cat", "dog"]``,
``[{"label": "cat", "x": 4, "y": 8, "width": 20, "height": 10}]``). A bad value is not an error
of the table: it is the reason its object is rejected (``bad labels: ...``, ``bad box: ...``),
counted as every reject is. Boxes are ``{label, x, y, width, height}`` with ``x``/``y`` the
top left corner, in pixels of the original image (``--box-units pixels``) or in fractions of
its width and height (``--box-units normalized``); the manifest holds them in pixels.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa

from lakeshard.format.label_columns import BOX_TYPE, BOXES, MULTI_LABEL, SINGLE_LABEL

__all__ = [
    "BOX_FIELDS",
    "LIST_COLUMNS",
    "SINGLE_CLASS",
    "BadValue",
    "TableColumns",
    "check_boxes",
    "parse_boxes",
    "parse_labels",
    "task_columns",
    "value_text",
]

#: The list columns of a labels table, read as lists (a CSV cell's JSON text) by every format.
LIST_COLUMNS = ("labels", "boxes")
#: The columns that give a row its classes, by task (one of them is needed).
SINGLE_CLASS = {SINGLE_LABEL: ("label",), MULTI_LABEL: ("labels", "label"), BOXES: ("boxes",)}


@dataclass(frozen=True, slots=True)
class TableColumns:
    """What a labels table's rows carry besides a key and a channel: the task (which class
    columns are read), the columns kept (``--keep-columns``) and the boxes' units."""

    task: str = SINGLE_LABEL
    keep: tuple[str, ...] = ()
    units: str = "pixels"


#: The members of a box, in the order the manifest's box struct has them after its label.
BOX_FIELDS = ("x", "y", "width", "height")
#: How far past the image's edge a box may end (rounding of a normalised box).
_SLACK = 1e-6


def value_text(value: Any) -> str | None:
    """One table value as text (None stays None): text as it is, an integer as its digits, a
    finite number with no fraction as an integer (``0.0`` -> ``"0"``), another number as Python
    writes it (``2.5`` -> ``"2.5"``). The one conversion of every table format (and of a Ground
    Truth value), so that the same value is the same class wherever it comes from.

    Raises ``ValueError`` saying what the value is (the caller names where): a boolean, a list,
    an object, a number that is not finite, any other kind of value."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise ValueError(f"a boolean ({value!r})")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (float, Decimal)):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number ({value!r})")
        if value == int(value):
            return str(int(value))
        return repr(value) if isinstance(value, float) else str(value.normalize())
    kind = (
        "a list"
        if isinstance(value, (list, tuple))
        else "an object"
        if isinstance(value, dict)
        else f"a {type(value).__name__}"
    )
    raise ValueError(f"{kind} ({value!r:.80})")


class BadValue(ValueError):
    """A table value its object is rejected for; the text is the reject reason."""


def _cell(value: Any, column: str, kind: str) -> list[Any]:
    """A list cell as a list ([] for a null cell); its JSON text parsed."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise BadValue(f"bad {kind}: {column!r} is not a JSON list: {value[:80]!r}") from None
    if not isinstance(value, (list, tuple)):
        raise BadValue(f"bad {kind}: {column!r} is not a list: {value!r:.80}")
    return list(value)


def parse_labels(value: Any) -> list[str]:
    """A ``labels`` cell: its class names, sorted, each once (each as :func:`value_text`).

    Raises :class:`BadValue` for a cell that is not a list, an item that is not a class (a
    list, an object, an empty name) and an empty list."""
    names = []
    for item in _cell(value, "labels", "labels"):
        try:
            text = value_text(item)
        except ValueError as exc:
            raise BadValue(f"bad labels: an item of 'labels' is {exc}") from None
        if text is None or not text.strip():
            raise BadValue("bad labels: 'labels' holds an empty class name")
        names.append(text.strip())
    if not names:
        raise BadValue("bad labels: 'labels' is empty (an image needs at least one class)")
    return sorted(set(names))


def _number(box: dict[str, Any], name: str, n: int) -> float:
    value = box.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadValue(f"bad box: box {n} has {name}={value!r}, not a finite number")
    return float(value)


def _confidence(box: dict[str, Any], n: int) -> float | None:
    """A box's optional ``confidence``, in [0, 1]."""
    if box.get("confidence") is None:
        return None
    value = _number(box, "confidence", n)
    if not 0 <= value <= 1:
        raise BadValue(f"bad box: box {n} has confidence={value:g}, not in [0, 1]")
    return value


def parse_boxes(value: Any, *, units: str) -> list[dict[str, Any]]:
    """A ``boxes`` cell: its boxes as ``{label, label_index: None, x, y, width, height,
    confidence}``, as measured (``units``: ``pixels`` or ``normalized``; ``confidence``
    optional, in [0, 1]). A null cell or an empty list is an image with no object.

    Raises :class:`BadValue` for a cell that is not a list of objects, a box without a label
    or with a member that is not a finite number, a width or height that is not positive, a
    corner left of or above the image, and with ``normalized`` a value past 1."""
    boxes = []
    for n, raw in enumerate(_cell(value, "boxes", "box"), 1):
        if not isinstance(raw, dict):
            raise BadValue(f"bad box: box {n} is not an object with label, x, y, width, height: {raw!r:.80}")
        try:
            label = value_text(raw.get("label"))
        except ValueError as exc:
            raise BadValue(f"bad box: box {n}'s label is {exc}") from None
        if label is None or not label.strip():
            raise BadValue(f"bad box: box {n} has no label")
        x, y, width, height = (_number(raw, name, n) for name in BOX_FIELDS)
        if width <= 0 or height <= 0:
            raise BadValue(f"bad box: box {n} has width={width:g}, height={height:g}; both must be positive")
        if x < 0 or y < 0:
            raise BadValue(f"bad box: box {n} starts at x={x:g}, y={y:g}, outside the image")
        if units == "normalized" and (x + width > 1 + _SLACK or y + height > 1 + _SLACK):
            raise BadValue(f"bad box: box {n} ends past 1 (x+width={x + width:g}, y+height={y + height:g})")
        box = {"label": label.strip(), "label_index": None, "x": x, "y": y, "width": width, "height": height}
        boxes.append({**box, "confidence": _confidence(raw, n)})
    return boxes


def check_boxes(
    boxes: Sequence[dict[str, Any]], width: int, height: int, *, units: str
) -> list[dict[str, Any]]:
    """``boxes`` (from :func:`parse_boxes`) in pixels of an image of ``width`` x ``height``.

    Raises :class:`BadValue` naming the first box that ends past the image's right or bottom
    edge."""
    out = []
    for n, box in enumerate(boxes, 1):
        if units == "normalized":
            box = {
                **box,
                "x": box["x"] * width,
                "y": box["y"] * height,
                "width": box["width"] * width,
                "height": box["height"] * height,
            }
        right, bottom = box["x"] + box["width"], box["y"] + box["height"]
        if right > width * (1 + _SLACK) or bottom > height * (1 + _SLACK):
            raise BadValue(
                f"bad box: box {n} ({box['label']}) ends at x={right:g}, y={bottom:g}, outside the "
                f"{width}x{height} image"
            )
        out.append(box)
    return out


def _row_problem(
    label: str | None, labels: Any, boxes: Any, columns: TableColumns
) -> tuple[Any, Any, str | None]:
    """One row's ``labels`` and ``boxes`` as the manifest holds them, and why its object is
    rejected (None: it is not)."""
    try:
        if columns.task == BOXES:
            return None, parse_boxes(boxes, units=columns.units), None
        if labels is None:
            if label is None:
                raise BadValue("bad labels: the row has neither a 'label' nor a 'labels' list")
            return None, None, None
        if label is not None:
            raise BadValue(f"mixed labels: the row has a 'label' ({label!r}) and a 'labels' list; give one")
        return parse_labels(labels), None, None
    except BadValue as exc:
        return None, None, str(exc)


def task_columns(table: pa.Table, label: pa.ChunkedArray, columns: TableColumns) -> dict[str, pa.Array]:
    """The task's columns of a labels table's rows (none for ``single-label``): ``labels``
    (a row's classes, null where its ``label`` gives one), ``boxes`` (as measured; normalised
    boxes become pixels once the image's size is known) and ``problem`` (why the row's object is
    rejected: a bad list or box, a row mixing a ``label`` and a ``labels`` list)."""
    if columns.task == SINGLE_LABEL:
        return {}
    n = table.num_rows
    lists = {c: table[c].to_pylist() if c in table.column_names else [None] * n for c in LIST_COLUMNS}
    rows = [
        _row_problem(text, labels, boxes, columns)
        for text, labels, boxes in zip(label.to_pylist(), lists["labels"], lists["boxes"])
    ]
    return {
        "labels": pa.array([r[0] for r in rows], pa.list_(pa.string())),
        "boxes": pa.array([r[1] for r in rows], pa.list_(BOX_TYPE)),
        "problem": pa.array([r[2] for r in rows], pa.string()),
    }
