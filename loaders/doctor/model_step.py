"""The model's training step alone (random batches, no loader), and every stage together: a
``ShardLoader`` with the transform feeding that step, or a loop that only takes its batches.

The step is the trainer's: forward, cross-entropy (``PAD_LABEL`` rows ignored; a multi-label
dataset's multi-hot labels: binary cross-entropy on the logits), backward, SGD step; images arrive as the loader gives them (uint8, made float32 in [-1, 1] on the device) or
as the transform made them (a floating-point tensor is used as it is).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loaders.doctor.figures import ModelFigures, TogetherFigures
from loaders.doctor.measure import timed_batches
from loaders.named_batch import Batch
from loaders.shard_loader import ShardLoader
from loaders.transforms import Transform

__all__ = ["WARMUP_STEPS", "ModelStep", "measure_model", "measure_together"]

#: Untimed steps before the model's timing (cuDNN's choices, the allocator, the first launches).
WARMUP_STEPS = {"cpu": 2, "cuda": 5}


class ModelStep:
    """One SGD step of ``model`` on a batch, on CUDA when available (else the CPU)."""

    def __init__(self, model: nn.Module) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        if self.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # Module.to takes it; torch's overloads omit it
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.to(self.device, non_blocking=True)
        if not x.is_floating_point():
            x = x.float().div_(127.5).sub_(1)
        if self.device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        y = labels.to(self.device, non_blocking=True)
        logits = self.model(x)
        loss = (
            F.binary_cross_entropy_with_logits(logits, y)
            if y.is_floating_point()
            else F.cross_entropy(logits, y)
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure_model(
    step: ModelStep,
    *,
    input_shape: tuple[int, ...],
    batch_size: int,
    num_classes: int,
    seconds: float,
    multi_hot: bool = False,
) -> ModelFigures:
    """Stage 4: ``step`` on one random uint8 batch of ``[batch_size, *input_shape]`` (random
    labels; ``multi_hot``: a multi-label dataset's, float32 ``[batch_size, num_classes]``) for
    ``seconds``, after :data:`WARMUP_STEPS` (two timed steps at least)."""
    images = torch.randint(0, 256, (batch_size, *input_shape), dtype=torch.uint8)
    if step.device.type == "cuda":
        images = images.pin_memory()
    labels = torch.randint(0, num_classes, (batch_size,), dtype=torch.int64)
    if multi_hot:
        labels = torch.randint(0, 2, (batch_size, num_classes)).float()
    warmup = WARMUP_STEPS[step.device.type]
    for _ in range(warmup):
        step(images, labels)
    step.sync()
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while steps < 2 or time.perf_counter() < deadline:
        step(images, labels)
        steps += 1
        if step.device.type == "cuda" and steps % 8 == 0:
            step.sync()  # keep the clock honest: the queue must not run far ahead of it
    step.sync()
    elapsed = time.perf_counter() - start
    return ModelFigures(
        device=_device_name(step.device),
        input_shape=(batch_size, *input_shape),
        steps=steps,
        images=steps * batch_size,
        seconds=elapsed,
        warmup_steps=warmup,
    )


def _device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})"


def _images_labels(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(images, labels)`` of a batch the loader yielded, if it is that (a
    :class:`~loaders.Batch`: its images and multi-hot labels)."""
    if isinstance(batch, Batch) and isinstance(batch.images, torch.Tensor):
        return batch.images, batch.labels
    if (
        isinstance(batch, tuple | list)
        and len(batch) == 2
        and all(isinstance(t, torch.Tensor) for t in batch)
    ):
        return batch[0], batch[1]
    return None


def _rows(batch: Any, default: int) -> int:
    if isinstance(batch, Batch):
        return len(batch.valid)
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    return default


def measure_together(
    dataset: str,
    options: dict[str, Any],
    *,
    transform: Transform | None,
    step: ModelStep | None,
    seconds: float,
) -> TogetherFigures:
    """Stage 5: a fresh ``ShardLoader(dataset, **options)`` with the transform, its batches fed to
    ``step`` (or only taken, without one) for ``seconds``; the time spent in ``next()`` is the
    wait for data."""
    images = batches = first_images = 0
    wait = first = 0.0
    with ShardLoader(dataset, transform=transform, **options) as loader:
        batch_size = loader.options.batch_size
        start = time.perf_counter()
        it = timed_batches(loader, seconds)
        while True:
            asked = time.perf_counter()
            batch = next(it, None)
            got = time.perf_counter()
            wait += got - asked
            if batch is None:
                break
            rows = _rows(batch, batch_size)
            if batches == 0:
                first, first_images = got - start, rows
            batches += 1
            images += rows
            if step is not None and (pair := _images_labels(batch)) is not None:
                step(*pair)
        if step is not None:
            step.sync()
        elapsed = time.perf_counter() - start
    return TogetherFigures(
        images=images,
        batches=batches,
        seconds=elapsed,
        wait_s=wait,
        first_batch_s=first,
        first_images=first_images,
        with_model=step is not None,
    )
