"""Image decoders: encoded bytes to an RGB ``uint8`` array of shape ``[H, W, 3]``.

``simplejpeg`` (libjpeg-turbo) decodes JPEG about 1.8x faster than Pillow on our machines and
releases the GIL; Pillow (which also releases the GIL while decoding) reads every other format
and is the fallback when simplejpeg is not installed or refuses a file (CMYK, for instance).
``benchmarks/loader_bench.py`` measures both. Choose with ``ShardLoader(decoder=...)``:

* ``"auto"``: simplejpeg for JPEG when importable, Pillow otherwise;
* ``"pillow"``: Pillow for everything.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image

try:  # optional: the fast JPEG path
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    _simplejpeg = None

__all__ = [
    "DECODERS",
    "ImageSizeError",
    "decode_pillow",
    "decode_simplejpeg",
    "get_decoder",
    "has_simplejpeg",
    "is_jpeg",
]

_JPEG_MAGIC = b"\xff\xd8\xff"


class ImageSizeError(ValueError):
    """The image decoded fine but is not the size the dataset promises."""


def has_simplejpeg() -> bool:
    return _simplejpeg is not None


def is_jpeg(data: bytes) -> bool:
    return data[:3] == _JPEG_MAGIC


def decode_pillow(data: bytes, out: np.ndarray | None = None) -> np.ndarray:
    """Decode any format Pillow reads; convert to RGB."""
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", im.size)  # JPEG: decode straight to RGB, no scaling
        if im.mode != "RGB":
            im = im.convert("RGB")
        arr = np.asarray(im)
    if out is not None:
        if out.shape != arr.shape:
            raise ImageSizeError(f"image is {arr.shape[1]}x{arr.shape[0]}, expected {out.shape[1]}x{out.shape[0]}")
        out[...] = arr
        return out
    return arr


def decode_simplejpeg(data: bytes, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a JPEG with libjpeg-turbo; into ``out`` when given (no extra copy)."""
    if _simplejpeg is None:
        raise RuntimeError("simplejpeg is not installed")
    if out is not None:
        h, w, _, _ = _simplejpeg.decode_jpeg_header(data)
        if (h, w, 3) != out.shape:
            raise ImageSizeError(f"image is {w}x{h}, expected {out.shape[1]}x{out.shape[0]}")
        return _simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
    return _simplejpeg.decode_jpeg(data, colorspace="RGB")


def _decode_auto(data: bytes, out: np.ndarray | None = None) -> np.ndarray:
    if _simplejpeg is not None and is_jpeg(data):
        try:
            return decode_simplejpeg(data, out)
        except ImageSizeError:
            raise
        except ValueError:
            pass  # e.g. a CMYK or an unusual JPEG: Pillow knows more variants
    return decode_pillow(data, out)


DECODERS: dict[str, Callable[..., np.ndarray]] = {"auto": _decode_auto, "pillow": decode_pillow}
if _simplejpeg is not None:
    DECODERS["simplejpeg"] = decode_simplejpeg


def get_decoder(name: str) -> Callable[..., np.ndarray]:
    try:
        return DECODERS[name]
    except KeyError:
        raise ValueError(f"decoder must be one of {sorted(DECODERS)}, got {name!r}") from None
