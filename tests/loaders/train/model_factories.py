"""Model factories for ``python -m loaders.train --model tests.loaders.train.model_factories:<name>``."""

from __future__ import annotations

import torch
from torch import nn


class _Linear(nn.Module):
    def __init__(self, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def linear(num_classes: int, image_size: int) -> nn.Module:
    return _Linear(num_classes, image_size)


class _Always(nn.Module):
    """Predicts class ``k`` for every image, whatever it learns (its weight does not reach the
    output); the weight is there so that the optimiser has a parameter."""

    def __init__(self, num_classes: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.register_buffer("logits", torch.nn.functional.one_hot(torch.tensor(k), num_classes).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1) + 0 * self.weight + 0 * x.float().mean()


def always_class_1(num_classes: int, image_size: int) -> nn.Module:
    return _Always(num_classes, 1)


def not_a_module(num_classes: int, image_size: int) -> list[int]:
    return [num_classes, image_size]


def needs_rgb_size_32(num_classes: int, image_size: int) -> nn.Module:
    if image_size != 32:
        raise ValueError(f"this network is for 32x32 images,\nnot {image_size}x{image_size}")
    return linear(num_classes, image_size)


NOT_CALLABLE = 3


#: The dtypes :func:`dtype_probe` models' outputs had (a test clears and reads it).
SEEN_DTYPES: set[torch.dtype] = set()


class _Probe(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        SEEN_DTYPES.add(out.dtype)
        return out


def dtype_probe(num_classes: int, image_size: int) -> nn.Module:
    return _Probe(num_classes, image_size)


# Factories whose models do not fit the data (the trainer's dry forward pass refuses them).
def for_32px_images(num_classes: int, image_size: int) -> nn.Module:
    """Builds for any size but expects 32x32 inputs: the first batch of another size fails."""
    return _Linear(num_classes, 32)


class _Mean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3))).squeeze(1)  # [B]: one score, not one per class


def one_score_per_image(num_classes: int, image_size: int) -> nn.Module:
    return _Mean()


class _Pair(_Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return out, out.softmax(dim=1)


def logits_and_probabilities(num_classes: int, image_size: int) -> nn.Module:
    return _Pair(num_classes, image_size)


class _Fixed(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], self.num_classes)


def no_parameters(num_classes: int, image_size: int) -> nn.Module:
    return _Fixed(num_classes)


def three_classes_too_many(num_classes: int, image_size: int) -> nn.Module:
    """``[B, num_classes + 3]`` logits: cross-entropy accepts them, training would run."""
    return _Linear(num_classes + 3, image_size)
