"""The per-image work every tool of the jobs benchmark does (``jobs_run.py``): the shard job's
``jobs.common.images.preprocess`` for the raw lake's JPEGs, with its default ``crop`` resize, as
JPEG, written with Pillow alone so that it imports in every peer's environment (which do not have
this project). Same Pillow, same bytes: ``tests/benchmarks/test_per_image.py`` holds the two
equal; a change to the shard job's preprocessing shows there.

What it leaves out, because the lake has none of it: rejection (bombs, undecodable objects) and
the modes other than a JPEG's (grey, RGB, CMYK: each becomes RGB as the shard job converts it).
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps

__all__ = ["prepare"]


def prepare(data: bytes, size: int, quality: int) -> bytes:
    """``data`` (a JPEG) decoded, turned upright by its EXIF orientation, converted to RGB, its
    center square resized to ``size`` px (bilinear) and encoded as a JPEG at ``quality``."""
    img: Image.Image = Image.open(io.BytesIO(data))
    w, h = img.size
    if img.format == "JPEG" and min(w, h) > 2 * size:
        # The shard job's DCT scaling while decoding (Pillow's draft), the same target box.
        f = size / min(w, h)
        img.draft("RGB", (max(1, int(w * f) + 1), max(1, int(h * f) + 1)))
    img.load()
    img = ImageOps.exif_transpose(img)
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    side = min(w, h)
    left, top = (w - side) / 2, (h - side) / 2
    img = img.resize(
        (size, size), Image.Resampling.BILINEAR, box=(left, top, left + side, top + side), reducing_gap=None
    )
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()
