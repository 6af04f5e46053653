"""Reader throughput on the same shards: our ShardLoader (main env) vs petastorm (.venv-petastorm).

```
.venv/bin/python benchmarks/petastorm_bench.py --images 2000 --size 224 --repeats 5 --out petastorm_bench.json
.venv/bin/python benchmarks/petastorm_bench.py --dataset ./datasets/pets-v1 --channel train
```

The orchestrator (run it with the main environment's Python) builds a dataset with our jobs
unless ``--dataset`` is given (a synthetic JPEG lake -> ``jobs.manifest`` -> ``jobs.shard``, dask
engine, one shard), then runs one worker subprocess per environment; each reads the whole
channel ``--repeats`` times after one warm-up pass, decoding every image to ``uint8``, and prints
its samples as JSON. Measured (median images/s, and the first batch's latency):

* ``shardloader``: :class:`loaders.ShardLoader` with its default decoder (``auto``: simplejpeg for
  JPEG, which both environments have), ``--threads`` decode threads, prefetch 4;
* ``petastorm_reader``: ``petastorm.make_batch_reader`` (thread pool of ``--threads`` workers)
  with :func:`loaders.petastorm_compat.make_transform_spec`, the same ``auto`` decoder;
* ``shardloader_pillow`` / ``petastorm_reader_pillow``: both with ``decoder="pillow"``;
* ``petastorm_dataloader``: ``petastorm_reader`` wrapped in ``petastorm.pytorch.DataLoader``
  (CHW, batches of ``--batch-size``).

ShardLoader is built once and iterated per pass (as a training loop does per epoch); a petastorm
reader with ``num_epochs=1`` is built per pass, so its start-up counts in its time, as it would
in a training loop that re-creates it each epoch.

Target (reported, not asserted): shardloader >= 3 x petastorm_reader (same decoder).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _timing import write_json  # noqa: E402

log = logging.getLogger("petastorm_bench")

#: worker -> the environment it runs in
WORKERS = {
    "shardloader": "main",
    "shardloader_pillow": "main",
    "petastorm_reader": "petastorm",
    "petastorm_reader_pillow": "petastorm",
    "petastorm_dataloader": "petastorm",
}


# -- workers (each runs in its own environment and prints one JSON object) ---------------------------
def _time_passes(one_pass, repeats: int) -> dict[str, Any]:
    one_pass()  # warm-up: page cache, imports, thread pools
    rates, firsts, images = [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        images, first = one_pass()
        elapsed = time.perf_counter() - start
        rates.append(images / elapsed)
        firsts.append(first - start)
    return {"images": images, "images_per_s": rates, "first_batch_s": firsts}


def _worker_shardloader(
    dataset: str, channel: str, threads: int, batch_size: int, decoder: str, repeats: int
) -> dict[str, Any]:
    from loaders import ShardLoader

    loader = ShardLoader(
        dataset,
        channel=channel,
        batch_size=batch_size,
        num_threads=threads,
        prefetch=4,
        decoder=decoder,
        remainder="drop",
    )

    def one_pass() -> tuple[int, float]:
        n, first = 0, 0.0
        for _images, labels in loader:
            first = first or time.perf_counter()
            n += int((labels >= 0).sum())  # padding rows (PAD_LABEL) do not count
        return n, first

    return _time_passes(one_pass, repeats)


def _worker_petastorm(
    dataset: str, channel: str, threads: int, batch_size: int, decoder: str, dataloader: bool, repeats: int
) -> dict[str, Any]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import DataLoader

    from lakeshard import storage
    from lakeshard.format import channel_shards, read_dataset_info
    from loaders.petastorm_compat import make_transform_spec

    root = storage.normalize(dataset)
    info = read_dataset_info(root)
    urls = [uri for uri, _ in channel_shards(root, info, channel)]
    spec = make_transform_spec(info.image.size, layout="chw" if dataloader else "hwc", decoder=decoder)

    def one_pass() -> tuple[int, float]:
        n, first = 0, 0.0
        with make_batch_reader(
            urls, transform_spec=spec, num_epochs=1, reader_pool_type="thread", workers_count=threads
        ) as reader:
            batches = DataLoader(reader, batch_size=batch_size) if dataloader else reader
            for batch in batches:
                first = first or time.perf_counter()
                n += len(batch["label"]) if dataloader else len(batch.label)
        return n, first

    return _time_passes(one_pass, repeats)


def run_worker(args: argparse.Namespace) -> None:
    if args.worker == "shardloader":
        result = _worker_shardloader(
            args.dataset, args.channel, args.threads, args.batch_size, "auto", args.repeats
        )
    elif args.worker == "shardloader_pillow":
        result = _worker_shardloader(
            args.dataset, args.channel, args.threads, args.batch_size, "pillow", args.repeats
        )
    else:
        decoder = "pillow" if args.worker.endswith("_pillow") else "auto"
        result = _worker_petastorm(
            args.dataset,
            args.channel,
            args.threads,
            args.batch_size,
            decoder,
            args.worker == "petastorm_dataloader",
            args.repeats,
        )
    import numpy
    import pyarrow

    result["env"] = {"python": sys.executable, "pyarrow": pyarrow.__version__, "numpy": numpy.__version__}
    print(json.dumps(result))


# -- orchestrator ------------------------------------------------------------------------------------
def _run(cmd: list[str], *, timeout: float = 1800) -> str:
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"petastorm_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def build_dataset(
    root: Path, *, python: str, images: int, size: int, quality: int, classes: int = 10
) -> Path:
    """A synthetic JPEG lake -> our manifest and shard jobs (dask engine, one shard per channel)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    lake = root / "raw"
    for i in range(images):
        coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
        field = np.asarray(
            Image.fromarray(coarse).resize((size + 32, size + 32), Image.BICUBIC), dtype=np.float32
        )
        noise = rng.normal(0, 6, size=field.shape).astype(np.float32)
        path = lake / f"class{i % classes}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(field + noise, 0, 255).astype(np.uint8)).save(path, quality=quality)
    out = root / "ds"
    _run(
        [
            python,
            "-m",
            "jobs.manifest",
            "--input",
            str(lake),
            "--output",
            str(out),
            "--seed",
            "1",
            "--engine",
            "dask",
        ]
    )
    _run(
        [
            python,
            "-m",
            "jobs.shard",
            "--dataset",
            str(out),
            "--num-shards",
            "1",
            "--image-size",
            str(size),
            "--image-format",
            "jpeg",
            "--quality",
            str(quality),
            "--engine",
            "dask",
        ]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="ShardLoader vs petastorm's reader on the same shards (images/s)."
    )
    p.add_argument(
        "--dataset", help="an existing dataset root (local path); default: build one with our jobs"
    )
    p.add_argument("--channel", default="train", help="channel to read (default: train)")
    p.add_argument("--images", type=int, default=2000, help="images in the synthetic lake (default: 2000)")
    p.add_argument("--size", type=int, default=224, help="image size of the synthetic dataset (default: 224)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default: 90)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 2, help="decode threads / petastorm workers"
    )
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed passes per worker, after one warm-up (default: 5)"
    )
    p.add_argument(
        "--main-python", default=str(REPO / ".venv" / "bin" / "python"), help="the main environment's Python"
    )
    p.add_argument(
        "--petastorm-python",
        default=str(REPO / ".venv-petastorm" / "bin" / "python"),
        help="the petastorm environment's Python (scripts/setup_petastorm.sh)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    pythons = {"main": args.main_python, "petastorm": args.petastorm_python}
    for env, python in pythons.items():
        if not os.access(python, os.X_OK):
            raise SystemExit(
                f"petastorm_bench: the {env} environment's Python {python} is missing "
                f"(scripts/setup.sh, scripts/setup_petastorm.sh)"
            )

    with tempfile.TemporaryDirectory(prefix="petastorm-bench-") as tmp:
        if args.dataset:
            dataset = Path(args.dataset).resolve()
        else:
            log.info("building a dataset of %d %dpx JPEGs with our jobs", args.images, args.size)
            dataset = build_dataset(
                Path(tmp), python=pythons["main"], images=args.images, size=args.size, quality=args.quality
            )
        results: dict[str, Any] = {}
        for worker, env in WORKERS.items():
            log.info("%s (%s env, %d threads, %d repeats)", worker, env, args.threads, args.repeats)
            out = _run(
                [
                    pythons[env],
                    str(Path(__file__).resolve()),
                    "--worker",
                    worker,
                    "--dataset",
                    str(dataset),
                    "--channel",
                    args.channel,
                    "--threads",
                    str(args.threads),
                    "--batch-size",
                    str(args.batch_size),
                    "--repeats",
                    str(args.repeats),
                ]
            )
            sample = json.loads(out.strip().splitlines()[-1])
            sample["median_images_per_s"] = statistics.median(sample["images_per_s"])
            sample["median_first_batch_ms"] = 1000 * statistics.median(sample["first_batch_s"])
            results[worker] = sample

    counts = {w: r["images"] for w, r in results.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"petastorm_bench: the workers read different numbers of images: {counts}")
    base = results["petastorm_reader"]["median_images_per_s"]
    print(
        f"{'worker':<24} {'env':<10} {'images/s (median)':>18} {'min':>8} {'max':>8} {'first batch ms':>15} {'× petastorm_reader':>19}"
    )
    for worker, r in results.items():
        rates = r["images_per_s"]
        print(
            f"{worker:<24} {WORKERS[worker]:<10} {r['median_images_per_s']:>18.0f} {min(rates):>8.0f} {max(rates):>8.0f} "
            f"{r['median_first_batch_ms']:>15.1f} {r['median_images_per_s'] / base:>19.2f}"
        )
    ratio = results["shardloader"]["median_images_per_s"] / base
    ratio_pillow = (
        results["shardloader_pillow"]["median_images_per_s"]
        / results["petastorm_reader_pillow"]["median_images_per_s"]
    )
    print(
        f"images per pass: {counts['shardloader']}; threads {args.threads}; shardloader / petastorm_reader = "
        f"{ratio:.2f} (target >= 3); with Pillow on both sides: {ratio_pillow:.2f}"
    )
    write_json(
        args.out,
        {
            "args": {k: v for k, v in vars(args).items() if k != "worker"},
            "results": results,
            "ratio_vs_petastorm_reader": ratio,
            "ratio_pillow": ratio_pillow,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
