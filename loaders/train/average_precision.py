"""Average precision over a whole multi-label evaluation channel: each rank counts its rows'
scores into bins per class, the counts are summed over the ranks, and each class's average
precision is read off the summed counts (:func:`evaluate_multi_label`, :class:`AveragePrecision`).

Binned, so that ranks add counts instead of gathering every score: the precision-recall curve
has a point per bin of sigmoid scores (:data:`BINS` of them, ``1 / BINS`` wide); rows whose
scores share a bin count as tied."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.named_batch import Batch
from loaders.train.world import World, all_reduce

__all__ = ["BINS", "AveragePrecision", "ClassPrecision", "average_precision", "evaluate_multi_label"]

#: Score bins of the precision-recall curve.
BINS = 1000


@dataclass(frozen=True, slots=True)
class ClassPrecision:
    """One class of a multi-label channel: its rows labelled with it and its average precision."""

    name: str
    index: int
    positives: int
    average_precision: float | None  #: None for a class no row has


@dataclass(frozen=True, slots=True)
class AveragePrecision:
    """A multi-label channel's average precision over every rank, per class and their mean."""

    per_class: tuple[ClassPrecision, ...]

    @property
    def mean(self) -> float | None:
        """The mean over the classes some row has (None: no row has any)."""
        values = [c.average_precision for c in self.per_class if c.average_precision is not None]
        return sum(values) / len(values) if values else None

    def to_json(self) -> dict[str, Any]:
        """As ``metrics.json`` has it: ``{"mean_average_precision", "per_class": {name: {"index",
        "positives", "average_precision"}}}``."""
        per_class = {
            c.name: {"index": c.index, "positives": c.positives, "average_precision": c.average_precision}
            for c in self.per_class
        }
        return {"mean_average_precision": self.mean, "per_class": per_class}


def average_precision(positives: torch.Tensor, negatives: torch.Tensor) -> float | None:
    """The average precision of one class from its rows counted by score bin (bin ``k``: scores
    in ``[k / BINS, (k + 1) / BINS)``): the sum over thresholds, highest first, of precision
    times the recall gained. None without positives."""
    total = float(positives.sum())
    if total == 0:
        return None
    tp = positives.flip(0).cumsum(0).double()
    fp = negatives.flip(0).cumsum(0).double()
    gained = positives.flip(0).double() / total
    precision = tp / (tp + fp).clamp(min=1)
    return float((precision * gained).sum())


@torch.no_grad()
def evaluate_multi_label(
    model: nn.Module,
    loader: Iterable[Batch],
    world: World,
    class_names: tuple[str, ...],
    *,
    bf16: bool = False,
    stop: Callable[[], bool] | None = None,
) -> AveragePrecision | None:
    """Average precision per class and its mean over the whole channel of a multi-label
    dataset's loader: each rank counts its valid rows, the counts are summed. ``None`` if
    ``stop()`` (asked after each batch, on every rank) returned true."""
    model.eval()
    n = len(class_names)
    positives = torch.zeros((n, BINS), dtype=torch.int64)
    negatives = torch.zeros((n, BINS), dtype=torch.int64)
    for batch in loader:
        images = batch.images.to(world.device, non_blocking=True)
        with world.autocast(bf16):
            logits = model(images)
        scores = torch.sigmoid(logits.float()).cpu()[batch.valid]
        bins = (scores * BINS).long().clamp(0, BINS - 1)
        truth = batch.labels[batch.valid] > 0
        for c in range(n):
            positives[c] += torch.bincount(bins[truth[:, c], c], minlength=BINS)
            negatives[c] += torch.bincount(bins[~truth[:, c], c], minlength=BINS)
        if stop is not None and stop():
            return None
    totals = all_reduce([*positives.flatten().tolist(), *negatives.flatten().tolist()], world)
    counts = torch.tensor(totals, dtype=torch.int64).view(2, n, BINS)
    per_class = (
        ClassPrecision(name, c, int(counts[0, c].sum()), average_precision(counts[0, c], counts[1, c]))
        for c, name in enumerate(class_names)
    )
    return AveragePrecision(tuple(per_class))
