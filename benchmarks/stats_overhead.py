"""What the loader's per-epoch statistics (``loader.epoch_stats()``, :mod:`loaders.stats`) cost
in CPU: a kept loader streams a local 224 px JPEG dataset for ``--seconds`` under py-spy, and
the samples in the statistics' code are counted against every busy sample (waits left out).

```
python benchmarks/stats_overhead.py --images 4096 --seconds 25
```

Prints the share of the busy samples in each part: the reader thread's tally of each batch's
rows for the shuffle figures (``tallied``), the per-epoch figures (``epoch_stats``, the
shuffle figures' computation included), and the counters (decode tally, totals, budget).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_bench import build_dataset

#: Leaf frames of a thread that is waiting, not working.
_IDLE = ("wait (threading", "_wait_for_tstate_lock", "select", "acquire", "get (queue", "sleep", "poll")
_PARTS = {
    "tally of each batch's rows (reader thread)": ("tallied (",),
    "per-epoch figures (epoch_stats)": ("epoch_stats (",),
    "counters (decode tally, totals, budget)": (
        "add (loaders/stats",
        "totals (loaders/shard_loader",
        "_check_budget (",
    ),
}


def stream(root: Path, seconds: float) -> None:
    from loaders import ShardLoader

    with ShardLoader(
        str(root), channel="train", batch_size=64, shuffle=True, seed=1, num_threads=2
    ) as loader:
        began, epoch = time.monotonic(), 0
        while time.monotonic() - began < seconds:
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            loader.epoch_stats()
            epoch += 1
    print(f"streamed {epoch} epochs")


def shares(raw: Path) -> dict[str, float]:
    """Each part's share of the busy samples of a py-spy ``--format raw`` file."""
    busy, counts = 0, dict.fromkeys(_PARTS, 0)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if any(w in stack.split(";")[-1] for w in _IDLE):
            continue
        busy += int(n)
        for part, marks in _PARTS.items():
            if part.startswith("tally"):  # the tally's own frames, not the window reads it drives
                frames = stack.split(";")
                at = next((i for i, f in enumerate(frames) if f.startswith(marks)), None)
                if at is not None and not any("window_reader" in f for f in frames[at + 1 :]):
                    counts[part] += int(n)
            elif any(m in stack for m in marks):
                counts[part] += int(n)
    return {part: n / busy for part, n in counts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="stats_overhead.py")
    p.add_argument("--images", type=int, default=4096, help="images in the dataset (default 4096)")
    p.add_argument("--seconds", type=float, default=25.0, help="how long to stream (default 25)")
    p.add_argument("--stream", type=Path, help=argparse.SUPPRESS)  # the profiled child
    args = p.parse_args(argv)
    if args.stream is not None:
        stream(args.stream, args.seconds)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root, raw = Path(tmp) / "ds", Path(tmp) / "profile.txt"
        build_dataset(root, images=args.images, size=224, quality=90)
        cmd = ["py-spy", "record", "--format", "raw", "-o", str(raw), "--rate", "200", "--idle", "--"]
        cmd += [sys.executable, __file__, "--stream", str(root), "--seconds", str(args.seconds)]
        subprocess.run(cmd, check=True)
        found = shares(raw)
    for part, share in found.items():
        print(f"{share:7.3%}  {part}")
    print(f"{sum(found.values()):7.3%}  in all, of the loader's busy CPU samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
