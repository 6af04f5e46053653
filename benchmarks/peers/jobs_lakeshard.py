"""Our rows of the jobs benchmark (``jobs_run.py``), in this project's environment: the two jobs on
an engine, and the ceiling.

```
python benchmarks/peers/jobs_lakeshard.py build --engine local --lake L --out O --size 224 --quality 90 --workers 2
python benchmarks/peers/jobs_lakeshard.py stored --out O
```

* ``--engine local|dask|spark``: ``python -m jobs.build`` (both jobs in one command, on one
  engine: the whole lake into ``train``, one shard), as the README runs it, each engine started
  as the command starts it: Spark ``local[workers]`` (``PYSPARK_SUBMIT_ARGS``), Dask its own
  ``LocalCluster`` (a worker process per core), local its threads and, for preprocessing, a
  worker process per core. The steady state is the shard job's preprocessing pass, from its
  log: from its ``preprocessing N images`` line to the next line.
* ``--engine ceiling``: the shard job's own per-image function
  (``jobs.common.images.preprocess``) on every image of the lake in a ``multiprocessing.Pool`` of
  ``workers``, each reading its files, writing nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from build_cli import add_build_commands, lake_images, run_build_command  # noqa: E402

ENGINES = ("local", "dask", "spark", "ceiling")
#: A line of the jobs' log: its time (the logging module's default format), then the message.
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")


# -- the ceiling -------------------------------------------------------------------------------------
def _preprocessed(job: tuple[str, int, int]) -> float:
    from jobs.common.images import DEFAULT_SPEC, ImageSpec, preprocess

    path, size, quality = job
    spec = ImageSpec(size, "jpeg", quality, "crop", DEFAULT_SPEC.max_pixels)
    preprocess(Path(path).read_bytes(), spec)
    return time.time()


def ceiling(lake: Path, *, size: int, quality: int, workers: int) -> dict[str, Any]:
    jobs = [(str(path), size, quality) for path, _ in lake_images(lake)]
    with multiprocessing.Pool(workers) as pool:
        done = list(pool.imap_unordered(_preprocessed, jobs, chunksize=8))
    return {"images": len(done), "first_done": min(done, default=None), "last_done": max(done, default=None)}


# -- the jobs ------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return env


def _run_job(cmd: list[str], env: dict[str, str]) -> list[str]:
    """Run one job, its output passed on to our standard error; its lines."""
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed with exit code {proc.returncode}")
    return proc.stdout.splitlines()


def preprocessing_span(lines: list[str]) -> tuple[float, float] | None:
    """``time.time()`` of the shard job's ``preprocessing N images`` line and of its next log line."""
    stamped = [(m.group(1), m.group(2)) for m in map(_LOG_LINE.match, lines) if m]
    for i, (_, message) in enumerate(stamped[:-1]):
        if message.startswith("preprocessing "):
            when = [
                datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                for t, _ in stamped[i : i + 2]
            ]
            return when[0], when[1]
    return None


def jobs(lake: Path, out: Path, *, engine: str, size: int, quality: int, workers: int) -> dict[str, Any]:
    env = _env()
    if engine == "spark":
        env["PYSPARK_SUBMIT_ARGS"] = f"--master local[{workers}] pyspark-shell"
    options = ["--input", str(lake), "--output", str(out), "--split", "train=1"]
    options += ["--image-size", str(size), "--quality", str(quality), "--engine", engine]
    span = preprocessing_span(_run_job([sys.executable, "-m", "jobs.build", *options], env))
    rows = json.loads((out / "dataset.json").read_text())["channels"]["train"]["rows"]
    return {"images": rows, "first_done": span and span[0], "last_done": span and span[1]}


def stored(out: Path) -> Iterator[tuple[int, bytes]]:
    import pyarrow.parquet as pq

    for shard in sorted((out / "shards").rglob("*.parquet")):
        table = pq.read_table(shard, columns=["label", "image"])
        yield from zip(table["label"].to_pylist(), table["image"].to_pylist(), strict=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=ENGINES, default="local", help="an engine, or the ceiling")
    add_build_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)

    def build(lake: Path, out: Path, *, size: int, quality: int, workers: int) -> dict[str, Any]:
        if args.engine == "ceiling":
            return ceiling(lake, size=size, quality=quality, workers=workers)
        return jobs(lake, out, engine=args.engine, size=size, quality=quality, workers=workers)

    return run_build_command(args, build, stored)


if __name__ == "__main__":
    sys.exit(main())
