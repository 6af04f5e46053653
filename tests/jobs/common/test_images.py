from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from jobs.common.images import DEFAULT_SPEC, SNIFF_BYTES, preprocess, sniff
from lakeshard.errors import ImageRejected
from tests.helpers.lake import bad_objects, encode, make_image

OBJECTS = bad_objects()


def _decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


@pytest.mark.parametrize("key", [k for k in OBJECTS if "/ok" in k])
def test_awkward_but_valid_images_become_rgb_squares(key):
    out, h, w = preprocess(OBJECTS[key], replace(DEFAULT_SPEC, size=32, format="png"))
    img = _decode(out)
    assert (img.mode, img.size, (h, w)) == ("RGB", (32, 32), (32, 32))


@pytest.mark.parametrize(
    "key,reason",
    [
        ("cls_a/bad_truncated.jpg", "cannot decode"),
        ("cls_a/bad_zero.jpg", "empty object"),
        ("cls_a/bad_text.jpg", "cannot decode"),
        ("cls_a/bad_corrupt.png", "cannot decode"),
    ],
)
def test_bad_images_are_rejected_with_a_reason(key, reason):
    with pytest.raises(ImageRejected, match=reason):
        preprocess(OBJECTS[key], replace(DEFAULT_SPEC, size=32))


def test_decompression_bomb_is_rejected_before_decoding():
    big = encode(make_image(0, size=(400, 300)), "PNG")
    with pytest.raises(ImageRejected, match="decompression bomb: 400x300 = 120000 pixels"):
        preprocess(big, replace(DEFAULT_SPEC, size=32, max_pixels=100_000))


def test_exif_rotated_image_comes_out_upright():
    # A picture whose top half is white and bottom half black, stored rotated with orientation 6.
    upright = np.zeros((64, 64, 3), np.uint8)
    upright[:32] = 255
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # what a camera would store
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(stored, "JPEG", quality=95, exif=exif.tobytes())
    out = np.asarray(_decode(preprocess(data, replace(DEFAULT_SPEC, size=32, format="png"))[0]), dtype=float)
    assert out[:12].mean() > 200 and out[-12:].mean() < 50


def test_sixteen_bit_grey_is_scaled_not_clipped():
    arr = np.full((16, 16), 32768, np.uint16)  # mid-grey in 16 bits
    data = encode(Image.fromarray(arr), "PNG")
    out = np.asarray(_decode(preprocess(data, replace(DEFAULT_SPEC, size=8, format="png"))[0]))
    assert 120 <= out.mean() <= 135


def test_transparent_pixels_become_white():
    rgba = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    out = np.asarray(_decode(preprocess(encode(rgba, "PNG"), replace(DEFAULT_SPEC, size=8, format="png"))[0]))
    assert out.min() == 255


def test_crop_keeps_center_and_pad_keeps_everything():
    arr = np.zeros((20, 60, 3), np.uint8)
    arr[:, 20:40] = 255  # a white center square on a wide black image
    src = encode(Image.fromarray(arr), "PNG")
    crop = np.asarray(
        _decode(preprocess(src, replace(DEFAULT_SPEC, size=20, resize="crop", format="png"))[0])
    )
    pad = np.asarray(_decode(preprocess(src, replace(DEFAULT_SPEC, size=30, resize="pad", format="png"))[0]))
    assert crop.mean() > 240  # only the white center survives
    assert pad[:5].max() == 0 and pad[13:17, 12:18].min() > 200  # black bars, white center


def test_large_jpeg_uses_draft_and_still_gives_exact_size():
    data = encode(make_image(3, size=(1600, 1200)), "JPEG", quality=90)
    out, h, w = preprocess(data, replace(DEFAULT_SPEC, size=64))
    assert (h, w) == (64, 64) and _decode(out).format == "JPEG"


@pytest.mark.parametrize(
    "head,fmt",
    [
        (b"\xff\xd8\xff\xe0", "jpeg"),
        (b"\x89PNG\r\n\x1a\n", "png"),
        (b"GIF89a", "gif"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "webp"),
        (b"hello", None),
        (b"", None),
    ],
)
def test_sniff(head, fmt):
    assert sniff(head) == fmt


@pytest.mark.parametrize(
    "fmt,name",
    [
        ("ICO", "ico"),
        ("JPEG2000", "jpeg2000"),
        ("PPM", "ppm"),
        ("TGA", "tga"),
        ("PCX", "pcx"),
        ("SGI", "sgi"),
    ],
)
def test_formats_pillow_reads_are_sniffed_and_preprocessed(fmt, name):
    data = encode(make_image(5, size=(48, 40)), fmt)
    assert sniff(data[:SNIFF_BYTES]) == name
    out, h, w = preprocess(data, replace(DEFAULT_SPEC, size=16, format="png"))
    assert (_decode(out).mode, (h, w)) == ("RGB", (16, 16))


@pytest.mark.parametrize(
    "head", [b"this is not an image, just text\n" * 20, b"some notes", b"P1 is a paragraph"]
)
def test_text_is_not_sniffed_as_an_image(head):
    assert sniff(head[:SNIFF_BYTES]) is None


def test_image_spec_names_bad_values():
    with pytest.raises(ValueError, match="resize must be one of crop, pad, stretch, got 'zoom'"):
        replace(DEFAULT_SPEC, resize="zoom")
    with pytest.raises(ValueError, match="image size must be an integer in \\[8, 8192\\], got 3"):
        replace(DEFAULT_SPEC, size=3)
