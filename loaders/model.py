"""The default model: a small CNN sized for the dataset's image size."""

from __future__ import annotations

import math

from torch import Tensor, nn

from lakeshard.errors import ConfigError

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """Conv-BN-ReLU blocks, each halving the resolution, until it is about 4x4; then global
    average pooling and a linear classifier. ``log2(image_size / 4)`` blocks (at least one),
    channels ``width, 2*width, ...`` capped at ``8*width``."""

    def __init__(self, num_classes: int, image_size: int, *, width: int = 32) -> None:
        super().__init__()
        if num_classes < 2:
            raise ConfigError(f"num_classes must be at least 2, got {num_classes!r}")
        if image_size < 2:
            raise ConfigError(f"image_size must be at least 2, got {image_size!r}")
        blocks = max(1, int(math.log2(max(image_size, 8) / 4)))
        layers: list[nn.Module] = []
        c_in = 3
        for b in range(blocks):
            c_out = width * min(2**b, 8)
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            layers.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
