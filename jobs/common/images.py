"""Image checks and preprocessing, shared by every engine.

``sniff`` tells an image from anything else by its first bytes (the manifest job); ``preprocess``
decodes, applies EXIF orientation, converts to 8-bit RGB, resizes and re-encodes (the shard
job) as an :class:`~lakeshard.format.ImageSpec` says (the format's model of ``dataset.json``'s
``image``, re-exported here). Preprocessing belongs here, once, not in every epoch of the
training loop.
"""

from __future__ import annotations

import io
import warnings
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from lakeshard.errors import ImageRejected
from lakeshard.format.info import ImageSpec
from lakeshard.format.layout import STORED_IMAGE_SIGNATURES

__all__ = ["DEFAULT_SPEC", "UNSUPPORTED_FORMATS", "EncodedImage", "ImageSpec", "preprocess", "sniff"]

# Magic numbers of the formats Pillow decodes for us; anything else is asked of Pillow itself.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    *((magic, name) for name, magic in STORED_IMAGE_SIGNATURES.items()),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"\x00\x00\x01\x00", "ico"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),  # JP2 file
    (b"\xffO\xffQ", "jpeg2000"),  # raw J2K codestream
)

#: Formats Pillow identifies but cannot decode without an external program: a reject reason
#: names them as unsupported rather than not images.
UNSUPPORTED_FORMATS = {"eps": "Pillow decodes EPS only through Ghostscript"}

#: How many leading bytes :func:`sniff` needs (Pillow reads a few hundred to identify some formats).
SNIFF_BYTES = 512


def _pillow_format(head: bytes) -> str | None:
    """The format Pillow identifies from ``head`` alone, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(head)) as img:
                return str(img.format).lower()
    except Exception:  # every plugin's way of saying "not mine" (or "need more bytes")
        return None


def sniff(head: bytes) -> str | None:
    """The image format of an object whose first bytes are ``head`` (at least
    :data:`SNIFF_BYTES` of them, or the whole object), or None if Pillow cannot identify it.

    Names are lower-case Pillow format names (``jpeg``, ``png``, ``ico``, ``ppm``, ``tga``...);
    those in :data:`UNSUPPORTED_FORMATS` are images the shard job cannot decode.
    """
    for magic, name in _SIGNATURES:
        if head.startswith(magic):
            return name
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return _pillow_format(head)


#: The image options by default, the shard job's (``conf/shard.yaml``): 224-pixel center crops as
#: JPEG quality 90, sources over Pillow's own decompression-bomb limit rejected. Another spec is
#: ``dataclasses.replace(DEFAULT_SPEC, size=64)``.
DEFAULT_SPEC = ImageSpec(size=224, format="jpeg", quality=90, resize="crop", max_pixels=89_478_485)


def _to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB from any mode: 16/32-bit grey is scaled (not clipped), alpha over white."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        if mode == "F":
            top = max(float(arr.max(initial=0)), 1.0)
        arr = np.clip(arr * (255.0 / top), 0, 255).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")  # L, 1, P, CMYK (Pillow undoes Adobe's inversion), YCbCr, LAB, HSV


class EncodedImage(NamedTuple):
    """A preprocessed image as a shard stores it: its encoded bytes and their size in pixels."""

    data: bytes
    height: int
    width: int


def _target_box(w: int, h: int, spec: ImageSpec) -> tuple[tuple[int, int], tuple[float, float, float, float]]:
    """Output size and the source box that maps onto it."""
    s = spec.size
    if spec.resize == "stretch":
        return (s, s), (0, 0, w, h)
    if spec.resize == "crop":
        side = min(w, h)
        left, top = (w - side) / 2, (h - side) / 2
        return (s, s), (left, top, left + side, top + side)
    scale = s / max(w, h)  # pad: fit inside
    return (max(1, round(w * scale)), max(1, round(h * scale))), (0, 0, w, h)


def preprocess(data: bytes, spec: ImageSpec) -> EncodedImage:
    """Decode ``data``, orient, convert, resize and encode it as ``spec`` says.

    Returns the encoded image and its height and width. Raises :class:`ImageRejected` with a reason for
    anything that cannot become a training image.
    """
    if not data:
        raise ImageRejected("empty object (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > spec.max_pixels:
                raise ImageRejected(
                    f"decompression bomb: {w}x{h} = {w * h} pixels exceeds max_image_pixels={spec.max_pixels}"
                )
            if img.format == "JPEG" and spec.resize != "pad":
                # DCT scaling while decoding: far less work for large JPEGs (Pillow's draft).
                short = min(w, h)
                if short > 2 * spec.size:
                    f = spec.size / short
                    img.draft("RGB", (max(1, int(w * f) + 1), max(1, int(h * f) + 1)))
            img.load()
            img = ImageOps.exif_transpose(img)  # no-op without an EXIF orientation tag
            img = _to_rgb(img)
    except ImageRejected:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageRejected(f"decompression bomb: {exc}") from None
    except Image.DecompressionBombWarning as exc:
        raise ImageRejected(f"decompression bomb: {exc}") from None
    except UnidentifiedImageError:
        raise ImageRejected("cannot decode: not an image Pillow can read") from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError, IndexError, TypeError) as exc:
        raise ImageRejected(f"cannot decode: {type(exc).__name__}: {exc}") from None

    w, h = img.size
    out_size, box = _target_box(w, h, spec)
    img = img.resize(out_size, Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if spec.resize == "pad" and out_size != (spec.size, spec.size):
        canvas = Image.new("RGB", (spec.size, spec.size))
        canvas.paste(img, ((spec.size - out_size[0]) // 2, (spec.size - out_size[1]) // 2))
        img = canvas
    buf = io.BytesIO()
    if spec.format == "jpeg":
        img.save(buf, "JPEG", quality=spec.quality)
    else:
        img.save(buf, "PNG", compress_level=1)
    return EncodedImage(buf.getvalue(), img.height, img.width)
