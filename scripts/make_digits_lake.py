"""Write scikit-learn's digits (1,797 real 8x8 scans of handwritten digits, 10 classes) as a raw
image lake of PNG files: ``<out>/<digit>/<index>.png``, the layout the manifest job reads.

    python scripts/make_digits_lake.py demo/lake/raw [--scale 4]

The dataset ships inside the scikit-learn package: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write <digit>/<index>.png under")
    p.add_argument(
        "--scale", type=int, default=4, help="upscale factor of the 8x8 scans (default: 4 -> 32x32)"
    )
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error(f"--scale must be a positive integer, got {args.scale}")

    from sklearn.datasets import load_digits

    digits = load_digits()
    written = 0
    for i, (pixels, target) in enumerate(zip(digits.images, digits.target)):
        grey = np.clip(pixels * (255.0 / 16.0), 0, 255).astype(np.uint8)  # values are 0..16
        img = Image.fromarray(grey, "L").resize((8 * args.scale, 8 * args.scale), Image.Resampling.NEAREST)
        path = args.out / str(int(target)) / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            img.save(path)
            written += 1
    print(f"digits lake: {len(digits.images)} images in 10 classes under {args.out} ({written} new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
