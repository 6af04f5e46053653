"""The trainer's model: a small CNN sized for the dataset's image size (the default), or the
user's own, named ``package.module:factory`` (:func:`build_model`)."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lakeshard.errors import ConfigError

__all__ = ["MODEL_SPEC", "SmallCNN", "build_model", "check_model", "describe", "load_weights"]

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
            layers += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
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
        raise ConfigError(
            f"{where}: expected package.module:factory, a callable (num_classes, image_size) -> torch.nn.Module"
        )
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
        raise ConfigError(
            f"--model {spec!r}: {call} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


#: The rows of the batch :func:`check_model` passes through the model.
_DRY_BATCH = 2


def check_model(
    model: nn.Module,
    spec: str | None,
    num_classes: int,
    image_size: int,
    *,
    width: int = 32,
    bf16: bool = False,
) -> None:
    """Check that ``model`` fits the data before any training: it has trainable parameters, and
    one forward pass on a float32 ``[2, 3, image_size, image_size]`` batch (the loader's images)
    returns ``[2, num_classes]`` floating-point logits. The pass runs where the weights are (the
    CPU, unless the factory moved them), under bfloat16 autocast with ``bf16`` (as training
    will), in eval mode, without gradients and with the CPU's random state restored afterwards:
    the model is left as it was.

    Raises:
        ConfigError: naming the model (:func:`describe`) and what did not fit.
    """
    where = describe(spec, width=width)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{where}: the model has no trainable parameters: there is nothing to train")
    shape = [_DRY_BATCH, 3, image_size, image_size]
    batch = f"a float32 [{', '.join(map(str, shape))}] batch"
    expected = (
        f"logits of shape [{_DRY_BATCH}, {num_classes}] (batch, classes: the dataset has {num_classes})"
    )
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=[]),
            torch.autocast(device.type, torch.bfloat16, enabled=bf16),
        ):
            out = model(torch.zeros(shape, device=device))
    except Exception as exc:
        raise ConfigError(
            f"{where}: a forward pass on {batch} (the dataset's image size) failed: {_one_line(exc)}"
        ) from None
    finally:
        model.train(training)
    if not isinstance(out, Tensor):
        raise ConfigError(
            f"{where}: the model returned a {type(out).__name__} for {batch}; expected a tensor of {expected}"
        )
    if list(out.shape) != [_DRY_BATCH, num_classes]:
        raise ConfigError(
            f"{where}: the model returned a tensor of shape [{', '.join(map(str, out.shape))}] for {batch}; "
            f"expected {expected}"
        )
    if not out.is_floating_point():
        raise ConfigError(
            f"{where}: the model returned a {out.dtype} tensor for {batch}; "
            f"expected floating-point {expected}"
        )


def describe(spec: str | None, *, width: int) -> str:
    """How error messages name the model: ``--model 'pkg.mod:f'`` or ``the small CNN (--width 32)``."""
    return f"the small CNN (--width {width})" if spec is None else f"--model {spec!r}"


def load_weights(model: nn.Module, weights: dict[str, Tensor], *, source: str, name: str) -> None:
    """Load a checkpoint's ``weights`` (from ``source``) into ``model`` (named ``name``, as
    :func:`describe` does).

    Raises:
        ConfigError: the weights do not fit the model (missing or unexpected keys, other
            shapes): a checkpoint of another network.
    """
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"--resume: the checkpoint {source} does not fit {name}: {_one_line(exc)}"
        ) from None
