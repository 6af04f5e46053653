"""Batch transforms: functions a :class:`~loaders.ShardLoader` runs on its decode threads.

A transform is any callable ``fn(images, labels, generator)``:

- ``images``: the decoded batch, uint8 ``[B, 3, H, W]`` (in ``torch.channels_last`` memory
  format); the loader owns it, so a transform may change it in place;
- ``labels``: int64 ``[B]`` (rows that must not count are :data:`~loaders.PAD_LABEL`); for a
  multi-label or boxes dataset, the batch's :class:`~loaders.Batch` (its targets: multi-hot
  labels, boxes, kept columns), which the transform returns in its place (``(images, batch)``),
  with its boxes moved if it moved the pixels (:meth:`~loaders.Batch.cropped`,
  :meth:`~loaders.Batch.flipped`);
- ``generator``: a CPU :class:`torch.Generator` seeded from ``(seed, epoch, rank, batch
  index)``; draw every random number from it (``torch.rand(..., generator=generator)``) and
  the batch is augmented alike whichever thread runs it, and a resumed run augments exactly
  as an uninterrupted one.

It returns what the loader yields for the batch (the transforms here return
``(images, labels)``). An exception it raises reaches the training loop as a
:class:`~lakeshard.errors.LoaderError` naming the shards and rows of the batch.

The transforms here take and return uint8 images, except :class:`Normalize` (float32 out),
which goes last. :func:`default_transform` builds the loader's ``augment``/``crop``/``normalize``
options out of them. :class:`CenterCrop` and :class:`RandomFlipCrop` move a batch's boxes with
its pixels, and so does :class:`RandomResizedCrop` (scaled with the window).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lakeshard.errors import ConfigError
from lakeshard.settings import check_positive
from loaders.named_batch import Batch

__all__ = [
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "Labels",
    "Normalize",
    "RandomFlipCrop",
    "RandomResizedCrop",
    "Transform",
    "batch_generator",
    "check_mean_std",
    "default_transform",
]

#: ``fn(images, labels, generator) -> anything`` (the transforms here return ``(images, labels)``).
Transform = Callable[[torch.Tensor, Any, torch.Generator], Any]
#: What a transform gets beside the images: int64 labels ``[B]``, or a multi-label or boxes
#: dataset's :class:`~loaders.Batch`.
Labels = torch.Tensor | Batch


def batch_generator(seed: int, epoch: int, rank: int, index: int) -> torch.Generator:
    """The generator handed to the transform of batch ``index``: seeded from all four numbers
    (mixed by :class:`numpy.random.SeedSequence`, so nearby keys give unrelated streams)."""
    state = np.random.SeedSequence([seed, epoch, rank, index]).generate_state(1, np.uint64)[0]
    generator = torch.Generator()
    generator.manual_seed(int(state))
    return generator


def check_mean_std(
    mean: Any, std: Any, *, what: str, where: str = ""
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of :class:`Normalize` as two tuples of 3 floats, one per RGB channel:
    finite numbers, every std positive; else a :class:`ConfigError` naming ``what`` (``"normalize"``),
    the bad part and its value, followed by ``where`` (the whole value, say)."""
    out = []
    for part, value in (("mean", mean), ("std", std)):
        try:
            items = tuple(value) if not isinstance(value, str | bytes) else None
        except TypeError:
            items = None
        if items is None or len(items) != 3 or not all(_is_number(v) for v in items):
            raise ConfigError(f"{what} {part} must be 3 numbers (one per RGB channel), got {value!r}{where}")
        if not all(math.isfinite(v) for v in items):
            raise ConfigError(f"{what} {part} must be finite, got {value!r}{where}")
        out.append(tuple(float(v) for v in items))
    if any(s <= 0 for s in out[1]):
        raise ConfigError(f"{what} std must be positive (images are divided by it), got {std!r}{where}")
    return out[0], out[1]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    check_positive(name, value, error=ConfigError)
    return value


def _nhwc(images: torch.Tensor) -> np.ndarray:
    """The ``[B, H, W, 3]`` numpy view of a CPU ``[B, 3, H, W]`` batch (a copy unless it is
    channels_last, as the loader's are). Per-image slicing is far cheaper in numpy than in torch."""
    return images.permute(0, 2, 3, 1).contiguous().numpy()


def _crop(images: torch.Tensor, size: int, ys: Sequence[int], xs: Sequence[int]) -> torch.Tensor:
    """Image ``i``'s ``size`` x ``size`` window at ``(ys[i], xs[i])``, channels_last."""
    src = _nhwc(images)
    out = np.empty((src.shape[0], size, size, src.shape[3]), dtype=src.dtype)
    for i, (y, x) in enumerate(zip(ys, xs, strict=True)):
        out[i] = src[i, y : y + size, x : x + size]
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def _check_fits(images: torch.Tensor, size: int, what: str) -> None:
    if images.shape[-1] < size or images.shape[-2] < size:
        raise ValueError(
            f"{what}: crop size {size} is larger than the images ({images.shape[-2]}x{images.shape[-1]})"
        )


class Compose:
    """Run ``transforms`` in turn, each on the ``(images, labels)`` the previous one returned,
    all with the same generator."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)
        for t in self.transforms:
            if not callable(t):
                raise ConfigError(f"Compose takes callables fn(images, labels, generator), got {t!r}")

    def __call__(self, images: torch.Tensor, labels: Labels, generator: torch.Generator) -> Any:
        for t in self.transforms:
            images, labels = t(images, labels, generator)
        return images, labels

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class CenterCrop:
    """The central ``size`` x ``size`` window of every image (offset ``(H - size) // 2``)."""

    def __init__(self, size: int) -> None:
        self.size = _positive_int("CenterCrop size", size)

    def __call__(
        self, images: torch.Tensor, labels: Labels, generator: torch.Generator
    ) -> tuple[torch.Tensor, Labels]:
        c = self.size
        _check_fits(images, c, "CenterCrop")
        n, y, x = images.shape[0], (images.shape[-2] - c) // 2, (images.shape[-1] - c) // 2
        if isinstance(labels, Batch):
            labels = labels.cropped([y] * n, [x] * n, c)
        return _crop(images, c, [y] * n, [x] * n), labels

    def __repr__(self) -> str:
        return f"CenterCrop({self.size})"


class RandomFlipCrop:
    """A random ``size`` x ``size`` window of each image (every offset equally likely; none
    when ``size`` is ``None``), then a horizontal flip of each image with probability 1/2."""

    def __init__(self, size: int | None = None) -> None:
        self.size = None if size is None else _positive_int("RandomFlipCrop size", size)

    def __call__(
        self, images: torch.Tensor, labels: Labels, generator: torch.Generator
    ) -> tuple[torch.Tensor, Labels]:
        n = images.shape[0]
        if self.size is not None:
            c = self.size
            _check_fits(images, c, "RandomFlipCrop")
            ys = torch.randint(0, images.shape[-2] - c + 1, (n,), generator=generator).tolist()
            xs = torch.randint(0, images.shape[-1] - c + 1, (n,), generator=generator).tolist()
            images = _crop(images, c, ys, xs)
            if isinstance(labels, Batch):
                labels = labels.cropped(ys, xs, c)
        flip = (torch.rand(n, generator=generator) < 0.5).numpy()
        if isinstance(labels, Batch):
            labels = labels.flipped(flip, images.shape[-1])
        if flip.any():
            hwc = _nhwc(images)
            hwc[flip] = hwc[flip, :, ::-1]
            images = torch.from_numpy(hwc).permute(0, 3, 1, 2)
        return images, labels

    def __repr__(self) -> str:
        return f"RandomFlipCrop({self.size})"


class Normalize:
    """uint8 images to float32 ``(x / 255 - mean) / std``, per channel (``mean``, ``std`` on the
    0-1 scale); padding rows' labels are left as they are."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        mean, std = check_mean_std(mean, std, what="Normalize")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(
        self, images: torch.Tensor, labels: Labels, generator: torch.Generator
    ) -> tuple[torch.Tensor, Labels]:
        return images.to(torch.float32).div_(255.0).sub_(self.mean).div_(self.std), labels

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


class RandomResizedCrop:
    """A random window of each image covering ``scale`` of its area with aspect ratio in
    ``ratio`` (log-uniform), resized to ``size`` x ``size`` with bilinear interpolation; the
    whole batch in one ``grid_sample``. uint8 in, uint8 out."""

    def __init__(
        self,
        size: int,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.size = _positive_int("RandomResizedCrop size", size)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ConfigError(f"RandomResizedCrop scale must satisfy 0 < low <= high <= 1, got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ConfigError(f"RandomResizedCrop ratio must satisfy 0 < low <= high, got {ratio!r}")
        self.scale, self.ratio = scale, ratio

    def __call__(
        self, images: torch.Tensor, labels: Labels, generator: torch.Generator
    ) -> tuple[torch.Tensor, Labels]:
        n = images.shape[0]
        area = torch.empty(n).uniform_(*self.scale, generator=generator)
        log_ratio = torch.empty(n).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator
        )
        aspect = log_ratio.exp()
        # Window width and height as fractions of the image's (at most the whole image).
        w = (area * aspect).sqrt().clamp(max=1.0)
        h = (area / aspect).sqrt().clamp(max=1.0)
        # Window centres in [-1, 1] coordinates, anywhere the window fits.
        cx = (torch.rand(n, generator=generator) * 2 - 1) * (1 - w)
        cy = (torch.rand(n, generator=generator) * 2 - 1) * (1 - h)
        theta = torch.zeros(n, 2, 3)
        theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = w, cx, h, cy
        grid = F.affine_grid(theta, [n, 3, self.size, self.size], align_corners=False)
        out = F.grid_sample(
            images.to(torch.float32), grid, mode="bilinear", padding_mode="border", align_corners=False
        )
        if isinstance(labels, Batch):  # the window in pixels: [-1, 1] spans the image's edges
            width, height = images.shape[-1], images.shape[-2]
            xs, ys = ((cx - w + 1) / 2 * width).tolist(), ((cy - h + 1) / 2 * height).tolist()
            labels = labels.windowed(xs, ys, (w * width).tolist(), (h * height).tolist(), self.size)
        return out.round_().clamp_(0, 255).to(torch.uint8), labels

    def __repr__(self) -> str:
        return f"RandomResizedCrop({self.size}, scale={self.scale}, ratio={self.ratio})"


class ColorJitter:
    """Scale each image's brightness, contrast and saturation by factors drawn uniformly from
    ``[1 - b, 1 + b]`` (and likewise for ``c``, ``s``). uint8 in, uint8 out."""

    def __init__(self, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0) -> None:
        for name, value in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if not 0 <= value <= 1:
                raise ConfigError(f"ColorJitter {name} must be in [0, 1], got {value!r}")
        self.brightness, self.contrast, self.saturation = brightness, contrast, saturation

    def _factors(self, n: int, amount: float, generator: torch.Generator) -> torch.Tensor:
        return torch.empty(n, 1, 1, 1).uniform_(1 - amount, 1 + amount, generator=generator)

    def __call__(
        self, images: torch.Tensor, labels: Labels, generator: torch.Generator
    ) -> tuple[torch.Tensor, Labels]:
        n = images.shape[0]
        x = images.to(torch.float32)
        x = x * self._factors(n, self.brightness, generator)
        gray = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
        mean = gray.mean(dim=(2, 3), keepdim=True)
        x = mean + (x - mean) * self._factors(n, self.contrast, generator)
        gray = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
        x = gray + (x - gray) * self._factors(n, self.saturation, generator)
        return x.round_().clamp_(0, 255).to(torch.uint8), labels

    def __repr__(self) -> str:
        return f"ColorJitter(brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation})"


def default_transform(
    *, augment: bool, crop: int | None, normalize: tuple[Sequence[float], Sequence[float]] | None
) -> Compose | None:
    """The transform the loader's ``augment``, ``crop`` and ``normalize`` options stand for:
    a random crop and flip with ``augment`` (a centre crop without), then :class:`Normalize`;
    ``None`` when none is set."""
    steps: list[Transform] = []
    if augment:
        steps.append(RandomFlipCrop(crop))
    elif crop is not None:
        steps.append(CenterCrop(crop))
    if normalize is not None:
        steps.append(Normalize(*normalize))
    return Compose(steps) if steps else None
