"""Does a boxes dataset load as fast as the same images single-label?

Writes two datasets of the same noisy JPEGs (``tests/loaders/loader_builders.py``): one
single-label, one ``boxes`` (a box drawn in each image, its label columns and kept columns
read with the rows), and times whole epochs of each with augment's crop and flip, the two
alternating round after round. Prints each side's images/s and the paired ratio boxes /
single-label (the median of each round's own ratio); ``--out`` writes them as JSON. How to run
it: ``benchmarks/README.md``, "Boxes against single-label".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "loaders"))

from _cli import positive, work_folder, write_out
from _timing import alternate, paired
from loader_builders import write_dataset

from loaders import ShardLoader

SIDES = ("single-label", "boxes")


def _rate(root: Path, args: argparse.Namespace, seed: int) -> float:
    """Images/s of one epoch (after one that warms the pipeline and the page cache)."""
    options = dict(batch_size=args.batch_size, shuffle=True, seed=seed, num_threads=args.threads)
    with ShardLoader(str(root), **options, augment=True, crop=args.crop) as loader:
        list(loader)
        loader.set_epoch(1)
        began, images = time.perf_counter(), 0
        for batch in loader:
            images += len(batch[1]) if isinstance(batch, tuple) else len(batch.valid)
    return images / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=positive, default=768, help="train images of each dataset")
    parser.add_argument("--size", type=positive, default=224, help="stored image size in pixels")
    parser.add_argument("--crop", type=positive, default=192, help="augment's random crop")
    parser.add_argument("--batch-size", type=positive, default=64)
    parser.add_argument("--threads", type=positive, default=2, help="decode threads")
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--work", help="folder for the datasets (default: a temporary one)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    with work_folder(args.work, prefix="task-bench-") as work:
        rows = {"train": args.images, "validation": 4, "test": 4}
        for side in SIDES:
            task = None if side == "single-label" else side
            write_dataset(
                work / side, rows=rows, size=args.size, fmt="jpeg", noise=True, task=task, row_group_rows=64
            )
        rates: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            for side in alternate(SIDES, r):
                rates[side].append(_rate(work / side, args, r))
    ratio = paired(rates["boxes"], rates["single-label"])
    for side in SIDES:
        print(f"{side:>12}: {' '.join(f'{x:.0f}' for x in rates[side])} images/s")
    print(f"boxes / single-label (paired, median of {args.rounds} rounds): {ratio:.3f}")
    write_out(args.out, {"args": vars(args), "images_per_s": rates, "boxes_over_single_label": ratio})


if __name__ == "__main__":
    main()
