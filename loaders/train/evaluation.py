"""Accuracy over a whole evaluation channel: each rank scores its share, the counts are summed
over the ranks (:func:`evaluate`), top-1 and per class (:class:`Accuracy`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.batch import PAD_LABEL
from loaders.train.world import World, all_reduce

__all__ = ["Accuracy", "ClassAccuracy", "evaluate"]


@dataclass(frozen=True, slots=True)
class ClassAccuracy:
    """One class's rows of a channel and how many the model labelled right."""

    name: str
    index: int
    correct: int
    count: int

    @property
    def accuracy(self) -> float | None:
        """``correct / count``; None for a class without rows."""
        return self.correct / self.count if self.count else None


@dataclass(frozen=True, slots=True)
class Accuracy:
    """A channel's accuracy over every rank: per class, by label index, and top-1."""

    per_class: tuple[ClassAccuracy, ...]

    @property
    def top1(self) -> float | None:
        """The share of the channel's rows labelled right; None for a channel without rows."""
        total = sum(c.count for c in self.per_class)
        return sum(c.correct for c in self.per_class) / total if total else None

    def to_json(self) -> dict[str, Any]:
        """As ``metrics.json`` has it: ``{"top1", "per_class": {name: {"index", "correct",
        "count", "accuracy"}}}`` (an accuracy over no rows is ``null``)."""
        per_class = {
            c.name: {"index": c.index, "correct": c.correct, "count": c.count, "accuracy": c.accuracy}
            for c in self.per_class
        }
        return {"top1": self.top1, "per_class": per_class}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],  # a ShardLoader, or a Concatenated one
    world: World,
    class_names: tuple[str, ...],
    *,
    bf16: bool = False,
    stop: Callable[[], bool] | None = None,
) -> Accuracy | None:
    """Top-1 accuracy over the whole channel, and per class: each rank scores its share, the
    counts are summed. ``None`` if ``stop()`` (asked after each batch, on every rank: the loader
    yields as many batches on each) returned true."""
    model.eval()
    n = len(class_names)
    correct, count = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    for images, labels in loader:
        images = images.to(world.device, non_blocking=True)
        labels = labels.to(world.device, non_blocking=True)
        valid = labels != PAD_LABEL
        with world.autocast(bf16):
            pred = model(images).argmax(dim=1)
        truth = labels[valid]
        count += torch.bincount(truth, minlength=n).cpu()
        correct += torch.bincount(truth[pred[valid] == truth], minlength=n).cpu()
        if stop is not None and stop():
            return None
    totals = all_reduce([*correct.tolist(), *count.tolist()], world)
    per_class = (
        ClassAccuracy(name, i, correct=int(totals[i]), count=int(totals[n + i]))
        for i, name in enumerate(class_names)
    )
    return Accuracy(tuple(per_class))
