"""A lake of images with drawn shapes whose classes and boxes are known (issue 51's tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from tests.helpers.lake import encode

__all__ = ["SHAPES", "Drawn", "Shape", "shapes_lake"]

#: The classes: what is drawn.
SHAPES = ("circle", "square", "triangle")


@dataclass(frozen=True, slots=True)
class Shape:
    """One drawn shape: its class and its box in pixels (x, y the top left corner)."""

    label: str
    x: int
    y: int
    width: int
    height: int

    def box(self) -> dict[str, object]:
        return {"label": self.label, "x": self.x, "y": self.y, "width": self.width, "height": self.height}


@dataclass(frozen=True, slots=True)
class Drawn:
    """An image of the lake: its key, its size and what is drawn on it."""

    key: str
    width: int
    height: int
    shapes: tuple[Shape, ...]

    @property
    def labels(self) -> list[str]:
        return sorted({s.label for s in self.shapes})


def _draw(img: Image.Image, shape: Shape) -> None:
    draw = ImageDraw.Draw(img)
    x0, y0, x1, y1 = shape.x, shape.y, shape.x + shape.width - 1, shape.y + shape.height - 1
    if shape.label == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=(220, 40, 40))
    elif shape.label == "square":
        draw.rectangle((x0, y0, x1, y1), fill=(40, 200, 40))
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=(40, 40, 220))


def shapes_lake(root: Path, n: int, *, seed: int = 0, size: tuple[int, int] = (64, 48)) -> list[Drawn]:
    """Write ``n`` PNGs under ``root`` (flat), each with one to three shapes of distinct classes
    at random places; the rarer classes are drawn less often (``triangle`` least). Returns
    what each holds."""
    rng = random.Random(seed)
    width, height = size
    out = []
    for i in range(n):
        kinds = [k for k, p in zip(SHAPES, (0.7, 0.5, 0.2)) if rng.random() < p] or [rng.choice(SHAPES)]
        shapes = []
        for kind in kinds:
            w, h = rng.randint(8, 20), rng.randint(8, 20)
            shapes.append(Shape(kind, rng.randint(0, width - w), rng.randint(0, height - h), w, h))
        img = Image.new("RGB", size, (250, 250, 250))
        for s in shapes:
            _draw(img, s)
        key = f"img_{i:04d}.png"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(encode(img, "PNG"))
        out.append(Drawn(key, width, height, tuple(shapes)))
    return out
