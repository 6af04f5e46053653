"""Does ShardLoader's memory stay bounded whatever the shard's size? Peak RSS of one epoch over
a shard of N images and over one of 10×N, each in a fresh process, side by side.

    python benchmarks/loader_memory.py --images 2000 --factor 10 --out benchmarks/results/loader_memory.json

Target (reported, not asserted): peak RSS at 10×N <= 1.1 × peak RSS at N. Also prints the time
to first batch of each (it must not grow with the shard either).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import write_json

_CHILD = r"""
import json, resource, sys, time
from loaders import ShardLoader
t = time.perf_counter()
loader = ShardLoader(sys.argv[1], channel="train", batch_size=64, shuffle=True, seed=0, num_threads=2, prefetch=4)
first = None
rows = 0
for images, labels in loader:
    if first is None:
        first = time.perf_counter() - t
    rows += len(labels)
loader.close()
print(json.dumps({"rows": rows, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "first_batch_s": first, "epoch_s": time.perf_counter() - t}))
"""


def run_epoch(dataset: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dataset)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from loader_bench import build_dataset  # puts the repository root on sys.path

    from lakeshard.format import FORMAT_VERSION

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="images in the small shard (default: 2000)")
    p.add_argument(
        "--factor", type=int, default=10, help="the large shard is this many times larger (default: 10)"
    )
    p.add_argument("--size", type=int, default=128, help="image side in pixels (default: 128)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lakeshard-memory-bench")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    results = {}
    for name, n in (("small", args.images), ("large", args.images * args.factor)):
        root = args.cache / f"v{FORMAT_VERSION}-{n}-{args.size}"  # a new format: a new dataset
        if not (root / "dataset.json").exists():
            build_dataset(root, images=n, size=args.size, quality=90)
        runs = [run_epoch(root) for _ in range(args.repeats)]
        results[name] = {
            "images": n,
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
            "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
            "images_per_s": statistics.median(r["rows"] / r["epoch_s"] for r in runs),
        }
    ratio = results["large"]["peak_rss_mib"] / results["small"]["peak_rss_mib"]
    print(f"{'shard':6} {'images':>7} {'peak RSS MiB':>13} {'first batch s':>14} {'images/s':>9}")
    for name, r in results.items():
        print(
            f"{name:6} {r['images']:7d} {r['peak_rss_mib']:13.1f} {r['first_batch_s']:14.3f} {r['images_per_s']:9.0f}"
        )
    print(f"peak RSS large/small: {ratio:.3f} (target <= 1.1)")
    write_json(args.out, {**results, "rss_ratio": ratio, "size": args.size})
    return 0


if __name__ == "__main__":
    sys.exit(main())
