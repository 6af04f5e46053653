"""Transforms a preparation cluster's workers import by reference (``tests.helpers.prep_parts:...``)."""

from __future__ import annotations

import torch


def jitter(
    images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random brightness shift per image, drawn from the loader's generator: the same batch
    index gives the same draws wherever it runs."""
    shift = torch.randint(-20, 21, (len(images), 1, 1, 1), generator=generator)
    return (images.to(torch.int16) + shift).clamp(0, 255).to(torch.uint8), labels
