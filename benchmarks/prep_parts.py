"""The preparation cluster benchmark's transform (``prep_bench.py``): imported by reference on
the cluster's workers, so it lives in a module of its own (not the script's ``__main__``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Blur passes of :func:`heavy` per batch: its CPU per image (calibrated by prep_bench.py's
#: report, which prints it beside the model step's).
PASSES = 3


def heavy(
    images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A RandAugment-like cost on one thread: float conversion, a random brightness and contrast
    per image, and ``PASSES`` 5x5 blurs of the whole batch; back to uint8."""
    x = images.float()
    n = len(x)
    gain = 0.8 + 0.4 * torch.rand((n, 1, 1, 1), generator=generator)
    bias = torch.randint(-16, 17, (n, 1, 1, 1), generator=generator).float()
    x = x * gain + bias
    kernel = torch.full((3, 1, 5, 5), 1 / 25.0)
    for _ in range(PASSES):
        x = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), kernel, groups=3)
    return x.clamp(0, 255).to(torch.uint8).contiguous(memory_format=torch.channels_last), labels
