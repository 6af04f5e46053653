"""ShardLoader options side by side, each in its own process, as a training run has it.

    python benchmarks/loader_ab.py --images 2000 --rounds 5 "num_threads=2" "num_threads=4"

Every round starts one process per variant, in turn (the order alternates from round to round,
so a slow spell of this shared machine hits every variant). Each process builds one loader and
runs ``--epochs`` epochs of it with ``set_epoch`` (a training loop's pattern), and measures the
decode ceiling of ``loader_bench.py`` (the same bytes in memory, the variant's decoder called
bare on one thread per core) before and after every epoch. It reports each epoch's images/s over the mean
of the two ceilings around it: the first epoch (a fresh process: thread pools, buffers and
Arrow's allocator start cold) apart from the median of the others.

A variant is ``option=value`` pairs of ``ShardLoader`` ("" is the defaults) and, in capitals,
environment variables for its processes: ``LAKESHARD_NO_EXTENSIONS=1`` runs without the C
extensions. Prints the median over rounds of each variant's ratios, and of its images/s (later
epochs) with the spread over processes; ``--out`` writes every run as JSON.

    python benchmarks/loader_ab.py --images 2000 --rounds 3 "" "LAKESHARD_NO_EXTENSIONS=1"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import parse_variant, write_runs

from lakeshard.format import FORMAT_VERSION
from loaders.options import OPTIONS

_CHILD = r"""
import argparse, json, os, statistics, sys, time
sys.path.insert(0, sys.argv[3])
import loader_bench
from loaders import ShardLoader
dataset, options, epochs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[4])
encoded = loader_bench.read_encoded(dataset, "train")
loader = ShardLoader(dataset, channel="train", batch_size=64, shuffle=True, seed=0, **options)
args = argparse.Namespace(decoder=options.get("decoder", "auto"), batch_size=64)
cores = os.cpu_count() or 1

def ceiling():
    return loader_bench.bench_ceiling(encoded, loader.image_size, args, cores)

ceiling()  # warm the decoder
ratios, rates = [], []
for epoch in range(epochs):
    before = ceiling()
    loader.set_epoch(epoch)
    start, rows = time.perf_counter(), 0
    for _, labels in loader:
        rows += len(labels)
    rate = rows / (time.perf_counter() - start)
    rates.append(rate)
    ratios.append(rate / ((before + ceiling()) / 2))
loader.close()
print(json.dumps({"first": ratios[0], "later": statistics.median(ratios[1:]), "epochs": ratios,
                  "rate_first": rates[0], "rate_later": statistics.median(rates[1:]), "rates": rates}))
"""


def variant(text: str) -> tuple[dict[str, object], dict[str, str]]:
    """``"num_threads=2,LAKESHARD_NO_EXTENSIONS=1"`` as ShardLoader keyword arguments and the
    environment variables (the keys in capitals) of the variant's processes."""
    pairs = [p for p in text.split(",") if p]
    env = dict(p.partition("=")[::2] for p in pairs if p.partition("=")[0].isupper())
    options = ",".join(p for p in pairs if not p.partition("=")[0].isupper())
    return parse_variant(options, OPTIONS, "ShardLoader"), env


def main(argv: list[str] | None = None) -> int:
    from loader_bench import build_dataset

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=[""], help='option=value,... ("" for the defaults)')
    p.add_argument("--images", type=int, default=2000, help="images in the synthetic shard (default: 2000)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels (default: 224)")
    p.add_argument("--rounds", type=int, default=5, help="processes per variant (default: 5)")
    p.add_argument(
        "--epochs", type=int, default=8, help="epochs per process, the first counted apart (default: 8)"
    )
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lakeshard-loader-ab")
    p.add_argument("--out", type=Path, help="write every run as JSON here")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error(f"--epochs must be at least 2 (the first is counted apart), got {args.epochs}")
    try:
        options = {v: variant(v) for v in args.variants}
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))

    root = args.cache / f"v{FORMAT_VERSION}-{args.images}-{args.size}"  # a new format: a new dataset
    if not (root / "dataset.json").exists():
        build_dataset(root, images=args.images, size=args.size, quality=90)
    here = str(Path(__file__).resolve().parent)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            kwargs, env = options[v]
            cmd = [sys.executable, "-c", _CHILD, str(root), json.dumps(kwargs), here, str(args.epochs)]
            out = subprocess.run(
                cmd, capture_output=True, text=True, cwd=Path(here).parent, env={**os.environ, **env}
            )
            if out.returncode:
                raise SystemExit(f"variant {v!r} failed:\n{out.stderr}")
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    print(
        f"{'variant':30s} {'first epoch ÷ ceiling':>22s} {'later epochs ÷ ceiling':>23s}   per process (later)"
    )
    for v, rs in runs.items():
        first = statistics.median(x["first"] for x in rs)
        later = statistics.median(x["later"] for x in rs)
        each = " ".join(f"{x['later']:.3f}" for x in rs)
        print(f"{v or '(defaults)':30s} {first:22.3f} {later:23.3f}   {each}")
    print(
        f"\n{'variant':30s} {'images/s, first epoch':>22s} {'later epochs':>13s} {'(min-max)':>13s}  ÷ first variant"
    )
    base = statistics.median(x["rate_later"] for x in runs[args.variants[0]])
    for v, rs in runs.items():
        first = statistics.median(x["rate_first"] for x in rs)
        later = [x["rate_later"] for x in rs]
        spread = f"{min(later):.0f}-{max(later):.0f}"
        print(
            f"{v or '(defaults)':30s} {first:22.0f} {statistics.median(later):13.0f} {spread:>13s}  {statistics.median(later) / base:.3f}"
        )
    write_runs(args.out, args, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
