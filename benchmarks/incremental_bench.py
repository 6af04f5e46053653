"""Incremental builds (issue 23): the time of rebuilding a lake grown by 10% on its last dataset
(``--base``), divided by the time of building the grown lake from scratch, on each engine.

How to run it, what it measures and what it prints: ``benchmarks/README.md``, "Incremental builds".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import names, work_folder
from _data import photo_jpeg, photo_lake
from _timing import alternate, write_json
from remote_bench import PROFILES
from remote_store import RemoteStore, parse_rate

from jobs import manifest as manifest_job
from jobs import shard as shard_job
from jobs.common.engines import ENGINE_NAMES, open_engine, split_parts
from jobs.manifest_steps.config import ManifestConfig
from jobs.shard_steps.config import ShardConfig

_REMOVED = 5


def link_lake(root: Path, files: list[Path], cache: Path) -> None:
    """A lake of hard links to ``files`` (same layout as the cache)."""
    shutil.rmtree(root, ignore_errors=True)
    for f in files:
        dst = root / f.relative_to(cache)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, dst)


@dataclasses.dataclass(frozen=True)
class Lake:
    """One lake folder in two versions: version 1 (``n`` photos), and version 2 (10% more, 5
    removed, one rewritten), which :meth:`grow` makes of version 1 in place: the objects that
    stay keep their URIs (and ETags)."""

    root: Path
    cache: Path
    files: tuple[Path, ...]  # every photo of version 2's, version 1's first
    n: int

    @classmethod
    def make(cls, cache: Path, root: Path, n: int) -> Lake:
        return cls(root=root, cache=cache, files=tuple(photo_lake(cache, n + max(1, n // 10))), n=n)

    @property
    def removed(self) -> set[int]:
        return {
            7 + k * (self.n // _REMOVED) for k in range(_REMOVED)
        }  # spread over version 1, never object 3

    def reset(self) -> None:
        """Version 1."""
        link_lake(self.root, list(self.files[: self.n]), self.cache)

    def grow(self) -> None:
        """Version 1 becomes version 2."""
        for f in self.files[self.n :]:
            dst = self.root / f.relative_to(self.cache)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst)
        for i in self.removed:
            (self.root / self.files[i].relative_to(self.cache)).unlink()
        changed = self.root / self.files[3].relative_to(self.cache)
        changed.unlink()  # a file of its own: the cache keeps the old bytes
        changed.write_bytes(photo_jpeg(10_000_000))

    def describe(self) -> dict[str, Any]:
        sizes = [f.stat().st_size for f in self.files]
        return {
            "root": str(self.root),
            "v1_objects": self.n,
            "v2_objects": len(self.files) - len(self.removed),
            "added": len(self.files) - self.n,
            "removed": len(self.removed),
            "changed": 1,
            "jpeg_kb_median": statistics.median(sizes) / 1024,
            "jpeg_kb_min": min(sizes) / 1024,
            "jpeg_kb_max": max(sizes) / 1024,
        }


def manifest_takes_base() -> bool:
    """Whether the manifest job has ``--base`` (its ``--help`` lists it)."""
    fields = {f.name for f in dataclasses.fields(ManifestConfig)}
    return "base" in fields and "--base" in manifest_job.parser().format_help()


class TimedActions:
    """An engine whose actions (``map_partitions`` calls) are timed on the driver: ``actions``
    holds ``(task function, engine tasks, seconds)`` of each since the last :meth:`take`."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.actions = engine, []
        self.name = engine.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def map_partitions(self, fn: Any, items: Any, *, partitions: int, cpu_bound: bool = False) -> list[Any]:
        inner = getattr(fn, "fn", getattr(fn, "func", fn))  # jobs.common.tasks.each, functools.partial
        t = time.perf_counter()
        out = self.engine.map_partitions(fn, items, partitions=partitions, cpu_bound=cpu_bound)
        name, tasks = getattr(inner, "__name__", repr(inner)), len(split_parts(items, partitions))
        self.actions.append((name, tasks, time.perf_counter() - t))
        return out

    def take(self) -> list[tuple[str, int, float]]:
        taken, self.actions = self.actions, []
        return taken


def build(engine: Any, lake: str, out: str, *, base: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The manifest job, then the shard job, each timed around its ``run`` (engine running);
    with a :class:`TimedActions` engine, each action too."""
    shutil.rmtree(out, ignore_errors=True)
    extra = {"base": base} if base is not None and manifest_takes_base() else {}
    t = time.perf_counter()
    manifest_job.run(
        ManifestConfig(input=lake, output=out, engine=engine.name, split=args.split, **extra), engine
    )
    manifest_s = time.perf_counter() - t
    t = time.perf_counter()
    info = shard_job.run(
        ShardConfig(dataset=out, num_shards=args.num_shards, engine=engine.name, base=base), engine
    )
    shard_s = time.perf_counter() - t
    actions = engine.take() if isinstance(engine, TimedActions) else None
    return {
        "manifest_s": manifest_s,
        "shard_s": shard_s,
        "total_s": manifest_s + shard_s,
        "actions": actions,
        "decoded": info.build.preprocessed,
        "reused": info.build.reused,
        "dropped": info.counts.dropped,
        "version": info.dataset_version,
    }


def bench_engine(
    name: str, lake: Lake, work: Path, args: argparse.Namespace, *, lake_uri: str, kinds: tuple[str, ...]
) -> dict[str, Any]:
    """The builds of ``kinds`` on engine ``name``, ``args.repeats`` times each, alternating."""
    t = time.perf_counter()
    engine = open_engine(name, app_name="lakeshard-incremental-bench")
    start_s = time.perf_counter() - t
    if args.actions:
        engine = TimedActions(engine)
    try:
        base = str(work / f"{name}-a")
        lake.reset()
        first = build(engine, lake_uri, base, base=None, args=args)
        lake.grow()
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        for r in range(args.repeats):
            for kind in alternate(list(kinds), r):
                run = build(
                    engine,
                    lake_uri,
                    str(work / f"{name}-{kind}"),
                    base=base if kind == "incremental" else None,
                    args=args,
                )
                runs[kind].append(run)
                print(
                    f"{name} {kind} #{r + 1}: {run['total_s']:.1f} s (manifest {run['manifest_s']:.1f} s, "
                    f"shard {run['shard_s']:.1f} s; {run['decoded']} decoded, {run['reused']} reused)",
                    flush=True,
                )
    finally:
        engine.close()
    versions = {run["version"] for kind in runs.values() for run in kind}
    if len(versions) != 1:
        raise SystemExit(f"{name}: the scratch and incremental builds made different datasets: {versions}")
    med = {
        kind: {k: statistics.median(run[k] for run in rs) for k in ("manifest_s", "shard_s", "total_s")}
        for kind, rs in runs.items()
    }
    both = len(med) == 2
    return {
        "engine": name,
        "start_s": start_s,
        "base_build": first,
        "runs": runs,
        "median": med,
        "ratio": med["incremental"]["total_s"] / med["scratch"]["total_s"] if both else None,
        "shard_ratio": med["incremental"]["shard_s"] / med["scratch"]["shard_s"] if both else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=5000, help="objects in version 1 of the lake")
    p.add_argument(
        "--engine", type=names(ENGINE_NAMES, "engines"), default="spark,dask", help="comma-separated engines"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--actions",
        action="store_true",
        help="also time each engine action of each build on the driver (in the JSON, and their medians printed)",
    )
    p.add_argument(
        "--only",
        choices=["scratch", "incremental"],
        default=None,
        help="time only this kind of build (to compare two versions of the code on a busy machine)",
    )
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--split", default="train=0.8,validation=0.1,test=0.1", help="the manifest job's --split")
    p.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "lakeshard-incremental-cache"),
        help="where the generated photos are kept between runs",
    )
    p.add_argument(
        "--work", default=None, help="where lakes and datasets are written (default: a temporary folder)"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--store",
        choices=["local", *PROFILES],
        default="local",
        help="where the lake is read from: local disk, or a remote-like S3 store on 127.0.0.1 "
        "(nginx behind a latency shim, benchmarks/remote_store.py) with remote_bench.py's "
        "near (20 ms, 80 MB/s a connection) or far (100 ms, 25 MB/s) profile; the datasets "
        "are written to local disk either way",
    )
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    cache = Path(args.cache)
    t = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(work_folder(args.work))
        lake = Lake.make(cache, work / "store" / "lake", args.images)  # the store serves only store/
        lakes = lake.describe()
        print(f"photos ready in {time.perf_counter() - t:.0f} s: {lakes}", flush=True)
        lake_uri = str(lake.root)
        if args.store != "local":  # before any engine starts: its workers inherit the environment
            latency, rate = PROFILES[args.store]
            (work / "store").mkdir(parents=True, exist_ok=True)
            store = stack.enter_context(
                RemoteStore(work / "store", latency_ms=latency, bandwidth=parse_rate(rate))
            )
            os.environ.update(store.environ())
            lake_uri = store.uri("lake")
        kinds = (args.only,) if args.only else ("scratch", "incremental")
        results = [bench_engine(e, lake, work, args, lake_uri=lake_uri, kinds=kinds) for e in args.engine]
    out = {
        "command": " ".join(["python", "benchmarks/incremental_bench.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "lake": lakes,
        "store": args.store,
        "manifest_base": manifest_takes_base(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "engines": results,
    }
    print(
        f"{'engine':8} {'scratch s':>10} {'incr. s':>8} {'ratio':>6} {'shard ratio':>11} {'decoded':>8} {'reused':>7}"
    )
    for r in results:
        last = r["runs"][kinds[-1]][0]
        total = {
            kind: f"{r['median'][kind]['total_s']:.2f}" if kind in r["median"] else "-"
            for kind in ("scratch", "incremental")
        }
        ratio = {k: f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("ratio", "shard_ratio")}
        print(
            f"{r['engine']:8} {total['scratch']:>10} {total['incremental']:>8} {ratio['ratio']:>6} "
            f"{ratio['shard_ratio']:>11} {last['decoded']:8d} {last['reused']:7d}"
        )
    if args.actions:
        for r in results:
            for kind, runs in r["runs"].items():
                steps = zip(*(run["actions"] for run in runs), strict=True)  # the same actions in every build
                print(
                    f"{r['engine']} {kind}: "
                    + ", ".join(
                        f"{s[0][0]} ({s[0][1]} tasks) {statistics.median(a[2] for a in s):.3f} s"
                        for s in steps
                    )
                )
    print(f"load average before {load_before}, after {out['load_after']}")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
