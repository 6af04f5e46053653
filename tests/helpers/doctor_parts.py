"""Transforms and models whose cost is known, for ``python -m loaders.doctor --transform
tests.helpers.doctor_parts:burn`` (or ``:wait``, or ``:burn_boxes`` on a boxes dataset) and ``--model tests.helpers.doctor_parts:slow_model`` (with the
repository root on ``PYTHONPATH``)."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from loaders import Batch

#: burn: side of the matrices multiplied per image, and how many times. About 5 ms of CPU per
#: image (on one thread) on the 2-core CI machine.
_SIDE = 128
_ROUNDS = 30


def burn(
    images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real work per image: ``_ROUNDS`` products of a ``_SIDE`` x ``_SIDE`` matrix seeded from the
    batch's generator and the image's pixels; the images come back flipped by it (so the work
    is used)."""
    flip = _burnt(images, generator)
    images[flip] = images[flip].flip(-1)
    return images, labels


def burn_boxes(images: torch.Tensor, batch: Batch, generator: torch.Generator) -> tuple[torch.Tensor, Batch]:
    """:func:`burn` on a boxes dataset's batch: the images flipped with their boxes
    (``batch.flipped``); anything but a :class:`~loaders.Batch` with boxes fails."""
    if batch.boxes is None:
        raise TypeError(f"burn_boxes takes a boxes dataset's batch, got {batch!r}")
    flip = _burnt(images, generator)
    images[flip] = images[flip].flip(-1)
    return images, batch.flipped(flip.numpy(), images.shape[-1])


def _burnt(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The work of :func:`burn`: which images to flip."""
    n = images.shape[0]
    m = torch.rand(n, _SIDE, _SIDE, generator=generator)
    m += images[:, :, 0, 0].float().mean(dim=1)[:, None, None] / 255
    for _ in range(_ROUNDS):
        m = torch.tanh(torch.bmm(m, m) / _SIDE)
    return m[:, 0, 0] > m[:, 0, 1]


def wait(
    images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Waits 3 ms an image (as for I/O or a GPU sync) and computes nothing: the batch unchanged."""
    time.sleep(0.003 * images.shape[0])
    return images, labels


class _Slow(nn.Module):
    """A linear layer, ``rounds`` products with a ``width`` x ``width`` weight, a classifier:
    about 0.3 s an SGD step of 32 images on 2 CPU cores."""

    def __init__(self, num_classes: int, image_size: int, *, width: int = 2048, rounds: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, width)
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width))
        self.head = nn.Linear(width, num_classes)
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.flatten(1))
        for _ in range(self.rounds):
            h = torch.tanh(h @ self.weight)
        return self.head(h)


def slow_model(num_classes: int, image_size: int) -> nn.Module:
    return _Slow(num_classes, image_size)


def wrong_logits(num_classes: int, image_size: int) -> nn.Module:
    """Logits for one class more than the dataset has."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, num_classes + 1))


NOT_CALLABLE = 3
