"""Rows whose labels are more than one class, as the manifest job's passes handle them: a row's
classes, its class indices, and the counts per channel and label the split made
(:mod:`lakeshard.format.label_columns` says what the columns hold)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.manifest_steps.listing import LabelledRow, StagedRow

__all__ = ["WrittenCounts", "index_labels", "row_labels", "written_counts"]


def row_labels(row: Mapping[str, Any]) -> list[str]:
    """The classes of an accepted row: its ``labels`` (a ``multi-label`` or ``boxes`` row),
    else its one ``label``."""
    labels = row.get("labels")
    return list(labels) if labels is not None else [row["label"]]


@dataclass(frozen=True, slots=True)
class WrittenCounts:
    """The accepted images per channel, and per channel each label's images (an image with
    several labels counts once for each), as
    :func:`jobs.manifest_steps.passes.class_task` wrote them."""

    images: dict[str, int] = field(default_factory=dict)
    classes: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def merge(cls, parts: Iterable[WrittenCounts]) -> WrittenCounts:
        images: Counter[str] = Counter()
        classes: dict[str, Counter[str]] = defaultdict(Counter)
        for p in parts:
            images.update(p.images)
            for channel, counts in p.classes.items():
                classes[channel].update(counts)
        return cls(images=dict(images), classes={c: dict(n) for c, n in classes.items()})


def index_labels(row: LabelledRow, labels: Mapping[str, int]) -> None:
    """Give an accepted row its class indices: ``label_index``, or ``label_indices`` and each
    box's ``label_index``."""
    names = row.get("labels")
    if names is None:
        row["label_index"] = labels[row["label"]]
        return
    row["label_indices"] = [labels[label] for label in names]
    for box in row.get("boxes") or ():
        box["label_index"] = labels[box["label"]]


def written_counts(ok: Sequence[StagedRow], channels: Iterable[str]) -> WrittenCounts:
    """The images per channel and, per channel, each label's images, as written."""
    images = Counter(r["channel"] for r in ok)
    classes: dict[str, Counter[str]] = {c: Counter() for c in channels}
    for r in ok:
        classes[r["channel"]].update(row_labels(r))
    return WrittenCounts(images=dict(images), classes={c: dict(n) for c, n in classes.items()})
