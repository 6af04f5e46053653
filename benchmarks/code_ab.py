"""A/B: one benchmark, two versions of the code (``--ref``), or several options of the loader
(``--loader``) or of the shard job (``--jobs``), side by side in one run.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "A/B, side by side
in one run" and "Jobs against the machine's limit".
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import json_child, run_checked
from _timing import alternate, parse_variant, ref_checkout, write_json, write_runs

ROOT = Path(__file__).resolve().parents[1]

_USAGE = "usage: code_ab.py --ref REF [--rounds N] --metric PATH ... -- benchmarks/X.py [args]"
#: Rounds when --rounds is not given, by mode.
_ROUNDS = {"ref": 3, "loader": 5, "jobs": 8}

_LOADER_CHILD = r"""
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


# -- --ref: two versions of the code ----------------------------------------------------------------
def _metric(data: Any, path: str) -> float:
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) and key.lstrip("-").isdigit() else data[key]
    return float(statistics.median(data) if isinstance(data, list) else data)


def _run(code: Path, command: list[str], out: Path) -> dict[str, Any]:
    script, *args = command
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, str(code / script), *args, "--out", str(out)]
    run_checked(command, f"{script} in {code}", cwd=code, env={**env, "PYTHONPATH": str(code)})
    return dict(json.loads(out.read_text()))


def code_ab(args: argparse.Namespace, command: list[str]) -> None:
    results: dict[str, list[dict[str, float]]] = {"ref": [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="code-ab-") as tmp:
        with ref_checkout(ROOT, args.ref, Path(tmp) / "ref") as old:
            for r in range(args.rounds):
                for name, code in alternate([("ref", old), ("tree", ROOT)], r):
                    data = _run(code, command, Path(tmp) / f"{name}-{r}.json")
                    results[name].append({m: _metric(data, m) for m in args.metric})
                    print(
                        f"round {r + 1}/{args.rounds} {name}: "
                        + ", ".join(f"{m} {v:.4g}" for m, v in results[name][-1].items()),
                        flush=True,
                    )
    print(f"{'metric':48} {'ref':>10} {'tree':>10} {'tree/ref':>9}")
    for m in args.metric:
        ref = statistics.median(x[m] for x in results["ref"])
        tree = statistics.median(x[m] for x in results["tree"])
        print(f"{m:48} {ref:10.4g} {tree:10.4g} {tree / ref if ref else float('nan'):9.3f}")
    write_json(args.out, {"ref": args.ref, "command": command, "rounds": results})


# -- --loader: ShardLoader options, each in its own processes ---------------------------------------
def loader_variant(text: str) -> tuple[dict[str, object], dict[str, str]]:
    """``"num_threads=2,LAKESHARD_NO_EXTENSIONS=1"`` as ShardLoader keyword arguments and the
    environment variables (the keys in capitals) of the variant's processes."""
    from loaders.options import OPTIONS

    pairs = [p for p in text.split(",") if p]
    env = dict(p.partition("=")[::2] for p in pairs if p.partition("=")[0].isupper())
    options = ",".join(p for p in pairs if not p.partition("=")[0].isupper())
    return parse_variant(options, OPTIONS, "ShardLoader"), env


def loader_ab(args: argparse.Namespace, options: dict[str, Any]) -> None:
    from _data import cached_dataset

    root = cached_dataset(args.cache, images=args.images, size=args.size)
    here = str(ROOT / "benchmarks")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in alternate(args.variants, r):
            kwargs, env = options[v]
            cmd = [sys.executable, "-c", _LOADER_CHILD, str(root), json.dumps(kwargs), here, str(args.epochs)]
            runs[v].append(json_child(cmd, f"variant {v!r}", cwd=ROOT, env={**os.environ, **env}))
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
        rates = [x["rate_later"] for x in rs]
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        later = statistics.median(rates)
        print(f"{v or '(defaults)':30s} {first:22.0f} {later:13.0f} {spread:>13s}  {later / base:.3f}")
    write_runs(args.out, args, runs)


# -- --jobs: shard job options, in turn on one engine -----------------------------------------------
def jobs_variant(text: str) -> dict[str, object]:
    """``"partitions=4,threads=1"`` as ShardConfig keyword arguments."""
    from jobs.shard_steps.config import ShardConfig

    return parse_variant(text, (f.name for f in dataclasses.fields(ShardConfig)), "shard job")


def _preprocess_files(paths: list[Path], spec: Any) -> float:
    """Seconds to preprocess ``paths`` (already read into memory) on one thread."""
    from jobs.common.images import preprocess

    data = [p.read_bytes() for p in paths]
    t = time.perf_counter()
    for d in data:
        preprocess(d, spec)
    return time.perf_counter() - t


#: glibc malloc settings of the reference processes. The reference loop (images preloaded, then
#: preprocessed one after another) page-faults its image buffers in again for every image with
#: glibc's defaults (~110-190 faults per 640x480 JPEG); the job's tasks do not (~1 per image:
#: they read each image just before decoding it, and glibc's adaptive mmap threshold settles).
#: These settings keep the buffers on the heap, which made the reference ~15% faster here: the
#: ceiling is the best one thread can do, not an artefact of how the reference loop allocates.
_REFERENCE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 20)}


class References:
    """The jobs' references, measured in fresh processes (``spawn``, so glibc reads
    :data:`_REFERENCE_MALLOC` at their start), one per core, started and warmed up at once."""

    def __init__(self, paths: list[Path], spec: Any) -> None:
        self.paths, self.spec, self.cores = paths, spec, os.cpu_count() or 1
        saved = dict(os.environ)
        os.environ.update(_REFERENCE_MALLOC)
        try:
            self.pool = ProcessPoolExecutor(self.cores, mp_context=multiprocessing.get_context("spawn"))
            list(self.pool.map(_preprocess_files, [paths[:5]] * self.cores, [spec] * self.cores))
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def single_thread_rate(self) -> float:
        """One process alone preprocessing 200 images on one thread: images/s."""
        return (
            len(self.paths[:200]) / self.pool.submit(_preprocess_files, self.paths[:200], self.spec).result()
        )

    def parallel_rate(self) -> float:
        """What one process per core preprocessing at once really gets from this (shared,
        virtual) machine: 200 images each, started together; images/s over the wall time."""
        slices = [self.paths[(i * 200) % len(self.paths) :][:200] for i in range(self.cores)]
        t = time.perf_counter()
        list(self.pool.map(_preprocess_files, slices, [self.spec] * self.cores))
        return sum(len(s) for s in slices) / (time.perf_counter() - t)


def jobs_ab(args: argparse.Namespace, options: dict[str, Any]) -> None:
    from jobs import manifest as manifest_job
    from jobs import shard as shard_job
    from jobs.common.engines import open_engine
    from jobs.common.images import DEFAULT_SPEC
    from jobs.manifest_steps.config import ManifestConfig
    from jobs.shard_steps.config import ShardConfig

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from _data import photo_lake

    lake = args.cache / f"{args.images}-640x480"
    paths = photo_lake(lake, args.images)
    refs = References(paths, DEFAULT_SPEC)
    t = time.perf_counter()
    engine = open_engine(args.engine, app_name="lakeshard-ab")
    engine_start_s = time.perf_counter() - t
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for r in range(args.rounds + 1):
            if r:
                seconds["ceiling"].append(len(paths) / (refs.cores * refs.single_thread_rate()))
                seconds[f"{refs.cores} procs"].append(len(paths) / refs.parallel_rate())
            out = tempfile.mkdtemp(prefix="lakeshard-ab-")
            t = time.perf_counter()
            # min_per_class=0: a small lake (a test run) may leave a class out of a channel
            manifest_job.run(ManifestConfig(input=str(lake), output=out, seed=r, min_per_class=0), engine)
            if r:
                seconds["manifest job"].append(time.perf_counter() - t)
            for v in args.variants:
                config = ShardConfig(
                    dataset=out,
                    num_shards=args.num_shards,
                    engine=args.engine,
                    overwrite=True,
                    resume=False,
                    **options[v],  # type: ignore[arg-type]
                )
                t = time.perf_counter()
                shard_job.run(config, engine)
                if r:
                    seconds[v].append(time.perf_counter() - t)
    finally:
        engine.close()
        refs.pool.shutdown()
    ceiling = statistics.median(seconds["ceiling"])
    print(f"engine start {engine_start_s:.1f} s; {len(paths)} images of 640x480, {refs.cores} cores")
    print(f"{'variant':32} {'median s':>9} {'images/s':>9} {'÷ ceiling':>10}  runs")
    for name in seconds:
        m = statistics.median(seconds[name])
        rounded = [round(x, 2) for x in seconds[name]]
        print(f"{name or 'defaults':32} {m:9.3f} {len(paths) / m:9.1f} {ceiling / m:10.2f}  {rounded}")
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "images": len(paths),
        "engine_start_s": engine_start_s,
        "seconds": seconds,
    }
    write_json(args.out, doc)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ref", help="the git ref to compare the working tree with (the benchmark after --)")
    mode.add_argument("--loader", action="store_true", help="ShardLoader options side by side")
    mode.add_argument("--jobs", action="store_true", help="shard job options side by side")
    p.add_argument(
        "variants", nargs="*", default=[""], help='--loader, --jobs: option=value,... ("" for the defaults)'
    )
    p.add_argument(
        "--rounds", type=int, help="rounds (default: --ref 3, --loader 5, --jobs 8 after a warm-up)"
    )
    p.add_argument(
        "--metric", action="append", default=[], help="--ref: a dotted path into the benchmark's JSON"
    )
    p.add_argument("--out", type=Path, help="write every round as JSON here")
    p.add_argument("--images", type=int, default=2000, help="--loader, --jobs: images (default: 2000)")
    p.add_argument("--size", type=int, default=224, help="--loader: image side in pixels (default: 224)")
    p.add_argument(
        "--epochs", type=int, default=8, help="--loader: epochs per process, the first apart (default: 8)"
    )
    p.add_argument("--engine", choices=["spark", "dask"], default="spark", help="--jobs: the engine")
    p.add_argument("--num-shards", type=int, default=4, help="--jobs: shards (default: 4)")
    p.add_argument("--cache", type=Path, help="--loader, --jobs: where the dataset or lake is kept")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = _parser()
    args = p.parse_args(argv[:cut])
    args.mode = "ref" if args.ref else "loader" if args.loader else "jobs"
    args.rounds = _ROUNDS[args.mode] if args.rounds is None else args.rounds
    tmp = Path(tempfile.gettempdir())
    args.cache = args.cache or tmp / ("lakeshard-loader-ab" if args.loader else "lakeshard-bench-lake")
    if args.ref:
        if cut == len(argv) or not args.metric or args.variants != [""]:
            raise SystemExit(_USAGE)
        code_ab(args, argv[cut + 1 :])
        return 0
    if args.loader and args.epochs < 2:
        p.error(f"--epochs must be at least 2 (the first is counted apart), got {args.epochs}")
    try:
        options = {v: (loader_variant if args.loader else jobs_variant)(v) for v in args.variants}
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if args.loader:
        loader_ab(args, options)
    else:
        jobs_ab(args, options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
