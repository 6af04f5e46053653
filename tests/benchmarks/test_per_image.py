"""The jobs benchmark's per-image work (``benchmarks/peers/per_image.py``, which every peer's
environment imports) gives the same bytes as the shard job's own preprocessing, for JPEGs like the
lake's (some of ``benchmarks/_data.py``'s ``lake_jpeg``) and others: small and large (DCT-scaled
while decoding), landscape and portrait, EXIF-rotated, grey and CMYK."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from PIL import Image

from jobs.common.images import DEFAULT_SPEC, ImageSpec, preprocess
from tests.helpers.lake import encode, make_image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from _data import lake_jpeg  # noqa: E402 - benchmarks/ is not a package
from per_image import prepare  # noqa: E402


def _jpeg(
    size: tuple[int, int], *, orientation: int | None = None, mode: str = "RGB", seed: int = 3
) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    return encode(make_image(seed, size=size, mode=mode), "JPEG", quality=90, exif=exif.tobytes())


CASES = {
    "smaller than the output": _jpeg((150, 120)),
    "photo-sized landscape": _jpeg((512, 389)),
    "photo-sized portrait": _jpeg((360, 480), seed=4),
    "large: scaled while decoding": _jpeg((1100, 830), seed=5),
    "odd sides": _jpeg((457, 301), seed=6),
    "EXIF orientation 6": _jpeg((500, 380), orientation=6, seed=7),
    "EXIF orientation 3": _jpeg((700, 470), orientation=3, seed=8),
    "EXIF orientation 8, large": _jpeg((1000, 700), orientation=8, seed=9),
    "grey": _jpeg((420, 330), mode="L", seed=10),
    "CMYK": _jpeg((430, 340), mode="CMYK", seed=11),
    **{f"the benchmark lake's image {i}": lake_jpeg(i) for i in (0, 1, 4, 9, 14)},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("size", "quality"), [(224, 90), (64, 75)])
def test_prepare_gives_the_shard_jobs_bytes(case: str, size: int, quality: int) -> None:
    spec = ImageSpec(size, "jpeg", quality, "crop", DEFAULT_SPEC.max_pixels)
    expected = preprocess(CASES[case], spec).data
    got = prepare(CASES[case], size, quality)
    assert got == expected, f"{case}: {len(got)} bytes, the shard job's {len(expected)}"
    with Image.open(io.BytesIO(got)) as img:
        assert img.size == (size, size) and img.mode == "RGB"
