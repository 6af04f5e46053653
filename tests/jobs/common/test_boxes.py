"""jobs/common/boxes.py: for any image size, EXIF orientation, encoding and resize mode, a box
moved by :func:`geometry` and :func:`move_boxes` lands within a pixel of where the resize's
documented geometry (a reference written here, from the image as displayed) puts it, and
:func:`geometry` names the size :func:`preprocess` stores."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from jobs.common.boxes import MIN_SIDE, OUTSIDE, TOO_SMALL, geometry, move_boxes
from jobs.common.images import DEFAULT_SPEC, preprocess
from tests.helpers.lake import encode

#: EXIF orientation -> the transpose that stores a displayed image so that orientation shows it.
_STORED = {
    1: None,
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}


def _reference(box: dict[str, float], w: int, h: int, resize: str, size: int) -> tuple[float, ...] | None:
    """``box`` (pixels of the displayed w x h image) as x0, y0, x1, y1 of the stored image, unclipped."""
    if resize == "stretch":
        sx, sy, dx, dy = size / w, size / h, 0.0, 0.0
    elif resize == "crop":
        side = min(w, h)
        sx = sy = size / side
        dx, dy = -(w - side) / 2 * sx, -(h - side) / 2 * sy
    else:
        scale = size / max(w, h)
        ow, oh = max(1, round(w * scale)), max(1, round(h * scale))
        sx, sy, dx, dy = ow / w, oh / h, (size - ow) // 2, (size - oh) // 2
    x, y = box["x"], box["y"]
    return (x * sx + dx, y * sy + dy, (x + box["width"]) * sx + dx, (y + box["height"]) * sy + dy)


def _clip(v: float, size: int) -> float:
    return min(max(v, 0.0), float(size))


@settings(max_examples=60, deadline=None)
@given(
    w=st.integers(4, 300),
    h=st.integers(4, 300),
    size=st.integers(8, 64),
    resize=st.sampled_from(["crop", "pad", "stretch"]),
    orientation=st.sampled_from(sorted(_STORED)),
    fmt=st.sampled_from(["PNG", "JPEG"]),
    at=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0.01, 1), st.floats(0.01, 1)),
)
def test_a_box_lands_within_a_pixel_of_the_resize_geometry(
    w: int, h: int, size: int, resize: str, orientation: int, fmt: str, at: tuple[float, ...]
) -> None:
    shown = Image.new("RGB", (w, h), (200, 100, 50))
    turn = _STORED[orientation]
    stored = shown.transpose(turn) if turn is not None else shown
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(stored, fmt, exif=exif.tobytes())
    spec = dataclasses.replace(DEFAULT_SPEC, size=size, resize=resize)
    x, y = at[0] * w, at[1] * h
    box: dict[str, Any] = {
        "label": "a",
        "x": x,
        "y": y,
        "width": at[2] * (w - x) + 0.01,
        "height": at[3] * (h - y) + 0.01,
    }
    where = geometry(data, spec)
    out = preprocess(data, spec)
    assert (where.width, where.height) == (out.width, out.height)
    want = [_clip(v, size) for v in _reference(box, w, h, resize, size) or ()]
    kept, dropped = move_boxes([box], where)
    if kept:
        got = kept[0]
        corners = (got["x"], got["y"], got["x"] + got["width"], got["y"] + got["height"])
        assert all(abs(g - r) <= 1.0 for g, r in zip(corners, want, strict=True)), (corners, want)
        assert got["width"] >= MIN_SIDE and got["height"] >= MIN_SIDE
    else:  # dropped: the reference leaves it (nearly) without area too
        assert set(dropped) <= {OUTSIDE, TOO_SMALL} and sum(dropped.values()) == 1
        assert min(want[2] - want[0], want[3] - want[1]) < MIN_SIDE + 2.0


def test_a_box_the_crop_leaves_without_area_is_dropped_as_outside() -> None:
    data = encode(Image.new("RGB", (64, 48)), "PNG")
    where = geometry(data, dataclasses.replace(DEFAULT_SPEC, size=24, resize="crop"))
    kept, dropped = move_boxes([{"label": "a", "x": 0.0, "y": 5.0, "width": 7.0, "height": 9.0}], where)
    assert (kept, dict(dropped)) == ([], {OUTSIDE: 1})
    kept, dropped = move_boxes([{"label": "a", "x": 30.0, "y": 5.0, "width": 0.1, "height": 9.0}], where)
    assert (kept, dict(dropped)) == ([], {TOO_SMALL: 1})
