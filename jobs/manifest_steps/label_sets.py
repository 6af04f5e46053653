"""What a key's rows of a labels table give its object: one class, a set of classes, or boxes,
with its pinned channel and kept columns (the labelling join's rule, per key).

Identical rows of a key are one. For ``single-label`` two different rows are a conflict (the
job fails naming the key). For ``multi-label`` the rows' classes are united (a ``labels`` list
or a ``label`` each) and for ``boxes`` their boxes are put together; a row the table reader
found bad, or a key with a ``labels`` list in one row and a single ``label`` in another,
rejects the object with the reason. Rows of a key that pin different channels or keep
different values are a conflict whatever the task.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.manifest_steps.listing import LabelledRow, reject
from jobs.manifest_steps.table_values import TableColumns
from lakeshard.format.label_columns import BOXES, SINGLE_LABEL

__all__ = ["KeyLabels", "combine"]


@dataclass(frozen=True, slots=True)
class KeyLabels:
    """A key's labels from its rows: its ``label`` (single-label), or ``labels`` and ``boxes``;
    its pinned channel, kept values, why its object is rejected (None: it is not), and the ways
    it is labelled when they conflict (empty: no conflict)."""

    label: str | None
    pin: str | None
    labels: list[str] | None = None
    boxes: list[dict[str, Any]] | None = None
    kept: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    ways: tuple[str, ...] = ()

    def apply(self, row: LabelledRow, task: str) -> None:
        """Label ``row`` (rejecting it if a row of the table was bad)."""
        row["label"], row["pin"] = self.label, self.pin
        if task != SINGLE_LABEL:
            row["labels"], row["boxes"] = self.labels, self.boxes
        row.update(self.kept)  # type: ignore[typeddict-item]
        if self.problem is not None and row["status"] == "ok":
            reject(row, self.problem)


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _spelled(label: str | None, channel: str | None, kept: dict[str, Any]) -> str:
    text = label if label is not None else "(labels)"
    text = text if channel is None else f"{text} (channel {channel})"
    return f"{text} {_text(kept)}" if kept else text


def combine(rows: Sequence[dict[str, Any]], columns: TableColumns) -> KeyLabels:
    """The labels of one key from its staged table rows (at least one), for ``columns.task``
    (a task other than ``single-label`` or ``boxes`` is ``multi-label``)."""
    unique = {_text(r): r for r in rows}
    distinct = [unique[k] for k in sorted(unique)]
    kept = [{c: r.get(c) for c in columns.keep} for r in distinct]
    if columns.task == SINGLE_LABEL:
        ways = {
            _text([r["label"], r["channel"], k]): (r["label"], r["channel"], k)
            for r, k in zip(distinct, kept)
        }
        first = min(ways.values(), key=lambda w: (w[0], w[1] or ""))
        spelled = tuple(sorted(_spelled(*w) for w in ways.values())) if len(ways) > 1 else ()
        return KeyLabels(label=first[0], pin=first[1], kept=first[2], ways=spelled)
    pins = sorted({r["channel"] or "" for r in distinct})
    values = {_text(k): k for k in kept}
    spelled = tuple(sorted({_spelled(None, r["channel"], k) for r, k in zip(distinct, kept)}))
    conflict = spelled if len(pins) > 1 or len(values) > 1 else ()
    problems = sorted(r["problem"] for r in distinct if r.get("problem"))
    if columns.task == BOXES:
        boxes = [b for r in distinct for b in r.get("boxes") or ()]
        labels = sorted({b["label"] for b in boxes})
        return KeyLabels(None, pins[0] or None, labels, boxes, kept[0], (problems or [None])[0], conflict)
    lists = [r for r in distinct if r.get("labels") is not None]
    if lists and len(lists) < len(distinct) and not problems:
        problems = ["mixed labels: a 'labels' list in one row and a single 'label' in another; give one form"]
    given = (r["labels"] if r.get("labels") is not None else [r["label"]] for r in distinct)
    labels = sorted({x for names in given for x in names if x is not None})
    return KeyLabels(None, pins[0] or None, labels, None, kept[0], (problems or [None])[0], conflict)
