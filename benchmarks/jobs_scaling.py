"""How the manifest and shard jobs scale with the number of objects, per engine.

    python benchmarks/jobs_scaling.py --sizes 1000 10000 --engines spark dask
    python benchmarks/jobs_scaling.py --sizes 100000 --engines dask --out benchmarks/results/dask-100k.json

Builds (once, in ``--cache-dir``) local lakes of N tiny PNGs spread over ``--classes``
classes, then for each engine starts it once (timed apart: Spark's JVM, Dask's LocalCluster)
and runs the manifest job and the shard job on every lake, in this process, through the same
``run(cfg, engine)`` the command lines call. Prints a table and writes JSON: wall seconds,
objects per second and milliseconds per object for each step.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# A plain checkout runs this file directly: import the package from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.engines import open_engine
from jobs.settings import ManifestConfig, ShardConfig


def _write_range(root: str, classes: int, start: int, stop: int, side: int) -> None:
    rng = np.random.default_rng(start)
    for i in range(start, stop):
        label = f"class_{i % classes:03d}"
        folder = Path(root) / label / f"batch{(i // classes) % 16:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
        (folder / f"img_{i:08d}.png").write_bytes(buf.getvalue())


def build_lake(cache: Path, n: int, *, classes: int, side: int) -> Path:
    """The lake of ``n`` objects in ``cache`` (built once; a ``.complete`` marker says it is whole)."""
    root = cache / f"lake-{n}-c{classes}-{side}px"
    if (root / ".complete").exists():
        return root / "raw"
    shutil.rmtree(root, ignore_errors=True)
    step = max(1, n // (4 * (os.cpu_count() or 1)))
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_range, *zip(*[(str(root / "raw"), classes, a, min(n, a + step), side)
                                           for a in range(0, n, step)], strict=True)))
    (root / ".complete").touch()
    return root / "raw"


def run_engine(name: str, lakes: dict[int, Path], work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    options: dict[str, Any] = {"app_name": "lakeshard-bench"}
    if name == "spark":
        options["master"] = args.spark_master
    else:
        options.update(scheduler=args.scheduler, threads_per_worker=args.dask_threads_per_worker)
    engine = open_engine(name, **options)
    startup = time.perf_counter() - t0
    results = []
    try:
        for n, lake in lakes.items():
            out = work / f"{name}-{n}"
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            manifest_job.run(ManifestConfig(input=str(lake), output=str(out), engine=name, seed=0,
                                            split_method="stratified"), engine)
            t_manifest = time.perf_counter() - t
            t = time.perf_counter()
            info = shard_job.run(ShardConfig(dataset=str(out), engine=name, num_shards=args.num_shards,
                                             image_size=args.image_size, threads=args.threads), engine)
            t_shard = time.perf_counter() - t
            rows = sum(c.rows for c in info.channels.values())
            results.append({"engine": name, "objects": n, "startup_s": round(startup, 2),
                            "manifest_s": round(t_manifest, 2), "shard_s": round(t_shard, 2),
                            "manifest_ms_per_object": round(1000 * t_manifest / n, 3),
                            "shard_ms_per_object": round(1000 * t_shard / n, 3),
                            "objects_per_s": round(n / (t_manifest + t_shard), 1), "shard_rows": rows,
                            "parallelism": engine.parallelism})
            print(f"  {name} {n}: manifest {t_manifest:.1f} s, shard {t_shard:.1f} s", flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        engine.close()
    return results


def table(results: list[dict[str, Any]]) -> str:
    head = ("engine", "objects", "startup_s", "manifest_s", "shard_s", "manifest_ms_per_object",
            "shard_ms_per_object", "objects_per_s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000], help="objects per lake")
    p.add_argument("--engines", nargs="+", default=["spark", "dask"], choices=["spark", "dask"])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--side", type=int, default=32, help="side of the raw PNGs, in pixels")
    p.add_argument("--image-size", type=int, default=32, help="side of the shard images")
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--threads", type=int, default=4, help="decode threads per preprocessing task")
    p.add_argument("--spark-master", default="local[2]")
    p.add_argument("--scheduler", default=None, help="dask scheduler address (default: a LocalCluster)")
    p.add_argument("--dask-threads-per-worker", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=Path("benchmarks/results/lakes"))
    p.add_argument("--work-dir", type=Path, default=Path("benchmarks/results/work"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/jobs_scaling.json"))
    p.add_argument("--keep", action="store_true", help="keep the datasets written")
    args = p.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    lakes = {}
    for n in args.sizes:
        t = time.perf_counter()
        lakes[n] = build_lake(args.cache_dir, n, classes=args.classes, side=args.side)
        print(f"lake of {n} objects ready in {time.perf_counter() - t:.1f} s: {lakes[n]}", flush=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = [r for name in args.engines for r in run_engine(name, lakes, args.work_dir, args)]
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv[1:], "cpus": os.cpu_count(), "python": platform.python_version(),
                                    "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
