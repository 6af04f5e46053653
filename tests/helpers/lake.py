"""Builders for raw lakes: tests make their own images, nothing binary is committed."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["bad_objects", "encode", "exif_rotated_jpeg", "make_image", "write_lake"]


def make_image(seed: int, *, size: tuple[int, int] = (48, 40), mode: str = "RGB") -> Image.Image:
    """A varied synthetic image (gradient + noise) whose content depends on ``seed``."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack(
        [(xx * (seed % 7 + 1)) % 256, (yy * (seed % 5 + 1)) % 256, ((xx + yy) * (seed % 3 + 1)) % 256],
        axis=-1,
    ).astype(np.float64)
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGB")
    return img if mode == "RGB" else img.convert(mode)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def write_lake(
    root: Path,
    counts: dict[str, int],
    *,
    size: tuple[int, int] = (48, 40),
    fmt: str = "PNG",
    seed: int = 0,
    nested: bool = True,
) -> list[Path]:
    """Write ``counts[label]`` images under ``root/<label>/`` (some one folder deeper)."""
    paths = []
    for li, (label, n) in enumerate(sorted(counts.items())):
        for i in range(n):
            sub = root / label / (f"batch{i % 3}" if nested and i % 2 else "")
            sub.mkdir(parents=True, exist_ok=True)
            ext = "png" if fmt == "PNG" else "jpg"
            path = sub / f"img_{i:05d}.{ext}"
            path.write_bytes(encode(make_image(seed * 100_003 + li * 10_007 + i, size=size), fmt))
            paths.append(path)
    return paths


def exif_rotated_jpeg() -> bytes:
    """A JPEG stored rotated with EXIF orientation 6: displayed upright it is white on top,
    black at the bottom (stored, the white half is on the right)."""
    upright = np.zeros((60, 60, 3), np.uint8)
    upright[:30] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90).save(
        buf, "JPEG", quality=95, exif=exif.tobytes()
    )
    return buf.getvalue()


def bad_objects(seed: int = 1) -> dict[str, bytes]:
    """Every kind of bad or awkward object we know, as relative key -> bytes, and what a job
    must do with it (the key names the expectation: ``ok_`` or ``bad_``)."""
    good = make_image(seed, size=(64, 48))
    jpeg = encode(good, "JPEG", quality=90)
    # EXIF orientation 6 (rotate 90° CW to display): stored 64x48, displayed 48x64.
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = encode(good, "JPEG", quality=90, exif=exif.tobytes())
    cmyk = encode(good.convert("CMYK"), "JPEG", quality=90)
    sixteen = Image.fromarray(np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 20)
    pa_bytes = io.BytesIO()
    pal = good.convert("P")
    pal.info["transparency"] = 0
    pal.save(pa_bytes, "PNG", transparency=0)
    return {
        "cls_a/ok_jpeg.jpg": jpeg,
        "cls_a/ok_exif_rotated.jpg": rotated,
        "cls_a/ok_cmyk.jpg": cmyk,
        "cls_a/ok_16bit.png": encode(sixteen, "PNG"),
        "cls_a/ok_palette_alpha.png": pa_bytes.getvalue(),
        "cls_a/ok_rgba.png": encode(good.convert("RGBA"), "PNG"),
        "cls_a/ok_png_named.jpg": encode(good, "PNG"),
        "cls_a/ok_1x1.png": encode(make_image(seed, size=(1, 1)), "PNG"),
        "cls_a/ok_wide.png": encode(make_image(seed, size=(2000, 2)), "PNG"),
        "cls_a/ok spaced ünïcødé.png": encode(good, "PNG"),
        # URI syntax in a name: a key or file name, never a fragment, a query or an escape.
        "cls_a/ok photo #1.png": encode(good, "PNG"),
        "cls_a/ok what?+a=b&c%20d.png": encode(good, "PNG"),
        "cls_a/bad_truncated.jpg": jpeg[: len(jpeg) // 2],
        "cls_a/bad_zero.jpg": b"",
        "cls_a/bad_text.jpg": b"this is not an image, just text\n" * 4,
        "cls_a/bad_corrupt.png": b"\x89PNG\r\n\x1a\n" + os.urandom(64),
        "cls_a/bad_notes.txt": b"some notes",
    }
