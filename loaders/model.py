"""The trainer's model: a small CNN sized for the dataset's image size (the default), or the
user's own, named ``package.module:factory`` (:func:`build_model`)."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

from torch import Tensor, nn

from lakeshard.errors import ConfigError

__all__ = ["MODEL_SPEC", "SmallCNN", "build_model"]

#: The form of ``--model``: a dotted module path, a colon, a dotted attribute path.
MODEL_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_factory(spec: str) -> Callable[..., object]:
    where = f"--model {spec!r}"
    if not MODEL_SPEC.fullmatch(spec):
        raise ConfigError(f"{where}: expected package.module:factory, a callable (num_classes, image_size) -> torch.nn.Module")
    module_name, attr = spec.split(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{where}: cannot import {module_name}: {_one_line(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {module_name}.{attr} is not callable (it is a {type(obj).__name__})")
    return obj


def build_model(spec: str | None, num_classes: int, image_size: int, *, width: int = 32) -> nn.Module:
    """The model ``--model spec`` names: ``factory(num_classes, image_size)`` for
    ``package.module:factory``; :class:`SmallCNN` (of ``width``) when ``spec`` is ``None``.

    Raises:
        ConfigError: naming ``spec``, when it is malformed, the import fails, the factory
            raises, or what it returns is not a ``torch.nn.Module``.
    """
    if spec is None:
        return SmallCNN(num_classes, image_size, width=width)
    factory = _load_factory(spec)
    call = f"{spec.split(':')[1]}({num_classes}, {image_size})"
    try:
        model = factory(num_classes, image_size)
    except Exception as exc:
        raise ConfigError(f"--model {spec!r}: {call} failed: {_one_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r}: {call} returned a {type(model).__name__}, not a torch.nn.Module")
    return model
