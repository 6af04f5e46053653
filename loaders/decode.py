"""Image decoders: encoded bytes to an RGB ``uint8`` array of shape ``[H, W, 3]``.

``simplejpeg`` (libjpeg-turbo) decodes JPEG faster than Pillow (``docs/performance.md``) and
releases the GIL; Pillow (which also releases the GIL while decoding) reads every other format
and is the fallback when simplejpeg is not installed or refuses a file.
``benchmarks/loader_bench.py`` measures both. Choose with ``ShardLoader(decoder=...)``:

* ``"auto"``: a whole batch of JPEGs at once with ``loaders._jpeg`` when built (see below), then
  simplejpeg for JPEG when importable, Pillow otherwise, for any row it left;
* ``"simplejpeg"``: simplejpeg image by image (when installed), no fallback;
* ``"pillow"``: Pillow for everything.

``loaders/_jpeg.c`` (built by pip, linking the system's libjpeg-turbo) decodes every image of a
batch with one release of the GIL, where simplejpeg takes and releases it for every image (and
holds it to parse each header and build each result); the loader's reader and its other decode
threads no longer wait for it several times per image (``docs/design/0006-loader-c-extensions.md``). Its
pixels are simplejpeg's (same library, same settings). Rows it does not decode (a CMYK JPEG, a
warning from libjpeg, a wrong size, not a JPEG) go through the image-by-image decoder, which
decodes or refuses them exactly as before. ``LAKESHARD_NO_EXTENSIONS=1`` switches it off; a
loader that decodes without it logs a WARNING once (``loaders._internal.extensions``).

Every decoder takes ``bytes`` or a ``memoryview`` of format ``"B"`` (a zero-copy view of an
Arrow buffer, for instance).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from lakeshard.format.layout import STORED_IMAGE_SIGNATURES
from loaders._internal.extensions import extension, fall_back

try:  # optional: the fast JPEG path
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    _simplejpeg = None

_jpeg = extension(
    "_jpeg", f"JPEGs are decoded image by image with {'simplejpeg' if _simplejpeg else 'Pillow'} (slower)"
)

__all__ = [
    "BATCH_DECODERS",
    "DECODERS",
    "NO_DECODER",
    "BatchDecoder",
    "Buffer",
    "ImageSizeError",
    "decode_pillow",
    "decode_simplejpeg",
    "get_batch_decoder",
    "get_decoder",
    "has_simplejpeg",
    "is_jpeg",
]

_JPEG_MAGIC = STORED_IMAGE_SIGNATURES["jpeg"]

#: What a decoder reads: encoded bytes, or a zero-copy view of them (``memoryview`` format "B").
Buffer = bytes | memoryview
#: Decodes what it can of a batch into ``out`` (``[B, H, W, 3]`` uint8, C-contiguous) and returns
#: the indices of the rows it left (``None`` rows among them) for the image-by-image decoder.
BatchDecoder = Callable[[Sequence[Buffer | None], np.ndarray], list[int]]


class ImageSizeError(ValueError):
    """The image decoded fine but is not the size the dataset promises."""


def has_simplejpeg() -> bool:
    return _simplejpeg is not None


def is_jpeg(data: Buffer) -> bool:
    return data[:3] == _JPEG_MAGIC


def _size_error(got: tuple[int, ...], out: np.ndarray) -> ImageSizeError:
    return ImageSizeError(f"image is {got[1]}x{got[0]}, expected {out.shape[1]}x{out.shape[0]}")


def decode_pillow(data: Buffer, out: np.ndarray | None = None) -> np.ndarray:
    """Decode any format Pillow reads; convert to RGB."""
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", im.size)  # JPEG: decode straight to RGB, no scaling
        arr = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
    if out is not None:
        if out.shape != arr.shape:
            raise _size_error(arr.shape, out)
        out[...] = arr
        return out
    return arr


def decode_simplejpeg(data: Buffer, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a JPEG with libjpeg-turbo; into ``out`` when given (no extra copy).

    The size is checked on the result, not by parsing the header first (a second parse of every
    header): a smaller image lands in the front of ``out`` and is refused; a larger one
    does not fit, and simplejpeg refuses it before writing.
    """
    if _simplejpeg is None:
        raise RuntimeError("simplejpeg is not installed")
    if out is None:
        return _simplejpeg.decode_jpeg(data, colorspace="RGB")
    try:
        arr = _simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)
    except ValueError:
        h, w, _, _ = _simplejpeg.decode_jpeg_header(data)  # a bad JPEG raises its own ValueError here
        if (h, w, 3) != out.shape:
            raise _size_error((h, w), out) from None
        raise
    if arr.shape != out.shape:
        raise _size_error(arr.shape, out)
    return out


def _decode_auto(data: Buffer, out: np.ndarray | None = None) -> np.ndarray:
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


#: The ``decoder`` that decodes nothing: batches are :class:`loaders.batch.EncodedBatch`.
NO_DECODER = "none"


def get_decoder(name: str) -> Callable[..., np.ndarray]:
    try:
        return DECODERS[name]
    except (KeyError, TypeError):  # TypeError: not hashable, so not a name
        raise ValueError(f"decoder must be one of {sorted(DECODERS)}, got {name!r}") from None


def _decode_jpeg_batch(images: Sequence[Buffer | None], out: np.ndarray) -> list[int]:
    return _jpeg.decode_into(images, out, out.shape[1], out.shape[2])


#: The batch decoder that goes first, by decoder name (only when ``loaders._jpeg`` is built).
BATCH_DECODERS: dict[str, BatchDecoder] = {"auto": _decode_jpeg_batch} if _jpeg is not None else {}


def get_batch_decoder(name: str) -> BatchDecoder | None:
    """The batch decoder that goes first for decoder ``name``, or ``None``: none for ``"pillow"``
    and ``"simplejpeg"``; for ``"auto"``, ``None`` only when ``loaders._jpeg`` is missing, which
    the first such call in a process logs as a WARNING."""
    get_decoder(name)  # the same check of the name
    if name == "auto" and _jpeg is None:
        fall_back("_jpeg")
    return BATCH_DECODERS.get(name)
