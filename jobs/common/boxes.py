"""Boxes moved with their image: where :func:`~jobs.common.images.preprocess` puts a source
pixel (:func:`geometry`), and a row's boxes scaled, shifted and clipped to match
(:func:`move_boxes`). The shard job, for a ``boxes`` dataset (docs/design/0045-shard-job-labels.md).

A box is in pixels of the source image *as displayed*, EXIF orientation applied (what an
annotator sees: SageMaker Ground Truth draws on the oriented image), ``x``/``y`` its top left
corner; coordinates are continuous, the top left corner of the top left pixel at (0, 0).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from PIL import Image

from jobs.common.images import ImageSpec, _target_box

__all__ = [
    "MIN_SIDE",
    "OUTSIDE",
    "TOO_SMALL",
    "TRANSPOSED",
    "Geometry",
    "geometry",
    "move_boxes",
    "orientation",
]

#: A moved box narrower or lower than this many pixels is dropped (:data:`TOO_SMALL`).
MIN_SIDE = 0.1
#: Why a box is dropped: the crop left it no area.
OUTSIDE = "outside the crop"
#: Why a box is dropped: resized under :data:`MIN_SIDE` pixels wide or high.
TOO_SMALL = "under a tenth of a pixel"

#: EXIF orientations that swap width and height (a transpose or a quarter turn).
TRANSPOSED = frozenset({5, 6, 7, 8})
_ORIENTATION = 0x0112


class Geometry(NamedTuple):
    """A source point ``(x, y)`` lands at ``(x * scale_x + shift_x, y * scale_y + shift_y)`` of
    the stored image, ``width`` by ``height`` pixels."""

    scale_x: float
    scale_y: float
    shift_x: float
    shift_y: float
    width: int
    height: int


def _draft_scale(img: Image.Image, spec: ImageSpec) -> int:
    """The 1/n at which :func:`~jobs.common.images.preprocess` decodes ``img`` (a JPEG's DCT
    scaling, its ``draft`` with the same request), 1 for a full decode."""
    w, h = img.size
    short = min(w, h)
    if img.format != "JPEG" or spec.resize == "pad" or short <= 2 * spec.size:
        return 1
    f = spec.size / short
    drafted = img.draft("RGB", (max(1, int(w * f) + 1), max(1, int(h * f) + 1)))
    return 1 if drafted is None else round(w / drafted[1][2])


def orientation(img: Image.Image, data: bytes) -> int:
    """The EXIF orientation ``preprocess`` applies to ``img`` (opened from ``data``), without
    decoding it: Pillow's PNG reader decodes the whole image to look for an ``eXIf`` chunk
    after the pixels, so a PNG whose bytes hold no such chunk type is taken as upright at once."""
    if img.format == "PNG" and "exif" not in img.info and b"eXIf" not in data:
        return 1
    return int(img.getexif().get(_ORIENTATION, 1))


def geometry(data: bytes, spec: ImageSpec) -> Geometry:
    """Where :func:`~jobs.common.images.preprocess` moves the pixels of the image ``data``
    (which it accepted) as ``spec`` says, read from the image's header alone: the decoded size
    (a JPEG's DCT scaling included), the EXIF orientation, then the resize's source box and
    output size (``images._target_box``) and a padded image's offset."""
    with Image.open(io.BytesIO(data)) as img:
        n = _draft_scale(img, spec)  # img.size is now the decoded size
        w, h = img.size
        if orientation(img, data) in TRANSPOSED:
            w, h = h, w
    (ow, oh), (left, top, right, bottom) = _target_box(w, h, spec)
    sx, sy = ow / (right - left), oh / (bottom - top)
    dx = dy = 0
    if spec.resize == "pad" and (ow, oh) != (spec.size, spec.size):
        dx, dy = (spec.size - ow) // 2, (spec.size - oh) // 2
    return Geometry(sx / n, sy / n, dx - left * sx, dy - top * sy, spec.size, spec.size)


def move_boxes(
    boxes: Sequence[Mapping[str, Any]], where: Geometry
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """``boxes`` (source pixels) in pixels of the stored image: scaled, shifted, clipped to
    it; those left without area (:data:`OUTSIDE`) or under :data:`MIN_SIDE` (:data:`TOO_SMALL`)
    dropped and counted by reason."""
    kept: list[dict[str, Any]] = []
    dropped: Counter[str] = Counter()
    for box in boxes:
        x0 = min(max(box["x"] * where.scale_x + where.shift_x, 0.0), where.width)
        y0 = min(max(box["y"] * where.scale_y + where.shift_y, 0.0), where.height)
        x1 = min(max((box["x"] + box["width"]) * where.scale_x + where.shift_x, 0.0), where.width)
        y1 = min(max((box["y"] + box["height"]) * where.scale_y + where.shift_y, 0.0), where.height)
        if x1 <= x0 or y1 <= y0:
            dropped[OUTSIDE] += 1
        elif x1 - x0 < MIN_SIDE or y1 - y0 < MIN_SIDE:
            dropped[TOO_SMALL] += 1
        else:
            kept.append({**box, "x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0})
    return kept, dropped
