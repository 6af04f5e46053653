"""Who holds Python's GIL, per image: a kept ShardLoader against the decode ceiling (py-spy).

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "Who holds the GIL".
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = r"""
import argparse, os, sys, time
sys.path.insert(0, sys.argv[3])
import loader_bench
from loaders import ShardLoader
workload, dataset = sys.argv[1], sys.argv[2]
if workload == "loader":
    loader = ShardLoader(dataset, channel="train", batch_size=64, shuffle=True, seed=0)
    def one_pass(epoch):
        loader.set_epoch(epoch)
        return sum(len(labels) for _, labels in loader)
else:
    encoded = loader_bench.read_encoded(dataset, "train")
    size = ShardLoader(dataset, channel="train").image_size
    args = argparse.Namespace(decoder="auto", batch_size=64)
    def one_pass(epoch):
        loader_bench.bench_ceiling(encoded, size, args, os.cpu_count() or 1)
        return len(encoded)
done, epoch = 0, 0
while True:  # until the parent stops it; one line per pass: wall clock, images so far
    done += one_pass(epoch)
    epoch += 1
    print(time.time(), done, flush=True)
"""


#: Leaf frames of a thread that is waiting, not working (``--stats``).
_IDLE = ("wait (threading", "_wait_for_tstate_lock", "select", "acquire", "get (queue", "sleep", "poll")
#: The statistics' parts (``--stats``) and the frames that mark each.
_PARTS = {
    "tally of each batch's rows (reader thread)": ("tallied (",),
    "per-epoch figures (epoch_stats)": ("epoch_stats (",),
    "counters (decode tally, totals, budget)": (
        "add (loaders/stats",
        "totals (loaders/shard_loader",
        "_check_budget (",
    ),
}


def images_between(progress: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Images processed in ``[t0, t1]``, interpolated linearly between the passes' ends."""

    def at(t: float) -> float:
        for (ta, na), (tb, nb) in itertools.pairwise(progress):
            if ta <= t <= tb:
                return na + (nb - na) * (t - ta) / (tb - ta)
        raise ValueError(f"time {t:.3f} is outside the passes ({progress[0][0]:.3f}-{progress[-1][0]:.3f})")

    return at(t1) - at(t0)


def gil_lines(raw: Path) -> collections.Counter[str]:
    """Samples per innermost frame, from py-spy's raw (collapsed stacks) output."""
    lines: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            lines[stack.split(";")[-1]] += int(count)
    return lines


def profile(workload: str, dataset: Path, args: argparse.Namespace, py_spy: str, work: Path) -> dict:
    here = Path(__file__).resolve().parent
    cmd = [sys.executable, "-c", _CHILD, workload, str(dataset), str(here)]
    child = subprocess.Popen(cmd, cwd=here.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress: list[tuple[float, int]] = []

    def next_pass() -> None:
        line = child.stdout.readline()
        if not line:
            child.wait()
            raise SystemExit(f"the {workload} process exited ({child.returncode}):\n{child.stderr.read()}")
        t, n = line.split()
        progress.append((float(t), int(n)))

    try:
        for _ in range(args.warmup):
            next_pass()
        raw = work / f"{workload}.txt"
        spy = [py_spy, "record", "--gil", "--idle", "--nonblocking", "--format", "raw", "--output", str(raw)]
        spy += ["--rate", str(args.rate), "--duration", str(args.seconds), "--pid", str(child.pid)]
        t0 = time.time()
        done = subprocess.run(spy, capture_output=True, text=True)
        t1 = time.time()
        if done.returncode or not raw.exists():
            raise SystemExit(f"py-spy failed ({done.returncode}): {done.stderr.strip()}")
        while progress[-1][0] < t1:  # the pass that was running when sampling stopped
            next_pass()
    finally:
        child.kill()
        child.wait()
    images = images_between(progress, t0, t1)
    lines = gil_lines(raw)
    held_s = sum(lines.values()) / args.rate
    return {
        "images_per_s": images / (t1 - t0),
        "gil_share": held_s / (t1 - t0),
        "gil_us_per_image": held_s / images * 1e6,
        "lines_us_per_image": {k: v / args.rate / images * 1e6 for k, v in lines.most_common()},
    }


#: ``--stats``' fewest epochs, however slow the machine: with a few epochs in ``--seconds`` on a
#: busy machine, the statistics' few calls drew no sample at all (CI printed 0.000% for each part).
_STATS_MIN_EPOCHS = 20


def stream(root: Path, seconds: float) -> None:
    """``--stats``' profiled child: a kept loader's epochs, each with its ``epoch_stats()``, for
    ``seconds`` and at least :data:`_STATS_MIN_EPOCHS` epochs."""
    from loaders import ShardLoader

    with ShardLoader(
        str(root), channel="train", batch_size=64, shuffle=True, seed=1, num_threads=2
    ) as loader:
        began, epoch = time.monotonic(), 0
        while epoch < _STATS_MIN_EPOCHS or time.monotonic() - began < seconds:
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            loader.epoch_stats()
            epoch += 1
    print(f"streamed {epoch} epochs")


def stats_shares(raw: Path) -> dict[str, float]:
    """Each part of the statistics' share of the busy samples of a py-spy ``--format raw`` file."""
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


def stats_overhead(root: Path, args: argparse.Namespace) -> None:
    """``--stats``: stream ``root`` under py-spy; print each part's share of the busy samples."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        cmd = [args.py_spy, "record", "--format", "raw", "-o", str(raw), "--rate", "200", "--idle", "--"]
        cmd += [sys.executable, __file__, "--stream", str(root), "--seconds", str(args.seconds)]
        subprocess.run(cmd, check=True)
        found = stats_shares(raw)
    for part, share in found.items():
        print(f"{share:7.3%}  {part}")
    print(f"{sum(found.values()):7.3%}  in all, of the loader's busy CPU samples")


def _default_py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")  # this virtualenv's, when it is not on PATH
    return str(beside) if beside.exists() else shutil.which("py-spy")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cli import positive
    from _data import cached_dataset
    from _timing import alternate, write_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--images", type=positive, default=2000, help="images in the synthetic shard (default: 2000)"
    )
    p.add_argument("--size", type=positive, default=224, help="image side in pixels (default: 224)")
    p.add_argument(
        "--seconds", type=positive, default=15, help="sampling time per workload and repeat (default: 15)"
    )
    p.add_argument("--rate", type=positive, default=1000, help="py-spy samples per second (default: 1000)")
    p.add_argument("--warmup", type=positive, default=3, help="passes before sampling starts (default: 3)")
    p.add_argument("--repeats", type=positive, default=3, help="processes per workload (default: 3)")
    p.add_argument("--top", type=int, default=12, help="source lines to print per workload (default: 12)")
    p.add_argument(
        "--py-spy",
        default=_default_py_spy(),
        help="the py-spy executable (default: next to this Python, else on PATH)",
    )
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lakeshard-loader-ab")
    p.add_argument("--out", type=Path, help="write every run as JSON here")
    p.add_argument(
        "--stats", action="store_true", help="the CPU of the per-epoch statistics instead (py-spy, no JSON)"
    )
    p.add_argument("--stream", type=Path, help=argparse.SUPPRESS)  # --stats' profiled child
    args = p.parse_args(argv)
    if args.stream is not None:
        stream(args.stream, args.seconds)
        return 0
    if not args.py_spy or not os.access(args.py_spy, os.X_OK):
        p.error(
            f"py-spy not found (--py-spy {args.py_spy!r}): pip install py-spy, or pip install -e '.[dev]'"
        )

    root = cached_dataset(args.cache, images=args.images, size=args.size)
    if args.stats:
        stats_overhead(root, args)
        return 0
    workloads = ("loader", "ceiling")
    runs: dict[str, list[dict]] = {w: [] for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for w in alternate(workloads, r):
                runs[w].append(profile(w, root, args, args.py_spy, Path(tmp)))
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    med = statistics.median
    print(f"{'':10s} {'images/s':>9s} {'GIL share':>10s} {'GIL us/image':>13s}   per process (us/image)")
    for w, rs in runs.items():
        each = " ".join(f"{x['gil_us_per_image']:.1f}" for x in rs)
        print(
            f"{w:10s} {med(x['images_per_s'] for x in rs):9.0f} {med(x['gil_share'] for x in rs):10.1%} "
            f"{med(x['gil_us_per_image'] for x in rs):13.1f}   {each}"
        )
    for w, rs in runs.items():
        print(f"\n{w}: GIL us/image by source line (median over repeats)")
        names = {k for x in rs for k in list(x["lines_us_per_image"])[: args.top]}
        per_line = {k: med(x["lines_us_per_image"].get(k, 0.0) for x in rs) for k in names}
        for k, v in sorted(per_line.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {v:6.2f}  {k}")
    write_runs(args.out, args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
