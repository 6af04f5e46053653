"""Shard job options side by side: each variant run in turn, round after round, on one engine,
with the ceiling of ``jobs_bench.py`` (single-thread preprocessing × cores, and 2 bare
processes) measured in every round, so a slow spell of this shared machine hits every variant.

    python benchmarks/jobs_ab.py --engine spark --images 2000 --rounds 8 "" "partitions=4" "threads=4,decode_threads=4"

A variant is ``option=value`` pairs of ``ShardConfig`` ("" is the defaults). The first round is
a warm-up and not counted. Prints medians and each variant's ratio to the ceiling.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jobs_bench
from variants import parse_variant

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines import open_engine
from jobs.common.images import DEFAULT_SPEC
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig


def variant(text: str) -> dict[str, object]:
    """``"partitions=4,threads=1"`` as ShardConfig keyword arguments."""
    return parse_variant(text, (f.name for f in dataclasses.fields(ShardConfig)), "shard job")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", default=[""], help='option=value,... ("" for the defaults)')
    p.add_argument("--engine", choices=["spark", "dask"], default="spark")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=8, help="counted rounds (after one warm-up round)")
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--out", type=Path, help="write the runs as JSON here")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lakeshard-bench-lake")
    args = p.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        options = {v: variant(v) for v in args.variants}
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))

    lake = args.cache / f"{args.images}-640x480"
    paths = jobs_bench.build_lake(lake, args.images, classes=10, size=(640, 480))
    spec = DEFAULT_SPEC
    cores = os.cpu_count() or 1
    pool = jobs_bench.reference_pool(cores, paths[:5], spec)
    engine = open_engine(args.engine, app_name="lakeshard-ab")
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    try:
        out = tempfile.mkdtemp(prefix="lakeshard-ab-")
        manifest_job.run(ManifestConfig(input=str(lake), output=out, seed=0), engine)
        for r in range(args.rounds + 1):
            if r:
                seconds["ceiling"].append(
                    len(paths) / (cores * jobs_bench.single_thread_rate(pool, paths, spec))
                )
                seconds["2 procs"].append(len(paths) / jobs_bench.parallel_rate(pool, paths, spec, cores))
            for v in args.variants:
                t = time.perf_counter()
                shard_job.run(
                    ShardConfig(
                        dataset=out,
                        num_shards=args.num_shards,
                        engine=args.engine,
                        overwrite=True,
                        resume=False,
                        **options[v],
                    ),
                    engine,
                )
                if r:
                    seconds[v].append(time.perf_counter() - t)
    finally:
        engine.close()
        pool.shutdown()
    ceiling = statistics.median(seconds["ceiling"])
    print(f"{'variant':32} {'median s':>9} {'images/s':>9} {'÷ ceiling':>10}  runs")
    for name in ["ceiling", "2 procs", *args.variants]:
        m = statistics.median(seconds[name])
        print(
            f"{name or 'defaults':32} {m:9.3f} {len(paths) / m:9.1f} {ceiling / m:10.2f}  "
            f"{[round(x, 2) for x in seconds[name]]}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "engine": args.engine,
                    "images": len(paths),
                    "seconds": seconds,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
