"""``--transform package.module:name`` and ``--model package.module:factory``: imported, called
once and checked before anything is measured, each failure a :class:`ConfigError` naming the
flag and the value.

The model is built and checked by the trainer's own code (:mod:`loaders.train.model`); the doctor,
a command like the trainer, sits above the library (``tests/test_layering.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lakeshard.errors import ConfigError
from lakeshard.format.label_columns import BOXES
from loaders._internal.prep import resolve_reference
from loaders.named_batch import Batch
from loaders.train import model as train_model
from loaders.transforms import Transform, batch_generator

__all__ = ["REFERENCE", "build_model", "check_transform", "describe", "load_reference"]

#: ``package.module:name``: a dotted module path, a colon, a dotted attribute path (the trainer's
#: ``--model`` form).
REFERENCE = train_model.MODEL_SPEC

#: Rows of the batch the checks pass through the transform and the model.
_DRY_BATCH = 2


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_reference(spec: str, *, flag: str, expect: str) -> Callable[..., Any]:
    """The callable ``spec`` (``package.module:name``) names; ``expect`` says what it should be."""
    if not REFERENCE.fullmatch(spec):
        raise ConfigError(f"{flag} {spec!r}: expected package.module:name, {expect}")
    return resolve_reference(spec, what=flag)


def describe(value: Any) -> str:
    """``(uint8 [64, 3, 24, 24], int64 [64])``: a batch's tensors by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} [{', '.join(map(str, value.shape))}]"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


def _dry_labels(images: torch.Tensor, task: str | None, num_classes: int) -> Any:
    """What the loader hands a transform with ``images``: int64 labels, or a multi-label or
    boxes dataset's :class:`~loaders.Batch` (no class, no box)."""
    n = len(images)
    if task is None:
        return torch.zeros(n, dtype=torch.int64)
    boxes = task == BOXES
    return Batch(
        images,
        torch.zeros((n, num_classes), dtype=torch.float32),
        torch.ones(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        boxes=[torch.zeros((0, 4)) for _ in range(n)] if boxes else None,
        box_labels=[torch.zeros(0, dtype=torch.int64) for _ in range(n)] if boxes else None,
    )


def check_transform(
    name: str, transform: Transform, *, size: int, task: str | None = None, num_classes: int = 0
) -> tuple[int, ...] | None:
    """Run ``transform`` once on a uint8 ``[2, 3, size, size]`` batch (the loader's layout), with
    int64 labels, or a :class:`~loaders.Batch` for a ``task`` dataset of ``num_classes`` classes.

    Returns:
        The ``(C, H, W)`` of the images it returned when it returned ``(images, labels)``
        tensors (or ``(images, batch)``), else ``None`` (a model cannot be fed from it).
    """
    images = torch.zeros(_DRY_BATCH, size, size, 3, dtype=torch.uint8).permute(0, 3, 1, 2)
    labels = _dry_labels(images, task, num_classes)
    try:
        out = transform(images, labels, batch_generator(0, 0, 0, 0))
    except Exception as exc:
        raise ConfigError(
            f"{name}: it failed on a uint8 [{_DRY_BATCH}, 3, {size}, {size}] batch (the dataset's images): "
            f"{_one_line(exc)}"
        ) from None
    if out is None:
        raise ConfigError(f"{name}: it returned None; a transform returns what the loader yields")
    if (
        isinstance(out, tuple | list)
        and len(out) == 2
        and isinstance(out[0], torch.Tensor)
        and isinstance(out[1], torch.Tensor | Batch)
        and out[0].dim() == 4
        and out[0].shape[0] == _DRY_BATCH
    ):
        return tuple(out[0].shape[1:])
    return None


def build_model(spec: str, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``factory(num_classes, image_size)`` of ``--model spec``, built and checked as the trainer
    does (:mod:`loaders.train.model`: trainable parameters, one forward pass on a float32
    ``[2, 3, side, side]`` batch returning ``[2, num_classes]`` logits), ``side`` being the side
    of the images the transform makes (``input_shape``: their ``(C, H, W)``)."""
    if len(input_shape) != 3 or input_shape[0] != 3 or input_shape[1] != input_shape[2]:
        raise ConfigError(
            f"--model {spec!r}: the transform makes images of shape {list(input_shape)}; the model is "
            "checked (as the trainer checks it) on square RGB images [3, side, side]"
        )
    model = train_model.build_model(spec, num_classes, input_shape[-1])
    train_model.check_model(model, spec, num_classes, input_shape[-1])
    return model
